//! The live hints up now (core/src/hints.rs): a small panel above the event log, one line
//! per hint; on a short terminal one line of their names. The event log holds each hint's
//! full text (raised and cleared), so nothing here is the only place it is said.
use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::fg;
use super::text::ellipsize;
use crate::app::App;

/// Hints shown in full at once; more are counted in the title.
const MAX_SHOWN: usize = 3;
/// The event log keeps at least this many rows beside the hints.
const EVENTS_KEEP: u16 = 3;

/// Rows the hints take from the event log's `available` rows: a bordered panel when it
/// fits beside a usable log, one line of names when only that does, else none.
pub fn rows_wanted(app: &App, available: u16) -> u16 {
    let n = app.hints.len().min(MAX_SHOWN) as u16;
    if n == 0 {
        0
    } else if available >= n + 2 + EVENTS_KEEP {
        n + 2
    } else if available > EVENTS_KEEP {
        1
    } else {
        0
    }
}

pub fn render(frame: &mut Frame, app: &App, area: Rect) {
    let style = fg(app, Color::Yellow);
    if area.height == 1 {
        let names: Vec<&str> = app.hints.keys().map(|k| k.label()).collect();
        let text = format!(" hints: {} (e: the event log says why)", names.join(" · "));
        let line = Line::from(Span::styled(ellipsize(&text, area.width as usize), style));
        frame.render_widget(Paragraph::new(line), area);
        return;
    }
    let n = app.hints.len();
    let title = if n > MAX_SHOWN {
        format!(" hints ({n}, {} more in the event log) ", n - MAX_SHOWN)
    } else {
        format!(" hints ({n}) ")
    };
    let cols = (area.width as usize).saturating_sub(2);
    let lines: Vec<Line> = app
        .hints
        .values()
        .take(MAX_SHOWN)
        .map(|h| {
            let head = format!("{}: ", h.hint.label());
            let rest = ellipsize(&h.text, cols.saturating_sub(head.chars().count()));
            Line::from(vec![Span::styled(head, style), Span::raw(rest)])
        })
        .collect();
    frame.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(title)),
        area,
    );
}
