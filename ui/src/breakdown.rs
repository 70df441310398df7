//! What the memory panel's stacked bar shows: a step's peak split into what is fixed
//! (parameters, gradients, optimizer state), what grows with the batch (activations at
//! the micro-batch the step ran), what the cache holds (reserved − allocated on CUDA;
//! on the CPU the heap's resident memory outside live allocations) and what lies outside
//! (on CUDA the device memory the allocator does not hold; on the CPU the rest of the
//! process: libtorch, the corpus, the interpreter). The drawing is `view::breakdown`.
use headroom_core::{PlanSplit, StepMemory, SystemSample, Telemetry};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct BreakdownState {
    /// The run's plan, once its start probe sent it.
    pub split: Option<PlanSplit>,
}

/// One step's memory, by part (bytes), against its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    pub fixed: u64,
    pub batch: u64,
    pub cache: u64,
    pub outside: u64,
    pub limit: u64,
}

impl Parts {
    /// The parts in bar order with their names.
    pub fn named(&self) -> [(&'static str, u64); 4] {
        [
            ("fixed", self.fixed),
            ("batch", self.batch),
            ("cache", self.cache),
            ("outside", self.outside),
        ]
    }
}

impl BreakdownState {
    pub fn observe(&mut self, msg: &Telemetry) {
        if let Telemetry::PlanSplit(s) = msg {
            self.split = Some(s.clone());
        }
    }

    /// The split of step `m`'s peak, with the sampler's latest cache figures; None before
    /// the plan is known.
    pub fn parts(&self, m: &StepMemory, sample: Option<&SystemSample>) -> Option<Parts> {
        let s = self.split.as_ref()?;
        let fixed = s.model_bytes;
        let batch = (s.activations_per_token * (m.micro_batch * m.seq_len) as f64) as u64;
        let (cache, outside) = match sample {
            Some(SystemSample {
                allocator: Some(a),
                gpu,
                ..
            }) => {
                let outside = gpu
                    .as_ref()
                    .map_or(0, |g| g.mem_used.saturating_sub(a.reserved));
                (a.reserved.saturating_sub(a.allocated), outside)
            }
            Some(SystemSample { heap: Some(h), .. }) => {
                let cache = h.held_apart();
                (cache, m.peak_bytes.saturating_sub(fixed + batch + cache))
            }
            // No cache figures: the peak less the model and the batch lies outside.
            _ => (0, m.peak_bytes.saturating_sub(fixed + batch)),
        };
        Some(Parts {
            fixed,
            batch,
            cache,
            outside,
            limit: m.limit_bytes.max(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::{AllocatorStats, GpuStats, HeapStats};

    const MIB: u64 = 1 << 20;

    fn step(mb: usize, peak: u64) -> StepMemory {
        StepMemory {
            step: 3,
            micro_batch: mb,
            seq_len: 64,
            peak_bytes: peak,
            predicted_bytes: None,
            limit_bytes: 1024 * MIB,
            configured_limit_bytes: 1024 * MIB,
            usage: peak as f64 / (1024 * MIB) as f64,
        }
    }

    fn state() -> BreakdownState {
        let mut s = BreakdownState::default();
        assert_eq!(s.parts(&step(8, 500 * MIB), None), None, "no plan yet");
        s.observe(&Telemetry::PlanSplit(PlanSplit {
            model_bytes: 13 * MIB,
            overhead_bytes: 360 * MIB,
            activations_per_token: (MIB / 16) as f64,
        }));
        s
    }

    #[test]
    fn cpu_splits_the_peak_by_plan_and_heap() {
        let sample = SystemSample {
            heap: Some(HeapStats {
                rss_anon: 300 * MIB,
                in_use: 280 * MIB,
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = state().parts(&step(8, 450 * MIB), Some(&sample)).unwrap();
        // 8 × 64 tokens of 64 KiB: 32 MiB of activations; 20 MiB held apart.
        assert_eq!((p.fixed, p.batch, p.cache), (13 * MIB, 32 * MIB, 20 * MIB));
        assert_eq!(p.outside, 450 * MIB - 65 * MIB);
    }

    #[test]
    fn cuda_takes_cache_and_outside_from_the_allocator_and_the_device() {
        let sample = SystemSample {
            allocator: Some(AllocatorStats {
                allocated: 200 * MIB,
                reserved: 260 * MIB,
                ..Default::default()
            }),
            gpu: Some(GpuStats {
                mem_used: 760 * MIB,
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = state().parts(&step(16, 700 * MIB), Some(&sample)).unwrap();
        assert_eq!(
            (p.batch, p.cache, p.outside),
            (64 * MIB, 60 * MIB, 500 * MIB)
        );
    }
}
