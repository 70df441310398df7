//! What the UI asks of the trainer. Every command is answered by a [`crate::Telemetry`]
//! message carrying the value the trainer applied, so the screen shows confirmed state.
use serde::{Deserialize, Serialize};

use crate::config::{Checkpointing, Precision};
use crate::policy::{Profile, Thresholds};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum Command {
    /// Stop after the current step: checkpoint, then finish. Answered by `Status(Stopping)`
    /// and later `Finished`.
    Stop,
    /// Hold at the next step boundary. Answered by `Status(Paused)`.
    Pause,
    /// Answered by `Status(Running)`.
    Resume,
    /// Write a checkpoint at the next step boundary. Answered by `CheckpointSaved`.
    Checkpoint,
    /// Replace the thresholds. Answered by `ThresholdsChanged` when valid, and by
    /// `CommandApplied` naming the problem (the old values stay in force) when not.
    SetThresholds { thresholds: Thresholds },
    /// Switch to a profile's thresholds. Answered by `ThresholdsChanged`.
    SetProfile { profile: Profile },
    /// Hold the micro-batch at this size (clamped to the allowed range); the controller
    /// then only warns. Answered by `CommandApplied` (and a `decision` when it resizes).
    PinMicroBatch { micro_batch: usize },
    /// Let the controller resize again. Answered by `CommandApplied`.
    Unpin,
    /// Return cached allocator memory to the device now. Answered by `CommandApplied`.
    FreeCache,
    /// Compute the built-in model in this precision from the next step. Answered by
    /// `CommandApplied`; once a step has run with it, a `lever` notice gives its peak
    /// against the last step's before the switch (the memory it freed).
    SetPrecision { precision: Precision },
    /// Activation checkpointing from the next step; answered as [`Command::SetPrecision`].
    SetCheckpointing { checkpoint: Checkpointing },
}
