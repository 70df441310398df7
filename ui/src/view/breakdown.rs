//! The memory panel's stacked bar: a step's peak as fixed, batch, cache and outside
//! against the limit ([`crate::breakdown`] computes the parts). Each part has its own
//! glyph, so the bar reads without colour; on a short panel the legend goes before the
//! bar, and on a narrow one it sheds names, then parts.
use headroom_core::units::fmt_bytes;
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};

use super::fg;
use super::text::first_fitting;
use crate::app::App;
use crate::breakdown::Parts;

const GLYPHS: [(char, Color); 4] = [
    ('█', Color::Blue),
    ('▓', Color::Green),
    ('▒', Color::Yellow),
    ('░', Color::Magenta),
];
const FREE: char = '·';

/// The bar across `cols` columns.
pub(super) fn bar_line(app: &App, parts: &Parts, cols: usize) -> Line<'static> {
    Line::from(bar(app, parts, cols))
}

/// The legend: each part's glyph, name and size, in the widest form that fits.
pub(super) fn legend(parts: &Parts, cols: usize) -> Line<'static> {
    let named = parts.named();
    let each = |f: &dyn Fn(char, &str, String) -> String, n: usize| -> String {
        named
            .iter()
            .zip(GLYPHS)
            .take(n)
            .map(|((name, b), (g, _))| f(g, name, fmt_bytes(*b)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let full = |g: char, name: &str, b: String| format!("{g} {name} {b}");
    let compact = |g: char, name: &str, b: String| format!("{g}{name} {}", b.replace(' ', ""));
    let short = |g: char, _: &str, b: String| format!("{g}{}", b.replace(' ', ""));
    let candidates = [
        each(&full, 4),
        each(&compact, 4),
        each(&short, 4),
        each(&short, 3),
        each(&short, 2),
    ];
    Line::from(first_fitting(&candidates, cols))
}

/// `w` cells: each part's share of the limit, in order, then what is free.
fn bar(app: &App, parts: &Parts, w: usize) -> Vec<Span<'static>> {
    let limit = parts.limit as f64;
    let mut spans = Vec::new();
    let (mut cum, mut drawn) = (0u64, 0usize);
    for ((_, bytes), (glyph, color)) in parts.named().into_iter().zip(GLYPHS) {
        cum += bytes;
        let end = ((cum as f64 / limit) * w as f64).round().min(w as f64) as usize;
        if end > drawn {
            spans.push(Span::styled(
                glyph.to_string().repeat(end - drawn),
                fg(app, color),
            ));
            drawn = end;
        }
    }
    if drawn < w {
        spans.push(Span::styled(
            FREE.to_string().repeat(w - drawn),
            if app.color {
                Style::default().fg(Color::DarkGray)
            } else {
                Style::default()
            },
        ));
    }
    spans
}
