//! What the trainer and the sampler tell the UI and the run log.
//!
//! One enum, internally tagged by `kind`, so a JSONL line is `{"kind":"step",...}`.
//! See docs/LOG_SCHEMA.md; a change here is a change to that contract.
use serde::{Deserialize, Serialize};

use crate::command::Command;
use crate::config::RunConfig;
use crate::segments::SegmentMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// Consumers (UI, headless) ignore kinds they do not know yet, so the trainer can grow
// new records without breaking them.
#[non_exhaustive]
pub enum Telemetry {
    /// Once, before the first step.
    RunStarted(RunInfo),
    /// Every optimizer step.
    Step(StepMetrics),
    /// Every validation pass.
    Eval(EvalMetrics),
    /// Host, device and allocator figures from the sampler thread, at a fixed rate.
    Sample(SystemSample),
    /// The CUDA allocator's segments and blocks, at a modest rate (CUDA runs only).
    Segments(SegmentMap),
    /// The run's state changed (also the answer to pause / resume / stop).
    Status {
        status: RunStatus,
    },
    /// Something the user should know that is not a failure: no GPU, no NVML, ...
    Notice(Notice),
    CheckpointSaved {
        step: u64,
        path: String,
    },
    /// The trainer received a command; `applied` says what it did with it.
    CommandApplied {
        command: Command,
        applied: String,
    },
    /// The run ended normally (completed or stopped by the user).
    Finished(RunSummary),
    /// The run ended with an error or a panic in the trainer.
    Failed {
        reason: String,
    },
}

impl Telemetry {
    /// High-rate figures that may be dropped (and counted) when a consumer lags. Everything
    /// else is a lifecycle event or a decision and is never dropped.
    pub fn is_high_rate(&self) -> bool {
        matches!(
            self,
            Telemetry::Step(_) | Telemetry::Sample(_) | Telemetry::Segments(_)
        )
    }

    /// The `kind` tag this message carries in the log.
    pub fn kind(&self) -> &'static str {
        match self {
            Telemetry::RunStarted(_) => "run_started",
            Telemetry::Step(_) => "step",
            Telemetry::Eval(_) => "eval",
            Telemetry::Sample(_) => "sample",
            Telemetry::Segments(_) => "segments",
            Telemetry::Status { .. } => "status",
            Telemetry::Notice(_) => "notice",
            Telemetry::CheckpointSaved { .. } => "checkpoint_saved",
            Telemetry::CommandApplied { .. } => "command_applied",
            Telemetry::Finished(_) => "finished",
            Telemetry::Failed { .. } => "failed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub run_name: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// Human name: the GPU's product name, or the CPU model.
    pub device_name: String,
    pub parameters: u64,
    /// Step the run starts after (0, or the resumed checkpoint's step).
    pub start_step: u64,
    pub total_steps: u64,
    pub corpus: String,
    pub train_bytes: u64,
    pub val_bytes: u64,
    pub config: RunConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// 1-based number of the optimizer step just completed.
    pub step: u64,
    pub total_steps: u64,
    /// Mean cross-entropy over every token of the effective batch, nats per byte.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub micro_batch: usize,
    pub accum_steps: usize,
    pub effective_batch: usize,
    pub seq_len: usize,
    pub tokens_seen: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: u64,
    /// Mean cross-entropy on the validation split, nats per byte.
    pub val_loss: f64,
    /// Mean training loss over the steps since the previous evaluation.
    pub train_loss: f64,
    pub tokens: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemSample {
    pub host: HostStats,
    /// Present when NVML answered for the run's device.
    pub gpu: Option<GpuStats>,
    /// Present when the run is on an accelerator with a caching allocator.
    pub allocator: Option<AllocatorStats>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostStats {
    /// Whole-machine CPU use, 0..=100.
    pub cpu_percent: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    /// This process's resident set.
    pub process_rss: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuStats {
    pub index: u32,
    pub name: String,
    pub mem_used: u64,
    pub mem_total: u64,
    pub util_percent: Option<u32>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
}

/// CUDA caching-allocator statistics (bytes unless named otherwise), from
/// `at::accelerator::getDeviceStats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocatorStats {
    pub allocated: u64,
    pub allocated_peak: u64,
    pub reserved: u64,
    pub reserved_peak: u64,
    pub active: u64,
    pub active_peak: u64,
    pub inactive_split: u64,
    pub inactive_split_peak: u64,
    pub requested: u64,
    pub requested_peak: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub segments: u64,
}

impl AllocatorStats {
    /// Reserved memory held in split blocks nobody uses: the fragmentation that
    /// `emptyCache` cannot return.
    pub fn fragmentation(&self) -> f64 {
        ratio(self.inactive_split, self.reserved)
    }

    /// Share of reserved memory not handed to tensors right now.
    pub fn unused_reserved(&self) -> f64 {
        1.0 - ratio(self.allocated, self.reserved)
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Starting,
    Running,
    Paused,
    Stopping,
    Finished,
    Failed,
}

impl RunStatus {
    pub fn label(self) -> &'static str {
        match self {
            RunStatus::Starting => "starting",
            RunStatus::Running => "running",
            RunStatus::Paused => "paused",
            RunStatus::Stopping => "stopping",
            RunStatus::Finished => "finished",
            RunStatus::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notice {
    pub level: Level,
    /// Which part speaks: `nvml`, `device`, `log`, `checkpoint`, ...
    pub source: String,
    pub text: String,
}

impl Notice {
    pub fn new(level: Level, source: &str, text: impl Into<String>) -> Self {
        Notice {
            level,
            source: source.to_string(),
            text: text.into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub steps_done: u64,
    pub total_steps: u64,
    pub stopped_by_user: bool,
    pub last_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    pub tokens_seen: u64,
    pub elapsed_s: f64,
    pub checkpoint: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_carry_the_kind_tag() {
        let msg = Telemetry::CheckpointSaved {
            step: 7,
            path: "runs/x".into(),
        };
        let json = serde_json::to_value(&msg).unwrap();
        assert_eq!(json["kind"], msg.kind());
        assert_eq!(json["step"], 7);
        let back: Telemetry = serde_json::from_value(json).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn only_steps_and_samples_are_droppable() {
        assert!(Telemetry::Sample(SystemSample::default()).is_high_rate());
        assert!(!Telemetry::Failed { reason: "x".into() }.is_high_rate());
        assert!(!Telemetry::Status {
            status: RunStatus::Paused
        }
        .is_high_rate());
    }

    #[test]
    fn fragmentation_is_inactive_split_over_reserved() {
        let s = AllocatorStats {
            allocated: 600,
            reserved: 1000,
            inactive_split: 250,
            ..Default::default()
        };
        assert!((s.fragmentation() - 0.25).abs() < 1e-12);
        assert!((s.unused_reserved() - 0.4).abs() < 1e-12);
        assert_eq!(AllocatorStats::default().fragmentation(), 0.0);
    }
}

#[cfg(test)]
mod schema_doc {
    /// docs/LOG_SCHEMA.md must describe every kind the log can hold.
    #[test]
    fn every_kind_is_documented() {
        let doc = include_str!("../../docs/LOG_SCHEMA.md");
        for kind in [
            "run_started",
            "step",
            "eval",
            "sample",
            "segments",
            "status",
            "notice",
            "checkpoint_saved",
            "command_applied",
            "finished",
            "failed",
        ] {
            assert!(doc.contains(&format!("| `{kind}` |")), "{kind} missing");
        }
    }
}
