//! The memory panel: the step's peak (or, before the first step, the sampler's figure)
//! against the limit, with the thresholds, the risk, the headroom left, where the memory
//! went and the sampler's essentials, ranked so a short terminal keeps what matters most.
use headroom_core::units::fmt_bytes;
use headroom_core::{Level, StepMemory};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::fg;
use super::text::{first_fitting, keep_most_important};
use super::{bar, breakdown, gauge};
use crate::app::{App, MemoryNow};

fn level_color(level: Level) -> Color {
    match level {
        Level::Info => Color::Green,
        Level::Warn => Color::Yellow,
        Level::Error => Color::Red,
    }
}

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    // "limit" is the configured one, as the run's "memory limit …" notice says; what other
    // processes left of it is "available", and usage is a share of that.
    let title = match (app.policy.lowered_limit(), app.policy.limit_bytes()) {
        (Some((available, limit)), _) => {
            let (available, limit) = (fmt_bytes(available), fmt_bytes(limit));
            first_fitting(
                &[
                    format!(" memory · limit {limit} · {available} of it available "),
                    format!(" memory · limit {limit} · {available} available "),
                    format!(" limit {limit} · {available} available "),
                ],
                area.width.saturating_sub(2) as usize,
            )
        }
        (None, Some(limit)) => format!(" memory · limit {} ", fmt_bytes(limit)),
        (None, None) => " memory now ".to_string(),
    };
    let block = Block::bordered().title(title);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.height == 0 {
        return;
    }
    let [gauge_area, text_area] =
        Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(inner);
    let cols = inner.width as usize;

    let lines = match (&app.policy.last_memory, app.memory_now()) {
        (Some(m), _) => {
            render_step_gauge(frame, app, m, gauge_area);
            memory_lines(app, m, cols)
        }
        (None, Some(mem)) => {
            render_sample_gauge(frame, app, mem, gauge_area);
            // No marks yet: this gauge is against all the memory there is, and the
            // thresholds are fractions of the limit (on the CPU, the smaller budget).
            let mut lines: Vec<(u8, Line)> = app
                .policy
                .thresholds
                .map(|t| {
                    let name = app.policy.profile.map_or("custom", |p| p.name());
                    let text = [
                        format!("thresholds {t} of the limit ({name})"),
                        format!("thresholds {t} ({name})"),
                        format!("thresholds {t}"),
                    ];
                    let text = first_fitting(&text, cols);
                    (0, Line::styled(text, fg(app, Color::DarkGray)))
                })
                .into_iter()
                .collect();
            lines.push((
                1,
                Line::from(format!("headroom {} free", fmt_bytes(free_now(app, mem)))),
            ));
            lines.extend(sample_lines(app, cols));
            lines
        }
        (None, None) => {
            frame.render_widget(Paragraph::new("waiting for the first sample…"), inner);
            return;
        }
    };
    let rows = text_area.height as usize;
    frame.render_widget(Paragraph::new(keep_most_important(lines, rows)), text_area);
}

/// What more the process could take now. On the CPU that is what the kernel says is
/// available, not host total minus our resident set: other processes' memory is not free.
fn free_now(app: &App, mem: MemoryNow) -> u64 {
    let host = app.sample.as_ref().map(|s| &s.host);
    match host {
        Some(h) if !mem.on_gpu && h.mem_available > 0 => h.mem_available,
        Some(h) if !mem.on_gpu && h.mem_used > 0 => h.mem_total.saturating_sub(h.mem_used),
        _ => mem.capacity.saturating_sub(mem.used),
    }
}

/// The most the process could hold right now, by the sampler's fresher figures: on the
/// CPU its resident set plus what the kernel still has available. None when unknown (and
/// on a GPU, where the trainer's limit already counts other processes).
fn reachable_now(app: &App) -> Option<u64> {
    let s = app.sample.as_ref()?;
    (s.gpu.is_none() && s.host.mem_available > 0).then(|| s.host.process_rss + s.host.mem_available)
}

/// The last step's peak against the limit, coloured by the thresholds it crossed.
fn render_step_gauge(frame: &mut Frame, app: &App, m: &StepMemory, area: Rect) {
    let color = level_color(app.policy.severity(m.usage));
    let what = if app.memory_now().is_some_and(|n| n.on_gpu) {
        "GPU peak"
    } else {
        "step peak"
    };
    let label = format!(
        "{what} {} / {} ({:.1}%)",
        fmt_bytes(m.peak_bytes),
        fmt_bytes(m.limit_bytes),
        m.usage * 100.0
    );
    let color = app.color.then_some(color);
    bar::render(frame.buffer_mut(), area, m.usage, &label, color);
}

/// Before the first step's peak: the sampler's figure against all the memory there is.
fn render_sample_gauge(frame: &mut Frame, app: &App, mem: MemoryNow, area: Rect) {
    let ratio = if mem.capacity > 0 {
        (mem.used as f64 / mem.capacity as f64).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let what = if mem.on_gpu { "GPU" } else { "process RSS" };
    let color = match ratio {
        r if r >= 0.95 => Color::Red,
        r if r >= 0.90 => Color::Yellow,
        _ => Color::Green,
    };
    let label = format!(
        "{what} {} / {} ({:.1}%)",
        fmt_bytes(mem.used),
        fmt_bytes(mem.capacity),
        ratio * 100.0
    );
    bar::render(
        frame.buffer_mut(),
        area,
        ratio,
        &label,
        app.color.then_some(color),
    );
}

/// The threshold marks under the gauge, once the trainer has said which are in force.
fn thresholds_row(app: &App, cols: usize) -> Option<(u8, Line<'static>)> {
    let t = app.policy.thresholds?;
    Some((0, gauge::marks_line(app, &t, app.policy.profile, cols)))
}

/// Ranked lines under the step gauge (lower rank stays longer on short terminals).
fn memory_lines(app: &App, m: &StepMemory, cols: usize) -> Vec<(u8, Line<'static>)> {
    let mut lines: Vec<(u8, Line)> = thresholds_row(app, cols).into_iter().collect();
    if let Some((level, texts)) = app.policy.risk() {
        let style = match level {
            Level::Info => Style::default(),
            other => fg(app, level_color(other)).add_modifier(Modifier::BOLD),
        };
        lines.push((0, Line::styled(first_fitting(&texts, cols), style)));
    }
    if let Some((available, limit)) = app.policy.lowered_limit() {
        let held = fmt_bytes(limit - available);
        let available = fmt_bytes(available);
        let lowered = [
            format!(
                "other processes hold {held} of the limit: usage is of the {available} available"
            ),
            format!("others hold {held} of the limit: usage is of {available}"),
            format!("others hold {held}: usage is of {available}"),
            format!("others hold {held} of the limit"),
        ];
        lines.push((
            1,
            Line::styled(
                first_fitting(&lowered, cols),
                fg(app, Color::Yellow).add_modifier(Modifier::BOLD),
            ),
        ));
    }
    let room = match app.policy.headroom(reachable_now(app)) {
        Some((to_target, to_limit)) => {
            let target = if to_target >= 0 {
                format!("{} to target", fmt_bytes(to_target as u64))
            } else {
                format!("{} over target", fmt_bytes(to_target.unsigned_abs()))
            };
            vec![
                format!("headroom {target} · {} to the limit", fmt_bytes(to_limit)),
                format!("headroom {target} · {} to limit", fmt_bytes(to_limit)),
                format!("{target} · {} to limit", fmt_bytes(to_limit)),
            ]
        }
        None => {
            let ceiling = reachable_now(app).map_or(m.limit_bytes, |r| r.min(m.limit_bytes));
            vec![format!(
                "headroom {} to the limit",
                fmt_bytes(ceiling.saturating_sub(m.peak_bytes))
            )]
        }
    };
    lines.push((1, Line::from(first_fitting(&room, cols))));
    if let Some(parts) = app.breakdown.parts(m, app.sample.as_ref()) {
        lines.push((1, breakdown::bar_line(app, &parts, cols)));
        lines.push((2, breakdown::legend(&parts, cols)));
    }
    lines.extend(sample_lines(app, cols));
    lines
}

/// The sampler's view: allocator figures on CUDA, the process, host and heap on the CPU.
fn sample_lines(app: &App, cols: usize) -> Vec<(u8, Line<'static>)> {
    let Some(sample) = app.sample.as_ref() else {
        return Vec::new();
    };
    match &sample.allocator {
        Some(a) => {
            let (alloc, reserved) = (fmt_bytes(a.allocated), fmt_bytes(a.reserved));
            let frag = format!("frag {:.1}%", a.fragmentation() * 100.0);
            let usage = [
                format!(
                    "alloc {alloc} · reserved {reserved} · {frag} · unused {:.1}%",
                    a.unused_reserved() * 100.0
                ),
                format!("alloc {alloc} · reserved {reserved} · {frag}"),
                format!("alloc {alloc} · rsv {reserved} · {frag}"),
            ];
            let peak = fmt_bytes(a.allocated_peak);
            let (retries, ooms) = (a.num_alloc_retries, a.num_ooms);
            let events = [
                format!("peak alloc {peak} · retries {retries} · OOMs {ooms}"),
                format!("peak {peak} · retries {retries} · OOMs {ooms}"),
            ];
            vec![
                (2, Line::from(first_fitting(&usage, cols))),
                (3, Line::from(first_fitting(&events, cols))),
            ]
        }
        None => {
            let h = &sample.host;
            let (rss, used, total) = (
                fmt_bytes(h.process_rss),
                fmt_bytes(h.mem_used),
                fmt_bytes(h.mem_total),
            );
            let host = [
                format!(
                    "process RSS {rss} · host {used} / {total} · cpu {:.0}%",
                    h.cpu_percent
                ),
                format!("process RSS {rss} · host {used} / {total}"),
                format!("RSS {rss} · host {used} / {total}"),
            ];
            let mut lines = vec![(2, Line::from(first_fitting(&host, cols)))];
            // The heap panel's essentials, for terminals too short to show the panel.
            if let Some(heap) = &sample.heap {
                let (live, held) = (fmt_bytes(heap.in_use), fmt_bytes(heap.held_apart()));
                let frag = heap.fragmentation() * 100.0;
                let texts = [
                    format!("heap: live {live} · held apart {held} ({frag:.1}% of anon RSS)"),
                    format!("heap live {live} · held apart {held} ({frag:.1}%)"),
                    format!("live {live} · held apart {held}"),
                ];
                lines.push((4, Line::from(first_fitting(&texts, cols))));
            }
            lines
        }
    }
}
