//! Switching a memory lever (precision, activation checkpointing) between steps, and
//! recording what it freed: the first step after the switch against the last one before
//! it, as a controller decision ([`Decision::Lever`]) the log, the dashboard and a replay
//! all show.
use headroom_core::policy::{Decision, LeverPeak};
use headroom_core::{Checkpointing, Precision};

use super::Session;

/// A step's measured peak and the shape it was measured at.
pub type Measured = LeverPeak;

/// A switch waiting for the first step that runs with it.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingSwitch {
    /// `precision fp32 → bf16`, `activation checkpointing none → blocks`.
    pub what: String,
    /// Who asked: `command` or `controller`.
    pub source: &'static str,
    pub before: Option<Measured>,
}

impl PendingSwitch {
    /// The decision once `after` (the first step with the new setting) is measured. Peaks
    /// compare directly at the same micro-batch and length only; at another shape the
    /// figure per token is what compares, and no freed amount is claimed.
    pub fn outcome(&self, after: Measured) -> Decision {
        let same_shape = self
            .before
            .filter(|b| (b.micro_batch, b.seq_len) == (after.micro_batch, after.seq_len));
        Decision::Lever {
            change: self.what.clone(),
            source: self.source.to_string(),
            before: self.before,
            after,
            freed_bytes: same_shape.map(|b| b.peak_bytes as i64 - after.peak_bytes as i64),
        }
    }
}

impl Session {
    /// The driver switched precision `was` → `to` (`source`: `command`, `controller`); the
    /// answer to say.
    pub fn switched_precision(
        &mut self,
        was: Precision,
        to: Precision,
        source: &'static str,
    ) -> String {
        if self.precision.is_some() {
            self.precision = Some(to);
        }
        self.lever_switched(format!("precision {was} → {to}"), source)
    }

    /// The driver switched activation checkpointing `was` → `to`; the answer to say.
    pub fn switched_checkpointing(
        &mut self,
        was: Checkpointing,
        to: Checkpointing,
        source: &'static str,
    ) -> String {
        if self.checkpointing.is_some() {
            self.checkpointing = Some(to);
        }
        self.lever_switched(format!("activation checkpointing {was} → {to}"), source)
    }

    /// A lever switched by the driver (`what`: `precision fp32 → bf16`), from the next
    /// step on; the answer to say. The next step's peak says what it freed
    /// ([`Session::measured`]); two switches before one step are said together, against
    /// the peak before the first.
    fn lever_switched(&mut self, what: String, source: &'static str) -> String {
        // A measured split was of the old lever state (a driver's plan re-sends its own).
        self.split_known = false;
        let text = format!("{what} from step {}", self.step + 1);
        self.switch = Some(match self.switch.take() {
            Some(earlier) => PendingSwitch {
                what: format!("{}, {what}", earlier.what),
                ..earlier
            },
            None => PendingSwitch {
                what,
                source,
                before: self.last_measured,
            },
        });
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: u64, peak: u64, micro_batch: usize) -> Measured {
        Measured {
            step,
            peak_bytes: peak,
            micro_batch,
            seq_len: 64,
        }
    }

    #[test]
    fn the_outcome_says_what_was_freed_only_at_the_same_shape() {
        let s = PendingSwitch {
            what: "precision fp32 → bf16".into(),
            source: "command",
            before: Some(m(7, 300 << 20, 8)),
        };
        let freed = |d: Decision| match d {
            Decision::Lever {
                freed_bytes,
                change,
                source,
                ..
            } => {
                assert_eq!(
                    (change.as_str(), source.as_str()),
                    (s.what.as_str(), "command")
                );
                freed_bytes
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(freed(s.outcome(m(8, 200 << 20, 8))), Some(100 << 20));
        assert_eq!(freed(s.outcome(m(8, 320 << 20, 8))), Some(-(20 << 20)));
        assert_eq!(freed(s.outcome(m(8, 300 << 20, 16))), None);
        let first = PendingSwitch {
            before: None,
            ..s.clone()
        };
        assert_eq!(freed(first.outcome(m(1, 1 << 20, 8))), None);
    }
}
