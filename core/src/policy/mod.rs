//! The memory policy: thresholds, a memory model fitted from the run's own steps, and the
//! batch controller. Pure: observations in, decisions out; the trainer applies them.
//!
//! The controller's rules read its state (`state.rs`) and propose moves (`moves.rs`);
//! [`controller`] applies them, the one place the state is written (docs/CONTROLLER.md).
//! `estimate.rs` says what memory costs, `evidence.rs` what a reading means, `horizon.rs`
//! the length sizes are planned for; `decision.rs` and `reflexes.rs` hold the rules;
//! `eval.rs` sizes evaluation's chunks against the same thresholds and limit.
pub mod controller;
mod decision;
mod estimate;
pub mod eval;
mod evidence;
mod horizon;
pub mod memory_model;
mod messages;
mod moves;
mod reflexes;
mod state;
pub mod thresholds;

pub use controller::{Controller, ControllerConfig, ALLOCATOR_NOISE, RSS_NOISE};
pub use memory_model::MemoryModel;
pub use messages::{Decision, LeverPeak, OomOutcome, ResizeReason, StepObservation, Upcoming};
pub use thresholds::{Profile, ThresholdError, Thresholds};
