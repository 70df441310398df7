//! The dashboard on a real pseudo-terminal: it takes raw mode and the alternate screen,
//! `q` stops the run gracefully, and the terminal comes back as it was; keys steer the
//! real trainer, and the run log shows exactly what they changed.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::pty::{tail, Pty};
use common::screen::Screen;
use common::{long_tiny_run, of_kind};
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use headroom_core::policy::Thresholds;
use headroom_ui::editor::NAMES;
use headroom_ui::keys::{action_for, Action, KeyContext};

#[test]
fn q_stops_with_a_checkpoint_and_restores_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let mut pty = long_tiny_run(dir.path());
    assert_eq!(pty.line_discipline(), (true, true), "a fresh pty is cooked");

    // Enter the alternate screen, then show training progress.
    assert!(
        pty.wait_for("\x1b[?1049h", Duration::from_secs(60)),
        "no alternate screen; output: {}",
        pty.output()
    );
    assert!(
        pty.wait_for("step", Duration::from_secs(60)),
        "no step on screen; output: {}",
        pty.output()
    );
    assert_eq!(
        pty.line_discipline(),
        (false, false),
        "raw mode while running"
    );
    // A step completed: `q` gives the step in progress up, and a run with none completed
    // has nothing to checkpoint.
    let log = dir.path().join("run.jsonl");
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("\"kind\":\"step\"")
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no step logged"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    pty.send(b"q");
    let status = pty
        .wait_exit(Duration::from_secs(60))
        .expect("headroom did not exit after q");
    let out = pty.output();
    assert!(
        status.success(),
        "exit {status:?}; output tail: {}",
        tail(&out)
    );
    assert!(out.contains("\x1b[?1049l"), "left the alternate screen");
    assert_eq!(
        pty.line_discipline(),
        (true, true),
        "terminal restored to cooked mode"
    );
    assert!(
        out.contains("stopped at step"),
        "summary after the screen: {}",
        tail(&out)
    );
    assert!(
        dir.path().join("ck/latest").exists(),
        "checkpoint written on q"
    );

    let log = common::read_log(&dir.path().join("run.jsonl"));
    let finished = common::of_kind(&log, "finished");
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0]["stopped_by_user"], true);
}

/// The end-to-end check: on a real pty, the threshold editor's keys change one
/// threshold by the editor's step and `p` pauses and resumes the trainer, and the JSONL log
/// shows the trainer applied exactly those changes and nothing else; `q` then stops with a
/// checkpoint of the last step and gives the terminal back as it was.
#[test]
fn keys_change_a_threshold_and_pause_resume_and_the_log_shows_exactly_that() {
    const WAIT: Duration = Duration::from_secs(60);
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("run.jsonl");
    // One thread: the trainer's pool does not take the cores the dashboard redraws on.
    let mut cmd = common::long_tiny_command(dir.path());
    cmd.args(["--threads", "1"]);
    let mut pty = Pty::spawn(cmd, COLS, ROWS);
    assert!(
        pty.wait_for("\x1b[?1049h", WAIT),
        "no alternate screen; output: {}",
        tail(&pty.output())
    );

    // Training is under way: a few steps are in the log.
    let log = wait_log(&log_path, WAIT, |log| common::logged_steps(log).len() >= 3)
        .unwrap_or_else(|| panic!("no steps logged; output: {}", tail(&pty.output())));
    let initial = of_kind(&log, "thresholds_changed");
    assert_eq!(initial.len(), 1, "one thresholds_changed at the start");
    assert_eq!(initial[0]["source"], "config");
    let initial: Thresholds = serde_json::from_value(initial[0]["thresholds"].clone()).unwrap();

    // The edit, as keys: open the editor, select right, right, left (so `warning`), then
    // one step down, then apply. The expected values come from the key map and the
    // editor's unit (hundredths), not from the editor's own arithmetic.
    let edit_keys: [(&[u8], KeyCode); 4] = [
        (b"\x1b[C", KeyCode::Right),
        (b"\x1b[C", KeyCode::Right),
        (b"\x1b[D", KeyCode::Left),
        (b"\x1b[B", KeyCode::Down),
    ];
    let (mut selected, mut hundredths) = (0i32, 0i32);
    for (_, code) in &edit_keys {
        let key = KeyEvent::new(*code, KeyModifiers::NONE);
        match action_for(key, KeyContext::ThresholdEditor) {
            Some(Action::SelectThreshold(by)) => selected += by,
            Some(Action::AdjustThreshold(by)) => hundredths += by,
            other => panic!("{code:?} does {other:?} in the editor"),
        }
    }
    let selected = selected.rem_euclid(NAMES.len() as i32) as usize;
    assert_eq!(NAMES[selected], "warning", "the keys select warning");
    assert_eq!(hundredths, -1, "one step down");
    let mut want = initial.as_array();
    want[selected] = ((want[selected] * 100.0).round() + hundredths as f64) / 100.0;
    assert!(
        (want[selected] - (initial.as_array()[selected] - 0.01)).abs() < 1e-9,
        "the editor's step is 0.01 (README): {} -> {}",
        initial.as_array()[selected],
        want[selected]
    );
    let want = Thresholds {
        target: want[0],
        warning: want[1],
        critical: want[2],
        emergency: want[3],
    };
    want.validate().expect("the edit is a valid set");

    pty.send(b"t");
    wait_screen(&pty, WAIT, |s| s.contains(EDITOR_TITLE));
    for (bytes, _) in &edit_keys {
        pty.send(bytes);
    }
    pty.send(b"\r");
    let log = wait_log(&log_path, WAIT, |log| {
        of_kind(log, "thresholds_changed").len() >= 2
            && !commands_applied(log, "set_thresholds").is_empty()
    })
    .unwrap_or_else(|| {
        panic!(
            "no threshold change logged; output: {}",
            tail(&pty.output())
        )
    });
    let changed = of_kind(&log, "thresholds_changed");
    assert_eq!(changed.len(), 2, "exactly one change: {changed:?}");
    assert_eq!(changed[1]["source"], "command");
    let applied: Thresholds = serde_json::from_value(changed[1]["thresholds"].clone()).unwrap();
    assert_eq!(applied, want, "the trainer applied the edited values");
    assert!(
        changed[1]["profile"].is_null(),
        "an edited set is no profile: {}",
        changed[1]
    );
    let set = commands_applied(&log, "set_thresholds");
    assert_eq!(set.len(), 1);
    let sent: Thresholds = serde_json::from_value(set[0]["command"]["thresholds"].clone()).unwrap();
    assert_eq!(sent, want, "the editor sent the edited values");
    let text = set[0]["applied"].as_str().unwrap();
    assert!(!text.starts_with("refused"), "{text}");
    // `p` is inert in the editor and pauses or resumes by the status the trainer
    // confirmed: it is pressed once the screen shows the editor closed and the run running.
    wait_screen(&pty, WAIT, |s| {
        !s.contains(EDITOR_TITLE) && s.contains("● running")
    });

    // Pause: confirmed in the log, and no step while paused.
    pty.send(b"p");
    let log = wait_log(&log_path, WAIT, |log| {
        statuses(log).contains(&"paused".into())
    })
    .unwrap_or_else(|| panic!("no pause logged; output: {}", tail(&pty.output())));
    let paused_at = common::logged_steps(&log).len();
    std::thread::sleep(Duration::from_millis(1500));
    let log = read_log_so_far(&log_path);
    assert_eq!(
        common::logged_steps(&log).len(),
        paused_at,
        "steps were logged while paused"
    );
    assert_eq!(statuses(&log).last().map(String::as_str), Some("paused"));

    // Resume: confirmed, and training goes on (pressed once the screen shows the pause).
    wait_screen(&pty, WAIT, |s| s.contains("● paused"));
    pty.send(b"p");
    wait_log(&log_path, WAIT, |log| {
        statuses(log).iter().filter(|s| *s == "running").count() >= 2
            && common::logged_steps(log).len() >= paused_at + 3
    })
    .unwrap_or_else(|| panic!("no resume logged; output: {}", tail(&pty.output())));

    pty.send(b"q");
    let status = pty.wait_exit(WAIT).expect("headroom did not exit after q");
    let out = pty.output();
    assert!(status.success(), "exit {status:?}; output: {}", tail(&out));

    // The terminal is given back: alternate screen left and cursor shown after they were
    // taken, cooked mode and echo on, and the summary printed on the normal screen.
    let left = out
        .rfind("\x1b[?1049l")
        .expect("never left the alternate screen");
    assert!(left > out.rfind("\x1b[?1049h").unwrap(), "{}", tail(&out));
    let shown = out.rfind("\x1b[?25h").expect("cursor never shown");
    assert!(
        shown > out.rfind("\x1b[?25l").expect("cursor never hidden"),
        "{}",
        tail(&out)
    );
    assert_eq!(pty.line_discipline(), (true, true), "cooked mode and echo");

    let log = common::read_log(&log_path);
    let steps = common::logged_steps(&log);
    let last = *steps.last().unwrap();
    assert_eq!(steps, (1..=last).collect::<Vec<_>>(), "every step once");
    let summary = format!("run stopped at step {last}/");
    let at = out
        .find(&summary)
        .unwrap_or_else(|| panic!("no summary: {}", tail(&out)));
    assert!(at > left, "summary after the screen closed: {}", tail(&out));

    // Exactly the changes made by keys, in order, and nothing else.
    let commands: Vec<&str> = of_kind(&log, "command_applied")
        .iter()
        .map(|r| r["command"]["command"].as_str().unwrap())
        .collect();
    assert_eq!(commands, ["set_thresholds", "pause", "resume", "stop"]);
    let changed = of_kind(&log, "thresholds_changed");
    assert_eq!(changed.len(), 2, "{changed:?}");
    assert_eq!(
        changed.iter().map(|r| &r["source"]).collect::<Vec<_>>(),
        ["config", "command"]
    );
    let states = statuses(&log);
    let run_states: Vec<&str> = states
        .iter()
        .map(String::as_str)
        .filter(|s| matches!(*s, "running" | "paused"))
        .collect();
    assert_eq!(run_states, ["running", "paused", "running"], "{states:?}");
    // In log order (the order sent), nothing stepped between the pause and the resume.
    let kinds: Vec<String> = log
        .iter()
        .map(|r| match r["kind"].as_str().unwrap() {
            "status" => format!("status:{}", r["status"].as_str().unwrap()),
            k => k.to_string(),
        })
        .collect();
    let pause = kinds.iter().position(|k| k == "status:paused").unwrap();
    let resume = pause
        + kinds[pause..]
            .iter()
            .position(|k| k == "status:running")
            .unwrap();
    assert!(
        !kinds[pause..resume].iter().any(|k| k == "step"),
        "a step while paused: {:?}",
        &kinds[pause..=resume]
    );

    // Stopped by the user, with a checkpoint of the last step.
    let finished = of_kind(&log, "finished");
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0]["stopped_by_user"], true);
    assert_eq!(finished[0]["steps_done"].as_u64(), Some(last));
    let saved = of_kind(&log, "checkpoint_saved");
    assert_eq!(saved.last().unwrap()["step"].as_u64(), Some(last));
    let name = std::fs::read_to_string(dir.path().join("ck/latest")).expect("ck/latest");
    assert_eq!(name.trim(), format!("step-{last:06}"));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("ck").join(name.trim()).join("state.json"))
            .expect("state.json"),
    )
    .unwrap();
    assert_eq!(state["step"].as_u64(), Some(last), "state.json: {state}");
}

const COLS: u16 = 100;
const ROWS: u16 = 30;
/// The threshold editor's title, on screen while it is open.
const EDITOR_TITLE: &str = "memory thresholds (fractions of the limit)";

/// The dashboard hears the trainer on a channel of its own, beside the log writer's: this
/// waits until the screen a user sees (the pty's output through a VT emulator) shows what
/// the log already does, so that the next key is read in the state the trainer confirmed.
fn wait_screen(pty: &Pty, timeout: Duration, shows: impl Fn(&Screen) -> bool) {
    let start = Instant::now();
    loop {
        let screen = Screen::of(&pty.output(), COLS as usize, ROWS as usize);
        if shows(&screen) {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "the screen never caught up:\n{}",
            screen.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The log's complete lines so far (the writer may be mid-line).
fn read_log_so_far(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad log line {l}: {e}")))
        .collect()
}

/// Polls the log until `done` holds for it; the log then, or `None` at the timeout.
fn wait_log(
    path: &Path,
    timeout: Duration,
    done: impl Fn(&[serde_json::Value]) -> bool,
) -> Option<Vec<serde_json::Value>> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        let log = read_log_so_far(path);
        if done(&log) {
            return Some(log);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn commands_applied<'a>(log: &'a [serde_json::Value], command: &str) -> Vec<&'a serde_json::Value> {
    of_kind(log, "command_applied")
        .into_iter()
        .filter(|r| r["command"]["command"] == command)
        .collect()
}

fn statuses(log: &[serde_json::Value]) -> Vec<String> {
    of_kind(log, "status")
        .iter()
        .map(|r| r["status"].as_str().unwrap().to_string())
        .collect()
}
