//! The help overlay: every key of the mode, and how to read the marks.
use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};
use ratatui::Frame;

use super::fg;
use crate::app::App;
use crate::keys::bindings;

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    let table = bindings(&app.mode);
    let width = 72.min(area.width);
    // Bindings, a blank line and three notes; every line fits the width unwrapped. The
    // blank line goes first where the box would not fit (a viewer's longer table at 80×24).
    let spaced = table.len() as u16 + 6 <= area.height;
    let height = (table.len() as u16 + 5 + u16::from(spaced)).min(area.height);
    let rect = Rect::new(
        area.x + (area.width - width) / 2,
        area.y + (area.height - height) / 2,
        width,
        height,
    );
    let mut lines: Vec<Line> = table
        .iter()
        .map(|(k, _, what)| {
            Line::from(vec![
                Span::styled(format!("{k:>5}  "), fg(app, Color::Cyan)),
                Span::raw(*what),
            ])
        })
        .collect();
    if spaced {
        lines.push(Line::from(""));
    }
    let last = match app.mode {
        crate::mode::Mode::Replay { .. } => "a replay is read-only: p c t P b f send no commands",
        _ => "commands apply between steps; shown once the trainer confirms them",
    };
    for text in [
        "chart marks: ! OOM  E eval OOM  ↑↓ batch  c cache freed  T thresholds",
        "gauge marks: t target  w warning  c critical  e emergency",
        last,
    ] {
        lines.push(Line::styled(text, fg(app, Color::DarkGray)));
    }
    frame.render_widget(Clear, rect);
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(Block::bordered().title(" help — Esc or ? to close ")),
        rect,
    );
}
