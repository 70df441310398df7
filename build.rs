//! Gives the headroom binary (and its integration tests) an rpath to libtorch, so it
//! starts without LD_LIBRARY_PATH, and keeps libtorch_cuda linked so CUDA is usable.
//! The lib dir comes from headroom-trainer's build script (links = "headroom_shim").
fn main() {
    let Ok(lib) = std::env::var("DEP_HEADROOM_SHIM_LIBTORCH_LIB") else {
        return;
    };
    let lib = std::path::Path::new(&lib);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // rustc's --as-needed would drop libtorch_cuda; see trainer/build.rs.
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
