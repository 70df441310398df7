//! Switching a memory lever (precision, activation checkpointing) between steps, and
//! saying what it freed: the first step after the switch against the last one before it.
use headroom_core::units::fmt_bytes;
use headroom_core::{Level, Notice};

/// A step's measured peak and the shape it was measured at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub step: u64,
    pub peak: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
}

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
    /// The notice once `after` (the first step with the new setting) is measured. Peaks
    /// compare directly at the same micro-batch and length; at another shape the figure
    /// per token is what compares.
    pub fn outcome(&self, after: Measured) -> Notice {
        let head = format!("step {}: {} ({})", after.step, self.what, self.source);
        let Some(b) = self.before else {
            return Notice::new(
                Level::Info,
                "lever",
                format!("{head}: step peak {}", fmt_bytes(after.peak)),
            );
        };
        let shape = |m: Measured| format!("{} × {} tokens", m.micro_batch, m.seq_len);
        let text = if (b.micro_batch, b.seq_len) == (after.micro_batch, after.seq_len) {
            let change = if after.peak <= b.peak {
                format!("{} freed", fmt_bytes(b.peak - after.peak))
            } else {
                format!("{} more", fmt_bytes(after.peak - b.peak))
            };
            format!(
                "{head}: step peak {} → {} at {}: {change}",
                fmt_bytes(b.peak),
                fmt_bytes(after.peak),
                shape(after)
            )
        } else {
            let per_token = |m: Measured| m.peak / (m.micro_batch * m.seq_len).max(1) as u64;
            format!(
                "{head}: step peak {} at {} (step {}) → {} at {}; {} → {} per token",
                fmt_bytes(b.peak),
                shape(b),
                b.step,
                fmt_bytes(after.peak),
                shape(after),
                fmt_bytes(per_token(b)),
                fmt_bytes(per_token(after))
            )
        };
        Notice::new(Level::Info, "lever", text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: u64, peak: u64, micro_batch: usize) -> Measured {
        Measured {
            step,
            peak,
            micro_batch,
            seq_len: 64,
        }
    }

    #[test]
    fn the_outcome_names_what_was_freed_or_compares_per_token() {
        let s = PendingSwitch {
            what: "precision fp32 → bf16".into(),
            source: "command",
            before: Some(m(7, 300 << 20, 8)),
        };
        let n = s.outcome(m(8, 200 << 20, 8));
        assert!(
            n.text.contains("step 8: precision fp32 → bf16 (command)"),
            "{}",
            n.text
        );
        assert!(n.text.contains("100 MiB freed"), "{}", n.text);
        let n = s.outcome(m(8, 320 << 20, 8));
        assert!(n.text.contains("20.0 MiB more"), "{}", n.text);
        let n = s.outcome(m(8, 300 << 20, 16));
        assert!(
            n.text.contains("per token") && n.text.contains("(step 7)"),
            "{}",
            n.text
        );
    }
}
