//! headroom's trainer: a byte-level GPT trained with libtorch through tch, on a thread
//! of its own that owns every tensor.
pub mod alloc_stats;
pub mod checkpoint;
pub mod compute;
pub mod data;
pub mod device;
pub mod digest;
pub mod heap_watch;
/// The controller's journal lives in core (the Python package replays it too).
pub use headroom_core::journal;
pub mod model;
pub mod oom;
pub mod optim;
pub mod peak;
pub mod pickle;
pub mod plan_probe;
pub mod runner;
pub mod schedule;
pub mod snapshot;
pub mod step;
pub mod stop;
