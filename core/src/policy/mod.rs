//! The memory policy: thresholds, a memory model fitted from the run's own steps, and the
//! batch controller. Pure: observations in, decisions out; the trainer applies them.
//!
//! The controller asks four questions, one module each (docs/CONTROLLER.md):
//! [`estimate`] what memory costs, [`evidence`] what a reading means, [`decision`] what to
//! do, [`reflexes`] what needs no model; [`horizon`] plans the length sizes are for.
pub mod controller;
mod decision;
mod estimate;
mod evidence;
mod horizon;
pub mod memory_model;
mod messages;
mod reflexes;
pub mod thresholds;

pub use controller::{Controller, ControllerConfig, ALLOCATOR_NOISE, RSS_NOISE};
pub use memory_model::MemoryModel;
pub use messages::{Decision, LeverPeak, OomOutcome, ResizeReason, StepObservation, Upcoming};
pub use thresholds::{Profile, ThresholdError, Thresholds};
