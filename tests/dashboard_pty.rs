//! The dashboard on a real pseudo-terminal: it takes raw mode and the alternate screen,
//! `q` stops the run gracefully, and the terminal comes back as it was.
mod common;

use std::time::Duration;

use common::pty::Pty;
use common::{bin, fixture};

#[test]
fn q_stops_with_a_checkpoint_and_restores_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = bin();
    cmd.current_dir(dir.path())
        .args(["train", "--config"])
        .arg(fixture("tiny.toml"))
        .args([
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ]);
    let mut pty = Pty::spawn(cmd, 100, 30);
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

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(2000);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}
