//! The job panel: a row per rank of a torchrun job (as rank 0 gathered them), the rank
//! that bounds the job's memory and the one the others wait for marked, the job's loss,
//! and which rank is selected and whose panels are shown.
use headroom_core::units::fmt_bytes;
use headroom_core::{RankRow, RunStatus};
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::text::{ellipsize, first_fitting, width};
use super::{fg, status_color};
use crate::app::App;
use crate::job::JobView;

/// Rows the panel would like: borders, the column header and one per rank.
pub fn wanted_rows(app: &App) -> u16 {
    app.job
        .as_ref()
        .map_or(0, |j| j.rows.world_size.max(1) as u16 + 3)
}

/// One column: its header, its cells (one per shown rank) and how it is aligned.
struct Column {
    name: &'static str,
    header: &'static str,
    cells: Vec<String>,
    right: bool,
}

impl Column {
    fn width(&self) -> usize {
        self.cells
            .iter()
            .map(|c| width(c))
            .chain([width(self.header)])
            .max()
            .unwrap_or(0)
    }

    fn cell(&self, text: &str) -> String {
        let w = self.width();
        if self.right {
            format!("{text:>w$}")
        } else {
            format!("{text:<w$}")
        }
    }
}

/// Left out first when the panel is narrow: the host, then the confirmations, then the
/// limit beside the peak; rank, step, micro-batch, usage, OOMs, time and status stay.
const SHED_ORDER: [&str; 3] = ["host", "cmds", "peak/limit"];

/// `1.20/4.00 GiB`, or both in full when their units differ.
fn peak_of_limit(peak: u64, limit: u64) -> String {
    if limit == 0 {
        return "-".into();
    }
    let (p, l) = (fmt_bytes(peak), fmt_bytes(limit));
    match (p.rsplit_once(' '), l.rsplit_once(' ')) {
        (Some((pv, pu)), Some((lv, lu))) if pu == lu => format!("{pv}/{lv} {lu}"),
        _ => format!("{p}/{l}"),
    }
}

fn step_time(s: f64) -> String {
    match s {
        s if s <= 0.0 => "-".into(),
        s if s < 10.0 => format!("{:.0} ms", s * 1e3),
        s => format!("{s:.1} s"),
    }
}

/// What marks a rank: the tightest on memory, the slowest, one that fell behind.
fn notes(job: &JobView, row: &RankRow) -> Vec<String> {
    let multi = job.rows.world_size > 1;
    let tight = multi && job.rows.tightest() == Some(row.rank);
    let slow = multi && job.rows.slowest() == Some(row.rank);
    let behind = job.rows.step.saturating_sub(row.step);
    let behind =
        (row.status != RunStatus::Failed && behind > 1).then(|| format!("{behind} steps behind"));
    let mut full = Vec::new();
    let mut short = Vec::new();
    if tight {
        full.push("tightest memory".to_string());
        short.push("tightest".to_string());
    }
    if slow {
        full.push("slowest".to_string());
        short.push("slowest".to_string());
    }
    if let Some(b) = behind {
        full.push(b.clone());
        short.push(b.replace(" steps behind", " behind"));
    }
    vec![full.join(" · "), short.join(" · "), short.join(" ")]
}

/// Which ranks get a row when not all fit: the selected one, the tightest, the slowest
/// and those in trouble first, then in rank order; shown in rank order.
fn shown_ranks(job: &JobView, rows: usize) -> Vec<usize> {
    let ranks = &job.rows.ranks;
    if ranks.len() <= rows {
        return (0..ranks.len()).collect();
    }
    let mut order: Vec<(u8, usize)> = ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let weight = if r.rank == job.selected {
                0
            } else if job.in_trouble(r) {
                1
            } else if job.rows.tightest() == Some(r.rank) || job.rows.slowest() == Some(r.rank) {
                2
            } else {
                3
            };
            (weight, i)
        })
        .collect();
    order.sort();
    let mut keep: Vec<usize> = order.into_iter().take(rows).map(|(_, i)| i).collect();
    keep.sort_unstable();
    keep
}

/// The panel's title, its longest form that fits.
fn title(job: &JobView, cols: usize) -> String {
    let r = &job.rows;
    let split = if r.uniform_micro_batch {
        "one micro-batch for all"
    } else {
        "micro-batch per rank"
    };
    let loss = job
        .loss()
        .map_or("no loss yet".into(), |l| format!("mean loss {l:.4}"));
    let agree = if r.agree_us >= 1000.0 {
        format!("agree {:.1} ms", r.agree_us / 1e3)
    } else {
        format!("agree {:.0} µs", r.agree_us)
    };
    let n = r.world_size;
    first_fitting(
        &[
            format!(
                " job {} · {n} ranks · step {} · {split} · {loss} · {agree} ",
                r.job, r.step
            ),
            format!(
                " job {} · {n} ranks · step {} · {split} · {loss} ",
                r.job, r.step
            ),
            format!(" job {} · {n} ranks · {split} · {loss} ", r.job),
            format!(" {n} ranks · {loss} "),
        ],
        cols,
    )
}

/// The bottom line: which rank is selected, whose panels show, and why not the selected
/// one's when they cannot.
fn selection_line(app: &App, job: &JobView, cols: usize) -> String {
    let panels = app.panels_rank();
    let shown = panels.map_or("the attached run".to_string(), |p| format!("rank {p}"));
    let sel = job.selected;
    let text = match &job.unreachable {
        Some((rank, why)) if *rank == sel => vec![
            format!(" rank {sel} selected: {why} · panels show {shown} "),
            format!(" rank {sel}: {why} "),
        ],
        _ if panels.is_some_and(|p| p != sel) => vec![
            format!(" rank {sel} selected · switching the panels to it… "),
            format!(" rank {sel} selected… "),
        ],
        _ => vec![
            format!(" panels show {shown} · [ ] or 0-9 selects a rank "),
            format!(" panels show {shown} "),
        ],
    };
    first_fitting(&text, cols)
}

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    let Some(job) = &app.job else { return };
    let cols = area.width.saturating_sub(2) as usize;
    let mut block = Block::bordered()
        .title(Span::styled(
            title(job, cols.saturating_sub(2)),
            Style::default().add_modifier(Modifier::BOLD),
        ))
        .title_bottom(Line::styled(
            selection_line(app, job, cols.saturating_sub(2)),
            fg(app, Color::DarkGray),
        ));
    if job
        .unreachable
        .as_ref()
        .is_some_and(|(r, _)| *r == job.selected)
    {
        block = block.border_style(fg(app, Color::Yellow));
    }
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.height == 0 {
        return;
    }
    let room = inner.height as usize - 1;
    let hidden_line = job.rows.ranks.len() > room;
    let shown = shown_ranks(
        job,
        if hidden_line {
            room.saturating_sub(1)
        } else {
            room
        },
    );
    let rows: Vec<&RankRow> = shown.iter().map(|&i| &job.rows.ranks[i]).collect();
    let most = job.commands_confirmed();
    let col = |name, header, right, f: &dyn Fn(&RankRow) -> String| Column {
        name,
        header,
        cells: rows.iter().map(|r| f(r)).collect(),
        right,
    };
    let mut columns = vec![
        col("rank", "rank", true, &|r| r.rank.to_string()),
        col("host", "host", false, &|r| ellipsize(&r.host, 16)),
        col("step", "step", true, &|r| r.step.to_string()),
        col("micro", "micro", true, &|r| r.micro_batch.to_string()),
        col("peak/limit", "peak/limit", true, &|r| {
            peak_of_limit(r.peak_bytes, r.limit_bytes)
        }),
        col("mem", "mem", true, &|r| {
            if r.limit_bytes > 0 {
                format!("{:.1}%", r.usage * 100.0)
            } else {
                "-".into()
            }
        }),
        col("ooms", "OOMs", true, &|r| r.ooms.to_string()),
        col("time", "step time", true, &|r| step_time(r.step_time_s)),
        col("status", "status", false, &|r| r.status.label().to_string()),
        col("cmds", "cmds", true, &|r| {
            if r.commands_applied < most {
                format!("{}/{most}", r.commands_applied)
            } else {
                r.commands_applied.to_string()
            }
        }),
    ];
    // The marker column (2 cells) and one space between columns; the notes get the rest.
    let fixed = |cols: &[Column]| 2 + cols.iter().map(|c| c.width() + 1).sum::<usize>();
    for name in SHED_ORDER {
        if fixed(&columns) + 8 <= cols {
            break;
        }
        columns.retain(|c| c.name != name);
    }
    let note_room = cols.saturating_sub(fixed(&columns));
    let header: String = columns
        .iter()
        .map(|c| c.cell(c.header))
        .collect::<Vec<_>>()
        .join(" ");
    let mut lines = vec![Line::styled(
        ellipsize(&format!("  {header}"), cols),
        fg(app, Color::DarkGray),
    )];
    for (i, row) in rows.iter().enumerate() {
        let selected = row.rank == job.selected;
        let mut spans = vec![Span::raw(if selected { "▶ " } else { "  " })];
        for c in &columns {
            let text = c.cell(&c.cells[i]);
            let style = match c.name {
                "status" => fg(app, status_color(row.status)),
                "ooms" if row.ooms > 0 => fg(app, Color::Red),
                "cmds" if row.commands_applied < most => fg(app, Color::Yellow),
                _ => Style::default(),
            };
            spans.push(Span::styled(text, style));
            spans.push(Span::raw(" "));
        }
        let note = first_fitting(&notes(job, row), note_room);
        let note_style = if job.in_trouble(row) {
            fg(app, Color::Red)
        } else {
            fg(app, Color::Yellow)
        };
        spans.push(Span::styled(note, note_style));
        let mut line = Line::from(spans);
        if selected {
            line = line.style(Style::default().add_modifier(Modifier::BOLD));
        }
        lines.push(line);
    }
    if hidden_line {
        let hidden: Vec<String> = job
            .rows
            .ranks
            .iter()
            .enumerate()
            .filter(|(i, _)| !shown.contains(i))
            .map(|(_, r)| r.rank.to_string())
            .collect();
        lines.push(Line::styled(
            ellipsize(
                &format!(
                    "  +{} more ranks ({}): enlarge the window, or select one with [ ]",
                    hidden.len(),
                    hidden.join(", ")
                ),
                cols,
            ),
            fg(app, Color::DarkGray),
        ));
    }
    frame.render_widget(Paragraph::new(lines), inner);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_and_limit_share_their_unit_when_they_can() {
        assert_eq!(peak_of_limit(1 << 30, 4 << 30), "1.00/4.00 GiB");
        assert_eq!(peak_of_limit(512 << 20, 4 << 30), "512 MiB/4.00 GiB");
        assert_eq!(peak_of_limit(5, 0), "-");
    }

    #[test]
    fn step_times_read_in_ms_then_seconds() {
        assert_eq!(step_time(0.0), "-");
        assert_eq!(step_time(0.1234), "123 ms");
        assert_eq!(step_time(12.34), "12.3 s");
    }
}
