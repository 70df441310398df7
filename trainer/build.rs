//! Builds the allocator-statistics shim against the libtorch that torch-sys found, and
//! makes every binary that links us find libtorch (and its CUDA half) at run time.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/alloc_shim.cpp");
    println!("cargo:rerun-if-changed=shim/compute_shim.cpp");
    // torch-sys (links = "tch") publishes the lib dir it linked against; reading it keeps
    // our shim and tch on the very same libtorch, whichever way it was provisioned.
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report its libtorch lib dir; run through ./dev"),
    );
    let root = lib
        .parent()
        .expect("libtorch lib dir has a parent")
        .to_path_buf();
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("GLOG_USE_GLOG_EXPORT", None)
        .warnings(false)
        .file("shim/alloc_shim.cpp")
        .file("shim/compute_shim.cpp")
        .compile("headroom_alloc_shim");

    // Downstream build scripts read these as DEP_HEADROOM_SHIM_*; link args do not
    // propagate from a library, so each package that links a binary emits its own.
    println!("cargo:libtorch_lib={}", lib.display());
    for arg in link_args(&lib) {
        println!("cargo:rustc-link-arg={arg}");
    }
}

/// rpath to libtorch, and libtorch_cuda forced in: rustc links with --as-needed, which
/// drops libtorch_cuda (nothing references it by symbol) and leaves CUDA "unavailable"
/// on a GPU machine. (The `-as-needed` link-lib modifier would propagate, but is
/// nightly-only.) Keep in step with the copy in ../build.rs.
fn link_args(lib: &std::path::Path) -> Vec<String> {
    let mut args = vec![format!("-Wl,-rpath,{}", lib.display())];
    if lib.join("libtorch_cuda.so").exists() {
        args.push("-Wl,--no-as-needed,-ltorch_cuda,--as-needed".into());
    }
    args
}
