//! Words for the memory controller's messages: the event log's entries and the training
//! panel's "last decision" lines. Every sentence carries the numbers that caused it, so
//! the log alone explains a run.
use headroom_core::policy::{Decision, Profile, ResizeReason, Thresholds};
use headroom_core::Level;

/// A fraction as a whole percentage: `0.412` → `41%`.
pub fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

fn reason_name(r: ResizeReason) -> &'static str {
    match r {
        ResizeReason::Grow => "grow",
        ResizeReason::Critical => "critical",
        ResizeReason::Emergency => "emergency",
        ResizeReason::Forecast => "forecast",
        ResizeReason::Oom => "oom",
        ResizeReason::Pinned => "pinned",
        ResizeReason::OverTarget => "over target",
    }
}

fn predicted_suffix(predicted: Option<f64>) -> String {
    predicted
        .map(|p| format!(" (predicted {})", pct(p)))
        .unwrap_or_default()
}

/// `96% ≥ critical 95%`, or without the number when the thresholds are not known.
fn against(usage: f64, op: &str, name: &str, value: Option<f64>) -> String {
    match value {
        Some(v) => format!("{} {op} {name} {}", pct(usage), pct(v)),
        None => format!("{} {op} {name}", pct(usage)),
    }
}

/// What taught a ceiling: an out-of-memory error, or a step that peaked too high.
fn ceiling_cause(usage: f64) -> String {
    if usage >= 1.0 {
        "ran out".into()
    } else {
        format!("peaked at {}", pct(usage))
    }
}

/// The event-log entry for a decision taken after step `step`.
pub fn decision_event(step: u64, d: &Decision) -> (Level, String) {
    match d {
        Decision::Resize {
            from,
            to,
            reason,
            usage,
            predicted,
        } => {
            let pred = predicted_suffix(*predicted);
            let verb = match reason {
                ResizeReason::Pinned => "pin",
                _ if to > from => "grow",
                _ => "shrink",
            };
            let at = pct(*usage);
            let (level, why) = match reason {
                ResizeReason::Grow => (Level::Info, format!(" at {at}")),
                ResizeReason::Pinned => (Level::Info, String::new()),
                ResizeReason::Critical => (Level::Warn, format!(" at {at} ≥ critical")),
                ResizeReason::Emergency => (Level::Warn, format!(" at {at} ≥ emergency")),
                ResizeReason::Forecast => (Level::Warn, format!(" at forecast {at}")),
                ResizeReason::Oom => (Level::Warn, " after out of memory".to_string()),
                ResizeReason::OverTarget => {
                    (Level::Warn, format!(" after steps over target, at {at}"))
                }
            };
            (level, format!("step {step}: {verb} {from} → {to}{why}{pred}"))
        }
        Decision::EmptyCache { usage } if *usage >= 1.0 => (
            Level::Warn,
            format!("step {step}: cached memory freed after out of memory"),
        ),
        Decision::EmptyCache { usage } => (
            Level::Warn,
            format!("step {step}: cached memory freed at {}", pct(*usage)),
        ),
        Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        } => (
            Level::Info,
            format!(
                "step {step}: ceiling learned: under {tokens} tokens (micro-batch {micro_batch} {})",
                ceiling_cause(*usage)
            ),
        ),
        Decision::CeilingRaised { tokens: Some(t) } => (
            Level::Info,
            format!("step {step}: ceiling raised to {t} tokens after a run without OOMs"),
        ),
        Decision::CeilingRaised { tokens: None } => (
            Level::Info,
            format!("step {step}: ceiling dropped after a run without OOMs"),
        ),
        Decision::Warning { text, .. } => (Level::Warn, format!("step {step}: {text}")),
    }
}

/// The event-log entry for an out-of-memory error in step `step`.
pub fn oom_event(
    step: u64,
    micro_batch: usize,
    seq_len: usize,
    retry_with: Option<usize>,
) -> (Level, String) {
    match retry_with {
        Some(n) => (
            Level::Warn,
            format!(
                "step {step}: out of memory at micro-batch {micro_batch} × {seq_len} tokens, retrying with {n}"
            ),
        ),
        None => (
            Level::Error,
            format!(
                "step {step}: out of memory at micro-batch {micro_batch} × {seq_len} tokens, giving up"
            ),
        ),
    }
}

/// `0.90,0.92,0.95,0.97 (balanced)`, or `(custom)`.
pub fn thresholds_text(t: &Thresholds, profile: Option<Profile>) -> String {
    let name = profile.map_or("custom", Profile::name);
    format!("{t} ({name})")
}

pub fn thresholds_event(t: &Thresholds, profile: Option<Profile>, source: &str) -> String {
    format!(
        "thresholds {} in force, from {source}",
        thresholds_text(t, profile)
    )
}

/// Short headline for the training panel: `after step 12: 8 → 32 (grow)`.
pub fn decision_headline(step: u64, d: &Decision) -> String {
    let what = match d {
        Decision::Resize {
            from, to, reason, ..
        } => format!("{from} → {to} ({})", reason_name(*reason)),
        Decision::EmptyCache { .. } => "freed cached memory".into(),
        Decision::CeilingLearned { .. } => "ceiling learned".into(),
        Decision::CeilingRaised { tokens: Some(_) } => "ceiling raised".into(),
        Decision::CeilingRaised { tokens: None } => "ceiling dropped".into(),
        Decision::Warning { forecast: true, .. } => "forecast warning".into(),
        Decision::Warning { .. } => "warning".into(),
    };
    format!("after step {step}: {what}")
}

/// Why the controller decided it, with the numbers; `t` are the thresholds in force.
pub fn decision_reason(d: &Decision, t: Option<&Thresholds>) -> String {
    match d {
        Decision::Resize {
            reason,
            usage,
            predicted,
            ..
        } => {
            let why = match reason {
                ResizeReason::Grow => against(*usage, "<", "target", t.map(|t| t.target)),
                ResizeReason::Critical => against(*usage, "≥", "critical", t.map(|t| t.critical)),
                ResizeReason::Emergency => {
                    against(*usage, "≥", "emergency", t.map(|t| t.emergency))
                }
                ResizeReason::Forecast => format!(
                    "forecast {}",
                    against(*usage, ">", "warning", t.map(|t| t.warning))
                ),
                ResizeReason::Oom => "out of memory".into(),
                ResizeReason::Pinned => "pinned by a command".into(),
                ResizeReason::OverTarget => format!(
                    "several steps {}",
                    against(*usage, ">", "target", t.map(|t| t.target))
                ),
            };
            match predicted {
                Some(p) => format!("{why}; predicted {}", pct(*p)),
                None => why,
            }
        }
        Decision::EmptyCache { usage } if *usage >= 1.0 => "after out of memory".into(),
        Decision::EmptyCache { usage } => match t {
            Some(t) if *usage < t.emergency => against(*usage, ">", "target", Some(t.target)),
            _ => against(*usage, "≥", "emergency", t.map(|t| t.emergency)),
        },
        Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        } => format!(
            "micro-batch {micro_batch} {}: < {tokens} tokens",
            ceiling_cause(*usage)
        ),
        Decision::CeilingRaised { tokens: Some(t) } => format!("no OOM for a while: {t} tokens"),
        Decision::CeilingRaised { tokens: None } => "no OOM for a while".into(),
        Decision::Warning { text, .. } => text.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resize(from: usize, to: usize, reason: ResizeReason, predicted: Option<f64>) -> Decision {
        Decision::Resize {
            from,
            to,
            reason,
            usage: if reason == ResizeReason::Oom {
                1.0
            } else {
                0.412
            },
            predicted,
        }
    }

    #[test]
    fn resize_entries_carry_sizes_usage_and_prediction() {
        assert_eq!(
            decision_event(12, &resize(8, 32, ResizeReason::Grow, Some(0.88))),
            (
                Level::Info,
                "step 12: grow 8 → 32 at 41% (predicted 88%)".into()
            )
        );
        let (level, text) = decision_event(40, &resize(32, 16, ResizeReason::Oom, None));
        assert_eq!(level, Level::Warn);
        assert_eq!(text, "step 40: shrink 32 → 16 after out of memory");
        assert_eq!(
            decision_event(40, &resize(32, 8, ResizeReason::Pinned, Some(0.4))).1,
            "step 40: pin 32 → 8 (predicted 40%)"
        );
        let crit = Decision::Resize {
            from: 32,
            to: 24,
            reason: ResizeReason::Critical,
            usage: 0.96,
            predicted: Some(0.89),
        };
        assert_eq!(
            decision_event(30, &crit).1,
            "step 30: shrink 32 → 24 at 96% ≥ critical (predicted 89%)"
        );
        let t = Thresholds::default();
        assert_eq!(
            decision_reason(&crit, Some(&t)),
            "96% ≥ critical 95%; predicted 89%"
        );
        assert_eq!(
            decision_headline(30, &crit),
            "after step 30: 32 → 24 (critical)"
        );
    }

    #[test]
    fn oom_entries_say_what_is_retried() {
        assert_eq!(
            oom_event(41, 32, 64, Some(16)),
            (
                Level::Warn,
                "step 41: out of memory at micro-batch 32 × 64 tokens, retrying with 16".into()
            )
        );
        assert_eq!(oom_event(41, 1, 64, None).0, Level::Error);
    }

    #[test]
    fn threshold_entries_name_the_profile_and_source() {
        let t = Profile::Conservative.thresholds();
        assert_eq!(
            thresholds_event(&t, Some(Profile::Conservative), "command"),
            "thresholds 0.85,0.88,0.92,0.95 (conservative) in force, from command"
        );
        assert!(thresholds_text(&t, None).ends_with("(custom)"));
    }

    #[test]
    fn cache_and_ceiling_entries() {
        assert_eq!(
            decision_event(40, &Decision::EmptyCache { usage: 1.0 }).1,
            "step 40: cached memory freed after out of memory"
        );
        assert_eq!(
            decision_event(9, &Decision::EmptyCache { usage: 0.981 }).1,
            "step 9: cached memory freed at 98%"
        );
        assert_eq!(
            decision_event(
                40,
                &Decision::CeilingLearned {
                    micro_batch: 32,
                    tokens: 2048,
                    usage: 1.0
                }
            )
            .1,
            "step 40: ceiling learned: under 2048 tokens (micro-batch 32 ran out)"
        );
        assert_eq!(
            decision_event(
                41,
                &Decision::CeilingLearned {
                    micro_batch: 70,
                    tokens: 4060,
                    usage: 0.993
                }
            )
            .1,
            "step 41: ceiling learned: under 4060 tokens (micro-batch 70 peaked at 99%)"
        );
        let t = Thresholds::default();
        assert_eq!(
            decision_reason(&Decision::EmptyCache { usage: 0.914 }, Some(&t)),
            "91% > target 90%"
        );
        assert_eq!(
            decision_reason(&Decision::EmptyCache { usage: 0.98 }, Some(&t)),
            "98% ≥ emergency 97%"
        );
    }
}
