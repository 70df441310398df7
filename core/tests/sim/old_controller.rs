//! The baseline controller the simulator compares against: an earlier version of the
//! controller (no baseline before the first step, no lengths told ahead), kept verbatim
//! except for its imports so the simulator can score it beside the current one. Not used
//! by the crate.
#![allow(dead_code)]
use std::collections::VecDeque;

use headroom_core::policy::{
    ControllerConfig, Decision, MemoryModel, OomOutcome, ResizeReason, StepObservation,
    ThresholdError, Thresholds,
};

/// Steps above target (below warning) at one size before shrinking: one reading there is
/// noise, several in a row are drift.
const OVER_TARGET_STEPS: u32 = 3;

/// Predictions whose error sets the planning margin.
pub const ERROR_WINDOW: usize = 16;
const MIN_MARGIN: f64 = 0.01;
/// While the fit rests on two sizes it has not been checked against a third: step peaks
/// scatter by about 1% run to run on CPU, so keep more room until it has.
const YOUNG_MARGIN: f64 = 0.02;
const MAX_MARGIN: f64 = 0.03;
/// A shrink expected to lower usage by at least this share of the limit, that lowered it
/// by less than a quarter of that, marks the footprint as not following the batch.
const MIN_EXPECTED_DROP: f64 = 0.01;

#[derive(Debug, Clone)]
pub struct OldController {
    cfg: ControllerConfig,
    thresholds: Thresholds,
    limit_bytes: u64,
    model: MemoryModel,
    micro_batch: usize,
    pinned: bool,
    ceiling_tokens: Option<u64>,
    steps_at_size: u32,
    /// Consecutive steps measured above target at the current size.
    steps_over_target: u32,
    clean_steps: u64,
    ooms_at_min: u32,
    warned: bool,
    /// |predicted − measured| / limit of the fitted model's latest predictions.
    errors: VecDeque<f64>,
    /// The longest sequence among the model's readings.
    max_seq_seen: usize,
    /// A shrink whose effect the next step shows: (micro-batch before, usage before).
    pending_shrink: Option<(usize, f64)>,
    /// The last shrink did not lower usage: memory is held apart from the batch.
    unresponsive: bool,
}

impl OldController {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit_bytes: u64,
        micro_batch: usize,
    ) -> OldController {
        let mb = micro_batch.clamp(cfg.min_micro_batch.max(1), cfg.max_micro_batch.max(1));
        OldController {
            cfg,
            thresholds,
            limit_bytes: limit_bytes.max(1),
            model: MemoryModel::new(),
            micro_batch: mb,
            pinned: false,
            ceiling_tokens: None,
            steps_at_size: 0,
            steps_over_target: 0,
            clean_steps: 0,
            ooms_at_min: 0,
            warned: false,
            errors: VecDeque::with_capacity(ERROR_WINDOW),
            max_seq_seen: 0,
            pending_shrink: None,
            unresponsive: false,
        }
    }

    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }
    pub fn model(&self) -> &MemoryModel {
        &self.model
    }
    pub fn ceiling_tokens(&self) -> Option<u64> {
        self.ceiling_tokens
    }
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    /// Replaces the thresholds if valid; a rejected set leaves the old ones in force.
    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        self.thresholds.set(t)?;
        self.warned = false;
        Ok(())
    }

    /// True after a shrink that did not lower usage, until usage falls under target.
    pub fn is_unresponsive(&self) -> bool {
        self.unresponsive
    }

    /// How much more a token of `seq_len` is assumed to cost than the fit says: 1 up to
    /// the longest measured sequence, the ratio of the lengths beyond it.
    fn stretch(&self, seq_len: usize) -> f64 {
        if self.max_seq_seen > 0 && seq_len > self.max_seq_seen {
            seq_len as f64 / self.max_seq_seen as f64
        } else {
            1.0
        }
    }

    /// Predicted peak bytes of `micro_batch` sequences of `seq_len`.
    pub fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        let (fixed, per) = self.model.coefficients()?;
        let tokens = (micro_batch * seq_len) as f64;
        Some((fixed + per * self.stretch(seq_len) * tokens).max(0.0) as u64)
    }

    /// Predicted usage (fraction of the limit) of `micro_batch` sequences of `seq_len`.
    pub fn predicted_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        self.predicted_bytes(micro_batch, seq_len)
            .map(|b| b as f64 / self.limit_bytes as f64)
    }

    /// Pins the micro-batch to `n` (clamped to the allowed range); the controller then
    /// only warns.
    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        let to = n.clamp(
            self.cfg.min_micro_batch.max(1),
            self.cfg.max_micro_batch.max(1),
        );
        self.pinned = true;
        self.resize(to, ResizeReason::Pinned, 0.0)
            .into_iter()
            .collect()
    }

    pub fn unpin(&mut self) {
        self.pinned = false;
        self.steps_at_size = 0;
    }

    fn cap(&self) -> usize {
        self.cfg.max_micro_batch.max(1)
    }
    fn floor(&self) -> usize {
        self.cfg.min_micro_batch.max(1)
    }

    fn plan_seq(&self, seq_len: usize) -> usize {
        self.cfg.max_seq_len.max(seq_len).max(1)
    }

    /// Largest micro-batch under the learned ceiling for `seq_len`.
    fn ceiling_batch(&self, seq_len: usize) -> usize {
        match self.ceiling_tokens {
            Some(c) => (c.saturating_sub(1) / seq_len.max(1) as u64) as usize,
            None => usize::MAX,
        }
    }

    /// The share of the limit kept free below target for the model's own error.
    pub fn margin(&self) -> f64 {
        let floor = if self.model.distinct_sizes() < 3 {
            YOUNG_MARGIN
        } else {
            MIN_MARGIN
        };
        self.errors
            .iter()
            .copied()
            .fold(0.0, f64::max)
            .clamp(floor, MAX_MARGIN)
    }

    /// The model's largest micro-batch predicted under target (less the margin).
    fn fit_target(&self, seq_len: usize) -> Option<usize> {
        let goal = (self.thresholds.target - self.margin()) * self.limit_bytes as f64;
        let (fixed, per) = self.model.coefficients()?;
        let per_seq = per * self.stretch(seq_len) * seq_len.max(1) as f64;
        if per_seq <= 0.0 {
            return None;
        }
        Some(((goal - fixed) / per_seq).max(0.0).floor() as usize)
    }

    /// Forgets the model's readings (they describe a footprint that is gone).
    fn forget_readings(&mut self) {
        self.model.clear();
        self.errors.clear();
        self.max_seq_seen = 0;
    }

    /// Lowers the ceiling to `tokens` if that is lower; the decision when it changed.
    fn learn_ceiling(&mut self, micro_batch: usize, tokens: u64, usage: f64) -> Option<Decision> {
        self.clean_steps = 0;
        if self.ceiling_tokens.is_some_and(|c| c <= tokens) {
            return None;
        }
        self.ceiling_tokens = Some(tokens);
        Some(Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        })
    }

    fn resize(&mut self, to: usize, reason: ResizeReason, usage: f64) -> Option<Decision> {
        let to = to.clamp(self.floor(), self.cap());
        if to == self.micro_batch {
            return None;
        }
        let from = self.micro_batch;
        self.micro_batch = to;
        self.steps_at_size = 0;
        self.steps_over_target = 0;
        self.warned = false;
        self.pending_shrink = match reason {
            ResizeReason::Critical | ResizeReason::OverTarget | ResizeReason::Emergency
                if to < from =>
            {
                Some((from, usage))
            }
            _ => None,
        };
        if to > from {
            self.unresponsive = false;
        }
        let seq = self.plan_seq(0);
        Some(Decision::Resize {
            from,
            to,
            reason,
            usage,
            predicted: self.predicted_usage(to, seq),
        })
    }

    /// The forecast for the next step, whose sequences are `seq_len` long: shrinks (or,
    /// pinned, warns) when it is predicted above warning.
    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        let mut out = Vec::new();
        let Some(pred) = self.predicted_usage(self.micro_batch, seq_len) else {
            return out;
        };
        if pred <= self.thresholds.warning {
            return out;
        }
        out.push(Decision::Warning {
            usage: pred,
            forecast: true,
            text: format!(
                "the next batch ({} × {seq_len} tokens) is forecast at {:.0}% of the limit, above warning {:.0}%",
                self.micro_batch,
                pred * 100.0,
                self.thresholds.warning * 100.0
            ),
        });
        if !self.pinned && self.cfg.adaptive {
            let fit = self.fit_target(seq_len).unwrap_or(0);
            let to = fit.min(self.micro_batch - 1).max(self.floor());
            if let Some(mut d) = self.resize(to, ResizeReason::Forecast, pred) {
                if let Decision::Resize { predicted, .. } = &mut d {
                    *predicted = self.predicted_usage(to, seq_len);
                }
                out.push(d);
            }
        }
        out
    }

    /// Feeds one successful step's measurement; returns what to change.
    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        let mut out = Vec::new();
        let tokens = (obs.micro_batch * obs.seq_len) as u64;
        let usage = obs.peak_bytes as f64 / self.limit_bytes as f64;
        let t = self.thresholds;
        if usage < t.target {
            self.unresponsive = false;
        }
        if obs.micro_batch == self.micro_batch {
            if let Some((from, before)) = self.pending_shrink.take() {
                out.extend(self.check_shrink_worked(obs, from, before, usage));
            }
        }
        // Only lengths already measured: the stretch beyond them is a bound, not the
        // model's error.
        if self.model.is_fitted() && obs.seq_len <= self.max_seq_seen && !self.unresponsive {
            if let Some(p) = self.model.predict(tokens) {
                if self.errors.len() == ERROR_WINDOW {
                    self.errors.pop_front();
                }
                self.errors
                    .push_back(p.abs_diff(obs.peak_bytes) as f64 / self.limit_bytes as f64);
            }
        }
        // While usage does not follow the batch, a reading says nothing about its cost.
        if !self.unresponsive {
            self.model.observe(tokens, obs.peak_bytes);
            self.max_seq_seen = self.max_seq_seen.max(obs.seq_len);
        }
        self.ooms_at_min = 0;
        if obs.micro_batch == self.micro_batch {
            self.steps_at_size = self.steps_at_size.saturating_add(1);
        }
        self.clean_steps += 1;
        if let Some(c) = self.ceiling_tokens {
            if self.clean_steps >= self.cfg.forget_every {
                self.clean_steps = 0;
                let raised = c + c / 10 + 1;
                let max_tokens = (self.cap() * self.plan_seq(obs.seq_len)) as u64;
                self.ceiling_tokens = (raised <= max_tokens).then_some(raised);
                out.push(Decision::CeilingRaised {
                    tokens: self.ceiling_tokens,
                });
            }
        }
        let seq = self.plan_seq(obs.seq_len);
        let may_resize = self.cfg.adaptive && !self.pinned;
        if usage >= t.critical {
            let bound = (tokens as f64 * t.target / usage).floor() as u64;
            out.extend(self.learn_ceiling(obs.micro_batch, bound.max(1), usage));
        }
        if usage >= t.emergency {
            out.push(Decision::EmptyCache { usage });
            if may_resize {
                let half = (self.micro_batch / 2).max(1);
                let to = self.fit_target(seq).map_or(half, |f| f.min(half));
                out.extend(self.resize(to, ResizeReason::Emergency, usage));
                return out;
            }
        } else if usage >= t.critical && may_resize && !self.unresponsive {
            let fit = self.fit_target(seq).unwrap_or(self.micro_batch * 3 / 4);
            let to = fit.min(self.micro_batch - 1);
            out.extend(self.resize(to, ResizeReason::Critical, usage));
            return out;
        }
        if usage > t.target && obs.micro_batch == self.micro_batch {
            self.steps_over_target += 1;
        } else {
            self.steps_over_target = 0;
        }
        if usage > t.target
            && usage <= t.warning
            && may_resize
            && !self.unresponsive
            && self.steps_over_target == OVER_TARGET_STEPS
        {
            // The allocator's cache may be what grew: free it before giving up samples.
            out.push(Decision::EmptyCache { usage });
            return out;
        }
        if usage > t.target
            && usage <= t.warning
            && may_resize
            && !self.unresponsive
            && self.steps_over_target >= 2 * OVER_TARGET_STEPS
        {
            // The fit still describes the old footprint: shed the excess at the fitted
            // cost per token, then forget the old readings so growth is planned from the
            // new footprint only (else it would grow straight back).
            let goal = (t.target - self.margin()) * self.limit_bytes as f64;
            let excess = obs.peak_bytes as f64 - goal;
            let to = match self.model.coefficients() {
                Some((_, per)) if per > 0.0 => {
                    let shed = (excess / (per * seq as f64)).ceil().max(1.0) as usize;
                    self.micro_batch.saturating_sub(shed)
                }
                _ => self.micro_batch * 9 / 10,
            };
            let to = to.min(self.micro_batch - 1);
            // As at critical: this many tokens stay above target whatever the fit says.
            let bound = (tokens as f64 * t.target / usage).floor() as u64;
            out.extend(self.learn_ceiling(obs.micro_batch, bound.max(1), usage));
            self.forget_readings();
            out.extend(self.resize(to, ResizeReason::OverTarget, usage));
            return out;
        }
        if usage > t.warning {
            if !self.warned && !self.unresponsive {
                self.warned = true;
                let what = if self.pinned {
                    "the micro-batch is pinned; unpin it to let headroom shrink it"
                } else if !self.cfg.adaptive {
                    "adaptation is off (memory.adaptive = false)"
                } else {
                    "growth stops"
                };
                out.push(Decision::Warning {
                    usage,
                    forecast: false,
                    text: format!(
                        "step {} peaked at {:.0}% of the limit, above warning {:.0}%; {what}",
                        obs.step,
                        usage * 100.0,
                        t.warning * 100.0
                    ),
                });
            }
            return out;
        }
        if usage < t.target && may_resize && self.steps_at_size >= self.cfg.patience {
            let Some(fit) = self.fit_target(seq) else {
                return out;
            };
            let factor = if self.model.is_fitted() {
                self.cfg.max_growth
            } else {
                self.cfg.probe_growth
            };
            let bound =
                ((self.micro_batch as f64 * factor).floor() as usize).max(self.micro_batch + 1);
            let cand = fit.min(bound).min(self.cap()).min(self.ceiling_batch(seq));
            let gain = (self.micro_batch as f64 * self.cfg.min_gain)
                .ceil()
                .max(1.0) as usize;
            if cand >= self.micro_batch + gain {
                out.extend(self.resize(cand, ResizeReason::Grow, usage));
            }
        }
        out
    }

    /// The first step after a shrink from `from` (at `before` usage): if usage did not
    /// follow, the memory is not the batch's, and shrinking further would only give up
    /// throughput.
    fn check_shrink_worked(
        &mut self,
        obs: StepObservation,
        from: usize,
        before: f64,
        usage: f64,
    ) -> Vec<Decision> {
        let expected = match self.model.coefficients() {
            Some((_, per)) if self.model.is_fitted() && per > 0.0 => {
                per * ((from - obs.micro_batch) * obs.seq_len) as f64 / self.limit_bytes as f64
            }
            _ => before * (1.0 - obs.micro_batch as f64 / from as f64),
        };
        if expected < MIN_EXPECTED_DROP || before - usage >= expected / 4.0 {
            return Vec::new();
        }
        self.unresponsive = true;
        self.forget_readings();
        vec![
            Decision::EmptyCache { usage },
            Decision::Warning {
                usage,
                forecast: false,
                text: format!(
                    "step {}: usage stayed at {:.0}% although the micro-batch shrank from {from} \
                     to {} (it was {:.0}%): the memory is held apart from the batch (allocator \
                     cache, fragmentation or another process); holding at {} and freeing the cache",
                    obs.step,
                    usage * 100.0,
                    obs.micro_batch,
                    before * 100.0,
                    obs.micro_batch
                ),
            },
        ]
    }

    /// A step at `micro_batch` × `seq_len` ran out of memory: learn the ceiling, free the
    /// cache, and pick the size to retry the same samples with.
    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        let tokens = (micro_batch * seq_len) as u64;
        let mut decisions = vec![Decision::EmptyCache { usage: 1.0 }];
        decisions.extend(self.learn_ceiling(micro_batch, tokens, 1.0));
        self.pinned = false;
        self.unresponsive = false;
        self.pending_shrink = None;
        self.micro_batch = micro_batch;
        if micro_batch <= self.floor() {
            self.ooms_at_min += 1;
            let retry_with = (self.ooms_at_min < self.cfg.max_ooms_at_min).then_some(micro_batch);
            return OomOutcome {
                decisions,
                retry_with,
            };
        }
        let half = micro_batch / 2;
        let to = self
            .fit_target(self.plan_seq(seq_len))
            .map_or(half, |f| f.min(half));
        decisions.extend(self.resize(to, ResizeReason::Oom, 1.0));
        OomOutcome {
            decisions,
            retry_with: Some(self.micro_batch),
        }
    }
}
