//! The memory policy: thresholds, a memory model fitted from the run's own steps, and the
//! batch controller. Pure: observations in, decisions out; the trainer applies them.
pub mod controller;
pub mod memory_model;
pub mod thresholds;

pub use controller::{
    Controller, ControllerConfig, Decision, OomOutcome, ResizeReason, StepObservation, Upcoming,
    ALLOCATOR_NOISE, RSS_NOISE,
};
pub use memory_model::MemoryModel;
pub use thresholds::{Profile, ThresholdError, Thresholds};
