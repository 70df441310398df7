//! headroom's trainer: a byte-level GPT trained with libtorch through tch, on a thread
//! of its own that owns every tensor.
pub mod alloc_stats;
