//! The memory gauge's bar with its label written across it, readable wherever the bar
//! ends. ratatui's Gauge draws the label in the terminal's default foreground over the
//! filled part, which vanishes on a yellow or green bar; here every label cell gets a
//! foreground chosen against the background actually under it.
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};

use super::text::width;

/// The text colour that reads on a bar of `color`: dark on the light colours, light on
/// the dark ones.
pub fn label_on(color: Color) -> Color {
    match color {
        Color::Red | Color::Blue | Color::Magenta | Color::DarkGray | Color::Black => Color::White,
        _ => Color::Black,
    }
}

/// Draws a one-row bar filled to `ratio` with `label` centred on it. `color` is `None`
/// without colour (NO_COLOR): the filled part is drawn in reverse video instead, which
/// every terminal renders with contrast.
pub fn render(buf: &mut Buffer, area: Rect, ratio: f64, label: &str, color: Option<Color>) {
    if area.width == 0 || area.height == 0 {
        return;
    }
    let cells = area.width as usize;
    let filled = ((ratio.clamp(0.0, 1.0) * cells as f64).round() as usize).min(cells);
    let label: String = super::text::ellipsize(label, cells);
    let start = (cells - width(&label)) / 2;
    let filled_style = match color {
        Some(c) => Style::default().bg(c).fg(label_on(c)),
        None => Style::default().add_modifier(Modifier::REVERSED),
    };
    // Where the bar has not reached: the terminal's own colours, which contrast with each
    // other on every theme, light or dark.
    let empty_style = Style::default();
    let y = area.y;
    for i in 0..cells {
        let style = if i < filled {
            filled_style
        } else {
            empty_style
        };
        buf[(area.x + i as u16, y)].set_symbol(" ").set_style(style);
    }
    let mut col = start;
    for ch in label.chars() {
        let s = ch.to_string();
        let w = width(&s);
        if w == 0 {
            continue;
        }
        let style = if col < filled {
            filled_style
        } else {
            empty_style
        };
        buf[(area.x + col as u16, y)]
            .set_symbol(&s)
            .set_style(style.add_modifier(Modifier::BOLD));
        col += w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(ratio: f64, color: Option<Color>) -> Buffer {
        let area = Rect::new(0, 0, 20, 1);
        let mut buf = Buffer::empty(area);
        render(&mut buf, area, ratio, "peak 5 / 10", color);
        buf
    }

    #[test]
    fn every_label_cell_contrasts_with_what_is_under_it() {
        for color in [Color::Green, Color::Yellow, Color::Red] {
            for ratio in [0.0, 0.3, 0.5, 0.7, 1.0] {
                let buf = bar(ratio, Some(color));
                let filled = (ratio * 20.0).round() as u16;
                for x in 0..20u16 {
                    let cell = &buf[(x, 0)];
                    if cell.symbol() == " " {
                        continue;
                    }
                    if x < filled {
                        assert_eq!(cell.bg, color, "{color:?} {ratio} at {x}");
                        assert_eq!(cell.fg, label_on(color), "{color:?} {ratio} at {x}");
                        assert_ne!(cell.fg, cell.bg);
                    } else {
                        assert_eq!((cell.fg, cell.bg), (Color::Reset, Color::Reset));
                    }
                }
            }
        }
    }

    #[test]
    fn the_label_is_centred_and_whole() {
        let buf = bar(0.5, None);
        let text: String = (0..20).map(|x| buf[(x, 0)].symbol().to_string()).collect();
        assert_eq!(text, "    peak 5 / 10     ");
        assert!(buf[(0, 0)].modifier.contains(Modifier::REVERSED));
        assert!(!buf[(19, 0)].modifier.contains(Modifier::REVERSED));
    }
}
