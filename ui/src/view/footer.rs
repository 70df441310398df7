//! The one-line footer: a question or a lost link when there is one, else the keys, and
//! on the right a replay's position or the samples dropped.
//!
//! Which keys it shows: the ones that do something in the run's state,
//! named for what they do in it (`p` pauses a running run and resumes a paused one; a
//! stopping or ended run takes no commands). All of them when they fit, else it leaves
//! out keys in a fixed order (navigation before the run's controls). `?` is never left
//! out: it lists everything.
use headroom_core::{Precision, RunStatus};
use ratatui::layout::{Alignment, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

use super::fg;
use super::text::{ellipsize, width};
use crate::app::App;
use crate::keys::{bindings, EDITOR_BINDINGS};

/// Dashboard keys, first left out first (an attached view's `S` among the last).
pub const SHED_ORDER: [&str; 15] = [
    "^Z", "Esc", "w", "↑↓", "Tab", "e", "a", "m", "P", "f", "+/-", "[ ]", "b", "t", "S",
];
/// A replay's keys, first left out first: its own controls stay longest.
pub const REPLAY_SHED_ORDER: [&str; 9] = ["^Z", "Esc", "w", "Tab", "↑↓", "e", "[ ]", "+/-", "G"];
/// Dashboard keys while the event list is open: its own keys stay longest.
pub const EVENTS_SHED_ORDER: [&str; 14] = [
    "^Z", "w", "Tab", "[ ]", "a", "m", "P", "f", "+/-", "b", "t", "c", "p", "Esc",
];
/// Editor keys, first left out first.
pub const EDITOR_SHED_ORDER: [&str; 2] = ["P", "←→"];

/// The dashboard's keys that act now, each with the word for what it does now. Keys the
/// app would ignore in this state are not offered.
pub fn live(app: &App) -> Vec<(&'static str, &'static str)> {
    bindings(&app.mode)
        .iter()
        .filter_map(|(key, short, _)| label_now(app, key, short).map(|l| (*key, l)))
        .collect()
}

fn label_now(app: &App, key: &str, short: &'static str) -> Option<&'static str> {
    // Only a job has ranks to select.
    if key == "[ ]" && app.job.is_none() {
        return None;
    }
    // Only a run that switches a lever itself (the built-in trainer, a Python run that
    // handed its run precision= or checkpoint blocks) has its key.
    let levers = app.levers();
    match key {
        "m" if levers.precision.is_none() => return None,
        "a" if levers.checkpointing.is_none() => return None,
        _ => {}
    }
    let commands = app.takes_commands();
    if app.mode.is_replay() {
        let paused = app.replay.is_some_and(|r| r.paused);
        let ended = app.replay.is_some_and(|r| r.ended);
        return match key {
            "Space" | "n" | "G" if ended => None,
            "Space" if paused => Some("play"),
            "Esc" if !app.show_help && !app.show_events => None,
            "e" if app.show_events => Some("close events"),
            _ => Some(short),
        };
    }
    match key {
        "q" if app.mode.is_attached() && !app.is_over() => Some("detach"),
        "q" if app.is_over() => Some("close"),
        "S" if !commands => None,
        "q" if app.stop_requested => Some("quit now"),
        "p" if !commands => None,
        "p" => match app.status {
            RunStatus::Running => Some("pause"),
            RunStatus::Paused => Some("resume"),
            _ => None,
        },
        "b" if commands && app.policy.pinned => Some("unpin"),
        "c" | "t" | "P" | "b" | "+/-" | "f" | "m" | "a" if !commands => None,
        // Named for where the key goes from here.
        "m" | "a" => Some(match key {
            "m" => match levers.other_precision(levers.precision?) {
                Precision::Fp32 => "fp32",
                Precision::Bf16 => "bf16",
                Precision::Fp16 => "fp16",
            },
            "a" if levers.checkpointing?.is_on() => "keep acts",
            _ => short,
        }),
        "Esc" if !app.show_help && !app.show_events => None,
        "e" if app.show_events => Some("close events"),
        _ => Some(short),
    }
}

/// Cells one key takes, as drawn: ` q ` then ` stop  `.
fn cells(key: &str, short: &str) -> usize {
    key.chars().count() + short.chars().count() + 5
}

/// The (key, short label) pairs that fit in `room` cells, in their order.
pub fn shown<'a>(
    keys: &[(&'a str, &'a str)],
    shed_order: &[&str],
    room: usize,
) -> Vec<(&'a str, &'a str)> {
    let mut used: usize = keys.iter().map(|(k, s)| cells(k, s)).sum();
    let mut shed: Vec<&str> = Vec::new();
    for key in shed_order {
        if used <= room {
            break;
        }
        if let Some((k, s)) = keys.iter().find(|(k, _)| k == key) {
            used -= cells(k, s);
            shed.push(k);
        }
    }
    keys.iter()
        .filter(|(k, _)| !shed.contains(k))
        .copied()
        .collect()
}

/// The `S` key's question: what a stop will keep, as the run said at its start (a
/// Python run without `on_checkpoint` saves nothing).
fn stop_question(app: &App) -> &'static str {
    match app.info.as_ref().and_then(|i| i.checkpoints) {
        Some(false) => {
            "stop the run? y stops it (finish the step; no checkpoint: the run has no \
             on_checkpoint) · n or Esc: no"
        }
        _ => "stop the run? y stops it (finish the step, checkpoint) · n or Esc: no",
    }
}

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    // A question or a lost link is what matters now: it takes the whole line.
    let alert = if app.confirm_stop {
        Some((stop_question(app).to_string(), Color::Yellow))
    } else {
        app.link.banner().map(|text| (text, Color::Red))
    };
    if let Some((text, color)) = alert {
        let style = fg(app, Color::Black)
            .bg_if(app.color, color)
            .add_modifier(Modifier::BOLD);
        let text = ellipsize(&format!(" {text} "), area.width as usize);
        frame.render_widget(Paragraph::new(Span::styled(text, style)), area);
        return;
    }
    let dropped = (app.dropped > 0).then(|| format!("dropped samples {}", app.dropped));
    let right = match (app.replay.filter(|_| app.mode.is_replay()), dropped) {
        (Some(r), _) => Some(r.status_line()),
        (None, dropped) => dropped,
    };
    let reserved = right.as_ref().map_or(0, |d| width(d) + 1);
    let room = (area.width as usize).saturating_sub(reserved);
    // The keys that work now, named for what they do now: the editor is modal, and a
    // paused, stopping or ended run takes other keys than a running one.
    let keys = match app.editor {
        Some(_) => {
            let all: Vec<_> = EDITOR_BINDINGS.iter().map(|(k, s, _)| (*k, *s)).collect();
            shown(&all, &EDITOR_SHED_ORDER, room)
        }
        None if app.mode.is_replay() => shown(&live(app), &REPLAY_SHED_ORDER, room),
        None if app.show_events => shown(&live(app), &EVENTS_SHED_ORDER, room),
        None => shown(&live(app), &SHED_ORDER, room),
    };
    let mut spans = Vec::new();
    for (key, short) in keys {
        spans.push(Span::styled(
            format!(" {key} "),
            fg(app, Color::Black).bg_if(app.color, Color::Gray),
        ));
        spans.push(Span::raw(format!(" {short}  ")));
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
    if let Some(text) = right {
        frame.render_widget(
            Paragraph::new(Span::styled(text, fg(app, Color::DarkGray)))
                .alignment(Alignment::Right),
            area,
        );
    }
}

/// Background colour only when colour is on.
trait BgIf {
    fn bg_if(self, on: bool, color: Color) -> Self;
}

impl BgIf for Style {
    fn bg_if(self, on: bool, color: Color) -> Self {
        if on {
            self.bg(color)
        } else {
            self.add_modifier(Modifier::REVERSED)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::EDITOR_BINDINGS;

    use crate::keys::BINDINGS;

    fn all() -> Vec<(&'static str, &'static str)> {
        BINDINGS.iter().map(|(k, s, _)| (*k, *s)).collect()
    }

    fn keys(room: usize) -> Vec<&'static str> {
        shown(&all(), &SHED_ORDER, room)
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    #[test]
    fn everything_fits_on_a_wide_line_but_help_only_keys() {
        let all = keys(1000);
        assert_eq!(all.len(), BINDINGS.len());
        let wide = keys(210);
        assert!(!wide.contains(&"^Z") && wide.contains(&"w"), "{wide:?}");
    }

    #[test]
    fn at_80_columns_the_run_controls_stay() {
        let k = keys(80);
        for needed in ["q", "p", "c", "t", "b", "?"] {
            assert!(k.contains(&needed), "{needed} missing: {k:?}");
        }
        let total: usize = shown(&all(), &SHED_ORDER, 80)
            .iter()
            .map(|(k, s)| cells(k, s))
            .sum();
        assert!(total <= 80);
        // With the dropped-samples counter beside them, help and the run's own controls.
        let k = keys(56);
        assert_eq!(k, vec!["q", "p", "c", "?"]);
    }

    #[test]
    fn every_shed_key_is_in_its_table() {
        let attached = bindings(&crate::mode::Mode::Attached {
            address: "a".into(),
        });
        for k in SHED_ORDER.iter().chain(&EVENTS_SHED_ORDER) {
            assert!(attached.iter().any(|b| b.0 == *k), "{k}");
        }
        let replay = bindings(&crate::mode::Mode::Replay { source: "r".into() });
        for k in REPLAY_SHED_ORDER {
            assert!(replay.iter().any(|b| b.0 == k), "{k}");
        }
        assert!(!EVENTS_SHED_ORDER.contains(&"e") && !EVENTS_SHED_ORDER.contains(&"q"));
        for k in EDITOR_SHED_ORDER {
            assert!(EDITOR_BINDINGS.iter().any(|b| b.0 == k), "{k}");
        }
        assert!(!SHED_ORDER.contains(&"?"));
    }
}
