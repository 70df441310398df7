//! The memory-history chart once the trainer reports step peaks: measured and predicted
//! peak usage of the limit over time, target, warning and critical ruled across, and the
//! controller's events marked on the time axis in the colour of their severity.
//!
//! Drawn by hand around two canvases because ratatui's Chart has neither horizontal rules
//! nor per-point glyphs, and the marks must stay readable without colour (NO_COLOR).
use headroom_core::units::fmt_duration;
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::widgets::canvas::{Canvas, Line as CanvasLine, Points};
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::fg;
use super::text::{first_fitting, width};
use crate::app::App;
use crate::policy::{Mark, MarkKind};
use headroom_core::Level;

/// `tc 90%`: the letters of the thresholds on a row, then its value.
const GUTTER: u16 = 6;
const RULE: char = '╌';
const PEAK_COLOR: Color = Color::Magenta;
const PREDICTED_COLOR: Color = Color::Cyan;

/// Maps values to cells exactly as the canvas does (it rounds to the nearest dot), so a
/// rule sits on the row a point at the same value is drawn in.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub x: [f64; 2],
    pub y: [f64; 2],
    pub plot: Rect,
}

impl Scale {
    /// Row of a value (braille: 4 dots a row).
    pub fn row(&self, v: f64) -> u16 {
        let dots = f64::from(self.plot.height) * 4.0 - 1.0;
        let [lo, hi] = self.y;
        let dot = ((hi - v.clamp(lo, hi)) * dots / (hi - lo)).round() as u16;
        self.plot.y + dot / 4
    }

    /// Column of a time (braille: 2 dots a column).
    pub fn col(&self, t: f64) -> u16 {
        let dots = f64::from(self.plot.width) * 2.0 - 1.0;
        let [x0, x1] = self.x;
        let dot = ((t.clamp(x0, x1) - x0) * dots / (x1 - x0)).round() as u16;
        self.plot.x + dot / 2
    }
}

fn floor_step(x: f64) -> f64 {
    // The epsilon keeps 0.85 − 0.05 (0.7999…) on the 80% step, not the one below.
    ((x * 20.0 + 1e-9).floor() / 20.0).max(0.0)
}

/// How far below the lowest rule the chart reaches while the run is up near the rules.
const ZOOM_BELOW_RULES: f64 = 0.30;

/// Below a third of the lowest rule, the run is far from every threshold: the chart is
/// scaled to what is used, and the rules are named above it instead of ruled.
const FAR_BELOW_RULES: f64 = 1.0 / 3.0;

/// The usage range shown, on whole 5% steps: every point and rule with a little room.
/// While the latest peak is within 30% of the lowest rule, the range starts there
/// instead, and older, lower points sit on the floor (labelled `≤`): at 80×24 the plot is
/// four rows tall, and target and critical (5% apart) need a row each to be told apart.
/// While every point is far below the rules (2% of the limit against a 90% target), the
/// range is 0 to a little over the highest point, on whole 1% steps: on the whole range
/// such a run is a flat line on the floor.
pub fn y_range(points: &[(f64, f64)], rules: &[f64], latest: Option<f64>) -> [f64; 2] {
    let top = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let lowest_rule = rules.iter().copied().fold(1.0, f64::min);
    if top.is_finite() && top < lowest_rule * FAR_BELOW_RULES {
        let hi = ((top.max(0.0) * 1.25 * 100.0 - 1e-9).ceil() / 100.0).max(0.01);
        return [0.0, hi];
    }
    let values = points.iter().map(|p| p.1).chain(rules.iter().copied());
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return [0.0, 1.0];
    }
    let mut lo = floor_step(lo - 0.05);
    let lowest_rule = rules.iter().copied().fold(f64::INFINITY, f64::min);
    if let (Some(latest), true) = (latest, lowest_rule.is_finite()) {
        let zoom = floor_step(lowest_rule - ZOOM_BELOW_RULES);
        if latest >= zoom {
            lo = lo.max(zoom);
        }
    }
    let hi = ((hi + 0.02) * 20.0 - 1e-9).ceil() / 20.0;
    [lo, hi.max(lo + 0.05)]
}

/// One mark per column: the most important of those that land there (the more severe
/// of two of a kind).
pub fn axis_marks(marks: &[Mark], scale: &Scale) -> Vec<(u16, Mark)> {
    let mut out: Vec<(u16, Mark)> = Vec::new();
    for m in marks {
        let col = scale.col(m.t);
        let outranks = |held: &Mark| {
            (m.kind.rank(), severity(m.level)) > (held.kind.rank(), severity(held.level))
        };
        match out.iter_mut().find(|(c, _)| *c == col) {
            Some((_, held)) if outranks(held) => *held = *m,
            Some(_) => {}
            None => out.push((col, *m)),
        }
    }
    out
}

fn severity(level: Level) -> u8 {
    match level {
        Level::Info => 0,
        Level::Warn => 1,
        Level::Error => 2,
    }
}

/// A mark's colour is its severity's: an OOM or a shrink forced by critical usage in
/// the error colour, a forecast or over-target shrink in the warning colour, a grow in
/// the routine one.
pub fn mark_color(mark: &Mark) -> Color {
    match (mark.kind, mark.level) {
        (_, Level::Error) => Color::Red,
        (MarkKind::ThresholdsChanged, _) => Color::Blue,
        (_, Level::Warn) => Color::Yellow,
        (_, Level::Info) => Color::Green,
    }
}

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect, block: Block) {
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let policy = &app.policy;
    let from = app.window.seconds().map(|s| app.elapsed - s);
    let shown = |t: f64| from.is_none_or(|f| t >= f);
    let peak: Vec<(f64, f64)> = policy
        .peak_usage
        .points()
        .into_iter()
        .filter(|p| shown(p.0))
        .collect();
    let predicted: Vec<(f64, f64)> = policy
        .predicted_usage
        .points()
        .into_iter()
        .filter(|p| shown(p.0))
        .collect();
    let marks: Vec<Mark> = policy
        .marks
        .iter()
        .filter(|m| shown(m.t))
        .copied()
        .collect();
    if peak.is_empty() && predicted.is_empty() {
        frame.render_widget(Paragraph::new("no step in this window (w: longer)"), inner);
        return;
    }
    if inner.width < GUTTER + 12 || inner.height < 4 {
        return;
    }
    let plot = Rect::new(
        inner.x + GUTTER + 1,
        inner.y,
        inner.width - GUTTER - 1,
        inner.height - 2,
    );
    let times = peak
        .iter()
        .chain(&predicted)
        .map(|p| p.0)
        .chain(marks.iter().map(|m| m.t));
    let (x0, x1) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), t| {
        (a.min(t), b.max(t))
    });
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let rules: Vec<(&str, f64, Color)> = policy
        .thresholds
        .map(|t| {
            vec![
                ("t", t.target, Color::Green),
                ("w", t.warning, Color::Yellow),
                ("c", t.critical, Color::Red),
            ]
        })
        .unwrap_or_default();
    let all: Vec<(f64, f64)> = peak.iter().chain(&predicted).copied().collect();
    let rule_values: Vec<f64> = rules.iter().map(|r| r.1).collect();
    let latest = peak.last().map(|p| p.1);
    let scale = Scale {
        x: [x0, x1],
        y: y_range(&all, &rule_values, latest),
        plot,
    };
    let floored = all.iter().any(|p| p.1 < scale.y[0]);

    let buf = frame.buffer_mut();
    draw_gutter_and_rules(buf, app, &scale, &rules, floored, inner);
    draw_time_axis(buf, app, &scale, &marks, inner);

    // Predictions first: where the measured line runs through the same cell it wins, so
    // the dots show exactly where the model was off.
    let [lo, hi] = scale.y;
    let clamp = |p: &(f64, f64)| (p.0, p.1.clamp(lo, hi));
    let predicted: Vec<(f64, f64)> = predicted.iter().map(clamp).collect();
    let peak: Vec<(f64, f64)> = peak.iter().map(clamp).collect();
    let color = |c: Color| if app.color { c } else { Color::Reset };
    frame.render_widget(
        Canvas::default()
            .marker(Marker::Dot)
            .x_bounds(scale.x)
            .y_bounds(scale.y)
            .paint(|ctx| {
                ctx.draw(&Points {
                    coords: &predicted,
                    color: color(PREDICTED_COLOR),
                })
            }),
        plot,
    );
    frame.render_widget(
        Canvas::default()
            .marker(Marker::Braille)
            .x_bounds(scale.x)
            .y_bounds(scale.y)
            .paint(|ctx| {
                if let [only] = peak.as_slice() {
                    ctx.draw(&Points {
                        coords: &[*only],
                        color: color(PEAK_COLOR),
                    });
                }
                for w in peak.windows(2) {
                    ctx.draw(&CanvasLine::new(
                        w[0].0,
                        w[0].1,
                        w[1].0,
                        w[1].1,
                        color(PEAK_COLOR),
                    ));
                }
            }),
        plot,
    );
    name_rules_above(frame.buffer_mut(), app, &scale, &rules);
}

fn put(buf: &mut Buffer, x: u16, y: u16, text: &str, style: Style) {
    buf.set_string(x, y, text, style);
}

/// Top and bottom values, and each rule with its letters and value, in the gutter.
fn draw_gutter_and_rules(
    buf: &mut Buffer,
    app: &App,
    scale: &Scale,
    rules: &[(&str, f64, Color)],
    floored: bool,
    inner: Rect,
) {
    let plot = scale.plot;
    let axis_x = plot.x - 1;
    // `≤`: lower points are drawn on the floor.
    let bottom = format!(
        "{}{:.0}%",
        if floored { "≤" } else { "" },
        scale.y[0] * 100.0
    );
    let mut labels: Vec<(u16, String, Style)> = vec![
        (
            plot.y,
            format!("{:>5.0}%", scale.y[1] * 100.0),
            fg(app, Color::DarkGray),
        ),
        (
            plot.bottom() - 1,
            format!("{bottom:>6}"),
            fg(app, Color::DarkGray),
        ),
    ];
    let mut ruled: Vec<(u16, String, f64, Color)> = Vec::new();
    for (letter, value, color) in rules.iter().filter(|r| r.1 <= scale.y[1]) {
        let row = scale.row(*value);
        match ruled.iter_mut().find(|r| r.0 == row) {
            // Two thresholds on one row: both letters, the lower value, and the colour of
            // the more severe (rules come in rising order), so critical never looks like
            // warning.
            Some(r) => {
                r.1.push_str(letter);
                r.3 = *color;
            }
            None => ruled.push((row, letter.to_string(), *value, *color)),
        }
    }
    for (row, letters, value, color) in &ruled {
        let rule: String = std::iter::repeat_n(RULE, plot.width as usize).collect();
        put(buf, plot.x, *row, &rule, fg(app, *color));
        labels.retain(|l| l.0 != *row);
        // Three thresholds can share a row at 80×24: the value gives up a column first.
        let digits = 5usize.saturating_sub(letters.chars().count()).max(1);
        let text: String = format!("{letters}{:>digits$.0}%", value * 100.0)
            .chars()
            .take(GUTTER as usize)
            .collect();
        labels.push((*row, text, fg(app, *color)));
    }
    for y in plot.y..plot.bottom() {
        let tick = labels.iter().any(|l| l.0 == y);
        put(
            buf,
            axis_x,
            y,
            if tick { "┤" } else { "│" },
            Style::default(),
        );
    }
    for (row, text, style) in labels {
        put(buf, inner.x, row, &text, style);
    }
}

/// Rules above the range (a run far below them) are named on the top row instead of
/// ruled; drawn over the line, which may reach that row.
fn name_rules_above(buf: &mut Buffer, app: &App, scale: &Scale, rules: &[(&str, f64, Color)]) {
    let plot = scale.plot;
    let above: Vec<&(&str, f64, Color)> = rules.iter().filter(|r| r.1 > scale.y[1]).collect();
    if !above.is_empty() {
        let all: Vec<String> = above
            .iter()
            .map(|(l, v, _)| format!("{l} {:.0}%", v * 100.0))
            .collect();
        let first = all[0].clone();
        let text = first_fitting(
            &[
                format!("↑ thresholds above: {}", all.join(" ")),
                format!("↑ {}", all.join(" ")),
                format!("↑ {first}"),
            ],
            plot.width as usize,
        );
        let x = plot.right().saturating_sub(width(&text) as u16);
        put(buf, x, plot.y, &text, fg(app, above[0].2));
    }
}

/// The legend's candidates, longest first. Evaluation's OOMs are named only while one is
/// in view: most runs never have one, and their legend keeps its room.
fn legend(marks: &[Mark]) -> Vec<String> {
    if marks.iter().any(|m| m.kind == MarkKind::EvalOom) {
        return vec![
            "⣀ peak • predicted ! OOM E eval OOM ↑↓ batch c cache T thresholds".into(),
            "⣀ peak • predicted ! OOM E eval OOM ↑↓ batch".into(),
            "⣀ peak • predicted ! OOM E eval OOM".into(),
            "⣀ peak • predicted E eval OOM".into(),
            "⣀ peak E eval OOM".into(),
            String::new(),
        ];
    }
    vec![
        "⣀ peak • predicted ! OOM ↑↓ batch c cache T thresholds".into(),
        "⣀ peak • predicted ! OOM ↑↓ batch".into(),
        "⣀ peak • predicted".into(),
        "⣀ peak •pred".into(),
        String::new(),
    ]
}

/// The axis line with the event marks on it, then the time labels and a legend.
fn draw_time_axis(buf: &mut Buffer, app: &App, scale: &Scale, marks: &[Mark], inner: Rect) {
    let plot = scale.plot;
    let axis_y = plot.bottom();
    let line: String = std::iter::once('└')
        .chain(std::iter::repeat_n('─', plot.width as usize))
        .collect();
    put(buf, plot.x - 1, axis_y, &line, Style::default());
    for (col, mark) in axis_marks(marks, scale) {
        put(
            buf,
            col,
            axis_y,
            &mark.kind.glyph().to_string(),
            fg(app, mark_color(&mark)),
        );
    }
    let label_y = axis_y + 1;
    let (left, right) = (fmt_duration(scale.x[0]), fmt_duration(scale.x[1]));
    put(buf, plot.x - 1, label_y, &left, Style::default());
    let right_x = inner.right().saturating_sub(width(&right) as u16);
    put(buf, right_x, label_y, &right, Style::default());
    // Between the two labels, a space on each side.
    let room = (right_x as usize).saturating_sub(plot.x as usize - 1 + width(&left) + 2);
    let legend = first_fitting(&legend(marks), room);
    let mut at = plot.x - 1 + width(&left) as u16 + 1 + (room - width(&legend)) as u16 / 2;
    for word in legend.split(' ') {
        let style = match word {
            "⣀" | "peak" => fg(app, PEAK_COLOR),
            "•" | "predicted" | "•pred" => fg(app, PREDICTED_COLOR),
            "!" => fg(app, Color::Red),
            "E" => fg(app, Color::Yellow),
            "↑↓" => fg(app, Color::Green),
            "c" => fg(app, Color::Yellow),
            "T" => fg(app, Color::Blue),
            _ => fg(app, Color::DarkGray),
        };
        put(buf, at, label_y, word, style);
        at += width(word) as u16 + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale() -> Scale {
        Scale {
            x: [0.0, 10.0],
            y: [0.8, 1.0],
            plot: Rect::new(7, 1, 20, 4),
        }
    }

    #[test]
    fn values_map_to_rows_as_the_canvas_draws_them() {
        let s = scale();
        assert_eq!(s.row(1.0), 1, "top value on the top row");
        assert_eq!(s.row(0.8), 4, "bottom value on the bottom row");
        assert_eq!(s.row(0.99), 1);
        assert_eq!(s.row(0.93), 2);
        assert_eq!(s.row(0.85), 3);
        assert_eq!(s.row(5.0), 1, "clamped");
        assert_eq!(s.col(0.0), 7);
        assert_eq!(s.col(10.0), 26);
    }

    #[test]
    fn range_covers_points_and_rules_on_five_percent_steps() {
        let r = y_range(&[(0.0, 0.85), (1.0, 0.88)], &[0.9, 0.95], Some(0.88));
        assert_eq!(r, [0.8, 1.0]);
        let r = y_range(&[(0.0, 0.12), (1.0, 0.35)], &[0.9, 0.95], Some(0.12));
        assert_eq!(r, [0.05, 1.0]);
        assert_eq!(y_range(&[], &[], None), [0.0, 1.0]);
        let over = y_range(&[(0.0, 1.07)], &[], Some(1.07));
        assert!(over[1] >= 1.07 && over[0] < 1.07, "{over:?}");
    }

    /// 2–4% of the limit against a 90% target: the range is what is used, not 0–100%
    /// with the run a flat line on the floor.
    #[test]
    fn a_run_far_below_its_rules_is_scaled_to_what_it_uses() {
        let pts = [(0.0, 0.02), (1.0, 0.04), (2.0, 0.03)];
        assert_eq!(y_range(&pts, &[0.9, 0.92, 0.95], Some(0.03)), [0.0, 0.05]);
        assert_eq!(
            y_range(&[(0.0, 0.12)], &[0.9, 0.95], Some(0.12)),
            [0.0, 0.15]
        );
        assert_eq!(y_range(&[(0.0, 0.001)], &[0.9], None), [0.0, 0.01]);
        let s = Scale {
            x: [0.0, 2.0],
            y: [0.0, 0.05],
            plot: Rect::new(0, 0, 10, 4),
        };
        assert_ne!(s.row(0.02), s.row(0.04), "2% and 4% on rows of their own");
    }

    #[test]
    fn a_run_near_its_rules_is_zoomed_so_target_and_critical_part() {
        // Grew from 30% to 85%: the early steps go to the floor.
        let pts = [(0.0, 0.30), (1.0, 0.85)];
        let r = y_range(&pts, &[0.9, 0.95], Some(0.85));
        assert_eq!(r, [0.6, 1.0]);
        let s = Scale {
            x: [0.0, 1.0],
            y: r,
            plot: Rect::new(0, 0, 10, 4),
        };
        assert_ne!(s.row(0.9), s.row(0.95), "four rows tell them apart");
        // Back down at 40%: the whole range again.
        assert_eq!(y_range(&pts, &[0.9, 0.95], Some(0.4)), [0.25, 1.0]);
    }

    #[test]
    fn an_oom_outranks_the_resize_in_its_column() {
        let s = scale();
        let marks = [
            Mark {
                t: 5.0,
                kind: MarkKind::CacheFreed,
                level: Level::Warn,
            },
            Mark {
                t: 5.0,
                kind: MarkKind::Oom,
                level: Level::Error,
            },
            Mark {
                t: 5.1,
                kind: MarkKind::Shrank,
                level: Level::Error,
            },
            Mark {
                t: 9.9,
                kind: MarkKind::Grew,
                level: Level::Info,
            },
        ];
        let got: Vec<(u16, MarkKind)> = axis_marks(&marks, &s)
            .into_iter()
            .map(|(c, m)| (c, m.kind))
            .collect();
        assert_eq!(
            got,
            vec![(s.col(5.0), MarkKind::Oom), (s.col(9.9), MarkKind::Grew)]
        );
    }

    #[test]
    fn the_legend_names_evaluations_ooms_only_while_one_is_shown() {
        let mark = |kind| Mark {
            t: 1.0,
            kind,
            level: Level::Warn,
        };
        assert!(!legend(&[mark(MarkKind::Oom)])[0].contains("eval"));
        let with_eval = legend(&[mark(MarkKind::Oom), mark(MarkKind::EvalOom)]);
        assert!(with_eval
            .iter()
            .all(|l| l.is_empty() || l.contains("E eval OOM")));
    }

    #[test]
    fn marks_take_their_severitys_colour() {
        let mark = |kind, level| Mark {
            t: 0.0,
            kind,
            level,
        };
        assert_eq!(mark_color(&mark(MarkKind::Oom, Level::Error)), Color::Red);
        assert_eq!(
            mark_color(&mark(MarkKind::Shrank, Level::Error)),
            Color::Red
        );
        assert_eq!(
            mark_color(&mark(MarkKind::Shrank, Level::Warn)),
            Color::Yellow
        );
        assert_eq!(mark_color(&mark(MarkKind::Grew, Level::Info)), Color::Green);
    }
}
