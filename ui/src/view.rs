//! Drawing. Reads the [`App`] and nothing else: no I/O, no locks, no clocks.
//!
//! This file lays the frame out and hands each area to the module that draws it.
mod allocator;
mod bar;
mod breakdown;
mod charts;
mod editor;
mod events;
mod footer;
mod gauge;
mod header;
mod heap;
mod help;
mod hints;
mod host;
mod memory;
mod ranks;
mod text;
mod training;
mod usage_chart;

use headroom_core::RunStatus;
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::widgets::{Block, Paragraph, Wrap};
use ratatui::Frame;

pub use allocator::segment_bar;

use crate::app::{App, Focus};

pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 24;

pub fn render(frame: &mut Frame, app: &App) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        too_small(frame, area);
        return;
    }
    // Tall terminals get dedicated allocator and host panels; at 80x24 their essentials
    // live in the memory panel.
    let detail_rows = if area.height >= 40 { 10 } else { 0 };
    // At 24 rows the memory and training panels get 5 lines each and shed their least
    // useful ones (see `keep_most_important`); one more row lets them show everything.
    let top_rows = if area.height >= 26 { 8 } else { 7 };
    let rows = split_rows(
        area.height.saturating_sub(5 + top_rows + detail_rows),
        ranks::wanted_rows(app),
    );
    let [header, top, details, job, charts, events, footer] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(top_rows),
        Constraint::Length(detail_rows),
        Constraint::Length(rows.job),
        Constraint::Length(rows.charts),
        Constraint::Length(rows.events),
        Constraint::Length(1),
    ])
    .areas(area);
    let [memory, batch] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(top);
    let [mem_chart, loss_chart] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(charts);
    if detail_rows > 0 {
        match &app.segments {
            // The allocator panel's longest line is 48 columns: give it exactly that and
            // the map the width left over, since wider bars resolve smaller blocks.
            Some(map) => {
                let [alloc, segments, host] = Layout::horizontal([
                    Constraint::Length(50),
                    Constraint::Percentage(40),
                    Constraint::Min(0),
                ])
                .areas(details);
                allocator::render(frame, app, alloc);
                allocator::render_segments(frame, app, map, segments);
                host::render(frame, app, host);
            }
            None => {
                let [alloc, host] =
                    Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                        .areas(details);
                // On the CPU glibc's heap is the allocator: its panel takes the place.
                if on_cpu(app) {
                    heap::render(frame, app, alloc);
                } else {
                    allocator::render(frame, app, alloc);
                }
                host::render(frame, app, host);
            }
        }
    }

    header::render(frame, app, header);
    memory::render(frame, app, memory);
    training::render(frame, app, batch);
    if rows.job > 0 {
        ranks::render(frame, app, job);
    }
    if rows.charts > 0 {
        charts::render_memory(frame, app, mem_chart);
        charts::render_loss(frame, app, loss_chart);
    }
    let hint_rows = hints::rows_wanted(app, events.height);
    let [hint_area, events] =
        Layout::vertical([Constraint::Length(hint_rows), Constraint::Min(0)]).areas(events);
    if hint_rows > 0 {
        hints::render(frame, app, hint_area);
    }
    events::render_panel(frame, app, events);
    footer::render(frame, app, footer);
    if app.show_events {
        let [list, _] = Layout::vertical([Constraint::Min(0), Constraint::Length(1)]).areas(area);
        events::render_full(frame, app, list);
    }
    if let Some(ed) = &app.editor {
        editor::render(frame, app, ed, area);
    }
    if app.show_help {
        help::render(frame, app, area);
    }
}

/// Rows of the middle of the screen: a job's ranks, the charts and the event log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MiddleRows {
    job: u16,
    charts: u16,
    events: u16,
}

/// Shares `rest` rows between the job panel (which wants `job_wants`, 0 without a job),
/// the charts and the event log. Without a job: the charts take 8 rows or more and the
/// log gives up rows first, down to three. With one, the ranks come before the charts
/// (at most half of the room when the job is large): charts of fewer than 6 rows show
/// nothing readable, so on a short terminal they go and the log keeps the rest.
fn split_rows(rest: u16, job_wants: u16) -> MiddleRows {
    let job =
        job_wants
            .min(rest.saturating_sub(3))
            .min(if job_wants > 0 { 7.max(rest / 2) } else { 0 });
    let left = rest - job;
    let events = left.saturating_sub(8).clamp(3, 7).min(left);
    let charts = left - events;
    if charts < 6 && job > 0 {
        return MiddleRows {
            job,
            charts: 0,
            events: left,
        };
    }
    MiddleRows {
        job,
        charts,
        events,
    }
}

/// A panel's frame; the focused one stands out (bold and thick when colour is off).
fn panel<'a>(app: &App, focus: Focus, title: String) -> Block<'a> {
    let block = Block::bordered().title(title);
    if app.focus != focus {
        return block;
    }
    block
        .border_type(ratatui::widgets::BorderType::Thick)
        .border_style(fg(app, Color::Cyan).add_modifier(Modifier::BOLD))
}

/// A style that is plain when colour is off (NO_COLOR).
pub(crate) fn fg(app: &App, color: Color) -> Style {
    if app.color {
        Style::default().fg(color)
    } else {
        Style::default()
    }
}

fn status_color(status: RunStatus) -> Color {
    match status {
        RunStatus::Running => Color::Green,
        RunStatus::Paused | RunStatus::Stopping | RunStatus::Starting => Color::Yellow,
        RunStatus::Finished => Color::Cyan,
        RunStatus::Failed => Color::Red,
    }
}

fn too_small(frame: &mut Frame, area: Rect) {
    let text = format!(
        "Terminal too small: {}x{}, need at least {MIN_WIDTH}x{MIN_HEIGHT}. Enlarge the window.",
        area.width, area.height
    );
    let height = 3.min(area.height);
    let y = area.y + area.height.saturating_sub(height) / 2;
    let rect = Rect::new(area.x, y, area.width, height);
    frame.render_widget(
        Paragraph::new(text)
            .alignment(Alignment::Center)
            .wrap(Wrap { trim: true }),
        rect,
    );
}

/// Whether the run is on the CPU: said by the run's start, else by a sample that carries
/// heap figures (a view that joined before the start record).
fn on_cpu(app: &App) -> bool {
    match &app.info {
        Some(info) => info.device == "cpu",
        None => app.sample.as_ref().is_some_and(|s| s.heap.is_some()),
    }
}
