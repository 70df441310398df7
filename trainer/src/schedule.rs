//! Learning rate: linear warmup, then cosine decay to a floor. A pure function of the step,
//! so a resumed run continues on the same curve with no state to save.
use headroom_core::config::OptimSection;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl Schedule {
    pub fn new(optim: &OptimSection, total_steps: u64) -> Schedule {
        Schedule {
            lr: optim.lr,
            min_lr: optim.min_lr,
            warmup_steps: optim.warmup_steps,
            total_steps,
        }
    }

    /// Learning rate of optimizer step `step` (1-based): `lr * step / warmup` up to
    /// `warmup_steps` (so the last warmup step uses the full `lr`, and the first is not
    /// wasted at 0), then a half cosine reaching `min_lr` at `total_steps`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let step = step.max(1);
        if step <= self.warmup_steps {
            return self.lr * step as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps);
        if decay_steps == 0 {
            return self.lr;
        }
        let progress = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + cosine * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched() -> Schedule {
        Schedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            total_steps: 100,
        }
    }

    #[test]
    fn endpoints() {
        let s = sched();
        assert!((s.lr_at(1) - 1e-4).abs() < 1e-15);
        assert_eq!(s.lr_at(10), 1e-3);
        assert!((s.lr_at(100) - 1e-4).abs() < 1e-15);
        // Past the end (a run extended without a new schedule) stays at the floor.
        assert!((s.lr_at(150) - 1e-4).abs() < 1e-15);
        // Midway through the decay: halfway between lr and min_lr.
        assert!((s.lr_at(55) - 5.5e-4).abs() < 1e-12);
    }

    #[test]
    fn rises_then_falls_monotonically() {
        let s = sched();
        let lrs: Vec<f64> = (1..=100).map(|i| s.lr_at(i)).collect();
        assert!(lrs[..10].windows(2).all(|w| w[0] < w[1]));
        assert!(lrs[9..].windows(2).all(|w| w[0] > w[1]));
        assert!(lrs.iter().all(|&l| (1e-4 - 1e-15..=1e-3).contains(&l)));
    }

    #[test]
    fn no_warmup_and_warmup_past_the_end() {
        let s = Schedule {
            warmup_steps: 0,
            ..sched()
        };
        assert!(s.lr_at(1) < 1e-3 && s.lr_at(1) > 9.9e-4);
        let s = Schedule {
            warmup_steps: 200,
            ..sched()
        };
        assert!((s.lr_at(100) - 5e-4).abs() < 1e-15);
    }
}
