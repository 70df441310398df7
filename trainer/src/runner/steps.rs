//! One optimizer step: the controller's size before it, the attempt, its peak after, an
//! out-of-memory error's recovery; and the plan probed before the first.
use std::time::Instant;

use crossbeam_channel::Receiver;
use headroom_core::config::Checkpointing;
use headroom_core::plan::{Lever, Plan};
use headroom_core::policy::Upcoming;
use headroom_core::units::fmt_bytes;
use headroom_core::{Command, Level, MemoryParts, PlanCheck, PlanSplit};
use headroom_host::procmem;
use headroom_host::session::{Measured, StepDone, StepPeak};
use tch::{Device, Tensor};

use super::{attempt, first_line, Failure, Trainer, LENGTH_HORIZON};
use crate::heap_watch;
use crate::oom;
use crate::plan_probe;
use crate::snapshot;
use crate::step::{self, StepPlan, Stepped};

impl Trainer {
    /// One optimizer step, retried with smaller micro-batches after an out-of-memory
    /// error until it succeeds or the controller gives up. False: a stop gave the step up
    /// between two micro-batches (its partial gradients dropped, nothing else changed).
    pub(super) fn train_one(&mut self, commands: &Receiver<Command>) -> Result<bool, String> {
        let done = self.session.step();
        let s = done + 1;
        let seq = self.cfg.data.seq_len_at(self.cfg.run.seed, s);
        if let Some(next) = self.session.before_step(s, seq, Some(self.upcoming(s))) {
            self.free_cache_if(next.free_cache);
        }
        self.follow_smaller_step(self.micro_batch() * seq);
        let (plan, out, dt) = loop {
            let plan = StepPlan {
                seed: self.cfg.run.seed,
                step: s,
                effective_batch: self.effective_batch,
                micro_batch: self.micro_batch(),
                seq_len: seq,
                lr: self.schedule.lr_at(s),
                grad_clip: self.cfg.optim.grad_clip,
                inject_oom: self.inject_oom.remove(&s),
            };
            let predicted = self.session.predicted_bytes(plan.micro_batch, seq);
            if let Err(e) = self.meter.reset() {
                self.session.notice(Level::Warn, "memory", e);
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
            self.stop.publish(done, true);
            let error = match attempt(self.hard_limit, || {
                if panic_now {
                    panic!("injected panic in step {s} (HEADROOM_INJECT_PANIC)");
                }
                step::train_step_until(model, opt, data, &plan, &mut abandon)
            }) {
                Ok(Stepped::Abandoned { micro_batches_done }) => {
                    self.opt.zero_grad();
                    self.stop.publish(done, false);
                    self.session.notice(
                        Level::Warn,
                        "stop",
                        abandoned_text(
                            s,
                            micro_batches_done,
                            plan.accum_steps(),
                            t0.elapsed().as_secs_f64(),
                        ),
                    );
                    return Ok(false);
                }
                Ok(Stepped::Done(out)) => {
                    let dt = t0.elapsed().as_secs_f64().max(1e-9);
                    self.observe_memory(&plan, predicted);
                    break (plan, out, dt);
                }
                Err(Failure::Other(e)) => return Err(format!("step {s} failed: {e}")),
                Err(Failure::Oom(e)) => e,
            };
            self.recover_from_oom(&plan, error)?;
        };
        if !out.loss.is_finite() {
            return Err(format!(
                "step {s}: the loss is {} (training diverged); lower optim.lr or raise \
                 optim.warmup_steps",
                out.loss
            ));
        }
        self.stop.publish(s, false);
        self.losses_since_eval.0 += out.loss;
        self.losses_since_eval.1 += 1;
        self.session.step_done(StepDone {
            step: s,
            loss: out.loss,
            lr: Some(plan.lr),
            grad_norm: Some(out.grad_norm),
            micro_batch: plan.micro_batch,
            effective_batch: plan.effective_batch,
            seq_len: seq,
            step_time_s: dt,
            tokens: (plan.effective_batch * seq) as u64,
        });
        if s == self.start_step + 1 {
            // This process's first step: its gradients and moments exist now.
            self.session.memory_parts(self.memory_parts());
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
    pub(super) fn start_plan(&mut self) {
        let t0 = Instant::now();
        let shape = plan_probe::shape(&self.cfg);
        let start = self.micro_batch();
        let sizes = plan_probe::sizes_for(start.min(16));
        let limit = self.meter.limit();
        let target = self.session.thresholds().target;
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
        self.session.notice(Level::Info, "plan", text);
        if let Ok(plan) = &probed {
            self.session.plan_split(plan_split(plan, lever));
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
    fn observe_memory(&mut self, plan: &StepPlan, predicted: Option<u64>) {
        let peak = match self.meter.peak() {
            Ok(p) => p,
            Err(e) => {
                self.session.notice(Level::Warn, "memory", e);
                return;
            }
        };
        let limit = self.meter.current_limit();
        let switched = self.session.measured(Measured {
            step: plan.step,
            peak_bytes: peak,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
        });
        if let Some(p) = self.plan.as_ref().filter(|p| p.is_measured()) {
            let lever = self.lever();
            if switched {
                // The memory panel's bar follows the lever now in force.
                self.session.plan_split(plan_split(p, lever));
            }
            self.session.plan_check(PlanCheck {
                step: plan.step,
                micro_batch: plan.micro_batch,
                planned_bytes: p.predict(lever, plan.micro_batch, plan.seq_len),
                peak_bytes: peak,
            });
        }
        let step_peak = StepPeak {
            step: plan.step,
            micro_batch: plan.micro_batch,
            seq_len: plan.seq_len,
            peak_bytes: peak,
            predicted_bytes: predicted,
            limit_bytes: limit,
            configured_limit_bytes: self.meter.limit(),
        };
        self.session.step_memory(step_peak);
        if self.watches_heap() {
            let live = procmem::take_heap_in_use_peak();
            if let Some(text) = self.heap.after_step(peak, predicted, live, limit) {
                self.session.notice(Level::Warn, "memory", text);
            }
        }
        if let Some(next) = self.session.observe(step_peak) {
            self.free_cache_if(next.free_cache);
        }
    }

    /// Whether steps are checked for memory glibc's heap holds beyond the batch
    /// ([`HeapWatch`]): on the CPU, unless tensors are mmapped already or another malloc
    /// serves them.
    fn watches_heap(&self) -> bool {
        self.device == Device::Cpu
            && !heap_watch::mmap_threshold_set(self.hard_limit)
            && headroom_host::procmem::glibc_malloc()
    }

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
    fn snapshot_oom(&self, step: u64) {
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
        self.session.notice(level, "memory", text);
    }

    /// Every tensor of the failed attempt is gone (returned or unwound); the gradients it
    /// half-accumulated are zeroed, the cache freed, and the controller picks the size
    /// the same samples are retried with. The optimizer never saw the attempt: its update
    /// is all-or-nothing (see [`crate::optim::AdamW::step`]). Out of sizes, activation
    /// checkpointing is the last resort (`memory.auto_checkpoint`); then the run gives up
    /// with a checkpoint and what would fit.
    fn recover_from_oom(&mut self, plan: &StepPlan, error: String) -> Result<(), String> {
        self.opt.zero_grad();
        let after = self
            .session
            .oom(plan.step, plan.micro_batch, plan.seq_len, &error);
        if let Some(after) = after {
            self.free_cache_if(after.free_cache);
        }
        self.snapshot_oom(plan.step);
        if after.is_some_and(|a| a.switch_checkpointing) {
            self.switch_checkpointing(Checkpointing::Blocks, "controller");
        }
        if after.is_some_and(|a| a.retry_with.is_some()) {
            return Ok(());
        }
        // The give-up runs while the cap may be full; the tests fill it here. Its record,
        // its message and its checkpoint's buffers are headroom's own allocations, which
        // the cap never refuses (host/src/own_heap.rs).
        procmem::fill_cap_if_asked();
        let saved = match self.checkpoint() {
            Ok(path) => format!(
                "the state after step {} is saved at {}",
                self.session.step(),
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
            self.session
                .controller()
                .map_or(0, |c| c.config().max_ooms_at_min),
            plan.micro_batch,
            plan.seq_len
        ))
    }

    /// The micro-batch the controller has chosen (a built-in run always has one).
    pub(super) fn micro_batch(&self) -> usize {
        self.session
            .micro_batch()
            .unwrap_or(self.cfg.batch.micro_batch)
    }

    /// Frees the allocator's cache when the controller decided to; a failure is said.
    fn free_cache_if(&self, decided: bool) {
        if !decided {
            return;
        }
        if let Err(e) = oom::free_cached(self.device) {
            self.session.notice(
                Level::Warn,
                "memory",
                format!("freeing cached memory failed: {e}"),
            );
        }
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
}
