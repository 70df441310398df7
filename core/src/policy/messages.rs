//! What goes into the controller (a step's reading, the lengths to come) and what comes
//! out of it (decisions, each with the numbers that caused it). The trainer, the Python
//! package and the dashboard speak these; the controller's modules share them.
use serde::{Deserialize, Serialize};

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepObservation {
    pub step: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
    /// The step's peak memory, bytes.
    pub peak_bytes: u64,
}

/// The longest sequence within the trainer's horizon of upcoming steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upcoming {
    /// The longest sequence length from the next step to the end of the horizon.
    pub seq_len: usize,
    /// The first step that feeds it.
    pub step: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeReason {
    /// Usage under target: room to grow.
    Grow,
    /// Usage at or above critical.
    Critical,
    /// Usage at or above emergency.
    Emergency,
    /// The next batch (or a longer one within the horizon) was forecast above warning.
    Forecast,
    /// The step ran out of memory.
    Oom,
    /// The user pinned the micro-batch.
    Pinned,
    /// Usage stayed above target for several steps at one size (the allocator's
    /// footprint drifted up, e.g. heap fragmentation after an OOM), or a growth landed
    /// above target.
    OverTarget,
}

/// What the controller decided, with the numbers that caused it. Usages are fractions of
/// the limit (the budget on CPU, device memory on CUDA).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Change the micro-batch (accumulation steps follow; the effective batch does not).
    Resize {
        from: usize,
        to: usize,
        reason: ResizeReason,
        /// The measured (or, for a forecast, predicted) usage that triggered it.
        usage: f64,
        /// Predicted usage at the new size, when the model can tell.
        predicted: Option<f64>,
    },
    /// Return cached allocator memory to the device (`emptyCache`).
    EmptyCache { usage: f64 },
    /// Sizes of this many tokens or more are avoided: `micro_batch` ran out of memory
    /// (`usage` 1.0) or peaked at `usage` ≥ critical (or stayed over target), and with a
    /// non-negative fixed part `tokens` would still be at or above target.
    CeilingLearned {
        micro_batch: usize,
        tokens: u64,
        usage: f64,
    },
    /// The ceiling was raised after a long run without OOMs; `None` when dropped.
    CeilingRaised { tokens: Option<u64> },
    /// Usage above warning, measured or forecast, that did not (or could not) resize;
    /// also why growth holds (a longer length is coming, or the fixed part is unknown).
    Warning {
        usage: f64,
        forecast: bool,
        text: String,
    },
    /// A memory lever (precision, activation checkpointing) was switched, judged by the
    /// first step that ran with it: its peak against the last one measured before.
    /// Recorded about that first step, once it is measured.
    Lever {
        /// What changed: `precision fp32 → bf16`, `activation checkpointing none →
        /// blocks`; switches made before one step are listed together.
        change: String,
        /// Who switched: `command` (the dashboard's keys, a viewer) or `controller`
        /// (`memory.auto_checkpoint` when the smallest micro-batch ran out of memory).
        source: String,
        /// The last step measured before the switch; `None` when there was none.
        before: Option<LeverPeak>,
        /// The first step measured with the lever switched.
        after: LeverPeak,
        /// `before − after` peak bytes when both ran at the same micro-batch and length
        /// (negative: the peak rose); `None` otherwise (then compare per token).
        freed_bytes: Option<i64>,
    },
    /// The chunk size evaluation batches run at changed (policy/eval.rs): after a chunk
    /// ran out of memory (`Oom`, usage 1.0), or for the next batch from what evaluation's
    /// own peaks predict (`Forecast` smaller, `Grow` larger; `usage` predicted at `to`).
    /// The training micro-batch is not affected.
    EvalSize {
        from: usize,
        to: usize,
        reason: ResizeReason,
        usage: f64,
    },
}

/// A step's measured peak and the shape it ran at, as a [`Decision::Lever`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeverPeak {
    pub step: u64,
    pub peak_bytes: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
}

impl LeverPeak {
    /// Peak bytes per token of the micro-batch.
    pub fn per_token(&self) -> u64 {
        self.peak_bytes / (self.micro_batch * self.seq_len).max(1) as u64
    }
}

/// What to do after an OOM.
#[derive(Debug, Clone, PartialEq)]
pub struct OomOutcome {
    pub decisions: Vec<Decision>,
    /// Retry the step with this micro-batch; `None`: give up (it failed repeatedly at
    /// the smallest size).
    pub retry_with: Option<usize>,
}
