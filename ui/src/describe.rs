//! Words for the memory controller's messages: the event log's entries and the training
//! panel's "last decision" lines. Every sentence carries the numbers that caused it, so
//! the log alone explains a run.
use headroom_core::policy::{Decision, LeverPeak, Profile, ResizeReason, Thresholds};
use headroom_core::units::{fmt_bytes, fmt_duration};
use headroom_core::{EvalMemory, Level};

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

/// How alarming a decision is: the colour its log entry and headline take. Running out
/// of memory and shrinking because usage crossed critical or emergency are errors;
/// shrinking ahead of a forecast or after steps over target, and warnings, are warnings;
/// growing and pinning are routine.
pub fn decision_level(d: &Decision) -> Level {
    match d {
        Decision::Resize { reason, .. } => match reason {
            ResizeReason::Critical | ResizeReason::Emergency | ResizeReason::Oom => Level::Error,
            ResizeReason::Forecast | ResizeReason::OverTarget => Level::Warn,
            ResizeReason::Grow | ResizeReason::Pinned => Level::Info,
        },
        Decision::EmptyCache { .. } | Decision::Warning { .. } => Level::Warn,
        // Evaluation's chunks shrinking after an OOM cost a retry, not the run; a sample
        // that does not fit on its own fails the evaluation.
        Decision::EvalSize {
            reason: ResizeReason::Oom,
            from,
            to,
            ..
        } if from == to => Level::Error,
        Decision::EvalSize {
            reason: ResizeReason::Oom,
            ..
        } => Level::Warn,
        Decision::EvalSize { .. }
        | Decision::CeilingLearned { .. }
        | Decision::CeilingRaised { .. }
        | Decision::Lever { .. } => Level::Info,
    }
}

/// `8 × 64 tokens`
fn shape(p: &LeverPeak) -> String {
    format!("{} × {} tokens", p.micro_batch, p.seq_len)
}

/// What a lever switch did to the step peak: `300 MiB → 200 MiB at 8 × 64 tokens: 100 MiB
/// freed`; at another shape than the step before, per token, since the peaks do not
/// compare directly.
fn lever_effect(before: Option<&LeverPeak>, after: &LeverPeak, freed: Option<i64>) -> String {
    match (before, freed) {
        (Some(b), Some(f)) => {
            let change = if f >= 0 {
                format!("{} freed", fmt_bytes(f as u64))
            } else {
                format!("{} more", fmt_bytes(f.unsigned_abs()))
            };
            format!(
                "step peak {} → {} at {}: {change}",
                fmt_bytes(b.peak_bytes),
                fmt_bytes(after.peak_bytes),
                shape(after)
            )
        }
        (Some(b), None) => format!(
            "step peak {} at {} (step {}) → {} at {}; {} → {} per token",
            fmt_bytes(b.peak_bytes),
            shape(b),
            b.step,
            fmt_bytes(after.peak_bytes),
            shape(after),
            fmt_bytes(b.per_token()),
            fmt_bytes(after.per_token())
        ),
        (None, _) => format!(
            "step peak {} at {}",
            fmt_bytes(after.peak_bytes),
            shape(after)
        ),
    }
}

/// The controller's own texts may already name their step (`step 58: usage stayed…`,
/// `step 58 peaked at…`); the log's `step N:` prefix must not say it twice.
fn without_own_step(step: u64, text: &str) -> &str {
    let own = format!("step {step}");
    match text.strip_prefix(&own) {
        Some(rest) if rest.starts_with(':') || rest.starts_with(' ') => {
            rest.trim_start_matches(':').trim_start()
        }
        _ => text,
    }
}

/// The event-log entry for a decision about step `step` (taken before it, during it or
/// after it completed: the trainer numbers all three by the step concerned).
pub fn decision_event(step: u64, d: &Decision) -> (Level, String) {
    (
        decision_level(d),
        format!("step {step}: {}", decision_text(step, d)),
    )
}

fn decision_text(step: u64, d: &Decision) -> String {
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
            let why = match reason {
                ResizeReason::Grow => format!(" at {at}"),
                ResizeReason::Pinned => String::new(),
                ResizeReason::Critical => format!(" at {at} ≥ critical"),
                ResizeReason::Emergency => format!(" at {at} ≥ emergency"),
                ResizeReason::Forecast => format!(" at forecast {at}"),
                ResizeReason::Oom => " after out of memory".to_string(),
                ResizeReason::OverTarget => format!(" after steps over target, at {at}"),
            };
            format!("{verb} {from} → {to}{why}{pred}")
        }
        Decision::EmptyCache { usage } if *usage >= 1.0 => {
            "cached memory freed after out of memory".into()
        }
        Decision::EmptyCache { usage } => format!("cached memory freed at {}", pct(*usage)),
        Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        } => format!(
            "ceiling learned: under {tokens} tokens (micro-batch {micro_batch} {})",
            ceiling_cause(*usage)
        ),
        Decision::CeilingRaised { tokens: Some(t) } => {
            format!("ceiling raised to {t} tokens after a run without OOMs")
        }
        Decision::CeilingRaised { tokens: None } => {
            "ceiling dropped after a run without OOMs".into()
        }
        Decision::Warning { text, .. } => without_own_step(step, text).to_string(),
        Decision::Lever {
            change,
            source,
            before,
            after,
            freed_bytes,
        } => format!(
            "{change} ({source}): {}",
            lever_effect(before.as_ref(), after, *freed_bytes)
        ),
        Decision::EvalSize {
            from,
            to,
            reason: ResizeReason::Oom,
            ..
        } if from == to => {
            format!("evaluation out of memory in chunks of {from}: no smaller chunk")
        }
        Decision::EvalSize {
            from,
            to,
            reason,
            usage,
        } => {
            let why = match reason {
                ResizeReason::Oom => " after out of memory",
                ResizeReason::Grow => ", room to grow",
                _ => ", forecast over target",
            };
            format!(
                "evaluation chunks {from} → {to}{why}{}",
                predicted_suffix(eval_predicted(*reason, *usage))
            )
        }
    }
}

/// What evaluation's own memory model predicts at a new chunk size; none after an OOM
/// (its usage is 1.0, the failure) or before the model has a chunk (sent as 0).
fn eval_predicted(reason: ResizeReason, usage: f64) -> Option<f64> {
    (reason != ResizeReason::Oom && usage > 0.0).then_some(usage)
}

/// The event-log entry for an out-of-memory error in step `step`: an error whether or not
/// it is retried, since the step's work was lost.
pub fn oom_event(
    step: u64,
    micro_batch: usize,
    seq_len: usize,
    retry_with: Option<usize>,
) -> (Level, String) {
    let then = match retry_with {
        Some(n) => format!("retrying with {n}"),
        None => "giving up".into(),
    };
    (
        Level::Error,
        format!(
            "step {step}: out of memory at micro-batch {micro_batch} × {seq_len} tokens, {then}"
        ),
    )
}

/// When an evaluation ran, by the training step it follows (0: before the first).
fn eval_when(step: u64) -> String {
    match step {
        0 => "before the first step".into(),
        n => format!("at step {n}"),
    }
}

/// The event-log entry for an out-of-memory error in an evaluation chunk: a warning while
/// its samples are retried in smaller chunks (training's micro-batch is not touched), an
/// error when not even one sample fits and the evaluation fails.
pub fn eval_oom_event(
    step: u64,
    phase: &str,
    size: usize,
    retry_with: Option<usize>,
) -> (Level, String) {
    let when = eval_when(step);
    match retry_with {
        Some(n) => (
            Level::Warn,
            format!("{phase} ran out of memory in chunks of {size} {when}; retrying in chunks of {n}"),
        ),
        None if size <= 1 => (
            Level::Error,
            format!("{phase} ran out of memory {when}; one sample does not fit: the evaluation fails"),
        ),
        None => (
            Level::Error,
            format!("{phase} ran out of memory in chunks of {size} {when}; not retried: the evaluation fails"),
        ),
    }
}

/// `1 OOM`, `3 OOMs`.
fn ooms(n: u64) -> String {
    match n {
        1 => "1 OOM".into(),
        n => format!("{n} OOMs"),
    }
}

/// An evaluation pass's duration: tenths under a minute (passes are often seconds long).
fn eval_seconds(s: f64) -> String {
    if s < 59.95 {
        format!("{s:.1} s")
    } else {
        fmt_duration(s)
    }
}

/// How the pass's batches ran: split into chunks, or whole.
fn eval_split(m: &EvalMemory) -> Option<String> {
    if m.size < m.asked {
        Some(format!("in chunks of {}", m.size))
    } else if m.chunks > m.batches {
        Some(format!("in {} chunks", m.chunks))
    } else {
        None
    }
}

/// An evaluation pass's memory in words, longest first (the training panel shows the
/// first that fits; the event log the first): `validation at step 40: 12 batches of 64
/// in chunks of 32 · peak 71% (2.10 GiB) · 1 OOM · 2.3 s`.
pub fn eval_pass(m: &EvalMemory) -> Vec<String> {
    let head = format!("{} {}", m.phase, eval_when(m.step));
    let short_head = match m.step {
        0 => m.phase.clone(),
        n => format!("{} @ {n}", m.phase),
    };
    let split = eval_split(m);
    let batches = format!(
        "{} batch{} of {}{}",
        m.batches,
        if m.batches == 1 { "" } else { "es" },
        m.asked,
        split.as_ref().map_or(", whole".into(), |s| format!(" {s}"))
    );
    let shape = match &split {
        Some(s) => format!("{} {s}", m.asked),
        None => format!("{} whole", m.asked),
    };
    let chunk = format!("chunks of {}", m.size);
    // A driver that measured no chunk has no peak to show.
    let measured = m.peak_bytes > 0;
    let peak = measured.then(|| format!("peak {}", pct(m.usage)));
    let peak_bytes =
        measured.then(|| format!("peak {} ({})", pct(m.usage), fmt_bytes(m.peak_bytes)));
    let bare = measured.then(|| pct(m.usage));
    let oom = (m.ooms > 0).then(|| ooms(m.ooms));
    let time = Some(eval_seconds(m.seconds));
    let join = |first: String, rest: &[&Option<String>]| {
        std::iter::once(first)
            .chain(rest.iter().filter_map(|p| (*p).clone()))
            .collect::<Vec<_>>()
            .join(" · ")
    };
    vec![
        join(format!("{head}: {batches}"), &[&peak_bytes, &oom, &time]),
        join(format!("{head}: {batches}"), &[&peak, &oom]),
        join(format!("{head}: {shape}"), &[&peak, &oom]),
        join(format!("{short_head}: {shape}"), &[&peak, &oom]),
        join(format!("{short_head}: {shape}"), &[&bare, &oom]),
        join(format!("{short_head}: {chunk}"), &[&bare, &oom]),
        join(format!("eval {chunk}"), &[&bare, &oom]),
    ]
}

/// An evaluation that failed because one sample did not fit, longest first.
pub fn eval_failure(step: u64, phase: &str) -> Vec<String> {
    vec![
        format!(
            "{phase} {}: one sample ran out of memory; the evaluation failed",
            eval_when(step)
        ),
        format!("{phase} failed: one sample does not fit"),
        format!("{phase}: one sample too big"),
    ]
}

/// How an effective batch is split into micro-batches, every candidate true: the last
/// micro-batch is short when the micro-batch does not divide the effective batch
/// (`163 × 3 + 23 = 512`), longest first.
pub fn batch_split(micro: usize, accum: usize, effective: usize) -> Vec<String> {
    let full = accum.saturating_sub(1);
    let last = micro
        .checked_mul(full)
        .and_then(|done| effective.checked_sub(done));
    match last {
        Some(last) if accum > 0 && last == micro => vec![
            format!("micro {micro} × accum {accum} = {effective}"),
            format!("{micro} × {accum} = {effective}"),
        ],
        Some(last) if accum > 0 && last > 0 && last < micro => vec![
            format!("micro {micro} × {full} + {last} = {effective} (accum {accum})"),
            format!("micro {micro} × {full} + {last} = {effective}"),
            format!("{micro} × {full} + {last} = {effective}"),
        ],
        // Figures that do not add up are shown as they came, not multiplied.
        _ => vec![
            format!("micro {micro}, accum {accum}, effective {effective}"),
            format!("{micro}, {accum} steps, {effective}"),
        ],
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

/// Short headline for the training panel: `step 12: 8 → 32 (grow)`, numbered as the
/// event log numbers it.
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
        Decision::Lever { change, .. } => change.clone(),
        Decision::EvalSize {
            from,
            to,
            reason: ResizeReason::Oom,
            ..
        } if from == to => "eval: one sample does not fit".into(),
        Decision::EvalSize {
            from, to, reason, ..
        } => format!("eval chunks {from} → {to} ({})", reason_name(*reason)),
    };
    format!("step {step}: {what}")
}

/// Why the controller decided it, with the numbers; `t` are the thresholds in force.
pub fn decision_reason(step: u64, d: &Decision, t: Option<&Thresholds>) -> String {
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
        Decision::Warning { text, .. } => without_own_step(step, text).to_string(),
        Decision::Lever {
            source,
            before,
            after,
            freed_bytes,
            ..
        } => format!(
            "switched by {source}; {}",
            lever_effect(before.as_ref(), after, *freed_bytes)
        ),
        Decision::EvalSize {
            reason: ResizeReason::Oom,
            from,
            to,
            ..
        } if from == to => "one evaluation sample ran out of memory: the evaluation fails".into(),
        Decision::EvalSize {
            reason: ResizeReason::Oom,
            ..
        } => "an evaluation chunk ran out of memory; training's micro-batch is unchanged".into(),
        Decision::EvalSize { reason, usage, .. } => {
            let predicted = eval_predicted(*reason, *usage)
                .map(|p| format!("predicted {} at the new size", pct(p)))
                .unwrap_or_else(|| "no prediction yet".into());
            format!("evaluation's own peaks: {predicted}; training's micro-batch is unchanged")
        }
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
        assert_eq!(level, Level::Error, "part of an out-of-memory error");
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
            decision_event(30, &crit),
            (
                Level::Error,
                "step 30: shrink 32 → 24 at 96% ≥ critical (predicted 89%)".into()
            )
        );
        let t = Thresholds::default();
        assert_eq!(
            decision_reason(30, &crit, Some(&t)),
            "96% ≥ critical 95%; predicted 89%"
        );
        assert_eq!(decision_headline(30, &crit), "step 30: 32 → 24 (critical)");
    }

    #[test]
    fn oom_entries_say_what_is_retried() {
        assert_eq!(
            oom_event(41, 32, 64, Some(16)),
            (
                Level::Error,
                "step 41: out of memory at micro-batch 32 × 64 tokens, retrying with 16".into()
            )
        );
        assert_eq!(oom_event(41, 1, 64, None).0, Level::Error);
    }

    /// Danger looks dangerous, routine looks routine: the colour follows the severity.
    #[test]
    fn levels_follow_severity() {
        let level = |reason| decision_event(1, &resize(8, 4, reason, None)).0;
        assert_eq!(oom_event(6, 64, 64, Some(32)).0, Level::Error);
        assert_eq!(level(ResizeReason::Critical), Level::Error);
        assert_eq!(level(ResizeReason::Emergency), Level::Error);
        assert_eq!(level(ResizeReason::Oom), Level::Error);
        assert_eq!(level(ResizeReason::Forecast), Level::Warn);
        assert_eq!(level(ResizeReason::OverTarget), Level::Warn);
        assert_eq!(
            decision_event(1, &resize(4, 8, ResizeReason::Grow, None)).0,
            Level::Info
        );
    }

    /// The controller's texts name their step; the log must not say it twice.
    #[test]
    fn a_warning_that_names_its_step_is_not_prefixed_twice() {
        let warn = |text: &str| Decision::Warning {
            usage: 0.96,
            forecast: false,
            text: text.into(),
        };
        assert_eq!(
            decision_event(58, &warn("step 58: usage stayed at 96%")).1,
            "step 58: usage stayed at 96%"
        );
        assert_eq!(
            decision_event(58, &warn("step 58 peaked at 93% of the limit")).1,
            "step 58: peaked at 93% of the limit"
        );
        // Another step's number is information, not a duplicate; step 5 is not step 58.
        assert_eq!(
            decision_event(58, &warn("step 5 peaked")).1,
            "step 58: step 5 peaked"
        );
        assert_eq!(
            decision_event(5, &warn("step 58 peaked")).1,
            "step 5: step 58 peaked"
        );
        assert_eq!(
            decision_reason(58, &warn("step 58: usage stayed at 96%"), None),
            "usage stayed at 96%"
        );
    }

    /// A split that does not divide evenly is written as it is run, never as a product
    /// that does not hold.
    #[test]
    fn batch_splits_always_add_up() {
        assert_eq!(batch_split(8, 4, 32)[0], "micro 8 × accum 4 = 32");
        assert_eq!(
            batch_split(163, 4, 512)[0],
            "micro 163 × 3 + 23 = 512 (accum 4)"
        );
        assert_eq!(batch_split(14, 19, 256)[1], "micro 14 × 18 + 4 = 256");
        assert_eq!(batch_split(16, 1, 16)[0], "micro 16 × accum 1 = 16");
        for (m, a, e) in [(163, 4, 512), (14, 19, 256), (8, 4, 32), (7, 5, 32)] {
            for text in batch_split(m, a, e) {
                assert!(text.contains(&format!("= {e}")), "{text}");
            }
        }
        // Nonsense figures are shown, not multiplied.
        assert_eq!(batch_split(10, 2, 5)[0], "micro 10, accum 2, effective 5");
        assert_eq!(batch_split(10, 0, 5)[0], "micro 10, accum 0, effective 5");
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
            decision_reason(9, &Decision::EmptyCache { usage: 0.914 }, Some(&t)),
            "91% > target 90%"
        );
        assert_eq!(
            decision_reason(9, &Decision::EmptyCache { usage: 0.98 }, Some(&t)),
            "98% ≥ emergency 97%"
        );
    }

    fn eval_size(from: usize, to: usize, reason: ResizeReason, usage: f64) -> Decision {
        Decision::EvalSize {
            from,
            to,
            reason,
            usage,
        }
    }

    /// Evaluation's chunk sizes are evaluation's: an OOM retried smaller is a warning,
    /// one sample that does not fit an error, a planned change routine.
    #[test]
    fn eval_size_entries_name_evaluation_and_its_prediction() {
        let oom = eval_size(64, 32, ResizeReason::Oom, 1.0);
        assert_eq!(
            decision_event(40, &oom),
            (
                Level::Warn,
                "step 40: evaluation chunks 64 → 32 after out of memory".into()
            )
        );
        assert_eq!(
            decision_headline(40, &oom),
            "step 40: eval chunks 64 → 32 (oom)"
        );
        let one = eval_size(1, 1, ResizeReason::Oom, 1.0);
        assert_eq!(decision_level(&one), Level::Error);
        assert_eq!(
            decision_headline(40, &one),
            "step 40: eval: one sample does not fit"
        );
        assert_eq!(
            decision_event(40, &eval_size(64, 40, ResizeReason::Forecast, 0.85)).1,
            "step 40: evaluation chunks 64 → 40, forecast over target (predicted 85%)"
        );
        // Sent as 0 before evaluation's model has a chunk: no prediction, not "0%".
        let grow = eval_size(32, 64, ResizeReason::Grow, 0.0);
        assert_eq!(
            decision_event(40, &grow),
            (
                Level::Info,
                "step 40: evaluation chunks 32 → 64, room to grow".into()
            )
        );
        assert_eq!(
            decision_reason(40, &grow, None),
            "evaluation's own peaks: no prediction yet; training's micro-batch is unchanged"
        );
    }

    #[test]
    fn eval_oom_entries_say_what_is_retried_or_that_the_evaluation_fails() {
        assert_eq!(
            eval_oom_event(40, "validation", 64, Some(32)),
            (
                Level::Warn,
                "validation ran out of memory in chunks of 64 at step 40; retrying in chunks of 32"
                    .into()
            )
        );
        assert_eq!(
            eval_oom_event(0, "predict", 1, None),
            (
                Level::Error,
                "predict ran out of memory before the first step; one sample does not fit: the \
                 evaluation fails"
                    .into()
            )
        );
        assert_eq!(eval_oom_event(7, "test", 8, None).0, Level::Error);
    }

    fn pass() -> EvalMemory {
        EvalMemory {
            step: 40,
            phase: "validation".into(),
            batches: 12,
            samples: 768,
            asked: 64,
            size: 32,
            chunks: 25,
            seq_len: 128,
            peak_bytes: 2 << 30,
            limit_bytes: 3 << 30,
            usage: 0.667,
            ooms: 1,
            seconds: 2.31,
        }
    }

    #[test]
    fn an_eval_pass_is_said_longest_first_and_every_wording_is_true() {
        let lines = eval_pass(&pass());
        assert_eq!(
            lines[0],
            "validation at step 40: 12 batches of 64 in chunks of 32 · peak 67% (2.00 GiB) · 1 \
             OOM · 2.3 s"
        );
        assert_eq!(lines.last().unwrap(), "eval chunks of 32 · 67% · 1 OOM");
        for pair in lines.windows(2) {
            assert!(pair[0].len() >= pair[1].len(), "{pair:?}");
        }
        // Never split, nothing measured, before the first step, a long pass.
        let whole = EvalMemory {
            step: 0,
            batches: 1,
            size: 64,
            chunks: 1,
            peak_bytes: 0,
            ooms: 0,
            seconds: 75.0,
            ..pass()
        };
        assert_eq!(
            eval_pass(&whole)[0],
            "validation before the first step: 1 batch of 64, whole · 1m15s"
        );
        assert_eq!(eval_pass(&whole)[4], "validation: 64 whole");
    }

    #[test]
    fn lever_entries_say_what_the_switch_freed_or_compare_per_token() {
        let peak = |step, mib: u64, micro_batch| LeverPeak {
            step,
            peak_bytes: mib << 20,
            micro_batch,
            seq_len: 64,
        };
        let lever =
            |before: Option<LeverPeak>, after: LeverPeak, freed: Option<i64>| Decision::Lever {
                change: "activation checkpointing none → blocks".into(),
                source: "command".into(),
                before,
                after,
                freed_bytes: freed,
            };
        let d = lever(Some(peak(7, 300, 8)), peak(8, 200, 8), Some(100 << 20));
        assert_eq!(
            decision_event(8, &d),
            (
                Level::Info,
                "step 8: activation checkpointing none → blocks (command): step peak 300 MiB → \
                 200 MiB at 8 × 64 tokens: 100 MiB freed"
                    .into()
            )
        );
        assert_eq!(
            decision_headline(8, &d),
            "step 8: activation checkpointing none → blocks"
        );
        let d = lever(Some(peak(7, 300, 8)), peak(8, 320, 8), Some(-(20 << 20)));
        assert!(decision_event(8, &d).1.ends_with(": 20.0 MiB more"));
        let d = lever(Some(peak(7, 300, 8)), peak(8, 400, 16), None);
        assert!(
            decision_reason(8, &d, None)
                .ends_with("(step 7) → 400 MiB at 16 × 64 tokens; 600 KiB → 400 KiB per token"),
            "{}",
            decision_reason(8, &d, None)
        );
        let d = lever(None, peak(1, 400, 1), None);
        assert!(decision_event(1, &d)
            .1
            .ends_with(": step peak 400 MiB at 1 × 64 tokens"));
    }
}
