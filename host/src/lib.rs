//! What a training process does on its host besides training, whatever trains: the
//! built-in libtorch trainer or a Python loop through the `headroom` package.
//!
//! No libtorch here: the Python extension links this crate beside the user's own torch.
pub mod conn;
pub mod log_thinning;
pub mod logger;
pub mod out;
pub mod own_heap;
pub mod procmem;
pub mod rundir;
pub mod sampler;
pub mod server;
pub mod session;
