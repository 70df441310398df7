//! The host panel on a tall terminal: CPU, memory, the process's resident set and the GPU.
use headroom_core::units::fmt_bytes;
use ratatui::layout::Rect;
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use crate::app::App;

pub(super) fn render(frame: &mut Frame, app: &App, area: Rect) {
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
