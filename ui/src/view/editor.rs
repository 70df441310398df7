//! The threshold editor overlay: the values in force beside the draft, the selected one
//! bracketed (visible without colour), and what became of the last Enter.
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::fg;
use super::gauge::percent;
use crate::app::App;
use crate::describe::thresholds_text;
use crate::editor::{profile_of, EditStatus, ThresholdEditor, NAMES};
use crate::keys::EDITOR_BINDINGS;

const LABEL: usize = 10;
const COLUMN: usize = 11;

/// `0.90`, or `0.875` when the value has more digits.
fn value(x: f64) -> String {
    let p = percent(x);
    if p.contains('.') {
        format!("{x:.3}")
    } else {
        format!("{x:.2}")
    }
}

fn row(label: &str, cells: Vec<Span<'static>>) -> Line<'static> {
    let mut spans = vec![Span::raw(format!("{label:<LABEL$}"))];
    spans.extend(cells);
    Line::from(spans)
}

fn cell(text: String) -> Span<'static> {
    Span::raw(format!("{text:>COLUMN$}"))
}

pub(super) fn render(frame: &mut Frame, app: &App, ed: &ThresholdEditor, area: Rect) {
    let width = 62.min(area.width);
    let in_force = app.policy.thresholds;
    let names = row("", NAMES.iter().map(|n| cell(n.to_string())).collect());
    let current = row(
        "in force",
        match in_force {
            Some(t) => t.as_array().iter().map(|x| cell(value(*x))).collect(),
            None => vec![Span::styled(
                format!("{:>COLUMN$}", "not reported yet"),
                fg(app, Color::DarkGray),
            )],
        },
    );
    let draft_cells = ed
        .draft
        .as_array()
        .iter()
        .enumerate()
        .flat_map(|(i, x)| {
            let changed = in_force.is_some_and(|t| t.as_array()[i] != *x);
            let mut style = Style::default();
            if changed {
                style = fg(app, Color::Yellow).add_modifier(Modifier::BOLD);
            }
            // Brackets say which one the arrows change, with or without colour.
            let text = if i == ed.selected {
                style = style.add_modifier(Modifier::REVERSED);
                format!("[{}]", value(*x))
            } else {
                value(*x)
            };
            let pad = COLUMN.saturating_sub(text.chars().count());
            [Span::raw(" ".repeat(pad)), Span::styled(text, style)]
        })
        .collect();
    let draft = row("new", draft_cells);
    let source = app
        .policy
        .thresholds_source
        .as_deref()
        .map(|s| format!(", from {s}"))
        .unwrap_or_default();
    let profiles = Line::styled(
        format!(
            "{:<LABEL$}{}{source} → {}",
            "profile",
            in_force.map_or("--".into(), |_| app
                .policy
                .profile
                .map_or("custom", |p| p.name())
                .to_string()),
            profile_of(&ed.draft).map_or("custom", |p| p.name()),
        ),
        fg(app, Color::DarkGray),
    );
    let hint = EDITOR_BINDINGS
        .iter()
        .map(|(k, short, _)| format!("{k} {short}"))
        .collect::<Vec<_>>()
        .join(" · ");
    let status = match &ed.status {
        EditStatus::Editing => Line::styled(
            "Enter sends them; the trainer confirms or refuses",
            fg(app, Color::DarkGray),
        ),
        EditStatus::Refused(why) => {
            let text = if why.starts_with("refused:") {
                why.clone()
            } else {
                format!("refused: {why}")
            };
            Line::styled(text, fg(app, Color::Red).add_modifier(Modifier::BOLD))
        }
        EditStatus::Sent(t) => Line::styled(
            format!(
                "sent {}; waiting for the trainer to confirm…",
                thresholds_text(t, profile_of(t))
            ),
            fg(app, Color::Yellow),
        ),
    };
    let lines = vec![
        names,
        current,
        draft,
        profiles,
        Line::default(),
        Line::styled(hint, fg(app, Color::DarkGray)),
        status,
    ];
    // As tall as its lines, the status wrapped (a long refusal takes three or four rows;
    // one spare row per wrapped line, since words do not break evenly).
    let inner_width = usize::from(width.saturating_sub(2)).max(1);
    let rows: usize = lines
        .iter()
        .map(|l| match l.width() {
            w if w <= inner_width => 1,
            w => w.div_ceil(inner_width) + 1,
        })
        .sum();
    let height = (rows as u16 + 2).min(area.height);
    let rect = Rect::new(
        area.x + (area.width - width) / 2,
        area.y + (area.height - height) / 2,
        width,
        height,
    );
    frame.render_widget(Clear, rect);
    frame.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(
            Block::bordered()
                .title(" memory thresholds (fractions of the limit) ")
                .border_style(fg(app, Color::Cyan)),
        ),
        rect,
    );
}
