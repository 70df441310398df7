//! What to do: grow, hold, shrink or free the cache, planned under target less the
//! estimate's margin for the length the horizon plans for, under the learned ceiling.
//!
//! Before each step the next batch is forecast: above warning it shrinks to fit before it
//! runs, and a longer length within the horizon predicted above warning (the longest the
//! run feeds: above target) shrinks the micro-batch before it arrives. After each step,
//! once no reflex acted:
//! - the first reading after a growth over target: the growth overshot; back to the fit
//!   (not below where it came from) with a ceiling at the overshot size;
//! - usage above target (up to warning) for 3 steps in a row at one size, beyond the
//!   size's own scatter: free the cache; 3 more: shed the excess and set a ceiling;
//! - usage above warning: warn once (growth stops);
//! - usage under target, `patience` steps measured at this size: grow to the fit (at most
//!   ×`max_growth` once fitted), only when the gain is worth it. Between target and
//!   critical nothing moves, so a steady state never oscillates.
//!
//! While the estimate rests on one size it cannot tell the fixed part: growth takes any
//! gain, then one sequence more if even the worst case stays under critical, then one
//! such probe per run past it; else it says once why it holds. When a longer length is
//! coming, growth waits for it and says so once per size.
use super::controller::Controller;
use super::estimate::MIN_MARGIN;
use super::evidence::{over_target_bound, Reading, OVER_TARGET_STEPS};
use super::horizon::Outlook;
use super::{Decision, ResizeReason, StepObservation, Upcoming};

/// The least gain worth a growth once the fit rests on three sizes or more.
const SETTLED_GAIN: f64 = 0.1;
/// How far (share of the limit) under target less the margin the model must predict the
/// planned length before a size shrunk for it grows back while that length has not been
/// measured: less is within what the extrapolation moves by as readings at longer lengths
/// come in, and growing on it would shrink again as the lengths keep rising.
const REGROW_ROOM: f64 = 0.05;
/// Steps before a longer length arrives within which the controller makes room for it
/// even on a bound (see `make_room_ahead`).
const YOUNG_LEAD: u64 = 3;

/// A growth by one sequence past what the estimate can promise, until its first reading:
/// the forecast (that same worst case) must not take it back before it runs, or the run
/// grows and shrinks by one every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The worst case of the fixed part stays under critical.
    OneMore,
    /// The worst case reaches critical, but the step ran well under target: tried once
    /// per run, and undone by one if it reads critical or fails.
    Risk,
}

/// The probes: the one in force, and whether the risky one was spent.
#[derive(Debug, Clone, Default)]
pub struct Probes {
    in_flight: Option<Probe>,
    risk_spent: bool,
}

impl Probes {
    /// A reading came; `current`: at the probed size. True on the risky probe's first.
    pub fn read(&mut self, current: bool) -> bool {
        let risk = self.in_flight == Some(Probe::Risk) && current;
        if current {
            self.in_flight = None;
        }
        risk
    }
    pub fn resized(&mut self) {
        self.in_flight = None;
    }
    pub fn is_risk(&self) -> bool {
        self.in_flight == Some(Probe::Risk)
    }
}

/// Why growth holds, said once per size held at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// With one size measured the fixed part is not known (said once per run).
    FixedPartUnknown,
    /// A longer length is coming.
    LongerLength,
}

/// Growth held for a size shrunk ahead of a longer length.
#[derive(Debug, Clone, Default)]
pub struct Regrowth {
    /// The micro-batch shrank to make room for a length not yet measured: growth waits
    /// until that length has run, unless the model shows plain room ([`REGROW_ROOM`]).
    pub shrunk_ahead: bool,
    /// Consecutive readings after which the model showed plain room at the planned length
    /// (one reading moves a young fit by that much).
    room_readings: u32,
}

/// What the decisions remember: what was said, and what growth waits for.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The warning above warning was given at this size.
    pub warned: bool,
    /// Why growth holds, said at which size. Not once per length: on a ramp the longest
    /// length in view grows every step, and a line per step would bury everything else.
    held: Option<(HoldReason, usize)>,
    /// The step whose reading said why growth holds: no growth at it or the next.
    held_at: Option<u64>,
    pub regrowth: Regrowth,
    pub probe: Probes,
}

impl Plan {
    fn say_held(&mut self, why: HoldReason, size: usize, step: u64) {
        self.held = Some((why, size));
        self.held_at = Some(step);
    }
}

/// What growth could do from the size in force.
struct Growth {
    /// The model's largest size under target less the margin.
    fit: usize,
    /// The most one growth may reach (factor, cap, ceiling).
    limit: usize,
    /// Where it would go.
    cand: usize,
    /// Growth waits (a length shrunk for has not run, or a hold was just said).
    waits: bool,
    /// The least growth worth an adjustment.
    gain: usize,
}

impl Controller {
    pub(super) fn forecast(&mut self, seq_len: usize, upcoming: Option<Upcoming>) -> Vec<Decision> {
        let mut out = Vec::new();
        let outlook = self.horizon.look_ahead(seq_len, upcoming);
        let mb = self.size.micro_batch;
        let Some(pred) = self.estimate.forecast_usage(mb, seq_len) else {
            return out;
        };
        // A shrink made on the latest reading is judged by the next one: shrinking again
        // before it, on the model fitted through that same reading, doubles the step down
        // on one number (a held high-water mark took 50 → 25 → 13 of a feasible 100).
        let judging = self
            .evidence
            .shrink
            .pending()
            .is_some_and(|p| seq_len <= p.seq_len);
        let probing = self.plan.probe.in_flight.is_some();
        let may_resize = self.may_resize()
            && !self.evidence.shrink.is_unresponsive()
            && !judging
            && (!probing || (pred >= self.thresholds.critical && !self.plan.probe.is_risk()));
        if pred > self.thresholds.warning {
            self.forecast_over_warning(seq_len, pred, outlook, may_resize, &mut out);
            return out;
        }
        if may_resize {
            out.extend(self.make_room_ahead(seq_len, outlook));
        }
        out
    }

    /// The next batch is forecast over warning: say so, and shrink to fit before it runs.
    fn forecast_over_warning(
        &mut self,
        seq_len: usize,
        pred: f64,
        outlook: Outlook,
        may_resize: bool,
        out: &mut Vec<Decision>,
    ) {
        out.push(Decision::Warning {
            usage: pred,
            forecast: true,
            text: format!(
                "the next batch ({} × {seq_len} tokens) is forecast at {:.0}% of the limit, above warning {:.0}%",
                self.size.micro_batch,
                pred * 100.0,
                self.thresholds.warning * 100.0
            ),
        });
        if !may_resize {
            return;
        }
        let fit = self.fit_target(seq_len).unwrap_or(0);
        // A length nobody announced is about to run: going there in halves would run it
        // predicted over warning. Announced lengths were made room for in halves ahead of
        // time.
        let shrunk = if outlook.unforeseen && fit >= 1 {
            let fit = self.half_of(self.size.micro_batch).min(fit);
            self.resize(fit, ResizeReason::Forecast, pred)
        } else {
            self.shrink(fit, ResizeReason::Forecast, pred, seq_len, false)
        };
        if let Some(mut d) = shrunk {
            if let Decision::Resize { to, predicted, .. } = &mut d {
                *predicted = self.predicted_usage(*to, seq_len);
            }
            out.push(d);
        }
    }

    /// A longer length to come: make room before it arrives.
    fn make_room_ahead(&mut self, seq_len: usize, outlook: Outlook) -> Option<Decision> {
        let plan = self.horizon.plan_seq(seq_len);
        let upcoming = self.horizon.upcoming()?;
        if plan <= seq_len {
            return None;
        }
        let ahead = self.predicted_usage(self.size.micro_batch, plan)?;
        // Above warning at the longest length in view: make room for it (under target less
        // the margin). The longest the run feeds, just come into view, must fit under
        // target itself: the size runs it for good, and one left between target and
        // warning would be shrunk again by the drift rule once it arrives.
        let max_seq = self.horizon.max_seq_len();
        let last = max_seq > 0 && plan >= max_seq;
        let trigger = if outlook.rising && last {
            self.thresholds.target
        } else {
            self.thresholds.warning
        };
        // Before the readings span enough lengths to fit what a token costs in a longer
        // sequence, the cost there is a bound (all of it quadratic), not an estimate: on a
        // ramp it put the size for a length 16 steps away at 70% of the limit, and the
        // next readings grew it back. Shrinking for such a length waits for the fit, or
        // until the length is near; the forecast of each step's own length keeps the
        // steps before it safe. With random lengths the longest the run feeds is planned
        // for before it is in view: not known to be near either.
        let far = if upcoming.seq_len == plan {
            upcoming.step > self.horizon.last_step() + 1 + YOUNG_LEAD
        } else {
            self.horizon.lengths_fall()
        };
        let bound_only = plan > self.estimate.longest_measured()
            && self.estimate.model().length_fit().is_none()
            && far;
        if ahead <= trigger || bound_only {
            return None;
        }
        let fit = self.fit_target(plan).unwrap_or(0);
        let mut d = self.shrink(fit, ResizeReason::Forecast, ahead, plan, false)?;
        // The next step is shorter: whether the shrink helped cannot be read from it.
        self.evidence.shrink.expect(None);
        self.plan.regrowth.shrunk_ahead = true;
        if let Decision::Resize { to, predicted, .. } = &mut d {
            *predicted = self.predicted_usage(*to, plan);
        }
        Some(d)
    }

    /// The rules after a reading no reflex acted on.
    pub(super) fn decide(&mut self, r: &Reading, out: &mut Vec<Decision>) {
        let t = self.thresholds;
        let usage = r.usage;
        if usage > t.target && r.current {
            self.evidence.over_target += 1;
        } else {
            self.evidence.over_target = 0;
        }
        if let Some(from) = r.grown_from {
            // Readings scatter by about MIN_MARGIN around the batch's own peak: one just
            // over target is as likely a size that fits on a high reading (and the drift
            // rule still sees it if it persists). Shrinking on it cost a fourth adjustment
            // and, once settled, undid a growth to the feasible size.
            if usage > t.target + MIN_MARGIN && usage < t.critical && self.may_resize() && !r.first
            {
                self.overshot(r, from, out);
                return;
            }
        }
        let over = usage > t.target && usage <= t.warning;
        if over && self.drift(r, out) {
            return;
        }
        if usage > t.warning {
            out.extend(self.warn_once(r.obs.step, usage));
            return;
        }
        if usage < t.target && self.may_resize() && self.size.steps_at_size >= self.cfg.patience {
            out.extend(self.grow(r.obs, usage, r.seq));
        }
    }

    /// The first reading after a growth landed over target: the growth overshot. Back to
    /// the fit, which now includes the reading that shows it (not below where it came
    /// from), with a ceiling at the overshot size, at once rather than after the drift
    /// rule's six steps.
    fn overshot(&mut self, r: &Reading, from: usize, out: &mut Vec<Decision>) {
        let fit = self.fit_target(r.seq).unwrap_or(from);
        out.extend(self.learn_ceiling(r.obs.micro_batch, r.tokens, r.obs.seq_len, r.usage));
        out.extend(self.shrink(
            fit.max(from),
            ResizeReason::OverTarget,
            r.usage,
            r.obs.seq_len,
            r.first,
        ));
    }

    /// Usage between target and warning: three readings in a row free the cache, three
    /// more shed the excess at the fitted cost per token, set a ceiling and forget the old
    /// readings (the footprint drifted rather than spiked). True when it acted.
    fn drift(&mut self, r: &Reading, out: &mut Vec<Decision>) -> bool {
        let streak = self.evidence.over_target as usize;
        let target = self.thresholds.target;
        if self
            .estimate
            .within_own_noise(r.tokens, r.obs.seq_len, streak, target)
        {
            // A settled size whose readings scatter about target: the streak over it is
            // that scatter, not drift. Shrinking on it undid a landing at the feasible size
            // a hundred steps later.
            self.evidence.over_target = 0;
        }
        if !self.may_resize() || self.evidence.shrink.is_unresponsive() {
            return false;
        }
        if self.evidence.over_target == OVER_TARGET_STEPS {
            // The allocator's cache may be what grew: free it before giving up samples.
            out.push(Decision::EmptyCache { usage: r.usage });
            return true;
        }
        if self.evidence.over_target < 2 * OVER_TARGET_STEPS {
            return false;
        }
        // The fit still describes the old footprint: shed the excess at the fitted cost
        // per token, then forget the old readings so growth is planned from the new
        // footprint only (else it would grow straight back).
        let goal = (target - self.margin()) * self.estimate.limit_bytes() as f64;
        let excess = r.obs.peak_bytes as f64 - goal;
        let seq = r.seq;
        let to = match self.estimate.cost_at(seq, false) {
            Some((_, per)) if per > 0.0 => {
                let shed = (excess / (per * seq as f64)).ceil().max(1.0) as usize;
                self.size.micro_batch.saturating_sub(shed)
            }
            _ => self.size.micro_batch * 9 / 10,
        };
        // As at critical: this many tokens stay above target whatever the fit says.
        let bound = over_target_bound(r.tokens, target, r.usage);
        out.extend(self.learn_ceiling(r.obs.micro_batch, bound.max(1), r.obs.seq_len, r.usage));
        self.estimate.forget();
        out.extend(self.shrink(
            to,
            ResizeReason::OverTarget,
            r.usage,
            r.obs.seq_len,
            r.first,
        ));
        if let Some(mut p) = self.evidence.shrink.pending() {
            // Planned on the fitted cost, before the readings were forgotten.
            p.guessed = false;
            self.evidence.shrink.expect(Some(p));
        }
        true
    }

    /// Usage above warning: said once per size (growth stops).
    fn warn_once(&mut self, step: u64, usage: f64) -> Option<Decision> {
        if self.plan.warned || self.evidence.shrink.is_unresponsive() {
            return None;
        }
        self.plan.warned = true;
        let what = if self.size.pinned {
            "the micro-batch is pinned; unpin it to let headroom shrink it"
        } else if !self.cfg.adaptive {
            "adaptation is off (memory.adaptive = false)"
        } else {
            "growth stops"
        };
        Some(Decision::Warning {
            usage,
            forecast: false,
            text: format!(
                "step {step} peaked at {:.0}% of the limit, above warning {:.0}%; {what}",
                usage * 100.0,
                self.thresholds.warning * 100.0
            ),
        })
    }

    /// Growth from a step under target, planned for sequences of `seq`.
    fn grow(&mut self, obs: StepObservation, usage: f64, seq: usize) -> Vec<Decision> {
        let mut out = Vec::new();
        let Some(g) = self.growth(obs, seq) else {
            return out;
        };
        let mb = self.size.micro_batch;
        let fitted = self.estimate.is_fitted();
        let margin = self.margin();
        let target = self.thresholds.target;
        // Room to spare: more than noise and the margin away from target.
        let room = usage < target - margin - 2.0 * MIN_MARGIN;
        let learning = !fitted && room && !self.size.shrunk_to_fit;
        // Nor, on a settled fit, is a growth whose predicted rise in usage is within what
        // readings scatter by (both ends of the noise): it cannot be told from noise, may
        // land over target and be undone. With a large fixed part a tenth more sequences
        // is that little memory, and the margin's decay (the young fit's errors leaving
        // the window) made such a growth, 20 steps after the run had settled near target,
        // a fourth adjustment. A growth that lands well under target cannot be undone by
        // noise, however little usage it adds: on a large limit (host memory, a tiny
        // model) every growth is "within noise" of the limit, and the rule had frozen such
        // runs at micro-batch 1.
        let (rise, lands_clear) = match (
            self.predicted_usage(g.cand, seq),
            self.predicted_usage(mb, seq),
        ) {
            (Some(to), Some(now)) => (to - now, to < target - margin - 2.0 * MIN_MARGIN),
            _ => (f64::INFINITY, false),
        };
        // Only at a length measured: beyond it the cost is a bound (all attention), whose
        // small steps are how a ramp learns the curve.
        let worth = g.cand >= mb + g.gain
            && (self.estimate.distinct_sizes() < 3
                || seq > self.estimate.longest_measured()
                || rise >= 2.0 * MIN_MARGIN
                || lands_clear);
        if worth || (learning && g.cand > mb) {
            // Unfitted, any gain is worth it: a second size is what separates the fixed
            // part from the per-token cost.
            out.extend(self.resize(g.cand, ResizeReason::Grow, usage));
            return out;
        }
        if learning && g.limit > mb && !g.waits {
            out.extend(self.probe(obs, usage, seq, g.limit));
            return out;
        }
        // Holding for a longer length still to come: say so once.
        if seq > obs.seq_len && g.cand < mb + g.gain {
            out.extend(self.say_held_for_length(obs, usage, seq, &g));
        }
        out
    }

    /// Where growth could go from the size in force, and whether it waits.
    fn growth(&mut self, obs: StepObservation, seq: usize) -> Option<Growth> {
        let target = self.thresholds.target;
        // While longer lengths keep coming into view, growth keeps the same room as a
        // shrink for them does (else the next one takes it back).
        let fit = self.estimate.fit_under(target - self.margin(), seq, true)?;
        let mb = self.size.micro_batch;
        let fitted = self.estimate.is_fitted();
        let max_growth = self.cfg.max_growth;
        let factor = if fitted && self.estimate.noise_bound() {
            // Sizes too close to tell their cost from noise: growth follows the steepest
            // line within the noise, a bound from above, not the fit.
            max_growth * max_growth
        } else if fitted {
            max_growth
        } else if self.estimate.baseline().is_some() {
            // The line through the baseline over-predicts every larger size.
            max_growth * max_growth
        } else {
            self.cfg.probe_growth
        };
        let bound =
            ((mb as f64 * factor).min(usize::MAX as f64 / 2.0).floor() as usize).max(mb + 1);
        let limit = bound
            .min(self.cap())
            .min(self.evidence.ceiling.batch(seq, self.floor()));
        // Shrunk for a length that has not run yet: the model's cost there is an
        // extrapolation that moves as readings at longer lengths come in. Growing back on
        // such a move while the lengths keep rising only shrinks again a few steps later:
        // wait for the length to run, unless the model shows plain room. And a size said
        // to hold holds at least until the next reading.
        let plain = self
            .predicted_usage(mb, seq)
            .is_some_and(|u| u < target - self.margin() - REGROW_ROOM);
        let rg = &mut self.plan.regrowth;
        rg.room_readings = if plain { rg.room_readings + 1 } else { 0 };
        let waits =
            (rg.shrunk_ahead && seq > self.estimate.longest_measured() && rg.room_readings < 2)
                || self.plan.held_at.is_some_and(|h| obs.step <= h + 1);
        let cand = if waits {
            fit.min(limit).min(mb)
        } else {
            fit.min(limit)
        };
        // Once the fit has been checked against a third size, the last few percent are
        // not worth another adjustment (they are within the fit's own error).
        let min_gain = if self.estimate.distinct_sizes() >= 3 {
            self.cfg.min_gain.max(SETTLED_GAIN)
        } else {
            self.cfg.min_gain
        };
        let gain = (mb as f64 * min_gain).ceil().max(1.0) as usize;
        Some(Growth {
            fit,
            limit,
            cand,
            waits,
            gain,
        })
    }

    /// Not even one more sequence is predicted under target, but the prediction assumes
    /// the worst of the fixed part: probe one more if even that worst case stays under
    /// critical; else once per run all the same; else say why growth holds.
    fn probe(
        &mut self,
        obs: StepObservation,
        usage: f64,
        seq: usize,
        limit: usize,
    ) -> Vec<Decision> {
        let mb = self.size.micro_batch;
        let probe = (mb + 1).min(limit);
        let safe = self
            .predicted_usage(probe, seq)
            .is_some_and(|u| u < self.thresholds.critical);
        // The worst case of the fixed part says even one more could reach critical, but
        // the step runs well under target: holding there for good gives up the room the
        // issue's first failure stalled in. Probe one more, once per run (an OOM or a
        // reading over critical there is recovered and sets a ceiling). Only at the length
        // planned for: with lengths to come longer than any run, the worst case there is
        // a bound the forecast acts on, not a stall.
        let risk = !safe && !self.plan.probe.risk_spent && seq == obs.seq_len;
        if safe || risk {
            self.plan.probe.risk_spent |= risk;
            let d = self.resize(probe, ResizeReason::Grow, usage);
            self.plan.probe.in_flight = Some(if risk { Probe::Risk } else { Probe::OneMore });
            return d.into_iter().collect();
        }
        if matches!(self.plan.held, Some((HoldReason::FixedPartUnknown, _))) {
            return Vec::new();
        }
        self.plan
            .say_held(HoldReason::FixedPartUnknown, mb, obs.step);
        vec![Decision::Warning {
            usage,
            forecast: true,
            // No percentage: from one reading it would be an extrapolation (919% was
            // seen), read as a risk that was never measured.
            text: format!(
                "holding at {mb}: only one size has been measured, so how much of the \
                 memory grows with the batch is not known yet; {} × {seq} is not tried \
                 while it could pass the critical threshold{}",
                mb + 1,
                if self.estimate.baseline().is_some() {
                    ""
                } else {
                    "; a baseline measured before the first step would tell"
                }
            ),
        }]
    }

    /// Growth holds for a longer length still to come: say so once per size.
    fn say_held_for_length(
        &mut self,
        obs: StepObservation,
        usage: f64,
        seq: usize,
        g: &Growth,
    ) -> Option<Decision> {
        let mb = self.size.micro_batch;
        let now = self
            .fit_target(obs.seq_len)
            .unwrap_or(0)
            .min(g.limit.max(mb));
        if now < mb + g.gain || self.plan.held.map(|h| h.1) == Some(mb) {
            return None;
        }
        self.plan.say_held(HoldReason::LongerLength, mb, obs.step);
        let when = match self.horizon.upcoming() {
            Some(u) if u.seq_len == seq => format!("arrives by step {}", u.step),
            _ => "may come (the longest the run feeds)".to_string(),
        };
        Some(Decision::Warning {
            usage: self.predicted_usage(mb, seq).unwrap_or(usage),
            forecast: true,
            text: if g.fit.min(g.limit) > mb {
                format!(
                    "holding at {mb}: length {seq} {when} and has not run yet; {now} \
                     would fit length {} now",
                    obs.seq_len
                )
            } else {
                format!(
                    "holding at {mb}: length {seq} {when} and {} × {seq} is the most \
                     that fits; {now} would fit length {} now",
                    g.fit.max(mb).min(g.limit.max(mb)),
                    obs.seq_len
                )
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{ControllerConfig, Thresholds};

    const LIMIT: u64 = 1 << 30;

    fn at(step: u64, micro_batch: usize, usage: f64) -> StepObservation {
        StepObservation {
            step,
            micro_batch,
            seq_len: 64,
            peak_bytes: (usage * LIMIT as f64) as u64,
        }
    }

    #[test]
    fn a_probe_ends_with_its_first_reading_and_the_risky_one_says_so() {
        let mut p = Probes {
            in_flight: Some(Probe::Risk),
            ..Default::default()
        };
        assert!(!p.read(false), "a reading at another size");
        assert!(p.is_risk());
        assert!(p.read(true));
        assert!(!p.is_risk() && !p.read(true));
        p.in_flight = Some(Probe::OneMore);
        p.resized();
        assert_eq!(p.in_flight, None);
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
        assert!(c.plan.probe.is_risk() && c.plan.probe.risk_spent);
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
