//! The memory controller as the dashboard knows it, folded from telemetry: thresholds in
//! force, per-step peaks against the limit, the controller's decisions, OOMs (training's
//! and evaluation's, marked apart), the pinned micro-batch. Only what the trainer
//! reported: a key press changes nothing here until the trainer confirms it.
use std::collections::VecDeque;

use headroom_core::policy::{Decision, Profile, ResizeReason, Thresholds};
use headroom_core::{Command, Level, StepMemory, Telemetry};

use crate::describe::{
    decision_event, decision_level, eval_oom_event, oom_event, pct, thresholds_event,
};
use crate::history::{History, Merge};

/// Chart marks kept; older ones fall off the whole-run view first.
pub const MARKS_KEPT: usize = 256;

/// Something the memory chart marks at the moment it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkKind {
    Oom,
    /// An evaluation chunk ran out of memory: retried smaller, training untouched.
    EvalOom,
    Grew,
    Shrank,
    CacheFreed,
    ThresholdsChanged,
}

impl MarkKind {
    /// The glyph on the chart's time axis, and in its legend.
    pub fn glyph(self) -> char {
        match self {
            MarkKind::Oom => '!',
            // Capital: the gauge's `e` is the emergency threshold.
            MarkKind::EvalOom => 'E',
            MarkKind::Grew => '↑',
            MarkKind::Shrank => '↓',
            MarkKind::CacheFreed => 'c',
            MarkKind::ThresholdsChanged => 'T',
        }
    }

    /// When two marks share a column, the one that matters more is drawn.
    pub fn rank(self) -> u8 {
        match self {
            MarkKind::Oom => 5,
            MarkKind::EvalOom => 4,
            MarkKind::Shrank => 3,
            MarkKind::Grew => 2,
            MarkKind::ThresholdsChanged => 1,
            MarkKind::CacheFreed => 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mark {
    /// Seconds since the dashboard started, as the memory chart's x.
    pub t: f64,
    pub kind: MarkKind,
    /// How alarming it was: a shrink forced by critical usage is drawn as the error it
    /// is, not like a routine grow.
    pub level: Level,
}

/// What the controller expects of the next step, from its decisions numbered `step`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outlook {
    pub step: u64,
    /// The step it is about: it lasts until that step has reported its peak.
    pub about: u64,
    /// A forecast above warning, when the controller raised one.
    pub forecast: Option<f64>,
    /// The size the next step runs at, when the controller changed it.
    pub resized_to: Option<usize>,
    /// Predicted usage at that size.
    pub predicted: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct PolicyState {
    /// In force, as the trainer last confirmed: never what was typed.
    pub thresholds: Option<Thresholds>,
    pub profile: Option<Profile>,
    pub thresholds_source: Option<String>,
    pub last_memory: Option<StepMemory>,
    /// Measured peak usage (fraction of the limit) by elapsed seconds, one per step.
    pub peak_usage: History,
    /// What the model predicted for the same steps, where it could.
    pub predicted_usage: History,
    pub marks: VecDeque<Mark>,
    /// The latest decision about training and the step it concerns.
    pub last_decision: Option<(u64, Decision)>,
    pub outlook: Option<Outlook>,
    pub ooms: u64,
    /// The last evaluation OOM's (step, size, retry): the decision that follows it says the
    /// same again and is not logged twice.
    eval_oom: Option<(u64, usize, Option<usize>)>,
    /// Micro-batch × sequence length at or above which the controller will not go.
    pub ceiling_tokens: Option<u64>,
    pub pinned: bool,
    /// The micro-batch each step ran at, by elapsed seconds (as the memory chart's x).
    /// Merged by minimum: a coarser view must not hide a shrink.
    pub batch_sizes: History,
    /// The micro-batch and the step it is for. Steps arrive on the metrics channel and
    /// decisions on the events channel, so a step report can arrive after a newer resize:
    /// the step key keeps the newer one.
    micro_batch: Option<(u64, usize)>,
}

impl PolicyState {
    pub fn new(history_points: usize) -> PolicyState {
        PolicyState {
            thresholds: None,
            profile: None,
            thresholds_source: None,
            last_memory: None,
            peak_usage: History::new(history_points, Merge::Max),
            predicted_usage: History::new(history_points, Merge::Max),
            marks: VecDeque::with_capacity(MARKS_KEPT),
            last_decision: None,
            outlook: None,
            ooms: 0,
            eval_oom: None,
            ceiling_tokens: None,
            pinned: false,
            batch_sizes: History::new(history_points, Merge::Min),
            micro_batch: None,
        }
    }

    /// Folds one message received `t` seconds in; returns the event-log entry it makes.
    pub fn apply(&mut self, t: f64, msg: &Telemetry) -> Option<(Level, String)> {
        match msg {
            Telemetry::Step(s) => {
                self.note_micro_batch(s.step, s.micro_batch);
                self.batch_sizes.push(t, s.micro_batch as f64);
                None
            }
            Telemetry::StepMemory(m) => {
                self.step_memory(t, m);
                None
            }
            Telemetry::Decision { step, decision } => {
                self.decision(t, *step, decision);
                (!self.repeats_eval_oom(*step, decision)).then(|| decision_event(*step, decision))
            }
            Telemetry::Oom {
                step,
                micro_batch,
                seq_len,
                retry_with,
                ..
            } => {
                self.ooms += 1;
                // The controller unpins on an OOM: the pinned size did not fit.
                self.pinned = false;
                if let Some(n) = retry_with {
                    self.note_micro_batch(*step, *n);
                }
                let (level, text) = oom_event(*step, *micro_batch, *seq_len, *retry_with);
                self.mark(t, MarkKind::Oom, level);
                Some((level, text))
            }
            // Not counted with training's OOMs and no unpin: evaluation runs in chunks of
            // its own, and training's micro-batch is not touched.
            Telemetry::EvalOom {
                step,
                phase,
                size,
                retry_with,
                ..
            } => {
                self.eval_oom = Some((*step, *size, *retry_with));
                let (level, text) = eval_oom_event(*step, phase, *size, *retry_with);
                self.mark(t, MarkKind::EvalOom, level);
                Some((level, text))
            }
            Telemetry::ThresholdsChanged {
                thresholds,
                profile,
                source,
            } => {
                self.thresholds = Some(*thresholds);
                self.profile = *profile;
                self.thresholds_source = Some(source.clone());
                // The run's starting values are not a change worth marking.
                if source != "config" {
                    self.mark(t, MarkKind::ThresholdsChanged, Level::Info);
                }
                Some((Level::Info, thresholds_event(thresholds, *profile, source)))
            }
            Telemetry::CommandApplied { command, applied } if !is_refusal(applied) => {
                match command {
                    Command::PinMicroBatch { .. } => self.pinned = true,
                    Command::Unpin => self.pinned = false,
                    _ => {}
                }
                None
            }
            _ => None,
        }
    }

    fn step_memory(&mut self, t: f64, m: &StepMemory) {
        self.note_micro_batch(m.step, m.micro_batch);
        self.peak_usage.push(t, m.usage);
        if let Some(p) = m.predicted_bytes {
            self.predicted_usage
                .push(t, p as f64 / m.limit_bytes.max(1) as f64);
        }
        // The step the outlook was about has now run.
        if self.outlook.is_some_and(|o| o.about <= m.step) {
            self.outlook = None;
        }
        self.last_memory = Some(m.clone());
    }

    fn decision(&mut self, t: f64, step: u64, d: &Decision) {
        match d {
            Decision::Resize {
                from,
                to,
                reason,
                predicted,
                ..
            } => {
                // Only a pin resizes a pinned batch, and anything else means unpinned.
                self.pinned = *reason == ResizeReason::Pinned;
                let about = applies_to(step, *reason);
                self.note_micro_batch(about, *to);
                let kind = if to > from {
                    MarkKind::Grew
                } else {
                    MarkKind::Shrank
                };
                self.mark(t, kind, decision_level(d));
                let mut o = match self.outlook {
                    Some(o) if o.step == step => o,
                    _ => Outlook {
                        step,
                        about,
                        forecast: None,
                        resized_to: None,
                        predicted: None,
                    },
                };
                o.about = about;
                o.resized_to = Some(*to);
                o.predicted = *predicted;
                self.outlook = Some(o);
            }
            Decision::EmptyCache { .. } => self.mark(t, MarkKind::CacheFreed, Level::Warn),
            Decision::CeilingLearned { tokens, .. } => self.ceiling_tokens = Some(*tokens),
            Decision::CeilingRaised { tokens } => self.ceiling_tokens = *tokens,
            Decision::Warning {
                usage,
                forecast: true,
                ..
            } => {
                // Forecasts are made before the step they are about.
                self.outlook = Some(Outlook {
                    step,
                    about: step,
                    forecast: Some(*usage),
                    resized_to: None,
                    predicted: None,
                });
            }
            // Evaluation's chunk size is shown with its pass (`eval`); as the last decision
            // it would hide training's, which is what the next step runs at.
            Decision::EvalSize { .. } => return,
            Decision::Warning { .. } | Decision::Lever { .. } => {}
        }
        self.last_decision = Some((step, d.clone()));
    }

    /// Whether `d` is the chunk size an evaluation OOM just announced (the session sends
    /// the `eval_oom` record, then this decision): its entry would repeat the OOM's.
    fn repeats_eval_oom(&mut self, step: u64, d: &Decision) -> bool {
        let Decision::EvalSize {
            from,
            to,
            reason: ResizeReason::Oom,
            ..
        } = d
        else {
            return false;
        };
        match self.eval_oom.take() {
            Some((s, size, retry)) => s == step && size == *from && retry.unwrap_or(size) == *to,
            None => false,
        }
    }

    fn note_micro_batch(&mut self, for_step: u64, size: usize) {
        if self.micro_batch.is_none_or(|(s, _)| for_step >= s) {
            self.micro_batch = Some((for_step, size));
        }
    }

    fn mark(&mut self, t: f64, kind: MarkKind, level: Level) {
        if self.marks.len() == MARKS_KEPT {
            self.marks.pop_front();
        }
        self.marks.push_back(Mark { t, kind, level });
    }

    /// The micro-batch the next step runs at, as last reported.
    pub fn micro_batch(&self) -> Option<usize> {
        self.micro_batch.map(|(_, n)| n)
    }

    pub fn limit_bytes(&self) -> Option<u64> {
        self.last_memory.as_ref().map(|m| m.limit_bytes)
    }

    /// `(limit, configured)` when the trainer lowered the configured limit because other
    /// processes hold part of it. Logs from before the field say 0: nothing lowered.
    pub fn lowered_limit(&self) -> Option<(u64, u64)> {
        let m = self.last_memory.as_ref()?;
        (m.configured_limit_bytes > m.limit_bytes)
            .then_some((m.limit_bytes, m.configured_limit_bytes))
    }

    /// How alarming a usage is under the thresholds in force.
    pub fn severity(&self, usage: f64) -> Level {
        match self.thresholds {
            Some(t) if usage >= t.critical => Level::Error,
            Some(t) if usage > t.warning => Level::Warn,
            _ => Level::Info,
        }
    }

    /// Room left under target (negative: over it) and under the limit, in bytes, at the
    /// last step's peak. `reachable` is the most the process could hold now by a fresher
    /// measure than the trainer's limit (on the CPU: its resident set plus MemAvailable);
    /// the room to the limit never exceeds it, since memory other processes took since
    /// the step is not room.
    pub fn headroom(&self, reachable: Option<u64>) -> Option<(i64, u64)> {
        let m = self.last_memory.as_ref()?;
        let ceiling = reachable.map_or(m.limit_bytes, |r| r.min(m.limit_bytes));
        let to_limit = ceiling.saturating_sub(m.peak_bytes);
        let target = self.thresholds?.target;
        let to_target = (target * m.limit_bytes as f64) as i64 - m.peak_bytes as i64;
        // Room to target past what can be reached is no room either.
        Some((to_target.min(to_limit as i64), to_limit))
    }

    /// The out-of-memory risk of the next step in words, longest first (the view shows
    /// the first that fits), with how alarming it is.
    pub fn risk(&self) -> Option<(Level, Vec<String>)> {
        let warning = self.thresholds.map(|t| t.warning);
        if let Some(o) = self.outlook {
            return Some(outlook_risk(self, &o, warning));
        }
        let m = self.last_memory.as_ref()?;
        let measured = pct(m.usage);
        let mb = m.micro_batch;
        Some(match m.predicted_bytes {
            Some(p) => {
                let p = p as f64 / m.limit_bytes.max(1) as f64;
                let predicted = pct(p);
                (
                    self.severity(p.max(m.usage)),
                    vec![
                        format!(
                            "step {}: predicted {predicted} at micro-batch {mb}, measured {measured}",
                            m.step
                        ),
                        format!("predicted {predicted} at micro-batch {mb} (measured {measured})"),
                        format!("predicted {predicted}, measured {measured}"),
                    ],
                )
            }
            None => (
                self.severity(m.usage),
                vec![
                    format!(
                        "step {}: measured {measured} at micro-batch {mb}, no prediction yet",
                        m.step
                    ),
                    format!("measured {measured}; no prediction yet"),
                ],
            ),
        })
    }
}

fn outlook_risk(state: &PolicyState, o: &Outlook, warning: Option<f64>) -> (Level, Vec<String>) {
    let over = |f: f64| match warning {
        Some(w) => format!("{} > warning {}", pct(f), pct(w)),
        None => pct(f),
    };
    match (o.forecast, o.resized_to, o.predicted) {
        (Some(f), Some(to), Some(p)) => (
            state.severity(p),
            vec![
                format!(
                    "next step forecast {}: micro-batch → {to}, predicted {}",
                    over(f),
                    pct(p)
                ),
                format!("forecast {}: micro-batch → {to}, {}", over(f), pct(p)),
                format!("forecast {}: micro-batch → {to}, {}", pct(f), pct(p)),
                format!("forecast {}: → {to} at {}", pct(f), pct(p)),
            ],
        ),
        (Some(f), _, _) => {
            let warn = warning
                .map(|w| format!(" (warning {})", pct(w)))
                .unwrap_or_default();
            (
                state.severity(f),
                vec![
                    format!("next step predicted {}{warn}", pct(f)),
                    format!("next step {}{warn}", pct(f)),
                ],
            )
        }
        (None, Some(to), Some(p)) => (
            state.severity(p),
            vec![
                format!("next step predicted {} at micro-batch {to}", pct(p)),
                format!("next: {} at micro-batch {to}", pct(p)),
            ],
        ),
        (None, to, _) => (
            Level::Info,
            vec![match to {
                Some(to) => format!("next step at micro-batch {to}, not predicted yet"),
                None => "next step not predicted yet".into(),
            }],
        ),
    }
}

/// The step a resize's new size is first run in, from the step the trainer numbered it
/// with. The trainer numbers a decision by the step it concerns: a forecast is made before
/// that step runs and an OOM's shrink during it (its retry runs at the new size), while
/// the other resizes follow a completed step and so apply from the next one.
pub fn applies_to(step: u64, reason: ResizeReason) -> u64 {
    match reason {
        ResizeReason::Forecast | ResizeReason::Oom => step,
        ResizeReason::Grow
        | ResizeReason::Critical
        | ResizeReason::Emergency
        | ResizeReason::OverTarget
        | ResizeReason::Pinned => step + 1,
    }
}

/// The trainer's answer to a refused command starts with `refused:` (core's contract for
/// threshold changes).
pub fn is_refusal(applied: &str) -> bool {
    applied.trim_start().starts_with("refused:")
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::StepMetrics;

    fn memory(step: u64, mb: usize, usage: f64, predicted: Option<f64>) -> Telemetry {
        let limit: u64 = 1 << 30;
        Telemetry::StepMemory(StepMemory {
            step,
            micro_batch: mb,
            seq_len: 64,
            peak_bytes: (usage * limit as f64) as u64,
            predicted_bytes: predicted.map(|p| (p * limit as f64) as u64),
            limit_bytes: limit,
            configured_limit_bytes: limit,
            usage,
        })
    }

    fn resize(step: u64, from: usize, to: usize, reason: ResizeReason) -> Telemetry {
        Telemetry::Decision {
            step,
            decision: Decision::Resize {
                from,
                to,
                reason,
                usage: 0.4,
                predicted: Some(0.8),
            },
        }
    }

    fn step(n: u64, mb: usize) -> Telemetry {
        Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 100,
            loss: 1.0,
            lr: Some(1e-3),
            grad_norm: Some(1.0),
            step_time_s: 0.1,
            tokens_per_s: 1.0,
            samples_per_s: 1.0,
            micro_batch: mb,
            accum_steps: 1,
            effective_batch: mb,
            seq_len: 64,
            tokens_seen: 0,
        })
    }

    #[test]
    fn a_late_step_report_does_not_undo_a_newer_resize() {
        let mut p = PolicyState::new(64);
        p.apply(0.0, &step(12, 8));
        p.apply(0.0, &resize(12, 8, 32, ResizeReason::Grow));
        assert_eq!(p.micro_batch(), Some(32));
        // Step 12's metrics arriving late on the other channel.
        p.apply(0.0, &step(12, 8));
        assert_eq!(p.micro_batch(), Some(32));
        p.apply(0.0, &step(13, 32));
        assert_eq!(p.micro_batch(), Some(32));
    }

    #[test]
    fn pinned_follows_the_trainer_and_an_oom_unpins() {
        let mut p = PolicyState::new(64);
        p.apply(
            0.0,
            &Telemetry::CommandApplied {
                command: Command::PinMicroBatch { micro_batch: 16 },
                applied: "micro-batch pinned at 16, 2 accumulation steps".into(),
            },
        );
        assert!(p.pinned);
        p.apply(
            0.0,
            &Telemetry::Oom {
                step: 5,
                micro_batch: 16,
                seq_len: 64,
                retry_with: Some(8),
                error: "CUDA out of memory".into(),
            },
        );
        assert!(!p.pinned);
        assert_eq!(p.micro_batch(), Some(8));
        p.apply(0.0, &resize(6, 8, 4, ResizeReason::Pinned));
        assert!(p.pinned, "a resize for a pin means pinned");
        p.apply(
            0.0,
            &Telemetry::CommandApplied {
                command: Command::Unpin,
                applied: "micro-batch unpinned; the controller resizes again".into(),
            },
        );
        assert!(!p.pinned);
    }

    #[test]
    fn the_outlook_lasts_until_the_step_it_is_about_has_run() {
        let mut p = PolicyState::new(64);
        p.apply(
            0.0,
            &Telemetry::ThresholdsChanged {
                thresholds: Thresholds::default(),
                profile: Some(Profile::Balanced),
                source: "config".into(),
            },
        );
        p.apply(0.0, &memory(20, 32, 0.85, Some(0.84)));
        // Made before step 21 runs, so numbered 21 (the step it concerns).
        p.apply(
            0.0,
            &Telemetry::Decision {
                step: 21,
                decision: Decision::Warning {
                    usage: 0.93,
                    forecast: true,
                    text: "the next batch is forecast at 93%".into(),
                },
            },
        );
        let (level, text) = p.risk().unwrap();
        assert_eq!(level, Level::Warn);
        assert_eq!(text[0], "next step predicted 93% (warning 92%)");
        // Step 20's figures arriving late on the other channel are not step 21's.
        p.apply(0.0, &memory(20, 32, 0.85, Some(0.84)));
        assert_eq!(
            p.risk().unwrap().1[0],
            "next step predicted 93% (warning 92%)"
        );
        p.apply(0.0, &memory(21, 32, 0.86, Some(0.93)));
        let (_, text) = p.risk().unwrap();
        assert_eq!(
            text[0],
            "step 21: predicted 93% at micro-batch 32, measured 86%"
        );
    }

    #[test]
    fn a_forecast_shrink_says_both_numbers() {
        let mut p = PolicyState::new(64);
        p.apply(0.0, &memory(20, 32, 0.85, None));
        for d in [
            Decision::Warning {
                usage: 0.93,
                forecast: true,
                text: String::new(),
            },
            Decision::Resize {
                from: 32,
                to: 24,
                reason: ResizeReason::Forecast,
                usage: 0.93,
                predicted: Some(0.85),
            },
        ] {
            p.apply(
                0.0,
                &Telemetry::Decision {
                    step: 21,
                    decision: d,
                },
            );
        }
        let (_, text) = p.risk().unwrap();
        assert_eq!(
            text[0],
            "next step forecast 93%: micro-batch → 24, predicted 85%"
        );
    }

    #[test]
    fn histories_and_marks_stay_bounded() {
        let mut p = PolicyState::new(32);
        for n in 0..(MARKS_KEPT as u64 + 50) {
            p.apply(n as f64, &memory(n, 8, 0.5, Some(0.5)));
            p.apply(n as f64, &resize(n, 8, 16, ResizeReason::Grow));
        }
        assert!(p.peak_usage.points().len() <= 32);
        assert!(p.predicted_usage.points().len() <= 32);
        assert_eq!(p.marks.len(), MARKS_KEPT);
        assert_eq!(p.marks.back().unwrap().t, (MARKS_KEPT + 49) as f64);
    }

    #[test]
    fn headroom_is_measured_from_the_last_peak() {
        let mut p = PolicyState::new(8);
        assert_eq!(p.headroom(None), None);
        p.apply(
            0.0,
            &Telemetry::ThresholdsChanged {
                thresholds: Thresholds::default(),
                profile: None,
                source: "config".into(),
            },
        );
        p.apply(0.0, &memory(1, 8, 0.5, None));
        let (to_target, to_limit) = p.headroom(None).unwrap();
        assert_eq!(to_limit, 1 << 29);
        assert_eq!(to_target, (0.4 * (1u64 << 30) as f64) as i64);
        assert!(p.marks.is_empty(), "config thresholds are not a change");
        // Other processes took memory since: the room is what can still be reached.
        let reachable = (1u64 << 29) + (100 << 20);
        assert_eq!(p.headroom(Some(reachable)), Some((100 << 20, 100 << 20)));
        assert_eq!(p.headroom(Some(1 << 20)), Some((0, 0)));
    }

    /// The micro-batch's history is kept per step, merged by its smallest size.
    #[test]
    fn batch_sizes_keep_every_step_and_never_hide_a_shrink() {
        let mut p = PolicyState::new(4);
        for (n, mb) in [(1, 8), (2, 16), (3, 4), (4, 16), (5, 16), (6, 16)] {
            p.apply(n as f64, &step(n, mb));
        }
        let sizes: Vec<f64> = p.batch_sizes.points().iter().map(|p| p.1).collect();
        assert!(sizes.contains(&4.0), "{sizes:?}");
        assert_eq!(sizes.last(), Some(&16.0));
    }

    #[test]
    fn refusals_are_recognised_by_their_prefix() {
        assert!(is_refusal(
            "refused: threshold target = 0 is outside (0, 1]"
        ));
        assert!(!is_refusal("thresholds 0.90,0.92,0.95,0.97 in force"));
    }
}
