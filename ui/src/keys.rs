//! Keys to actions: pure, so the mapping is tested without a terminal.
//!
//! The threshold editor is modal: while it is open the arrows, `hjkl`, `+`/`-` and Enter
//! edit the draft instead of scrolling the log or resizing the batch, so the caller says
//! which [`KeyContext`] a key arrives in.
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use crate::feed::ReplayControl;
use crate::mode::Mode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop gracefully; a second one while stopping quits without waiting.
    Quit,
    /// Ctrl-Z: in raw mode the terminal sends it as a key, not as SIGTSTP, so the
    /// dashboard hands the terminal back and stops itself, as the shell would have.
    Suspend,
    /// Open or close the full-screen event list, where long entries are read in full.
    ToggleEvents,
    TogglePause,
    Checkpoint,
    ToggleHelp,
    /// Close whatever overlay is open (the help first, then the editor).
    Back,
    FocusNext,
    FocusPrev,
    /// Scroll the focused panel (the event log) by lines; negative is towards newer.
    Scroll(i32),
    /// Jump to the newest entry.
    ScrollTop,
    /// Cycle the memory-history window (1m, 5m, 15m, whole run).
    CycleWindow,
    /// Open the threshold editor.
    EditThresholds,
    /// Next profile: of the editor's draft when it is open, else sent to the trainer.
    CycleProfile,
    /// Pin the micro-batch at its current size, or unpin it when pinned.
    TogglePin,
    /// Pin the micro-batch at twice its current size.
    DoubleBatch,
    /// Pin the micro-batch at half its current size (at least 1).
    HalveBatch,
    /// Return cached allocator memory to the device.
    FreeCache,
    /// Built-in trainer: compute in bf16 / back in fp32, from the next step.
    TogglePrecision,
    /// Built-in trainer: activation checkpointing of every block on / off.
    ToggleCheckpointing,
    /// Editor: move the selection by this many thresholds (negative: left).
    SelectThreshold(i32),
    /// Editor: change the selected threshold by this many hundredths.
    AdjustThreshold(i32),
    /// Editor: validate the draft and send it.
    ApplyThresholds,
    /// Attached: stop the run, once confirmed (`q` only detaches there).
    StopRun,
    /// The answer to "stop the run? y/n".
    Confirm(bool),
    /// Replay: steer the replay (its keys take the batch keys' places).
    Replay(ReplayControl),
    /// A job: select the rank this many ranks on (negative: back), wrapping.
    ShiftRank(i32),
    /// A job: select this rank.
    PickRank(u32),
}

/// Where a key arrives: the same key means different things in the editor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyContext {
    Dashboard,
    ThresholdEditor,
    /// A viewer attached over a socket: the dashboard's keys, and `S` to stop the run.
    Attached,
    /// "stop the run? y/n" is asked: only `y` stops it.
    ConfirmStop,
    /// A replayed log: read-only, with the replay's own controls.
    Replay,
}

pub fn action_for(key: KeyEvent, context: KeyContext) -> Option<Action> {
    if key.kind == KeyEventKind::Release {
        return None;
    }
    // Ctrl-C stops the run from anywhere, editor included: it must never be swallowed.
    if key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL) {
        return Some(Action::Quit);
    }
    // Job control works from anywhere too, as in every other program in a terminal.
    if key.code == KeyCode::Char('z') && key.modifiers.contains(KeyModifiers::CONTROL) {
        return Some(Action::Suspend);
    }
    match context {
        KeyContext::Dashboard => dashboard_action(key.code),
        KeyContext::ThresholdEditor => editor_action(key.code),
        // Shift-s: stopping someone's run from a viewer is deliberate, and asks first.
        KeyContext::Attached => match key.code {
            KeyCode::Char('S') => Some(Action::StopRun),
            code => dashboard_action(code),
        },
        KeyContext::ConfirmStop => match key.code {
            KeyCode::Char('y') | KeyCode::Char('Y') => Some(Action::Confirm(true)),
            KeyCode::Char('n') | KeyCode::Char('N') | KeyCode::Esc => Some(Action::Confirm(false)),
            KeyCode::Char('q') | KeyCode::Char('Q') => Some(Action::Quit),
            _ => None,
        },
        KeyContext::Replay => replay_action(key.code),
    }
}

/// A replay takes no commands, so the pause and batch keys steer the replay instead; the
/// other command keys still map, so that pressing one says why it does nothing.
fn replay_action(code: KeyCode) -> Option<Action> {
    match code {
        KeyCode::Char('p') | KeyCode::Char(' ') => Some(Action::Replay(ReplayControl::TogglePause)),
        KeyCode::Char('n') | KeyCode::Char('.') => Some(Action::Replay(ReplayControl::StepOne)),
        KeyCode::Char('G') | KeyCode::End => Some(Action::Replay(ReplayControl::JumpToEnd)),
        KeyCode::Char('+') | KeyCode::Char('=') => Some(Action::Replay(ReplayControl::Faster)),
        KeyCode::Char('-') => Some(Action::Replay(ReplayControl::Slower)),
        code => dashboard_action(code),
    }
}

fn dashboard_action(code: KeyCode) -> Option<Action> {
    match code {
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
        KeyCode::Char('t') => Some(Action::EditThresholds),
        // Shift-p: a deliberate chord, since it changes the run's policy at once.
        KeyCode::Char('P') => Some(Action::CycleProfile),
        KeyCode::Char('b') => Some(Action::TogglePin),
        // `=` is `+` without Shift on most layouts, as in zoom keys.
        KeyCode::Char('+') | KeyCode::Char('=') => Some(Action::DoubleBatch),
        KeyCode::Char('-') => Some(Action::HalveBatch),
        KeyCode::Char('f') => Some(Action::FreeCache),
        KeyCode::Char('m') => Some(Action::TogglePrecision),
        KeyCode::Char('a') => Some(Action::ToggleCheckpointing),
        KeyCode::Char('e') => Some(Action::ToggleEvents),
        KeyCode::Char('[') => Some(Action::ShiftRank(-1)),
        KeyCode::Char(']') => Some(Action::ShiftRank(1)),
        KeyCode::Char(c @ '0'..='9') => Some(Action::PickRank(c as u32 - '0' as u32)),
        _ => None,
    }
}

fn editor_action(code: KeyCode) -> Option<Action> {
    match code {
        KeyCode::Esc => Some(Action::Back),
        KeyCode::Enter => Some(Action::ApplyThresholds),
        KeyCode::Left | KeyCode::Char('h') | KeyCode::BackTab => Some(Action::SelectThreshold(-1)),
        KeyCode::Right | KeyCode::Char('l') | KeyCode::Tab => Some(Action::SelectThreshold(1)),
        KeyCode::Up | KeyCode::Char('k') | KeyCode::Char('+') | KeyCode::Char('=') => {
            Some(Action::AdjustThreshold(1))
        }
        KeyCode::Down | KeyCode::Char('j') | KeyCode::Char('-') => {
            Some(Action::AdjustThreshold(-1))
        }
        KeyCode::Char('P') => Some(Action::CycleProfile),
        KeyCode::Char('?') | KeyCode::F(1) => Some(Action::ToggleHelp),
        // Everything else, `q` included, is inert while editing: a stray key must not
        // stop the run or resize the batch behind the editor.
        _ => None,
    }
}

/// The key line (short label) and the help overlay (full text) are built from this one
/// table, so they cannot disagree: (key, short label, description).
pub const BINDINGS: &[(&str, &str, &str)] = &[
    (
        "q",
        "stop",
        "stop: finish the step, checkpoint, summary (q again: quit now)",
    ),
    (
        "p",
        "pause",
        "pause / resume at the next step boundary (Space too)",
    ),
    ("c", "checkpoint", "write a checkpoint now"),
    (
        "t",
        "thresholds",
        "edit thresholds: target, warning, critical, emergency",
    ),
    (
        "P",
        "profile",
        "next threshold profile: aggressive, balanced, conservative",
    ),
    (
        "b",
        "pin",
        "pin the micro-batch at its current size / unpin it",
    ),
    (
        "+/-",
        "batch",
        "pin the micro-batch at twice / half its size",
    ),
    (
        "f",
        "free cache",
        "return cached memory now (CUDA cache; CPU: heap's free pages)",
    ),
    (
        "m",
        "bf16",
        "bf16 (or the run's fp16) / fp32 compute from the next step",
    ),
    (
        "a",
        "recompute",
        "activation checkpointing on / off, from the next step",
    ),
    (
        "e",
        "events",
        "every event in full, scrollable (e or Esc closes)",
    ),
    (
        "[ ]",
        "rank",
        "a job's previous / next rank: its row and its panels (0-9 too)",
    ),
    ("Tab", "focus", "focus the next panel (Shift-Tab: previous)"),
    (
        "↑↓",
        "scroll",
        "scroll the event log (j/k; PgUp/PgDn by ten; Home/g: newest)",
    ),
    (
        "w",
        "window",
        "memory-history window: 1m, 5m, 15m, whole run",
    ),
    ("?", "help", "this help"),
    (
        "Esc",
        "close",
        "close the help, the event list or the editor",
    ),
    (
        "^Z",
        "suspend",
        "suspend to the shell (fg brings the screen back)",
    ),
];

/// An attached viewer's keys: `q` detaches and `S` stops the run (after a y/n).
const ATTACHED_KEYS: &[(&str, &str, &str)] = &[
    ("q", "detach", "detach: this screen closes, the run goes on"),
    (
        "S",
        "stop run",
        "stop the run (asks y/n first): finish the step, checkpoint",
    ),
];

/// A replay's own keys, in place of the run's controls (commands are disabled).
const REPLAY_KEYS: &[(&str, &str, &str)] = &[
    ("q", "close", "close the replay"),
    ("Space", "pause", "pause / resume the replay (p too)"),
    ("n", "step", "play up to the next step, then pause (. too)"),
    ("G", "end", "jump to the end of the log (End too)"),
    (
        "+/-",
        "speed",
        "replay twice / half as fast (1/16x to 1024x)",
    ),
];

/// Keys that send commands: not offered in a replay.
const COMMAND_KEYS: [&str; 9] = ["q", "p", "c", "t", "P", "b", "+/-", "m", "a"];

/// The key table of a mode, in the order the footer and the help list it.
pub fn bindings(mode: &Mode) -> Vec<(&'static str, &'static str, &'static str)> {
    let rest = |skip: &[&str]| {
        BINDINGS
            .iter()
            .filter(|(k, _, _)| !skip.contains(k))
            .copied()
            .collect::<Vec<_>>()
    };
    match mode {
        Mode::InProcess => BINDINGS.to_vec(),
        Mode::Attached { .. } => {
            let mut all = ATTACHED_KEYS.to_vec();
            all.extend(rest(&["q"]));
            all
        }
        Mode::Replay { .. } => {
            let mut all = REPLAY_KEYS.to_vec();
            all.extend(rest(&[&COMMAND_KEYS[..], &["f"]].concat()));
            all
        }
    }
}

/// The key context of a mode's dashboard (outside the editor and the y/n question).
pub fn dashboard_context(mode: &Mode) -> KeyContext {
    match mode {
        Mode::InProcess => KeyContext::Dashboard,
        Mode::Attached { .. } => KeyContext::Attached,
        Mode::Replay { .. } => KeyContext::Replay,
    }
}

/// The threshold editor's keys, in the same shape: its footer and its own help line.
pub const EDITOR_BINDINGS: &[(&str, &str, &str)] = &[
    (
        "←→",
        "select",
        "select target / warning / critical / emergency (h/l, Tab)",
    ),
    (
        "↑↓",
        "±0.01",
        "raise / lower the selected threshold by 0.01 (k/j, +/-)",
    ),
    (
        "P",
        "profile",
        "load the next profile's thresholds into the draft",
    ),
    (
        "Enter",
        "apply",
        "check the draft and send it to the trainer",
    ),
    (
        "Esc",
        "cancel",
        "close the editor; the thresholds in force stay",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn key(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    fn dash(code: KeyCode) -> Option<Action> {
        action_for(key(code), KeyContext::Dashboard)
    }

    fn edit(code: KeyCode) -> Option<Action> {
        action_for(key(code), KeyContext::ThresholdEditor)
    }

    #[test]
    fn maps_conventional_keys() {
        assert_eq!(dash(KeyCode::Char('q')), Some(Action::Quit));
        assert_eq!(dash(KeyCode::Char('p')), Some(Action::TogglePause));
        assert_eq!(dash(KeyCode::Char(' ')), Some(Action::TogglePause));
        assert_eq!(dash(KeyCode::Char('c')), Some(Action::Checkpoint));
        assert_eq!(dash(KeyCode::Char('?')), Some(Action::ToggleHelp));
        assert_eq!(dash(KeyCode::Esc), Some(Action::Back));
        assert_eq!(dash(KeyCode::Char('x')), None);
    }

    #[test]
    fn memory_keys_map_to_their_actions() {
        assert_eq!(dash(KeyCode::Char('t')), Some(Action::EditThresholds));
        assert_eq!(dash(KeyCode::Char('b')), Some(Action::TogglePin));
        assert_eq!(dash(KeyCode::Char('+')), Some(Action::DoubleBatch));
        assert_eq!(dash(KeyCode::Char('=')), Some(Action::DoubleBatch));
        assert_eq!(dash(KeyCode::Char('-')), Some(Action::HalveBatch));
        assert_eq!(dash(KeyCode::Char('f')), Some(Action::FreeCache));
        assert_eq!(dash(KeyCode::Char('m')), Some(Action::TogglePrecision));
        assert_eq!(dash(KeyCode::Char('a')), Some(Action::ToggleCheckpointing));
        // Terminals report Shift-p as an upper-case P, with or without the modifier.
        assert_eq!(dash(KeyCode::Char('P')), Some(Action::CycleProfile));
        let shift_p = KeyEvent::new(KeyCode::Char('P'), KeyModifiers::SHIFT);
        assert_eq!(
            action_for(shift_p, KeyContext::Dashboard),
            Some(Action::CycleProfile)
        );
        // Lower-case p still pauses: the profile needs the deliberate chord.
        assert_ne!(dash(KeyCode::Char('p')), Some(Action::CycleProfile));
    }

    #[test]
    fn ctrl_c_quits_everywhere_but_plain_c_checkpoints() {
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(
            action_for(ctrl_c, KeyContext::Dashboard),
            Some(Action::Quit)
        );
        assert_eq!(
            action_for(ctrl_c, KeyContext::ThresholdEditor),
            Some(Action::Quit)
        );
        assert_eq!(dash(KeyCode::Char('c')), Some(Action::Checkpoint));
    }

    #[test]
    fn navigation_keys_accept_arrows_and_hjkl() {
        assert_eq!(dash(KeyCode::Down), Some(Action::Scroll(1)));
        assert_eq!(dash(KeyCode::Char('j')), Some(Action::Scroll(1)));
        assert_eq!(dash(KeyCode::Char('k')), Some(Action::Scroll(-1)));
        assert_eq!(dash(KeyCode::PageUp), Some(Action::Scroll(-10)));
        assert_eq!(dash(KeyCode::Tab), Some(Action::FocusNext));
        assert_eq!(dash(KeyCode::BackTab), Some(Action::FocusPrev));
        assert_eq!(dash(KeyCode::Char('w')), Some(Action::CycleWindow));
    }

    #[test]
    fn the_editor_takes_arrows_hjkl_plus_minus_and_enter() {
        for (code, want) in [
            (KeyCode::Left, Action::SelectThreshold(-1)),
            (KeyCode::Char('h'), Action::SelectThreshold(-1)),
            (KeyCode::Right, Action::SelectThreshold(1)),
            (KeyCode::Char('l'), Action::SelectThreshold(1)),
            (KeyCode::Tab, Action::SelectThreshold(1)),
            (KeyCode::Up, Action::AdjustThreshold(1)),
            (KeyCode::Char('k'), Action::AdjustThreshold(1)),
            (KeyCode::Char('+'), Action::AdjustThreshold(1)),
            (KeyCode::Down, Action::AdjustThreshold(-1)),
            (KeyCode::Char('j'), Action::AdjustThreshold(-1)),
            (KeyCode::Char('-'), Action::AdjustThreshold(-1)),
            (KeyCode::Enter, Action::ApplyThresholds),
            (KeyCode::Esc, Action::Back),
            (KeyCode::Char('P'), Action::CycleProfile),
        ] {
            assert_eq!(edit(code), Some(want), "{code:?}");
        }
    }

    #[test]
    fn the_editor_swallows_run_controls() {
        for c in ['q', 'p', 'c', 'b', 'f', 't', 'w', ' '] {
            assert_eq!(
                edit(KeyCode::Char(c)),
                None,
                "{c:?} must be inert while editing"
            );
        }
    }

    fn modes() -> [Mode; 3] {
        [
            Mode::InProcess,
            Mode::Attached {
                address: "a".into(),
            },
            Mode::Replay { source: "r".into() },
        ]
    }

    #[test]
    fn no_two_bindings_share_a_key() {
        let tables: Vec<Vec<_>> = modes().iter().map(bindings).collect();
        for table in tables
            .iter()
            .map(Vec::as_slice)
            .chain([BINDINGS, EDITOR_BINDINGS])
        {
            let mut keys: Vec<&str> = table.iter().map(|b| b.0).collect();
            keys.sort();
            let before = keys.len();
            keys.dedup();
            assert_eq!(keys.len(), before, "duplicate key in {table:?}");
        }
    }

    /// Every key the table names reaches an action, so the help never lists a dead key.
    #[test]
    fn every_listed_key_does_something() {
        let codes = |k: &str| -> Vec<KeyCode> {
            match k {
                "Tab" => vec![KeyCode::Tab],
                "Esc" => vec![KeyCode::Esc],
                "Enter" => vec![KeyCode::Enter],
                "↑↓" => vec![KeyCode::Up, KeyCode::Down],
                "←→" => vec![KeyCode::Left, KeyCode::Right],
                "+/-" => vec![KeyCode::Char('+'), KeyCode::Char('-')],
                "Space" => vec![KeyCode::Char(' ')],
                "[ ]" => vec![KeyCode::Char('['), KeyCode::Char(']')],
                k => k.chars().map(KeyCode::Char).collect(),
            }
        };
        let chord = |k: &str| match k {
            "^Z" => Some(KeyEvent::new(KeyCode::Char('z'), KeyModifiers::CONTROL)),
            _ => None,
        };
        let mut tables: Vec<(Vec<_>, KeyContext)> = modes()
            .iter()
            .map(|m| (bindings(m), dashboard_context(m)))
            .collect();
        tables.push((EDITOR_BINDINGS.to_vec(), KeyContext::ThresholdEditor));
        for (table, context) in tables {
            for (k, _, _) in &table {
                if let Some(chord) = chord(k) {
                    assert!(action_for(chord, context).is_some(), "{k} unmapped");
                    continue;
                }
                for code in codes(k) {
                    assert!(
                        action_for(key(code), context).is_some(),
                        "{k} ({code:?}) is listed but unmapped in {context:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn ctrl_z_suspends_everywhere_and_e_opens_the_event_list() {
        let ctrl_z = KeyEvent::new(KeyCode::Char('z'), KeyModifiers::CONTROL);
        for context in [KeyContext::Dashboard, KeyContext::ThresholdEditor] {
            assert_eq!(action_for(ctrl_z, context), Some(Action::Suspend));
        }
        assert_eq!(dash(KeyCode::Char('z')), None);
        assert_eq!(dash(KeyCode::Char('e')), Some(Action::ToggleEvents));
    }

    #[test]
    fn brackets_and_digits_select_a_rank_in_every_view_but_the_editor() {
        for context in [
            KeyContext::Dashboard,
            KeyContext::Attached,
            KeyContext::Replay,
        ] {
            let k = |code| action_for(key(code), context);
            assert_eq!(k(KeyCode::Char('[')), Some(Action::ShiftRank(-1)));
            assert_eq!(k(KeyCode::Char(']')), Some(Action::ShiftRank(1)));
            assert_eq!(k(KeyCode::Char('0')), Some(Action::PickRank(0)));
            assert_eq!(k(KeyCode::Char('7')), Some(Action::PickRank(7)));
        }
        assert_eq!(edit(KeyCode::Char(']')), None);
        assert_eq!(edit(KeyCode::Char('1')), None);
    }

    #[test]
    fn attached_views_stop_with_shift_s_and_ask_first() {
        let k = |code| action_for(key(code), KeyContext::Attached);
        assert_eq!(k(KeyCode::Char('S')), Some(Action::StopRun));
        assert_eq!(k(KeyCode::Char('q')), Some(Action::Quit));
        assert_eq!(dash(KeyCode::Char('S')), None, "in-process, q stops");
        let c = |code| action_for(key(code), KeyContext::ConfirmStop);
        assert_eq!(c(KeyCode::Char('y')), Some(Action::Confirm(true)));
        assert_eq!(c(KeyCode::Char('n')), Some(Action::Confirm(false)));
        assert_eq!(c(KeyCode::Esc), Some(Action::Confirm(false)));
        assert_eq!(c(KeyCode::Char('p')), None);
    }

    #[test]
    fn a_replay_steers_itself_with_the_pause_and_batch_keys() {
        let r = |code| action_for(key(code), KeyContext::Replay);
        assert_eq!(
            r(KeyCode::Char(' ')),
            Some(Action::Replay(ReplayControl::TogglePause))
        );
        assert_eq!(
            r(KeyCode::Char('.')),
            Some(Action::Replay(ReplayControl::StepOne))
        );
        assert_eq!(
            r(KeyCode::End),
            Some(Action::Replay(ReplayControl::JumpToEnd))
        );
        assert_eq!(
            r(KeyCode::Char('+')),
            Some(Action::Replay(ReplayControl::Faster))
        );
        assert_eq!(
            r(KeyCode::Char('-')),
            Some(Action::Replay(ReplayControl::Slower))
        );
        // Still mapped, so that pressing it says commands are disabled.
        assert_eq!(r(KeyCode::Char('c')), Some(Action::Checkpoint));
    }

    #[test]
    fn key_releases_are_ignored() {
        let mut k = key(KeyCode::Char('q'));
        k.kind = KeyEventKind::Release;
        assert_eq!(action_for(k, KeyContext::Dashboard), None);
    }
}
