//! What the CPU heap panel knows: the sampler's latest heap figures and what the screen
//! learns from their sequence (the step a trim came at, the most ever held apart). The
//! drawing is in `view::heap`.
use headroom_core::HeapStats;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeapState {
    /// The latest figures; `None` until a sample carries them (a CUDA run, another malloc,
    /// a log from before they were recorded).
    pub now: Option<HeapStats>,
    /// The last completed step when the trim count last rose; `None` when no trim came
    /// while this screen watched (a view attached after it knows only that it happened).
    pub last_trim_after_step: Option<u64>,
    /// The most anonymous memory held apart from live allocations in any sample, and the
    /// step it was seen after.
    pub most_held_apart: Option<(u64, u64)>,
}

impl HeapState {
    /// A sample's heap figures, seen after `step` completed steps.
    pub fn observe(&mut self, heap: Option<&HeapStats>, step: u64) {
        let Some(h) = heap else {
            return;
        };
        if let Some(prev) = &self.now {
            if h.trims > prev.trims {
                self.last_trim_after_step = Some(step);
            }
        }
        let held = h.held_apart();
        if self.most_held_apart.is_none_or(|(most, _)| held > most) {
            self.most_held_apart = Some((held, step));
        }
        self.now = Some(h.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap(rss_anon: u64, in_use: u64, trims: u64) -> HeapStats {
        HeapStats {
            rss_anon,
            in_use,
            free_kept: 0,
            trims,
            last_trim_freed: (trims > 0).then_some(7),
        }
    }

    #[test]
    fn a_rising_trim_count_dates_the_trim_and_the_most_held_apart_is_kept() {
        let mut s = HeapState::default();
        s.observe(None, 1);
        assert_eq!(s, HeapState::default(), "nothing measured, nothing known");
        // Attached after two trims: when they came is not known.
        s.observe(Some(&heap(1000, 600, 2)), 3);
        assert_eq!(s.last_trim_after_step, None);
        assert_eq!(s.most_held_apart, Some((400, 3)));
        s.observe(Some(&heap(1000, 900, 2)), 4);
        assert_eq!(s.last_trim_after_step, None);
        s.observe(Some(&heap(800, 700, 3)), 9);
        assert_eq!(s.last_trim_after_step, Some(9));
        assert_eq!(s.most_held_apart, Some((400, 3)));
        assert_eq!(s.now.as_ref().unwrap().trims, 3);
    }
}
