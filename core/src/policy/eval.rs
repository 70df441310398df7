//! How many samples of an evaluation batch run at once (validation, test, prediction, a
//! script's own evaluation). An evaluation batch asked for by the user (the HF Trainer's
//! `per_device_eval_batch_size`, a Lightning loader's batch) runs in chunks that fit:
//! split after an out-of-memory error, the rest of the batch retried smaller, and the size
//! kept for the next batch instead of starting over at the asked one.
//!
//! Evaluation keeps no activations for a backward and takes no optimizer step, so its
//! memory per sample is its own: it gets its own [`MemoryModel`] fitted from its own
//! chunks' peaks, judged against the controller's thresholds, limit and margin (the
//! controller owns this and calls it; see `Controller::eval_size`). The training
//! micro-batch is never touched by it.
use super::memory_model::MemoryModel;
use super::messages::{Decision, ResizeReason};

#[derive(Debug, Clone, Default)]
pub struct EvalSizer {
    model: MemoryModel,
    /// Chunks of this many tokens or more ran out of memory (or peaked at critical).
    ceiling_tokens: Option<u64>,
    /// The largest chunk, tokens, that peaked under critical: a fit's extrapolation does
    /// not shrink below what ran (when the fixed part alone is near the limit, a fit
    /// would otherwise ask for chunks of one sample that save nothing).
    ran_tokens: Option<u64>,
    /// The last batch's (asked, chunk size): a change at the same asked size is a
    /// decision; a smaller last batch of an epoch is not.
    last: Option<(usize, usize)>,
}

impl EvalSizer {
    pub fn model(&self) -> &MemoryModel {
        &self.model
    }

    pub fn ceiling_tokens(&self) -> Option<u64> {
        self.ceiling_tokens
    }

    /// The largest chunk of `seq_len`-token samples allowed: under the ceiling, and
    /// predicted under `under_bytes` once a chunk was measured; `None`: no bound known.
    fn bound(&self, seq_len: usize, under_bytes: u64) -> Option<usize> {
        let seq = seq_len.max(1) as u64;
        let below_ceiling = self
            .ceiling_tokens
            .map(|c| (c.saturating_sub(1) / seq).max(1) as usize);
        let fitted = if self.model.is_empty() {
            None
        } else {
            let ran = self.ran_tokens.map_or(1, |t| (t / seq).max(1) as usize);
            self.model
                .max_batch_under(under_bytes, seq_len)
                .map(|n| n.max(ran))
        };
        match (below_ceiling, fitted) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The chunk size for a batch of `asked` samples of `seq_len` tokens: as asked until
    /// something bounds it, then the bound spread evenly over the chunks it takes (64
    /// under a bound of 40 runs as 32 + 32, not 40 + 24). A change from the last batch of
    /// the same asked size is a decision (its usage predicted at the new size against
    /// `limit_bytes`).
    pub fn size_for(
        &mut self,
        asked: usize,
        seq_len: usize,
        under_bytes: u64,
        limit_bytes: u64,
    ) -> (usize, Option<Decision>) {
        let asked = asked.max(1);
        let most = self.bound(seq_len, under_bytes).unwrap_or(asked).min(asked);
        let size = asked.div_ceil(asked.div_ceil(most));
        let decision = match self.last {
            Some((a, from)) if a == asked && from != size => Some(Decision::EvalSize {
                from,
                to: size,
                reason: if size < from {
                    ResizeReason::Forecast
                } else {
                    ResizeReason::Grow
                },
                usage: self
                    .model
                    .predict((size * seq_len.max(1)) as u64)
                    .map_or(0.0, |b| b as f64 / limit_bytes.max(1) as f64),
            }),
            _ => None,
        };
        self.last = Some((asked, size));
        (size, decision)
    }

    /// A chunk of `size` samples completed at `peak_bytes`; `critical`: the peak was at
    /// or past the critical threshold, so that size is not run again.
    pub fn measured(&mut self, size: usize, seq_len: usize, peak_bytes: u64, critical: bool) {
        let tokens = (size * seq_len.max(1)) as u64;
        self.model.observe_at(tokens, peak_bytes, seq_len);
        if critical {
            self.lower_ceiling(tokens);
        } else if self.ceiling_tokens.is_none_or(|c| tokens < c) {
            self.ran_tokens = Some(self.ran_tokens.map_or(tokens, |t| t.max(tokens)));
        }
    }

    /// A chunk of `size` ran out of memory: the size to retry the same samples with
    /// (half, or less where the model says so), or `None` at one sample.
    pub fn oom(
        &mut self,
        size: usize,
        seq_len: usize,
        under_bytes: u64,
    ) -> (Option<usize>, Decision) {
        self.lower_ceiling((size * seq_len.max(1)) as u64);
        let retry = (size > 1).then(|| {
            let half = (size / 2).max(1);
            self.bound(seq_len, under_bytes)
                .map_or(half, |b| b.min(half))
        });
        if let (Some(to), Some(last)) = (retry, self.last.as_mut()) {
            last.1 = last.1.min(to);
        }
        let decision = Decision::EvalSize {
            from: size,
            to: retry.unwrap_or(size),
            reason: ResizeReason::Oom,
            usage: 1.0,
        };
        (retry, decision)
    }

    fn lower_ceiling(&mut self, tokens: u64) {
        self.ceiling_tokens = Some(self.ceiling_tokens.map_or(tokens, |c| c.min(tokens)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn runs_as_asked_until_something_bounds_it() {
        let mut s = EvalSizer::default();
        assert_eq!(s.size_for(64, 128, GIB, GIB), (64, None));
        assert_eq!(s.size_for(64, 128, GIB, GIB), (64, None));
    }

    #[test]
    fn an_oom_halves_the_rest_and_the_next_batch_starts_split_evenly() {
        let mut s = EvalSizer::default();
        s.size_for(64, 128, GIB, GIB);
        let (retry, d) = s.oom(64, 128, GIB);
        assert_eq!(retry, Some(32));
        assert!(matches!(
            d,
            Decision::EvalSize {
                from: 64,
                to: 32,
                reason: ResizeReason::Oom,
                ..
            }
        ));
        // The next batch of 64 stays under the ceiling (64 × 128 tokens): two even halves,
        // no second decision (the OOM said it).
        assert_eq!(s.size_for(64, 128, GIB, GIB), (32, None));
        // A smaller last batch runs whole when it fits under the ceiling.
        assert_eq!(s.size_for(40, 128, GIB, GIB), (40, None));
        assert_eq!(s.size_for(10, 128, GIB, GIB), (10, None));
    }

    #[test]
    fn one_sample_that_does_not_fit_gives_up() {
        let mut s = EvalSizer::default();
        assert_eq!(s.oom(1, 4096, GIB).0, None);
    }

    #[test]
    fn the_model_of_measured_chunks_bounds_the_size_under_target() {
        let mut s = EvalSizer::default();
        // 1 MiB fixed + 1 MiB per sample of 100 tokens: under 21 MiB, at most 20 samples.
        s.measured(8, 100, 9 << 20, false);
        s.measured(16, 100, 17 << 20, false);
        let (size, _) = s.size_for(64, 100, 21 << 20, GIB);
        assert_eq!(size, 16, "64 in 4 even chunks of at most 20");
        // More room: the same asked size grows, said as a decision.
        let (size, d) = s.size_for(64, 100, 40 << 20, GIB);
        assert_eq!(size, 32);
        assert!(matches!(
            d,
            Some(Decision::EvalSize {
                from: 16,
                to: 32,
                reason: ResizeReason::Grow,
                ..
            })
        ));
    }

    #[test]
    fn a_fit_does_not_shrink_below_a_size_that_ran_under_critical() {
        let mut s = EvalSizer::default();
        // A fixed part near the limit: the fit says no sample fits under 21 MiB, but 8
        // ran (under critical), so chunks stay at 8.
        s.measured(8, 100, 20 << 20, false);
        s.measured(4, 100, 19 << 20, false);
        assert_eq!(s.size_for(64, 100, 18 << 20, GIB).0, 8);
    }

    #[test]
    fn a_chunk_at_critical_is_not_run_again() {
        let mut s = EvalSizer::default();
        s.measured(32, 100, 30 << 20, true);
        let (size, _) = s.size_for(32, 100, GIB, GIB);
        assert!(size < 32, "{size}");
    }
}
