//! The reflexes: what the controller does when memory is past what any plan allows, with
//! no more model than it has.
//!
//! - usage ≥ critical: learn a ceiling and shrink to the model's fit under target, at
//!   least by one and at most to half;
//! - usage ≥ emergency: free the cache too, and halve;
//! - past the whole limit on a soft budget: what a hard one would have failed with, so
//!   as after an OOM;
//! - an OOM: free the cache, learn a ceiling, retry at the fit (at most half; an eighth
//!   when nothing has run) — or, at a size that has run cleanly many times, retry the
//!   same size once: that OOM was not the batch's doing;
//! - while memory is held apart from the batch ([`ShrinkCheck::Unresponsive`]) only the
//!   cache is freed: shrinking would give up throughput for nothing.
//!
//! [`ShrinkCheck::Unresponsive`]: super::evidence::ShrinkCheck::Unresponsive
use super::controller::Controller;
use super::evidence::{over_target_bound, PendingShrink, Reading};
use super::{Decision, OomOutcome, ResizeReason};

/// Clean steps at a size after which an OOM there is not taken as the batch's.
const SETTLED_STEPS: u32 = 5;

/// What the OOM reflex remembers between calls.
#[derive(Debug, Clone, Default)]
pub struct OomReflex {
    /// Consecutive OOMs at the smallest micro-batch.
    ooms_at_min: u32,
    /// The OOM being retried at the same size (micro-batch, sequence length).
    retrying: Option<(usize, usize)>,
}

impl OomReflex {
    /// A step ran: the retry (if any) worked, and the smallest size is not failing.
    pub fn read(&mut self) {
        self.retrying = None;
        self.ooms_at_min = 0;
    }

    /// Another OOM at the smallest size: whether to retry it (`max` in a row give up).
    fn at_min(&mut self, max: u32) -> bool {
        self.ooms_at_min += 1;
        self.ooms_at_min < max
    }
}

impl Controller {
    /// The reflexes after a reading; true when one acted (no other rule then does).
    pub(super) fn reflexes(&mut self, r: &Reading, out: &mut Vec<Decision>) -> bool {
        let t = self.thresholds;
        let usage = r.usage;
        if usage >= t.critical && self.evidence.shrink.is_unresponsive() {
            // Not the batch's memory: shrinking would only give up throughput. The cache
            // is still worth freeing.
            if usage >= t.emergency {
                out.push(Decision::EmptyCache { usage });
            }
            return true;
        }
        if usage >= t.critical {
            // A step at or above critical also sets a ceiling: with a non-negative fixed
            // part, a micro-batch of `tokens × target / usage` tokens would still be at or
            // above target (else the robust fit, which treats the one bad reading as an
            // outlier, would grow straight back).
            let bound = over_target_bound(r.tokens, t.target, usage);
            out.extend(self.learn_ceiling(r.obs.micro_batch, bound.max(1), r.obs.seq_len, usage));
        }
        if usage >= t.emergency {
            out.push(Decision::EmptyCache { usage });
        }
        if !self.may_resize() {
            return false;
        }
        if usage >= t.critical && r.risk_probed && r.obs.micro_batch > self.floor() {
            self.risk_probe_failed(r, out);
            return true;
        }
        if !r.current {
            return false;
        }
        if usage >= 1.0 {
            self.past_the_limit(r, out);
            return true;
        }
        if usage < t.critical {
            return false;
        }
        let reason = severity(usage, t.emergency);
        // Emergency: half, safety over throughput (the memory has followed the batch so
        // far, else this rule would not be reached).
        let fit = match reason {
            ResizeReason::Emergency => 0,
            _ => self.fit_target(r.seq).unwrap_or(0),
        };
        out.extend(self.shrink(fit, reason, usage, r.obs.seq_len, r.first));
        true
    }

    /// The one-sequence probe past the worst case read at or above critical: back to the
    /// size it came from, which ran cleanly (halving would put it below what fits, and a
    /// retained heap's high-water mark would never let it grow back).
    fn risk_probe_failed(&mut self, r: &Reading, out: &mut Vec<Decision>) {
        let reason = severity(r.usage, self.thresholds.emergency);
        out.extend(self.resize(r.obs.micro_batch - 1, reason, r.usage));
        // A reading there as high as this one is memory the probe left behind.
        self.evidence.shrink.expect(Some(PendingShrink {
            from: r.obs.micro_batch,
            before: r.usage,
            seq_len: r.obs.seq_len,
            guessed: !self.estimate.is_fitted(),
            first: r.first,
        }));
    }

    /// Past the limit (a soft budget): what a hard one would have failed with an OOM, and
    /// memory that followed the batch so far.
    fn past_the_limit(&mut self, r: &Reading, out: &mut Vec<Decision>) {
        let mut to = self.after_oom(r.obs.micro_batch, r.obs.seq_len, r.first);
        if r.after_first_shrink {
            // Right after a shrink made on the first step, which could not be judged: a
            // reading still past the limit may be memory held at that step's mark (it
            // read 285% at 400, then 270% at 50, and the one-size fit took the run to 13
            // of a feasible 100). Half, and the next reading judges it.
            to = to.max(self.half_of(r.obs.micro_batch));
        }
        let from = self.size.micro_batch;
        out.extend(self.resize(to, ResizeReason::Emergency, r.usage));
        let shrank = self.size.micro_batch < from;
        let pending = shrank.then_some(PendingShrink {
            from,
            before: r.usage,
            seq_len: r.obs.seq_len,
            guessed: !self.estimate.is_fitted(),
            first: r.first,
        });
        self.evidence.shrink.expect(pending);
    }

    /// The size to go to from `micro_batch`, which did not fit in the limit: the fit, at
    /// most half. When no step has run yet, an eighth: halving from a start far too large
    /// fails step after step, while from an eighth the baseline's line grows back safely
    /// in one move.
    fn after_oom(&self, micro_batch: usize, seq_len: usize, nothing_ran: bool) -> usize {
        match self.fit_target(self.horizon.plan_seq(seq_len)) {
            Some(f) => f.min(micro_batch / 2),
            None if nothing_ran => micro_batch / 8,
            None => micro_batch / 2,
        }
    }

    /// A step at `micro_batch` × `seq_len` ran out of memory: learn the ceiling, free the
    /// cache, and pick the size to retry the same samples with.
    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        let tokens = (micro_batch * seq_len) as u64;
        let mut decisions = vec![Decision::EmptyCache { usage: 1.0 }];
        let retried = self.oom.retrying == Some((micro_batch, seq_len));
        // A size that has run cleanly many times at this length or longer did not
        // outgrow the memory: something else took it (a spike, another process). Retry it
        // once; a second OOM there is taken as real.
        let settled = micro_batch == self.size.micro_batch
            && self.size.steps_at_size >= SETTLED_STEPS
            && !self.evidence.shrink.is_unresponsive()
            && seq_len <= self.estimate.longest_measured()
            && !retried;
        self.size.pinned = false;
        self.evidence.shrink.expect(None);
        self.evidence.grown_from = None;
        if settled {
            self.oom.retrying = Some((micro_batch, seq_len));
            return OomOutcome {
                decisions,
                retry_with: Some(micro_batch),
            };
        }
        if retried {
            self.outside_grew(micro_batch, seq_len);
        }
        self.oom.retrying = None;
        decisions.extend(self.learn_ceiling(micro_batch, tokens, seq_len, 1.0));
        self.evidence.shrink.under_target();
        self.size.micro_batch = micro_batch;
        if micro_batch <= self.floor() {
            let again = self.oom.at_min(self.cfg.max_ooms_at_min);
            return OomOutcome {
                decisions,
                retry_with: again.then_some(micro_batch),
            };
        }
        // The one-sequence probe failed: back to the size it came from, which ran.
        let to = if self.plan.probe.is_risk() {
            micro_batch - 1
        } else {
            self.after_oom(micro_batch, seq_len, !self.evidence.seen_first)
        };
        decisions.extend(self.resize(to, ResizeReason::Oom, 1.0));
        OomOutcome {
            decisions,
            retry_with: Some(self.size.micro_batch),
        }
    }

    /// The retried size failed again: the memory outside the batch grew by at least what
    /// the model left between this size and the limit. Move the fixed part by that so the
    /// size retried with is planned from the memory left.
    fn outside_grew(&mut self, micro_batch: usize, seq_len: usize) {
        if let Some(p) = self.predicted_bytes(micro_batch, seq_len) {
            let gap = self.estimate.limit_bytes() as f64 - p as f64;
            if gap > 0.0 {
                self.estimate.shift(gap);
            }
        }
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

    #[test]
    fn the_smallest_size_is_retried_until_max_ooms_in_a_row_and_a_step_resets_the_count() {
        let mut o = OomReflex::default();
        assert!(o.at_min(3));
        assert!(o.at_min(3));
        assert!(!o.at_min(3));
        o.read();
        assert!(o.at_min(3));
        o.retrying = Some((8, 64));
        o.read();
        assert_eq!(o.retrying, None);
    }

    #[test]
    fn emergency_is_its_own_threshold() {
        assert_eq!(severity(0.97, 0.97), ResizeReason::Emergency);
        assert_eq!(severity(0.96, 0.97), ResizeReason::Critical);
    }
}
