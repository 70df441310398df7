//! `headroom attach` and `headroom replay` on a real pty: the dashboard drawn from a
//! socket or a log, keys applied to a run in another process, detaching leaves it going.
mod common;

use std::time::{Duration, Instant};

use common::pty::{tail, Pty};
use common::stream::Served;
use common::{of_kind, read_log_so_far};

const WAIT: Duration = Duration::from_secs(60);

/// Waits until `pred` holds for the run's log.
fn wait_log(run: &Served, what: &str, pred: impl Fn(&[serde_json::Value]) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        if pred(&read_log_so_far(&run.log())) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never logged: {}",
            run.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn attach_draws_the_run_applies_a_key_and_detach_leaves_it_going() {
    let run = Served::start(&[]);
    run.socket();
    run.wait_steps(20, WAIT);
    let mut cmd = run.cmd();
    cmd.arg("attach");
    let started = Instant::now();
    let mut pty = Pty::spawn(cmd, 120, 40);
    // The first frame already holds the run's history: the header's step count and the
    // attached address.
    assert!(
        pty.wait_for("attached to", WAIT),
        "no attached screen: {}",
        tail(&pty.output())
    );
    assert!(pty.wait_for("/1000000", WAIT), "{}", tail(&pty.output()));
    println!("attach to a drawn frame: {:?}", started.elapsed());

    // Pause from the attached screen: applied by the run, confirmed in its log.
    pty.send(b"p");
    wait_log(&run, "the pause", |log| {
        of_kind(log, "command_applied")
            .iter()
            .any(|r| r["command"]["command"] == "pause")
    });
    let paused_at = run.steps_logged();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        run.steps_logged() <= paused_at + 1,
        "steps went on while paused"
    );
    pty.send(b"p");
    wait_log(&run, "the resume", |log| {
        of_kind(log, "command_applied")
            .iter()
            .any(|r| r["command"]["command"] == "resume")
    });

    // `S` asks first: `n` sends nothing.
    pty.send(b"S");
    assert!(
        pty.wait_for("stop the run?", WAIT),
        "{}",
        tail(&pty.output())
    );
    pty.send(b"n");

    // q detaches: the viewer ends, the run goes on.
    pty.send(b"q");
    let status = pty.wait_exit(WAIT).expect("attach exits after q");
    assert!(status.success(), "{}", tail(&pty.output()));
    assert!(
        pty.output().contains("detached from tiny"),
        "{}",
        tail(&pty.output())
    );
    assert_eq!(pty.line_discipline(), (true, true), "terminal restored");
    let after = run.steps_logged();
    run.wait_steps(after + 5, WAIT);
    let log = read_log_so_far(&run.log());
    let applied: Vec<&str> = of_kind(&log, "command_applied")
        .iter()
        .map(|r| r["command"]["command"].as_str().unwrap())
        .collect();
    assert_eq!(applied, ["pause", "resume"], "no stop was sent");
}

#[test]
fn attach_without_a_run_or_a_token_says_what_to_do() {
    let run = Served::start(&["--listen", "0"]);
    run.socket();
    // A TCP address without a token: refused before any screen opens.
    let out = run
        .cmd()
        .args(["attach", "127.0.0.1:9"])
        .env_remove("HEADROOM_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--token-file"), "{err}");
    // A name that is not running.
    let out = run.cmd().args(["attach", "nosuchrun"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no running run or job is named nosuchrun"),
        "{err}"
    );
    drop(run);
    // No runs at all.
    let dir = tempfile::tempdir().unwrap();
    let out = common::bin()
        .env("HEADROOM_RUNTIME_DIR", dir.path().join("rt"))
        .arg("attach")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no runs are running"), "{err}");
}

#[test]
fn replay_of_a_finished_log_draws_its_final_state_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let out = common::train_tiny(dir.path(), &["--steps", "12", "--log", "run.jsonl"]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let mut cmd = common::bin();
    cmd.current_dir(dir.path())
        .args(["replay", "--end", "run.jsonl"]);
    let mut pty = Pty::spawn(cmd, 120, 40);
    assert!(pty.wait_for("replay of", WAIT), "{}", tail(&pty.output()));
    assert!(pty.wait_for("12/12", WAIT), "{}", tail(&pty.output()));
    // A command key does nothing but say so.
    pty.send(b"c");
    assert!(pty.wait_for("disabled", WAIT), "{}", tail(&pty.output()));
    pty.send(b"q");
    let status = pty.wait_exit(WAIT).expect("replay exits after q");
    assert!(status.success(), "{}", tail(&pty.output()));
    assert_eq!(pty.line_discipline(), (true, true), "terminal restored");
}
