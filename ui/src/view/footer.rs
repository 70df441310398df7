//! Which keys the one-line footer shows: all of them when they fit, else it leaves out
//! keys in a fixed order (navigation before the run's controls). `?` is never left out:
//! it lists everything.

/// Dashboard keys, first left out first.
pub const SHED_ORDER: [&str; 9] = ["Esc", "w", "↑↓", "Tab", "P", "f", "+/-", "b", "t"];
/// Editor keys, first left out first.
pub const EDITOR_SHED_ORDER: [&str; 2] = ["P", "←→"];

/// Cells one key takes, as drawn: ` q ` then ` stop  `.
fn cells(key: &str, short: &str) -> usize {
    key.chars().count() + short.chars().count() + 5
}

/// The (key, short label) pairs that fit in `room` cells, in table order.
pub fn shown<'a>(
    table: &'a [(&'a str, &'a str, &'a str)],
    shed_order: &[&str],
    room: usize,
) -> Vec<(&'a str, &'a str)> {
    let mut used: usize = table.iter().map(|(k, s, _)| cells(k, s)).sum();
    let mut shed: Vec<&str> = Vec::new();
    for key in shed_order {
        if used <= room {
            break;
        }
        if let Some((k, s, _)) = table.iter().find(|(k, _, _)| k == key) {
            used -= cells(k, s);
            shed.push(k);
        }
    }
    table
        .iter()
        .filter(|(k, _, _)| !shed.contains(k))
        .map(|(k, s, _)| (*k, *s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{BINDINGS, EDITOR_BINDINGS};

    fn keys(room: usize) -> Vec<&'static str> {
        shown(BINDINGS, &SHED_ORDER, room)
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    #[test]
    fn everything_fits_on_a_wide_line_but_esc_which_is_help_only() {
        let all = keys(1000);
        assert_eq!(all.len(), BINDINGS.len());
        let wide = keys(155);
        assert!(!wide.contains(&"Esc") && wide.contains(&"w"), "{wide:?}");
    }

    #[test]
    fn at_80_columns_the_run_controls_stay() {
        let k = keys(80);
        for needed in ["q", "p", "c", "t", "b", "?"] {
            assert!(k.contains(&needed), "{needed} missing: {k:?}");
        }
        let total: usize = shown(BINDINGS, &SHED_ORDER, 80)
            .iter()
            .map(|(k, s)| cells(k, s))
            .sum();
        assert!(total <= 80);
        // With the dropped-samples counter beside them, help and the run's own controls.
        let k = keys(56);
        assert_eq!(k, vec!["q", "p", "c", "?"]);
    }

    #[test]
    fn every_shed_key_is_in_its_table() {
        for k in SHED_ORDER {
            assert!(BINDINGS.iter().any(|b| b.0 == k), "{k}");
        }
        for k in EDITOR_SHED_ORDER {
            assert!(EDITOR_BINDINGS.iter().any(|b| b.0 == k), "{k}");
        }
        assert!(!SHED_ORDER.contains(&"?"));
    }
}
