//! The batch controller: a pure policy from step observations and thresholds to
//! [`Decision`]s. The trainer applies them at step boundaries and logs every one.
//!
//! It works in tokens (micro-batch × sequence length). Its rules are functions that read
//! the `State` (state.rs) and propose `Move`s (moves.rs); docs/CONTROLLER.md draws the
//! whole:
//! - `decision.rs`: the forecast before a step; after it, an overshot growth, drift, the
//!   warning, growth and its probes and holds;
//! - `reflexes.rs`: critical, emergency, past the limit, a shrink that did not lower
//!   usage, an OOM and its retry.
//!
//! This file is the one place that writes the state: it takes in what the trainer reports
//! (a reading, a forecast's outlook, an OOM), asks the rules in order, and applies their
//! moves (`Controller::apply`). No decision but an OOM takes the micro-batch below half
//! of what it was, and a pinned micro-batch is never resized except by an OOM (which
//! unpins it); the controller then only warns.
use super::decision;
pub use super::estimate::ERROR_WINDOW;
use super::eval::EvalSizer;
use super::evidence::{PendingShrink, Reading, ShrinkCheck};
use super::memory_model::MemoryModel;
pub use super::messages::{Decision, OomOutcome, ResizeReason, StepObservation, Upcoming};
use super::moves::{Judge, Move};
use super::reflexes;
pub use super::state::{ControllerConfig, ALLOCATOR_NOISE, RSS_NOISE};
use super::state::{OutsideMove, Probe, State};
use super::thresholds::{ThresholdError, Thresholds};

#[derive(Debug, Clone)]
pub struct Controller {
    state: State,
    /// Evaluation's chunk size, judged against this controller's thresholds and limit.
    eval: EvalSizer,
}

impl Controller {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit_bytes: u64,
        micro_batch: usize,
    ) -> Controller {
        Controller {
            state: State::new(cfg, thresholds, limit_bytes, micro_batch),
            eval: EvalSizer::default(),
        }
    }

    pub fn micro_batch(&self) -> usize {
        self.state.size.micro_batch
    }
    pub fn thresholds(&self) -> Thresholds {
        self.state.thresholds
    }
    pub fn limit_bytes(&self) -> u64 {
        self.state.estimate.limit_bytes()
    }
    pub fn model(&self) -> &MemoryModel {
        self.state.estimate.model()
    }
    pub fn ceiling_tokens(&self) -> Option<u64> {
        self.state.evidence.ceiling.tokens()
    }
    pub fn is_pinned(&self) -> bool {
        self.state.size.pinned
    }
    pub fn config(&self) -> &ControllerConfig {
        &self.state.cfg
    }
    pub fn baseline(&self) -> Option<u64> {
        self.state.estimate.baseline()
    }

    /// Replaces the thresholds if valid; a rejected set leaves the old ones in force.
    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        self.state.thresholds.set(t)?;
        self.state.plan.warned = false;
        Ok(())
    }

    /// Memory in use before the first step, once the model (and, if the trainer creates
    /// it up front, the optimizer state) exists. The fixed part of a step's peak is at
    /// least this (gradients and workspace come on top), so with one size measured the
    /// line through it over-predicts larger sizes: growth can go as far as that line
    /// allows instead of stalling on a proportional guess.
    pub fn set_baseline(&mut self, bytes: u64) {
        self.state.estimate.set_baseline(bytes);
    }

    /// The limit usage is measured against, when it moves during a run (the trainer passes
    /// min(configured, available) each step).
    pub fn set_limit(&mut self, bytes: u64) {
        if self.state.estimate.set_limit(bytes) {
            self.state.plan.warned = false;
        }
    }

    /// True after a shrink that did not lower usage, until usage falls under target.
    pub fn is_unresponsive(&self) -> bool {
        self.state.evidence.shrink.is_unresponsive()
    }

    /// Predicted peak bytes of `micro_batch` sequences of `seq_len`.
    pub fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        self.state.estimate.predicted_bytes(micro_batch, seq_len)
    }

    /// Predicted usage (fraction of the limit) of `micro_batch` sequences of `seq_len`.
    pub fn predicted_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        self.state.predicted_usage(micro_batch, seq_len)
    }

    /// The share of the limit kept free below target for the model's own error.
    pub fn margin(&self) -> f64 {
        self.state.margin()
    }

    /// Pins the micro-batch to `n` (clamped to the allowed range); the controller then
    /// only warns.
    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        let to = n.clamp(self.state.floor(), self.state.cap());
        self.state.size.pinned = true;
        let mut out = Vec::new();
        self.apply(
            Move::Resize {
                to,
                reason: ResizeReason::Pinned,
                usage: 0.0,
                predict_at: None,
            },
            &mut out,
        );
        out
    }

    pub fn unpin(&mut self) {
        self.state.size.pinned = false;
        self.state.size.steps_at_size = 0;
    }

    /// The forecast for the next step, whose sequences are `seq_len` long: shrinks (or,
    /// pinned, warns) when it is predicted above warning. Plans growth for the configured
    /// longest length.
    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        self.forecast(seq_len, None)
    }

    /// As [`before_step`](Self::before_step), told the longest sequence within the
    /// trainer's horizon of upcoming steps: growth is planned for what is actually coming,
    /// and the micro-batch shrinks before a longer length arrives rather than when it
    /// does.
    pub fn before_step_ahead(&mut self, seq_len: usize, upcoming: Upcoming) -> Vec<Decision> {
        self.forecast(seq_len, Some(upcoming))
    }

    /// Feeds one successful step's measurement; returns what to change.
    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        let mut out = Vec::new();
        let r = self.read(obs, &mut out);
        let reflex = reflexes::after_reading(&self.state, &r);
        let settled = reflex.settles;
        self.apply_all(reflex.moves, &mut out);
        if !settled {
            self.decide(&r, &mut out);
        }
        out
    }

    /// A step at `micro_batch` × `seq_len` ran out of memory: learn the ceiling, free the
    /// cache, and pick the size to retry the same samples with.
    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        let mut decisions = Vec::new();
        self.apply_all(
            reflexes::on_oom(&self.state, micro_batch, seq_len),
            &mut decisions,
        );
        if self.state.oom.retrying.is_some() {
            return OomOutcome {
                decisions,
                retry_with: Some(micro_batch),
            };
        }
        if micro_batch <= self.state.floor() {
            let again = self.state.oom.at_min(self.state.cfg.max_ooms_at_min);
            return OomOutcome {
                decisions,
                retry_with: again.then_some(micro_batch),
            };
        }
        let retry = reflexes::retry_size(&self.state, micro_batch, seq_len);
        self.apply(retry, &mut decisions);
        OomOutcome {
            decisions,
            retry_with: Some(self.state.size.micro_batch),
        }
    }

    /// Evaluation's chunks are planned under target less the margin, as the steps are.
    fn eval_room(&self) -> u64 {
        let fraction = (self.state.thresholds.target - self.margin()).max(0.05);
        (fraction * self.limit_bytes() as f64) as u64
    }

    /// The chunk size for an evaluation batch of `asked` samples of `seq_len` tokens
    /// (policy/eval.rs), with the decision when it changed from the last such batch.
    pub fn eval_size(&mut self, asked: usize, seq_len: usize) -> (usize, Vec<Decision>) {
        let room = self.eval_room();
        let (size, decision) = self.eval.size_for(asked, seq_len, room, self.limit_bytes());
        (size, decision.into_iter().collect())
    }

    /// An evaluation chunk of `size` samples peaked at `peak_bytes`.
    pub fn eval_measured(&mut self, size: usize, seq_len: usize, peak_bytes: u64) {
        let usage = peak_bytes as f64 / self.limit_bytes().max(1) as f64;
        let critical = usage >= self.state.thresholds.critical;
        self.eval.measured(size, seq_len, peak_bytes, critical);
    }

    /// An evaluation chunk of `size` ran out of memory: the size to retry the same samples
    /// with (`None`: one sample does not fit) and the decision saying so.
    pub fn eval_oom(&mut self, size: usize, seq_len: usize) -> (Option<usize>, Decision) {
        let room = self.eval_room();
        self.eval.oom(size, seq_len, room)
    }

    /// Before a step: the horizon takes in what is coming, then the forecast's rules.
    fn forecast(&mut self, seq_len: usize, upcoming: Option<Upcoming>) -> Vec<Decision> {
        let mut out = Vec::new();
        let outlook = self.state.horizon.look_ahead(seq_len, upcoming);
        let moves = decision::forecast(&self.state, seq_len, outlook);
        self.apply_all(moves, &mut out);
        out
    }

    /// Takes in one step's reading: what it judges (a shrink, a growth), what it adds to
    /// the estimate, and the bookkeeping of sizes, ceilings and lengths.
    fn read(&mut self, obs: StepObservation, out: &mut Vec<Decision>) -> Reading {
        let s = &mut self.state;
        let usage = obs.peak_bytes as f64 / s.estimate.limit_bytes() as f64;
        let first = !s.evidence.seen_first;
        s.evidence.seen_first = true;
        s.horizon.ran(obs.step, obs.seq_len);
        s.oom.read();
        let current = obs.micro_batch == s.size.micro_batch;
        let risk_probed = s.plan.probe.read(current);
        // Before the reading joins the fit: a move of the fixed part it does not see keeps
        // it out (the fit is the moved one), and an undone move moves every reading.
        let moves = reflexes::outside_judged(&self.state, obs, usage);
        self.apply_all(moves, out);
        let s = &mut self.state;
        let outside_unjudged = matches!(s.oom.outside, OutsideMove::Pending { .. });
        if usage < s.thresholds.target {
            s.evidence.shrink.under_target();
        }
        let mut after_first_shrink = false;
        if current {
            if let Some(p) = s.evidence.shrink.take() {
                after_first_shrink = p.first;
                let moves = reflexes::shrink_judged(&self.state, obs, p, usage);
                self.apply_all(moves, out);
            }
        }
        let s = &mut self.state;
        let grown_from = if current {
            s.evidence.grown_from.take()
        } else {
            None
        };
        // While usage does not follow the batch, a reading says nothing about its cost.
        let trusted = !first && !s.evidence.shrink.is_unresponsive() && !outside_unjudged;
        s.estimate.take(obs, trusted);
        if current && !first {
            s.size.steps_at_size = s.size.steps_at_size.saturating_add(1);
        }
        s.oom.ran(
            s.size.micro_batch,
            s.size.steps_at_size,
            reflexes::SETTLED_STEPS,
        );
        let (cap, plan) = (s.cap(), s.horizon.plan_seq(obs.seq_len));
        let max_tokens = move || (cap * plan) as u64;
        let raised = s
            .evidence
            .ceiling
            .clean_step(s.cfg.forget_every, max_tokens);
        // A limit the errors taught is as old as their ceiling: forgotten with it.
        if raised.is_some() && s.estimate.limit_has_fallen() && s.estimate.forget_fallen_limit() {
            s.plan.warned = false;
        }
        out.extend(raised);
        let seq = s.horizon.plan_seq(obs.seq_len);
        if s.estimate.longest_measured() >= seq {
            // The length the size was shrunk for has run: readings check it now.
            s.plan.regrowth.shrunk_ahead = false;
        }
        Reading {
            obs,
            tokens: (obs.micro_batch * obs.seq_len) as u64,
            usage,
            first,
            current,
            risk_probed,
            after_first_shrink,
            grown_from,
            seq,
        }
    }

    /// The rules after a reading no reflex settled, in order; the first to act settles it.
    fn decide(&mut self, r: &Reading, out: &mut Vec<Decision>) {
        let t = self.state.thresholds;
        let usage = r.usage;
        let streak = &mut self.state.evidence.over_target;
        *streak = if usage > t.target && r.current {
            *streak + 1
        } else {
            0
        };
        if let Some(moves) = decision::overshot(&self.state, r) {
            return self.apply_all(moves, out);
        }
        if usage > t.target && usage <= t.warning {
            let drift = decision::drift(&self.state, r);
            let settled = drift.settles;
            self.apply_all(drift.moves, out);
            if settled {
                return;
            }
        }
        let s = &self.state;
        let moves = if usage > t.warning {
            decision::warn_once(s, r.obs.step, usage)
                .into_iter()
                .collect()
        } else if usage < t.target && s.may_resize() && s.size.steps_at_size >= s.cfg.patience {
            decision::grow(s, r.obs, usage, r.seq)
        } else {
            Vec::new()
        };
        self.apply_all(moves, out);
    }

    fn apply_all(&mut self, moves: Vec<Move>, out: &mut Vec<Decision>) {
        for m in moves {
            self.apply(m, out);
        }
    }

    /// Applies one move: the only writes of the controller's state that a rule asks for,
    /// and the decisions they make.
    fn apply(&mut self, m: Move, out: &mut Vec<Decision>) {
        let s = &mut self.state;
        match m {
            Move::Resize {
                to,
                reason,
                usage,
                predict_at,
            } => out.extend(self.resize(to, reason, usage, predict_at)),
            Move::Shrink {
                to,
                reason,
                usage,
                seq_len,
                first,
                judge,
                predict_at,
            } => {
                // At most to half, at least by one.
                let from = s.size.micro_batch;
                let to = to.clamp(s.half_of(from), from.saturating_sub(1).max(1));
                let Some(d) = self.resize(to, reason, usage, predict_at) else {
                    return;
                };
                out.push(d);
                let s = &mut self.state;
                let p = PendingShrink {
                    from,
                    before: usage,
                    seq_len,
                    guessed: !s.estimate.is_fitted(),
                    first,
                };
                match judge {
                    Judge::Next => s.evidence.shrink.expect(Some(p)),
                    Judge::Fitted => s.evidence.shrink.expect(Some(PendingShrink {
                        guessed: false,
                        ..p
                    })),
                    Judge::Ahead => {
                        s.evidence.shrink = ShrinkCheck::Clear;
                        s.plan.regrowth.shrunk_ahead = true;
                    }
                }
            }
            Move::Probe { to, usage, kind } => {
                s.plan.probe.risk_spent |= kind == Probe::Risk;
                out.extend(self.resize(to, ResizeReason::Grow, usage, None));
                self.state.plan.probe.in_flight = Some(kind);
            }
            Move::Expect(p) => s.evidence.shrink.expect(p),
            Move::LearnCeiling {
                micro_batch,
                tokens,
                seq_len,
                usage,
            } => {
                let longest = s.horizon.plan_seq(seq_len).max(s.cfg.max_seq_len);
                let one = (s.floor() * longest) as u64 + 1;
                out.extend(s.evidence.ceiling.learn(micro_batch, tokens, one, usage));
            }
            Move::EmptyCache { usage } => out.push(Decision::EmptyCache { usage }),
            Move::Warn {
                usage,
                forecast,
                text,
                once,
            } => {
                s.plan.warned |= once;
                out.push(Decision::Warning {
                    usage,
                    forecast,
                    text,
                });
            }
            Move::Hold {
                why,
                at,
                step,
                usage,
                text,
            } => {
                s.plan.say_held(why, at, step);
                out.push(Decision::Warning {
                    usage,
                    forecast: true,
                    text,
                });
            }
            Move::ForgetReadings => s.estimate.forget(),
            Move::StreakIsNoise => s.evidence.over_target = 0,
            Move::RoomReadings(n) => s.plan.regrowth.room_readings = n,
            Move::HeldApart => {
                s.evidence.shrink = ShrinkCheck::Unresponsive;
                s.size.shrunk_to_fit = false;
                s.estimate.forget();
            }
            Move::OomSeen => {
                s.size.pinned = false;
                s.evidence.shrink.expect(None);
                s.evidence.grown_from = None;
            }
            Move::RetrySame {
                micro_batch,
                seq_len,
            } => s.oom.retrying = Some((micro_batch, seq_len)),
            Move::OutsideGrew { bytes } => {
                s.estimate.shift(bytes);
                s.oom.outside = OutsideMove::Pending { bytes, unseen: 0 };
            }
            Move::OutsideSeen => s.oom.outside = OutsideMove::Clear,
            Move::OutsideUnseen => {
                if let OutsideMove::Pending { unseen, .. } = &mut s.oom.outside {
                    *unseen += 1;
                }
            }
            Move::OutsideBack { bytes } => {
                s.estimate.shift(-bytes);
                s.oom.outside = OutsideMove::Undone {
                    at: s.size.micro_batch,
                };
            }
            Move::LimitFell { bytes } => {
                s.oom.outside = OutsideMove::LimitFell;
                if s.estimate.limit_fell(bytes) {
                    s.plan.warned = false;
                }
            }
            Move::OomAt { micro_batch } => {
                s.oom.retrying = None;
                s.evidence.shrink.under_target();
                s.size.micro_batch = micro_batch;
            }
        }
    }

    /// Any change of size: the size's own record starts again, and so do the streak, the
    /// warning and a probe; a growth's first reading judges it.
    fn resize(
        &mut self,
        to: usize,
        reason: ResizeReason,
        usage: f64,
        predict_at: Option<usize>,
    ) -> Option<Decision> {
        let s = &mut self.state;
        let to = to.clamp(s.floor(), s.cap());
        if to == s.size.micro_batch {
            return None;
        }
        let from = s.size.micro_batch;
        s.size.micro_batch = to;
        s.size.steps_at_size = 0;
        s.size.shrunk_to_fit =
            to < from && !matches!(reason, ResizeReason::Oom | ResizeReason::Emergency);
        s.evidence.over_target = 0;
        s.evidence.shrink.resized(to > from);
        s.evidence.grown_from = (to > from && reason == ResizeReason::Grow).then_some(from);
        s.plan.warned = false;
        s.plan.probe.resized();
        let seq = predict_at.unwrap_or_else(|| s.horizon.plan_seq(0));
        Some(Decision::Resize {
            from,
            to,
            reason,
            usage,
            predicted: s.predicted_usage(to, seq),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u64 = 1 << 30;

    fn at(step: u64, micro_batch: usize, usage: f64) -> StepObservation {
        StepObservation {
            step,
            micro_batch,
            seq_len: 64,
            peak_bytes: (usage * LIMIT as f64) as u64,
        }
    }

    /// Between target and warning nothing moves until the streak is drift; one reading
    /// under target after a streak starts it again.
    #[test]
    fn between_target_and_warning_only_a_streak_acts() {
        let cfg = ControllerConfig {
            max_micro_batch: 64,
            ..Default::default()
        };
        let mut c = Controller::new(cfg, Thresholds::default(), LIMIT, 10);
        let mut acted = Vec::new();
        for (step, usage) in [
            (1, 0.5),
            (2, 0.91),
            (3, 0.91),
            (4, 0.89),
            (5, 0.91),
            (6, 0.91),
        ] {
            acted.extend(c.observe(at(step, 10, usage)));
        }
        assert!(acted.is_empty(), "{acted:?}");
        acted.extend(c.observe(at(7, 10, 0.91)));
        assert!(
            matches!(acted[..], [Decision::EmptyCache { .. }]),
            "{acted:?}"
        );
    }

    /// With one size measured and no baseline, the worst case of the fixed part (all of
    /// the reading) decides: one sequence more if it stays under critical, else the one
    /// risky probe per run, then a hold said once.
    #[test]
    fn one_size_probes_once_past_its_worst_case_then_says_why_it_holds() {
        let cfg = ControllerConfig {
            max_micro_batch: 64,
            max_seq_len: 64,
            ..Default::default()
        };
        let mut c = Controller::new(cfg, Thresholds::default(), LIMIT, 1);
        c.observe(at(1, 1, 0.5));
        // 1 → 2 at 0.8 each would be 160%: not even the worst case under critical.
        let ds = c.observe(at(2, 1, 0.8));
        assert!(
            matches!(ds[..], [Decision::Resize { from: 1, to: 2, .. }]),
            "{ds:?}"
        );
        assert!(c.state.plan.probe.is_risk() && c.state.plan.probe.risk_spent);
        // The probe reads critical: back by one, and never again.
        let ds = c.observe(at(3, 2, 0.96));
        assert!(
            ds.iter()
                .any(|d| matches!(d, Decision::Resize { to: 1, .. })),
            "{ds:?}"
        );
        let mut said = 0;
        for step in 4..10 {
            let ds = c.observe(at(step, 1, 0.8));
            assert!(
                ds.iter().all(|d| !matches!(d, Decision::Resize { .. })),
                "{ds:?}"
            );
            said += ds.len();
        }
        assert!(said <= 1, "the hold said once");
    }
}
