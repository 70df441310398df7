//! SIGINT and SIGTERM stop a run gracefully: the step finishes, a checkpoint is written,
//! the exit code is 0, and the checkpoint resumes.
mod common;

use std::time::{Duration, Instant};

use common::{bin, fixture, of_kind, read_log};

fn stop_with(signal: i32) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--config"])
        .arg(fixture("tiny.toml"))
        .args([
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until training is under way (a few steps logged), then signal mid-run.
    let log = dir.path().join("run.jsonl");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.matches("\"kind\":\"step\"").count() >= 3 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "signal {signal}: exit {status:?}");

    let records = read_log(&log);
    let finished = of_kind(&records, "finished");
    assert_eq!(finished.len(), 1, "a finished record");
    assert_eq!(finished[0]["stopped_by_user"], true);
    let steps = finished[0]["steps_done"].as_u64().unwrap();
    assert!((3..100_000).contains(&steps));
    let saved = of_kind(&records, "checkpoint_saved");
    assert_eq!(saved.last().unwrap()["step"].as_u64(), Some(steps));

    // The checkpoint is whole: a resume continues from it.
    let out = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "ck", "--steps"])
        .arg((steps + 2).to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sigterm_stops_with_a_checkpoint() {
    stop_with(libc::SIGTERM);
}

#[test]
fn sigint_stops_with_a_checkpoint() {
    stop_with(libc::SIGINT);
}
