//! Faults inside the trainer, injected through the path a real one takes: a panic in a
//! step (`HEADROOM_INJECT_PANIC`, raised inside the step's attempt exactly where a bug in
//! tch or in our step code would unwind from).
mod common;

use std::time::Duration;

use common::pty::Pty;
use common::{bin, fixture, of_kind, read_log, stderr};

#[test]
fn a_trainer_panic_headless_fails_with_the_reason_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = std::fs::read_to_string(fixture("tiny.toml"))
        .unwrap()
        .replace("checkpoint_every = 0", "checkpoint_every = 2");
    std::fs::write(dir.path().join("every2.toml"), cfg).unwrap();
    let out = bin()
        .current_dir(dir.path())
        .env("HEADROOM_INJECT_PANIC", "5")
        .args(["train", "--headless", "--config", "every2.toml"])
        .args(["--checkpoint-dir", "ck", "--log", "run.jsonl"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the trainer panicked: injected panic in step 5"),
        "{err}"
    );
    let log = read_log(&dir.path().join("run.jsonl"));
    let failed = of_kind(&log, "failed");
    assert_eq!(failed.len(), 1, "{log:?}");
    assert!(failed[0]["reason"]
        .as_str()
        .unwrap()
        .contains("injected panic in step 5"));
    assert_eq!(common::logged_steps(&log), vec![1, 2, 3, 4]);
    // No checkpoint of the failed step: the last one is step 4's, whole, and it resumes.
    let latest = std::fs::read_to_string(dir.path().join("ck/latest")).unwrap();
    assert!(latest.trim().ends_with("step-000004"), "{latest}");
    let out = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "ck", "--steps", "6"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("steps 5..6"), "{}", stderr(&out));
}

#[test]
fn a_trainer_panic_on_the_dashboard_is_shown_then_the_terminal_is_restored() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = bin();
    cmd.current_dir(dir.path())
        .env("HEADROOM_INJECT_PANIC", "3")
        .args(["train", "--config"])
        .arg(fixture("tiny.toml"))
        .args(["--steps", "1000", "--checkpoint-dir", "ck"]);
    let mut pty = Pty::spawn(cmd, 100, 30);
    assert!(
        pty.wait_for("\x1b[?1049h", Duration::from_secs(60)),
        "no alternate screen: {}",
        pty.output()
    );
    // The reason is on the screen while the screen is still up: the user can read it.
    assert!(
        pty.wait_for("injected panic in step 3", Duration::from_secs(60)),
        "the failure is not on screen: {}",
        pty.output()
    );
    let shown = pty.output();
    assert!(
        !shown.contains("\x1b[?1049l"),
        "the screen closed by itself"
    );
    assert_eq!(
        pty.line_discipline(),
        (false, false),
        "still raw while shown"
    );
    pty.send(b"q");
    let status = pty
        .wait_exit(Duration::from_secs(30))
        .expect("headroom did not exit after q");
    assert_eq!(status.code(), Some(1), "a failed run exits non-zero");
    let out = pty.output();
    let after = &out[out.rfind("\x1b[?1049l").expect("left the alternate screen")..];
    assert_eq!(pty.line_discipline(), (true, true), "terminal restored");
    assert!(after.contains("\x1b[?25h"), "cursor shown again");
    assert!(
        after.contains("injected panic in step 3"),
        "the reason is printed after the screen: {after}"
    );
}

#[test]
fn a_bad_panic_step_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .current_dir(dir.path())
        .env("HEADROOM_INJECT_PANIC", "soon")
        .args(["train", "--headless", "--config"])
        .arg(fixture("tiny.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("HEADROOM_INJECT_PANIC=\"soon\" is not a step number"),
        "{}",
        stderr(&out)
    );
}
