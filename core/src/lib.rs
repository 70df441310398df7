//! What headroom's threads say to each other, and the configuration they share.
//!
//! This crate has no libtorch: the UI and (later) the memory policy build and test in
//! seconds against it, and the UI never links torch.
pub mod bus;
pub mod command;
pub mod config;
pub mod hints;
pub mod journal;
pub mod logfile;
pub mod plan;
pub mod policy;
pub mod protocol;
pub mod record;
pub mod segments;
pub mod telemetry;
pub mod units;

pub use bus::{Bus, BusReceivers, SinkLosses};
pub use command::Command;
pub use config::{Checkpointing, ConfigError, DeviceChoice, OnUserSignal, Precision, RunConfig};
pub use hints::{Hint, HintEngine, HintKind, MemoryParts};
pub use record::{BadRecord, Record};
pub use segments::{BlockRun, Segment, SegmentMap};
pub use telemetry::*;
