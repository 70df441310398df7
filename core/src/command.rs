//! What the UI asks of the trainer. Every command is answered by a [`crate::Telemetry`]
//! message carrying the value the trainer applied, so the screen shows confirmed state.
use serde::{Deserialize, Serialize};

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
}
