//! The run's configuration: TOML presets in configs/, overridden by CLI flags.
//!
//! Every section denies unknown keys, so a typo is an error that names the key instead of
//! a silently ignored setting. Missing keys take the defaults below, which are the values
//! of configs/default.toml.
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::policy::{Profile, Thresholds};
use crate::units::parse_bytes;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    pub run: RunSection,
    pub data: DataSection,
    pub model: ModelSection,
    pub optim: OptimSection,
    pub batch: BatchSection,
    pub memory: MemorySection,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    pub name: String,
    /// Optimizer steps to train for (the total, counting resumed ones).
    pub steps: u64,
    pub seed: u64,
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Where checkpoints go; empty means `runs/<name>`.
    pub checkpoint_dir: String,
    /// Steps between periodic checkpoints; 0 writes only the final one.
    pub checkpoint_every: u64,
    /// Steps between validation passes; 0 evaluates only at the end.
    pub eval_every: u64,
    /// Validation windows per pass (each `batch.micro_batch` sequences).
    pub eval_batches: usize,
    /// Steps between headless progress lines.
    pub progress_every: u64,
    /// Sampler rate for host / device / allocator figures: a ceiling (the sampler slows
    /// where a reading costs more than `sampler::READ_BUDGET` of a core); the log keeps at
    /// most 4 a second (`log_thinning`).
    pub sample_hz: f64,
    /// libtorch's intra-op threads (`--threads`); 0 keeps libtorch's default, one per
    /// core. On a machine busy with other work fewer can be much faster: the pool's
    /// threads spin waiting for each other (a tiny model measured 10–30 steps/s with the
    /// default on two loaded cores, about 1 000 with one thread).
    pub threads: usize,
    /// What SIGUSR1 asks (`--on-usr1`): `stop` (checkpoint, then exit like SIGTERM) or
    /// `checkpoint` (save at the step's end and go on). Stop by default: a batch
    /// scheduler's `--signal=USR1@SECONDS` is the "your time is almost up" warning, and
    /// a run that only saved would then be killed in the middle of its next steps.
    pub on_usr1: OnUserSignal,
    /// The same for SIGUSR2 (`--on-usr2`).
    pub on_usr2: OnUserSignal,
}

/// What a user signal (SIGUSR1, SIGUSR2) asks of a run (see [`RunSection::on_usr1`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnUserSignal {
    /// Checkpoint and stop, as SIGTERM does.
    #[default]
    Stop,
    /// Checkpoint at the end of the step in progress and keep training.
    Checkpoint,
}

impl std::str::FromStr for OnUserSignal {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "stop" => Ok(OnUserSignal::Stop),
            "checkpoint" => Ok(OnUserSignal::Checkpoint),
            other => Err(format!(
                "{other:?} is not an action; use stop or checkpoint"
            )),
        }
    }
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            name: "default".into(),
            steps: 300,
            seed: 1337,
            device: "auto".into(),
            checkpoint_dir: String::new(),
            checkpoint_every: 100,
            eval_every: 50,
            eval_batches: 8,
            progress_every: 10,
            sample_hz: 20.0,
            threads: 0,
            on_usr1: OnUserSignal::Stop,
            on_usr2: OnUserSignal::Stop,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Text file to train on; empty means the bundled tinyshakespeare.
    pub corpus: String,
    /// Share of the corpus (its tail) held out for validation.
    pub val_fraction: f64,
    /// Bytes per training sequence (the model's context length): the longest a step
    /// feeds when lengths vary.
    pub seq_len: usize,
    /// How long each step's sequences are: `fixed` (always `seq_len`), `ramp` (a
    /// curriculum from `min_seq_len` up to `seq_len` over `ramp_steps`) or `random`
    /// (each step draws a length in `min_seq_len..=seq_len`).
    pub lengths: Lengths,
    /// Shortest length for `ramp` and `random`; 0 means a quarter of `seq_len`.
    pub min_seq_len: usize,
    /// Steps the `ramp` takes to reach `seq_len`.
    pub ramp_steps: u64,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            corpus: String::new(),
            val_fraction: 0.1,
            seq_len: 64,
            lengths: Lengths::Fixed,
            min_seq_len: 0,
            ramp_steps: 200,
        }
    }
}

/// The sequence-length schedule (see [`DataSection::lengths`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Lengths {
    #[default]
    Fixed,
    Ramp,
    Random,
}

impl DataSection {
    /// The shortest length a step may feed.
    pub fn min_len(&self) -> usize {
        match self.lengths {
            Lengths::Fixed => self.seq_len,
            _ if self.min_seq_len == 0 => (self.seq_len / 4).max(1),
            _ => self.min_seq_len,
        }
    }

    /// Sequence length of step `step` (1-based): a pure function of the config, the seed
    /// and the step, so a resumed or retried step sees the same length.
    pub fn seq_len_at(&self, seed: u64, step: u64) -> usize {
        let (lo, hi) = (self.min_len(), self.seq_len);
        match self.lengths {
            Lengths::Fixed => hi,
            Lengths::Ramp => {
                let done = step.saturating_sub(1).min(self.ramp_steps.max(1)) as f64
                    / self.ramp_steps.max(1) as f64;
                lo + ((hi - lo) as f64 * done).round() as usize
            }
            Lengths::Random => {
                let h = crate::units::splitmix64(crate::units::splitmix64(seed ^ 0x5eed) ^ step);
                lo + (h % (hi - lo + 1) as u64) as usize
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Share the token embedding with the output head.
    pub tie_weights: bool,
    /// What the matmuls compute in (`--precision`): `fp32`, or `bf16` autocast-style
    /// (linear layers and attention in bfloat16; master weights, AdamW moments, the loss
    /// and the norms' statistics in float32).
    pub precision: Precision,
    /// Which blocks recompute their activations in backward instead of keeping them
    /// (`--activation-checkpoint`): `none`, `blocks` (every block) or `every:N` (every
    /// N-th block).
    pub checkpoint: Checkpointing,
    /// CUDA runs in fp32: let matmuls and convolutions use TF32 tensor cores (about 10
    /// mantissa bits per product, float32 accumulation), as PyTorch's
    /// `set_float32_matmul_precision("high")`. No effect on the CPU.
    pub tf32: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            tie_weights: true,
            precision: Precision::Fp32,
            checkpoint: Checkpointing::None,
            tf32: true,
        }
    }
}

/// The compute precision of the built-in model (see [`ModelSection::precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    Fp32,
    Bf16,
    /// float16 autocast with a loss scaler: a Python run's half precision where the device
    /// has no bf16 (`half_precision="fp16"`); the built-in trainer has no scaler and
    /// refuses it.
    Fp16,
}

impl Precision {
    /// Bytes of one value computed at this precision.
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Bf16 | Precision::Fp16 => 2.0,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "float16" | "half" => Ok(Precision::Fp16),
            other => Err(format!(
                "{other:?} is not a precision; use fp32, bf16 or fp16"
            )),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// Activation checkpointing of the built-in model (see [`ModelSection::checkpoint`]):
/// written `none`, `blocks` or `every:N` in configs and on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum Checkpointing {
    #[default]
    None,
    /// Every block recomputes its activations in backward.
    Blocks,
    /// Blocks 0, N, 2N, ... recompute theirs; the others keep them (N ≥ 1).
    Every(usize),
}

impl Checkpointing {
    /// Whether block `i` (0-based) recomputes its activations in backward.
    pub fn recomputes(&self, i: usize) -> bool {
        match *self {
            Checkpointing::None => false,
            Checkpointing::Blocks => true,
            Checkpointing::Every(n) => i.is_multiple_of(n.max(1)),
        }
    }

    pub fn is_on(&self) -> bool {
        *self != Checkpointing::None
    }
}

impl std::str::FromStr for Checkpointing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        let bad =
            || format!("{s:?} is not a checkpointing mode; use none, blocks or every:N (N ≥ 1)");
        match t.as_str() {
            "none" | "off" => Ok(Checkpointing::None),
            "blocks" | "all" => Ok(Checkpointing::Blocks),
            _ => match t.strip_prefix("every:").map(|n| n.trim().parse::<usize>()) {
                Some(Ok(n)) if n >= 1 => Ok(Checkpointing::Every(n)),
                _ => Err(bad()),
            },
        }
    }
}

impl TryFrom<String> for Checkpointing {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Checkpointing> for String {
    fn from(c: Checkpointing) -> String {
        c.to_string()
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::Blocks => f.write_str("blocks"),
            Checkpointing::Every(n) => write!(f, "every:{n}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    pub lr: f64,
    /// Floor of the cosine decay.
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 20,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchSection {
    /// Sequences per forward/backward pass.
    pub micro_batch: usize,
    /// Sequences per optimizer step; micro-batches are accumulated to reach it. 0 means
    /// "same as micro_batch" (no accumulation).
    pub effective_batch: usize,
}

impl Default for BatchSection {
    fn default() -> Self {
        BatchSection {
            micro_batch: 8,
            effective_batch: 128,
        }
    }
}

impl BatchSection {
    /// Sequences per optimizer step.
    pub fn effective(&self) -> usize {
        if self.effective_batch == 0 {
            self.micro_batch
        } else {
            self.effective_batch
        }
    }

    /// Micro-batches per optimizer step; the last one may be smaller.
    pub fn accum_steps(&self) -> usize {
        self.effective().div_ceil(self.micro_batch.max(1))
    }
}

/// How headroom manages memory: thresholds, the budget, adaptation of the micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySection {
    /// Threshold preset (`--profile`): aggressive, balanced or conservative.
    pub profile: Profile,
    /// `target,warning,critical,emergency` overriding the profile (`--thresholds`); empty
    /// means the profile's.
    pub thresholds: String,
    /// CPU runs: the memory the run may use (`--memory-budget`, e.g. `6GiB`); empty means
    /// the host's total memory. CUDA runs use the device's memory.
    pub memory_budget: String,
    /// Make the budget a real allocation cap (RLIMIT_DATA; CPU runs, `--hard-limit`).
    pub hard_limit: bool,
    /// Let the controller resize the micro-batch (OOM recovery works either way).
    pub adaptive: bool,
    pub min_micro_batch: usize,
    /// 0 means the effective batch (the micro-batch never exceeds it).
    pub max_micro_batch: usize,
    /// Built-in trainer: when even the smallest micro-batch runs out of memory, turn
    /// activation checkpointing on (`model.checkpoint = "blocks"`) and retry the step,
    /// instead of stopping. Off by default: it changes the run's speed unasked.
    pub auto_checkpoint: bool,
    /// On a CUDA out-of-memory error, write what the caching allocator held (the pickle
    /// PyTorch's memory_viz reads) beside the checkpoints (`--oom-snapshot`). The CPU has
    /// no such allocator: there it is said and off.
    pub oom_snapshot: bool,
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection {
            profile: Profile::Balanced,
            thresholds: String::new(),
            memory_budget: "auto".into(),
            hard_limit: false,
            adaptive: true,
            min_micro_batch: 1,
            max_micro_batch: 0,
            auto_checkpoint: false,
            oom_snapshot: false,
        }
    }
}

impl MemorySection {
    /// The thresholds in force at the start: the override, else the profile's.
    pub fn thresholds(&self) -> Result<Thresholds, ConfigError> {
        if self.thresholds.trim().is_empty() {
            Ok(self.profile.thresholds())
        } else {
            Thresholds::parse(&self.thresholds)
                .map_err(|e| invalid("memory.thresholds (--thresholds)", e.0))
        }
    }

    /// The budget in bytes, when one was given.
    /// The budget in bytes when the config names a size; `None` for host memory (`""`)
    /// and for `"auto"`, which the trainer sizes from the machine ([`auto_budget`]).
    pub fn is_auto_budget(&self) -> bool {
        self.memory_budget.trim().eq_ignore_ascii_case("auto")
    }

    pub fn budget_bytes(&self) -> Result<Option<u64>, ConfigError> {
        if self.memory_budget.trim().is_empty() || self.is_auto_budget() {
            return Ok(None);
        }
        parse_bytes(&self.memory_budget)
            .map(Some)
            .map_err(|e| invalid("memory.memory_budget (--memory-budget)", e))
    }
}

/// `memory_budget = "auto"` on a CPU run: what the process holds once the model and its
/// optimizer state exist, plus [`AUTO_ROOM`] for activations, and never more than half of
/// what the machine has available on top of that. Small on purpose: the bundled default
/// then shows the controller fitting the batch to memory on any laptop, instead of a
/// tiny model idling at 2% of the host. Pure, so the rule is tested here and said on screen
/// by the trainer.
pub fn auto_budget(held: u64, available: u64) -> u64 {
    held + AUTO_ROOM.min(available / 2)
}

/// The room [`auto_budget`] gives activations above the process's own size.
pub const AUTO_ROOM: u64 = 320 << 20;

/// Largest batch accepted: beyond this a typo (an extra zero or three) is likelier than
/// intent, and the first step would try to allocate absurd memory.
pub const MAX_BATCH: usize = 1 << 16;
/// Deepest and widest models accepted before the memory check (which then compares the
/// model's size with the memory there is).
pub const MAX_LAYERS: usize = 4096;
pub const MAX_EMBD: usize = 1 << 16;
/// Below this no run can even hold libtorch; the trainer also checks the budget against
/// the process's own size once the model exists.
pub const MIN_BUDGET: u64 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceChoice {
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            _ => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| {
                    format!("device '{text}' is not one of auto, cpu, cuda, cuda:N (e.g. cuda:0)")
                }),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Auto => write!(f, "auto"),
            DeviceChoice::Cpu => write!(f, "cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum ConfigError {
    /// The file could not be read.
    Read { path: PathBuf, reason: String },
    /// Not TOML, an unknown key, or a value of the wrong type.
    Parse { path: PathBuf, reason: String },
    /// A value out of range; `key` is its dotted name, `fix` what to do.
    Invalid { key: String, reason: String },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, reason } => write!(
                f,
                "cannot read config {}: {reason}; check the path given to --config",
                path.display()
            ),
            ConfigError::Parse { path, reason } => write!(
                f,
                "config {} is invalid: {}; see configs/default.toml for every key",
                path.display(),
                reason.trim().replace('\n', " ")
            ),
            ConfigError::Invalid { key, reason } => write!(f, "{key}: {reason}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// `line N (`the line`): what is wrong`, on one line. toml's own rendering draws a
/// multi-line caret diagram that turns to noise once folded into one error line.
fn parse_reason(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    let Some(span) = e.span().filter(|s| s.start <= text.len()) else {
        return message;
    };
    let line = text[..span.start].matches('\n').count() + 1;
    let source = text.lines().nth(line - 1).unwrap_or("").trim();
    if source.is_empty() {
        return format!("line {line}: {message}");
    }
    let mut shown: String = source.chars().take(60).collect();
    if shown.len() < source.len() {
        shown.push_str("...");
    }
    format!("line {line} (`{shown}`): {message}")
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

impl RunConfig {
    pub fn from_toml_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            reason: parse_reason(text, &e),
        })
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::from_toml_str(&text, path)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a RunConfig always serializes")
    }

    pub fn device(&self) -> Result<DeviceChoice, ConfigError> {
        self.run.device_choice()
    }

    /// Where checkpoints go when no directory was configured.
    pub fn checkpoint_dir(&self) -> PathBuf {
        if self.run.checkpoint_dir.is_empty() {
            PathBuf::from("runs").join(&self.run.name)
        } else {
            PathBuf::from(&self.run.checkpoint_dir)
        }
    }

    /// Every range check, with the key and the fix in the message: section by section,
    /// the first failing check's message.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.run.validate()?;
        self.data.validate()?;
        self.model.validate()?;
        self.optim.validate()?;
        self.batch.validate()?;
        self.memory.validate()?;
        let b = &self.batch;
        if b.effective() < b.micro_batch {
            return Err(invalid(
                "batch.effective_batch (--effective-batch)",
                format!(
                    "{} is smaller than the micro-batch {}; raise it or lower --batch-size",
                    b.effective(),
                    b.micro_batch
                ),
            ));
        }
        Ok(())
    }
}

impl RunSection {
    fn device_choice(&self) -> Result<DeviceChoice, ConfigError> {
        DeviceChoice::parse(&self.device).map_err(|e| invalid("run.device", e))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.steps == 0 {
            return Err(invalid("run.steps (--steps)", "must be at least 1"));
        }
        // The name becomes a directory under runs/: it must stay one level down.
        let n = self.name.trim();
        if n.is_empty()
            || n == "."
            || n == ".."
            || self.name.contains(['/', '\\'])
            || self.name.chars().any(char::is_control)
            || self.name.len() > 128
        {
            return Err(invalid(
                "run.name",
                format!(
                    "{:?} must be a plain name (not . or .., no slashes or control \
                     characters, at most 128 bytes), e.g. \"shakespeare-small\"",
                    self.name
                ),
            ));
        }
        self.device_choice()?;
        if !(self.sample_hz > 0.0 && self.sample_hz <= 100.0) {
            return Err(invalid(
                "run.sample_hz",
                format!("{} is out of range; use a rate in (0, 100]", self.sample_hz),
            ));
        }
        if self.eval_batches == 0 {
            return Err(invalid("run.eval_batches", "must be at least 1"));
        }
        if self.threads > 1024 {
            return Err(invalid(
                "run.threads (--threads)",
                format!(
                    "{} is out of range; use 0 (libtorch's default) or a count up to the \
                     machine's cores",
                    self.threads
                ),
            ));
        }
        Ok(())
    }
}

impl DataSection {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(self.val_fraction > 0.0 && self.val_fraction <= 0.5) {
            return Err(invalid(
                "data.val_fraction",
                format!(
                    "{} is out of range; use a share in (0, 0.5]",
                    self.val_fraction
                ),
            ));
        }
        if self.seq_len < 2 || self.seq_len > 1 << 16 {
            return Err(invalid(
                "data.seq_len",
                format!("{} is out of range; use 2 to 65536 bytes", self.seq_len),
            ));
        }
        if self.lengths != Lengths::Fixed && self.min_seq_len > self.seq_len {
            return Err(invalid(
                "data.min_seq_len",
                format!(
                    "{} is above data.seq_len = {}; the shortest length must not exceed the longest",
                    self.min_seq_len, self.seq_len
                ),
            ));
        }
        Ok(())
    }
}

impl ModelSection {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.precision == Precision::Fp16 {
            return Err(invalid(
                "model.precision (--precision)",
                "fp16 needs a loss scaler, which the built-in trainer has not; use bf16 (the \
                 same memory, no scaler) or fp32",
            ));
        }
        if self.n_layer == 0 || self.n_head == 0 || self.n_embd == 0 {
            return Err(invalid(
                "model",
                "n_layer, n_head and n_embd must each be at least 1",
            ));
        }
        for (key, v, max) in [
            ("model.n_layer", self.n_layer, MAX_LAYERS),
            ("model.n_embd", self.n_embd, MAX_EMBD),
            ("model.n_head", self.n_head, self.n_embd),
        ] {
            if v > max {
                return Err(invalid(
                    key,
                    format!("{v} is out of range; use at most {max}"),
                ));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(invalid(
                "model.n_embd",
                format!(
                    "{} is not divisible by model.n_head = {}; pick n_embd a multiple of n_head",
                    self.n_embd, self.n_head
                ),
            ));
        }
        Ok(())
    }
}

impl OptimSection {
    fn validate(&self) -> Result<(), ConfigError> {
        // Every float is checked in a range that includes only values that train: a NaN
        // fails every comparison, so none can slip through as "off", and inf is refused.
        if !(self.lr > 0.0 && self.lr <= 10.0) {
            return Err(invalid(
                "optim.lr",
                format!(
                    "{} is out of range; use a rate in (0, 10], like 3e-3",
                    self.lr
                ),
            ));
        }
        if !(self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(invalid(
                "optim.min_lr",
                format!(
                    "{} must be between 0 and optim.lr = {}",
                    self.min_lr, self.lr
                ),
            ));
        }
        for (key, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(key, format!("{v} must be in [0, 1)")));
            }
        }
        if !(self.eps > 0.0 && self.eps <= 1.0) {
            return Err(invalid(
                "optim.eps",
                format!(
                    "{} is out of range; use a small positive number in (0, 1], like 1e-8",
                    self.eps
                ),
            ));
        }
        // AdamW shrinks each weight by lr × weight_decay per step: at 1 it zeroes them.
        if !(self.weight_decay >= 0.0 && self.weight_decay * self.lr < 1.0) {
            return Err(invalid(
                "optim.weight_decay",
                format!(
                    "{} is out of range; use 0 (off) up to below 1 / optim.lr, typically 0.1",
                    self.weight_decay
                ),
            ));
        }
        if !(self.grad_clip >= 0.0 && self.grad_clip.is_finite()) {
            return Err(invalid(
                "optim.grad_clip",
                format!(
                    "{} is out of range; use 0 to turn clipping off, or a positive norm like 1.0",
                    self.grad_clip
                ),
            ));
        }
        Ok(())
    }
}

impl BatchSection {
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("batch.micro_batch (--batch-size)", self.micro_batch),
            (
                "batch.effective_batch (--effective-batch)",
                self.effective(),
            ),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
            if v > MAX_BATCH {
                return Err(invalid(
                    key,
                    format!("{v} is absurdly large; use at most {MAX_BATCH}"),
                ));
            }
        }
        Ok(())
    }
}

impl MemorySection {
    fn validate(&self) -> Result<(), ConfigError> {
        self.thresholds()?;
        if let Some(b) = self.budget_bytes()? {
            if b < MIN_BUDGET {
                return Err(invalid(
                    "memory.memory_budget (--memory-budget)",
                    format!(
                        "{} is below the {} that libtorch and the smallest model need \
                         before training anything; give e.g. 1GiB",
                        crate::units::fmt_bytes(b),
                        crate::units::fmt_bytes(MIN_BUDGET)
                    ),
                ));
            }
        }
        if self.hard_limit && self.memory_budget.trim().is_empty() {
            return Err(invalid(
                "memory.hard_limit (--hard-limit)",
                "needs a budget to enforce; give --memory-budget SIZE (e.g. 2GiB)",
            ));
        }
        if self.min_micro_batch == 0 {
            return Err(invalid("memory.min_micro_batch", "must be at least 1"));
        }
        if self.max_micro_batch != 0 && self.max_micro_batch < self.min_micro_batch {
            return Err(invalid(
                "memory.max_micro_batch",
                format!(
                    "{} is below memory.min_micro_batch = {}; raise it or use 0 (the effective batch)",
                    self.max_micro_batch, self.min_micro_batch
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RunConfig, ConfigError> {
        RunConfig::from_toml_str(text, Path::new("test.toml"))
    }

    #[test]
    fn shipped_configs_parse_and_validate() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&root).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let cfg = RunConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
                cfg.validate()
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen += 1;
            }
        }
        assert!(seen >= 2, "expected default.toml and a GPU preset");
    }

    #[test]
    fn the_auto_budget_leaves_room_above_the_process_within_what_is_free() {
        assert_eq!(auto_budget(400 << 20, 16 << 30), (400 << 20) + AUTO_ROOM);
        // A crowded machine: never more than half of what is still available.
        assert_eq!(auto_budget(400 << 20, 200 << 20), 500 << 20);
        let c = RunConfig::default();
        assert!(c.memory.is_auto_budget() && c.memory.budget_bytes().unwrap().is_none());
    }

    #[test]
    fn default_toml_matches_built_in_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/default.toml");
        assert_eq!(RunConfig::load(&path).unwrap(), RunConfig::default());
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("[model]\nn_layers = 3\n").unwrap_err().to_string();
        assert!(err.contains("n_layers"), "{err}");
        assert!(err.contains("test.toml"), "{err}");
        let err = parse("[modle]\n").unwrap_err().to_string();
        assert!(err.contains("modle"), "{err}");
    }

    #[test]
    fn malformed_toml_and_wrong_types_are_parse_errors() {
        assert!(matches!(parse("[run\n"), Err(ConfigError::Parse { .. })));
        let err = parse("[run]\nsteps = \"many\"\n").unwrap_err().to_string();
        assert!(err.contains("steps"), "{err}");
        // One readable line: where, the line itself, what is wrong.
        assert!(
            err.contains("line 2 (`steps = \"many\"`): invalid type"),
            "{err}"
        );
        assert!(!err.contains('\n') && !err.contains('^'), "{err}");
    }

    /// Every float that cannot train is refused by name (NaN included, which would
    /// otherwise compare its way past a range check and silently mean "off"), and so are a
    /// run name that leaves runs/, an absurd model and a budget below libtorch's own size.
    #[test]
    fn values_that_cannot_train_are_refused_by_key() {
        type Edit = fn(&mut RunConfig);
        let cases: Vec<(Edit, &str)> = vec![
            (|c| c.optim.eps = f64::INFINITY, "optim.eps"),
            (|c| c.optim.eps = f64::NAN, "optim.eps"),
            (|c| c.optim.eps = 0.0, "optim.eps"),
            (|c| c.optim.lr = f64::INFINITY, "optim.lr"),
            (|c| c.optim.lr = 1e6, "optim.lr"),
            (|c| c.optim.min_lr = f64::NAN, "optim.min_lr"),
            (|c| c.optim.grad_clip = f64::NAN, "optim.grad_clip"),
            (|c| c.optim.grad_clip = f64::INFINITY, "optim.grad_clip"),
            (|c| c.optim.weight_decay = f64::NAN, "optim.weight_decay"),
            (|c| c.optim.weight_decay = 1e4, "optim.weight_decay"),
            (|c| c.optim.beta1 = f64::NAN, "optim.beta1"),
            (|c| c.data.val_fraction = f64::NAN, "data.val_fraction"),
            (|c| c.run.sample_hz = f64::NAN, "run.sample_hz"),
            (|c| c.run.name = "..".into(), "run.name"),
            (|c| c.run.name = ".".into(), "run.name"),
            (|c| c.run.name = "a/../../b".into(), "run.name"),
            (|c| c.run.name = "tab\there".into(), "run.name"),
            (|c| c.model.n_layer = 1_000_000, "model.n_layer"),
            (|c| c.model.n_embd = 1 << 20, "model.n_embd"),
            (|c| c.memory.memory_budget = "1".into(), "--memory-budget"),
            (
                |c| c.memory.memory_budget = "1MiB".into(),
                "--memory-budget",
            ),
            (
                |c| c.memory.thresholds = "0.9,0.92,0.95,NaN".into(),
                "threshold",
            ),
        ];
        for (edit, key) in cases {
            let mut c = RunConfig::default();
            edit(&mut c);
            let err = c.validate().map(|_| ()).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        // The values a user would write still pass.
        let mut c = RunConfig::default();
        c.optim.grad_clip = 0.0;
        c.optim.weight_decay = 0.0;
        c.run.name = "shakespeare-small.v2".into();
        c.memory.memory_budget = "512MiB".into();
        c.validate().unwrap();
    }

    #[test]
    fn range_errors_name_the_key_and_flag() {
        let mut c = RunConfig::default();
        c.batch.micro_batch = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--batch-size"));
        let mut c = RunConfig::default();
        c.batch.micro_batch = 1 << 20;
        assert!(c.validate().unwrap_err().to_string().contains("absurdly"));
        let mut c = RunConfig::default();
        c.model.n_embd = 130;
        assert!(c.validate().unwrap_err().to_string().contains("n_head"));
        let mut c = RunConfig::default();
        c.batch.micro_batch = 16;
        c.batch.effective_batch = 8;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("smaller than the micro-batch"));
        let mut c = RunConfig::default();
        c.run.device = "tpu".into();
        assert!(c.validate().unwrap_err().to_string().contains("cuda:N"));
    }

    #[test]
    fn memory_section_parses_and_rejects_bad_thresholds() {
        let c = parse(
            "[memory]\nprofile = \"conservative\"\nmemory_budget = \"2GiB\"\nhard_limit = true\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.memory.thresholds().unwrap(),
            Profile::Conservative.thresholds()
        );
        assert_eq!(c.memory.budget_bytes().unwrap(), Some(2 << 30));
        let c = parse("[memory]\nthresholds = \"0.8,0.85,0.9,0.95\"\n").unwrap();
        assert_eq!(c.memory.thresholds().unwrap().target, 0.8);
        // Out of order: the key and the reason are named.
        let c = parse("[memory]\nthresholds = \"0.9,0.85,0.95,0.97\"\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("memory.thresholds") && err.contains("strictly"),
            "{err}"
        );
        let err = parse("[memory]\nprofile = \"greedy\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("greedy"), "{err}");
        let mut c = RunConfig::default();
        c.memory.memory_budget = "lots".into();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--memory-budget"));
        let mut c = RunConfig::default();
        c.memory.memory_budget = String::new();
        c.memory.hard_limit = true;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--memory-budget"));
    }

    #[test]
    fn sequence_lengths_follow_the_schedule() {
        let mut d = DataSection {
            seq_len: 128,
            ..Default::default()
        };
        assert!((1..50).all(|s| d.seq_len_at(1, s) == 128));
        d.lengths = Lengths::Ramp;
        d.ramp_steps = 10;
        assert_eq!(d.seq_len_at(1, 1), 32, "starts at a quarter");
        assert_eq!(d.seq_len_at(1, 6), 80);
        assert_eq!(d.seq_len_at(1, 11), 128);
        assert_eq!(d.seq_len_at(1, 500), 128);
        d.lengths = Lengths::Random;
        d.min_seq_len = 100;
        let lens: Vec<usize> = (1..200).map(|s| d.seq_len_at(7, s)).collect();
        assert!(lens.iter().all(|l| (100..=128).contains(l)));
        assert!(
            lens.contains(&100) && lens.contains(&128),
            "both ends drawn"
        );
        assert_eq!(
            lens,
            (1..200).map(|s| d.seq_len_at(7, s)).collect::<Vec<_>>()
        );
        let mut c = RunConfig::default();
        c.data.lengths = Lengths::Random;
        c.data.min_seq_len = 65;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("data.min_seq_len"), "{err}");
    }

    #[test]
    fn precision_and_checkpointing_parse_and_bad_values_name_the_choices() {
        let c = parse("[model]\nprecision = \"bf16\"\ncheckpoint = \"every:2\"\n").unwrap();
        assert_eq!(c.model.precision, Precision::Bf16);
        assert_eq!(c.model.checkpoint, Checkpointing::Every(2));
        assert!(c.model.checkpoint.recomputes(0) && !c.model.checkpoint.recomputes(1));
        assert!(c.model.checkpoint.recomputes(4));
        // Written back as it was read: a checkpoint's state.json round-trips.
        assert_eq!(parse(&c.to_toml()).unwrap(), c);
        let c = parse("[model]\ncheckpoint = \"blocks\"\n").unwrap();
        assert!((0..5).all(|i| c.model.checkpoint.recomputes(i)));
        for bad in ["every:0", "every:x", "some"] {
            let err = parse(&format!("[model]\ncheckpoint = \"{bad}\"\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("none, blocks or every:N"), "{err}");
        }
        // fp16 reads (a Python run's half precision) but the built-in trainer refuses it.
        let err = parse("[model]\nprecision = \"fp16\"\n")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("fp16 needs a loss scaler"), "{err}");
        assert!(err.contains("use bf16"), "{err}");
        assert_eq!("fp16".parse::<Precision>(), Ok(Precision::Fp16));
        assert!("fp8"
            .parse::<Precision>()
            .unwrap_err()
            .contains("fp32, bf16 or fp16"));
    }

    #[test]
    fn accumulation_rounds_up() {
        let b = BatchSection {
            micro_batch: 12,
            effective_batch: 32,
        };
        assert_eq!(b.accum_steps(), 3);
        let b = BatchSection {
            micro_batch: 8,
            effective_batch: 0,
        };
        assert_eq!((b.effective(), b.accum_steps()), (8, 1));
    }

    #[test]
    fn devices_parse() {
        assert_eq!(DeviceChoice::parse("CUDA:1"), Ok(DeviceChoice::Cuda(1)));
        assert_eq!(DeviceChoice::parse("cuda"), Ok(DeviceChoice::Cuda(0)));
        assert_eq!(DeviceChoice::parse("auto"), Ok(DeviceChoice::Auto));
        assert!(DeviceChoice::parse("cuda:x").is_err());
    }
}
