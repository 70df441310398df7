//! One run, whatever trains it. The built-in trainer (trainer/src/runner/) and the Python
//! extension (py/src/run.rs) are drivers: they train, measure and hand a [`Session`] what
//! happened (a step's figures, its peak, an out-of-memory error, a command that came in);
//! the session keeps what a run is (the controller and its journal, thresholds, pause and
//! stop, the OOM count, the peak, a lever switch waiting for its first step), says it on
//! the bus, answers commands and decides. What only a driver can do (save a checkpoint,
//! free a cache, switch a lever, block while paused) it is handed back.
mod commands;
mod eval;
mod levers;
mod policy;
mod sinks;

pub use commands::Handled;
pub use levers::{Measured, PendingSwitch};
pub use policy::{
    budget_below_held, controller_config, hard_limit_notice, limit_notice, malloc_notice,
    resolved_auto_budget, resume_controller, resumed_auto_budget, ResumedController,
};
pub use sinks::{run_bus, Sinks};

use std::time::Instant;

use headroom_core::journal::Journaled;
use headroom_core::policy::{Decision, Profile, StepObservation, Thresholds, Upcoming};
use headroom_core::{
    Bus, Checkpointing, Level, MemoryParts, MemorySummary, Notice, PlanCheck, PlanSplit, Precision,
    RunInfo, RunLevers, RunStatus, RunSummary, StepMemory, StepMetrics, Telemetry,
};

/// What the driver of a run can do, which decides how the session answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Driver {
    /// The training loop is the user's script: a stop is a flag it reads, not a boundary
    /// the session's driver stops at by itself.
    pub script: bool,
    /// A stop saves a checkpoint (the built-in always; a script when it gave a callback).
    pub checkpoints: bool,
}

impl Driver {
    /// `headroom train`: it owns the model, its levers ([`Session::set_levers`]) and its
    /// checkpoints.
    pub const BUILT_IN: Driver = Driver {
        script: false,
        checkpoints: true,
    };

    /// A Python loop (`headroom.Run`): levers only where it hands them to the run.
    pub fn script(checkpoints: bool) -> Driver {
        Driver {
            script: true,
            checkpoints,
        }
    }
}

/// A completed step's figures, as the driver measured them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDone {
    pub step: u64,
    pub loss: f64,
    pub lr: Option<f64>,
    pub grad_norm: Option<f64>,
    pub micro_batch: usize,
    pub effective_batch: usize,
    pub seq_len: usize,
    pub step_time_s: f64,
    pub tokens: u64,
}

/// A step's peak against its limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPeak {
    pub step: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub peak_bytes: u64,
    pub predicted_bytes: Option<u64>,
    /// The limit this step ran under (on the CPU it follows what other processes take).
    pub limit_bytes: u64,
    /// The limit the run was configured with.
    pub configured_limit_bytes: u64,
}

/// What the controller wants next: the micro-batch, and whether the driver must free the
/// allocator's cache first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Next {
    pub micro_batch: usize,
    pub free_cache: bool,
}

/// What an out-of-memory error leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AfterOom {
    /// The micro-batch to retry with; `None`: the run gives up.
    pub retry_with: Option<usize>,
    pub free_cache: bool,
    /// Out of sizes, activation checkpointing is the last resort: the driver switches it
    /// on ([`Session::switched_checkpointing`]) before the retry.
    pub switch_checkpointing: bool,
}

/// One run's state and its voice on the bus.
pub struct Session {
    bus: Option<Bus>,
    driver: Driver,
    /// Adaptive runs: decides the micro-batch, every call journaled for checkpoints.
    controller: Option<Journaled>,
    /// A watch-only run's thresholds (an adaptive run's live in its controller).
    thresholds: Thresholds,
    effective_batch: usize,
    total_steps: u64,
    started: Instant,
    /// Optimizer steps completed, counting resumed ones.
    step: u64,
    tokens_seen: u64,
    last_loss: Option<f64>,
    last_val_loss: Option<f64>,
    /// The latest checkpoint's path.
    checkpoint: Option<String>,
    /// Peak, resizes and OOMs, for the summary.
    memory: MemorySummary,
    /// The last step's limit and usage (a job's rows carry them).
    last_limit: u64,
    last_usage: f64,
    paused: bool,
    stop_requested: bool,
    /// A lever switch waiting for the first step that runs with it.
    switch: Option<PendingSwitch>,
    /// The last completed step's peak, what a lever switch is measured against.
    last_measured: Option<Measured>,
    /// The driver's precision, where it can switch it (a lever command for one it cannot
    /// is refused here).
    precision: Option<Precision>,
    /// The half precision the precision lever switches to (bf16 unless the driver scales
    /// its loss for fp16).
    half: Precision,
    /// The driver's activation checkpointing, where it can switch it.
    checkpointing: Option<Checkpointing>,
    /// Out of micro-batch sizes, checkpointing goes on and the step is retried
    /// (`memory.auto_checkpoint`; a Python run with a checkpointing lever).
    auto_checkpoint: bool,
    /// The evaluation pass in progress (eval.rs).
    eval_pass: Option<eval::EvalPass>,
    /// Parameters, gradients and optimizer state, bytes, once the driver counted them.
    model_bytes: Option<u64>,
    /// Whether the memory panel has a split under the levers in force: a driver's plan
    /// ([`Session::plan_split`]) or one the controller's fit gave.
    split_known: bool,
}

impl Session {
    pub fn new(
        bus: Bus,
        driver: Driver,
        thresholds: Thresholds,
        effective_batch: usize,
        total_steps: u64,
    ) -> Session {
        Session {
            bus: Some(bus),
            driver,
            controller: None,
            thresholds,
            effective_batch,
            total_steps,
            started: Instant::now(),
            step: 0,
            tokens_seen: 0,
            last_loss: None,
            last_val_loss: None,
            checkpoint: None,
            memory: MemorySummary::default(),
            last_limit: 0,
            last_usage: 0.0,
            paused: false,
            stop_requested: false,
            switch: None,
            last_measured: None,
            precision: None,
            half: Precision::Bf16,
            checkpointing: None,
            auto_checkpoint: false,
            eval_pass: None,
            model_bytes: None,
            split_known: false,
        }
    }

    /// The levers the driver can switch, as they are now (`None`: not this driver's to
    /// switch); `auto_checkpoint`: out of sizes, checkpointing goes on rather than the run
    /// giving up.
    pub fn set_levers(
        &mut self,
        precision: Option<Precision>,
        checkpointing: Option<Checkpointing>,
        auto_checkpoint: bool,
    ) {
        self.precision = precision;
        self.checkpointing = checkpointing;
        self.auto_checkpoint = auto_checkpoint && checkpointing.is_some();
    }

    /// The half precision the driver's precision lever switches to from fp32 (bf16 unless
    /// it says so: a Python run that scales its loss for fp16).
    pub fn set_half_precision(&mut self, half: Precision) {
        self.half = half;
    }

    /// Makes the run adaptive: `controller` decides its micro-batch from now on.
    pub fn set_controller(&mut self, controller: Journaled) {
        self.controller = Some(controller);
    }

    /// Continues after `step` steps and `tokens_seen` tokens (a resumed run), from the
    /// checkpoint at `checkpoint` when the driver knows it.
    pub fn resume_at(&mut self, step: u64, tokens_seen: u64, checkpoint: Option<String>) {
        self.step = step;
        self.tokens_seen = tokens_seen;
        self.checkpoint = checkpoint;
    }

    pub fn send(&self, msg: Telemetry) {
        if let Some(bus) = &self.bus {
            bus.send(msg);
        }
    }

    pub fn notice(&self, level: Level, source: &str, text: impl Into<String>) {
        self.send(Telemetry::Notice(Notice::new(level, source, text)));
    }

    /// The run's bus; `None` once the run has ended.
    pub fn bus(&self) -> Option<&Bus> {
        self.bus.as_ref()
    }

    /// Ends the run's hold on its bus, so the sinks see the stream close.
    pub fn take_bus(&mut self) -> Option<Bus> {
        self.bus.take()
    }

    /// The run starts: its description, with the levers the driver switches itself. The
    /// run's time (the summary's) counts from here.
    pub fn run_started(&mut self, mut info: RunInfo) {
        self.started = Instant::now();
        if self.precision.is_some() || self.checkpointing.is_some() {
            info.levers = Some(RunLevers {
                precision: self.precision,
                checkpointing: self.checkpointing,
                half: self.precision.map(|_| self.half),
            });
        }
        self.send(Telemetry::RunStarted(info));
    }

    pub fn status(&self, status: RunStatus) {
        self.send(Telemetry::Status { status });
    }

    pub fn controller(&self) -> Option<&Journaled> {
        self.controller.as_ref()
    }

    pub fn thresholds(&self) -> Thresholds {
        self.controller
            .as_ref()
            .map_or(self.thresholds, |c| c.thresholds())
    }

    /// The thresholds in force, with the preset they are (given by name or by value),
    /// else custom. The one place a profile is worked out, for every driver.
    pub fn thresholds_changed(&self, source: &str, named: Option<Profile>) {
        let thresholds = self.thresholds();
        self.send(Telemetry::ThresholdsChanged {
            thresholds,
            profile: named.or_else(|| Profile::of(thresholds)),
            source: source.into(),
        });
    }

    pub fn micro_batch(&self) -> Option<usize> {
        self.controller.as_ref().map(|c| c.micro_batch())
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    pub fn last_loss(&self) -> Option<f64> {
        self.last_loss
    }

    pub fn effective_batch(&self) -> usize {
        self.effective_batch
    }

    pub fn paused(&self) -> bool {
        self.paused
    }

    pub fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    pub fn ooms(&self) -> u64 {
        self.memory.ooms
    }

    /// The last step's limit (bytes) and usage (peak / limit); 0 before the first.
    pub fn last_memory(&self) -> (u64, f64) {
        (self.last_limit, self.last_usage)
    }

    /// Reports every decision as concerning `step` (made before its first attempt, after
    /// an out-of-memory error in it, or once it completed: one numbering on screen and in
    /// the log); whether the driver must free the allocator's cache.
    pub fn decided(&mut self, step: u64, decisions: Vec<Decision>) -> bool {
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

    fn next(&mut self, step: u64, decisions: Vec<Decision>) -> Next {
        let free_cache = self.decided(step, decisions);
        Next {
            micro_batch: self.micro_batch().unwrap_or(0),
            free_cache,
        }
    }

    /// Before a step's first attempt (adaptive runs): the micro-batch it runs at.
    /// `upcoming`: the longest length within the horizon, and its step.
    pub fn before_step(
        &mut self,
        step: u64,
        seq_len: usize,
        upcoming: Option<Upcoming>,
    ) -> Option<Next> {
        let c = self.controller.as_mut()?;
        let decisions = match upcoming {
            Some(u) => c.before_step_ahead(seq_len, u),
            None => c.before_step(seq_len),
        };
        Some(self.next(step, decisions))
    }

    pub fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        self.controller
            .as_ref()
            .and_then(|c| c.predicted_bytes(micro_batch, seq_len))
    }

    /// A completed step's peak at its shape: what a lever switch waiting for it freed
    /// (a controller decision); whether one did.
    pub fn measured(&mut self, measured: Measured) -> bool {
        let switched = self.switch.take().map(|switch| {
            self.send(Telemetry::Decision {
                step: measured.step,
                decision: switch.outcome(measured),
            })
        });
        self.last_measured = Some(measured);
        switched.is_some()
    }

    /// A plan's prediction for a completed step beside its measured peak.
    pub fn plan_check(&self, check: PlanCheck) {
        self.send(Telemetry::PlanCheck(check));
    }

    /// A completed step's peak against its limit, on the bus and in the summary.
    pub fn step_memory(&mut self, p: StepPeak) {
        let limit = p.limit_bytes.max(1);
        let usage = p.peak_bytes as f64 / limit as f64;
        self.memory.note_peak(p.peak_bytes, limit, usage);
        (self.last_limit, self.last_usage) = (limit, usage);
        self.send(Telemetry::StepMemory(StepMemory {
            step: p.step,
            micro_batch: p.micro_batch,
            seq_len: p.seq_len,
            peak_bytes: p.peak_bytes,
            predicted_bytes: p.predicted_bytes,
            limit_bytes: limit,
            configured_limit_bytes: p.configured_limit_bytes,
            usage,
        }));
    }

    /// The peak into the controller (adaptive runs): the next micro-batch.
    pub fn observe(&mut self, p: StepPeak) -> Option<Next> {
        let c = self.controller.as_mut()?;
        c.set_limit(p.limit_bytes.max(1));
        let decisions = c.observe(StepObservation {
            step: p.step,
            micro_batch: p.micro_batch,
            seq_len: p.seq_len,
            peak_bytes: p.peak_bytes,
        });
        let next = self.next(p.step, decisions);
        self.measured_split();
        Some(next)
    }

    /// An out-of-memory error in a step's attempt, counted and said; what to retry with.
    /// A watch-only run has no controller to ask: `None`.
    pub fn oom(
        &mut self,
        step: u64,
        micro_batch: usize,
        seq_len: usize,
        error: &str,
    ) -> Option<AfterOom> {
        let c = self.controller.as_mut()?;
        let outcome = c.on_oom(micro_batch, seq_len);
        self.memory.ooms += 1;
        self.send(Telemetry::Oom {
            step,
            micro_batch,
            seq_len,
            retry_with: outcome.retry_with,
            error: error.lines().next().unwrap_or_default().to_string(),
        });
        let free_cache = self.decided(step, outcome.decisions);
        let last_resort = outcome.retry_with.is_none()
            && self.auto_checkpoint
            && self.checkpointing.is_some_and(|c| !c.is_on());
        if last_resort {
            // The smallest micro-batch does not fit: recomputing the blocks' activations
            // may make it fit, which beats stopping (the user opted in).
            self.notice(
                Level::Warn,
                "memory",
                format!(
                    "step {step} ran out of memory at the smallest micro-batch ({micro_batch} \
                     × {seq_len} tokens): activation checkpointing is now on \
                     ({}) and the step is retried",
                    if self.driver.script {
                        "the run's checkpointing lever"
                    } else {
                        "memory.auto_checkpoint"
                    }
                ),
            );
        }
        Some(AfterOom {
            retry_with: if last_resort {
                Some(micro_batch)
            } else {
                outcome.retry_with
            },
            free_cache,
            switch_checkpointing: last_resort,
        })
    }

    /// A completed step's figures.
    pub fn step_done(&mut self, s: StepDone) {
        let dt = s.step_time_s.max(1e-9);
        self.step = s.step;
        self.tokens_seen += s.tokens;
        self.last_loss = Some(s.loss);
        self.send(Telemetry::Step(StepMetrics {
            step: s.step,
            total_steps: self.total_steps,
            loss: s.loss,
            lr: s.lr,
            grad_norm: s.grad_norm,
            step_time_s: dt,
            tokens_per_s: s.tokens as f64 / dt,
            samples_per_s: s.effective_batch as f64 / dt,
            micro_batch: s.micro_batch,
            accum_steps: s.effective_batch.div_ceil(s.micro_batch.max(1)),
            effective_batch: s.effective_batch,
            seq_len: s.seq_len,
            tokens_seen: self.tokens_seen,
        }));
    }

    /// What the step's fixed memory is made of (the optimizer-state hint reads it).
    pub fn memory_parts(&mut self, parts: MemoryParts) {
        self.model_bytes = Some(parts.parameters + parts.gradients + parts.optimizer);
        self.send(Telemetry::MemoryParts(parts));
        self.measured_split();
    }

    /// A driver's plan of a step's memory (a start probe, `headroom.plan`): the memory
    /// panel's split.
    pub fn plan_split(&mut self, split: PlanSplit) {
        self.split_known = true;
        self.send(Telemetry::PlanSplit(split));
    }

    /// Without a plan, the split from what the run measured: the model's bytes the driver
    /// counted, and the controller's fit of its steps' peaks (fixed + per token, once two
    /// sizes ran), so a Python run's panel is as complete as a probed one's. Once per
    /// lever state.
    fn measured_split(&mut self) {
        if self.split_known {
            return;
        }
        let (Some(model), Some(c)) = (self.model_bytes, self.controller.as_ref()) else {
            return;
        };
        if !c.model().is_fitted() {
            return;
        }
        let Some((fixed, per_token)) = c.model().coefficients() else {
            return;
        };
        if per_token <= 0.0 {
            return;
        }
        self.split_known = true;
        self.send(Telemetry::PlanSplit(PlanSplit {
            model_bytes: model,
            overhead_bytes: (fixed.max(0.0) as u64).saturating_sub(model),
            activations_per_token: per_token,
        }));
    }

    /// A validation result.
    pub fn eval(&mut self, step: u64, val_loss: f64, train_loss: f64, tokens: u64) {
        self.last_val_loss = Some(val_loss);
        self.send(Telemetry::Eval(headroom_core::EvalMetrics {
            step,
            val_loss,
            train_loss,
            tokens,
        }));
    }

    /// A checkpoint the driver wrote.
    pub fn checkpoint_saved(&mut self, step: u64, path: String) {
        self.checkpoint = Some(path.clone());
        self.send(Telemetry::CheckpointSaved { step, path });
    }

    /// How the run ended, for the exit summary and the `finished` record.
    pub fn summary(&self, stopped_by_user: bool) -> RunSummary {
        let mb = self.micro_batch().unwrap_or(0);
        RunSummary {
            steps_done: self.step,
            total_steps: self.total_steps,
            stopped_by_user: stopped_by_user || self.stop_requested,
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

    /// The run finished (or stopped): its status and summary, the last records.
    pub fn finished(&mut self, stopped_by_user: bool) -> RunSummary {
        self.eval_end();
        let summary = self.summary(stopped_by_user);
        self.status(RunStatus::Finished);
        self.send(Telemetry::Finished(summary.clone()));
        summary
    }

    /// The run failed, with the reason.
    pub fn failed(&mut self, reason: String) {
        self.eval_end();
        self.status(RunStatus::Failed);
        self.send(Telemetry::Failed { reason });
    }
}

#[cfg(test)]
mod tests;
