//! Which sampler readings the run log keeps: at most one in each [`LOG_SAMPLE_EVERY`] of
//! the run's clock, the one using the most memory (a viewer's catch-up keeps the same). The screen and the viewers get every
//! reading (20 Hz by default); a log written for a week stays the size it had at 4 Hz. A
//! step's own peak is in its `step_memory` record (the allocator's and the kernel's
//! high-water marks), so what a thinned chart can miss between readings, the log still has.
use headroom_core::{kept_sample_slot, Record, Telemetry};

/// The run-clock span of each slot that keeps one reading: 4 a second.
pub use headroom_core::KEPT_SAMPLE_EVERY as LOG_SAMPLE_EVERY;

/// The reading held for its slot, and the last slot written: records go to the file in
/// the order they came, so a slot another record was written after is closed.
#[derive(Debug, Default)]
pub struct Thinning {
    held: Option<(i64, Record)>,
    closed: Option<i64>,
}

impl Thinning {
    /// `rec` came; returns what to write before it, then whether to write it too. A
    /// reading is held for its slot (one using more memory replaces it) and written when
    /// a later slot's reading or any other record comes.
    pub fn offer(&mut self, rec: Record) -> (Option<Record>, Option<Record>) {
        let Telemetry::Sample(s) = &rec.msg else {
            return (self.take(), Some(rec));
        };
        let slot = kept_sample_slot(rec.t);
        if self.closed.is_some_and(|c| slot <= c) {
            return (None, None);
        }
        match &self.held {
            Some((held_slot, held)) if *held_slot == slot => {
                if used(held).is_some_and(|u| s.memory_used() > u) {
                    self.held = Some((slot, rec));
                }
                (None, None)
            }
            _ => {
                let before = self.take();
                self.held = Some((slot, rec));
                (before, None)
            }
        }
    }

    /// The reading held, to write now (another record follows, or the log ends).
    pub fn take(&mut self) -> Option<Record> {
        let (slot, rec) = self.held.take()?;
        self.closed = Some(slot);
        Some(rec)
    }
}

fn used(rec: &Record) -> Option<u64> {
    match &rec.msg {
        Telemetry::Sample(s) => Some(s.memory_used()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::{GpuStats, Level, Notice, SystemSample};

    fn sample(t: f64, rss: u64) -> Record {
        let mut s = SystemSample::default();
        s.host.process_rss = rss;
        Record {
            ts: 1e9 + t,
            t,
            msg: Telemetry::Sample(s),
        }
    }

    fn step(t: f64, n: u64) -> Record {
        Record {
            ts: 1e9 + t,
            t,
            msg: Telemetry::Notice(Notice::new(Level::Info, "step", n.to_string())),
        }
    }

    /// Feeds `records` through the thinning as the writer does; what reaches the file.
    fn written(records: Vec<Record>) -> Vec<Record> {
        let mut thin = Thinning::default();
        let mut out = Vec::new();
        for rec in records {
            let (before, now) = thin.offer(rec);
            out.extend(before);
            out.extend(now);
        }
        out.extend(thin.take());
        out
    }

    fn describe(recs: &[Record]) -> Vec<String> {
        recs.iter()
            .map(|r| match &r.msg {
                Telemetry::Sample(s) => format!("sample {:.2} {}", r.t, s.host.process_rss),
                Telemetry::Notice(n) => format!("step {}", n.text),
                _ => "other".into(),
            })
            .collect()
    }

    /// 20 Hz readings: one a quarter second, the highest of its slot, in time order.
    #[test]
    fn twenty_readings_a_second_keep_the_highest_of_each_quarter() {
        let readings = (0..20)
            .map(|i| sample(i as f64 * 0.05, [5, 9, 7, 1, 3][i % 5] * 100 + i as u64))
            .collect();
        assert_eq!(
            describe(&written(readings)),
            [
                "sample 0.05 901",
                "sample 0.30 906",
                "sample 0.55 911",
                "sample 0.80 916",
            ]
        );
    }

    /// Another record closes the slot: the reading held goes first (the file stays in
    /// time order), a later reading of that slot is not written, nothing else is dropped.
    #[test]
    fn a_step_writes_the_held_reading_first_and_closes_its_slot() {
        let got = written(vec![
            sample(0.00, 100),
            step(0.02, 1),
            sample(0.05, 900),
            step(0.07, 2),
            step(0.09, 3),
            sample(0.26, 200),
            sample(0.31, 150),
        ]);
        assert_eq!(
            describe(&got),
            [
                "sample 0.00 100",
                "step 1",
                "step 2",
                "step 3",
                "sample 0.26 200"
            ]
        );
    }

    /// On a GPU the device's memory decides, not the host process's.
    #[test]
    fn on_a_gpu_the_devices_memory_decides() {
        let gpu = |t: f64, used: u64, rss: u64| {
            let mut r = sample(t, rss);
            if let Telemetry::Sample(s) = &mut r.msg {
                s.gpu = Some(GpuStats {
                    mem_used: used,
                    ..Default::default()
                });
            }
            r
        };
        let got = written(vec![gpu(0.0, 5, 900), gpu(0.1, 7, 100)]);
        assert_eq!(describe(&got), ["sample 0.10 100"]);
    }

    /// Up to 4 a second nothing is thinned: a run asking 4 Hz logs what it logged before.
    #[test]
    fn four_readings_a_second_are_all_kept() {
        let readings: Vec<Record> = (0..12).map(|i| sample(i as f64 * 0.25 + 0.01, 1)).collect();
        assert_eq!(written(readings.clone()).len(), readings.len());
    }
}
