//! The event log: a panel of one line per entry (long ones end in an ellipsis), and the
//! full-screen list (`e`) where every entry is wrapped and read in full.
use headroom_core::units::fmt_duration;
use headroom_core::Level;
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph};
use ratatui::Frame;

use super::text::{ellipsize, width, wrap};
use super::{fg, panel};
use crate::app::{App, Focus, LogEntry};

/// ` 1m05s ` before each entry.
const TIME_COLS: usize = 7;

/// An entry's colour says how alarming it is; routine entries keep the terminal's own.
pub fn level_style(app: &App, level: Level) -> Style {
    match level {
        Level::Info => Style::default(),
        Level::Warn => fg(app, Color::Yellow),
        Level::Error => fg(app, Color::Red),
    }
}

fn time_span(app: &App, e: &LogEntry) -> Span<'static> {
    Span::styled(
        format!("{:>6} ", fmt_duration(e.t)),
        fg(app, Color::DarkGray),
    )
}

pub(super) fn render_panel(frame: &mut Frame, app: &App, area: Rect) {
    let rows = area.height.saturating_sub(2) as usize;
    // Borders and the time column; a long entry ends in an ellipsis, not mid-word, and
    // the title says where to read it whole.
    let text_cols = (area.width as usize).saturating_sub(2 + TIME_COLS);
    let shown: Vec<&LogEntry> = app
        .events
        .iter()
        .skip(app.event_scroll)
        .take(rows)
        .collect();
    let cut = shown.iter().any(|e| width(&e.text) > text_cols);
    let full = if cut {
        " · e: read in full"
    } else {
        " · e: all"
    };
    let title = match app.event_scroll {
        0 => format!(" events (newest first{full}) "),
        n => format!(" events ({n} newer above, Home: newest{full}) "),
    };
    let block = panel(app, Focus::Events, title);
    let lines: Vec<Line> = shown
        .iter()
        .map(|e| {
            Line::from(vec![
                time_span(app, e),
                Span::styled(ellipsize(&e.text, text_cols), level_style(app, e.level)),
            ])
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

/// Every entry from the scroll position on, wrapped under its time, over the whole screen
/// but the footer.
pub(super) fn render_full(frame: &mut Frame, app: &App, area: Rect) {
    let title = format!(
        " all {} events, newest first · ↑↓ PgUp PgDn scroll · Home newest · e/Esc close ",
        app.events.len()
    );
    let block = Block::bordered()
        .title(title)
        .border_style(fg(app, Color::Cyan));
    let inner = block.inner(area);
    let rows = inner.height as usize;
    let text_cols = (inner.width as usize).saturating_sub(TIME_COLS).max(1);
    let mut lines: Vec<Line> = Vec::with_capacity(rows);
    for e in app.events.iter().skip(app.event_scroll) {
        if lines.len() >= rows {
            break;
        }
        let style = level_style(app, e.level);
        for (i, part) in wrap(&e.text, text_cols).into_iter().enumerate() {
            let lead = if i == 0 {
                time_span(app, e)
            } else {
                Span::raw(" ".repeat(TIME_COLS))
            };
            lines.push(Line::from(vec![lead, Span::styled(part, style)]));
        }
    }
    lines.truncate(rows);
    if app.events.is_empty() {
        lines.push(Line::styled("no events yet", fg(app, Color::DarkGray)));
    }
    frame.render_widget(Clear, area);
    frame.render_widget(Paragraph::new(lines).block(block), area);
}
