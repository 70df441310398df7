//! The two charts: memory (step peaks against the limit once the trainer reports them,
//! the sampler's bytes until then) and loss.
use headroom_core::units::{fmt_bytes, fmt_duration};
use ratatui::layout::Rect;
use ratatui::style::Color;
use ratatui::symbols::Marker;
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, Paragraph};
use ratatui::Frame;

use super::{fg, panel, usage_chart};
use crate::app::{App, Focus};

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

pub(super) fn render_memory(frame: &mut Frame, app: &App, area: Rect) {
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

pub(super) fn render_loss(frame: &mut Frame, app: &App, area: Rect) {
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
