//! Builds the allocator-statistics shim against the libtorch that torch-sys found, and
//! makes every binary that links us find libtorch (and its CUDA half) at run time.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/alloc_shim.cpp");
    // torch-sys (links = "tch") publishes the lib dir it linked against; reading it keeps
    // our shim and tch on the very same libtorch, whichever way it was provisioned.
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report its libtorch lib dir; run through ./dev"),
    );
    let root = lib.parent().expect("libtorch lib dir has a parent").to_path_buf();
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
        .compile("headroom_alloc_shim");

    // rustc links with --as-needed, which drops libtorch_cuda (nothing references it by
    // symbol) and leaves CUDA "unavailable" on a GPU machine. The -as-needed modifier on a
    // link-lib propagates to every binary downstream, unlike rustc-link-arg.
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-lib=dylib:-as-needed=torch_cuda");
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Downstream build scripts read this as DEP_HEADROOM_SHIM_LIBTORCH_LIB for their rpath.
    println!("cargo:libtorch_lib={}", lib.display());
}
