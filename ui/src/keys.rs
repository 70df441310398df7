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
        _ => None,
    }
}

/// The key line and the help overlay are built from this one table.
pub const BINDINGS: &[(&str, &str)] = &[
    (
        "q",
        "stop: finish the step, checkpoint, summary (q again: quit now)",
    ),
    ("p", "pause / resume at the next step boundary"),
    ("c", "write a checkpoint now"),
    ("?", "this help"),
    ("Esc", "close help"),
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
    fn key_releases_are_ignored() {
        let mut k = key(KeyCode::Char('q'));
        k.kind = KeyEventKind::Release;
        assert_eq!(action_for(k), None);
    }
}
