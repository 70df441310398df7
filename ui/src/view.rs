//! Drawing. Reads the [`App`] and nothing else: no I/O, no locks, no clocks.
use headroom_core::units::{fmt_bytes, fmt_duration};
use headroom_core::{Level, RunStatus, Segment, SegmentMap};
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Clear, Dataset, Gauge, GraphType, Paragraph, Wrap};
use ratatui::Frame;

use crate::app::{App, Focus};
use crate::keys::BINDINGS;

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
    // The fixed panels need 19 rows besides the event log; on short terminals the log
    // gives up rows, not the memory panel (else its allocator lines are cut).
    let event_rows = area.height.saturating_sub(19).clamp(3, 7);
    let [header, top, details, charts, events, footer] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(6),
        Constraint::Length(detail_rows),
        Constraint::Min(8),
        Constraint::Length(event_rows),
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
                render_allocator(frame, app, alloc);
                render_host(frame, app, host);
            }
        }
    }

    render_header(frame, app, header);
    render_memory(frame, app, memory);
    render_batch(frame, app, batch);
    render_memory_chart(frame, app, mem_chart);
    render_loss_chart(frame, app, loss_chart);
    render_events(frame, app, events);
    render_footer(frame, app, footer);
    if app.show_help {
        render_help(frame, app, area);
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
fn fg(app: &App, color: Color) -> Style {
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
    let block = Block::bordered().title(Span::styled(
        title,
        fg(app, Color::Cyan).add_modifier(Modifier::BOLD),
    ));
    let status = Span::styled(
        format!("● {}", app.status_text()),
        fg(app, status_color(app.status)).add_modifier(Modifier::BOLD),
    );
    let throughput = match &app.last_step {
        Some(s) => format!(
            "{:.1} samples/s · {:.0} tok/s · {:.1} steps/s",
            s.samples_per_s,
            s.tokens_per_s,
            1.0 / s.step_time_s.max(1e-9)
        ),
        None => "waiting for the first step".into(),
    };
    let params = app
        .info
        .as_ref()
        .map(|i| format!(" · {:.2}M params", i.parameters as f64 / 1e6))
        .unwrap_or_default();
    let lines = vec![
        Line::from(vec![
            status,
            Span::raw("  "),
            Span::raw(app.progress_line()),
            Span::raw(format!("  elapsed {}", fmt_duration(app.elapsed))),
        ]),
        Line::from(format!("{}{params} · {throughput}", app.device_line())),
    ];
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

fn render_memory(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" memory now ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [gauge_area, text_area] =
        Layout::vertical([Constraint::Length(1), Constraint::Min(1)]).areas(inner);

    let Some(mem) = app.memory_now() else {
        frame.render_widget(Paragraph::new("waiting for the first sample…"), inner);
        return;
    };
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
    frame.render_widget(
        Gauge::default()
            .gauge_style(fg(app, color))
            .ratio(ratio)
            .label(format!(
                "{what} {} / {} ({:.1}%)",
                fmt_bytes(mem.used),
                fmt_bytes(mem.capacity),
                ratio * 100.0
            )),
        gauge_area,
    );

    let sample = app.sample.as_ref();
    let mut lines = vec![Line::from(format!(
        "headroom {} free",
        fmt_bytes(mem.capacity.saturating_sub(mem.used))
    ))];
    match sample.and_then(|s| s.allocator.as_ref()) {
        Some(a) => {
            lines.push(Line::from(format!(
                "alloc {} · reserved {} · frag {:.1}% · unused {:.1}%",
                fmt_bytes(a.allocated),
                fmt_bytes(a.reserved),
                a.fragmentation() * 100.0,
                a.unused_reserved() * 100.0
            )));
            lines.push(Line::from(format!(
                "peak alloc {} · retries {} · OOMs {}",
                fmt_bytes(a.allocated_peak),
                a.num_alloc_retries,
                a.num_ooms
            )));
        }
        None => {
            if let Some(s) = sample {
                lines.push(Line::from(format!(
                    "host {} / {} · cpu {:.0}%",
                    fmt_bytes(s.host.mem_used),
                    fmt_bytes(s.host.mem_total),
                    s.host.cpu_percent
                )));
            }
            lines.push(Line::styled(
                "allocator stats are CUDA-only: this run is on the CPU",
                fg(app, Color::DarkGray),
            ));
        }
    }
    frame.render_widget(Paragraph::new(lines), text_area);
}

fn render_allocator(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" CUDA caching allocator ");
    let sample = app.sample.as_ref();
    let Some(a) = sample.and_then(|s| s.allocator.as_ref()) else {
        let lines = vec![
            Line::from("No allocator figures: this run is on the CPU."),
            Line::styled(
                "libtorch's CPU allocator keeps no cache, so the process's resident set",
                fg(app, Color::DarkGray),
            ),
            Line::styled(
                "(host panel) is what the memory gauge and the policy watch.",
                fg(app, Color::DarkGray),
            ),
        ];
        frame.render_widget(Paragraph::new(lines).block(block), area);
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

fn render_batch(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" training ");
    let lines = match &app.last_step {
        None => vec![Line::from("no step yet")],
        Some(s) => {
            let val = app
                .last_eval
                .as_ref()
                .map(|e| format!("{:.4}", e.val_loss))
                .unwrap_or_else(|| "--".into());
            vec![
                Line::from(format!(
                    "batch: micro {} × accum {} = effective {}",
                    s.micro_batch, s.accum_steps, s.effective_batch
                )),
                Line::from(format!(
                    "seq {} · lr {:.2e} · step {:.0} ms",
                    s.seq_len,
                    s.lr,
                    s.step_time_s * 1e3
                )),
                Line::from(format!(
                    "loss {:.4} · val {val} · grad norm {:.2}",
                    s.loss, s.grad_norm
                )),
                Line::from(format!("tokens seen {}", s.tokens_seen)),
            ]
        }
    };
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

fn render_events(frame: &mut Frame, app: &App, area: Rect) {
    let title = match app.event_scroll {
        0 => " events (newest first) ".to_string(),
        n => format!(" events ({n} newer above, Home: newest) "),
    };
    let block = panel(app, Focus::Events, title);
    let rows = area.height.saturating_sub(2) as usize;
    let lines: Vec<Line> = app
        .events
        .iter()
        .skip(app.event_scroll)
        .take(rows)
        .map(|e| {
            let color = match e.level {
                Level::Info => Color::Reset,
                Level::Warn => Color::Yellow,
                Level::Error => Color::Red,
            };
            Line::from(vec![
                Span::styled(
                    format!("{:>6} ", fmt_duration(e.t)),
                    fg(app, Color::DarkGray),
                ),
                Span::styled(e.text.clone(), fg(app, color)),
            ])
        })
        .collect();
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

/// Keys the footer leaves out first when the line is short: navigation goes before the
/// run's controls, and `?` (which lists everything) is never left out.
const FOOTER_SHED_ORDER: [&str; 3] = ["w", "↑↓", "Tab"];

fn render_footer(frame: &mut Frame, app: &App, area: Rect) {
    let dropped = (app.dropped > 0).then(|| format!("dropped samples {}", app.dropped));
    let reserved = dropped.as_ref().map_or(0, |d| d.chars().count() + 1);
    let room = (area.width as usize).saturating_sub(reserved);
    // " q " + " stop  ", as drawn below.
    let width = |key: &str, short: &str| key.chars().count() + short.chars().count() + 5;
    let keys: Vec<_> = BINDINGS.iter().take(7).collect();
    let mut used: usize = keys.iter().map(|(k, s, _)| width(k, s)).sum();
    let mut shed: Vec<&str> = Vec::new();
    for key in FOOTER_SHED_ORDER {
        if used <= room {
            break;
        }
        if let Some((k, s, _)) = keys.iter().find(|(k, _, _)| *k == key) {
            used -= width(k, s);
            shed.push(key);
        }
    }
    let mut spans = Vec::new();
    for (key, short, _) in keys.iter().filter(|(k, _, _)| !shed.contains(k)) {
        spans.push(Span::styled(
            format!(" {key} "),
            fg(app, Color::Black).bg_if(app.color, Color::Gray),
        ));
        spans.push(Span::raw(format!(" {short}  ")));
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
    if let Some(text) = dropped {
        frame.render_widget(
            Paragraph::new(Span::styled(text, fg(app, Color::DarkGray)))
                .alignment(Alignment::Right),
            area,
        );
    }
}

fn render_help(frame: &mut Frame, app: &App, area: Rect) {
    let width = 72.min(area.width);
    let height = (BINDINGS.len() as u16 + 6).min(area.height);
    let rect = Rect::new(
        area.x + (area.width - width) / 2,
        area.y + (area.height - height) / 2,
        width,
        height,
    );
    let mut lines: Vec<Line> = BINDINGS
        .iter()
        .map(|(k, _, what)| {
            Line::from(vec![
                Span::styled(format!("{k:>5}  "), fg(app, Color::Cyan)),
                Span::raw(*what),
            ])
        })
        .collect();
    lines.push(Line::from(""));
    lines.push(Line::styled(
        "commands apply at the next step boundary; the screen shows what the trainer confirmed",
        fg(app, Color::DarkGray),
    ));
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
