//! One Python run: a [`Session`] driven by a Python loop. Python calls in at the points
//! the built-in trainer's runner does (before a step, after its peak is known, after an
//! OOM, at the step boundary for commands) and carries out what comes back; the session
//! answers commands, keeps the controller (every call journaled, so a checkpoint can
//! carry it in `run.state_dict()` and a resume replay it) and says it all on the bus.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use headroom_core::config::RunConfig;
use headroom_core::journal::{ControllerJournal, Journaled};
use headroom_core::policy::{ControllerConfig, Thresholds, Upcoming};
use headroom_core::protocol::JobRank;
use headroom_core::{
    Checkpointing, Command, Level, Notice, Precision, RunInfo, RunStatus, Telemetry,
};
use headroom_host::logger;
use headroom_host::sampler::{AllocatorSource, Sampler};
use headroom_host::server::{self, ServeOptions, Server};
use headroom_host::session::{
    controller_config, resume_controller, resumed_auto_budget, run_bus, Driver, Handled, Measured,
    Session, Sinks, StepDone, StepPeak,
};
use headroom_host::{procmem, rundir};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::allocator::PyAllocator;
use crate::limit::resolve_limit;
use crate::reporter::{self, Limits, Loss, Peak, Report, Reporter, Shared};

fn value_error(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A Python run: the [`Session`] its loop drives, and what only Python's side has (the
/// commands Python carries out, by the id it confirms them with).
#[pyclass(module = "headroom._native")]
pub struct NativeRun {
    /// Shared with the reporter thread, which records a watch-only run's steps.
    session: Shared,
    /// Started at a watch-only run's first `report()`.
    reporter: Option<Reporter>,
    /// A stop was asked (a command or a signal): what `report()` needs to know of the
    /// session without taking its lock, which the reporter holds while it records.
    stopping: bool,
    /// `None` once the run has ended.
    sinks: Option<Sinks>,
    commands: Receiver<Command>,
    /// Held so the command channel stays open whether or not a server is up.
    _commands_tx: Sender<Command>,
    /// How an adaptive run's controller was built: a restored journal replays into one
    /// built the same way.
    controller_cfg: Option<ControllerConfig>,
    /// `memory_budget="auto"` on the CPU: a resume keeps the budget the run resolved.
    auto_budget: bool,
    name: String,
    cuda: bool,
    /// Allocations past the budget fail (RLIMIT_DATA): tensors are mmapped.
    hard_limit: bool,
    /// The configured limit: the budget, host memory or the device's memory.
    limit: u64,
    /// The thresholds the run was given: they win over a restored controller's.
    given_thresholds: Thresholds,
    /// Where the log is written (`log=`, or the next free name beside it).
    log_path: Option<PathBuf>,
    /// Commands handed to Python to carry out, by the id Python confirms them with.
    pending: BTreeMap<u64, Command>,
    next_id: u64,
    ended: bool,
}

impl NativeRun {
    fn session(&self) -> MutexGuard<'_, Session> {
        reporter::lock(&self.session)
    }

    /// Every reported step recorded (before the caller reads or resets the peak itself,
    /// or the run ends), the GIL released meanwhile.
    fn flush_reports(&self, py: Python<'_>) {
        if let Some(r) = &self.reporter {
            py.detach(|| r.flush());
        }
    }

    fn stop_reporter(&mut self, py: Python<'_>) {
        if let Some(mut r) = self.reporter.take() {
            py.detach(move || r.stop());
        }
    }

    fn server(&self) -> Option<&Server> {
        self.sinks.as_ref().and_then(|s| s.server())
    }

    fn live(&self) -> PyResult<()> {
        match self.session().bus() {
            Some(_) => Ok(()),
            None => Err(PyRuntimeError::new_err("this headroom run has ended")),
        }
    }

    /// Acts on one command; Python's part is kept until it is confirmed, and its
    /// `(id, kind)` returned.
    fn handle(&mut self, cmd: Command) -> Option<(u64, String)> {
        let Handled::Driver(cmd) = self.session().handle(cmd) else {
            return None;
        };
        let id = self.next_id;
        self.next_id += 1;
        let kind = match &cmd {
            Command::Checkpoint => "checkpoint".to_string(),
            Command::SetPrecision { precision } => format!("precision:{precision}"),
            Command::SetCheckpointing { checkpoint } => format!("checkpointing:{checkpoint}"),
            _ => "free_cache".to_string(),
        };
        self.pending.insert(id, cmd);
        Some((id, kind))
    }

    /// Ends the run: the last records out, then every thread and socket gone (with the
    /// GIL released: the sampler may be waiting for it to read the allocator).
    fn end(&mut self, py: Python<'_>) -> Option<String> {
        if self.ended {
            return None;
        }
        self.ended = true;
        let bus = self.session().take_bus();
        let sinks = self.sinks.take();
        py.detach(move || {
            let mut sinks = sinks.unwrap_or_default();
            sinks.stop_sampler();
            drop(bus);
            sinks.close()
        })
    }
}

#[pymethods]
impl NativeRun {
    #[new]
    #[pyo3(signature = (
        name, *, producer, device, device_name, parameters, total_steps,
        effective_batch, micro_batch, log=None, listen=None, sample_hz=20.0,
        cuda_index=None, device_total=None, allocator=None, memory_budget=None,
        hard_limit=false, thresholds=None, profile=None, adaptive=false, job=None,
        checkpoints=false, precision=None, checkpointing=None, half_precision=None,
        last_resort=true, log_rotate=None
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
        precision: Option<String>,
        checkpointing: Option<String>,
        half_precision: Option<String>,
        last_resort: bool,
        log_rotate: Option<String>,
    ) -> PyResult<NativeRun> {
        // The levers this run switches itself (precision: its run.backward's autocast;
        // checkpointing: the blocks it names), as they are at the start.
        let precision = precision
            .map(|p| p.parse::<Precision>())
            .transpose()
            .map_err(value_error)?;
        let half = half_precision
            .map(|p| p.parse::<Precision>())
            .transpose()
            .map_err(value_error)?;
        let checkpointing = checkpointing
            .map(|c| c.parse::<Checkpointing>())
            .transpose()
            .map_err(value_error)?;
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
        let rotate = log_rotate
            .map(|r| r.parse::<headroom_core::logfile::Rotate>())
            .transpose()
            .map_err(|e| value_error(e.replace("log rotation '", "log_rotate='")))?;
        let pending_log = log
            .as_deref()
            .map(|p| logger::open(p, &[], None, Duration::from_secs(10)))
            .transpose()
            .map_err(|e| value_error(format!("{e:#}").replace("--log", "log=")))?;
        let pending_log = pending_log.map(|l| l.with_rotation(rotate));
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
        let (bus, rx) = run_bus(pending_log.is_some());
        // Nobody draws in this process: viewers attach over the socket.
        drop((rx.events, rx.metrics));
        let (commands_tx, commands) = bounded::<Command>(64);
        let mut session = Session::new(
            bus.clone(),
            Driver::script(checkpoints),
            t,
            effective_batch,
            total_steps,
        );
        // Out of micro-batch sizes, a checkpointing lever goes on before the run gives up
        // (not under FSDP2: one rank's switch would change its collectives).
        session.set_levers(precision, checkpointing, last_resort);
        if let Some(half) = half {
            session.set_half_precision(half);
        }
        session.run_started(RunInfo {
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
            levers: None,
        });
        let serve = ServeOptions {
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
        let sinks = Sinks::start(
            &bus,
            pending_log,
            rx.log,
            rx.serve,
            commands_tx.clone(),
            serve,
        );
        for n in notices {
            session.send(Telemetry::Notice(n));
        }
        let source = allocator.map(|a| Box::new(PyAllocator::new(a)) as Box<dyn AllocatorSource>);
        // The sampler's first read may want the GIL (the allocator), which this thread
        // holds: start it detached.
        let sampler = py.detach(move || Sampler::start(bus, cuda_index, sample_hz, source));
        let run = NativeRun {
            session: Arc::new(Mutex::new(session)),
            reporter: None,
            stopping: false,
            sinks: Some(sinks.with_sampler(sampler)),
            commands,
            _commands_tx: commands_tx,
            controller_cfg: None,
            auto_budget: auto,
            name,
            cuda,
            hard_limit,
            limit,
            given_thresholds: t,
            log_path: log,
            pending: BTreeMap::new(),
            next_id: 1,
            ended: false,
        };
        run.session().thresholds_changed("config", None);
        run.session().status(RunStatus::Running);
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
        self.live()?;
        let effective = self.session().effective_batch();
        if effective == 0 {
            return Err(value_error("an adaptive run needs effective_batch ≥ 1"));
        }
        let cfg = controller_config(
            min_micro_batch,
            max_micro_batch,
            effective,
            adaptive,
            max_seq_len,
            self.cuda,
            self.hard_limit,
        );
        let thresholds = self.session().thresholds();
        let mut c = Journaled::new(cfg.clone(), thresholds, self.limit, micro_batch);
        if let Some(b) = baseline {
            c.set_baseline(b);
        }
        self.session().set_controller(c);
        self.controller_cfg = Some(cfg);
        Ok(())
    }

    /// Python switched a lever (`lever`: "precision" or "checkpointing") from `was` to
    /// `to`, asked by `source` ("command" or "controller"); what to answer. The next
    /// step's peak says what it freed, as a controller decision.
    fn switched(&mut self, lever: &str, was: &str, to: &str, source: &str) -> PyResult<String> {
        let source = match source {
            "command" => "command",
            "controller" => "controller",
            other => {
                return Err(value_error(format!(
                    "source {other:?}: command or controller"
                )))
            }
        };
        match lever {
            "precision" => Ok(self.session().switched_precision(
                was.parse().map_err(value_error)?,
                to.parse().map_err(value_error)?,
                source,
            )),
            "checkpointing" => Ok(self.session().switched_checkpointing(
                was.parse().map_err(value_error)?,
                to.parse().map_err(value_error)?,
                source,
            )),
            other => Err(value_error(format!(
                "lever {other:?}: precision or checkpointing"
            ))),
        }
    }

    /// What a checkpoint needs to continue this run as if never interrupted, as JSON: the
    /// steps done, the tokens seen and the controller's journal (adaptive runs).
    fn state(&self, py: Python<'_>) -> PyResult<String> {
        self.flush_reports(py);
        let session = self.session();
        let state = ResumeState {
            step: session.step(),
            tokens_seen: session.tokens_seen(),
            controller: session.controller().map(|c| c.journal().clone()),
        };
        serde_json::to_string(&state).map_err(value_error)
    }

    /// Continues from a [`state`](Self::state): the step count, and the controller the run
    /// had, its journal replayed (what the built-in trainer's resume does). Before the
    /// first step only. Returns the step it continues after.
    fn restore(&mut self, state: &str) -> PyResult<u64> {
        if self.session().step() != 0 {
            return Err(PyRuntimeError::new_err(format!(
                "load_state_dict() after step {}: call it right after creating the run, before \
                 its first step",
                self.session().step()
            )));
        }
        let state: ResumeState = serde_json::from_str(state).map_err(|e| {
            value_error(format!(
                "this is not a headroom run state ({e}); give load_state_dict() what \
                 run.state_dict() returned, as saved"
            ))
        })?;
        self.session()
            .resume_at(state.step, state.tokens_seen, None);
        let text = match (state.controller, self.controller_cfg.clone()) {
            (Some(j), Some(cfg)) => {
                if self.auto_budget {
                    let (limit, notice) = resumed_auto_budget(&j);
                    self.limit = limit;
                    self.session().send(Telemetry::Notice(notice));
                }
                let resumed = resume_controller(cfg, &j, self.given_thresholds);
                self.session().set_controller(resumed.controller);
                if let Some(n) = resumed.refused {
                    self.session().send(Telemetry::Notice(n));
                }
                format!("resumed after step {}: {}", state.step, resumed.text)
            }
            (None, Some(_)) => format!(
                "resumed after step {}: the state holds no controller (a watch-only run's); \
                 this run's controller starts fresh",
                state.step
            ),
            (_, None) => format!("resumed after step {}", state.step),
        };
        self.session().notice(Level::Info, "memory", text);
        Ok(state.step)
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
        let upcoming = upcoming.map(|(len, at)| Upcoming {
            seq_len: len.max(seq_len),
            step: at,
        });
        let next = self
            .session()
            .before_step(step, seq_len, upcoming)
            .ok_or_else(not_adaptive)?;
        Ok((next.micro_batch, next.free_cache))
    }

    /// The predicted peak of a micro-batch, bytes, when the model can tell.
    fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        self.session().predicted_bytes(micro_batch, seq_len)
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
        self.live()?;
        // On the CPU the limit is never more than this process holds plus what the host
        // could still give: memory other processes take lowers it.
        let limit = limit_bytes.unwrap_or_else(|| {
            if self.cuda {
                self.limit
            } else {
                procmem::current_cpu_limit(self.limit)
            }
        });
        let peak = StepPeak {
            step,
            micro_batch,
            seq_len,
            peak_bytes,
            predicted_bytes,
            limit_bytes: limit,
            configured_limit_bytes: self.limit,
        };
        self.session().measured(Measured {
            step,
            peak_bytes,
            micro_batch,
            seq_len,
        });
        self.session().step_memory(peak);
        Ok(self
            .session()
            .observe(peak)
            .map_or((micro_batch, false), |n| (n.micro_batch, n.free_cache)))
    }

    /// An out-of-memory error in a step's attempt: the micro-batch to retry the
    /// remaining samples with (`None`: give up), whether to free the cache, and whether to
    /// switch activation checkpointing on first (the last resort, out of sizes).
    fn oom(
        &mut self,
        step: u64,
        micro_batch: usize,
        seq_len: usize,
        error: &str,
    ) -> PyResult<(Option<usize>, bool, bool)> {
        let after = self
            .session()
            .oom(step, micro_batch, seq_len, error)
            .ok_or_else(not_adaptive)?;
        if after.retry_with.is_none() {
            // The give-up runs while the cap may be full; the tests fill it here.
            procmem::fill_cap_if_asked();
        }
        Ok((
            after.retry_with,
            after.free_cache,
            after.switch_checkpointing,
        ))
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
        self.live()?;
        self.session().step_done(StepDone {
            step,
            loss,
            lr,
            grad_norm,
            micro_batch,
            effective_batch,
            seq_len,
            step_time_s,
            tokens,
        });
        Ok(())
    }

    /// A watch-only step completed (`run.report()`): its figures go to the reporter
    /// thread, which reads the peak (unless given: CUDA's) and records the step; this
    /// returns at once. True when the boundary has work: commands waiting, paused, or a
    /// stop asked.
    ///
    /// `loss`: a float, or a device tensor read on the reporter thread. `peak`: None for
    /// the resident set's, or a callable returning the peak since its last call (CUDA).
    #[pyo3(signature = (step, loss, samples, seq_len, step_time_s, lr=None, grad_norm=None, peak=None, planned_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &mut self,
        step: u64,
        loss: Bound<'_, PyAny>,
        samples: usize,
        seq_len: usize,
        step_time_s: f64,
        lr: Option<f64>,
        grad_norm: Option<f64>,
        peak: Option<Py<PyAny>>,
        planned_bytes: Option<u64>,
    ) -> PyResult<bool> {
        // A float as it is; anything else (a device tensor) is read on the reporter thread:
        // extracting it here would wait for the device.
        let loss = match loss.cast::<pyo3::types::PyFloat>() {
            Ok(f) => Loss::Value(f.value()),
            Err(_) => Loss::Tensor(loss.unbind()),
        };
        let peak = peak.map_or(Peak::Rss, Peak::Python);
        if self.ended {
            return Err(PyRuntimeError::new_err("this headroom run has ended"));
        }
        let limits = Limits {
            cuda: self.cuda,
            limit: self.limit,
        };
        let session = &self.session;
        let reporter = self
            .reporter
            .get_or_insert_with(|| Reporter::start(session.clone(), limits));
        reporter.report(Report {
            step,
            loss,
            samples,
            seq_len,
            step_time_s,
            lr,
            grad_norm,
            peak,
            planned_bytes,
        });
        // A pause comes as a command and holds the loop in the boundary until resumed:
        // at a report, commands waiting and a stop are what the boundary has to do.
        Ok(!self.commands.is_empty() || reporter.has_diverged() || self.stopping)
    }

    /// A reported device loss that was NaN or infinite, once: `(step, value)`.
    fn take_diverged(&self) -> Option<(u64, f64)> {
        self.reporter.as_ref().and_then(Reporter::take_diverged)
    }

    /// Waits until every reported step is recorded.
    fn flush(&self, py: Python<'_>) {
        self.flush_reports(py);
    }

    /// What the step's fixed memory is made of, counted by Python after the first
    /// optimizer step: parameters, gradients and the optimizer's state, bytes (the
    /// optimizer-state hint reads it).
    fn memory_parts(&mut self, parameters: u64, gradients: u64, optimizer: u64) -> PyResult<()> {
        self.live()?;
        self.session().memory_parts(headroom_core::MemoryParts {
            parameters,
            gradients,
            optimizer,
        });
        Ok(())
    }

    /// A `headroom.plan`'s split of a step's memory, for the memory panel (without one
    /// the session works it out from the steps it measures).
    fn plan_split(
        &mut self,
        model_bytes: u64,
        overhead_bytes: u64,
        activations_per_token: f64,
    ) -> PyResult<()> {
        self.live()?;
        self.session().plan_split(headroom_core::PlanSplit {
            model_bytes,
            overhead_bytes,
            activations_per_token,
        });
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
        self.live()?;
        self.session().plan_check(headroom_core::PlanCheck {
            step,
            micro_batch,
            planned_bytes,
            peak_bytes,
        });
        Ok(())
    }

    /// A validation result.
    fn eval(&mut self, step: u64, val_loss: f64, train_loss: f64, tokens: u64) -> PyResult<()> {
        self.live()?;
        self.session().eval(step, val_loss, train_loss, tokens);
        Ok(())
    }

    /// An evaluation pass begins (`phase`: eval, validation, test, predict).
    fn eval_begin(&mut self, py: Python<'_>, phase: &str) -> PyResult<()> {
        self.flush_reports(py);
        self.live()?;
        self.session().eval_begin(phase);
        Ok(())
    }

    /// The chunk size for an evaluation batch of `asked` samples (the controller's,
    /// core/src/policy/eval.rs; opens a pass named `eval` when none is).
    fn eval_size(&mut self, py: Python<'_>, asked: usize, seq_len: usize) -> PyResult<usize> {
        self.flush_reports(py);
        self.live()?;
        Ok(self.session().eval_size(asked, seq_len.max(1)))
    }

    /// An evaluation chunk completed at `peak_bytes`.
    fn eval_chunk(&mut self, size: usize, seq_len: usize, peak_bytes: u64) -> PyResult<()> {
        self.live()?;
        let limit = if self.cuda {
            self.limit
        } else {
            procmem::current_cpu_limit(self.limit)
        };
        self.session()
            .eval_chunk(size, seq_len.max(1), peak_bytes, limit);
        Ok(())
    }

    /// An evaluation chunk ran out of memory: the size to retry its samples with
    /// (`None`: one sample does not fit).
    fn eval_oom(&mut self, size: usize, seq_len: usize, error: &str) -> PyResult<Option<usize>> {
        self.live()?;
        Ok(self.session().eval_oom(size, seq_len.max(1), error))
    }

    /// The evaluation pass ends; whether one was open.
    fn eval_end(&mut self) -> PyResult<bool> {
        self.live()?;
        Ok(self.session().eval_end().is_some())
    }

    /// Whether an evaluation pass is open.
    #[getter]
    fn evaluating(&self) -> bool {
        self.session().evaluating()
    }

    /// A line for the dashboard's event log: `level` is info, warn or error.
    #[pyo3(signature = (text, level="info", source="python"))]
    fn notice_text(&self, py: Python<'_>, text: String, level: &str, source: &str) -> PyResult<()> {
        self.flush_reports(py);
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
        self.live()?;
        self.session().notice(level, source, text);
        Ok(())
    }

    /// Takes the commands that came in. The session carries out what it can (pause,
    /// thresholds, pin, stop) and hands back `(id, kind)` for what Python must do
    /// (`checkpoint`, `free_cache`), to be confirmed with [`NativeRun::confirm`]. While
    /// paused, it waits up to 100 ms for a command (the GIL released) and runs Python's
    /// signal handlers before it returns: the caller polls again while `paused`, and a
    /// handler that needs this run (a SIGTERM's stop) acts between calls, not inside this
    /// one's borrow.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let mut out = Vec::new();
        let mut waited = false;
        loop {
            let cmd = match self.commands.try_recv() {
                Ok(c) => c,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty)
                    if !self.session().paused() || !out.is_empty() || waited =>
                {
                    break
                }
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
            out.extend(self.handle(cmd));
        }
        let stopping = self.session().stop_requested();
        self.stopping = stopping;
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
            out.extend(self.handle(cmd));
        }
        Ok(out)
    }

    /// Rank 0 of a job: every rank's row at this step's agreement (a `JobRanks` record,
    /// as JSON).
    fn job_ranks(&self, record: &str) -> PyResult<()> {
        self.live()?;
        let rows: headroom_core::JobRanks =
            serde_json::from_str(record).map_err(|e| value_error(format!("job_ranks: {e}")))?;
        self.session().send(Telemetry::JobRanks(rows));
        Ok(())
    }

    /// Out-of-memory errors caught so far.
    #[getter]
    fn ooms(&self) -> u64 {
        self.session().ooms()
    }

    /// The last step's limit (bytes) and usage (peak / limit); 0 before the first.
    #[getter]
    fn last_memory(&self) -> (u64, f64) {
        self.session().last_memory()
    }

    /// A stop asked by a signal (`why`, e.g. "SIGTERM"): as the dashboard's stop, said
    /// with its cause.
    fn request_stop(&mut self, why: &str) -> PyResult<()> {
        self.live()?;
        self.session().signal_stop(why);
        self.stopping = true;
        Ok(())
    }

    /// Confirms a command Python carried out, with what it did.
    fn confirm(&mut self, py: Python<'_>, id: u64, applied: String) -> PyResult<()> {
        self.flush_reports(py);
        let cmd = self
            .pending
            .remove(&id)
            .ok_or_else(|| value_error(format!("no command {id} is waiting")))?;
        self.session().answer(cmd, applied);
        Ok(())
    }

    /// A checkpoint the loop wrote.
    fn checkpoint_saved(&mut self, py: Python<'_>, step: u64, path: String) -> PyResult<()> {
        self.flush_reports(py);
        self.live()?;
        self.session().checkpoint_saved(step, path);
        Ok(())
    }

    /// Ends the run as finished; returns a warning about the log, if any.
    #[pyo3(signature = (stopped_by_user=false))]
    fn finish(&mut self, py: Python<'_>, stopped_by_user: bool) -> Option<String> {
        if self.ended {
            return None;
        }
        self.stop_reporter(py);
        self.session().finished(stopped_by_user);
        self.end(py)
    }

    /// Ends the run as failed, with the reason.
    fn fail(&mut self, py: Python<'_>, reason: String) -> Option<String> {
        if self.ended {
            return None;
        }
        self.stop_reporter(py);
        self.session().failed(reason);
        self.end(py)
    }

    #[getter]
    fn paused(&self) -> bool {
        self.session().paused()
    }

    #[getter]
    fn stop_requested(&self) -> bool {
        self.session().stop_requested()
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
        self.session().micro_batch()
    }

    #[getter]
    fn limit_bytes(&self) -> u64 {
        self.limit
    }

    #[getter]
    fn thresholds(&self) -> (f64, f64, f64, f64) {
        let [a, b, c, d] = self.session().thresholds().as_array();
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
        self.server()
            .map(|s| s.addresses().socket.display().to_string())
    }

    /// `host:port` when serving on TCP too.
    #[getter]
    fn tcp(&self) -> Option<String> {
        self.server()
            .and_then(|s| s.addresses().tcp)
            .map(|a| a.to_string())
    }

    /// The file holding the TCP token.
    #[getter]
    fn token_file(&self) -> Option<String> {
        self.server()
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
