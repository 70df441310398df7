//! What the trainer and the sampler tell the UI and the run log.
//!
//! One enum, internally tagged by `kind`, so a JSONL line is `{"kind":"step",...}`.
//! See docs/LOG_SCHEMA.md; a change here is a change to that contract.
use serde::{Deserialize, Serialize};

use crate::command::Command;
use crate::config::{Checkpointing, Precision, RunConfig};
use crate::hints::{Hint, MemoryParts};
use crate::policy::{Decision, Profile, Thresholds};
use crate::segments::SegmentMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// Consumers (UI, headless) ignore kinds they do not know yet, so the trainer can grow
// new records without breaking them.
#[non_exhaustive]
// RunStarted (with the whole config) is the large one and is sent once per run; the cost
// is channel slots of ~0.5 KiB, a few hundred KiB over every bounded channel together.
#[allow(clippy::large_enum_variant)]
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
    /// The memory controller decided something (resize, free cache, ceiling, warning),
    /// with the numbers that caused it. Applied before step `step + 1`.
    Decision {
        step: u64,
        decision: Decision,
    },
    /// A step ran out of memory; every tensor of the attempt was dropped and the same
    /// samples are retried with `retry_with` (none: the run stops).
    Oom {
        /// The step that failed (1-based), not counted as done.
        step: u64,
        micro_batch: usize,
        seq_len: usize,
        retry_with: Option<usize>,
        /// libtorch's message.
        error: String,
    },
    /// An evaluation chunk ran out of memory; its samples are retried in chunks of
    /// `retry_with` (none: one sample does not fit, and the evaluation fails). Training's
    /// micro-batch is not touched.
    EvalOom {
        /// The training step the evaluation follows (0: before the first).
        step: u64,
        /// What the driver calls the pass: `eval`, `validation`, `test`, `predict`.
        phase: String,
        size: usize,
        seq_len: usize,
        retry_with: Option<usize>,
        error: String,
    },
    /// One evaluation pass, as its own phase: how its batches were split and what they
    /// peaked at. Sent when the pass ends.
    EvalMemory(EvalMemory),
    /// The thresholds in force changed (at start, from a command); `source` says who.
    ThresholdsChanged {
        thresholds: Thresholds,
        /// The profile, when the values are exactly a profile's.
        profile: Option<Profile>,
        source: String,
    },
    /// Every optimizer step: the memory it peaked at, what the model predicted for it,
    /// and the limit usage is measured against.
    StepMemory(StepMemory),
    /// The run ended normally (completed or stopped by the user).
    Finished(RunSummary),
    /// The run ended with an error or a panic in the trainer.
    Failed {
        reason: String,
    },
    /// A torchrun job's ranks, as rank 0 gathered them over the process group at `step`
    /// (sent by rank 0 only; one row per rank, in rank order).
    JobRanks(JobRanks),
    /// A live hint raised or cleared (core/src/hints.rs), computed from the records above.
    Hint(Hint),
    /// What the step's fixed memory is made of, as the producer counted it (once a run).
    MemoryParts(MemoryParts),
    /// Every optimizer step of a run given a plan (`headroom.plan`): the plan's
    /// prediction beside the step's measured peak.
    PlanCheck(PlanCheck),
    /// The built-in trainer's plan (`headroom plan`'s arithmetic, probed at the run's
    /// start), once: what every step holds and what each token of a micro-batch adds.
    PlanSplit(PlanSplit),
}

impl Telemetry {
    /// High-rate figures that may be dropped (and counted) when a consumer lags. Everything
    /// else is a lifecycle event or a decision and is never dropped.
    pub fn is_high_rate(&self) -> bool {
        matches!(
            self,
            Telemetry::Step(_)
                | Telemetry::StepMemory(_)
                | Telemetry::Sample(_)
                | Telemetry::Segments(_)
                | Telemetry::JobRanks(_)
                | Telemetry::PlanCheck(_)
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
            Telemetry::Decision { .. } => "decision",
            Telemetry::Oom { .. } => "oom",
            Telemetry::EvalOom { .. } => "eval_oom",
            Telemetry::EvalMemory(_) => "eval_memory",
            Telemetry::ThresholdsChanged { .. } => "thresholds_changed",
            Telemetry::StepMemory(_) => "step_memory",
            Telemetry::Finished(_) => "finished",
            Telemetry::Failed { .. } => "failed",
            Telemetry::JobRanks(_) => "job_ranks",
            Telemetry::Hint(_) => "hint",
            Telemetry::MemoryParts(_) => "memory_parts",
            Telemetry::PlanCheck(_) => "plan_check",
            Telemetry::PlanSplit(_) => "plan_split",
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
    /// `headroom train`'s configuration; absent for other producers (a Python loop),
    /// whose settings are not a `RunConfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<RunConfig>,
    /// Whether a stop saves a checkpoint of the last completed step: always for
    /// `headroom train`, for a Python run when it has `on_checkpoint`. Absent in logs from
    /// before runs said it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<bool>,
    /// The memory levers the run switches itself (the dashboard's `m` and `a`), as they
    /// are at its start; absent where it holds none (a Python loop that keeps its own)
    /// and in logs from before runs said it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub levers: Option<RunLevers>,
}

/// A run's switchable levers; `None`: not the run's to switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RunLevers {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointing: Option<Checkpointing>,
    /// The half precision the precision lever switches to from fp32: bf16, or fp16 where
    /// the run scales its loss (a Python run's `half_precision="fp16"`). `None` (logs
    /// from before runs said it): bf16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub half: Option<Precision>,
}

impl RunLevers {
    /// Where the precision lever goes from `now`: fp32 to the run's half precision, a
    /// half precision back to fp32.
    pub fn other_precision(&self, now: Precision) -> Precision {
        match now {
            Precision::Fp32 => self.half.unwrap_or(Precision::Bf16),
            Precision::Bf16 | Precision::Fp16 => Precision::Fp32,
        }
    }

    /// The lever a confirmed command switched, in force from now on.
    pub fn switched(&mut self, command: &Command) {
        match command {
            Command::SetPrecision { precision } if self.precision.is_some() => {
                self.precision = Some(*precision)
            }
            Command::SetCheckpointing { checkpoint } if self.checkpointing.is_some() => {
                self.checkpointing = Some(*checkpoint)
            }
            _ => {}
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// 1-based number of the optimizer step just completed.
    pub step: u64,
    pub total_steps: u64,
    /// Mean cross-entropy over every token of the effective batch, nats per byte.
    pub loss: f64,
    /// `None` (null) when the producer does not know it (a Python loop that did not say).
    pub lr: Option<f64>,
    /// Global gradient norm before clipping; `None` when the producer does not know it.
    pub grad_norm: Option<f64>,
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
pub struct StepMemory {
    pub step: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
    /// The step's peak: peak RSS on CPU; allocator peak plus memory outside the
    /// allocator (NVML used minus reserved) on CUDA.
    pub peak_bytes: u64,
    /// What the memory model predicted before the step, when it could.
    pub predicted_bytes: Option<u64>,
    /// The limit usage is a share of: the budget (CPU) or the device's memory (CUDA),
    /// lowered to what is really available to this process when other processes hold
    /// part of it (resident + MemAvailable on CPU, own use + free on CUDA).
    pub limit_bytes: u64,
    /// The configured limit (budget, host or device total) before that lowering; equal to
    /// `limit_bytes` when nothing else competes. 0 in logs from before this field.
    #[serde(default)]
    pub configured_limit_bytes: u64,
    /// peak / limit.
    pub usage: f64,
}

/// A plan's prediction for a step against what the step measured (bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanCheck {
    pub step: u64,
    pub micro_batch: usize,
    pub planned_bytes: u64,
    /// The same peak as the step's `step_memory` record.
    pub peak_bytes: u64,
}

/// A plan's split of a step's memory (bytes): the memory panel's stacked bar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanSplit {
    /// Parameters, gradients and optimizer state.
    pub model_bytes: u64,
    /// The rest of a step's fixed part: workspaces, allocator slack, on the CPU the
    /// process itself (libtorch, the corpus).
    pub overhead_bytes: u64,
    /// Activation bytes each token of the micro-batch adds, with the run's levers.
    pub activations_per_token: f64,
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

/// An evaluation pass's memory (the `eval_memory` record): its batches ran in chunks the
/// controller sized (policy/eval.rs) to stay under target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMemory {
    /// The training step the evaluation follows (0: before the first).
    pub step: u64,
    /// What the driver calls the pass: `eval`, `validation`, `test`, `predict`.
    pub phase: String,
    pub batches: u64,
    pub samples: u64,
    /// The largest batch asked for (the loader's or the script's batch size).
    pub asked: usize,
    /// The chunk size the pass ended at (`asked`: never split).
    pub size: usize,
    /// Forward passes run, retries after out-of-memory errors included.
    pub chunks: u64,
    /// The longest sample, tokens (1 when the driver did not say).
    pub seq_len: usize,
    /// The largest chunk's peak, bytes, and against the limit.
    pub peak_bytes: u64,
    pub limit_bytes: u64,
    pub usage: f64,
    /// Chunks that ran out of memory and were retried smaller.
    pub ooms: u64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SystemSample {
    pub host: HostStats,
    /// Present when NVML answered for the run's device.
    pub gpu: Option<GpuStats>,
    /// Present when the run is on an accelerator with a caching allocator.
    pub allocator: Option<AllocatorStats>,
    /// The process's heap, on a CPU run whose allocator is glibc's malloc (absent on CUDA,
    /// under another malloc, and in logs from before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap: Option<HeapStats>,
}

/// The span of run time in which what keeps readings for later (the log, a viewer's
/// catch-up) keeps one, the one using the most memory: 4 a second, whatever the rate.
pub const KEPT_SAMPLE_EVERY: f64 = 0.25;

/// The slot of [`KEPT_SAMPLE_EVERY`] a reading at run time `t` falls in.
pub fn kept_sample_slot(t: f64) -> i64 {
    (t / KEPT_SAMPLE_EVERY).floor() as i64
}

impl SystemSample {
    /// The memory the run's own figure says it uses: the device's on a GPU, else the
    /// process's resident set (what the screen's memory chart draws).
    pub fn memory_used(&self) -> u64 {
        match &self.gpu {
            Some(g) => g.mem_used,
            None => self.host.process_rss,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostStats {
    /// Whole-machine CPU use, 0..=100.
    pub cpu_percent: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    /// What the kernel says could still be handed out without swapping (MemAvailable);
    /// 0 in logs from before this field.
    #[serde(default)]
    pub mem_available: u64,
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

/// A CPU run's heap: what the resident set holds against what is live in it. On the CPU
/// the step's peak resident set is what the controller and a soft budget measure, so
/// freed pages glibc keeps count as use until a trim returns them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeapStats {
    /// Anonymous resident memory (`RssAnon`): the heap, mmapped tensors, thread stacks.
    pub rss_anon: u64,
    /// Bytes in live malloc allocations (`mallinfo2`: `uordblks + hblkhd`): every CPU
    /// tensor and everything else malloc handed out.
    pub in_use: u64,
    /// Free bytes inside malloc's arenas (`fordblks`), kept for reuse; some of them no
    /// longer resident after a trim.
    pub free_kept: u64,
    /// Heap trims (`malloc_trim`) this process made so far: before a smaller step, when
    /// the controller frees cached memory, on `f` (a Python loop: after an OOM too).
    pub trims: u64,
    /// What the last trim returned to the kernel: the resident set before it minus after
    /// it (absent before the first trim).
    pub last_trim_freed: Option<u64>,
}

impl HeapStats {
    /// Anonymous resident memory outside live allocations: freed heap pages glibc keeps
    /// (and stacks, other mappings). A soft budget counts it as use.
    pub fn held_apart(&self) -> u64 {
        self.rss_anon.saturating_sub(self.in_use)
    }

    /// [`HeapStats::held_apart`] as a share of the anonymous resident set.
    pub fn fragmentation(&self) -> f64 {
        ratio(self.held_apart(), self.rss_anon)
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Every rank of a job at one agreement point (docs/PYTHON.md, "torchrun").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRanks {
    /// The job's id (torchrun's run id).
    pub job: String,
    /// The step whose agreement carried these rows (each row's own figures are of that
    /// rank's last completed step, at most one step behind).
    pub step: u64,
    pub world_size: u32,
    /// Whether every rank follows one micro-batch size (false: each rank's own controller
    /// sizes its own micro-batches; the gradient all-reduce happens once per step).
    pub uniform_micro_batch: bool,
    /// Microseconds the agreement collective took on rank 0 (waiting for the slowest rank
    /// included).
    pub agree_us: f64,
    pub ranks: Vec<RankRow>,
}

/// One rank's figures in a [`JobRanks`] record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankRow {
    pub rank: u32,
    /// The host the rank runs on.
    pub host: String,
    /// Steps this rank completed.
    pub step: u64,
    /// The micro-batch its controller holds now.
    pub micro_batch: usize,
    /// Its last step's peak, the limit that peak is a share of, and the share.
    pub peak_bytes: u64,
    pub limit_bytes: u64,
    pub usage: f64,
    /// Out-of-memory errors it caught (and recovered from) so far.
    pub ooms: u64,
    /// Its last step's wall time (its own work: micro-batches and optimizer).
    pub step_time_s: f64,
    /// Its share of the last step's loss (its own samples).
    pub loss: Option<f64>,
    pub status: RunStatus,
    /// Commands it has carried out so far (a command reaches every rank; this counts the
    /// confirmations).
    pub commands_applied: u64,
}

impl JobRanks {
    /// The rank closest to its limit (the one that bounds the job's memory).
    pub fn tightest(&self) -> Option<u32> {
        self.ranks
            .iter()
            .filter(|r| r.limit_bytes > 0)
            .max_by(|a, b| a.usage.total_cmp(&b.usage))
            .map(|r| r.rank)
    }

    /// The rank with the longest step (the one every other rank waits for).
    pub fn slowest(&self) -> Option<u32> {
        self.ranks
            .iter()
            .filter(|r| r.step_time_s > 0.0)
            .max_by(|a, b| a.step_time_s.total_cmp(&b.step_time_s))
            .map(|r| r.rank)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// (The default of a [`RankRow`] built field by field.)
    #[default]
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
    /// The line the screen shows.
    pub text: String,
    /// What lies behind `text` (an error's own words), kept in the log and off the
    /// screen. Absent from the JSON when there is none, and in logs from before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Notice {
    pub fn new(level: Level, source: &str, text: impl Into<String>) -> Self {
        Notice {
            level,
            source: source.to_string(),
            text: text.into(),
            detail: None,
        }
    }

    /// The same notice, with what lies behind it for the log.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
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
    /// What memory did over the run (absent in logs from before this field).
    #[serde(default)]
    pub memory: MemorySummary,
}

/// The memory side of a finished run, for the exit summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemorySummary {
    /// The highest step peak, as a share of the limit at that step, and in bytes.
    pub peak_usage: Option<f64>,
    pub peak_bytes: Option<u64>,
    /// The limit at the step that peaked.
    pub limit_bytes: Option<u64>,
    /// The micro-batch the run ended with, and how many micro-batches a step took.
    pub final_micro_batch: usize,
    pub accum_steps: usize,
    /// The effective batch (sequences per optimizer step).
    pub effective_batch: usize,
    /// Micro-batch changes made by the controller or a pin.
    pub resizes: u64,
    /// Out-of-memory errors caught and recovered from (or given up on).
    pub ooms: u64,
}

impl MemorySummary {
    /// Keeps a step's peak when it is the run's highest share of its limit so far.
    pub fn note_peak(&mut self, peak: u64, limit: u64, usage: f64) {
        if self.peak_usage.is_none_or(|u| usage > u) {
            self.peak_usage = Some(usage);
            self.peak_bytes = Some(peak);
            self.limit_bytes = Some(limit);
        }
    }
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
    fn decisions_round_trip_through_json() {
        use crate::policy::{Decision, ResizeReason};
        let msg = Telemetry::Decision {
            step: 3,
            decision: Decision::Resize {
                from: 4,
                to: 32,
                reason: ResizeReason::Grow,
                usage: 0.1,
                predicted: Some(0.85),
            },
        };
        let json = serde_json::to_value(&msg).unwrap();
        assert_eq!(json["kind"], "decision");
        assert_eq!(json["decision"]["decision"], "resize");
        assert_eq!(json["decision"]["reason"], "grow");
        assert_eq!(serde_json::from_value::<Telemetry>(json).unwrap(), msg);
        let cmd = Command::SetThresholds {
            thresholds: Thresholds::default(),
        };
        let json = serde_json::to_value(&cmd).unwrap();
        assert_eq!(json["command"], "set_thresholds");
        assert_eq!(json["thresholds"]["target"], 0.9);
        assert!(!msg.is_high_rate());
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

    #[test]
    fn heap_held_apart_is_anonymous_rss_beyond_live_allocations() {
        let h = HeapStats {
            rss_anon: 1000,
            in_use: 750,
            ..Default::default()
        };
        assert_eq!(h.held_apart(), 250);
        assert!((h.fragmentation() - 0.25).abs() < 1e-12);
        // More in use than resident (allocated, never touched): nothing is held apart.
        let untouched = HeapStats {
            rss_anon: 100,
            in_use: 400,
            ..Default::default()
        };
        assert_eq!(untouched.held_apart(), 0);
    }

    /// A sample from a log written before the heap field replays with the heap absent.
    #[test]
    fn an_old_sample_without_heap_reads_as_absent() {
        let line = r#"{"kind":"sample","host":{"cpu_percent":1.0,"mem_used":1,"mem_total":2,"process_rss":3},"gpu":null,"allocator":null}"#;
        let Telemetry::Sample(s) = serde_json::from_str(line).unwrap() else {
            panic!("not a sample")
        };
        assert_eq!(s.heap, None);
        let json = serde_json::to_value(Telemetry::Sample(s)).unwrap();
        assert!(json.get("heap").is_none(), "absent, not null: {json}");
    }

    /// A notice's detail goes to the log beside its short text; a notice without one
    /// (and every notice in a log from before the field) reads and writes as before.
    #[test]
    fn a_notice_carries_its_detail_and_old_notices_read_without_one() {
        let old =
            r#"{"kind":"notice","level":"info","source":"nvml","text":"NVML unavailable (x)"}"#;
        let Telemetry::Notice(n) = serde_json::from_str(old).unwrap() else {
            panic!("not a notice")
        };
        assert_eq!(
            (n.text.as_str(), n.detail.as_deref()),
            ("NVML unavailable (x)", None)
        );
        let json = serde_json::to_value(Telemetry::Notice(n)).unwrap();
        assert!(json.get("detail").is_none(), "absent, not null: {json}");
        let n = Notice::new(Level::Info, "nvml", "short").with_detail("why");
        let json = serde_json::to_value(Telemetry::Notice(n.clone())).unwrap();
        assert_eq!(
            (json["text"].as_str(), json["detail"].as_str()),
            (Some("short"), Some("why"))
        );
        assert_eq!(
            serde_json::from_value::<Telemetry>(json).unwrap(),
            Telemetry::Notice(n)
        );
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
            "decision",
            "oom",
            "eval_oom",
            "eval_memory",
            "thresholds_changed",
            "step_memory",
            "finished",
            "failed",
            "job_ranks",
            "hint",
            "memory_parts",
            "plan_check",
            "plan_split",
        ] {
            assert!(doc.contains(&format!("| `{kind}` |")), "{kind} missing");
        }
    }
}
