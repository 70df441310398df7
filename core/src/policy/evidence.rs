//! What a reading means: whether it says what the batch costs, and what it teaches.
//!
//! - The run's first step is not a reading of the footprint (optimizer state appears
//!   during it, so it peaks low): it can trigger a shrink, never growth, and is not fitted.
//! - A shrink is judged by the next reading at the same length or shorter (or longer with
//!   a batch still smaller): if usage did not follow, the memory is not the batch's
//!   (allocator cache, heap fragmentation, another process) and the controller holds
//!   ([`ShrinkCheck::Unresponsive`]) until usage falls under target. A shrink whose outcome
//!   cannot tell is not judged: one made on the first step, or one by less than 40%
//!   planned on one size.
//! - A growth is judged by its first reading: over target, it overshot.
//! - Readings over target at one size, several in a row, are drift, unless they sit within
//!   the size's own scatter.
//! - A step at or over critical, or an OOM, teaches a [`Ceiling`]: sizes of that many
//!   tokens or more are avoided until it is forgotten.
use super::estimate::Estimate;
use super::messages::{Decision, StepObservation};

/// Steps above target (below warning) at one size before acting: one reading there is
/// noise, several in a row are drift.
pub(super) const OVER_TARGET_STEPS: u32 = 3;
/// A shrink expected to lower usage by at least this share of the limit, that lowered it
/// by less than a quarter of that, marks the footprint as not following the batch.
const MIN_EXPECTED_DROP: f64 = 0.01;

/// A shrink whose effect the next step at the same length shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PendingShrink {
    pub from: usize,
    /// Usage measured (or forecast) at `from`.
    pub before: f64,
    pub seq_len: usize,
    /// The model had one size when the shrink was decided: its fixed part was a guess.
    pub guessed: bool,
    /// Decided on the run's first step.
    pub first: bool,
}

/// What the latest shrink showed of whether memory follows the batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ShrinkCheck {
    /// Nothing to judge: memory has followed the batch as far as anyone can tell.
    #[default]
    Clear,
    /// A shrink awaits the reading that judges it.
    Pending(PendingShrink),
    /// A shrink did not lower usage: the memory is held apart from the batch. Readings
    /// say nothing of its cost and no rule shrinks for usage (an OOM is still recovered),
    /// until usage falls under target or the batch grows.
    Unresponsive,
}

impl ShrinkCheck {
    /// A resize replaced the size a pending shrink was about; a growth also ends the
    /// hold on held memory.
    pub fn resized(&mut self, grew: bool) {
        match self {
            ShrinkCheck::Pending(_) => *self = ShrinkCheck::Clear,
            ShrinkCheck::Unresponsive if grew => *self = ShrinkCheck::Clear,
            _ => {}
        }
    }
    /// Usage fell under target: whatever held memory has let it go.
    pub fn under_target(&mut self) {
        if *self == ShrinkCheck::Unresponsive {
            *self = ShrinkCheck::Clear;
        }
    }
    /// Sets (or, `None`, drops) the shrink to judge.
    pub fn expect(&mut self, p: Option<PendingShrink>) {
        match p {
            Some(p) => *self = ShrinkCheck::Pending(p),
            None => self.resized(false),
        }
    }
    /// The pending shrink, taken for judging.
    pub fn take(&mut self) -> Option<PendingShrink> {
        match *self {
            ShrinkCheck::Pending(p) => {
                *self = ShrinkCheck::Clear;
                Some(p)
            }
            _ => None,
        }
    }
    pub fn pending(&self) -> Option<PendingShrink> {
        match *self {
            ShrinkCheck::Pending(p) => Some(p),
            _ => None,
        }
    }
    pub fn is_unresponsive(&self) -> bool {
        *self == ShrinkCheck::Unresponsive
    }
}

/// Sizes of this many tokens or more are avoided: learned from an OOM or a step at or
/// over critical, raised by 10% after a long run without one.
#[derive(Debug, Clone, Default)]
pub struct Ceiling {
    tokens: Option<u64>,
    clean_steps: u64,
}

impl Ceiling {
    pub fn tokens(&self) -> Option<u64> {
        self.tokens
    }

    /// Lowers the ceiling to `tokens` (never below `one`, a sequence of the planned
    /// length) if that is lower; the decision when it changed.
    pub fn learn(
        &mut self,
        micro_batch: usize,
        tokens: u64,
        one: u64,
        usage: f64,
    ) -> Option<Decision> {
        self.clean_steps = 0;
        let tokens = tokens.max(one);
        if self.tokens.is_some_and(|c| c <= tokens) {
            return None;
        }
        self.tokens = Some(tokens);
        Some(Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        })
    }

    /// One clean step: after `forget_every` of them the ceiling rises by 10%, and goes
    /// once above `max_tokens` (the largest size allowed at the planned length).
    pub fn clean_step(
        &mut self,
        forget_every: u64,
        max_tokens: impl FnOnce() -> u64,
    ) -> Option<Decision> {
        self.clean_steps += 1;
        let c = self.tokens?;
        if self.clean_steps < forget_every {
            return None;
        }
        self.clean_steps = 0;
        let raised = c + c / 10 + 1;
        self.tokens = (raised <= max_tokens()).then_some(raised);
        Some(Decision::CeilingRaised {
            tokens: self.tokens,
        })
    }

    /// Largest micro-batch under the ceiling for `seq_len` (at least `floor`).
    pub fn batch(&self, seq_len: usize, floor: usize) -> usize {
        match self.tokens {
            Some(c) => ((c.saturating_sub(1) / seq_len.max(1) as u64) as usize).max(floor),
            None => usize::MAX,
        }
    }
}

/// With a non-negative fixed part, a micro-batch of `tokens × target / usage` tokens would
/// still be at or above target after a reading of `usage` at `tokens`: the ceiling such a
/// reading teaches (never below half the tokens that set it).
pub fn over_target_bound(tokens: u64, target: f64, usage: f64) -> u64 {
    ((tokens as f64 * target / usage).floor() as u64).max(tokens / 2)
}

/// What the readings so far mean for the next one.
#[derive(Debug, Clone, Default)]
pub struct Evidence {
    /// Whether the run's first step has been observed.
    pub seen_first: bool,
    pub shrink: ShrinkCheck,
    /// The size grown from, until the first reading at the new size.
    pub grown_from: Option<usize>,
    /// Consecutive steps measured above target at the current size.
    pub over_target: u32,
    pub ceiling: Ceiling,
}

/// At most this share of the batch's memory at the shrink's size and length is left in
/// `obs`, if memory follows the batch: tokens scale it, and a token in a longer sequence
/// costs at most that much more (all of it attention).
pub fn shrunk_batch_share(p: PendingShrink, obs: StepObservation) -> f64 {
    let stretch = (obs.seq_len as f64 / p.seq_len.max(1) as f64).max(1.0);
    obs.micro_batch as f64 / p.from.max(1) as f64 * stretch * stretch
}

/// Whether usage `usage` at `obs`, the first reading to judge shrink `p`, shows memory
/// that did not follow the batch. Unjudged shrinks and falls that match what the
/// estimate expects say no.
pub fn held_apart(est: &Estimate, obs: StepObservation, p: PendingShrink, usage: f64) -> bool {
    let before = p.before;
    // The fit's own slope, not the steepest within the noise that growth follows: that
    // one bounds the cost from above, and the least drop that following memory shows
    // is what a shrink is judged by.
    let fitted = est.has_own_slope();
    let expected = match (
        fitted,
        est.fitted_bytes(p.from, obs.seq_len),
        est.fitted_bytes(obs.micro_batch, obs.seq_len),
    ) {
        (true, Some(a), Some(b)) => a.saturating_sub(b) as f64 / est.limit_bytes() as f64,
        // One size measured: only the part above the fixed part follows the batch. Taking
        // all of it as the batch's would expect a halving to halve usage, and judge a
        // shrink over a large fixed part not to have worked.
        _ => {
            let fixed = est.one_size_fixed() / est.limit_bytes() as f64;
            (before - fixed).max(0.0) * (1.0 - shrunk_batch_share(p, obs))
        }
    };
    // Without a baseline the fixed part is unknown: a fall larger than readings scatter
    // by (both ends of the noise) is the batch's memory going, whatever the guess
    // expected.
    let moved = before - usage > 2.0 * est.noise() * before;
    let followed =
        before - usage >= expected / 4.0 || (moved && !fitted && est.baseline().is_none());
    // Planned on one size, a shrink by less than 40% assumed the least fixed part
    // there could be: with a large one its effect is within the noise, and judging it
    // would hold the run where it is. The readings at both sizes now fit the fixed
    // part; the next shrink, planned on them, is judged. Nor is a shrink made on the
    // run's first step, which peaks low (optimizer state appears during it): the state
    // arriving reads as memory that did not follow the batch. The next shrink is judged
    // (and is at most a half).
    let small = obs.micro_batch as f64 > 0.6 * p.from as f64;
    let unjudged = (p.guessed && small) || p.first;
    !(expected < MIN_EXPECTED_DROP || followed || unjudged)
}

/// One reading, as the rules act on it (the controller takes it in and hands it to them).
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    pub obs: StepObservation,
    pub tokens: u64,
    /// Peak over the limit.
    pub usage: f64,
    /// The run's first step.
    pub first: bool,
    /// Measured at the size in force (not one a forecast has since changed).
    pub current: bool,
    /// The first reading of the one probe past a worst case above critical.
    pub risk_probed: bool,
    /// The first reading judging a shrink made on the first step.
    pub after_first_shrink: bool,
    /// The size a growth came from, on the growth's first reading.
    pub grown_from: Option<usize>,
    /// The length sizes are planned for after this step.
    pub seq: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(from: usize, before: f64) -> PendingShrink {
        PendingShrink {
            from,
            before,
            seq_len: 64,
            guessed: false,
            first: false,
        }
    }

    fn obs(micro_batch: usize, seq_len: usize, usage: f64) -> StepObservation {
        StepObservation {
            step: 9,
            micro_batch,
            seq_len,
            peak_bytes: (usage * 1e9) as u64,
        }
    }

    #[test]
    fn a_shrink_check_is_dropped_by_a_resize_and_held_memory_by_growth_or_room() {
        let mut s = ShrinkCheck::default();
        s.expect(Some(pending(10, 0.97)));
        assert_eq!(s.pending().map(|p| p.from), Some(10));
        s.resized(false);
        assert_eq!(s, ShrinkCheck::Clear);
        s = ShrinkCheck::Unresponsive;
        s.resized(false);
        s.expect(None);
        assert!(s.is_unresponsive(), "only a growth or room ends the hold");
        s.resized(true);
        assert_eq!(s, ShrinkCheck::Clear);
        s = ShrinkCheck::Unresponsive;
        s.under_target();
        assert_eq!(s, ShrinkCheck::Clear);
        s.expect(Some(pending(10, 0.97)));
        assert!(s.take().is_some() && s.take().is_none());
    }

    #[test]
    fn a_ceiling_never_goes_below_one_sequence_and_rises_after_clean_steps() {
        let mut c = Ceiling::default();
        assert_eq!(c.batch(64, 1), usize::MAX);
        assert!(c.learn(10, 100, 65, 1.0).is_some());
        assert_eq!(c.tokens(), Some(100));
        // Higher: nothing learned. Lower than one sequence: one sequence.
        assert!(c.learn(10, 200, 65, 1.0).is_none());
        assert!(c.learn(1, 10, 65, 1.0).is_some());
        assert_eq!(c.tokens(), Some(65));
        assert_eq!(c.batch(64, 1), 1);
        assert!(c.clean_step(3, || 1000).is_none());
        assert!(c.clean_step(3, || 1000).is_none());
        assert_eq!(
            c.clean_step(3, || 1000),
            Some(Decision::CeilingRaised { tokens: Some(72) })
        );
        // Raised past the largest size allowed: dropped.
        c.clean_step(1, || 70);
        assert_eq!(c.tokens(), None);
        assert_eq!(over_target_bound(1000, 0.9, 0.95), 947);
        assert_eq!(over_target_bound(1000, 0.9, 3.0), 500);
    }

    #[test]
    fn a_shrink_is_held_apart_only_when_usage_did_not_follow_and_it_could_tell() {
        let est = Estimate::new(0.02, false, 1_000_000_000);
        // Nothing measured: a halving from 97% with no fixed part known expects half.
        assert!(held_apart(
            &est,
            obs(5, 64, 0.965),
            pending(10, 0.97),
            0.965
        ));
        assert!(!held_apart(&est, obs(5, 64, 0.6), pending(10, 0.97), 0.6));
        // Made on the first step, or by a little on a guessed fixed part: not judged.
        let first = PendingShrink {
            first: true,
            ..pending(10, 0.97)
        };
        assert!(!held_apart(&est, obs(5, 64, 0.965), first, 0.965));
        let guessed = PendingShrink {
            guessed: true,
            ..pending(10, 0.97)
        };
        assert!(!held_apart(&est, obs(8, 64, 0.965), guessed, 0.965));
        assert!(shrunk_batch_share(pending(10, 0.97), obs(5, 128, 0.5)) == 2.0);
    }

    /// Without a baseline the fixed part is a guess: a fall beyond the noise is the
    /// batch's memory going, even where the guess expected more (a shrink from 112% to
    /// 98% over a fixed part of 0.83 would otherwise hold the run at critical).
    #[test]
    fn a_fall_beyond_the_noise_follows_the_batch_when_the_fixed_part_is_a_guess() {
        let est = Estimate::new(0.02, false, 1_000_000_000);
        assert!(!held_apart(&est, obs(5, 64, 0.98), pending(10, 1.12), 0.98));
    }

    /// Planned on one size, a shrink by less than 40% is not judged: over a large fixed
    /// part its effect is within the noise (656 → 604 read 95.6% then 95.2%).
    #[test]
    fn a_small_shrink_planned_on_one_size_is_not_judged() {
        let est = Estimate::new(0.02, false, 1_000_000_000);
        let guessed = PendingShrink {
            guessed: true,
            ..pending(656, 0.956)
        };
        assert!(!held_apart(&est, obs(604, 64, 0.952), guessed, 0.952));
        assert!(held_apart(
            &est,
            obs(604, 64, 0.952),
            pending(656, 0.956),
            0.952
        ));
    }
}
