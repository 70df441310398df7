//! What to do: grow, hold, shrink or free the cache, planned under target less the
//! estimate's margin for the length the horizon plans for, under the learned ceiling.
//! Each rule reads the [`State`] and returns the [`Move`]s it proposes; the controller
//! applies them.
//!
//! Before each step the next batch is forecast ([`forecast`]): above warning it shrinks
//! to fit before it runs, and a longer length within the horizon predicted above warning
//! (the longest the run feeds: above target) shrinks the micro-batch before it arrives.
//! After each step, once no reflex acted:
//! - [`overshot`]: the first reading after a growth over target: the growth overshot;
//!   back to the fit (not below where it came from) with a ceiling at the overshot size;
//! - [`drift`]: usage above target (up to warning) for 3 steps in a row at one size,
//!   beyond the size's own scatter: free the cache; 3 more: shed the excess and set a
//!   ceiling;
//! - [`warn_once`]: usage above warning: warn once (growth stops);
//! - [`grow`]: usage under target, `patience` steps measured at this size: grow to the fit
//!   (at most ×`max_growth` once fitted), only when the gain is worth it. Between target
//!   and critical nothing moves, so a steady state never oscillates.
//!
//! While the estimate rests on one size it cannot tell the fixed part: growth takes any
//! gain, then one sequence more if even the worst case stays under critical, then one
//! such probe per run past it; else it says once why it holds. When a longer length is
//! coming, growth waits for it and says so once per size.
use super::estimate::MIN_MARGIN;
use super::evidence::{over_target_bound, Reading, OVER_TARGET_STEPS};
use super::horizon::Outlook;
use super::messages::{ResizeReason, StepObservation};
use super::moves::{Judge, Move, Proposal};
use super::state::{HoldReason, OutsideMove, Probe, State};

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
    /// Readings in a row that showed plain room at the planned length, this one counted.
    room_readings: u32,
}

/// The forecast for a step of `seq_len`, whose outlook the horizon has just taken in.
pub(super) fn forecast(s: &State, seq_len: usize, outlook: Outlook) -> Vec<Move> {
    let Some(pred) = s.estimate.forecast_usage(s.size.micro_batch, seq_len) else {
        return Vec::new();
    };
    // A shrink made on the latest reading is judged by the next one: shrinking again
    // before it, on the model fitted through that same reading, would step down twice on
    // one number.
    let judging = s
        .evidence
        .shrink
        .pending()
        .is_some_and(|p| seq_len <= p.seq_len);
    let probing = s.plan.probe.in_flight.is_some();
    let may_resize = s.may_resize()
        && !s.evidence.shrink.is_unresponsive()
        && !judging
        && (!probing || (pred >= s.thresholds.critical && !s.plan.probe.is_risk()));
    if pred > s.thresholds.warning {
        return forecast_over_warning(s, seq_len, pred, outlook, may_resize);
    }
    if !may_resize {
        return Vec::new();
    }
    make_room_ahead(s, seq_len, outlook).into_iter().collect()
}

/// The next batch is forecast over warning: say so, and shrink to fit before it runs.
fn forecast_over_warning(
    s: &State,
    seq_len: usize,
    pred: f64,
    outlook: Outlook,
    may_resize: bool,
) -> Vec<Move> {
    let mut moves = vec![Move::Warn {
        usage: pred,
        forecast: true,
        text: format!(
            "the next batch ({} × {seq_len} tokens) is forecast at {:.0}% of the limit, above warning {:.0}%",
            s.size.micro_batch,
            pred * 100.0,
            s.thresholds.warning * 100.0
        ),
        once: false,
    }];
    if !may_resize {
        return moves;
    }
    let fit = s.fit_target(seq_len).unwrap_or(0);
    // A length nobody announced is about to run: going there in halves would run it
    // predicted over warning. Announced lengths were made room for in halves ahead of
    // time.
    moves.push(if outlook.unforeseen && fit >= 1 {
        Move::Resize {
            to: s.half_of(s.size.micro_batch).min(fit),
            reason: ResizeReason::Forecast,
            usage: pred,
            predict_at: Some(seq_len),
        }
    } else {
        Move::Shrink {
            to: fit,
            reason: ResizeReason::Forecast,
            usage: pred,
            seq_len,
            first: false,
            judge: Judge::Next,
            predict_at: Some(seq_len),
        }
    });
    moves
}

/// A longer length to come: make room before it arrives.
fn make_room_ahead(s: &State, seq_len: usize, outlook: Outlook) -> Option<Move> {
    let plan = s.horizon.plan_seq(seq_len);
    let upcoming = s.horizon.upcoming()?;
    if plan <= seq_len {
        return None;
    }
    let ahead = s.predicted_usage(s.size.micro_batch, plan)?;
    // Above warning at the longest length in view: make room for it (under target less
    // the margin). The longest the run feeds, just come into view, must fit under target
    // itself: the size runs it for good, and one left between target and warning would be
    // shrunk again by the drift rule once it arrives.
    let max_seq = s.horizon.max_seq_len();
    let last = max_seq > 0 && plan >= max_seq;
    let trigger = if outlook.rising && last {
        s.thresholds.target
    } else {
        s.thresholds.warning
    };
    // Before the readings span enough lengths to fit what a token costs in a longer
    // sequence, the cost there is a bound (all of it quadratic), not an estimate: a size
    // shrunk for a length far ahead on it would grow back with the next readings.
    // Shrinking for such a length waits for the fit, or until the length is near; the
    // forecast of each step's own length keeps the steps before it safe. With random
    // lengths the longest the run feeds is planned for before it is in view: not known to
    // be near either.
    let far = if upcoming.seq_len == plan {
        upcoming.step > s.horizon.last_step() + 1 + YOUNG_LEAD
    } else {
        s.horizon.lengths_fall()
    };
    let bound_only =
        plan > s.estimate.longest_measured() && s.estimate.model().length_fit().is_none() && far;
    if ahead <= trigger || bound_only {
        return None;
    }
    Some(Move::Shrink {
        to: s.fit_target(plan).unwrap_or(0),
        reason: ResizeReason::Forecast,
        usage: ahead,
        seq_len: plan,
        first: false,
        judge: Judge::Ahead,
        predict_at: Some(plan),
    })
}

/// The first reading after a growth landed over target: the growth overshot. Back to the
/// fit, which now includes the reading that shows it (not below where it came from), with
/// a ceiling at the overshot size, at once rather than after the drift rule's six steps.
pub(super) fn overshot(s: &State, r: &Reading) -> Option<Vec<Move>> {
    let t = s.thresholds;
    let from = r.grown_from?;
    // Readings scatter by about MIN_MARGIN around the batch's own peak: one just over
    // target is as likely a size that fits on a high reading (and the drift rule still
    // sees it if it persists); shrinking on it would undo a growth to the feasible size.
    let over = r.usage > t.target + MIN_MARGIN && r.usage < t.critical;
    if !over || !s.may_resize() || r.first {
        return None;
    }
    let fit = s.fit_target(r.seq).unwrap_or(from);
    Some(vec![
        Move::LearnCeiling {
            micro_batch: r.obs.micro_batch,
            tokens: r.tokens,
            seq_len: r.obs.seq_len,
            usage: r.usage,
        },
        Move::Shrink {
            to: fit.max(from),
            reason: ResizeReason::OverTarget,
            usage: r.usage,
            seq_len: r.obs.seq_len,
            first: r.first,
            judge: Judge::Next,
            predict_at: None,
        },
    ])
}

/// Usage between target and warning: three readings in a row free the cache, three more
/// shed the excess at the fitted cost per token, set a ceiling and forget the old readings
/// (the footprint drifted rather than spiked). Settles the step when it acted.
pub(super) fn drift(s: &State, r: &Reading) -> Proposal {
    let mut streak = s.evidence.over_target;
    let target = s.thresholds.target;
    let mut moves = Vec::new();
    // Enough readings before the streak to know the size's own scatter.
    let earlier = 2 * OVER_TARGET_STEPS as usize;
    if s.estimate
        .within_own_noise(r.tokens, r.obs.seq_len, streak as usize, earlier, target)
    {
        // A settled size whose readings scatter about target: the streak over it is that
        // scatter, not drift, and shrinking on it would undo a landing at the feasible
        // size.
        moves.push(Move::StreakIsNoise);
        streak = 0;
    }
    if !s.may_resize() || s.evidence.shrink.is_unresponsive() {
        return Proposal::pass(moves);
    }
    if streak == OVER_TARGET_STEPS {
        // The allocator's cache may be what grew: free it before giving up samples.
        moves.push(Move::EmptyCache { usage: r.usage });
        return Proposal::settle(moves);
    }
    if streak < 2 * OVER_TARGET_STEPS {
        return Proposal::pass(moves);
    }
    // The fit still describes the old footprint: shed the excess at the fitted cost per
    // token, then forget the old readings so growth is planned from the new footprint
    // only (else it would grow straight back).
    let goal = (target - s.margin()) * s.estimate.limit_bytes() as f64;
    let excess = r.obs.peak_bytes as f64 - goal;
    let seq = r.seq;
    let to = match s.estimate.cost_at(seq, false) {
        Some((_, per)) if per > 0.0 => {
            let shed = (excess / (per * seq as f64)).ceil().max(1.0) as usize;
            s.size.micro_batch.saturating_sub(shed)
        }
        _ => s.size.micro_batch * 9 / 10,
    };
    // As at critical: this many tokens stay above target whatever the fit says.
    let bound = over_target_bound(r.tokens, target, r.usage);
    moves.extend([
        Move::LearnCeiling {
            micro_batch: r.obs.micro_batch,
            tokens: bound.max(1),
            seq_len: r.obs.seq_len,
            usage: r.usage,
        },
        Move::ForgetReadings,
        Move::Shrink {
            to,
            reason: ResizeReason::OverTarget,
            usage: r.usage,
            seq_len: r.obs.seq_len,
            first: r.first,
            judge: Judge::Fitted,
            predict_at: None,
        },
    ]);
    Proposal::settle(moves)
}

/// Usage above warning: said once per size (growth stops).
pub(super) fn warn_once(s: &State, step: u64, usage: f64) -> Option<Move> {
    if s.plan.warned || s.evidence.shrink.is_unresponsive() {
        return None;
    }
    let what = if s.size.pinned {
        "the micro-batch is pinned; unpin it to let headroom shrink it"
    } else if !s.cfg.adaptive {
        "adaptation is off (memory.adaptive = false)"
    } else {
        "growth stops"
    };
    Some(Move::Warn {
        usage,
        forecast: false,
        text: format!(
            "step {step} peaked at {:.0}% of the limit, above warning {:.0}%; {what}",
            usage * 100.0,
            s.thresholds.warning * 100.0
        ),
        once: true,
    })
}

/// Growth from a step under target, planned for sequences of `seq`.
pub(super) fn grow(s: &State, obs: StepObservation, usage: f64, seq: usize) -> Vec<Move> {
    // The fixed part stands moved for an error that readings have not yet judged
    // (`reflexes::outside_judged`): they are kept out of the fit meanwhile, and growth on
    // the fit they would have corrected walks into the error again.
    if matches!(s.oom.outside, OutsideMove::Pending { .. }) {
        return Vec::new();
    }
    let Some(g) = growth(s, obs, seq) else {
        return Vec::new();
    };
    let mut moves = vec![Move::RoomReadings(g.room_readings)];
    let mb = s.size.micro_batch;
    let fitted = s.estimate.is_fitted();
    let margin = s.margin();
    let target = s.thresholds.target;
    // Room to spare: more than noise and the margin away from target.
    let room = usage < target - margin - 2.0 * MIN_MARGIN;
    let learning = !fitted && room && !s.size.shrunk_to_fit;
    // Nor, on a settled fit, is a growth whose predicted rise in usage is within what
    // readings scatter by (both ends of the noise) worth it: it cannot be told from noise,
    // may land over target and be undone. With a large fixed part a tenth more sequences
    // is that little memory, and the margin's decay (the young fit's errors leaving the
    // window) would make such a growth, long after the run settled near target, one
    // adjustment too many. A growth that lands well under target cannot be undone by
    // noise, however little usage it adds: on a large limit (host memory, a tiny model)
    // every growth is "within noise" of the limit, and the rule must not freeze such runs
    // at micro-batch 1.
    let (rise, lands_clear) = match (s.predicted_usage(g.cand, seq), s.predicted_usage(mb, seq)) {
        (Some(to), Some(now)) => (to - now, to < target - margin - 2.0 * MIN_MARGIN),
        _ => (f64::INFINITY, false),
    };
    // Only at a length measured: beyond it the cost is a bound (all attention), whose
    // small steps are how a ramp learns the curve.
    let worth = g.cand >= mb + g.gain
        && (s.estimate.distinct_sizes() < 3
            || seq > s.estimate.longest_measured()
            || rise >= 2.0 * MIN_MARGIN
            || lands_clear);
    if worth || (learning && g.cand > mb) {
        // Unfitted, any gain is worth it: a second size is what separates the fixed part
        // from the per-token cost.
        moves.push(Move::Resize {
            to: g.cand,
            reason: ResizeReason::Grow,
            usage,
            predict_at: None,
        });
    } else if learning && g.limit > mb && !g.waits {
        moves.extend(probe(s, obs, usage, seq, g.limit));
    } else if seq > obs.seq_len && g.cand < mb + g.gain {
        // Holding for a longer length still to come: say so once.
        moves.extend(hold_for_length(s, obs, usage, seq, &g));
    }
    moves
}

/// Where growth could go from the size in force, and whether it waits.
fn growth(s: &State, obs: StepObservation, seq: usize) -> Option<Growth> {
    let target = s.thresholds.target;
    // While longer lengths keep coming into view, growth keeps the same room as a shrink
    // for them does (else the next one takes it back).
    let fit = s.estimate.fit_under(target - s.margin(), seq, true)?;
    let mb = s.size.micro_batch;
    let fitted = s.estimate.is_fitted();
    let max_growth = s.cfg.max_growth;
    let factor = if fitted && s.estimate.noise_bound() {
        // Sizes too close to tell their cost from noise: growth follows the steepest line
        // within the noise, a bound from above, not the fit.
        max_growth * max_growth
    } else if fitted {
        max_growth
    } else if s.estimate.baseline().is_some() {
        // The line through the baseline over-predicts every larger size.
        max_growth * max_growth
    } else {
        s.cfg.probe_growth
    };
    let bound = ((mb as f64 * factor).min(usize::MAX as f64 / 2.0).floor() as usize).max(mb + 1);
    let limit = bound
        .min(s.cap())
        .min(s.evidence.ceiling.batch(seq, s.floor()));
    // Shrunk for a length that has not run yet: the model's cost there is an
    // extrapolation that moves as readings at longer lengths come in. Growing back on
    // such a move while the lengths keep rising only shrinks again a few steps later: wait
    // for the length to run, unless the model shows plain room ([`REGROW_ROOM`]). And a
    // size said to hold holds at least until the next reading.
    let plain = s
        .predicted_usage(mb, seq)
        .is_some_and(|u| u < target - s.margin() - REGROW_ROOM);
    let rg = &s.plan.regrowth;
    let room_readings = if plain { rg.room_readings + 1 } else { 0 };
    let waits = (rg.shrunk_ahead && seq > s.estimate.longest_measured() && room_readings < 2)
        || s.plan.held_at.is_some_and(|h| obs.step <= h + 1);
    let cand = if waits {
        fit.min(limit).min(mb)
    } else {
        fit.min(limit)
    };
    // Once the fit has been checked against a third size, the last few percent are not
    // worth another adjustment (they are within the fit's own error).
    let min_gain = if s.estimate.distinct_sizes() >= 3 {
        s.cfg.min_gain.max(SETTLED_GAIN)
    } else {
        s.cfg.min_gain
    };
    let gain = (mb as f64 * min_gain).ceil().max(1.0) as usize;
    Some(Growth {
        fit,
        limit,
        cand,
        waits,
        gain,
        room_readings,
    })
}

/// Not even one more sequence is predicted under target, but the prediction assumes the
/// worst of the fixed part: probe one more if even that worst case stays under critical;
/// else once per run all the same; else say why growth holds.
fn probe(s: &State, obs: StepObservation, usage: f64, seq: usize, limit: usize) -> Option<Move> {
    let mb = s.size.micro_batch;
    let to = (mb + 1).min(limit);
    let safe = s
        .predicted_usage(to, seq)
        .is_some_and(|u| u < s.thresholds.critical);
    // The worst case of the fixed part says even one more could reach critical, but the
    // step runs well under target: holding there for good gives up room that may be
    // there. Probe one more, once per run (an OOM or a reading over critical there is
    // recovered and sets a ceiling). Only at the length planned for: with lengths to come
    // longer than any run, the worst case there is a bound the forecast acts on, not a
    // stall.
    let risk = !safe && !s.plan.probe.risk_spent && seq == obs.seq_len;
    if safe || risk {
        let kind = if risk { Probe::Risk } else { Probe::OneMore };
        return Some(Move::Probe { to, usage, kind });
    }
    if matches!(s.plan.held, Some((HoldReason::FixedPartUnknown, _))) {
        return None;
    }
    Some(Move::Hold {
        why: HoldReason::FixedPartUnknown,
        at: mb,
        step: obs.step,
        usage,
        // No percentage: from one reading it would be an extrapolation, read as a risk
        // that was never measured.
        text: format!(
            "holding at {mb}: only one size has been measured, so how much of the \
             memory grows with the batch is not known yet; {} × {seq} is not tried \
             while it could pass the critical threshold{}",
            mb + 1,
            if s.estimate.baseline().is_some() {
                ""
            } else {
                "; a baseline measured before the first step would tell"
            }
        ),
    })
}

/// Growth holds for a longer length still to come: say so once per size.
fn hold_for_length(
    s: &State,
    obs: StepObservation,
    usage: f64,
    seq: usize,
    g: &Growth,
) -> Option<Move> {
    let mb = s.size.micro_batch;
    let now = s.fit_target(obs.seq_len).unwrap_or(0).min(g.limit.max(mb));
    if now < mb + g.gain || s.plan.held.map(|h| h.1) == Some(mb) {
        return None;
    }
    let when = match s.horizon.upcoming() {
        Some(u) if u.seq_len == seq => format!("arrives by step {}", u.step),
        _ => "may come (the longest the run feeds)".to_string(),
    };
    Some(Move::Hold {
        why: HoldReason::LongerLength,
        at: mb,
        step: obs.step,
        usage: s.predicted_usage(mb, seq).unwrap_or(usage),
        text: if g.fit.min(g.limit) > mb {
            format!(
                "holding at {mb}: length {seq} {when} and has not run yet; {now} would \
                 fit length {} now",
                obs.seq_len
            )
        } else {
            format!(
                "holding at {mb}: length {seq} {when} and {} × {seq} is the most that \
                 fits; {now} would fit length {} now",
                g.fit.max(mb).min(g.limit.max(mb)),
                obs.seq_len
            )
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::state::fixtures::{reading, state};

    #[test]
    fn the_warning_above_warning_is_proposed_once_per_size() {
        let mut s = state(10);
        assert!(matches!(
            warn_once(&s, 9, 0.93),
            Some(Move::Warn { once: true, .. })
        ));
        s.plan.warned = true;
        assert_eq!(warn_once(&s, 9, 0.93), None);
    }

    /// Three readings over target free the cache; six shed the excess, learn a ceiling and
    /// forget the readings, the shrink judged on the fitted cost.
    #[test]
    fn drift_frees_the_cache_at_three_readings_and_sheds_the_excess_at_six() {
        let mut s = state(10);
        s.evidence.over_target = 2;
        let p = drift(&s, &reading(10, 0.91));
        assert!(!p.settles && p.moves.is_empty(), "{:?}", p.moves);
        s.evidence.over_target = OVER_TARGET_STEPS;
        let p = drift(&s, &reading(10, 0.91));
        assert!(p.settles);
        assert_eq!(p.moves, [Move::EmptyCache { usage: 0.91 }]);
        s.evidence.over_target = 2 * OVER_TARGET_STEPS;
        let p = drift(&s, &reading(10, 0.91));
        assert!(p.settles);
        assert!(
            matches!(
                p.moves[..],
                [
                    Move::LearnCeiling { .. },
                    Move::ForgetReadings,
                    Move::Shrink {
                        reason: ResizeReason::OverTarget,
                        judge: Judge::Fitted,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.moves
        );
    }
}
