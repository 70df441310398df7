//! The reflexes: what the controller does when memory is past what any plan allows, with
//! no more model than it has. Each reads the [`State`] and returns the [`Move`]s it
//! proposes; the controller applies them.
//!
//! - usage ≥ critical: learn a ceiling and shrink to the model's fit under target, at
//!   least by one and at most to half;
//! - usage ≥ emergency: free the cache too, and halve;
//! - past the whole limit on a soft budget: what a hard one would have failed with, so
//!   as after an OOM;
//! - an OOM: free the cache, learn a ceiling, retry at the fit (at most half; an eighth
//!   when nothing has run) — or, at a size that has run cleanly many times, retry the
//!   same size once: that OOM was not the batch's doing;
//! - a reading while the fixed part stands moved up for a retried size that failed again:
//!   whether it sees that memory; ten in a row that do not undo the move, and an error
//!   before a size grown back to settles then says the limit fell without being told
//!   ([`outside_judged`], [`on_oom`]);
//! - a shrink that did not lower usage: the memory is held apart from the batch
//!   ([`ShrinkCheck::Unresponsive`]); while it is, only the cache is freed: shrinking
//!   would give up throughput for nothing.
//!
//! [`ShrinkCheck::Unresponsive`]: super::evidence::ShrinkCheck::Unresponsive
use super::evidence::{held_apart, over_target_bound, shrunk_batch_share, PendingShrink, Reading};
use super::messages::{ResizeReason, StepObservation};
use super::moves::{Judge, Move, Proposal};
use super::state::{OutsideMove, State};

/// Clean steps at a size after which an OOM there is not taken as the batch's.
pub(super) const SETTLED_STEPS: u32 = 5;
/// Readings in a row that must not see the memory a move of the fixed part assumed before
/// the move is undone ([`outside_judged`]). A limit that fell silently for a few steps
/// has come back by then: with the simulator's limit drops made silent for 10 steps (400
/// runs), undoing after 5 readings grew back while the limit was still down (13 more
/// errors than keeping the move, 23 runs worse), after 10 it did not (3 fewer, none worse).
const UNSEEN_READINGS: u32 = 10;

/// The reflexes after a reading; the proposal settles the step when one acted.
pub(super) fn after_reading(s: &State, r: &Reading) -> Proposal {
    let t = s.thresholds;
    let usage = r.usage;
    let mut moves = Vec::new();
    if usage >= t.critical && s.evidence.shrink.is_unresponsive() {
        // Not the batch's memory: shrinking would only give up throughput. The cache is
        // still worth freeing.
        if usage >= t.emergency {
            moves.push(Move::EmptyCache { usage });
        }
        return Proposal::settle(moves);
    }
    if usage >= t.critical {
        // A step at or above critical also sets a ceiling: with a non-negative fixed part,
        // a micro-batch of `tokens × target / usage` tokens would still be at or above
        // target (else the robust fit, which treats the one bad reading as an outlier,
        // would grow straight back).
        let bound = over_target_bound(r.tokens, t.target, usage);
        moves.push(Move::LearnCeiling {
            micro_batch: r.obs.micro_batch,
            tokens: bound.max(1),
            seq_len: r.obs.seq_len,
            usage,
        });
    }
    if usage >= t.emergency {
        moves.push(Move::EmptyCache { usage });
    }
    if !s.may_resize() {
        return Proposal::pass(moves);
    }
    if usage >= t.critical && r.risk_probed && r.obs.micro_batch > s.floor() {
        moves.extend(risk_probe_failed(s, r));
        return Proposal::settle(moves);
    }
    if !r.current {
        return Proposal::pass(moves);
    }
    if usage >= 1.0 {
        moves.extend(past_the_limit(s, r));
        return Proposal::settle(moves);
    }
    if usage < t.critical {
        return Proposal::pass(moves);
    }
    let reason = severity(usage, t.emergency);
    // Emergency: half, safety over throughput (the memory has followed the batch so far,
    // else this rule would not be reached).
    let fit = match reason {
        ResizeReason::Emergency => 0,
        _ => s.fit_target(r.seq).unwrap_or(0),
    };
    moves.push(Move::Shrink {
        to: fit,
        reason,
        usage,
        seq_len: r.obs.seq_len,
        first: r.first,
        judge: Judge::Next,
        predict_at: None,
    });
    Proposal::settle(moves)
}

/// The one-sequence probe past the worst case read at or above critical: back to the size
/// it came from, which ran cleanly (halving would put it below what fits, and a retained
/// heap's high-water mark would never let it grow back).
fn risk_probe_failed(s: &State, r: &Reading) -> [Move; 2] {
    [
        Move::Resize {
            to: r.obs.micro_batch - 1,
            reason: severity(r.usage, s.thresholds.emergency),
            usage: r.usage,
            predict_at: None,
        },
        // A reading there as high as this one is memory the probe left behind.
        Move::Expect(Some(PendingShrink {
            from: r.obs.micro_batch,
            before: r.usage,
            seq_len: r.obs.seq_len,
            guessed: !s.estimate.is_fitted(),
            first: r.first,
        })),
    ]
}

/// Past the limit (a soft budget): what a hard one would have failed with an OOM, and
/// memory that followed the batch so far.
fn past_the_limit(s: &State, r: &Reading) -> [Move; 2] {
    let mut to = after_oom(s, r.obs.micro_batch, r.obs.seq_len, r.first);
    if r.after_first_shrink {
        // Right after a shrink made on the first step, which could not be judged: a
        // reading still past the limit may be memory held at that step's mark, and a fit
        // through it would take the run far below what fits. Half, and the next reading
        // judges it.
        to = to.max(s.half_of(r.obs.micro_batch));
    }
    let from = s.size.micro_batch;
    let shrank = to.clamp(s.floor(), s.cap()) < from;
    [
        Move::Resize {
            to,
            reason: ResizeReason::Emergency,
            usage: r.usage,
            predict_at: None,
        },
        Move::Expect(shrank.then_some(PendingShrink {
            from,
            before: r.usage,
            seq_len: r.obs.seq_len,
            guessed: !s.estimate.is_fitted(),
            first: r.first,
        })),
    ]
}

/// The size to go to from `micro_batch`, which did not fit in the limit: the fit, at most
/// half. When no step has run yet, an eighth: halving from a start far too large fails
/// step after step, while from an eighth the baseline's line grows back safely in one
/// move.
fn after_oom(s: &State, micro_batch: usize, seq_len: usize, nothing_ran: bool) -> usize {
    match s.fit_target(s.horizon.plan_seq(seq_len)) {
        Some(f) => f.min(micro_batch / 2),
        None if nothing_ran => micro_batch / 8,
        None => micro_batch / 2,
    }
}

/// The first reading at the size a shrink reached, `p` the shrink: when usage did not
/// follow, the memory is not the batch's, and shrinking further would only give up
/// throughput. Free the cache, forget the readings (a fit through equal peaks would say
/// every token is expensive) and say so.
pub(super) fn shrink_judged(
    s: &State,
    obs: StepObservation,
    p: PendingShrink,
    usage: f64,
) -> Vec<Move> {
    // A shorter length only lowers usage further, so it judges the shrink too (with
    // random lengths the same length rarely comes next); so does a longer one whose batch
    // is still smaller, a sequence costing at most quadratically in its length. Waiting
    // for a length no longer than the one shrunk at would let the emergency rule halve
    // again and again on memory held at a high-water mark.
    if shrunk_batch_share(p, obs) >= 1.0 || !held_apart(&s.estimate, obs, p, usage) {
        return Vec::new();
    }
    vec![
        Move::HeldApart,
        Move::EmptyCache { usage },
        Move::Warn {
            usage,
            forecast: false,
            text: format!(
                "step {}: usage stayed at {:.0}% although the micro-batch shrank from {} \
                 to {} (it was {:.0}%): the memory is held apart from the batch (allocator \
                 cache, fragmentation or another process); holding at {} and freeing the cache",
                obs.step,
                usage * 100.0,
                p.from,
                obs.micro_batch,
                p.before * 100.0,
                obs.micro_batch
            ),
            once: false,
        },
    ]
}

/// A step at `micro_batch` × `seq_len` ran out of memory: free the cache, and either retry
/// the same size once or learn the ceiling. The size to retry with is asked afterwards
/// ([`retry_size`]), of the estimate as this reaction leaves it.
pub(super) fn on_oom(s: &State, micro_batch: usize, seq_len: usize) -> Vec<Move> {
    let mut moves = vec![Move::EmptyCache { usage: 1.0 }, Move::OomSeen];
    let retried = s.oom.retrying == Some((micro_batch, seq_len));
    // A size that has run cleanly many times at this length or longer did not outgrow the
    // memory: something else took it (a spike, another process). Retry it once; a second
    // OOM there is taken as real.
    let settled_size = micro_batch == s.size.micro_batch
        && s.size.steps_at_size >= SETTLED_STEPS
        && !s.evidence.shrink.is_unresponsive()
        && seq_len <= s.estimate.longest_measured();
    if settled_size && !retried {
        moves.push(Move::RetrySame {
            micro_batch,
            seq_len,
        });
        return moves;
    }
    // A move of the fixed part was undone because the readings did not see the memory,
    // and a size grown back since fails before it settles: not a spike, the limit fell
    // silently (no reading can show that). It is planned under from now on as a limit,
    // not as memory outside the batch: what the failed size would have peaked at. Once
    // the limit has fallen so, every error at a size the estimate puts under it teaches
    // it again.
    let limit_falls = s.oom.outside == OutsideMove::LimitFell;
    if (s.oom.undone() && !retried) || limit_falls {
        if let Some(p) = s.estimate.predicted_bytes(micro_batch, seq_len) {
            let limit = s.estimate.limit_bytes();
            if p < limit {
                moves.extend([
                    Move::LimitFell { bytes: p },
                    Move::Warn {
                        usage: 1.0,
                        forecast: false,
                        text: format!(
                            "micro-batch {micro_batch} ran out of memory where it would have \
                             peaked at {:.0}% of the limit: the limit fell although it was not \
                             said to; planning under {} MiB from now on",
                            p as f64 * 100.0 / limit as f64,
                            p >> 20
                        ),
                        once: false,
                    },
                ]);
            }
        }
    } else if retried {
        // The retried size failed again: the memory outside the batch grew by at least
        // what the model left between this size and the limit (or the limit fell by it).
        // Move the fixed part by that so the size retried with is planned from the memory
        // left.
        if let Some(p) = s.estimate.predicted_bytes(micro_batch, seq_len) {
            let gap = s.estimate.limit_bytes() as f64 - p as f64;
            if gap > 0.0 {
                moves.push(Move::OutsideGrew { bytes: gap });
            }
        }
    }
    moves.extend([
        Move::LearnCeiling {
            micro_batch,
            tokens: (micro_batch * seq_len) as u64,
            seq_len,
            usage: 1.0,
        },
        Move::OomAt { micro_batch },
    ]);
    moves
}

/// A reading while the fixed part stands moved up by `bytes` for a retried size that
/// failed again ([`on_oom`], [`OutsideMove::Pending`]): whether it sees that memory. A
/// reading under target that sits nearer the fit before the move than after it, by more
/// than readings scatter, does not; [`UNSEEN_READINGS`] such readings in a row undo the
/// move. Kept, it would hold the run at a fraction of what fits until `forget_every`
/// raised the ceiling: over a large fixed part the move (the limit less the fit's
/// prediction at the failed size) leaves no room under target for even one sample, and a
/// CPU run under a hard cap, met by the address space its heap keeps and not by resident
/// memory, held micro-batch 1 at 82% for 71 steps after two errors at 9
/// (docs/CONTROLLER.md, "The margin"). The ceiling the errors taught stays, and an error
/// before a size grown back to settles says the limit fell ([`on_oom`]). Any other
/// reading sees the memory (another process's, counted in the reading): the move stands.
pub(super) fn outside_judged(s: &State, obs: StepObservation, usage: f64) -> Vec<Move> {
    let OutsideMove::Pending { bytes, unseen } = s.oom.outside else {
        return Vec::new();
    };
    let Some(moved) = s.estimate.predicted_bytes(obs.micro_batch, obs.seq_len) else {
        return vec![Move::OutsideSeen];
    };
    let peak = obs.peak_bytes as f64;
    let below = moved as f64 - peak;
    let scatter = 2.0 * s.estimate.noise() * peak;
    if usage >= s.thresholds.target || below < bytes / 2.0 || below <= scatter {
        return vec![Move::OutsideSeen];
    }
    if unseen + 1 < UNSEEN_READINGS {
        return vec![Move::OutsideUnseen];
    }
    let limit = s.estimate.limit_bytes() as f64;
    vec![
        Move::OutsideBack { bytes },
        Move::Warn {
            usage,
            forecast: false,
            text: format!(
                "step {}: {:.0}% at micro-batch {}, {} readings in a row, where the memory the \
                 last out-of-memory errors suggested had grown outside the batch would read \
                 {:.0}%: it did not grow (a passing spike, or a hard cap met by address space \
                 the heap keeps); sizing from the fit again, under the ceiling the errors \
                 left (another error before a size settles is taken as the limit having fallen)",
                obs.step,
                usage * 100.0,
                obs.micro_batch,
                UNSEEN_READINGS,
                moved as f64 * 100.0 / limit,
            ),
            once: false,
        },
    ]
}

/// The size to retry an OOM at `micro_batch` × `seq_len` with, above the smallest size.
pub(super) fn retry_size(s: &State, micro_batch: usize, seq_len: usize) -> Move {
    // The one-sequence probe failed: back to the size it came from, which ran.
    let to = if s.plan.probe.is_risk() {
        micro_batch - 1
    } else {
        after_oom(s, micro_batch, seq_len, !s.evidence.seen_first)
    };
    Move::Resize {
        to,
        reason: ResizeReason::Oom,
        usage: 1.0,
        predict_at: None,
    }
}

/// Emergency at or over `emergency`, else critical.
fn severity(usage: f64, emergency: f64) -> ResizeReason {
    if usage >= emergency {
        ResizeReason::Emergency
    } else {
        ResizeReason::Critical
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::evidence::ShrinkCheck;
    use crate::policy::state::fixtures::{reading, state};

    #[test]
    fn critical_learns_a_ceiling_and_shrinks_emergency_also_frees_the_cache_and_halves() {
        let p = after_reading(&state(10), &reading(10, 0.96));
        assert!(p.settles);
        assert!(
            matches!(
                p.moves[..],
                [
                    Move::LearnCeiling {
                        micro_batch: 10,
                        ..
                    },
                    Move::Shrink {
                        reason: ResizeReason::Critical,
                        judge: Judge::Next,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.moves
        );
        let p = after_reading(&state(10), &reading(10, 0.98));
        assert!(
            matches!(
                p.moves[..],
                [
                    Move::LearnCeiling { .. },
                    Move::EmptyCache { .. },
                    Move::Shrink {
                        to: 0,
                        reason: ResizeReason::Emergency,
                        ..
                    }
                ]
            ),
            "{:?}",
            p.moves
        );
    }

    #[test]
    fn held_apart_memory_only_frees_the_cache_and_a_pinned_size_leaves_the_rest_to_warn() {
        let mut s = state(10);
        s.evidence.shrink = ShrinkCheck::Unresponsive;
        let p = after_reading(&s, &reading(10, 0.98));
        assert!(p.settles);
        assert_eq!(p.moves, [Move::EmptyCache { usage: 0.98 }]);
        let mut s = state(10);
        s.size.pinned = true;
        let p = after_reading(&s, &reading(10, 0.96));
        assert!(!p.settles, "the warning rule still speaks");
        assert!(
            matches!(p.moves[..], [Move::LearnCeiling { .. }]),
            "{:?}",
            p.moves
        );
    }

    #[test]
    fn an_oom_at_a_fresh_size_learns_its_ceiling_and_a_settled_one_is_retried_once() {
        let s = state(10);
        assert!(
            matches!(
                on_oom(&s, 10, 64)[..],
                [
                    Move::EmptyCache { .. },
                    Move::OomSeen,
                    Move::LearnCeiling { tokens: 640, .. },
                    Move::OomAt { micro_batch: 10 }
                ]
            ),
            "{:?}",
            on_oom(&s, 10, 64)
        );
        let mut s = state(10);
        s.size.steps_at_size = SETTLED_STEPS;
        s.estimate.take(reading(10, 0.5).obs, true);
        assert_eq!(
            on_oom(&s, 10, 64).last(),
            Some(&Move::RetrySame {
                micro_batch: 10,
                seq_len: 64
            })
        );
        s.oom.retrying = Some((10, 64));
        assert!(!on_oom(&s, 10, 64)
            .iter()
            .any(|m| matches!(m, Move::RetrySame { .. })));
    }

    /// A state settled at 10 sequences of 64 (50% fixed, 3% a sequence), its fixed part
    /// moved up by 10% of the limit for a retried size that failed again.
    fn moved() -> State {
        let mut s = state(10);
        for (step, mb) in [(2, 4), (3, 10), (4, 10), (5, 10)] {
            let usage = 0.5 + 0.03 * mb as f64;
            s.estimate.take(reading(mb, usage).obs, true);
            s.estimate.take(
                StepObservation {
                    step,
                    ..reading(mb, usage).obs
                },
                true,
            );
        }
        let bytes = 0.1 * s.estimate.limit_bytes() as f64;
        s.estimate.shift(bytes);
        s.oom.outside = OutsideMove::Pending { bytes, unseen: 0 };
        s
    }

    #[test]
    fn a_reading_that_sees_the_moved_memory_keeps_the_move_and_ten_that_do_not_undo_it() {
        let s = moved();
        // 2 sequences: 56% before the move, 66% after it.
        assert_eq!(
            outside_judged(&s, reading(2, 0.66).obs, 0.66),
            [Move::OutsideSeen]
        );
        assert_eq!(
            outside_judged(&s, reading(2, 0.56).obs, 0.56),
            [Move::OutsideUnseen]
        );
        let mut s = s;
        s.oom.outside = OutsideMove::Pending {
            bytes: 0.1 * s.estimate.limit_bytes() as f64,
            unseen: UNSEEN_READINGS - 1,
        };
        let moves = outside_judged(&s, reading(2, 0.56).obs, 0.56);
        assert!(
            matches!(moves[..], [Move::OutsideBack { .. }, Move::Warn { .. }]),
            "{moves:?}"
        );
        // Over target, it is not judged to be under the move.
        assert_eq!(
            outside_judged(&s, reading(2, 0.91).obs, 0.91),
            [Move::OutsideSeen]
        );
    }

    #[test]
    fn an_oom_after_an_undone_move_before_a_size_settles_teaches_the_limit() {
        let mut s = moved();
        s.estimate.shift(-0.1 * s.estimate.limit_bytes() as f64);
        s.oom.outside = OutsideMove::Undone { at: 2 };
        s.size.micro_batch = 9;
        s.size.steps_at_size = 1;
        let moves = on_oom(&s, 9, 64);
        let at_9 = s.estimate.predicted_bytes(9, 64).unwrap();
        assert!(
            matches!(
                moves[..],
                [
                    Move::EmptyCache { .. },
                    Move::OomSeen,
                    Move::LimitFell { bytes },
                    Move::Warn { .. },
                    Move::LearnCeiling { .. },
                    Move::OomAt { micro_batch: 9 }
                ] if bytes == at_9
            ),
            "{moves:?}"
        );
        // Settled there, it is retried as it is first.
        s.size.steps_at_size = SETTLED_STEPS;
        assert!(matches!(
            on_oom(&s, 9, 64).last(),
            Some(Move::RetrySame { .. })
        ));
    }

    #[test]
    fn emergency_is_its_own_threshold() {
        assert_eq!(severity(0.97, 0.97), ResizeReason::Emergency);
        assert_eq!(severity(0.96, 0.97), ResizeReason::Critical);
    }
}
