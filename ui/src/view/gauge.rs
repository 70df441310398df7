//! The threshold marks under the memory gauge: one letter per threshold (t, w, c, e) in
//! the cell of the gauge its fraction falls in, so the bar reads against them.
use headroom_core::policy::{Profile, Thresholds};
use ratatui::style::{Color, Modifier};
use ratatui::text::{Line, Span};

use super::text::width;
use crate::app::App;

pub const LETTERS: [char; 4] = ['t', 'w', 'c', 'e'];
const COLORS: [Color; 4] = [Color::Green, Color::Yellow, Color::Red, Color::Magenta];

/// The column of each mark under a bar `cells` wide. Thresholds sit close together (0.90
/// and 0.92 share a cell below 50 columns), so a mark that lands on its neighbour's cell
/// moves right, and the row is pushed back left from the end: all four stay visible,
/// in order.
pub fn mark_columns(t: &Thresholds, cells: usize) -> [usize; 4] {
    let last = cells.saturating_sub(1);
    let mut cols = t
        .as_array()
        .map(|x| ((x.clamp(0.0, 1.0) * cells as f64) as usize).min(last));
    for i in 1..4 {
        cols[i] = cols[i].max(cols[i - 1] + 1);
    }
    for i in (0..4).rev() {
        cols[i] = cols[i].min(last.saturating_sub(3 - i));
    }
    cols
}

/// `90` for 0.90, `87.5` for 0.875: as short as the value allows.
pub fn percent(x: f64) -> String {
    let p = x * 100.0;
    if (p - p.round()).abs() < 1e-6 {
        format!("{p:.0}")
    } else {
        format!("{p:.1}")
    }
}

/// The marks row: the values in words on the left where they fit, the letters under
/// the gauge where they belong.
pub fn marks_line(
    app: &App,
    t: &Thresholds,
    profile: Option<Profile>,
    cells: usize,
) -> Line<'static> {
    if cells < 4 {
        return Line::default();
    }
    let cols = mark_columns(t, cells);
    let values = t
        .as_array()
        .iter()
        .zip(LETTERS)
        .map(|(x, l)| format!("{l} {}", percent(*x)))
        .collect::<Vec<_>>()
        .join(" ");
    let name = profile.map_or("custom", Profile::name);
    let text = [format!("{values} ({name})"), values]
        .into_iter()
        .find(|s| width(s) < cols[0])
        .unwrap_or_default();
    let mut spans = vec![Span::styled(text.clone(), super::fg(app, Color::DarkGray))];
    let mut at = width(&text);
    for ((col, letter), color) in cols.iter().zip(LETTERS).zip(COLORS) {
        spans.push(Span::raw(" ".repeat(col - at)));
        spans.push(Span::styled(
            letter.to_string(),
            super::fg(app, color).add_modifier(Modifier::BOLD),
        ));
        at = col + 1;
    }
    Line::from(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_fall_in_their_cells_when_there_is_room() {
        let t = Thresholds::new(0.5, 0.6, 0.7, 0.8).unwrap();
        assert_eq!(mark_columns(&t, 10), [5, 6, 7, 8]);
        assert_eq!(mark_columns(&t, 100), [50, 60, 70, 80]);
    }

    #[test]
    fn crowded_marks_stay_distinct_ordered_and_inside() {
        let t = Thresholds::default(); // 0.90 0.92 0.95 0.97
        for cells in 4..200 {
            let c = mark_columns(&t, cells);
            assert!(c.windows(2).all(|w| w[0] < w[1]), "{cells}: {c:?}");
            assert!(c[3] < cells, "{cells}: {c:?}");
        }
        assert_eq!(mark_columns(&t, 40), [36, 37, 38, 39]);
        let full = Thresholds::new(0.97, 0.98, 0.99, 1.0).unwrap();
        assert_eq!(mark_columns(&full, 10), [6, 7, 8, 9]);
    }

    #[test]
    fn percentages_are_short() {
        assert_eq!(percent(0.9), "90");
        assert_eq!(percent(0.875), "87.5");
    }

    #[test]
    fn the_row_names_the_values_when_they_fit() {
        let app = App::new("t", false);
        let t = Thresholds::default();
        let line = marks_line(&app, &t, Some(Profile::Balanced), 42);
        let text: String = line.spans.iter().map(|s| s.content.as_ref()).collect();
        assert_eq!(text.chars().count(), 41);
        assert!(
            text.starts_with("t 90 w 92 c 95 e 97 (balanced)"),
            "{text:?}"
        );
        assert!(text.ends_with("twce"), "{text:?}");
        let narrow = marks_line(&app, &t, Some(Profile::Balanced), 12);
        let text: String = narrow.spans.iter().map(|s| s.content.as_ref()).collect();
        assert_eq!(text.trim(), "twce");
    }
}
