//! The training panel: how the batch is split, the micro-batch's size over time, the
//! controller's last decision, loss and pace, and the last evaluation pass's memory (its
//! own phase, beside the validation loss).
use headroom_core::units::fmt_count;
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::events::level_style;
use super::fg;
use super::text::{ellipsize, first_fitting, keep_most_important, width};
use crate::app::App;
use crate::describe::{
    batch_split, decision_headline, decision_level, decision_reason, eval_failure, eval_pass,
};

const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The micro-batch per column over `[x0, x1]`: the smallest size run inside a column (a
/// shrink is never hidden), else the size carried on from the columns before; `None`
/// before the first step.
pub fn columns(points: &[(f64, f64)], n: usize) -> Vec<Option<f64>> {
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return vec![None; n];
    };
    let (x0, x1) = (first.0, last.0.max(first.0 + 1e-9));
    let mut out = vec![None; n];
    let mut carried: Option<f64> = None;
    let mut i = 0;
    for (col, slot) in out.iter_mut().enumerate() {
        let end = x0 + (x1 - x0) * (col + 1) as f64 / n as f64;
        let mut inside: Option<f64> = None;
        while i < points.len() && (points[i].0 <= end || col + 1 == n) {
            let v = points[i].1;
            inside = Some(inside.map_or(v, |m: f64| m.min(v)));
            carried = Some(v);
            i += 1;
        }
        *slot = inside.or(carried);
    }
    out
}

/// One block character per column, its height the size against the largest shown.
pub fn sparkline(points: &[(f64, f64)], n: usize) -> String {
    let max = points.iter().fold(0.0_f64, |m, p| m.max(p.1));
    columns(points, n)
        .into_iter()
        .map(|v| match v {
            Some(v) if max > 0.0 => {
                let level = ((v / max) * LEVELS.len() as f64).ceil() as usize;
                LEVELS[level.clamp(1, LEVELS.len()) - 1]
            }
            _ => ' ',
        })
        .collect()
}

/// `size ▁▁▄▄██▆▆ 8 (max 16)`: the size history over the memory chart's window, so the
/// chart's ↑↓ marks have their levels beside them.
fn size_line(app: &App, cols: usize) -> Option<Line<'static>> {
    let from = app.window.seconds().map(|s| app.elapsed - s);
    let points: Vec<(f64, f64)> = app
        .policy
        .batch_sizes
        .points()
        .into_iter()
        .filter(|p| from.is_none_or(|f| p.0 >= f))
        .collect();
    let now = points.last()?.1;
    let max = points.iter().fold(0.0_f64, |m, p| m.max(p.1));
    let label = if max > now {
        format!(" {now:.0} (max {max:.0})")
    } else {
        format!(" {now:.0}")
    };
    let prefix = "size ";
    let room = cols.saturating_sub(width(prefix) + width(&label));
    if room < 4 {
        return Some(Line::from(ellipsize(&format!("size{label}"), cols)));
    }
    Some(Line::from(vec![
        Span::styled(prefix, fg(app, Color::DarkGray)),
        Span::styled(sparkline(&points, room), fg(app, Color::Cyan)),
        Span::raw(label),
    ]))
}

/// The last evaluation pass: what it ran at and peaked at, or that it failed. A pass that
/// ran out of memory outranks the pace line below it; a routine one does not.
fn eval_line(app: &App, cols: usize) -> Option<(u8, Line<'static>)> {
    if let Some(f) = &app.eval.failed {
        let text = first_fitting(&eval_failure(f.step, &f.phase), cols);
        let style = level_style(app, headroom_core::Level::Error).add_modifier(Modifier::BOLD);
        return Some((2, Line::styled(text, style)));
    }
    let m = app.eval.last.as_ref()?;
    let text = first_fitting(&eval_pass(m), cols);
    Some(match m.ooms {
        0 => (3, Line::from(text)),
        _ => (
            2,
            Line::styled(text, level_style(app, headroom_core::Level::Warn)),
        ),
    })
}

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
    let block = Block::bordered().title(" training ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let cols = inner.width as usize;
    let policy = &app.policy;
    let mut lines: Vec<(u8, Line)> = Vec::new();
    let pinned = policy.pinned.then(|| {
        Span::styled(
            " · pinned",
            fg(app, Color::Yellow).add_modifier(Modifier::BOLD),
        )
    });
    match &app.last_step {
        None => lines.push((0, Line::from("no step yet"))),
        Some(s) => {
            let room = cols.saturating_sub(pinned.as_ref().map_or(0, |p| p.width()));
            let split = batch_split(s.micro_batch, s.accum_steps, s.effective_batch);
            lines.push((
                0,
                Line::from(
                    [Span::raw(first_fitting(&split, room))]
                        .into_iter()
                        .chain(pinned)
                        .collect::<Vec<_>>(),
                ),
            ));
        }
    }
    if let Some(line) = size_line(app, cols) {
        lines.push((1, line));
    }
    match &policy.last_decision {
        Some((step, d)) => {
            let head = decision_headline(*step, d);
            let style = match decision_level(d) {
                headroom_core::Level::Info => Style::default(),
                level => level_style(app, level).add_modifier(Modifier::BOLD),
            };
            lines.push((1, Line::styled(ellipsize(&head, cols), style)));
            let why = decision_reason(*step, d, policy.thresholds.as_ref());
            lines.push((
                3,
                Line::styled(
                    ellipsize(&format!("  {why}"), cols),
                    fg(app, Color::DarkGray),
                ),
            ));
        }
        None if app.last_step.is_some() => lines.push((
            2,
            Line::styled("controller: no decision yet", fg(app, Color::DarkGray)),
        )),
        None => {}
    }
    if let Some(s) = &app.last_step {
        let val = app
            .last_eval
            .as_ref()
            .map(|e| format!("{:.4}", e.val_loss))
            .unwrap_or_else(|| "--".into());
        let loss = match s.grad_norm {
            Some(gn) => vec![
                format!("loss {:.4} · val {val} · grad norm {gn:.2}", s.loss),
                format!("loss {:.4} · val {val} · gn {gn:.2}", s.loss),
                format!("loss {:.4} · val {val}", s.loss),
            ],
            None => vec![format!("loss {:.4} · val {val}", s.loss)],
        };
        lines.push((2, Line::from(first_fitting(&loss, cols))));
    }
    lines.extend(eval_line(app, cols));
    if let Some(s) = &app.last_step {
        // Data without tokens (seq_len 1) has no sequence length to show.
        let seq = (s.seq_len > 1).then(|| format!("seq {}", s.seq_len));
        let lr = s.lr.map(|lr| format!("lr {lr:.2e}"));
        let time = Some(format!("step {:.0} ms", s.step_time_s * 1e3));
        let parts: Vec<String> = [seq, lr, time].into_iter().flatten().collect();
        lines.push((3, Line::from(ellipsize(&parts.join(" · "), cols))));
    }
    if policy.ooms > 0 || policy.ceiling_tokens.is_some() {
        let ceiling = policy
            .ceiling_tokens
            .map(|t| format!(" · ceiling {t} tokens"))
            .unwrap_or_default();
        let style = if policy.ooms > 0 {
            fg(app, Color::Red)
        } else {
            Style::default()
        };
        let ooms = [
            format!("OOMs caught {}{ceiling}", policy.ooms),
            format!("OOMs {}{ceiling}", policy.ooms),
        ];
        lines.push((2, Line::styled(first_fitting(&ooms, cols), style)));
    }
    if let Some(s) = &app.last_step {
        let seen = match s.seq_len {
            0 | 1 => "samples seen",
            _ => "tokens seen",
        };
        lines.push((
            4,
            Line::from(format!("{seen} {}", fmt_count(s.tokens_seen))),
        ));
    }
    let rows = inner.height as usize;
    frame.render_widget(Paragraph::new(keep_most_important(lines, rows)), inner);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_history_shows_each_level_and_every_shrink() {
        let pts: Vec<(f64, f64)> = (0..40)
            .map(|i| {
                (
                    i as f64,
                    if i < 10 {
                        4.0
                    } else if i < 30 {
                        16.0
                    } else {
                        8.0
                    },
                )
            })
            .collect();
        let line = sparkline(&pts, 8);
        assert_eq!(line.chars().count(), 8);
        assert_eq!(line, "▂▂████▄▄");
        // A one-step dip inside a column still shows.
        let mut dip = vec![
            (0.0, 16.0),
            (1.0, 16.0),
            (2.0, 1.0),
            (3.0, 16.0),
            (4.0, 16.0),
        ];
        dip.push((5.0, 16.0));
        assert!(
            sparkline(&dip, 2).starts_with('▁'),
            "{}",
            sparkline(&dip, 2)
        );
        assert_eq!(sparkline(&[], 3), "   ");
        assert_eq!(sparkline(&[(1.0, 5.0)], 3), "███");
    }
}
