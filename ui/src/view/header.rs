//! The header: the run's name and where the picture comes from, its status, progress and
//! pace, and the device it trains on.
use headroom_core::units::fmt_duration;
use headroom_core::RunStatus;
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::text::{ellipsize, first_fitting, width};
use super::{fg, status_color};
use crate::app::App;

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    let title = format!(" headroom · {} ", app.run_name);
    let mut block = Block::bordered().title(Span::styled(
        title.clone(),
        fg(app, Color::Cyan).add_modifier(Modifier::BOLD),
    ));
    // Where the picture comes from, on the right of the title: a viewer must never be
    // mistaken for the run's own screen.
    // A job's view moves its panels between ranks' sockets: it says which rank they show
    // (the title's run name holds the job's id), not the socket it first attached to.
    let tag = match (&app.job, app.panels_rank()) {
        (Some(_), Some(rank)) if app.mode.is_attached() => {
            Some(format!("attached to the job · rank {rank}'s panels"))
        }
        _ => app.mode.tag(),
    };
    if let Some(tag) = tag {
        let room = (area.width as usize).saturating_sub(width(&title) + 6);
        if room > 8 {
            block = block.title_top(
                Line::from(Span::styled(
                    format!(" {} ", ellipsize(&tag, room - 2)),
                    fg(app, Color::Magenta).add_modifier(Modifier::BOLD),
                ))
                .right_aligned(),
            );
        }
    }
    let status = Span::styled(
        format!("● {}", app.status_text()),
        fg(app, status_color(app.status)).add_modifier(Modifier::BOLD),
    );
    let throughput = match (&app.last_step, app.status) {
        // The last step's pace is history once the run is paused or over, not a rate.
        (_, RunStatus::Paused) => "paused: no steps running".into(),
        (_, RunStatus::Finished) => "finished".into(),
        (_, RunStatus::Failed) => "failed".into(),
        // Data without tokens (seq_len 1: a sample is the unit) has no token rate to show:
        // it would only repeat samples/s.
        (Some(s), _) if s.seq_len <= 1 => format!(
            "{:.1} samples/s · {:.1} steps/s",
            s.samples_per_s,
            1.0 / s.step_time_s.max(1e-9)
        ),
        (Some(s), _) => format!(
            "{:.1} samples/s · {:.0} tok/s · {:.1} steps/s",
            s.samples_per_s,
            s.tokens_per_s,
            1.0 / s.step_time_s.max(1e-9)
        ),
        (None, _) => "waiting for the first step".into(),
    };
    let params = app
        .model_line()
        .map(|m| format!(" · {m}"))
        .unwrap_or_default();
    // At 80 columns the device line sheds the parameter count, then steps/s.
    let cols = area.width.saturating_sub(2) as usize;
    let device = app.device_line();
    let about = [
        format!("{device}{params} · {throughput}"),
        format!("{device} · {throughput}"),
        format!(
            "{device} · {}",
            throughput
                .rsplit_once(" · ")
                .map_or(throughput.as_str(), |t| t.0)
        ),
    ];
    let lines = vec![
        Line::from(vec![
            status,
            Span::raw("  "),
            Span::raw(app.progress_line()),
            Span::raw(format!("  elapsed {}", fmt_duration(app.elapsed))),
        ]),
        Line::from(first_fitting(&about, cols)),
    ];
    frame.render_widget(Paragraph::new(lines).block(block), area);
}
