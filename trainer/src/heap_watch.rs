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

/// A peak this far (share of the limit) over the prediction is not the model's error:
/// more than the margin's cap (3%) with room for the meter's scatter.
const EXCESS: f64 = 0.05;
/// Steps that far over before saying so: one can be a young fit.
const STEPS: u32 = 3;

#[derive(Debug, Default)]
pub struct HeapWatch {
    /// Steps that peaked [`EXCESS`] or more over the prediction, and the largest excess.
    over: u32,
    most: u64,
    said: bool,
}

impl HeapWatch {
    /// A step peaked at `peak` bytes where `predicted` was expected. Returns the notice's
    /// text on the [`STEPS`]th step over the prediction by [`EXCESS`] of `limit`.
    pub fn after_step(&mut self, peak: u64, predicted: Option<u64>, limit: u64) -> Option<String> {
        let excess = peak.saturating_sub(predicted?);
        if self.said || (excess as f64) < EXCESS * limit as f64 {
            return None;
        }
        self.over += 1;
        self.most = self.most.max(excess);
        if self.over < STEPS {
            return None;
        }
        self.said = true;
        Some(format!(
            "the heap, not the batch, holds memory: {} steps peaked up to {} ({:.0} points of \
             the limit) over what this run's own steps say the batch needs. glibc keeps \
             freed tensors' memory fragmented, and the micro-batch is sized down for it. To \
             make memory follow tensors, start the run with \
             GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576 (measured: peaks 9 points \
             lower, steps 18% slower; 262144: 20 points lower, 35% slower; docs/BENCHMARKS.md)",
            self.over,
            headroom_core::units::fmt_bytes(self.most),
            self.most as f64 * 100.0 / limit as f64
        ))
    }
}

/// Whether glibc's mmap threshold was set for this process (by the user through
/// `GLIBC_TUNABLES`, or by `--hard-limit`): then the resident set follows tensors already.
pub fn mmap_threshold_set(hard_limit: bool) -> bool {
    hard_limit || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc.mmap_threshold"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const LIMIT: u64 = 1000 * MIB;

    #[test]
    fn peaks_well_over_the_prediction_are_said_once_on_the_third() {
        let mut w = HeapWatch::default();
        // No prediction yet, and the model's own error: nothing.
        assert_eq!(w.after_step(900 * MIB, None, LIMIT), None);
        assert_eq!(w.after_step(730 * MIB, Some(700 * MIB), LIMIT), None);
        assert_eq!(w.after_step(500 * MIB, Some(700 * MIB), LIMIT), None);
        assert_eq!(w.after_step(780 * MIB, Some(700 * MIB), LIMIT), None);
        assert_eq!(w.after_step(860 * MIB, Some(700 * MIB), LIMIT), None);
        let said = w
            .after_step(760 * MIB, Some(700 * MIB), LIMIT)
            .expect("the third step 5% over");
        assert!(
            said.starts_with("the heap, not the batch, holds memory: 3 steps peaked up to 160"),
            "{said}"
        );
        assert!(
            said.contains("GLIBC_TUNABLES=glibc.malloc.mmap_threshold="),
            "{said}"
        );
        assert_eq!(
            w.after_step(990 * MIB, Some(700 * MIB), LIMIT),
            None,
            "once"
        );
    }
}
