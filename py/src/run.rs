//! One Python run: the bus and its sinks (log, stream server), the sampler, and, in
//! adaptive mode, the same [`Controller`] `headroom train` uses. Python calls in at the
//! points the built-in trainer's runner does (before a step, after its peak is known,
//! after an OOM, at the step boundary for commands) and carries out what comes back.
//! Every call that changes the controller is journaled ([`Journaled`]), so a checkpoint
//! can carry the controller (`run.state_dict()`) and a resume replay it.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use headroom_core::config::{auto_budget, MemorySection, RunConfig};
use headroom_core::journal::{ControllerJournal, Journaled};
use headroom_core::policy::{
    ControllerConfig, Decision, Profile, StepObservation, Thresholds, Upcoming,
};
use headroom_core::protocol::JobRank;
use headroom_core::units::fmt_bytes;
use headroom_core::{
    Bus, Command, Level, MemorySummary, Notice, RunInfo, RunStatus, RunSummary, StepMemory,
    StepMetrics, Telemetry,
};
use headroom_host::logger::{self, LogWriter};
use headroom_host::sampler::{AllocatorSource, Sampler};
use headroom_host::server::{self, ServeOptions, Server};
use headroom_host::{procmem, rundir};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::allocator::PyAllocator;

/// How long the end waits for attached viewers and the log to take the last records.
const VIEWERS_WAIT: Duration = Duration::from_secs(2);
const LOG_WAIT: Duration = Duration::from_secs(5);

/// The preset whose values `t` are exactly, if any.
fn profile_of(t: Thresholds) -> Option<Profile> {
    [
        Profile::Aggressive,
        Profile::Balanced,
        Profile::Conservative,
    ]
    .into_iter()
    .find(|p| p.thresholds() == t)
}

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[pyclass(module = "headroom._native")]
pub struct NativeRun {
    bus: Option<Bus>,
    commands: Receiver<Command>,
    /// Held so the command channel stays open whether or not a server is up.
    _commands_tx: Sender<Command>,
    server: Option<Server>,
    log: Option<LogWriter>,
    sampler: Option<Sampler>,
    controller: Option<Journaled>,
    /// How an adaptive run's controller was built: a restored journal replays into one
    /// built the same way.
    controller_cfg: Option<ControllerConfig>,
    /// `memory_budget="auto"` on the CPU: a resume keeps the budget the run resolved.
    auto_budget: bool,
    started: Instant,
    name: String,
    cuda: bool,
    /// Allocations past the budget fail (RLIMIT_DATA): tensors are mmapped.
    hard_limit: bool,
    /// The configured limit: the budget, host memory or the device's memory.
    limit: u64,
    /// In force for a watch-only run (an adaptive run's live in its controller).
    thresholds: Thresholds,
    effective_batch: usize,
    total_steps: u64,
    paused: bool,
    stop_requested: bool,
    /// Where the log is written (`log=`, or the next free name beside it).
    log_path: Option<PathBuf>,
    /// Commands handed to Python to carry out, by the id Python confirms them with.
    pending: BTreeMap<u64, Command>,
    next_id: u64,
    ended: bool,
    step: u64,
    tokens_seen: u64,
    last_loss: Option<f64>,
    last_val_loss: Option<f64>,
    checkpoint: Option<String>,
    memory: MemorySummary,
    /// The last step's limit and usage (a job's rows carry them).
    last_limit: u64,
    last_usage: f64,
    /// Whether the loop gave a checkpoint callback: what a stop may promise.
    checkpoints: bool,
}

impl NativeRun {
    fn bus(&self) -> PyResult<&Bus> {
        self.bus
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("this headroom run has ended"))
    }

    fn send(&self, msg: Telemetry) {
        if let Some(bus) = &self.bus {
            bus.send(msg);
        }
    }

    fn notice(&self, level: Level, source: &str, text: String) {
        self.send(Telemetry::Notice(Notice::new(level, source, text)));
    }

    fn thresholds_now(&self) -> Thresholds {
        self.controller
            .as_ref()
            .map_or(self.thresholds, |c| c.thresholds())
    }

    /// The thresholds in force, with the profile they are (as `headroom train` says it:
    /// the preset whose values they are, given by name or by value), else custom.
    fn thresholds_changed(&self, source: &str, profile: Option<Profile>) {
        let thresholds = self.thresholds_now();
        let profile = profile.or_else(|| profile_of(thresholds));
        self.send(Telemetry::ThresholdsChanged {
            thresholds,
            profile,
            source: source.into(),
        });
    }

    /// What a stop saves, said where the stop is asked for. `mid_step`: asked during a
    /// step (a signal), which a watch-only loop finishes before the checkpoint.
    fn stop_checkpoint_text(&self, mid_step: bool) -> String {
        if self.checkpoints && mid_step && self.controller.is_none() {
            "the checkpoint will be taken at the end of the step in progress".to_string()
        } else if self.checkpoints {
            format!("the checkpoint will be of step {}", self.step)
        } else {
            "no checkpoint will be taken: this run has no on_checkpoint (give \
             headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
                .to_string()
        }
    }

    /// Carries out what Rust can (reporting every decision); says whether Python must
    /// free the allocator's cache.
    fn apply(&mut self, step: u64, decisions: Vec<Decision>) -> bool {
        let mut free_cache = false;
        for decision in decisions {
            match decision {
                Decision::Resize { .. } => self.memory.resizes += 1,
                Decision::EmptyCache { .. } => free_cache = true,
                _ => {}
            }
            self.send(Telemetry::Decision { step, decision });
        }
        free_cache
    }

    fn applied(&self, command: Command, applied: String) {
        self.send(Telemetry::CommandApplied { command, applied });
    }

    fn set_thresholds(&mut self, command: Command, t: Thresholds, profile: Option<Profile>) {
        let old = self.thresholds_now();
        let result = match self.controller.as_mut() {
            Some(c) => c.set_thresholds(t),
            None => t.validate().map(|()| self.thresholds = t),
        };
        let text = match result {
            Ok(()) => {
                self.thresholds_changed("command", profile);
                match profile {
                    Some(p) => format!("profile {p}: thresholds {t}"),
                    None => format!("thresholds {t} in force"),
                }
            }
            Err(e) => format!("refused: {e}; {old} stay in force"),
        };
        self.applied(command, text);
    }

    /// Acts on one command; returns it when Python must carry it out.
    fn handle(&mut self, cmd: Command) -> Option<Command> {
        match cmd {
            Command::Stop => {
                self.paused = false;
                if !self.stop_requested {
                    self.stop_requested = true;
                    self.send(Telemetry::Status {
                        status: RunStatus::Stopping,
                    });
                }
                let text = format!(
                    "stopping after step {} (run.should_stop is set; the loop ends when it \
                     reads it); {}",
                    self.step,
                    self.stop_checkpoint_text(false)
                );
                self.applied(cmd, text);
            }
            Command::Pause if self.paused => {
                self.applied(cmd, format!("already paused after step {}", self.step))
            }
            Command::Pause => {
                self.paused = true;
                self.send(Telemetry::Status {
                    status: RunStatus::Paused,
                });
                self.applied(cmd, format!("paused after step {}", self.step));
            }
            Command::Resume if self.paused => {
                self.paused = false;
                self.send(Telemetry::Status {
                    status: RunStatus::Running,
                });
                self.applied(cmd, format!("resumed at step {}", self.step + 1));
            }
            Command::Resume => self.applied(cmd, "already running".into()),
            Command::SetThresholds { thresholds } => self.set_thresholds(cmd, thresholds, None),
            Command::SetProfile { profile } => {
                self.set_thresholds(cmd, profile.thresholds(), Some(profile))
            }
            Command::PinMicroBatch { micro_batch } => {
                let step = self.step;
                let Some(c) = self.controller.as_mut() else {
                    self.applied(
                        cmd,
                        "refused: a watch-only run has no micro-batch to pin (adaptive runs \
                         hand their batch to run.backward)"
                            .into(),
                    );
                    return None;
                };
                let decisions = c.pin(micro_batch);
                let mb = c.micro_batch();
                self.apply(step, decisions);
                let note = if mb == micro_batch {
                    String::new()
                } else {
                    format!(" ({micro_batch} is outside the allowed range)")
                };
                let text = format!(
                    "micro-batch pinned at {mb}{note}, {} accumulation steps",
                    self.effective_batch.div_ceil(mb.max(1))
                );
                self.applied(cmd, text);
            }
            Command::Unpin => match self.controller.as_mut() {
                Some(c) => {
                    c.unpin();
                    self.applied(
                        cmd,
                        "micro-batch unpinned; the controller resizes again".into(),
                    );
                }
                None => self.applied(cmd, "refused: a watch-only run has no micro-batch".into()),
            },
            Command::Checkpoint | Command::FreeCache => return Some(cmd),
            // A Python run's precision and checkpointing are its script's (autocast,
            // torch.utils.checkpoint): nothing here can change them.
            Command::SetPrecision { .. } | Command::SetCheckpointing { .. } => self.applied(
                cmd,
                "refused: a Python run's precision and activation checkpointing are set by \
                 its script"
                    .into(),
            ),
        }
        None
    }

    /// Keeps a command Python must carry out until it is confirmed; its `(id, kind)`.
    fn hand_to_python(&mut self, cmd: Command) -> (u64, String) {
        let id = self.next_id;
        self.next_id += 1;
        let kind = match cmd {
            Command::Checkpoint => "checkpoint",
            _ => "free_cache",
        };
        self.pending.insert(id, cmd);
        (id, kind.to_string())
    }

    /// Ends the run: the last records out, then every thread and socket gone. Called with
    /// the GIL released: the sampler may be waiting for it to read the allocator.
    fn shut_down(
        bus: Option<Bus>,
        sampler: Option<Sampler>,
        server: Option<Server>,
        log: Option<LogWriter>,
    ) -> Option<String> {
        drop(sampler);
        drop(bus);
        if let Some(server) = server {
            server.finish(VIEWERS_WAIT);
        }
        log.and_then(|w| w.finish(LOG_WAIT))
    }

    fn end(&mut self, py: Python<'_>, last: Vec<Telemetry>) -> Option<String> {
        if self.ended {
            return None;
        }
        self.ended = true;
        for msg in last {
            self.send(msg);
        }
        let (bus, sampler, server, log) = (
            self.bus.take(),
            self.sampler.take(),
            self.server.take(),
            self.log.take(),
        );
        py.detach(move || NativeRun::shut_down(bus, sampler, server, log))
    }

    fn summary(&self, stopped_by_user: bool) -> RunSummary {
        let mb = self.controller.as_ref().map_or(0, |c| c.micro_batch());
        RunSummary {
            steps_done: self.step,
            total_steps: self.total_steps,
            stopped_by_user,
            last_loss: self.last_loss,
            last_val_loss: self.last_val_loss,
            tokens_seen: self.tokens_seen,
            elapsed_s: self.started.elapsed().as_secs_f64(),
            checkpoint: self.checkpoint.clone(),
            memory: MemorySummary {
                final_micro_batch: mb,
                accum_steps: if mb == 0 {
                    0
                } else {
                    self.effective_batch.div_ceil(mb)
                },
                effective_batch: self.effective_batch,
                ..self.memory.clone()
            },
        }
    }
}

/// The limit a run's usage is a share of, and what to say about it.
fn resolve_limit(
    mem: &MemorySection,
    cuda: bool,
    device_total: Option<u64>,
) -> Result<(u64, Vec<Notice>), String> {
    let mut notices = Vec::new();
    let budget = match mem.budget_bytes().map_err(|e| e.to_string())? {
        Some(b) => Some(b),
        None if mem.is_auto_budget() && !cuda => {
            let held = procmem::rss_bytes().ok_or("cannot read VmRSS from /proc/self/status")?;
            let available = procmem::host_available_bytes().unwrap_or(0);
            let b = auto_budget(held, available);
            notices.push(Notice::new(
                Level::Info,
                "memory",
                format!(
                    "memory budget auto: {} (this process's {} plus {} for activations)",
                    fmt_bytes(b),
                    fmt_bytes(held),
                    fmt_bytes(b - held)
                ),
            ));
            Some(b)
        }
        None => None,
    };
    if mem.hard_limit && cuda {
        return Err(
            "hard_limit caps host memory and applies to CPU runs only; on CUDA a \
                    memory_budget already caps the caching allocator (a real CUDA OOM past it)"
                .into(),
        );
    }
    if mem.hard_limit && budget.is_none() {
        return Err(
            "hard_limit needs a memory_budget to cap at, e.g. memory_budget=\"2GiB\"".into(),
        );
    }
    let limit = if cuda {
        let total = device_total.ok_or("the device's memory is unknown")?;
        budget.map_or(total, |b| b.min(total))
    } else {
        let held = procmem::rss_bytes().unwrap_or(0);
        if let Some(b) = budget.filter(|b| *b <= held) {
            return Err(format!(
                "memory_budget {} is below what this process already holds ({}: Python, torch, \
                 the model and its optimizer state); give a budget well above that, e.g. {}",
                fmt_bytes(b),
                fmt_bytes(held),
                fmt_bytes((held * 2).next_multiple_of(64 << 20))
            ));
        }
        match budget {
            Some(b) => b,
            None => procmem::host_total_bytes().ok_or("cannot read MemTotal from /proc/meminfo")?,
        }
    };
    let what = match (cuda, budget) {
        (false, Some(_)) => "the budget (memory_budget)",
        (false, None) => "host memory (no memory_budget)",
        (true, Some(_)) => "the budget (the caching allocator's per-process fraction)",
        (true, None) => "device memory",
    };
    notices.push(Notice::new(
        Level::Info,
        "memory",
        format!(
            "memory limit {} ({what}); thresholds {}",
            fmt_bytes(limit),
            mem.thresholds().map_err(|e| e.to_string())?
        ),
    ));
    if mem.hard_limit {
        let b = budget.expect("checked above");
        let cap = procmem::set_hard_limit(b)
            .map_err(|e| e.replace("--memory-budget", "memory_budget"))?;
        notices.push(Notice::new(
            Level::Info,
            "memory",
            format!(
                "hard limit: allocations past {} resident fail (RLIMIT_DATA {})",
                fmt_bytes(b),
                fmt_bytes(cap)
            ),
        ));
    }
    Ok((limit, notices))
}

#[pymethods]
impl NativeRun {
    #[new]
    #[pyo3(signature = (
        name, *, producer, device, device_name, parameters, total_steps,
        effective_batch, micro_batch, log=None, listen=None, sample_hz=4.0,
        cuda_index=None, device_total=None, allocator=None, memory_budget=None,
        hard_limit=false, thresholds=None, profile=None, adaptive=false, job=None,
        checkpoints=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        producer: String,
        device: String,
        device_name: String,
        parameters: u64,
        total_steps: u64,
        effective_batch: usize,
        micro_batch: usize,
        log: Option<PathBuf>,
        listen: Option<String>,
        sample_hz: f64,
        cuda_index: Option<usize>,
        device_total: Option<u64>,
        allocator: Option<Py<PyAny>>,
        memory_budget: Option<String>,
        hard_limit: bool,
        thresholds: Option<String>,
        profile: Option<String>,
        adaptive: bool,
        job: Option<(String, u32, u32, u32)>,
        checkpoints: bool,
    ) -> PyResult<NativeRun> {
        if name.trim().is_empty() {
            return Err(value_error(
                "a run needs a name, e.g. headroom.Run(\"mnist\")",
            ));
        }
        if !(sample_hz > 0.0 && sample_hz <= 100.0) {
            return Err(value_error(format!(
                "sample_hz {sample_hz} is out of range; give a rate in (0, 100] samples per second"
            )));
        }
        if let Some(l) = &listen {
            server::parse_listen(l).map_err(value_error)?;
        }
        let mut cfg = RunConfig::default();
        cfg.run.name = name.clone();
        cfg.run.steps = total_steps;
        cfg.run.device = device.clone();
        cfg.run.sample_hz = sample_hz;
        cfg.data.corpus = String::new();
        cfg.batch.micro_batch = micro_batch.max(1);
        cfg.batch.effective_batch = effective_batch;
        cfg.memory.memory_budget = memory_budget.unwrap_or_default();
        cfg.memory.hard_limit = hard_limit;
        cfg.memory.adaptive = adaptive;
        cfg.memory.thresholds = thresholds.unwrap_or_default();
        if let Some(p) = profile {
            cfg.memory.profile = p.parse().map_err(value_error)?;
        }
        let t = cfg.memory.thresholds().map_err(value_error)?;
        let cuda = cuda_index.is_some();
        let auto = !cuda && cfg.memory.is_auto_budget();
        // A log that holds an earlier run's records is kept: this run takes the next
        // free name beside it, and says so.
        let asked_log = log.clone();
        let log = log.map(|p| logger::next_free(&p));
        let log_moved = match (&asked_log, &log) {
            (Some(a), Some(l)) if a != l => Some(Notice::new(
                Level::Warn,
                "log",
                format!(
                    "{} holds an earlier run's log, kept; this run logs to {}",
                    a.display(),
                    l.display()
                ),
            )),
            _ => None,
        };
        let pending_log = log
            .as_deref()
            .map(|p| logger::open(p, &[], None, Duration::from_secs(10)))
            .transpose()
            .map_err(|e| value_error(format!("{e:#}").replace("--log", "log=")))?;
        // Last of the checks: a hard cap, once set, is the whole process's.
        let (limit, mut notices) = match resolve_limit(&cfg.memory, cuda, device_total) {
            Ok(r) => r,
            Err(e) => {
                if let Some(l) = pending_log {
                    l.abandon();
                }
                return Err(value_error(e));
            }
        };
        notices.extend(log_moved);
        let (bus, mut rx) = Bus::with_sinks(pending_log.is_some(), true);
        // Live hints from this run's figures, on the same stream and log as `headroom train`'s.
        let bus = bus.with_hints();
        // Nobody draws in this process: viewers attach over the socket.
        drop((rx.events, rx.metrics));
        let log_writer = match (pending_log, rx.log.take()) {
            (Some(l), Some(lines)) => Some(LogWriter::start(l, lines, bus.ui_only())),
            _ => None,
        };
        let (commands_tx, commands) = bounded::<Command>(64);
        bus.send(Telemetry::RunStarted(RunInfo {
            run_name: name.clone(),
            device: device.clone(),
            device_name,
            parameters,
            start_step: 0,
            total_steps,
            corpus: String::new(),
            train_bytes: 0,
            val_bytes: 0,
            config: None,
            checkpoints: Some(checkpoints),
        }));
        let server = rx.serve.take().and_then(|records| {
            let opts = ServeOptions {
                run_name: name.clone(),
                listen,
                producer,
                job: job.map(|(id, rank, local_rank, world_size)| JobRank {
                    id,
                    rank,
                    local_rank,
                    world_size,
                }),
            };
            server::serve_run(&opts, records, commands_tx.clone(), &bus)
        });
        for n in notices {
            bus.send(Telemetry::Notice(n));
        }
        let source = allocator.map(|a| Box::new(PyAllocator::new(a)) as Box<dyn AllocatorSource>);
        let sampler_bus = bus.clone();
        // The sampler's first read may want the GIL (the allocator), which this thread
        // holds: start it detached.
        let sampler = py.detach(move || Sampler::start(sampler_bus, cuda_index, sample_hz, source));
        let run = NativeRun {
            bus: Some(bus),
            commands,
            _commands_tx: commands_tx,
            server,
            log: log_writer,
            sampler: Some(sampler),
            controller: None,
            controller_cfg: None,
            auto_budget: auto,
            started: Instant::now(),
            name,
            cuda,
            hard_limit,
            limit,
            thresholds: t,
            effective_batch,
            total_steps,
            paused: false,
            stop_requested: false,
            pending: BTreeMap::new(),
            next_id: 1,
            ended: false,
            step: 0,
            tokens_seen: 0,
            last_loss: None,
            last_val_loss: None,
            checkpoint: None,
            memory: MemorySummary::default(),
            log_path: log,
            last_limit: 0,
            last_usage: 0.0,
            checkpoints,
        };
        run.thresholds_changed("config", None);
        run.send(Telemetry::Status {
            status: RunStatus::Running,
        });
        Ok(run)
    }

    /// Hands the micro-batch to the controller. `baseline`: memory in use before the
    /// first step (model and optimizer state), the fixed part every batch sits on.
    #[pyo3(signature = (micro_batch, min_micro_batch, max_micro_batch, max_seq_len, baseline=None, adaptive=true))]
    fn adapt(
        &mut self,
        micro_batch: usize,
        min_micro_batch: usize,
        max_micro_batch: usize,
        max_seq_len: usize,
        baseline: Option<u64>,
        adaptive: bool,
    ) -> PyResult<()> {
        self.bus()?;
        if self.effective_batch == 0 {
            return Err(value_error("an adaptive run needs effective_batch ≥ 1"));
        }
        let max = match max_micro_batch {
            0 => self.effective_batch,
            m => m.min(self.effective_batch),
        };
        let cfg = procmem::with_meter(
            ControllerConfig {
                min_micro_batch: min_micro_batch.clamp(1, max),
                max_micro_batch: max,
                adaptive,
                max_seq_len,
                ..ControllerConfig::default()
            },
            self.cuda,
            self.hard_limit,
        );
        let mut c = Journaled::new(cfg.clone(), self.thresholds, self.limit, micro_batch);
        if let Some(b) = baseline {
            c.set_baseline(b);
        }
        self.controller = Some(c);
        self.controller_cfg = Some(cfg);
        Ok(())
    }

    /// What a checkpoint needs to continue this run as if never interrupted, as JSON: the
    /// steps done, the tokens seen and the controller's journal (adaptive runs).
    fn state(&self) -> PyResult<String> {
        let state = ResumeState {
            step: self.step,
            tokens_seen: self.tokens_seen,
            controller: self.controller.as_ref().map(|c| c.journal().clone()),
        };
        serde_json::to_string(&state).map_err(value_error)
    }

    /// Continues from a [`state`](Self::state): the step count, and the controller the run
    /// had, its journal replayed (what the built-in trainer's resume does). Before the
    /// first step only. Returns the step it continues after.
    fn restore(&mut self, state: &str) -> PyResult<u64> {
        if self.step != 0 {
            return Err(PyRuntimeError::new_err(format!(
                "load_state_dict() after step {}: call it right after creating the run, before                  its first step",
                self.step
            )));
        }
        let state: ResumeState = serde_json::from_str(state).map_err(|e| {
            value_error(format!(
                "this is not a headroom run state ({e}); give load_state_dict() what                  run.state_dict() returned, as saved"
            ))
        })?;
        self.step = state.step;
        self.tokens_seen = state.tokens_seen;
        let text = match (state.controller, self.controller_cfg.clone()) {
            (Some(j), Some(cfg)) => {
                if self.auto_budget {
                    // The budget the run resolved at its start, not one from this
                    // process's memory now: the uninterrupted run goes on against it.
                    self.limit = j.limit;
                }
                let mut c = Journaled::replay(cfg, &j);
                let mut text = format!(
                    "resumed after step {}: controller state restored ({} calls replayed),                      micro-batch {}, as the uninterrupted run had it",
                    state.step,
                    j.calls.len(),
                    c.micro_batch()
                );
                // Thresholds given for the resume win over the saved ones.
                if self.thresholds != j.thresholds {
                    match c.set_thresholds(self.thresholds) {
                        Ok(()) => text += &format!("; thresholds {} in force", self.thresholds),
                        Err(e) => text += &format!("; thresholds refused ({e}), the saved stay"),
                    }
                }
                self.controller = Some(c);
                text
            }
            (None, Some(_)) => format!(
                "resumed after step {}: the state holds no controller (a watch-only run's);                  this run's controller starts fresh",
                state.step
            ),
            (_, None) => format!("resumed after step {}", state.step),
        };
        self.notice(Level::Info, "memory", text);
        Ok(self.step)
    }

    /// Before a step's first attempt: the micro-batch to use, and whether to free the
    /// cache first. `upcoming`: the longest length within the horizon and its step.
    #[pyo3(signature = (step, seq_len, upcoming=None))]
    fn before_step(
        &mut self,
        step: u64,
        seq_len: usize,
        upcoming: Option<(usize, u64)>,
    ) -> PyResult<(usize, bool)> {
        let c = self.controller.as_mut().ok_or_else(not_adaptive)?;
        let decisions = match upcoming {
            Some((len, at)) => c.before_step_ahead(
                seq_len,
                Upcoming {
                    seq_len: len.max(seq_len),
                    step: at,
                },
            ),
            None => c.before_step(seq_len),
        };
        let mb = c.micro_batch();
        let free = self.apply(step, decisions);
        Ok((mb, free))
    }

    /// The predicted peak of a micro-batch, bytes, when the model can tell.
    fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        self.controller
            .as_ref()
            .and_then(|c| c.predicted_bytes(micro_batch, seq_len))
    }

    /// A completed step's peak. Adaptive runs feed it to the controller and get back the
    /// next micro-batch and whether to free the cache; watch-only runs report it.
    #[pyo3(signature = (step, micro_batch, seq_len, peak_bytes, limit_bytes=None, predicted_bytes=None))]
    fn observe(
        &mut self,
        step: u64,
        micro_batch: usize,
        seq_len: usize,
        peak_bytes: u64,
        limit_bytes: Option<u64>,
        predicted_bytes: Option<u64>,
    ) -> PyResult<(usize, bool)> {
        self.bus()?;
        // On the CPU the limit is never more than this process holds plus what the host
        // could still give: memory other processes take lowers it.
        let limit = limit_bytes
            .unwrap_or_else(|| {
                if self.cuda {
                    self.limit
                } else {
                    procmem::current_cpu_limit(self.limit)
                }
            })
            .max(1);
        let usage = peak_bytes as f64 / limit as f64;
        self.memory.note_peak(peak_bytes, limit, usage);
        (self.last_limit, self.last_usage) = (limit, usage);
        self.send(Telemetry::StepMemory(StepMemory {
            step,
            micro_batch,
            seq_len,
            peak_bytes,
            predicted_bytes,
            limit_bytes: limit,
            configured_limit_bytes: self.limit,
            usage,
        }));
        let Some(c) = self.controller.as_mut() else {
            return Ok((micro_batch, false));
        };
        c.set_limit(limit);
        let decisions = c.observe(StepObservation {
            step,
            micro_batch,
            seq_len,
            peak_bytes,
        });
        let mb = c.micro_batch();
        let free = self.apply(step, decisions);
        Ok((mb, free))
    }

    /// An out-of-memory error in a step's attempt: the micro-batch to retry the
    /// remaining samples with (`None`: give up), and whether to free the cache.
    fn oom(
        &mut self,
        step: u64,
        micro_batch: usize,
        seq_len: usize,
        error: &str,
    ) -> PyResult<(Option<usize>, bool)> {
        let c = self.controller.as_mut().ok_or_else(not_adaptive)?;
        let outcome = c.on_oom(micro_batch, seq_len);
        self.memory.ooms += 1;
        self.send(Telemetry::Oom {
            step,
            micro_batch,
            seq_len,
            retry_with: outcome.retry_with,
            error: error.lines().next().unwrap_or("").to_string(),
        });
        let free = self.apply(step, outcome.decisions);
        if outcome.retry_with.is_none() {
            // The give-up runs while the cap may be full; the tests fill it here.
            procmem::fill_cap_if_asked();
        }
        Ok((outcome.retry_with, free))
    }

    /// A completed step's figures.
    #[pyo3(signature = (step, loss, micro_batch, effective_batch, seq_len, step_time_s, tokens, lr=None, grad_norm=None))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        step: u64,
        loss: f64,
        micro_batch: usize,
        effective_batch: usize,
        seq_len: usize,
        step_time_s: f64,
        tokens: u64,
        lr: Option<f64>,
        grad_norm: Option<f64>,
    ) -> PyResult<()> {
        self.bus()?;
        let dt = step_time_s.max(1e-9);
        self.step = step;
        self.tokens_seen += tokens;
        self.last_loss = Some(loss);
        self.send(Telemetry::Step(StepMetrics {
            step,
            total_steps: self.total_steps,
            loss,
            lr,
            grad_norm,
            step_time_s: dt,
            tokens_per_s: tokens as f64 / dt,
            samples_per_s: effective_batch as f64 / dt,
            micro_batch,
            accum_steps: effective_batch.div_ceil(micro_batch.max(1)),
            effective_batch,
            seq_len,
            tokens_seen: self.tokens_seen,
        }));
        Ok(())
    }

    /// What the step's fixed memory is made of, counted by Python after the first
    /// optimizer step: parameters, gradients and the optimizer's state, bytes (the
    /// optimizer-state hint reads it).
    fn memory_parts(&self, parameters: u64, gradients: u64, optimizer: u64) -> PyResult<()> {
        self.bus()?;
        self.send(Telemetry::MemoryParts(headroom_core::MemoryParts {
            parameters,
            gradients,
            optimizer,
        }));
        Ok(())
    }

    /// A plan's prediction for a completed step beside its measured peak.
    fn plan_check(
        &self,
        step: u64,
        micro_batch: usize,
        planned_bytes: u64,
        peak_bytes: u64,
    ) -> PyResult<()> {
        self.bus()?;
        self.send(Telemetry::PlanCheck(headroom_core::PlanCheck {
            step,
            micro_batch,
            planned_bytes,
            peak_bytes,
        }));
        Ok(())
    }

    /// A validation result.
    fn eval(&mut self, step: u64, val_loss: f64, train_loss: f64, tokens: u64) -> PyResult<()> {
        self.bus()?;
        self.last_val_loss = Some(val_loss);
        self.send(Telemetry::Eval(headroom_core::EvalMetrics {
            step,
            val_loss,
            train_loss,
            tokens,
        }));
        Ok(())
    }

    /// A line for the dashboard's event log: `level` is info, warn or error.
    #[pyo3(signature = (text, level="info", source="python"))]
    fn notice_text(&self, text: String, level: &str, source: &str) -> PyResult<()> {
        let level = match level {
            "info" => Level::Info,
            "warn" | "warning" => Level::Warn,
            "error" => Level::Error,
            other => {
                return Err(value_error(format!(
                    "level {other:?}: use \"info\", \"warn\" or \"error\""
                )))
            }
        };
        self.bus()?;
        self.notice(level, source, text);
        Ok(())
    }

    /// Takes the commands that came in. Rust carries out what it can (pause, thresholds,
    /// pin, stop) and hands back `(id, kind)` for what Python must do (`checkpoint`,
    /// `free_cache`), to be confirmed with [`NativeRun::confirm`]. While paused, it waits
    /// up to 100 ms for a command (the GIL released) and runs Python's signal handlers
    /// before it returns: the caller polls again while `paused`, and a handler that needs
    /// this run (a SIGTERM's stop) acts between calls, not inside this one's borrow.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let mut out = Vec::new();
        let mut waited = false;
        loop {
            let cmd = match self.commands.try_recv() {
                Ok(c) => c,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) if !self.paused || !out.is_empty() || waited => break,
                Err(TryRecvError::Empty) => {
                    waited = true;
                    let rx = self.commands.clone();
                    let got = py.detach(move || rx.recv_timeout(Duration::from_millis(100)));
                    py.check_signals()?;
                    match got {
                        Ok(c) => c,
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
            };
            if let Some(cmd) = self.handle(cmd) {
                out.push(self.hand_to_python(cmd));
            }
        }
        Ok(out)
    }

    /// A torchrun job's way in for commands: what viewers sent this rank, taken raw (as
    /// protocol JSON), not acted on, so the job can hand every rank the same commands at
    /// the same step. Waits up to `timeout_s` (the GIL released) when none is waiting.
    #[pyo3(signature = (timeout_s=0.0))]
    fn take_commands(&mut self, py: Python<'_>, timeout_s: f64) -> PyResult<Vec<String>> {
        let mut out = Vec::new();
        while let Ok(c) = self.commands.try_recv() {
            out.push(serde_json::to_string(&c).map_err(value_error)?);
        }
        if out.is_empty() && timeout_s > 0.0 {
            let rx = self.commands.clone();
            let wait = Duration::from_secs_f64(timeout_s.min(5.0));
            if let Ok(c) = py.detach(move || rx.recv_timeout(wait)) {
                out.push(serde_json::to_string(&c).map_err(value_error)?);
            }
            py.check_signals()?;
        }
        Ok(out)
    }

    /// Acts on commands the job agreed on (every rank gets the same list, in the same
    /// order), exactly as [`NativeRun::poll`] acts on a viewer's; returns `(id, kind)` for
    /// what Python must carry out. A command this build does not know is refused loudly.
    fn apply_commands(&mut self, commands: Vec<String>) -> PyResult<Vec<(u64, String)>> {
        let mut out = Vec::new();
        for text in commands {
            let cmd: Command = serde_json::from_str(&text).map_err(|e| {
                value_error(format!("a job command {text:?} is not understood: {e}"))
            })?;
            if let Some(cmd) = self.handle(cmd) {
                out.push(self.hand_to_python(cmd));
            }
        }
        Ok(out)
    }

    /// Rank 0 of a job: every rank's row at this step's agreement (a `JobRanks` record,
    /// as JSON).
    fn job_ranks(&self, record: &str) -> PyResult<()> {
        self.bus()?;
        let rows: headroom_core::JobRanks =
            serde_json::from_str(record).map_err(|e| value_error(format!("job_ranks: {e}")))?;
        self.send(Telemetry::JobRanks(rows));
        Ok(())
    }

    /// Out-of-memory errors caught so far.
    #[getter]
    fn ooms(&self) -> u64 {
        self.memory.ooms
    }

    /// The last step's limit (bytes) and usage (peak / limit); 0 before the first.
    #[getter]
    fn last_memory(&self) -> (u64, f64) {
        (self.last_limit, self.last_usage)
    }

    /// A stop asked by a signal (`why`, e.g. "SIGTERM"): as the dashboard's stop, said
    /// with its cause.
    fn request_stop(&mut self, why: &str) -> PyResult<()> {
        self.bus()?;
        if !self.stop_requested {
            self.stop_requested = true;
            self.paused = false;
            self.send(Telemetry::Status {
                status: RunStatus::Stopping,
            });
        }
        self.notice(
            Level::Warn,
            "signal",
            format!(
                "{why}: stopping; {} (a step in progress in run.backward() is abandoned at \
                 its next micro-batch; a loop that only reports ends when it reads \
                 run.should_stop, or at the next step's end; {why} again within 1 s is the \
                 same request, a second signal later ends the process at once)",
                self.stop_checkpoint_text(true)
            ),
        );
        Ok(())
    }

    /// Confirms a command Python carried out, with what it did.
    fn confirm(&mut self, id: u64, applied: String) -> PyResult<()> {
        let cmd = self
            .pending
            .remove(&id)
            .ok_or_else(|| value_error(format!("no command {id} is waiting")))?;
        self.applied(cmd, applied);
        Ok(())
    }

    /// A checkpoint the loop wrote.
    fn checkpoint_saved(&mut self, step: u64, path: String) -> PyResult<()> {
        self.bus()?;
        self.checkpoint = Some(path.clone());
        self.send(Telemetry::CheckpointSaved { step, path });
        Ok(())
    }

    /// Ends the run as finished; returns a warning about the log, if any.
    #[pyo3(signature = (stopped_by_user=false))]
    fn finish(&mut self, py: Python<'_>, stopped_by_user: bool) -> Option<String> {
        let summary = self.summary(stopped_by_user || self.stop_requested);
        self.end(
            py,
            vec![
                Telemetry::Status {
                    status: RunStatus::Finished,
                },
                Telemetry::Finished(summary),
            ],
        )
    }

    /// Ends the run as failed, with the reason.
    fn fail(&mut self, py: Python<'_>, reason: String) -> Option<String> {
        self.end(
            py,
            vec![
                Telemetry::Status {
                    status: RunStatus::Failed,
                },
                Telemetry::Failed { reason },
            ],
        )
    }

    #[getter]
    fn paused(&self) -> bool {
        self.paused
    }

    #[getter]
    fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    #[getter]
    fn ended(&self) -> bool {
        self.ended
    }

    /// How the controller reads this run's memory: its reading noise and whether it
    /// counts glibc's heap fragments (None: not adaptive).
    #[getter]
    fn controller_meter(&self) -> Option<(f64, bool)> {
        self.controller_cfg
            .as_ref()
            .map(|c| (c.reading_noise, c.heap_fragments))
    }

    #[getter]
    fn micro_batch(&self) -> Option<usize> {
        self.controller.as_ref().map(|c| c.micro_batch())
    }

    #[getter]
    fn limit_bytes(&self) -> u64 {
        self.limit
    }

    #[getter]
    fn thresholds(&self) -> (f64, f64, f64, f64) {
        let [a, b, c, d] = self.thresholds_now().as_array();
        (a, b, c, d)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    #[getter]
    fn is_cuda(&self) -> bool {
        self.cuda
    }

    /// The file the run log is written to (see `logger::next_free`); `None`: no log.
    #[getter]
    fn log_path(&self) -> Option<String> {
        self.log_path.as_ref().map(|p| p.display().to_string())
    }

    /// The Unix socket `headroom attach` reaches this run on; `None` when not serving.
    #[getter]
    fn socket(&self) -> Option<String> {
        self.server
            .as_ref()
            .map(|s| s.addresses().socket.display().to_string())
    }

    /// `host:port` when serving on TCP too.
    #[getter]
    fn tcp(&self) -> Option<String> {
        self.server
            .as_ref()
            .and_then(|s| s.addresses().tcp)
            .map(|a| a.to_string())
    }

    /// The file holding the TCP token.
    #[getter]
    fn token_file(&self) -> Option<String> {
        self.server
            .as_ref()
            .and_then(|s| s.addresses().token_file.as_ref())
            .map(|p| p.display().to_string())
    }

    /// The directory runs serve their sockets in.
    #[staticmethod]
    fn runtime_dir() -> PyResult<String> {
        rundir::dir()
            .map(|d| d.display().to_string())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

impl Drop for NativeRun {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        // Dropped without finish() or fail(): the loop died or forgot; say so rather than
        // leave viewers waiting.
        Python::attach(|py| {
            self.fail(py, "the run was dropped before finish() or fail()".into());
        });
    }
}

/// What `run.state_dict()` carries for the native side.
#[derive(serde::Serialize, serde::Deserialize)]
struct ResumeState {
    step: u64,
    tokens_seen: u64,
    controller: Option<ControllerJournal>,
}

fn not_adaptive() -> PyErr {
    PyRuntimeError::new_err(
        "this run is watch-only: the controller decides micro-batches only for runs created \
         with adaptive settings (effective_batch=…)",
    )
}
