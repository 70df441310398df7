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

use crossbeam_channel::{bounded, Receiver, TryRecvError};
use headroom_core::{
    Bus, Command, EvalMetrics, Level, Notice, RunConfig, RunInfo, RunStatus, RunSummary,
    StepMetrics, Telemetry,
};
use tch::{Device, TchError};

use crate::checkpoint::{self, CheckpointError, CheckpointState};
use crate::data::{DataError, Dataset};
use crate::device::{self, DeviceError};
use crate::model::Gpt;
use crate::optim::{AdamW, AdamWConfig};
use crate::schedule::Schedule;
use crate::step::{self, StepPlan};

pub struct TrainOptions {
    /// The run's configuration, validated.
    pub config: RunConfig,
    pub checkpoint_dir: PathBuf,
    /// A checkpoint root or step directory to continue from.
    pub resume: Option<PathBuf>,
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
}

/// The config a checkpoint was trained with (for `--resume`).
pub fn read_checkpoint_config(dir: &Path) -> Result<RunConfig, CheckpointError> {
    Ok(checkpoint::load(dir)?.state.config)
}

/// Starts the trainer thread and waits until it has prepared the run (corpus, device,
/// model, optimizer, resumed checkpoint, writable checkpoint directory). Training then
/// proceeds on the thread; `commands` steer it, `bus` carries what it reports.
pub fn spawn(
    opts: TrainOptions,
    bus: Bus,
    commands: Receiver<Command>,
) -> Result<TrainerHandle, TrainError> {
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
        Ok(Ok(device)) => Ok(TrainerHandle { thread, device }),
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
    /// Sequences per forward/backward right now. Runner state, not config: a memory
    /// controller may change it between steps without changing what a step trains on.
    micro_batch: usize,
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
}

impl Trainer {
    fn prepare(opts: TrainOptions, bus: &Bus) -> Result<Trainer, TrainError> {
        let cfg = opts.config;
        cfg.validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let data = Dataset::load(&cfg.data.corpus, cfg.data.val_fraction, cfg.data.seq_len)?;
        let choice = cfg
            .device()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let device = device::resolve(choice, bus)?;
        checkpoint::check_writable(&opts.checkpoint_dir)?;
        let resumed = opts.resume.as_deref().map(checkpoint::load).transpose()?;

        let torch = |what: &str, e: TchError| TrainError::Torch(format!("{what} failed: {e}"));
        let model = Gpt::new(&cfg.model, cfg.data.seq_len, device, cfg.run.seed)
            .map_err(|e| torch("building the model", e))?;
        let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim))
            .map_err(|e| torch("allocating the optimizer state", e))?;

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

        let val_offsets = data.val_offsets(cfg.run.eval_batches * cfg.batch.micro_batch);
        Ok(Trainer {
            schedule: Schedule::new(&cfg.optim, cfg.run.steps),
            micro_batch: cfg.batch.micro_batch,
            effective_batch: cfg.batch.effective(),
            checkpoint_dir: opts.checkpoint_dir,
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
        })
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
            config: self.cfg.clone(),
        }));
        bus.send(Telemetry::Status {
            status: RunStatus::Running,
        });

        while self.step < total {
            if let Flow::Stop = self.drain_commands(bus, commands)? {
                break;
            }
            self.train_one(bus)?;
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

        if self.last_eval_step != Some(self.step) {
            self.evaluate(bus)?;
        }
        let trained = self.step > self.start_step;
        if trained && self.saved.as_ref().map(|s| s.0) != Some(self.step) {
            self.checkpoint(bus).map_err(|e| e.to_string())?;
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
        };
        bus.send(Telemetry::Status {
            status: RunStatus::Finished,
        });
        bus.send(Telemetry::Finished(summary.clone()));
        Ok(summary)
    }

    fn train_one(&mut self, bus: &Bus) -> Result<(), String> {
        let s = self.step + 1;
        let plan = StepPlan {
            seed: self.cfg.run.seed,
            step: s,
            effective_batch: self.effective_batch,
            micro_batch: self.micro_batch,
            lr: self.schedule.lr_at(s),
            grad_clip: self.cfg.optim.grad_clip,
        };
        let t0 = Instant::now();
        let out = step::train_step(&self.model, &mut self.opt, &self.data, &plan)
            .map_err(|e| format!("step {s} failed: {e}"))?;
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        if !out.loss.is_finite() {
            return Err(format!(
                "step {s}: the loss is {} (training diverged); lower optim.lr or raise \
                 optim.warmup_steps",
                out.loss
            ));
        }
        let tokens = (plan.effective_batch * self.data.seq_len()) as u64;
        self.step = s;
        self.tokens_seen += tokens;
        self.last_loss = Some(out.loss);
        self.losses_since_eval.0 += out.loss;
        self.losses_since_eval.1 += 1;
        bus.send(Telemetry::Step(StepMetrics {
            step: s,
            total_steps: self.cfg.run.steps,
            loss: out.loss,
            lr: plan.lr,
            grad_norm: out.grad_norm,
            step_time_s: dt,
            tokens_per_s: tokens as f64 / dt,
            samples_per_s: plan.effective_batch as f64 / dt,
            micro_batch: plan.micro_batch,
            accum_steps: plan.accum_steps(),
            effective_batch: plan.effective_batch,
            seq_len: self.data.seq_len(),
            tokens_seen: self.tokens_seen,
        }));
        Ok(())
    }

    fn evaluate(&mut self, bus: &Bus) -> Result<(), String> {
        let val_loss = step::evaluate(&self.model, &self.data, &self.val_offsets, self.micro_batch)
            .map_err(|e| format!("validation at step {} failed: {e}", self.step))?;
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

    /// Saves the current state (once per step: a second request reports the first save).
    fn checkpoint(&mut self, bus: &Bus) -> Result<PathBuf, CheckpointError> {
        let path = match &self.saved {
            Some((step, path)) if *step == self.step => path.clone(),
            _ => {
                let state =
                    CheckpointState::new(self.step, self.tokens_seen, &self.cfg, &self.model);
                let path = checkpoint::save(&self.checkpoint_dir, &self.model, &self.opt, &state)?;
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

    /// Acts on every waiting command; blocks while paused.
    fn drain_commands(&mut self, bus: &Bus, commands: &Receiver<Command>) -> Result<Flow, String> {
        let mut paused = false;
        loop {
            let cmd = if paused {
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
            }
        }
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
