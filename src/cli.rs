//! The command line. Flags that overlap a config key override it; see configs/default.toml.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use headroom_core::RunConfig;
use headroom_viewer::ViewCommand;

#[derive(Debug, Parser)]
#[command(
    name = "headroom",
    version,
    about = "Train a model and watch its memory headroom live in the terminal"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Debug, Subcommand)]
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Commands {
    /// Train a byte-level GPT with a live memory dashboard (headless when not a terminal)
    Train(TrainArgs),
    /// Before a run: where one step's memory goes for the built-in model, and the largest
    /// micro-batch each precision × checkpointing choice fits under target
    Plan(PlanArgs),
    #[command(flatten)]
    View(ViewCommand),
}

#[derive(Debug, Clone, Default, Args)]
pub struct TrainArgs {
    /// TOML config (default: the built-in defaults, same as configs/default.toml)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Text file to train on (default: bundled tinyshakespeare)
    #[arg(long, value_name = "FILE")]
    pub corpus: Option<PathBuf>,
    /// auto, cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Total optimizer steps (including resumed ones)
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Micro-batch: sequences per forward/backward pass, where the controller starts (raises
    /// the effective batch to N when that is smaller and not given)
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Sequences per optimizer step (micro-batches are accumulated to reach it)
    #[arg(long, value_name = "N")]
    pub effective_batch: Option<usize>,
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// libtorch intra-op threads (0: one per core); fewer can be faster on a busy machine
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Compute precision: fp32, or bf16 (autocast-style: matmuls and attention in
    /// bfloat16, weights and optimizer state in float32); may change on --resume
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<headroom_core::Precision>,
    /// Activation checkpointing: none, blocks (every block recomputes its activations in
    /// backward) or every:N (every N-th block); may change on --resume
    #[arg(long, value_name = "none|blocks|every:N")]
    pub activation_checkpoint: Option<headroom_core::Checkpointing>,
    /// No dashboard: progress lines on stderr (automatic when stdout is not a terminal)
    #[arg(long)]
    pub headless: bool,
    /// Write every telemetry record and event as JSON lines (docs/LOG_SCHEMA.md); a name
    /// ending in .zst is written zstd-compressed (`zstdcat FILE | jq`), about 100 bytes a
    /// step
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Close the log at a size (256MiB) or an age (12h, 1d) and go on in a fresh file; the
    /// closed ones are FILE's numbered segments (run.1.jsonl.zst, …), replayed as one log
    #[arg(long, value_name = "SIZE|AGE", requires = "log")]
    pub log_rotate: Option<headroom_core::logfile::Rotate>,
    /// Steps between checkpoints (0: only when the run ends or stops)
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Where checkpoints go (default: runs/<run name>)
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue a run from its checkpoint directory (or one step-NNNNNN directory in it)
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Start a fresh run in a checkpoint directory that holds another run's checkpoints,
    /// deleting them (without this, such a start is refused)
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// With --resume: accept a corpus whose content changed since the checkpoint (what the
    /// run learns from changes)
    #[arg(long, requires = "resume")]
    pub allow_changed_corpus: bool,
    /// Close the dashboard as soon as the run completes (default: keep it until q)
    #[arg(long)]
    pub close_on_finish: bool,
    /// Threshold preset: aggressive, balanced or conservative
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    /// Thresholds as fractions of usable memory: target,warning,critical,emergency
    #[arg(long, value_name = "T,W,C,E")]
    pub thresholds: Option<String>,
    /// Memory the run may use on CPU (e.g. 6GiB, 512MiB); default: host memory
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Make --memory-budget a real allocation cap (RLIMIT_DATA), so overruns fail for real
    #[arg(long)]
    pub hard_limit: bool,
    /// On a CUDA out-of-memory error, write the allocator's snapshot (PyTorch memory_viz's
    /// pickle) beside the checkpoints
    #[arg(long)]
    pub oom_snapshot: bool,
    /// Raise an out-of-memory error inside these steps (testing recovery); also
    /// HEADROOM_INJECT_OOM
    #[arg(long, value_name = "STEP[,STEP...]", value_delimiter = ',')]
    pub inject_oom: Vec<u64>,
    /// Also serve the stream on TCP: PORT or :PORT (loopback), or HOST:PORT (that address);
    /// viewers need the token the run writes beside its socket
    #[arg(long, value_name = "[HOST:]PORT")]
    pub listen: Option<String>,
    /// What SIGUSR1 asks: stop (checkpoint and exit, as SIGTERM; SLURM's --signal=USR1@T
    /// warning) or checkpoint (save at the step's end and go on)
    #[arg(long, value_name = "stop|checkpoint")]
    pub on_usr1: Option<headroom_core::OnUserSignal>,
    /// What SIGUSR2 asks: stop or checkpoint, as --on-usr1
    #[arg(long, value_name = "stop|checkpoint")]
    pub on_usr2: Option<headroom_core::OnUserSignal>,
}

#[derive(Debug, Clone, Default, Args)]
pub struct PlanArgs {
    /// TOML config (default: the built-in defaults, same as configs/default.toml)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// auto, cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// The micro-batch to plan for; the probe measures half of it and all of it
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// The precision the probe runs in: fp32 or bf16 (the other rows are scaled from it;
    /// fp16 is a Python run's, the built-in trainer has no loss scaler)
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<headroom_core::Precision>,
    /// The checkpointing the probe runs with: none, blocks or every:N
    #[arg(long, value_name = "none|blocks|every:N")]
    pub activation_checkpoint: Option<headroom_core::Checkpointing>,
    /// Memory a CPU run may use (e.g. 6GiB); default: the config's (auto: as a run sizes it)
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// libtorch intra-op threads (0: one per core)
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

impl PlanArgs {
    /// The config a `headroom train` with the same flags would run.
    pub fn resolve(&self) -> Result<RunConfig> {
        TrainArgs {
            config: self.config.clone(),
            device: self.device.clone(),
            batch_size: self.batch_size,
            precision: self.precision,
            activation_checkpoint: self.activation_checkpoint,
            memory_budget: self.memory_budget.clone(),
            threads: self.threads,
            ..TrainArgs::default()
        }
        .resolve(None)
    }
}

/// The step to panic in, from `HEADROOM_INJECT_PANIC` (tests of the trainer-panic path;
/// deliberately not a flag).
pub fn inject_panic_step(env: Option<&str>) -> Result<Option<u64>> {
    match env.map(str::trim).filter(|t| !t.is_empty()) {
        None => Ok(None),
        Some(t) => t.parse().map(Some).map_err(|_| {
            anyhow::anyhow!("HEADROOM_INJECT_PANIC={t:?} is not a step number; unset it or give one step, e.g. 5")
        }),
    }
}

/// Steps to inject out-of-memory errors at: `--inject-oom` and `HEADROOM_INJECT_OOM`.
pub fn inject_oom_steps(args: &TrainArgs, env: Option<&str>) -> Result<Vec<u64>> {
    let mut steps = args.inject_oom.clone();
    if let Some(text) = env.filter(|t| !t.trim().is_empty()) {
        for part in text.split(',') {
            let step = part.trim().parse::<u64>().with_context(|| {
                format!(
                    "HEADROOM_INJECT_OOM='{text}': '{part}' is not a step number; give e.g. 3,10"
                )
            })?;
            steps.push(step);
        }
    }
    if steps.contains(&0) {
        bail!("--inject-oom: steps count from 1; 0 is not a step");
    }
    steps.sort_unstable();
    steps.dedup();
    Ok(steps)
}

/// Validation chunks to inject out-of-memory errors at, from `HEADROOM_INJECT_EVAL_OOM`
/// (tests of validation's recovery; deliberately not a flag): 1-based, counting only the
/// chunks of more than one window, over the whole run.
pub fn inject_eval_oom_chunks(env: Option<&str>) -> Result<Vec<u64>> {
    let Some(text) = env.filter(|t| !t.trim().is_empty()) else {
        return Ok(Vec::new());
    };
    let mut chunks = Vec::new();
    for part in text.split(',') {
        match part.trim().parse::<u64>() {
            Ok(n) if n > 0 => chunks.push(n),
            _ => bail!(
                "HEADROOM_INJECT_EVAL_OOM='{text}': '{part}' is not a chunk number (they count \
                 from 1); give e.g. 1,3"
            ),
        }
    }
    chunks.sort_unstable();
    chunks.dedup();
    Ok(chunks)
}

impl TrainArgs {
    /// The config this run uses: the file (or defaults) with the flags applied, or, when
    /// resuming, the checkpoint's own config with only the flags that cannot change what
    /// is learned.
    pub fn resolve(&self, resumed: Option<RunConfig>) -> Result<RunConfig> {
        let resuming = resumed.is_some();
        let mut cfg = match resumed {
            Some(cfg) => {
                if self.config.is_some() {
                    bail!("--resume takes the run's config from its checkpoint; drop --config");
                }
                // --corpus may name where the same content lives now: the trainer checks
                // it against the checkpoint's digest.
                for (flag, given) in [
                    ("--effective-batch", self.effective_batch.is_some()),
                    ("--seed", self.seed.is_some()),
                ] {
                    if given {
                        bail!("{flag} cannot change when resuming (it would change what is learned); drop it or start a new run");
                    }
                }
                cfg
            }
            None => match &self.config {
                Some(path) => RunConfig::load(path)?,
                None => RunConfig::default(),
            },
        };
        if let Some(c) = &self.corpus {
            cfg.data.corpus = c.to_string_lossy().into_owned();
        }
        if let Some(d) = &self.device {
            cfg.run.device = d.clone();
        }
        if let Some(n) = self.steps {
            cfg.run.steps = n;
        }
        // On a resume, --batch-size only says where the controller starts (see
        // `start_micro_batch`): the config's micro-batch also fixes the effective batch
        // (when it is 0) and the validation set, which must not change mid-run.
        if let (Some(n), false) = (self.batch_size, resuming) {
            cfg.batch.micro_batch = n;
            // A micro-batch beyond the configured effective batch, with none asked for:
            // the user means to train on batches of n, not to meet an error about a
            // default they never set.
            if self.effective_batch.is_none() && cfg.batch.effective_batch != 0 {
                cfg.batch.effective_batch = cfg.batch.effective_batch.max(n);
            }
        }
        if let Some(n) = self.effective_batch {
            cfg.batch.effective_batch = n;
        }
        if let Some(n) = self.seed {
            cfg.run.seed = n;
        }
        if let Some(n) = self.threads {
            cfg.run.threads = n;
        }
        // Both levers change memory and speed, not the model or its data: a resume may
        // change them (the trainer says so).
        if let Some(p) = self.precision {
            cfg.model.precision = p;
        }
        if let Some(c) = self.activation_checkpoint {
            cfg.model.checkpoint = c;
        }
        if let Some(n) = self.checkpoint_every {
            cfg.run.checkpoint_every = n;
        }
        if let Some(dir) = &self.checkpoint_dir {
            cfg.run.checkpoint_dir = dir.to_string_lossy().into_owned();
        } else if let Some(dir) = &self.resume {
            // A resumed run goes on saving where it was resumed from: the directory its
            // config named may be relative to wherever it first ran (`--resume
            // ../backup/ck` must not write to, and prune, `./ck`).
            cfg.run.checkpoint_dir = headroom_trainer::checkpoint::root_of(dir)
                .to_string_lossy()
                .into_owned();
        }
        if let Some(p) = &self.profile {
            cfg.memory.profile = p.parse().map_err(|e| anyhow::anyhow!("--profile: {e}"))?;
            // A profile given on the command line wins over thresholds from the file.
            if self.thresholds.is_none() {
                cfg.memory.thresholds.clear();
            }
        }
        if let Some(t) = &self.thresholds {
            cfg.memory.thresholds = t.clone();
        }
        if let Some(b) = &self.memory_budget {
            cfg.memory.memory_budget = b.clone();
        }
        if self.hard_limit {
            cfg.memory.hard_limit = true;
        }
        if self.oom_snapshot {
            cfg.memory.oom_snapshot = true;
        }
        if let Some(a) = self.on_usr1 {
            cfg.run.on_usr1 = a;
        }
        if let Some(a) = self.on_usr2 {
            cfg.run.on_usr2 = a;
        }
        cfg.validate().context("invalid configuration")?;
        if let Some(n) = self.start_micro_batch() {
            if n == 0 || n > cfg.batch.effective() {
                bail!(
                    "--batch-size {n} is outside 1..={} (the run's effective batch); give a \
                     micro-batch within it",
                    cfg.batch.effective()
                );
            }
        }
        Ok(cfg)
    }

    /// On a resume, the micro-batch the controller starts from (`--batch-size`); the
    /// checkpoint's own settled size otherwise.
    pub fn start_micro_batch(&self) -> Option<usize> {
        self.resume.as_ref().and(self.batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> TrainArgs {
        let mut argv = vec!["headroom", "train"];
        argv.extend_from_slice(list);
        match Cli::try_parse_from(argv).unwrap().command {
            Commands::Train(a) => a,
            other => panic!("not a train command: {other:?}"),
        }
    }

    #[test]
    fn flags_override_config_keys() {
        let cfg = args(&[
            "--steps",
            "7",
            "--batch-size",
            "4",
            "--effective-batch",
            "12",
        ])
        .resolve(None)
        .unwrap();
        assert_eq!(cfg.run.steps, 7);
        assert_eq!((cfg.batch.micro_batch, cfg.batch.effective()), (4, 12));
    }

    #[test]
    fn user_signal_flags_override_the_file_and_bad_values_name_the_choices() {
        use headroom_core::OnUserSignal;
        let cfg = args(&["--on-usr1", "checkpoint"]).resolve(None).unwrap();
        assert_eq!(cfg.run.on_usr1, OnUserSignal::Checkpoint);
        assert_eq!(cfg.run.on_usr2, OnUserSignal::Stop, "the default");
        let err = Cli::try_parse_from(["headroom", "train", "--on-usr2", "pause"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("stop or checkpoint"), "{err}");
    }

    #[test]
    fn lever_flags_override_the_config_and_may_change_on_resume() {
        use headroom_core::{Checkpointing, Precision};
        let a = args(&["--precision", "bf16", "--activation-checkpoint", "every:2"]);
        for resumed in [None, Some(RunConfig::default())] {
            let cfg = a.resolve(resumed).unwrap();
            assert_eq!(cfg.model.precision, Precision::Bf16);
            assert_eq!(cfg.model.checkpoint, Checkpointing::Every(2));
        }
        for (flag, value, needle) in [
            ("--precision", "fp8", "fp32, bf16 or fp16"),
            ("--activation-checkpoint", "every:0", "every:N"),
        ] {
            let err = Cli::try_parse_from(["headroom", "train", flag, value])
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err}");
        }
        // fp16 parses (a Python run's half precision); the built-in trainer refuses it.
        let err = args(&["--precision", "fp16"]).resolve(None).unwrap_err();
        assert!(
            format!("{err:#}").contains("fp16 needs a loss scaler"),
            "{err:#}"
        );
    }

    #[test]
    fn zero_batch_is_an_error_naming_the_flag() {
        let err = args(&["--batch-size", "0"]).resolve(None).unwrap_err();
        assert!(format!("{err:#}").contains("--batch-size"), "{err:#}");
    }

    #[test]
    fn memory_flags_override_and_bad_values_name_the_flag() {
        let cfg = args(&[
            "--profile",
            "conservative",
            "--memory-budget",
            "2GiB",
            "--hard-limit",
        ])
        .resolve(None)
        .unwrap();
        assert_eq!(
            cfg.memory.thresholds().unwrap(),
            headroom_core::policy::Profile::Conservative.thresholds()
        );
        assert_eq!(cfg.memory.budget_bytes().unwrap(), Some(2 << 30));
        assert!(cfg.memory.hard_limit);
        let cfg = args(&["--thresholds", "0.5,0.6,0.7,0.8"])
            .resolve(None)
            .unwrap();
        assert_eq!(cfg.memory.thresholds().unwrap().target, 0.5);
        for (flags, needle) in [
            (&["--thresholds", "0.9,0.8,0.95,0.97"][..], "--thresholds"),
            (&["--thresholds", "0.9,0.92"][..], "four"),
            (&["--profile", "greedy"][..], "--profile"),
            (&["--memory-budget", "lots"][..], "--memory-budget"),
            (
                &["--hard-limit", "--memory-budget", ""][..],
                "--memory-budget",
            ),
        ] {
            let err = format!("{:#}", args(flags).resolve(None).unwrap_err());
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
    }

    #[test]
    fn injected_oom_steps_come_from_the_flag_and_the_environment() {
        let a = args(&["--inject-oom", "5,2"]);
        assert_eq!(inject_oom_steps(&a, Some("9, 2")).unwrap(), vec![2, 5, 9]);
        assert_eq!(inject_oom_steps(&a, None).unwrap(), vec![2, 5]);
        let err = inject_oom_steps(&a, Some("3,x")).unwrap_err().to_string();
        assert!(
            err.contains("HEADROOM_INJECT_OOM") && err.contains("'x'"),
            "{err}"
        );
        let err = inject_oom_steps(&args(&["--inject-oom", "0"]), None).unwrap_err();
        assert!(err.to_string().contains("from 1"), "{err}");
    }

    #[test]
    fn injected_validation_ooms_come_from_the_environment() {
        assert_eq!(inject_eval_oom_chunks(None).unwrap(), Vec::<u64>::new());
        assert_eq!(
            inject_eval_oom_chunks(Some(" ")).unwrap(),
            Vec::<u64>::new()
        );
        assert_eq!(inject_eval_oom_chunks(Some("3, 1,3")).unwrap(), vec![1, 3]);
        for bad in ["x", "0", "2,-1"] {
            let err = inject_eval_oom_chunks(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("HEADROOM_INJECT_EVAL_OOM"), "{bad}: {err}");
        }
    }

    #[test]
    fn resume_refuses_flags_that_change_learning() {
        let err = args(&["--seed", "3"])
            .resolve(Some(RunConfig::default()))
            .unwrap_err();
        assert!(err.to_string().contains("--seed"), "{err}");
        let cfg = args(&["--steps", "900"])
            .resolve(Some(RunConfig::default()))
            .unwrap();
        assert_eq!(cfg.run.steps, 900);
    }

    #[test]
    fn batch_size_on_resume_moves_the_start_not_what_is_learned() {
        let mut saved = RunConfig::default();
        saved.batch.micro_batch = 32;
        saved.batch.effective_batch = 0;
        let a = args(&["--resume", "ck", "--batch-size", "8"]);
        let cfg = a.resolve(Some(saved.clone())).unwrap();
        assert_eq!(cfg.batch.micro_batch, 32, "the validation set follows this");
        assert_eq!(cfg.batch.effective(), 32, "the effective batch stays");
        assert_eq!(a.start_micro_batch(), Some(8));
        let err = args(&["--resume", "ck", "--batch-size", "64"])
            .resolve(Some(saved))
            .unwrap_err();
        assert!(err.to_string().contains("--batch-size 64"), "{err}");
        assert_eq!(args(&["--batch-size", "8"]).start_micro_batch(), None);
    }
}
