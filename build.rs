//! Gives the headroom binary (and its integration tests) an rpath to libtorch, so it
//! starts without LD_LIBRARY_PATH.
fn main() {
    if let Ok(lib) = std::env::var("DEP_HEADROOM_SHIM_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
