//! The CUDA caching allocator on a tall terminal: its figures now and at their peak, and
//! the map of its segments.
use headroom_core::units::fmt_bytes;
use headroom_core::{Segment, SegmentMap};
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Wrap};
use ratatui::Frame;

use super::fg;
use crate::app::App;

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
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
pub(super) fn render_segments(frame: &mut Frame, app: &App, map: &SegmentMap, area: Rect) {
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
