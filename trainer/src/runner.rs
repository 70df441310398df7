//! The trainer thread: prepares everything, then steps, evaluates and checkpoints while
//! answering the UI's commands at step boundaries.
//!
//! Every tensor lives and dies on this thread; only telemetry and the final summary leave
//! it. Preparation happens on the thread too (libtorch state is per thread in places,
//! e.g. grad mode), and its outcome is reported back before [`spawn`] returns, so bad
//! input is a one-line error before any dashboard starts.
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

use std::collections::BTreeSet;

use crossbeam_channel::{bounded, Receiver, TryRecvError};
use headroom_core::config::{Checkpointing, Precision};
use headroom_core::plan::{Lever, Plan};
use headroom_core::policy::{
    ControllerConfig, Decision, Profile, StepObservation, Thresholds, Upcoming,
};
use headroom_core::units::fmt_bytes;
use headroom_core::{
    Bus, Command, EvalMetrics, Level, MemoryParts, MemorySummary, Notice, PlanCheck, PlanSplit,
    RunConfig, RunInfo, RunStatus, RunSummary, StepMemory, StepMetrics, Telemetry,
};
use headroom_host::procmem;
use tch::{Device, TchError, Tensor};

use crate::checkpoint::{self, CheckpointError, CheckpointState, CorpusRecord};
use crate::data::{DataError, Dataset};
use crate::device::{self, DeviceError};
use crate::heap_watch::{self, HeapWatch};
use crate::journal::{Call, ControllerJournal, Journaled};
use crate::levers::{Measured, PendingSwitch};
use crate::model::Gpt;
use crate::oom;
use crate::optim::{AdamW, AdamWConfig};
use crate::peak::PeakMeter;
use crate::plan_probe;
use crate::schedule::Schedule;
use crate::snapshot;
use crate::step::{self, StepPlan, Stepped};
use crate::stop::StopSwitch;

/// Steps ahead the controller is told about lengths (a ramp or random lengths), so it can
/// shrink before a longer one arrives rather than meet it at critical.
const LENGTH_HORIZON: u64 = 16;

pub struct TrainOptions {
    /// The run's configuration, validated.
    pub config: RunConfig,
    pub checkpoint_dir: PathBuf,
    /// A checkpoint root or step directory to continue from.
    pub resume: Option<PathBuf>,
    /// Steps (1-based) whose first attempt raises a real out-of-memory error inside the
    /// step (`--inject-oom`, `HEADROOM_INJECT_OOM`).
    pub inject_oom: Vec<u64>,
    /// A step whose first attempt panics inside the step (`HEADROOM_INJECT_PANIC`): the
    /// path a bug in the trainer takes, for the tests that the screen, the exit code and
    /// the terminal survive one.
    pub inject_panic: Option<u64>,
    /// A fresh run may delete another run's checkpoints in `checkpoint_dir`.
    pub overwrite: bool,
    /// A resume may train on a corpus whose content changed since the checkpoint.
    pub allow_changed_corpus: bool,
    /// How long a FIFO corpus may go without a writer.
    pub fifo_wait: std::time::Duration,
    /// On a resume, where the controller starts (`--batch-size`); else the checkpoint's.
    pub start_micro_batch: Option<usize>,
    /// Seen between micro-batches: a stop gives the step in progress up (see
    /// [`StopSwitch`]). The trainer sets it itself when a stop command arrives mid-step.
    pub stop: StopSwitch,
}

impl TrainOptions {
    /// A fresh run of `config` into `checkpoint_dir`, nothing injected or overridden.
    pub fn new(config: RunConfig, checkpoint_dir: PathBuf) -> TrainOptions {
        TrainOptions {
            config,
            checkpoint_dir,
            resume: None,
            inject_oom: Vec::new(),
            inject_panic: None,
            overwrite: false,
            allow_changed_corpus: false,
            fifo_wait: crate::data::FIFO_WAIT,
            start_micro_batch: None,
            stop: StopSwitch::new(),
        }
    }
}

/// Why a run could not start.
#[derive(Debug)]
pub enum TrainError {
    Config(String),
    Data(DataError),
    Device(DeviceError),
    Checkpoint(CheckpointError),
    /// libtorch failed while building the model or optimizer.
    Torch(String),
    /// The trainer thread could not start or died while preparing.
    Thread(String),
}

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainError::Config(m) | TrainError::Torch(m) | TrainError::Thread(m) => f.write_str(m),
            TrainError::Data(e) => e.fmt(f),
            TrainError::Device(e) => e.fmt(f),
            TrainError::Checkpoint(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for TrainError {}

impl From<DataError> for TrainError {
    fn from(e: DataError) -> Self {
        TrainError::Data(e)
    }
}

impl From<DeviceError> for TrainError {
    fn from(e: DeviceError) -> Self {
        TrainError::Device(e)
    }
}

impl From<CheckpointError> for TrainError {
    fn from(e: CheckpointError) -> Self {
        TrainError::Checkpoint(e)
    }
}

pub struct TrainerHandle {
    thread: JoinHandle<Result<RunSummary, String>>,
    device: Device,
    checkpoint_dir: PathBuf,
}

impl TrainerHandle {
    /// Waits for the run to end: its summary, or why it failed (also sent as
    /// `Telemetry::Failed`).
    pub fn join(self) -> Result<RunSummary, String> {
        self.thread
            .join()
            .unwrap_or_else(|p| Err(format!("the trainer panicked: {}", panic_text(&p))))
    }

    /// The CUDA device the run trains on; `None` on the CPU.
    pub fn cuda_index(&self) -> Option<usize> {
        match self.device {
            Device::Cuda(n) => Some(n),
            _ => None,
        }
    }

    /// `cpu` or `cuda:N`.
    pub fn device_label(&self) -> String {
        device::label(self.device)
    }

    /// Where this run writes its checkpoints.
    pub fn checkpoint_dir(&self) -> &Path {
        &self.checkpoint_dir
    }
}

/// The config a checkpoint was trained with (for `--resume`). Its corpus is the absolute
/// path recorded at the run's start, so a resume works from any directory (`--corpus`
/// may still say where the same content lives now).
pub fn read_checkpoint_config(dir: &Path) -> Result<RunConfig, CheckpointError> {
    let state = checkpoint::load(dir)?.state;
    let mut config = state.config;
    if let Some(rec) = state.corpus.filter(|r| !r.path.is_empty()) {
        config.data.corpus = rec.path;
    }
    Ok(config)
}

/// Starts the trainer thread and waits until it has prepared the run (corpus, device,
/// model, optimizer, resumed checkpoint, writable checkpoint directory). Training then
/// proceeds on the thread; `commands` steer it, `bus` carries what it reports.
pub fn spawn(
    opts: TrainOptions,
    bus: Bus,
    commands: Receiver<Command>,
) -> Result<TrainerHandle, TrainError> {
    oom::quiet_oom_panics();
    let checkpoint_dir = opts.checkpoint_dir.clone();
    let (ready_tx, ready_rx) = bounded::<Result<Device, TrainError>>(1);
    let thread = std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            let prepared = catch_unwind(AssertUnwindSafe(|| Trainer::prepare(opts, &bus)));
            let mut trainer = match prepared {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => {
                    let text = e.to_string();
                    let _ = ready_tx.send(Err(e));
                    return Err(text);
                }
                Err(p) => {
                    let text = format!("the trainer panicked while preparing: {}", panic_text(&p));
                    let _ = ready_tx.send(Err(TrainError::Thread(text.clone())));
                    return Err(text);
                }
            };
            let _ = ready_tx.send(Ok(trainer.device));
            drop(ready_tx);
            let outcome = catch_unwind(AssertUnwindSafe(|| trainer.run(&bus, &commands)))
                .unwrap_or_else(|p| Err(format!("the trainer panicked: {}", panic_text(&p))));
            if let Err(reason) = &outcome {
                bus.send(Telemetry::Status {
                    status: RunStatus::Failed,
                });
                bus.send(Telemetry::Failed {
                    reason: reason.clone(),
                });
            }
            outcome
        })
        .map_err(|e| TrainError::Thread(format!("cannot start the trainer thread: {e}")))?;
    match ready_rx.recv() {
        Ok(Ok(device)) => Ok(TrainerHandle {
            thread,
            device,
            checkpoint_dir,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let reason = match thread.join() {
                Ok(Err(r)) => r,
                Ok(Ok(_)) => "the trainer ended before it was ready".into(),
                Err(p) => format!("the trainer panicked while preparing: {}", panic_text(&p)),
            };
            Err(TrainError::Thread(reason))
        }
    }
}

/// Whether two paths name the same directory (links and `..` resolved); a path that does
/// not exist is compared as written.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// What checkpoints record of the corpus: its absolute path and its content's digest.
fn corpus_record(cfg: &RunConfig, data: &Dataset) -> CorpusRecord {
    let path = match cfg.data.corpus.as_str() {
        "" => String::new(),
        p => std::path::absolute(p)
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_else(|_| p.to_string()),
    };
    CorpusRecord {
        path,
        digest: data.digest(),
        bytes: data.len() as u64,
    }
}

/// A resume trains on the content the checkpoint was trained on, wherever it lives now;
/// changed content is refused unless the user says so (then said on screen).
fn check_same_corpus(
    ck: &checkpoint::Checkpoint,
    now: &CorpusRecord,
    allow_changed: bool,
    bus: &Bus,
) -> Result<(), TrainError> {
    let Some(then) = &ck.state.corpus else {
        return Ok(());
    };
    if then.digest == now.digest {
        return Ok(());
    }
    let name = |p: &str| {
        if p.is_empty() {
            "the bundled corpus".to_string()
        } else {
            p.to_string()
        }
    };
    let what = format!(
        "the corpus changed since checkpoint {}: it was {} ({} bytes, {}), it is now {} ({} \
         bytes, {})",
        ck.dir.display(),
        name(&then.path),
        then.bytes,
        then.digest,
        name(&now.path),
        now.bytes,
        now.digest
    );
    if !allow_changed {
        return Err(TrainError::Config(format!(
            "{what}; point --corpus at the original content, or pass --allow-changed-corpus \
             to go on training on the new one"
        )));
    }
    bus.send(Telemetry::Notice(Notice::new(
        Level::Warn,
        "data",
        format!("{what}; training on the new content (--allow-changed-corpus)"),
    )));
    Ok(())
}

/// A resume with another `--steps` reshapes the learning-rate schedule: say how.
fn schedule_change(now: &RunConfig, then: &RunConfig, step: u64) -> Option<Notice> {
    if now.run.steps == then.run.steps {
        return None;
    }
    let next = step + 1;
    let old = Schedule::new(&then.optim, then.run.steps).lr_at(next);
    let new = Schedule::new(&now.optim, now.run.steps).lr_at(next);
    let change = format!(
        "the run is now {} steps long (it was {}): the learning-rate schedule's decay is \
         stretched to match",
        now.run.steps, then.run.steps
    );
    // Said as a warning only when the next step's rate differs (shown to 4 digits): in
    // warmup it does not, and "9.000e-4 instead of 9.000e-4" alarmed for nothing.
    if format!("{new:.3e}") == format!("{old:.3e}") {
        return Some(Notice::new(
            Level::Info,
            "optim",
            format!("{change}; step {next}'s lr is unchanged ({new:.3e}), later ones differ"),
        ));
    }
    Some(Notice::new(
        Level::Warn,
        "optim",
        format!("{change}, so step {next} trains at lr {new:.3e} instead of {old:.3e}"),
    ))
}

/// A resume with another precision or checkpointing says so: the checkpoint holds float32
/// weights and moments either way, so it loads, but the steps after it are computed
/// differently from those before it.
fn lever_changes(now: &RunConfig, then: &RunConfig, step: u64) -> Vec<Notice> {
    let (a, b) = (&then.model, &now.model);
    let mut out = Vec::new();
    if a.precision != b.precision {
        out.push(Notice::new(
            Level::Warn,
            "model",
            format!(
                "resuming in {} a run trained in {} up to step {step}: the checkpoint's \
                 float32 weights and moments load as they are, and the steps from {} on \
                 compute in {}",
                b.precision,
                a.precision,
                step + 1,
                b.precision
            ),
        ));
    }
    if a.checkpoint != b.checkpoint {
        out.push(Notice::new(
            Level::Info,
            "model",
            format!(
                "activation checkpointing is {} (it was {} up to step {step}): memory per \
                 sequence changes, what is learned does not",
                b.checkpoint, a.checkpoint
            ),
        ));
    }
    out
}

/// Refuses a model that cannot train in the memory there is, before building it: a huge
/// config would otherwise allocate until the machine swaps, or die in libtorch.
fn check_model_fits(cfg: &RunConfig, device: Device) -> Result<(), TrainError> {
    let params = Gpt::parameters_for(&cfg.model, cfg.data.seq_len);
    // Weights, gradients and AdamW's two moments, all float32: the least a step needs.
    let needed = params.saturating_mul(16);
    let (room, what) = match device {
        Device::Cuda(n) => match crate::alloc_stats::memory_info(n) {
            Ok((_, total)) => (total, format!("cuda:{n}'s memory")),
            Err(_) => return Ok(()),
        },
        _ => match cfg.memory.budget_bytes().ok().flatten() {
            Some(b) => (b, "the budget (--memory-budget)".to_string()),
            None => match procmem::host_available_bytes() {
                Some(a) => (a, "the host memory available".to_string()),
                None => return Ok(()),
            },
        },
    };
    if needed > u128::from(room) {
        let m = &cfg.model;
        return Err(TrainError::Config(format!(
            "the model is too large: n_layer {} × n_embd {} gives {} parameters, whose \
             weights, gradients and optimizer state need at least {}, more than {what} ({}); \
             lower model.n_layer or model.n_embd",
            m.n_layer,
            m.n_embd,
            fmt_count(params),
            fmt_bytes(u64::try_from(needed).unwrap_or(u64::MAX)),
            fmt_bytes(room)
        )));
    }
    Ok(())
}

fn fmt_count(n: u128) -> String {
    match n {
        0..1_000_000 => n.to_string(),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

/// Free space for checkpoints: refused when not even one fits, said when fewer than a
/// save needs with the ones it keeps (a save writes the new one before pruning). A checkpoint
/// takes what the one resumed from takes, else [`checkpoint::estimated_size`]. A resume
/// into its own directory makes room as a failed save does: older checkpoints go first,
/// the one resumed from (the newest good one) never.
fn check_room(
    root: &Path,
    shapes: &[(String, Vec<i64>)],
    resumed: Option<&checkpoint::Checkpoint>,
    adopt: bool,
) -> Result<Vec<Notice>, TrainError> {
    let Some(mut free) = checkpoint::free_bytes(root) else {
        return Ok(Vec::new());
    };
    let one = match resumed {
        Some(ck) => checkpoint::size_on_disk(&ck.dir).max(1),
        None => checkpoint::estimated_size(shapes),
    };
    let mut notices = Vec::new();
    if let (true, true, Some(ck)) = (free < one, adopt, resumed) {
        let removed = checkpoint::prune_all_but(root, Some(&ck.dir));
        if !removed.is_empty() {
            let before = free;
            free = checkpoint::free_bytes(root).unwrap_or(free);
            notices.push(Notice::new(
                Level::Warn,
                "checkpoint",
                format!(
                    "{} had {} free and a checkpoint of this run takes {}: deleted older \
                     checkpoints ({}) to make room; {} is kept",
                    root.display(),
                    fmt_bytes(before),
                    fmt_bytes(one),
                    removed.join(", "),
                    ck.dir.display()
                ),
            ));
        }
    }
    if free < one {
        return Err(CheckpointError::NoRoom {
            root: root.to_path_buf(),
            free,
            needed: one,
        }
        .into());
    }
    let want = one * (checkpoint::KEEP as u64 + 1);
    if free < want {
        notices.push(Notice::new(
            Level::Warn,
            "checkpoint",
            format!(
                "{} has {} free; a checkpoint takes about {} and a save needs room for {} of \
                 them: when the disk fills, older checkpoints are deleted first and the newest \
                 is always kept",
                root.display(),
                fmt_bytes(free),
                fmt_bytes(one),
                checkpoint::KEEP + 1
            ),
        ));
    }
    Ok(notices)
}

/// A state.json whose step disagrees with its directory's name or with the tokens it says
/// were seen was edited, or copied from elsewhere: refused, since a resume from it would
/// continue at the wrong step (another learning rate, other batches) without a word.
fn check_state_consistent(ck: &checkpoint::Checkpoint) -> Result<(), TrainError> {
    let st = &ck.state;
    let named = ck
        .dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(checkpoint::parse_step_dir);
    let cfg = &st.config;
    let effective = cfg.batch.effective() as u64;
    let tokens_at = |steps: u64| -> u64 {
        (1..=steps)
            .map(|s| effective * cfg.data.seq_len_at(cfg.run.seed, s) as u64)
            .sum()
    };
    let mut wrong = Vec::new();
    if let Some(n) = named.filter(|n| *n != st.step) {
        wrong.push(format!("its directory is {}", checkpoint::step_dir_name(n)));
    }
    let expected = tokens_at(st.step);
    if st.tokens_seen != expected {
        wrong.push(format!(
            "tokens_seen is {} where {} steps of {} sequences make {expected}",
            st.tokens_seen, st.step, effective
        ));
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(TrainError::Checkpoint(CheckpointError::Corrupt {
        file: ck.dir.join("state.json"),
        reason: format!(
            "it says step {}, but {} (edited, or copied from another step)",
            st.step,
            wrong.join(", and ")
        ),
    }))
}

/// How an attempt at a step or a validation pass failed.
enum Failure {
    /// Out of memory: retry smaller.
    Oom(String),
    Other(String),
}

/// Runs `f` so that an out-of-memory error and an out-of-memory panic (tch's infallible
/// calls, and its `f_*_scalar` ones, panic where an `f_` call would return the error)
/// take the same path. Any other panic goes on unwinding. `hard_limit`: under the cap,
/// oneDNN's nameless allocation failures count as out of memory too.
fn attempt<T>(hard_limit: bool, f: impl FnOnce() -> Result<T, TchError>) -> Result<T, Failure> {
    let is_oom = |text: &str| {
        if hard_limit {
            oom::is_capped_oom_message(text)
        } else {
            oom::is_oom_message(text)
        }
    };
    let text = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => e.to_string(),
        Err(p) => {
            let text = panic_text(&p);
            if !is_oom(&text) {
                std::panic::resume_unwind(p);
            }
            text
        }
    };
    Err(if is_oom(&text) {
        Failure::Oom(text)
    } else {
        Failure::Other(text)
    })
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_string()
}

fn panic_text(p: &Box<dyn Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

enum Flow {
    Continue,
    Stop,
}

/// Everything a run holds between steps.
struct Trainer {
    cfg: RunConfig,
    data: Dataset,
    model: Gpt,
    opt: AdamW,
    device: Device,
    schedule: Schedule,
    checkpoint_dir: PathBuf,
    /// The fixed validation windows (see [`Dataset::val_offsets`]).
    val_offsets: Vec<usize>,
    /// Decides the micro-batch (sequences per forward/backward) between steps; what a
    /// step trains on does not depend on it. Its calls are journaled for the checkpoint.
    controller: Journaled,
    meter: PeakMeter,
    /// Steps whose first attempt is made to run out of memory; each fires once.
    inject_oom: BTreeSet<u64>,
    inject_panic: Option<u64>,
    /// `--hard-limit` is on: allocation failures that do not say "memory" are OOMs too.
    hard_limit: bool,
    /// Said once the run has started (the UI learns the run before its details).
    startup_notices: Vec<Notice>,
    effective_batch: usize,
    start_step: u64,
    /// Optimizer steps completed (counting resumed ones).
    step: u64,
    tokens_seen: u64,
    /// Where the latest state of this run is on disk, and its step.
    saved: Option<(u64, PathBuf)>,
    last_eval_step: Option<u64>,
    last_loss: Option<f64>,
    last_val_loss: Option<f64>,
    /// Training losses since the previous evaluation (sum, count).
    losses_since_eval: (f64, u64),
    stopped_by_user: bool,
    /// The checkpoint directory is this run's while this lives.
    _lock: checkpoint::DirLock,
    /// The corpus as checkpoints record it.
    corpus: CorpusRecord,
    /// Peak, resizes and OOMs, for the exit summary.
    memory: MemorySummary,
    /// Tokens per micro-batch of the previous step ([`Trainer::follow_smaller_step`]).
    last_tokens: usize,
    /// Whether glibc's heap holds memory the batch does not ([`HeapWatch`]).
    heap: HeapWatch,
    /// Asked between micro-batches whether to give the step up.
    stop: StopSwitch,
    /// Commands that arrived during a step, carried out at its end.
    pending: std::collections::VecDeque<Command>,
    /// The last completed step's measured peak, for what a lever switch frees.
    last_measured: Option<Measured>,
    /// A precision or checkpointing switch waiting for its first step.
    switch: Option<PendingSwitch>,
    /// Where a step's memory goes, probed at the start ([`Trainer::start_plan`]): its
    /// prediction is logged beside every step's peak, and it names the lever that would
    /// fit when even the smallest micro-batch does not.
    plan: Option<Plan>,
}

impl Trainer {
    fn prepare(opts: TrainOptions, bus: &Bus) -> Result<Trainer, TrainError> {
        let cfg = opts.config;
        cfg.validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let data = Dataset::load_waiting(
            &cfg.data.corpus,
            cfg.data.val_fraction,
            cfg.data.seq_len,
            opts.fifo_wait,
        )?;
        let choice = cfg
            .device()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let device = device::resolve(choice, bus)?;
        if cfg.run.threads > 0 {
            tch::set_num_threads(cfg.run.threads as i32);
        }
        if let Device::Cuda(_) = device {
            crate::compute::set_tf32(cfg.model.tf32).map_err(|e| {
                TrainError::Torch(format!(
                    "setting model.tf32 failed: {}",
                    first_line(&e.to_string())
                ))
            })?;
        }
        check_model_fits(&cfg, device)?;
        let resumed = opts.resume.as_deref().map(checkpoint::load).transpose()?;
        if let Some(ck) = &resumed {
            check_state_consistent(ck)?;
        }
        let corpus = corpus_record(&cfg, &data);
        if let Some(ck) = &resumed {
            check_same_corpus(ck, &corpus, opts.allow_changed_corpus, bus)?;
        }

        // libtorch's own errors carry a C++ backtrace: the first line is the message.
        let torch = |what: &str, e: TchError| {
            TrainError::Torch(format!("{what} failed: {}", first_line(&e.to_string())))
        };
        let model = Gpt::new(&cfg.model, cfg.data.seq_len, device, cfg.run.seed)
            .map_err(|e| torch("building the model", e))?;
        let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim))
            .map_err(|e| torch("allocating the optimizer state", e))?;

        let mut notices = Vec::new();
        let (start_step, tokens_seen, saved) = match &resumed {
            None => (0, 0, None),
            Some(ck) => {
                if ck.state.step >= cfg.run.steps {
                    return Err(TrainError::Config(format!(
                        "checkpoint {} is at step {}, and the run is {} steps long; raise \
                         --steps above {} to train further",
                        ck.dir.display(),
                        ck.state.step,
                        cfg.run.steps,
                        ck.state.step
                    )));
                }
                ck.restore(&model, &mut opt)?;
                if ck.state.checksums.is_empty() {
                    notices.push(Notice::new(
                        Level::Warn,
                        "checkpoint",
                        format!(
                            "{} has no checksums in its state.json (written by an older \
                             headroom, or edited): its tensors were loaded unchecked",
                            ck.dir.display()
                        ),
                    ));
                }
                if let Some(n) = schedule_change(&cfg, &ck.state.config, ck.state.step) {
                    notices.push(n);
                }
                notices.extend(lever_changes(&cfg, &ck.state.config, ck.state.step));
                if ck.state.seed != cfg.run.seed {
                    bus.send(Telemetry::Notice(Notice::new(
                        Level::Warn,
                        "checkpoint",
                        format!(
                            "resuming with seed {} but the checkpoint was trained with seed {}; \
                             batches differ from the original run's",
                            cfg.run.seed, ck.state.seed
                        ),
                    )));
                }
                (
                    ck.state.step,
                    ck.state.tokens_seen,
                    Some((ck.state.step, ck.dir.clone())),
                )
            }
        };
        // After the checkpoint loaded: claiming the directory creates it, and a resume
        // that fails must not leave an empty one behind.
        let adopt = opts
            .resume
            .as_deref()
            .is_some_and(|r| same_dir(checkpoint::root_of(r), &opts.checkpoint_dir));
        let (lock, removed) = checkpoint::claim(&opts.checkpoint_dir, adopt, opts.overwrite)?;
        if !removed.is_empty() {
            notices.push(Notice::new(
                Level::Warn,
                "checkpoint",
                format!(
                    "--overwrite: deleted the previous run's checkpoints in {} ({})",
                    opts.checkpoint_dir.display(),
                    removed.join(", ")
                ),
            ));
        }
        notices.extend(check_room(
            &opts.checkpoint_dir,
            &model.fingerprint(),
            resumed.as_ref(),
            adopt,
        )?);

        // Resuming starts at the micro-batch the run had settled on, unless the user asked
        // for another one (--batch-size) this time.
        let start_micro = opts
            .start_micro_batch
            .or_else(|| resumed.as_ref().and_then(|ck| ck.state.micro_batch))
            .unwrap_or(cfg.batch.micro_batch);
        // A resume at the saved micro-batch continues the controller the run had (its
        // journal replayed); one at another (--batch-size) starts a fresh one there.
        let journal = match opts.start_micro_batch {
            None => resumed.as_ref().and_then(|ck| ck.state.controller.as_ref()),
            Some(_) => None,
        };
        let (controller, meter, mut startup_notices) =
            Self::memory_policy(&cfg, device, start_micro, journal)?;
        // The tokens of the last step before the checkpoint, as an uninterrupted run
        // would remember them (see `follow_smaller_step`).
        let last_tokens = journal
            .and_then(|j| {
                j.calls.iter().rev().find_map(|c| match c {
                    Call::Observe(_, mb, seq, _) => Some(mb * seq),
                    _ => None,
                })
            })
            .unwrap_or(0);
        startup_notices.extend(notices);
        let threads = match tch::get_num_threads() {
            1 => "1 intra-op thread".to_string(),
            n => format!("{n} intra-op threads"),
        };
        startup_notices.push(Notice::new(
            Level::Info,
            "torch",
            match cfg.run.threads {
                0 => format!(
                    "libtorch uses {threads} (its default); on a busy machine \
                     --threads 1 can be faster"
                ),
                _ => format!("libtorch uses {threads} (run.threads)"),
            },
        ));
        let val_offsets = data.val_offsets(cfg.run.eval_batches * cfg.batch.micro_batch);
        Ok(Trainer {
            schedule: Schedule::new(&cfg.optim, cfg.run.steps),
            controller,
            meter,
            inject_oom: opts.inject_oom.iter().copied().collect(),
            inject_panic: opts.inject_panic,
            hard_limit: cfg.memory.hard_limit,
            startup_notices,
            effective_batch: cfg.batch.effective(),
            checkpoint_dir: opts.checkpoint_dir,
            _lock: lock,
            corpus,
            cfg,
            data,
            model,
            opt,
            device,
            val_offsets,
            start_step,
            step: start_step,
            tokens_seen,
            saved,
            last_eval_step: None,
            last_loss: None,
            last_val_loss: None,
            losses_since_eval: (0.0, 0),
            stopped_by_user: false,
            memory: MemorySummary::default(),
            last_tokens,
            heap: HeapWatch::default(),
            stop: opts.stop,
            pending: Default::default(),
            last_measured: None,
            switch: None,
            plan: None,
        })
    }

    /// The controller and the meter it reads. Called once the model and optimizer exist,
    /// so a hard cap's baseline includes them.
    /// Its notices are sent once the run has started, after `RunStarted`.
    /// `journal`: a resumed run's controller journal, replayed instead of a fresh start.
    fn memory_policy(
        cfg: &RunConfig,
        device: Device,
        start_micro: usize,
        journal: Option<&ControllerJournal>,
    ) -> Result<(Journaled, PeakMeter, Vec<Notice>), TrainError> {
        let mut notices = Vec::new();
        let mem = &cfg.memory;
        let config = |e: headroom_core::ConfigError| TrainError::Config(e.to_string());
        let thresholds = mem.thresholds().map_err(config)?;
        let mut budget = mem.budget_bytes().map_err(config)?;
        if let (true, Device::Cpu, Some(j)) = (mem.is_auto_budget(), device, journal) {
            // The budget the run resolved at its start, not one from this process's
            // memory now: the uninterrupted run would go on measuring against it.
            budget = Some(j.limit);
            notices.push(Notice::new(
                Level::Info,
                "memory",
                format!(
                    "memory budget auto: {}, as the run resumed from resolved it",
                    fmt_bytes(j.limit)
                ),
            ));
        } else if mem.is_auto_budget() && device == Device::Cpu {
            let held = procmem::rss_bytes();
            let available = procmem::host_available_bytes();
            if let (Some(held), Some(available)) = (held, available) {
                let b = headroom_core::config::auto_budget(held, available);
                budget = Some(b);
                notices.push(Notice::new(
                    Level::Info,
                    "memory",
                    format!(
                        "memory budget auto: {} (this process's {} once the model exists, plus \
                         {} for activations), so the controller fits the micro-batch to it; \
                         set memory.memory_budget = \"\" (all host memory) or --memory-budget \
                         SIZE to change it",
                        fmt_bytes(b),
                        fmt_bytes(held),
                        fmt_bytes(b - held)
                    ),
                ));
            }
        }
        if mem.hard_limit && device != Device::Cpu {
            return Err(TrainError::Config(
                "--hard-limit caps host memory and applies to CPU runs only; drop it or use \
                 --device cpu"
                    .into(),
            ));
        }
        if budget.is_some() && device != Device::Cpu && !mem.is_auto_budget() {
            notices.push(Notice::new(
                Level::Warn,
                "memory",
                "--memory-budget applies to CPU runs; a CUDA run is measured against the \
                 device's memory",
            ));
        }
        if let (Some(b), Some(held)) = (budget, procmem::rss_bytes()) {
            // Under a budget the process already exceeds, every step is an emergency and
            // the controller can only shrink to nothing.
            if device == Device::Cpu && b <= held {
                return Err(TrainError::Config(format!(
                    "--memory-budget {} is below what this process already holds ({}: \
                     libtorch, the data, the model and its optimizer state); give a budget \
                     well above that, e.g. {}",
                    fmt_bytes(b),
                    fmt_bytes(held),
                    fmt_bytes((held * 2).next_multiple_of(64 << 20))
                )));
            }
        }
        let meter = PeakMeter::new(device, budget).map_err(TrainError::Config)?;
        if !meter.is_exact() {
            notices.push(Notice::new(
                Level::Warn,
                "memory",
                "the kernel refused to reset the peak RSS (/proc/self/clear_refs); step peaks \
                 are the process's peak so far and over-state later steps",
            ));
        }
        let what = match (device, budget) {
            (Device::Cpu, Some(_)) => "the budget (--memory-budget)",
            (Device::Cpu, None) => "host memory (no --memory-budget)",
            _ => "device memory",
        };
        notices.push(Notice::new(
            Level::Info,
            "memory",
            format!(
                "memory limit {} ({what}); thresholds {thresholds}",
                fmt_bytes(meter.limit())
            ),
        ));
        if mem.hard_limit {
            let budget = budget.expect("validate() requires a budget with hard_limit");
            oom::start_thread_pools();
            let cap = oom::set_hard_limit(budget).map_err(TrainError::Config)?;
            notices.push(Notice::new(
                Level::Info,
                "memory",
                format!(
                    "hard limit: allocations past {} resident fail (RLIMIT_DATA {})",
                    fmt_bytes(budget),
                    fmt_bytes(cap)
                ),
            ));
        }
        if mem.oom_snapshot && matches!(device, Device::Cpu) {
            notices.push(Notice::new(
                Level::Info,
                "memory",
                "oom_snapshot: off on the CPU: the snapshot is the CUDA caching allocator's \
                 (the pickle PyTorch's memory_viz reads), and the CPU has none"
                    .to_string(),
            ));
        }
        let effective = cfg.batch.effective();
        let max = match mem.max_micro_batch {
            0 => effective,
            m => m.min(effective),
        };
        let ccfg = procmem::with_meter(
            ControllerConfig {
                min_micro_batch: mem.min_micro_batch.min(max),
                max_micro_batch: max,
                adaptive: mem.adaptive,
                max_seq_len: cfg.data.seq_len,
                ..ControllerConfig::default()
            },
            matches!(device, Device::Cuda(_)),
            mem.hard_limit,
        );
        if let Some(j) = journal {
            // Its baseline and every reading since are in the journal.
            let mut controller = Journaled::replay(ccfg, j);
            notices.push(Notice::new(
                Level::Info,
                "memory",
                format!(
                    "controller state restored from the checkpoint ({} calls replayed): \
                     micro-batch {}, as the uninterrupted run had it",
                    j.calls.len(),
                    controller.micro_batch()
                ),
            ));
            // Thresholds the config changes for the resume win over the saved ones.
            if thresholds != j.thresholds && controller.set_thresholds(thresholds).is_err() {
                notices.push(Notice::new(
                    Level::Warn,
                    "memory",
                    format!("thresholds {thresholds} refused; the saved ones stay"),
                ));
            }
            return Ok((controller, meter, notices));
        }
        let mut controller = Journaled::new(ccfg, thresholds, meter.limit(), start_micro);
        // The model and the optimizer state exist: what the process holds now is the fixed
        // part every batch sits on, which one measured size alone cannot tell apart from
        // the per-sequence cost (a run starting at 1 never grew without it).
        match meter.reset().and_then(|()| meter.peak()) {
            Ok(held) => controller.set_baseline(held),
            Err(e) => notices.push(Notice::new(Level::Warn, "memory", e)),
        }
        Ok((controller, meter, notices))
    }

    fn run(&mut self, bus: &Bus, commands: &Receiver<Command>) -> Result<RunSummary, String> {
        let started = Instant::now();
        let total = self.cfg.run.steps;
        bus.send(Telemetry::RunStarted(RunInfo {
            run_name: self.cfg.run.name.clone(),
            device: device::label(self.device),
            device_name: device::human_name(self.device),
            parameters: self.model.num_parameters(),
            start_step: self.start_step,
            total_steps: total,
            corpus: self.data.name().to_string(),
            train_bytes: self.data.train_bytes() as u64,
            val_bytes: self.data.val_bytes() as u64,
            config: Some(self.cfg.clone()),
            checkpoints: Some(true),
        }));
        for notice in std::mem::take(&mut self.startup_notices) {
            bus.send(Telemetry::Notice(notice));
        }
        self.thresholds_changed(bus, "config");
        self.start_plan(bus);
        bus.send(Telemetry::Status {
            status: RunStatus::Running,
        });

        self.stop.publish(self.step, false);
        while self.step < total {
            if let Flow::Stop = self.drain_commands(bus, commands)? {
                break;
            }
            if !self.train_one(bus, commands)? {
                // Given up for a stop: the stop command is among those that arrived during
                // the step (or on its way); the others go with the run.
                let cmd = self
                    .pending
                    .iter()
                    .position(|c| matches!(c, Command::Stop))
                    .and_then(|i| self.pending.remove(i));
                self.stop(bus, cmd);
                break;
            }
            let s = self.step;
            let every = |n: u64| n > 0 && s.is_multiple_of(n) && s < total;
            if every(self.cfg.run.eval_every) {
                self.evaluate(bus)?;
            }
            if every(self.cfg.run.checkpoint_every) {
                // A failed periodic save is not worth the run: warn, retry at the next.
                if let Err(e) = self.checkpoint(bus) {
                    bus.send(Telemetry::Notice(Notice::new(
                        Level::Error,
                        "checkpoint",
                        e.to_string(),
                    )));
                }
            }
        }

        // A stop skips the final validation pass: whoever stops a run (a scheduler whose
        // SIGKILL follows, a user at the keyboard) waits for the checkpoint, not for it.
        if !self.stopped_by_user && self.last_eval_step != Some(self.step) {
            self.evaluate(bus)?;
        }
        let trained = self.step > self.start_step;
        if trained && self.saved.as_ref().map(|s| s.0) != Some(self.step) {
            if let Err(e) = self.checkpoint(bus) {
                return Err(format!(
                    "the final checkpoint (step {}) could not be written: {e}. {}",
                    self.step,
                    self.kept_text()
                ));
            }
        }
        let summary = RunSummary {
            steps_done: self.step,
            total_steps: total,
            stopped_by_user: self.stopped_by_user,
            last_loss: self.last_loss,
            last_val_loss: self.last_val_loss,
            tokens_seen: self.tokens_seen,
            elapsed_s: started.elapsed().as_secs_f64(),
            checkpoint: self.saved.as_ref().map(|s| s.1.display().to_string()),
            memory: MemorySummary {
                final_micro_batch: self.controller.micro_batch(),
                accum_steps: self
                    .effective_batch
                    .div_ceil(self.controller.micro_batch().max(1)),
                effective_batch: self.effective_batch,
                ..self.memory.clone()
            },
        };
        bus.send(Telemetry::Status {
            status: RunStatus::Finished,
        });
        bus.send(Telemetry::Finished(summary.clone()));
        Ok(summary)
    }

    /// One optimizer step, retried with smaller micro-batches after an out-of-memory
    /// error until it succeeds or the controller gives up. False: a stop gave the step up
    /// between two micro-batches (its partial gradients dropped, nothing else changed).
    fn train_one(&mut self, bus: &Bus, commands: &Receiver<Command>) -> Result<bool, String> {
        let s = self.step + 1;
        let seq = self.cfg.data.seq_len_at(self.cfg.run.seed, s);
        let forecast = self.controller.before_step_ahead(seq, self.upcoming(s));
        self.apply(bus, s, forecast);
        self.follow_smaller_step(self.controller.micro_batch() * seq);
        let (plan, out, dt) = loop {
            let plan = StepPlan {
                seed: self.cfg.run.seed,
                step: s,
                effective_batch: self.effective_batch,
                micro_batch: self.controller.micro_batch(),
                seq_len: seq,
                lr: self.schedule.lr_at(s),
                grad_clip: self.cfg.optim.grad_clip,
                inject_oom: self.inject_oom.remove(&s),
            };
            let predicted = self.controller.predicted_bytes(plan.micro_batch, seq);
            if let Err(e) = self.meter.reset() {
                bus.send(Telemetry::Notice(Notice::new(Level::Warn, "memory", e)));
            }
            if self.watches_heap() {
                let heap = procmem::heap_stats();
                self.heap
                    .step_started(procmem::rss_bytes(), heap.map(|h| h.in_use));
                procmem::take_heap_in_use_peak();
            }
            let t0 = Instant::now();
            let (model, opt, data) = (&self.model, &mut self.opt, &self.data);
            let (stop, pending) = (&self.stop, &mut self.pending);
            // Commands that arrive during the step wait for its end, but a stop is seen
            // at the next micro-batch boundary.
            let mut abandon = |at: step::Boundary| {
                while let Ok(c) = commands.try_recv() {
                    if matches!(c, Command::Stop) {
                        stop.request();
                    }
                    pending.push_back(c);
                }
                match at {
                    step::Boundary::MicroBatch => stop.requested(),
                    step::Boundary::Update => !stop.commit(),
                }
            };
            let panic_now = self.inject_panic.take_if(|p| *p == s).is_some();
            self.stop.publish(self.step, true);
            let error = match attempt(self.hard_limit, || {
                if panic_now {
                    panic!("injected panic in step {s} (HEADROOM_INJECT_PANIC)");
                }
                step::train_step_until(model, opt, data, &plan, &mut abandon)
            }) {
                Ok(Stepped::Abandoned { micro_batches_done }) => {
                    self.opt.zero_grad();
                    self.stop.publish(self.step, false);
                    bus.send(Telemetry::Notice(Notice::new(
                        Level::Warn,
                        "stop",
                        abandoned_text(
                            s,
                            micro_batches_done,
                            plan.accum_steps(),
                            t0.elapsed().as_secs_f64(),
                        ),
                    )));
                    return Ok(false);
                }
                Ok(Stepped::Done(out)) => {
                    let dt = t0.elapsed().as_secs_f64().max(1e-9);
                    self.observe_memory(bus, &plan, predicted);
                    break (plan, out, dt);
                }
                Err(Failure::Other(e)) => return Err(format!("step {s} failed: {e}")),
                Err(Failure::Oom(e)) => e,
            };
            self.recover_from_oom(bus, &plan, error)?;
        };
        if !out.loss.is_finite() {
            return Err(format!(
                "step {s}: the loss is {} (training diverged); lower optim.lr or raise \
                 optim.warmup_steps",
                out.loss
            ));
        }
        let tokens = (plan.effective_batch * seq) as u64;
        self.step = s;
        self.stop.publish(s, false);
        self.tokens_seen += tokens;
        self.last_loss = Some(out.loss);
        self.losses_since_eval.0 += out.loss;
        self.losses_since_eval.1 += 1;
        bus.send(Telemetry::Step(StepMetrics {
            step: s,
            total_steps: self.cfg.run.steps,
            loss: out.loss,
            lr: Some(plan.lr),
            grad_norm: Some(out.grad_norm),
            step_time_s: dt,
            tokens_per_s: tokens as f64 / dt,
            samples_per_s: plan.effective_batch as f64 / dt,
            micro_batch: plan.micro_batch,
            accum_steps: plan.accum_steps(),
            effective_batch: plan.effective_batch,
            seq_len: seq,
            tokens_seen: self.tokens_seen,
        }));
        if s == self.start_step + 1 {
            // This process's first step: its gradients and moments exist now.
            bus.send(Telemetry::MemoryParts(self.memory_parts()));
        }
        Ok(true)
    }

    /// What the step's fixed memory is made of, counted from the tensors as they are (the
    /// record a Python run sends too; the optimizer-state hint reads it): parameters,
    /// their gradients and AdamW's moments, bytes.
    fn memory_parts(&self) -> MemoryParts {
        let bytes = |t: &Tensor| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        MemoryParts {
            parameters: self
                .model
                .named_parameters()
                .iter()
                .map(|(_, t)| bytes(t))
                .sum(),
            gradients: self.opt.grads().iter().map(bytes).sum(),
            optimizer: self.opt.state_bytes(),
        }
    }

    /// On the CPU, glibc keeps the heap a bigger step grew: the resident set, and so the
    /// step's measured peak, would stay at the old high-water mark, and a smaller batch
    /// would seem to use as much memory as the bigger one (the controller took that for
    /// memory held apart from the batch, and collapsed the micro-batch). Before a step
    /// with fewer tokens than the last, the heap's free pages go back to the kernel, so
    /// the resident set follows live tensors. Only then: trimming every step would make
    /// every step fault its pages in again.
    fn follow_smaller_step(&mut self, tokens: usize) {
        if self.device == Device::Cpu && tokens < self.last_tokens {
            let _ = oom::free_cached(self.device);
        }
        self.last_tokens = tokens;
    }

    /// The longest length the steps after `step` bring within the planning horizon, and
    /// the first step that brings it: the controller makes room before it arrives.
    fn upcoming(&self, step: u64) -> Upcoming {
        let last = (step + LENGTH_HORIZON).min(self.cfg.run.steps);
        let len_at = |s: u64| self.cfg.data.seq_len_at(self.cfg.run.seed, s);
        // From this step's own length: the last steps have nothing after them.
        let now = Upcoming {
            seq_len: len_at(step),
            step,
        };
        (step + 1..=last)
            .map(|s| (len_at(s), s))
            .fold(now, |best, (len, s)| {
                if len > best.seq_len {
                    Upcoming {
                        seq_len: len,
                        step: s,
                    }
                } else {
                    best
                }
            })
    }

    /// The plan, from a probe of the run's own model before its first step: forward and
    /// backward at two micro-batch sizes (half the starting one and all of it, at most
    /// 16), measured as a step is, without an update, so training is untouched (the
    /// gradients are zeroed after it). Cheaper than waiting for two step sizes, which a
    /// run settled at one size never gives. When sequences of the run's length do not
    /// fit, shorter ones are probed (every term is per token); when none do, the plan
    /// rests on the model's shapes alone.
    fn start_plan(&mut self, bus: &Bus) {
        let t0 = Instant::now();
        let shape = plan_probe::shape(&self.cfg);
        let start = self.controller.micro_batch();
        let sizes = plan_probe::sizes_for(start.min(16));
        let limit = self.meter.limit();
        let target = self.controller.thresholds().target;
        let mut seq = self.cfg.data.seq_len;
        let probed = loop {
            let (model, opt, data, meter) = (&self.model, &mut self.opt, &self.data, &self.meter);
            let seed = self.cfg.run.seed;
            match attempt(self.hard_limit, || {
                plan_probe::probe(model, opt, data, meter, sizes, seq, seed, None)
            }) {
                Ok(probe) => break Plan::from_probe(shape, probe, limit, target).map_err(|e| e.0),
                Err(Failure::Oom(_)) if seq / 4 >= 8 => {
                    self.opt.zero_grad();
                    let _ = oom::free_cached(self.device);
                    seq /= 4;
                }
                Err(Failure::Oom(e) | Failure::Other(e)) => break Err(first_line(&e)),
            }
        };
        self.opt.zero_grad();
        let _ = oom::free_cached(self.device);
        let lever = plan_probe::lever(&self.cfg);
        let seq_len = self.cfg.data.seq_len;
        let text = match &probed {
            Ok(plan) => format!(
                "plan (probe of micro-batches {} and {} × {} tokens, {:.1}s): fixed {}, {} \
                 per sequence of {seq_len} tokens; predicted peak at micro-batch {start} {}; \
                 largest under target {}; logged beside each step's peak (plan_check)",
                sizes[0],
                sizes[1],
                plan.probe.seq_len,
                t0.elapsed().as_secs_f64(),
                fmt_bytes(plan.fixed(lever)),
                fmt_bytes(plan.per_sequence(lever, seq_len) as u64),
                fmt_bytes(plan.predict(lever, start, seq_len)),
                plan.largest_micro_batch(lever, seq_len)
                    .map_or("none".to_string(), |n| n.to_string()),
            ),
            Err(e) => format!("plan: the probe failed ({e}); the model's shapes stand in"),
        };
        bus.send(Telemetry::Notice(Notice::new(Level::Info, "plan", text)));
        if let Ok(plan) = &probed {
            bus.send(Telemetry::PlanSplit(plan_split(plan, lever)));
        }
        self.plan = Some(probed.unwrap_or_else(|_| {
            let held = self
                .meter
                .reset()
                .and_then(|()| self.meter.peak())
                .unwrap_or(0);
            let model = plan_probe::model_bytes(&self.model, &self.opt);
            Plan::from_shapes(shape, model, held, limit, target)
        }));
    }

    /// After a successful step: its peak, against the prediction, into the controller.
    fn observe_memory(&mut self, bus: &Bus, plan: &StepPlan, predicted: Option<u64>) {
        let peak = match self.meter.peak() {
            Ok(p) => p,
            Err(e) => {
                bus.send(Telemetry::Notice(Notice::new(Level::Warn, "memory", e)));
                return;
            }
        };
        let limit = self.meter.current_limit();
        self.controller.set_limit(limit);
        let usage = peak as f64 / limit as f64;
        self.memory.note_peak(peak, limit, usage);
        let measured = Measured {
            step: plan.step,
            peak_bytes: peak,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
        };
        if let Some(switch) = self.switch.take() {
            bus.send(Telemetry::Decision {
                step: plan.step,
                decision: switch.outcome(measured),
            });
            // The memory panel's bar follows the lever now in force.
            if let Some(p) = self.plan.as_ref().filter(|p| p.is_measured()) {
                bus.send(Telemetry::PlanSplit(plan_split(p, self.lever())));
            }
        }
        self.last_measured = Some(measured);
        if let Some(p) = self.plan.as_ref().filter(|p| p.is_measured()) {
            let lever = self.lever();
            bus.send(Telemetry::PlanCheck(PlanCheck {
                step: plan.step,
                micro_batch: plan.micro_batch,
                planned_bytes: p.predict(lever, plan.micro_batch, plan.seq_len),
                peak_bytes: peak,
            }));
        }
        bus.send(Telemetry::StepMemory(StepMemory {
            step: plan.step,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
            peak_bytes: peak,
            predicted_bytes: predicted,
            limit_bytes: limit,
            configured_limit_bytes: self.meter.limit(),
            usage,
        }));
        if self.watches_heap() {
            let live = procmem::take_heap_in_use_peak();
            if let Some(text) = self.heap.after_step(peak, predicted, live, limit) {
                bus.send(Telemetry::Notice(Notice::new(Level::Warn, "memory", text)));
            }
        }
        let decisions = self.controller.observe(StepObservation {
            step: plan.step,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
            peak_bytes: peak,
        });
        self.apply(bus, plan.step, decisions);
    }

    /// Whether steps are checked for memory glibc's heap holds beyond the batch
    /// ([`HeapWatch`]): on the CPU, unless tensors are mmapped already.
    fn watches_heap(&self) -> bool {
        self.device == Device::Cpu && !heap_watch::mmap_threshold_set(self.hard_limit)
    }

    /// Every tensor of the failed attempt is gone (returned or unwound); the gradients it
    /// half-accumulated are zeroed, the cache freed, and the controller picks the size
    /// the same samples are retried with. The optimizer never saw the attempt: its update
    /// is all-or-nothing (see [`AdamW::step`]).
    /// The precision and checkpointing in force now (the dashboard can switch both).
    fn lever(&self) -> Lever {
        Lever {
            precision: self.model.precision(),
            checkpoint: self.model.checkpointing(),
        }
    }

    /// With `memory.oom_snapshot` on CUDA: what the caching allocator held when the step
    /// ran out of memory, as memory_viz's pickle, beside the checkpoints; its path goes in
    /// the event log. A snapshot that fails is said and never ends the run it explains.
    fn snapshot_oom(&self, bus: &Bus, step: u64) {
        if !self.cfg.memory.oom_snapshot || matches!(self.device, Device::Cpu) {
            return;
        }
        let (level, text) = match snapshot::pickled() {
            Some(Ok(bytes)) => match snapshot::write_oom(&self.checkpoint_dir, step, &bytes) {
                Ok(path) => (
                    Level::Info,
                    format!(
                        "step {step}: what the allocator held at the out-of-memory error is \
                         in {} (open it at https://pytorch.org/memory_viz)",
                        path.display()
                    ),
                ),
                Err(e) => (
                    Level::Warn,
                    format!("step {step}: the out-of-memory snapshot could not be written: {e}"),
                ),
            },
            Some(Err(e)) => (
                Level::Warn,
                format!("step {step}: the out-of-memory snapshot failed: {e}"),
            ),
            None => return,
        };
        bus.send(Telemetry::Notice(Notice::new(level, "memory", text)));
    }

    fn recover_from_oom(
        &mut self,
        bus: &Bus,
        plan: &StepPlan,
        error: String,
    ) -> Result<(), String> {
        self.opt.zero_grad();
        self.memory.ooms += 1;
        let outcome = self.controller.on_oom(plan.micro_batch, plan.seq_len);
        bus.send(Telemetry::Oom {
            step: plan.step,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
            retry_with: outcome.retry_with,
            error: first_line(&error),
        });
        self.apply(bus, plan.step, outcome.decisions);
        self.snapshot_oom(bus, plan.step);
        if outcome.retry_with.is_some() {
            return Ok(());
        }
        if self.cfg.memory.auto_checkpoint && !self.model.checkpointing().is_on() {
            // The smallest micro-batch does not fit: recomputing the blocks' activations
            // may make it fit, which beats stopping (the user opted in).
            self.switch_checkpointing(Checkpointing::Blocks, "controller");
            bus.send(Telemetry::Notice(Notice::new(
                Level::Warn,
                "memory",
                format!(
                    "step {} ran out of memory at the smallest micro-batch ({} × {} tokens): \
                     activation checkpointing is now on (memory.auto_checkpoint) and the step \
                     is retried",
                    plan.step, plan.micro_batch, plan.seq_len
                ),
            )));
            return Ok(());
        }
        // The give-up runs while the cap may be full; the tests fill it here. Its record,
        // its message and its checkpoint's buffers are headroom's own allocations, which
        // the cap never refuses (host/src/own_heap.rs).
        procmem::fill_cap_if_asked();
        let saved = match self.checkpoint(bus) {
            Ok(path) => format!(
                "the state after step {} is saved at {}",
                self.step,
                path.display()
            ),
            Err(e) => format!("the checkpoint failed too: {e}"),
        };
        // The last words: which lever would make one sequence fit, from the plan.
        let levers = match &self.plan {
            Some(p) if plan.micro_batch == 1 => format!(
                " What would fit: {}.",
                p.levers_that_fit(self.lever(), plan.seq_len)
            ),
            _ => String::new(),
        };
        Err(format!(
            "step {} ran out of memory {} times in a row at micro-batch {} ({} tokens per \
             sequence); {saved}. Lower data.seq_len or the model size, or give it more \
             memory (--memory-budget), then --resume.{levers}",
            plan.step,
            self.controller.config().max_ooms_at_min,
            plan.micro_batch,
            plan.seq_len
        ))
    }

    /// A precision switch, from the next step on; what the run's checkpoints record too.
    fn switch_precision(&mut self, to: Precision, source: &'static str) -> Option<String> {
        let was = self.model.precision();
        if was == to {
            return None;
        }
        self.model.set_precision(to);
        self.cfg.model.precision = to;
        Some(self.note_switch(format!("precision {was} → {to}"), source))
    }

    /// An activation-checkpointing switch, from the next step on.
    fn switch_checkpointing(&mut self, to: Checkpointing, source: &'static str) -> Option<String> {
        let was = self.model.checkpointing();
        if was == to {
            return None;
        }
        self.model.set_checkpointing(to);
        self.cfg.model.checkpoint = to;
        Some(self.note_switch(format!("activation checkpointing {was} → {to}"), source))
    }

    /// Waits for the next step's peak to say what the switch freed; two switches before
    /// one step are said together, against the peak before the first.
    fn note_switch(&mut self, what: String, source: &'static str) -> String {
        let text = format!("{what} from step {}", self.step + 1);
        self.switch = Some(match self.switch.take() {
            Some(earlier) => PendingSwitch {
                what: format!("{}, {what}", earlier.what),
                ..earlier
            },
            None => PendingSwitch {
                what,
                source,
                before: self.last_measured,
            },
        });
        text
    }

    /// Carries out the controller's decisions and reports each with its numbers.
    /// `step` is the step the decision concerns: made before its first attempt, after an
    /// out-of-memory error in it, or once it completed (one numbering, on screen and in
    /// the log).
    fn apply(&mut self, bus: &Bus, step: u64, decisions: Vec<Decision>) {
        for decision in decisions {
            if let Decision::Resize { .. } = decision {
                self.memory.resizes += 1;
            }
            if let Decision::EmptyCache { .. } = decision {
                if let Err(e) = oom::free_cached(self.device) {
                    bus.send(Telemetry::Notice(Notice::new(
                        Level::Warn,
                        "memory",
                        format!("freeing cached memory failed: {e}"),
                    )));
                }
            }
            bus.send(Telemetry::Decision { step, decision });
        }
    }

    fn thresholds_changed(&self, bus: &Bus, source: &str) {
        let thresholds = self.controller.thresholds();
        let profile = [
            Profile::Aggressive,
            Profile::Balanced,
            Profile::Conservative,
        ]
        .into_iter()
        .find(|p| p.thresholds() == thresholds);
        bus.send(Telemetry::ThresholdsChanged {
            thresholds,
            profile,
            source: source.into(),
        });
    }

    fn evaluate(&mut self, bus: &Bus) -> Result<(), String> {
        let val_loss = self.evaluate_fitting(bus)?;
        let (sum, n) = self.losses_since_eval;
        // No step since the last evaluation (a run stopped before its first step): the
        // freshest figure there is stands in, so the record never holds a NaN.
        let train_loss = if n > 0 {
            sum / n as f64
        } else {
            self.last_loss.unwrap_or(val_loss)
        };
        self.losses_since_eval = (0.0, 0);
        self.last_eval_step = Some(self.step);
        self.last_val_loss = Some(val_loss);
        bus.send(Telemetry::Eval(EvalMetrics {
            step: self.step,
            val_loss,
            train_loss,
            tokens: (self.val_offsets.len() * self.data.seq_len()) as u64,
        }));
        Ok(())
    }

    /// Validation in chunks of the current micro-batch, halved after an out-of-memory error
    /// (the result does not depend on the chunk).
    fn evaluate_fitting(&mut self, bus: &Bus) -> Result<f64, String> {
        let mut chunk = self.controller.micro_batch();
        loop {
            let (model, data, offsets) = (&self.model, &self.data, &self.val_offsets);
            match attempt(self.hard_limit, || {
                step::evaluate(model, data, offsets, chunk)
            }) {
                Ok(v) => return Ok(v),
                Err(Failure::Oom(_)) if chunk > 1 => {}
                Err(Failure::Oom(e) | Failure::Other(e)) => {
                    return Err(format!("validation at step {} failed: {e}", self.step));
                }
            }
            let _ = oom::free_cached(self.device);
            bus.send(Telemetry::Notice(Notice::new(
                Level::Warn,
                "memory",
                format!(
                    "validation ran out of memory in chunks of {chunk}; retrying in chunks of {}",
                    chunk / 2
                ),
            )));
            chunk /= 2;
        }
    }

    /// Saves the current state (once per step: a second request reports the first save).
    fn checkpoint(&mut self, bus: &Bus) -> Result<PathBuf, CheckpointError> {
        let path = match &self.saved {
            Some((step, path)) if *step == self.step => path.clone(),
            _ => {
                let state = CheckpointState::new(
                    self.step,
                    self.tokens_seen,
                    &self.cfg,
                    &self.model,
                    self.controller.micro_batch(),
                )
                .with_corpus(Some(self.corpus.clone()))
                .with_controller(Some(self.controller.journal().clone()));
                let save =
                    || checkpoint::save(&self.checkpoint_dir, &self.model, &self.opt, &state);
                let path = match save() {
                    Ok(path) => path,
                    Err(first) => {
                        // Most often a full disk: older checkpoints go first, the newest
                        // one stays whatever happens, and the save is tried once more.
                        let keep = self.saved.as_ref().map(|s| s.1.as_path());
                        let removed = checkpoint::prune_all_but(&self.checkpoint_dir, keep);
                        if removed.is_empty() {
                            return Err(first);
                        }
                        bus.send(Telemetry::Notice(Notice::new(
                            Level::Warn,
                            "checkpoint",
                            format!(
                                "saving step {} failed ({first}); deleted older checkpoints \
                                 ({}) to make room and trying again",
                                self.step,
                                removed.join(", ")
                            ),
                        )));
                        save()?
                    }
                };
                self.saved = Some((self.step, path.clone()));
                path
            }
        };
        bus.send(Telemetry::CheckpointSaved {
            step: self.step,
            path: path.display().to_string(),
        });
        Ok(path)
    }

    /// What is on disk after a failed save: said exactly, since that is what the user keeps.
    fn kept_text(&self) -> String {
        match &self.saved {
            Some((step, path)) if path.join("state.json").exists() => format!(
                "Kept: the checkpoint of step {step} at {} ({} steps behind), untouched; \
                 continue from it with --resume {} once there is room",
                path.display(),
                self.step - step,
                self.checkpoint_dir.display()
            ),
            _ => format!(
                "No checkpoint of this run is on disk: the {} steps trained are lost; free \
                 space in {} (or choose another --checkpoint-dir) and start again",
                self.step - self.start_step,
                self.checkpoint_dir.display()
            ),
        }
    }

    /// Acts on every waiting command; blocks while paused.
    fn drain_commands(&mut self, bus: &Bus, commands: &Receiver<Command>) -> Result<Flow, String> {
        let mut paused = false;
        loop {
            let cmd = if let Some(c) = self.pending.pop_front() {
                c
            } else if paused {
                match commands.recv() {
                    Ok(c) => c,
                    // Nobody can resume us any more: stop cleanly rather than hang.
                    Err(_) => return Ok(self.stop(bus, None)),
                }
            } else {
                match commands.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => return Ok(Flow::Continue),
                    Err(TryRecvError::Disconnected) => return Ok(self.stop(bus, None)),
                }
            };
            let applied = |bus: &Bus, command: Command, applied: String| {
                bus.send(Telemetry::CommandApplied { command, applied });
            };
            match cmd {
                Command::Stop => return Ok(self.stop(bus, Some(cmd))),
                Command::Pause if paused => {
                    applied(bus, cmd, format!("already paused after step {}", self.step));
                }
                Command::Pause => {
                    paused = true;
                    bus.send(Telemetry::Status {
                        status: RunStatus::Paused,
                    });
                    applied(bus, cmd, format!("paused after step {}", self.step));
                }
                Command::Resume if paused => {
                    paused = false;
                    bus.send(Telemetry::Status {
                        status: RunStatus::Running,
                    });
                    applied(bus, cmd, format!("resumed at step {}", self.step + 1));
                }
                Command::Resume => applied(bus, cmd, "already running".into()),
                Command::Checkpoint => match self.checkpoint(bus) {
                    Ok(path) => applied(
                        bus,
                        cmd,
                        format!("checkpoint of step {} at {}", self.step, path.display()),
                    ),
                    Err(e) => applied(bus, cmd, format!("checkpoint failed: {e}")),
                },
                Command::SetThresholds { thresholds } => {
                    let done = format!("thresholds {thresholds} in force");
                    self.set_thresholds(bus, cmd, thresholds, done);
                }
                Command::SetProfile { profile } => {
                    let t = profile.thresholds();
                    self.set_thresholds(bus, cmd, t, format!("profile {profile}: thresholds {t}"));
                }
                Command::PinMicroBatch { micro_batch } => {
                    let decisions = self.controller.pin(micro_batch);
                    self.apply(bus, self.step, decisions);
                    let mb = self.controller.micro_batch();
                    let note = if mb == micro_batch {
                        String::new()
                    } else {
                        format!(" ({micro_batch} is outside the allowed range)")
                    };
                    applied(
                        bus,
                        cmd,
                        format!(
                            "micro-batch pinned at {mb}{note}, {} accumulation steps",
                            self.effective_batch.div_ceil(mb)
                        ),
                    );
                }
                Command::Unpin => {
                    self.controller.unpin();
                    applied(
                        bus,
                        cmd,
                        "micro-batch unpinned; the controller resizes again".into(),
                    );
                }
                Command::SetPrecision { precision } => {
                    let text = self
                        .switch_precision(precision, "command")
                        .unwrap_or_else(|| format!("precision is already {precision}"));
                    applied(bus, cmd, text);
                }
                Command::SetCheckpointing { checkpoint } => {
                    let text = self
                        .switch_checkpointing(checkpoint, "command")
                        .unwrap_or_else(|| {
                            format!("activation checkpointing is already {checkpoint}")
                        });
                    applied(bus, cmd, text);
                }
                Command::FreeCache => {
                    let (what, before) = oom::held(self.device);
                    let text = match oom::free_cached(self.device) {
                        Ok(()) => {
                            let after = oom::held(self.device).1;
                            format!("cached memory freed: {what} {before} → {after}")
                        }
                        Err(e) => format!("freeing cached memory failed: {e}"),
                    };
                    applied(bus, cmd, text);
                }
            }
        }
    }

    /// A threshold change from a command: in force and confirmed, or refused with the old
    /// values kept and the reason said.
    fn set_thresholds(&mut self, bus: &Bus, command: Command, t: Thresholds, done: String) {
        let old = self.controller.thresholds();
        let applied = match self.controller.set_thresholds(t) {
            Ok(()) => {
                self.thresholds_changed(bus, "command");
                done
            }
            Err(e) => format!("refused: {e}; {old} stay in force"),
        };
        bus.send(Telemetry::CommandApplied { command, applied });
    }

    fn stop(&mut self, bus: &Bus, cmd: Option<Command>) -> Flow {
        self.stopped_by_user = true;
        bus.send(Telemetry::Status {
            status: RunStatus::Stopping,
        });
        if let Some(command) = cmd {
            bus.send(Telemetry::CommandApplied {
                command,
                applied: format!("stopping after step {}", self.step),
            });
        }
        Flow::Stop
    }
}

/// The memory panel's stacked bar under `lever`: what is fixed, what each token adds.
fn plan_split(plan: &Plan, lever: Lever) -> PlanSplit {
    PlanSplit {
        model_bytes: plan.model_bytes(),
        overhead_bytes: plan.fixed(lever).saturating_sub(plan.model_bytes()),
        activations_per_token: plan.per_token(lever).total(),
    }
}

/// What a stop left of step `s`, given up after `done` of its `total` micro-batches: the
/// gradients it drops are partial only when some micro-batches were still to come.
fn abandoned_text(s: u64, done: usize, total: usize, secs: f64) -> String {
    let dropped = match done {
        0 => "nothing of it had been computed",
        d if d >= total => "its gradients, complete but not yet applied, are dropped",
        _ => "its partial gradients are dropped",
    };
    format!(
        "step {s} abandoned after {done} of {total} micro-batches ({secs:.1}s in): {dropped} \
         and the parameters stay those of step {}; a resume redoes step {s}",
        s - 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_in_a_steps_only_micro_batch_does_not_call_its_gradients_partial() {
        let only = abandoned_text(8, 1, 1, 0.4);
        assert!(
            only.contains("complete but not yet applied") && !only.contains("partial"),
            "{only}"
        );
        assert!(abandoned_text(8, 3, 8, 1.0).contains("partial gradients"));
        assert!(abandoned_text(8, 0, 8, 0.0).contains("nothing of it"));
        assert!(abandoned_text(8, 3, 8, 1.0).contains("stay those of step 7"));
    }

    fn lengthened(from: u64, to: u64, step: u64) -> Notice {
        let mut then = RunConfig::default();
        then.run.steps = from;
        let mut now = then.clone();
        now.run.steps = to;
        schedule_change(&now, &then, step).expect("the length changed")
    }

    #[test]
    fn a_longer_run_in_warmup_is_said_without_alarm() {
        // The default warms up over 20 steps: step 6's rate does not depend on the length.
        let n = lengthened(300, 500, 5);
        assert_eq!(n.level, Level::Info, "{}", n.text);
        assert!(
            n.text.contains("step 6's lr is unchanged") && !n.text.contains("instead of"),
            "{}",
            n.text
        );
        // After warmup it does: a warning with both rates.
        let n = lengthened(300, 500, 200);
        assert_eq!(n.level, Level::Warn, "{}", n.text);
        assert!(n.text.contains("instead of"), "{}", n.text);
        let mut same = RunConfig::default();
        same.run.steps = 300;
        assert!(schedule_change(&same, &same.clone(), 5).is_none());
    }
}
