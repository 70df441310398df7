//! The CPU heap panel: where the CUDA allocator panel stands on a GPU run. On the CPU the
//! step's peak resident set is what the controller and a soft budget measure, so the
//! panel shows what that resident set holds: live allocations against pages freed but
//! kept, what the last trim returned, and the most ever held apart. A figure the sampler
//! did not measure is said to be absent, never shown as 0.
use headroom_core::units::fmt_bytes;
use headroom_core::HeapStats;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::text::{first_fitting, wrap};
use super::{bar, fg};
use crate::app::App;
use crate::heap::HeapState;

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" CPU heap (glibc malloc) ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.height == 0 || inner.width == 0 {
        return;
    }
    let cols = inner.width as usize;
    let rss = app.sample.as_ref().map(|s| s.host.process_rss);
    let Some(h) = app.heap.now.as_ref() else {
        frame.render_widget(Paragraph::new(absent_lines(app, rss, cols)), inner);
        return;
    };
    let [gauge, text] = Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(inner);
    let live = 1.0 - h.fragmentation();
    let label = format!(
        "live {} of {} anonymous resident ({:.1}%)",
        fmt_bytes(h.in_use.min(h.rss_anon)),
        fmt_bytes(h.rss_anon),
        live * 100.0
    );
    bar::render(
        frame.buffer_mut(),
        gauge,
        live,
        &label,
        app.color.then_some(Color::Cyan),
    );
    frame.render_widget(Paragraph::new(lines(app, &app.heap, h, rss, cols)), text);
}

/// The figures under the gauge, each line the widest form that fits.
fn lines(
    app: &App,
    state: &HeapState,
    h: &HeapStats,
    rss: Option<u64>,
    cols: usize,
) -> Vec<Line<'static>> {
    let resident = match rss {
        Some(r) => fmt_bytes(r),
        None => "absent".into(),
    };
    let anon = fmt_bytes(h.rss_anon);
    let (in_use, held, free) = (
        fmt_bytes(h.in_use),
        fmt_bytes(h.held_apart()),
        fmt_bytes(h.free_kept),
    );
    let frag = format!("{:.1}%", h.fragmentation() * 100.0);
    let trim = match (h.last_trim_freed, state.last_trim_after_step) {
        (None, _) if h.trims == 0 => vec![
            "no trim yet: one comes before a smaller step; f trims now".to_string(),
            "no trim yet · f trims now".to_string(),
        ],
        (freed, step) => {
            let freed = freed.map_or("an unmeasured amount".into(), fmt_bytes);
            let when = step.map_or(String::new(), |s| format!(" after step {s}"));
            vec![
                format!("last trim{when} freed {freed} · {} trims", h.trims),
                format!("trim{when} freed {freed} · {} trims", h.trims),
                format!("trim freed {freed}"),
            ]
        }
    };
    let mut out = vec![
        Line::from(first_fitting(
            &[
                format!("resident (RSS) {resident} · anonymous {anon}"),
                format!("RSS {resident} · anon {anon}"),
            ],
            cols,
        )),
        Line::from(first_fitting(
            &[
                format!("in live allocations {in_use} (tensors and the rest)"),
                format!("in live allocations {in_use}"),
                format!("live {in_use}"),
            ],
            cols,
        )),
        Line::from(first_fitting(
            &[
                format!("held apart {held} = {frag} of anonymous (anon - live)"),
                format!("held apart {held} = {frag} of anonymous"),
                format!("held apart {held} ({frag})"),
            ],
            cols,
        )),
        Line::from(first_fitting(
            &[
                format!("freed, kept by malloc {free} (a trim returns its pages)"),
                format!("freed, kept by malloc {free}"),
                format!("kept free {free}"),
            ],
            cols,
        )),
        Line::from(first_fitting(&trim, cols)),
    ];
    if let Some((most, step)) = state.most_held_apart {
        out.push(Line::from(first_fitting(
            &[
                format!("most held apart {} (after step {step})", fmt_bytes(most)),
                format!("most held apart {}", fmt_bytes(most)),
            ],
            cols,
        )));
    }
    out.push(Line::styled(
        first_fitting(
            &[
                "a soft budget counts what is held apart as use".to_string(),
                "the budget counts it as use".to_string(),
            ],
            cols,
        ),
        fg(app, Color::DarkGray),
    ));
    out
}

/// A CPU sample without heap figures: the resident set, and why the rest is missing.
fn absent_lines(app: &App, rss: Option<u64>, cols: usize) -> Vec<Line<'static>> {
    let mut out = vec![Line::from(match rss {
        Some(r) => format!("resident (RSS) {}", fmt_bytes(r)),
        None => "waiting for the first sample".to_string(),
    })];
    if rss.is_some() {
        let why = "heap figures absent: this producer did not record them (a log from \
                   before they were, or a malloc other than glibc's)";
        out.extend(
            wrap(why, cols)
                .into_iter()
                .map(|l| Line::styled(l, fg(app, Color::DarkGray))),
        );
    }
    out
}
