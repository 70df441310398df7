//! Fitting text into narrow panels: at 80 columns every panel is 34 to 42 cells wide, and
//! a line cut mid-word reads as a bug. Pure, so the choices are tested without drawing.
use ratatui::text::Line;

/// Display width in cells.
pub fn width(text: &str) -> usize {
    Line::raw(text).width()
}

/// `text` if it fits in `max` cells, else cut with an ellipsis.
pub fn ellipsize(text: &str, max: usize) -> String {
    if width(text) <= max {
        return text.to_string();
    }
    if max == 0 {
        return String::new();
    }
    let mut out = String::new();
    for c in text.chars() {
        if width(&out) + width(&c.to_string()) + 1 > max {
            break;
        }
        out.push(c);
    }
    out.push('…');
    out
}

/// The first of `candidates` (longest and clearest first) that fits; the last one cut
/// when none does.
pub fn first_fitting(candidates: &[String], max: usize) -> String {
    candidates
        .iter()
        .find(|c| width(c) <= max)
        .cloned()
        .unwrap_or_else(|| ellipsize(candidates.last().map_or("", String::as_str), max))
}

/// Keeps the `rows` most important items (lowest rank first; ties by position) in their
/// original order: short panels drop their least useful lines, never their first ones.
pub fn keep_most_important<T>(items: Vec<(u8, T)>, rows: usize) -> Vec<T> {
    let mut order: Vec<(u8, usize)> = items
        .iter()
        .enumerate()
        .map(|(i, (r, _))| (*r, i))
        .collect();
    order.sort();
    let mut keep: Vec<usize> = order.into_iter().take(rows).map(|(_, i)| i).collect();
    keep.sort_unstable();
    let mut out = Vec::with_capacity(keep.len());
    for (i, (_, item)) in items.into_iter().enumerate() {
        if keep.binary_search(&i).is_ok() {
            out.push(item);
        }
    }
    out
}

/// `text` in lines of at most `max` cells, broken between words; a word longer than a
/// line is broken inside it. Nothing is dropped: every character is on some line.
pub fn wrap(text: &str, max: usize) -> Vec<String> {
    let max = max.max(1);
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let sep = usize::from(!line.is_empty());
        if !line.is_empty() && width(&line) + sep + width(word) > max {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        for c in word.chars() {
            if width(&line) + width(&c.to_string()) > max {
                lines.push(std::mem::take(&mut line));
            }
            line.push(c);
        }
    }
    lines.push(line);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_keeps_every_word_and_fits_the_width() {
        let text = "step 58: usage stayed at 96% although the micro-batch shrank from 32 to 16";
        let lines = wrap(text, 20);
        assert!(lines.iter().all(|l| width(l) <= 20), "{lines:?}");
        assert_eq!(lines.join(" "), text);
        assert_eq!(lines[0], "step 58: usage");
        assert_eq!(wrap("abcdefgh", 3), vec!["abc", "def", "gh"]);
        assert_eq!(wrap("", 5), vec![""]);
    }

    #[test]
    fn ellipsis_only_when_needed() {
        assert_eq!(ellipsize("micro 16 × 2", 12), "micro 16 × 2");
        assert_eq!(ellipsize("micro 16 × 2", 8), "micro 1…");
        assert_eq!(width(&ellipsize("a → b → c → d", 5)), 5);
        assert_eq!(ellipsize("abc", 0), "");
    }

    #[test]
    fn picks_the_first_candidate_that_fits() {
        let c = vec!["a long way to say it".to_string(), "short".to_string()];
        assert_eq!(first_fitting(&c, 30), c[0]);
        assert_eq!(first_fitting(&c, 6), "short");
        assert_eq!(first_fitting(&c, 3), "sh…");
    }

    #[test]
    fn keeps_the_important_lines_in_order() {
        let items = vec![(0, "a"), (3, "b"), (1, "c"), (2, "d"), (1, "e")];
        assert_eq!(keep_most_important(items.clone(), 3), vec!["a", "c", "e"]);
        assert_eq!(keep_most_important(items.clone(), 9).len(), 5);
        assert!(keep_most_important(items, 0).is_empty());
    }
}
