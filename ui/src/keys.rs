//! Keys to actions: pure, so the mapping is tested without a terminal.
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop gracefully; a second one while stopping quits without waiting.
    Quit,
    TogglePause,
    Checkpoint,
    ToggleHelp,
    /// Close whatever overlay is open.
    Back,
    FocusNext,
    FocusPrev,
    /// Scroll the focused panel (the event log) by lines; negative is towards newer.
    Scroll(i32),
    /// Jump to the newest entry.
    ScrollTop,
    /// Cycle the memory-history window (1m, 5m, 15m, whole run).
    CycleWindow,
}

pub fn action_for(key: KeyEvent) -> Option<Action> {
    if key.kind == KeyEventKind::Release {
        return None;
    }
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    match key.code {
        KeyCode::Char('c') if ctrl => Some(Action::Quit),
        KeyCode::Char('q') | KeyCode::Char('Q') => Some(Action::Quit),
        KeyCode::Char('p') | KeyCode::Char(' ') => Some(Action::TogglePause),
        KeyCode::Char('c') => Some(Action::Checkpoint),
        KeyCode::Char('?') | KeyCode::F(1) => Some(Action::ToggleHelp),
        KeyCode::Esc => Some(Action::Back),
        KeyCode::Tab => Some(Action::FocusNext),
        KeyCode::BackTab => Some(Action::FocusPrev),
        KeyCode::Down | KeyCode::Char('j') => Some(Action::Scroll(1)),
        KeyCode::Up | KeyCode::Char('k') => Some(Action::Scroll(-1)),
        KeyCode::PageDown => Some(Action::Scroll(10)),
        KeyCode::PageUp => Some(Action::Scroll(-10)),
        KeyCode::Home | KeyCode::Char('g') => Some(Action::ScrollTop),
        KeyCode::Char('w') => Some(Action::CycleWindow),
        _ => None,
    }
}

/// The key line (short label) and the help overlay (full text) are built from this one
/// table, so they cannot disagree.
pub const BINDINGS: &[(&str, &str, &str)] = &[
    (
        "q",
        "stop",
        "stop: finish the step, checkpoint, summary (q again: quit now)",
    ),
    ("p", "pause", "pause / resume at the next step boundary"),
    ("c", "checkpoint", "write a checkpoint now"),
    ("Tab", "focus", "focus the next panel (Shift-Tab: previous)"),
    (
        "↑↓",
        "scroll",
        "scroll the event log (j/k too; PgUp/PgDn by ten, Home/g: newest)",
    ),
    (
        "w",
        "window",
        "memory-history window: 1m, 5m, 15m, whole run",
    ),
    ("?", "help", "this help"),
    ("Esc", "close", "close help"),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn key(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    #[test]
    fn maps_conventional_keys() {
        assert_eq!(action_for(key(KeyCode::Char('q'))), Some(Action::Quit));
        assert_eq!(
            action_for(key(KeyCode::Char('p'))),
            Some(Action::TogglePause)
        );
        assert_eq!(
            action_for(key(KeyCode::Char('c'))),
            Some(Action::Checkpoint)
        );
        assert_eq!(
            action_for(key(KeyCode::Char('?'))),
            Some(Action::ToggleHelp)
        );
        assert_eq!(action_for(key(KeyCode::Esc)), Some(Action::Back));
        assert_eq!(action_for(key(KeyCode::Char('x'))), None);
    }

    #[test]
    fn ctrl_c_quits_but_plain_c_checkpoints() {
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(action_for(ctrl_c), Some(Action::Quit));
    }

    #[test]
    fn navigation_keys_accept_arrows_and_hjkl() {
        assert_eq!(action_for(key(KeyCode::Down)), Some(Action::Scroll(1)));
        assert_eq!(action_for(key(KeyCode::Char('j'))), Some(Action::Scroll(1)));
        assert_eq!(
            action_for(key(KeyCode::Char('k'))),
            Some(Action::Scroll(-1))
        );
        assert_eq!(action_for(key(KeyCode::PageUp)), Some(Action::Scroll(-10)));
        assert_eq!(action_for(key(KeyCode::Tab)), Some(Action::FocusNext));
        assert_eq!(action_for(key(KeyCode::BackTab)), Some(Action::FocusPrev));
        assert_eq!(
            action_for(key(KeyCode::Char('w'))),
            Some(Action::CycleWindow)
        );
    }

    #[test]
    fn key_releases_are_ignored() {
        let mut k = key(KeyCode::Char('q'));
        k.kind = KeyEventKind::Release;
        assert_eq!(action_for(k), None);
    }
}
