//! Drawing. Reads the [`App`] and nothing else: no I/O, no locks, no clocks.
mod bar;
mod breakdown;
mod editor;
mod events;
mod footer;
mod gauge;
mod heap;
mod hints;
mod ranks;
mod text;
mod training;
mod usage_chart;

use headroom_core::units::{fmt_bytes, fmt_duration};
use headroom_core::{Level, RunStatus, Segment, SegmentMap, StepMemory};
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Clear, Dataset, GraphType, Paragraph, Wrap};
use ratatui::Frame;

use crate::app::{App, Focus};
use crate::keys::{bindings, EDITOR_BINDINGS};
use text::{ellipsize, first_fitting, keep_most_important, width};

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
                render_allocator(frame, app, alloc);
                render_segments(frame, app, map, segments);
                render_host(frame, app, host);
            }
            None => {
                let [alloc, host] =
                    Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                        .areas(details);
                // On the CPU glibc's heap is the allocator: its panel takes the place.
                if on_cpu(app) {
                    heap::render(frame, app, alloc);
                } else {
                    render_allocator(frame, app, alloc);
                }
                render_host(frame, app, host);
            }
        }
    }

    render_header(frame, app, header);
    render_memory(frame, app, memory);
    training::render(frame, app, batch);
    if rows.job > 0 {
        ranks::render(frame, app, job);
    }
    if rows.charts > 0 {
        render_memory_chart(frame, app, mem_chart);
        render_loss_chart(frame, app, loss_chart);
    }
    let hint_rows = hints::rows_wanted(app, events.height);
    let [hint_area, events] =
        Layout::vertical([Constraint::Length(hint_rows), Constraint::Min(0)]).areas(events);
    if hint_rows > 0 {
        hints::render(frame, app, hint_area);
    }
    events::render_panel(frame, app, events);
    render_footer(frame, app, footer);
    if app.show_events {
        let [list, _] = Layout::vertical([Constraint::Min(0), Constraint::Length(1)]).areas(area);
        events::render_full(frame, app, list);
    }
    if let Some(ed) = &app.editor {
        editor::render(frame, app, ed, area);
    }
    if app.show_help {
        render_help(frame, app, area);
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

fn render_header(frame: &mut Frame, app: &App, area: Rect) {
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

fn level_color(level: Level) -> Color {
    match level {
        Level::Info => Color::Green,
        Level::Warn => Color::Yellow,
        Level::Error => Color::Red,
    }
}

fn render_memory(frame: &mut Frame, app: &App, area: Rect) {
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
fn free_now(app: &App, mem: crate::app::MemoryNow) -> u64 {
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
fn render_sample_gauge(frame: &mut Frame, app: &App, mem: crate::app::MemoryNow, area: Rect) {
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

/// Whether the run is on the CPU: said by the run's start, else by a sample that carries
/// heap figures (a view that joined before the start record).
fn on_cpu(app: &App) -> bool {
    match &app.info {
        Some(info) => info.device == "cpu",
        None => app.sample.as_ref().is_some_and(|s| s.heap.is_some()),
    }
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

fn render_allocator(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" CUDA caching allocator ");
    let sample = app.sample.as_ref();
    let Some(a) = sample.and_then(|s| s.allocator.as_ref()) else {
        let lines = vec![
            Line::from("No allocator figures in the latest sample."),
            Line::styled(
                "The event log says why (the statistics failed, or the producer does \
                 not send them).",
                fg(app, Color::DarkGray),
            ),
        ];
        frame.render_widget(
            Paragraph::new(lines).wrap(Wrap { trim: true }).block(block),
            area,
        );
        return;
    };
    let row = |name: &str, now: u64, peak: u64| {
        Line::from(format!(
            "{name:<15}{:>11}   peak {:>11}",
            fmt_bytes(now),
            fmt_bytes(peak)
        ))
    };
    let mut lines = vec![
        row("allocated", a.allocated, a.allocated_peak),
        row("reserved", a.reserved, a.reserved_peak),
        row("active", a.active, a.active_peak),
        row("inactive split", a.inactive_split, a.inactive_split_peak),
        Line::from(format!(
            "fragmentation {:.1}% (inactive split / reserved)",
            a.fragmentation() * 100.0
        )),
        Line::from(format!(
            "unused reserved {:.1}% (1 - allocated / reserved)",
            a.unused_reserved() * 100.0
        )),
    ];
    if let Some(g) = sample.and_then(|s| s.gpu.as_ref()) {
        lines.push(Line::from(format!(
            "outside allocator {} (NVML used - reserved)",
            fmt_bytes(g.mem_used.saturating_sub(a.reserved))
        )));
    }
    let oom_style = if a.num_ooms > 0 {
        fg(app, Color::Red)
    } else {
        Style::default()
    };
    lines.push(Line::styled(
        format!(
            "alloc retries {} · OOMs {} · segments {}",
            a.num_alloc_retries, a.num_ooms, a.segments
        ),
        oom_style,
    ));
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

/// One row per segment: its size, then a bar of its blocks in address order, so free
/// holes between live tensors (the fragmentation `emptyCache` cannot return) show up.
fn render_segments(frame: &mut Frame, app: &App, map: &SegmentMap, area: Rect) {
    let shown_bytes: u64 = map.segments.iter().map(|s| s.total_size).sum();
    let title = if map.omitted_segments > 0 {
        format!(
            " segment map: {} largest of {} segments, {} ",
            map.segments.len(),
            map.segments.len() + map.omitted_segments,
            fmt_bytes(shown_bytes + map.omitted_bytes)
        )
    } else {
        format!(
            " segment map: {} segments, {} ",
            map.segments.len(),
            fmt_bytes(shown_bytes)
        )
    };
    let block = Block::bordered().title(title);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let rows = inner.height as usize;
    // " 8.00 GiB " before the bar, one space after it.
    let bar_width = (inner.width as usize).saturating_sub(11);
    if rows == 0 || bar_width == 0 {
        return;
    }
    let hidden = map.segments.len().saturating_sub(rows);
    // When not every segment fits, the last row says how many are missing.
    let fit = if hidden > 0 { rows - 1 } else { rows };
    let mut lines: Vec<Line> = map
        .segments
        .iter()
        .take(fit)
        .map(|seg| {
            let mut spans = vec![Span::raw(format!(" {:>8} ", fmt_bytes(seg.total_size)))];
            spans.extend(
                segment_bar(seg, bar_width)
                    .into_iter()
                    .map(|(text, allocated)| {
                        let color = if allocated {
                            Color::Cyan
                        } else {
                            Color::DarkGray
                        };
                        Span::styled(text, fg(app, color))
                    }),
            );
            Line::from(spans)
        })
        .collect();
    if hidden > 0 {
        let rest: u64 = map.segments[fit..].iter().map(|s| s.total_size).sum();
        lines.push(Line::styled(
            format!(
                " +{} more segments, {}",
                map.segments.len() - fit,
                fmt_bytes(rest)
            ),
            fg(app, Color::DarkGray),
        ));
    }
    frame.render_widget(Paragraph::new(lines), inner);
}

/// A segment drawn in `width` cells, as runs of equal cells: `(text, allocated)`. Each
/// cell shows the state holding most of its bytes; a tie shows allocated, so a block
/// straddling a cell boundary is not hidden by the free space next to it.
pub fn segment_bar(seg: &Segment, width: usize) -> Vec<(String, bool)> {
    let total: u128 = seg.runs.iter().map(|r| r.size as u128).sum();
    if width == 0 || total == 0 {
        return Vec::new();
    }
    let w = width as u128;
    // In units of 1/width of a byte, cell i spans [i*total, (i+1)*total) and a run
    // starting at byte b spans [b*width, ...): integer arithmetic, no rounding drift.
    let mut out: Vec<(String, bool)> = Vec::new();
    let mut run_idx = 0;
    let mut run_start: u128 = 0;
    for cell in 0..w {
        let (lo, hi) = (cell * total, (cell + 1) * total);
        let mut allocated_part: u128 = 0;
        let mut i = run_idx;
        let mut start = run_start;
        while i < seg.runs.len() {
            let end = start + seg.runs[i].size as u128 * w;
            let overlap = end.min(hi).saturating_sub(start.max(lo));
            if seg.runs[i].allocated {
                allocated_part += overlap;
            }
            if end > hi {
                break;
            }
            // This run ends inside the cell: later cells start from the next one.
            i += 1;
            start = end;
            run_idx = i;
            run_start = start;
        }
        let allocated = allocated_part * 2 >= total;
        let symbol = if allocated { '█' } else { '░' };
        match out.last_mut() {
            Some((text, state)) if *state == allocated => text.push(symbol),
            _ => out.push((symbol.to_string(), allocated)),
        }
    }
    out
}

fn render_host(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" host ");
    let Some(s) = app.sample.as_ref() else {
        frame.render_widget(Paragraph::new("no sample yet").block(block), area);
        return;
    };
    let h = &s.host;
    let mut lines = vec![
        Line::from(format!("cpu {:.0}%", h.cpu_percent)),
        Line::from(format!(
            "memory {} / {} ({:.1}%)",
            fmt_bytes(h.mem_used),
            fmt_bytes(h.mem_total),
            100.0 * h.mem_used as f64 / h.mem_total.max(1) as f64
        )),
        Line::from(format!("process RSS {}", fmt_bytes(h.process_rss))),
    ];
    if h.mem_available > 0 {
        lines.insert(
            2,
            Line::from(format!(
                "available {} (what others leave)",
                fmt_bytes(h.mem_available)
            )),
        );
    }
    if let Some(g) = &s.gpu {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "--".into());
        lines.push(Line::from(""));
        lines.push(Line::from(format!("GPU {} · {}", g.index, g.name)));
        lines.push(Line::from(format!(
            "util {} · {} · {}",
            opt(g.util_percent.map(|u| format!("{u}%"))),
            opt(g.temperature_c.map(|t| format!("{t}°C"))),
            opt(g.power_w.map(|p| format!("{p:.0} W")))
        )));
    }
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

fn bounds(points: &[(f64, f64)]) -> Option<([f64; 2], [f64; 2])> {
    let first = points.first()?;
    let (mut x, mut y) = ([first.0, first.0], [first.1, first.1]);
    for p in points {
        x = [x[0].min(p.0), x[1].max(p.0)];
        y = [y[0].min(p.1), y[1].max(p.1)];
    }
    if x[1] <= x[0] {
        x[1] = x[0] + 1.0;
    }
    Some((x, y))
}

fn empty_chart(frame: &mut Frame, block: Block, area: Rect, text: &str) {
    frame.render_widget(Paragraph::new(text).block(block), area);
}

fn render_memory_chart(frame: &mut Frame, app: &App, area: Rect) {
    // Once the trainer reports step peaks, the chart shows them against the limit and the
    // thresholds; until then, the sampler's bytes.
    if app.policy.last_memory.is_some() {
        let block = panel(
            app,
            Focus::MemoryChart,
            format!(" memory vs limit ({}, w) ", app.window.label()),
        );
        return usage_chart::render(frame, app, area, block);
    }
    let block = panel(
        app,
        Focus::MemoryChart,
        format!(" memory history ({}, w) ", app.window.label()),
    );
    let mut points = app.memory.points();
    if let Some(span) = app.window.seconds() {
        let from = app.elapsed - span;
        points.retain(|p| p.0 >= from);
    }
    let (Some((x, _)), Some(mem)) = (bounds(&points), app.memory_now()) else {
        return empty_chart(frame, block, area, "no samples yet");
    };
    // Scaled to what was used (with room above), not to capacity: 500 MiB of a 24 GiB
    // host would otherwise be a flat line on the floor. The gauge shows capacity.
    let seen = points.iter().fold(1.0_f64, |hi, p| hi.max(p.1));
    let top = (seen * 1.25).min(mem.capacity as f64).max(1.0);
    let data = Dataset::default()
        .marker(Marker::Braille)
        .graph_type(GraphType::Line)
        .style(fg(app, Color::Magenta))
        .data(&points);
    let chart = Chart::new(vec![data])
        .block(block)
        .x_axis(
            Axis::default()
                .bounds(x)
                .labels([fmt_duration(x[0]), fmt_duration(x[1])]),
        )
        .y_axis(
            Axis::default()
                .bounds([0.0, top])
                .labels(["0".to_string(), fmt_bytes(top as u64)]),
        );
    frame.render_widget(chart, area);
}

fn render_loss_chart(frame: &mut Frame, app: &App, area: Rect) {
    let block = panel(app, Focus::LossChart, " loss (train, val) ".into());
    let train = app.loss.points();
    let val = app.val_loss.points();
    let all: Vec<(f64, f64)> = train.iter().chain(val.iter()).copied().collect();
    let Some((x, y)) = bounds(&all) else {
        return empty_chart(frame, block, area, "no step yet");
    };
    let pad = ((y[1] - y[0]) * 0.05).max(1e-3);
    let y = [(y[0] - pad).max(0.0), y[1] + pad];
    let datasets = vec![
        Dataset::default()
            .name("train")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(fg(app, Color::Cyan))
            .data(&train),
        Dataset::default()
            .name("val")
            .marker(Marker::Dot)
            .graph_type(GraphType::Scatter)
            .style(fg(app, Color::Yellow))
            .data(&val),
    ];
    let chart = Chart::new(datasets)
        .block(block)
        .x_axis(
            Axis::default()
                .bounds(x)
                .labels([format!("{:.0}", x[0]), format!("{:.0}", x[1])]),
        )
        .y_axis(
            Axis::default()
                .bounds(y)
                .labels([format!("{:.2}", y[0]), format!("{:.2}", y[1])]),
        );
    frame.render_widget(chart, area);
}

fn render_footer(frame: &mut Frame, app: &App, area: Rect) {
    // A question or a lost link is what matters now: it takes the whole line.
    let alert = if app.confirm_stop {
        Some((
            "stop the run? y stops it (finish the step, checkpoint) · n or Esc: no".to_string(),
            Color::Yellow,
        ))
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
            footer::shown(&all, &footer::EDITOR_SHED_ORDER, room)
        }
        None if app.mode.is_replay() => {
            footer::shown(&footer::live(app), &footer::REPLAY_SHED_ORDER, room)
        }
        None if app.show_events => {
            footer::shown(&footer::live(app), &footer::EVENTS_SHED_ORDER, room)
        }
        None => footer::shown(&footer::live(app), &footer::SHED_ORDER, room),
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

fn render_help(frame: &mut Frame, app: &App, area: Rect) {
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
        "chart marks: ! OOM  ↑↓ batch resized  c cache freed  T thresholds set",
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
