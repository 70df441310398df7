//! Evaluation as its own phase of the run, as the training panel shows it: the memory of
//! the last pass that ended (its `eval_memory` record), and an evaluation that failed
//! because not even one sample fitted. Evaluation's OOMs reach the event log and the
//! memory chart's marks through `policy`, beside training's; the drawing is in
//! `view::training`.
use headroom_core::{EvalMemory, Telemetry};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalState {
    /// The last pass that ended; `None` before one did (a run without evaluation, a
    /// producer that does not size its evaluation, a log from before the record).
    pub last: Option<EvalMemory>,
    /// An evaluation that ran out of memory at one sample and failed: shown until a later
    /// pass ends, since the run goes on training and the next pass may fit.
    pub failed: Option<EvalFailure>,
}

/// Where an evaluation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalFailure {
    /// The training step it followed (0: before the first).
    pub step: u64,
    pub phase: String,
}

impl EvalState {
    pub fn observe(&mut self, msg: &Telemetry) {
        match msg {
            Telemetry::EvalOom {
                step,
                phase,
                retry_with: None,
                ..
            } => {
                self.failed = Some(EvalFailure {
                    step: *step,
                    phase: phase.clone(),
                });
            }
            Telemetry::EvalMemory(m) => {
                // A driver may still end the pass that failed: its record is that pass's,
                // and the failure stays the news.
                let same_pass = self
                    .failed
                    .as_ref()
                    .is_some_and(|f| f.step == m.step && f.phase == m.phase);
                if !same_pass {
                    self.failed = None;
                }
                self.last = Some(m.clone());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(step: u64, phase: &str) -> Telemetry {
        Telemetry::EvalMemory(EvalMemory {
            step,
            phase: phase.into(),
            batches: 4,
            samples: 256,
            asked: 64,
            size: 32,
            chunks: 9,
            seq_len: 128,
            peak_bytes: 1 << 30,
            limit_bytes: 2 << 30,
            usage: 0.5,
            ooms: 1,
            seconds: 1.5,
        })
    }

    fn gave_up(step: u64, phase: &str) -> Telemetry {
        Telemetry::EvalOom {
            step,
            phase: phase.into(),
            size: 1,
            seq_len: 4096,
            retry_with: None,
            error: "CUDA out of memory".into(),
        }
    }

    #[test]
    fn a_failure_lasts_until_a_later_pass_ends() {
        let mut s = EvalState::default();
        s.observe(&Telemetry::EvalOom {
            step: 10,
            phase: "validation".into(),
            size: 64,
            seq_len: 128,
            retry_with: Some(32),
            error: String::new(),
        });
        assert_eq!(s, EvalState::default(), "a retried chunk is no failure");
        s.observe(&pass(10, "validation"));
        assert_eq!(s.last.as_ref().map(|m| m.step), Some(10));
        s.observe(&gave_up(20, "validation"));
        // The failed pass's own record does not hide its failure.
        s.observe(&pass(20, "validation"));
        assert_eq!(s.failed.as_ref().map(|f| f.step), Some(20));
        assert_eq!(s.last.as_ref().map(|m| m.step), Some(20));
        s.observe(&pass(30, "validation"));
        assert_eq!(s.failed, None);
    }
}
