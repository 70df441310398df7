//! Command echoes: the trainer reports a state change just before it confirms the
//! command that caused it (`status: paused`, then `paused after step 8`). The entry the
//! change makes is marked with the answer it expects, and the confirmation that follows
//! within the same happening is merged into it, so the log says it once.
use headroom_core::{Command, RunStatus, Telemetry};

use super::App;

/// A state change and the confirmation of the command that caused it are sent back to
/// back; records this close in the run's time are one happening.
const SAME_HAPPENING_S: f64 = 0.25;

/// A state change the trainer reports just before confirming the command that caused it
/// (`status: paused`, then `paused after step 8`): one happening, so one line.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Echo {
    answers: Answers,
    merged: Merged,
}

/// The commands whose confirmation repeats an earlier entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answers {
    Pause,
    Resume,
    Stop,
    Thresholds,
    Pin,
    FreeCache,
}

impl Answers {
    fn of(command: &Command) -> Option<Answers> {
        Some(match command {
            Command::Pause => Answers::Pause,
            Command::Resume => Answers::Resume,
            Command::Stop => Answers::Stop,
            Command::SetThresholds { .. } | Command::SetProfile { .. } => Answers::Thresholds,
            Command::PinMicroBatch { .. } => Answers::Pin,
            Command::FreeCache => Answers::FreeCache,
            _ => return None,
        })
    }
}

/// Which words the merged line keeps.
#[derive(Debug, Clone, PartialEq)]
enum Merged {
    /// The confirmation's: it says more (`paused after step 8` over `status: paused`).
    Answer,
    /// The entry's own: it already names values, profile and source.
    Own,
    /// The confirmation's, between the entry's step and its details.
    Framed { prefix: String, suffix: String },
}

impl App {
    /// Folds a command's confirmation into the entry that announced its effect a moment
    /// before (the same frame: the trainer sends both back to back), if there is one.
    pub(super) fn merge_answer(&mut self, now: f64, command: &Command, applied: &str) -> bool {
        let Some(answers) = Answers::of(command) else {
            return false;
        };
        let found = self
            .events
            .iter_mut()
            .take(4)
            .take_while(|e| (e.t - now).abs() <= SAME_HAPPENING_S)
            .find(|e| e.echo.as_ref().is_some_and(|echo| echo.answers == answers));
        let Some(entry) = found else {
            return false;
        };
        let echo = entry.echo.take().expect("found by its echo");
        match echo.merged {
            Merged::Answer => entry.text = applied.to_string(),
            Merged::Own => {}
            Merged::Framed { prefix, suffix } => {
                entry.text = format!("{prefix}{applied}{suffix}");
            }
        }
        true
    }
}

/// The entry a message makes that a command's confirmation would repeat, if any.
pub(super) fn echo_of(msg: &Telemetry) -> Option<Echo> {
    use headroom_core::policy::{Decision, ResizeReason};
    let (answers, merged) = match msg {
        Telemetry::Status { status } => (
            match status {
                RunStatus::Paused => Answers::Pause,
                RunStatus::Running => Answers::Resume,
                RunStatus::Stopping => Answers::Stop,
                _ => return None,
            },
            Merged::Answer,
        ),
        Telemetry::ThresholdsChanged { source, .. } if source == "command" => {
            (Answers::Thresholds, Merged::Own)
        }
        Telemetry::Decision {
            step,
            decision:
                Decision::Resize {
                    from,
                    reason: ResizeReason::Pinned,
                    predicted,
                    ..
                },
        } => {
            let predicted = predicted
                .map(|p| format!(", predicted {}", crate::describe::pct(p)))
                .unwrap_or_default();
            (
                Answers::Pin,
                Merged::Framed {
                    prefix: format!("step {step}: "),
                    suffix: format!(" (was {from}{predicted})"),
                },
            )
        }
        Telemetry::Decision {
            step,
            decision: Decision::EmptyCache { .. },
        } => (
            Answers::FreeCache,
            Merged::Framed {
                prefix: format!("step {step}: "),
                suffix: String::new(),
            },
        ),
        _ => return None,
    };
    Some(Echo { answers, merged })
}
