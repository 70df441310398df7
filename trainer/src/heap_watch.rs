//! On the CPU with a soft budget: whether glibc's heap, not the batch, holds the memory the
//! controller sizes the micro-batch by, and what to do about it.
//!
//! The controller predicts each step's peak from the run's own readings. With glibc's
//! default mmap threshold, large tensors come from the heap, and freed ones leave holes
//! that tensors of another length or size do not fit: the heap grows around them, and a
//! step peaks well over what the batch itself needs. Under `--hard-limit` (a 64 KiB
//! threshold: tensors mmapped, the resident set following them) the prediction held
//! within 3.5% of the limit on random lengths 32–256 and within 0.6% once fitted; without
//! it, on random lengths 64–256 and a 700 MiB budget, 20 of 55 steps peaked 5 to 16
//! points over it, and the controller shrank for each. Three such steps say that the heap
//! holds that memory, once, with glibc's setting that makes memory follow tensors and its
//! measured cost (docs/BENCHMARKS.md, the mmap-threshold table).
//!
//! A fit that learns the excess does not see it: on a length ramp the fragmentation grows
//! with the lengths, the readings follow their fit, and a run ended at micro-batch 11 at
//! 87.5% where a hard cap, tensors mmapped, fits 52. So a step is also judged against the
//! tensors it held: its peak over the largest heap in use the sampler saw during it, plus
//! what the process holds outside the heap. Under a hard cap that reads 2–5% of the limit
//! (a 4 Hz sampler misses the live peak by that much), 13–15 points on a soft fixed-length
//! run at the size fixed runs fit; over a fragmented heap, 15–29 points on random lengths
//! and 18–20 at the ramp's end.

/// A peak this far (share of the limit) over the prediction is not the model's error:
/// more than the margin's cap (3%) with room for the meter's scatter.
const EXCESS: f64 = 0.05;
/// A peak this far (share of the limit) over the tensors the step held is the heap's: past
/// what a 4 Hz sampler's view of the live peak misses (at most 5% under a hard cap; 13–15%
/// on the soft fixed-length run, whose size is what fixed runs fit, so it is no excess).
const EXCESS_OVER_LIVE: f64 = 0.17;
/// Steps that far over before saying so: one can be a young fit.
const STEPS: u32 = 3;

#[derive(Debug, Default)]
pub struct HeapWatch {
    /// Steps that peaked [`EXCESS`] or more over the prediction (or
    /// [`EXCESS_OVER_LIVE`] over the tensors held), and the largest excess.
    over: u32,
    most: u64,
    said: bool,
    /// The least the process was seen to hold outside the heap's allocations at a step's
    /// start (resident set − heap in use): libraries, stacks, the interpreter.
    outside_heap: Option<u64>,
}

impl HeapWatch {
    /// A step starts, the process holding `rss` bytes of which the heap's allocations are
    /// `in_use` (`None` where malloc is not glibc's).
    pub fn step_started(&mut self, rss: Option<u64>, in_use: Option<u64>) {
        if let (Some(r), Some(u)) = (rss, in_use) {
            let outside = r.saturating_sub(u);
            self.outside_heap = Some(self.outside_heap.map_or(outside, |o| o.min(outside)));
        }
    }

    /// A step peaked at `peak` bytes where `predicted` was expected, its tensors holding at
    /// most `live` bytes of the heap (`None`: not seen). Returns the notice's text on the
    /// [`STEPS`]th step over the prediction by [`EXCESS`] of `limit`, or over the tensors
    /// by [`EXCESS_OVER_LIVE`].
    pub fn after_step(
        &mut self,
        peak: u64,
        predicted: Option<u64>,
        live: Option<u64>,
        limit: u64,
    ) -> Option<String> {
        let over = |base: Option<u64>, share: f64| {
            base.map(|b| peak.saturating_sub(b))
                .filter(|&e| e as f64 >= share * limit as f64)
        };
        let held = live.zip(self.outside_heap).map(|(l, o)| l + o);
        let excess = over(predicted, EXCESS).max(over(held, EXCESS_OVER_LIVE));
        let excess = excess.filter(|_| !self.said)?;
        self.over += 1;
        self.most = self.most.max(excess);
        if self.over < STEPS {
            return None;
        }
        self.said = true;
        Some(format!(
            "the heap, not the batch, holds memory: {} steps peaked up to {} ({:.0} points of \
             the limit) over what the batch needs (the tensors alive in the step, or what \
             this run's own steps predict). glibc keeps \
             freed tensors' memory fragmented, and the micro-batch is sized down for it. To \
             make memory follow tensors, start the run with jemalloc preloaded \
             (LD_PRELOAD=libjemalloc.so.2, from the libjemalloc2 package; measured: peaks 15 \
             points lower at no cost in speed, and the controller settled at twice the \
             micro-batch) or with GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576 (peaks 9 \
             points lower, steps 18% slower; docs/BENCHMARKS.md, \"Another malloc\")",
            self.over,
            headroom_core::units::fmt_bytes(self.most),
            self.most as f64 * 100.0 / limit as f64
        ))
    }
}

pub use headroom_host::procmem::mmap_threshold_set;

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const LIMIT: u64 = 1000 * MIB;

    #[test]
    fn peaks_well_over_the_prediction_are_said_once_on_the_third() {
        let mut w = HeapWatch::default();
        // No prediction yet, and the model's own error: nothing.
        assert_eq!(w.after_step(900 * MIB, None, None, LIMIT), None);
        assert_eq!(w.after_step(730 * MIB, Some(700 * MIB), None, LIMIT), None);
        assert_eq!(w.after_step(500 * MIB, Some(700 * MIB), None, LIMIT), None);
        assert_eq!(w.after_step(780 * MIB, Some(700 * MIB), None, LIMIT), None);
        assert_eq!(w.after_step(860 * MIB, Some(700 * MIB), None, LIMIT), None);
        let said = w
            .after_step(760 * MIB, Some(700 * MIB), None, LIMIT)
            .expect("the third step 5% over");
        assert!(
            said.starts_with("the heap, not the batch, holds memory: 3 steps peaked up to 160"),
            "{said}"
        );
        assert!(
            said.contains("GLIBC_TUNABLES=glibc.malloc.mmap_threshold=")
                && said.contains("LD_PRELOAD=libjemalloc.so.2"),
            "{said}"
        );
        assert_eq!(
            w.after_step(990 * MIB, Some(700 * MIB), None, LIMIT),
            None,
            "once"
        );
    }

    /// The ramp's case: the readings follow the fit (no prediction is exceeded), but each
    /// peak stands 20 points over the tensors the step held.
    #[test]
    fn peaks_over_the_tensors_held_are_said_though_the_fit_follows_them() {
        let mut w = HeapWatch::default();
        w.step_started(Some(420 * MIB), Some(100 * MIB));
        w.step_started(Some(400 * MIB), Some(100 * MIB));
        // 300 MiB outside the heap; tensors at most 380 MiB: 680 held, peaks 880 (20 points).
        let step = |w: &mut HeapWatch, live| w.after_step(880 * MIB, Some(875 * MIB), live, LIMIT);
        // As a hard cap reads (4% over what the sampler saw alive), and unseen: nothing.
        assert_eq!(w.after_step(880 * MIB, None, Some(540 * MIB), LIMIT), None);
        assert_eq!(step(&mut w, None), None);
        assert_eq!(step(&mut w, Some(380 * MIB)), None);
        assert_eq!(step(&mut w, Some(380 * MIB)), None);
        let said = step(&mut w, Some(380 * MIB)).expect("the third step 20 points over");
        assert!(
            said.starts_with("the heap, not the batch, holds memory: 3 steps peaked up to 200"),
            "{said}"
        );
    }
}
