//! The trainer thread: prepares everything, then steps, evaluates and checkpoints while
//! answering the UI's commands at step boundaries. It drives a [`Session`] (host/src/
//! session/), which keeps what the run is and answers commands, as a Python run does.
//!
//! - [`prepare`]: the checks before training and the memory policy;
//! - [`steps`]: one optimizer step, its peak and its out-of-memory recovery;
//! - [`commands`]: commands at a step boundary, and what only this trainer carries out;
//! - [`saving`]: validation and checkpoints.
//!
//! Every tensor lives and dies on this thread; only telemetry and the final summary leave
//! it. Preparation happens on the thread too (libtorch state is per thread in places,
//! e.g. grad mode), and its outcome is reported back before [`spawn`] returns, so bad
//! input is a one-line error before any dashboard starts.
use std::any::Any;
use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver};
use headroom_core::plan::Plan;
use headroom_core::{
    Bus, Command, Level, Notice, RunConfig, RunInfo, RunStatus, RunSummary, Telemetry,
};
use headroom_host::session::Session;
use tch::{Device, TchError};

use crate::checkpoint::{self, CheckpointError, CorpusRecord};
use crate::data::{DataError, Dataset};
use crate::device::{self, DeviceError};
use crate::heap_watch::HeapWatch;
use crate::model::Gpt;
use crate::oom;
use crate::optim::AdamW;
use crate::peak::PeakMeter;
use crate::schedule::Schedule;
use crate::stop::StopSwitch;

mod commands;
mod prepare;
mod saving;
mod steps;

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
    /// Validation chunks (1-based, counting only chunks of more than one window, over the
    /// whole run) whose attempt raises a real out-of-memory error after its forward
    /// (`HEADROOM_INJECT_EVAL_OOM`).
    pub inject_eval_oom: Vec<u64>,
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
            inject_eval_oom: Vec::new(),
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
            // Said before `spawn` returns: whatever starts then (the sampler, the log
            // writer, viewers' catch-up) comes after the run's start in the stream.
            trainer.announce();
            let _ = ready_tx.send(Ok(trainer.device));
            drop(ready_tx);
            let outcome = catch_unwind(AssertUnwindSafe(|| trainer.run(&commands)))
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

/// How an attempt at a step or a validation chunk failed.
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
    /// The run whatever trains it: the controller deciding the micro-batch (sequences
    /// per forward/backward) between steps, its journal, thresholds, pause and stop, the
    /// step and memory records, lever switches. What a step trains on does not depend on
    /// it.
    session: Session,
    meter: PeakMeter,
    /// Steps whose first attempt is made to run out of memory; each fires once.
    inject_oom: BTreeSet<u64>,
    /// Validation chunks (of more than one window) made to run out of memory; each once.
    inject_eval_oom: BTreeSet<u64>,
    /// Validation chunks of more than one window attempted so far, this process.
    eval_chunks_tried: u64,
    inject_panic: Option<u64>,
    /// `--hard-limit` is on: allocation failures that do not say "memory" are OOMs too.
    hard_limit: bool,
    /// Said once the run has started (the UI learns the run before its details).
    startup_notices: Vec<Notice>,
    effective_batch: usize,
    start_step: u64,
    /// Where the latest state of this run is on disk, and its step.
    saved: Option<(u64, PathBuf)>,
    last_eval_step: Option<u64>,
    /// Training losses since the previous evaluation (sum, count).
    losses_since_eval: (f64, u64),
    /// The checkpoint directory is this run's while this lives.
    _lock: checkpoint::DirLock,
    /// The corpus as checkpoints record it.
    corpus: CorpusRecord,
    /// Tokens per micro-batch of the previous step ([`Trainer::follow_smaller_step`]).
    last_tokens: usize,
    /// Whether glibc's heap holds memory the batch does not ([`HeapWatch`]).
    heap: HeapWatch,
    /// Asked between micro-batches whether to give the step up.
    stop: StopSwitch,
    /// Commands that arrived during a step, carried out at its end.
    pending: VecDeque<Command>,
    /// Where a step's memory goes, probed at the start ([`Trainer::start_plan`]): its
    /// prediction is logged beside every step's peak, and it names the lever that would
    /// fit when even the smallest micro-batch does not.
    plan: Option<Plan>,
}

impl Trainer {
    /// The run's start: what it is, the notices its preparation gathered, the thresholds
    /// in force.
    fn announce(&mut self) {
        self.session.run_started(RunInfo {
            run_name: self.cfg.run.name.clone(),
            device: device::label(self.device),
            device_name: device::human_name(self.device),
            parameters: self.model.num_parameters(),
            start_step: self.start_step,
            total_steps: self.cfg.run.steps,
            corpus: self.data.name().to_string(),
            train_bytes: self.data.train_bytes() as u64,
            val_bytes: self.data.val_bytes() as u64,
            config: Some(self.cfg.clone()),
            checkpoints: Some(true),
            levers: None,
        });
        for notice in std::mem::take(&mut self.startup_notices) {
            self.session.send(Telemetry::Notice(notice));
        }
        self.session.thresholds_changed("config", None);
    }

    fn run(&mut self, commands: &Receiver<Command>) -> Result<RunSummary, String> {
        let total = self.cfg.run.steps;
        self.start_plan();
        self.session.status(RunStatus::Running);

        self.stop.publish(self.session.step(), false);
        while self.session.step() < total {
            if let Flow::Stop = self.drain_commands(commands)? {
                break;
            }
            if !self.train_one(commands)? {
                // Given up for a stop: the stop command is among those that arrived during
                // the step (or on its way); the others go with the run.
                let cmd = self
                    .pending
                    .iter()
                    .position(|c| matches!(c, Command::Stop))
                    .and_then(|i| self.pending.remove(i));
                self.session.stop(cmd);
                break;
            }
            let s = self.session.step();
            let every = |n: u64| n > 0 && s.is_multiple_of(n) && s < total;
            if every(self.cfg.run.eval_every) {
                self.evaluate()?;
            }
            if every(self.cfg.run.checkpoint_every) {
                // A failed periodic save is not worth the run: warn, retry at the next.
                if let Err(e) = self.checkpoint() {
                    self.session
                        .notice(Level::Error, "checkpoint", e.to_string());
                }
            }
        }

        // A stop skips the final validation pass: whoever stops a run (a scheduler whose
        // SIGKILL follows, a user at the keyboard) waits for the checkpoint, not for it.
        let step = self.session.step();
        if !self.session.stop_requested() && self.last_eval_step != Some(step) {
            self.evaluate()?;
        }
        let trained = step > self.start_step;
        if trained && self.saved.as_ref().map(|s| s.0) != Some(step) {
            if let Err(e) = self.checkpoint() {
                return Err(format!(
                    "the final checkpoint (step {step}) could not be written: {e}. {}",
                    self.kept_text()
                ));
            }
        }
        Ok(self.session.finished(false))
    }
}
