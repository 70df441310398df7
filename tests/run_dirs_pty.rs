//! The README's first command, twice in one directory: the second run takes
//! the next free run directory instead of refusing, says so, and `--resume NAME` continues
//! the run of that name that was saved last (on a terminal, after a numbered choice).
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::bin;
use common::pty::{tail, Pty};

const WAIT: Duration = Duration::from_secs(120);

/// `headroom train ARGS...` as `./dev train ARGS...` runs it: the default config, in `dir`.
fn train(dir: &Path, runtime: &Path, args: &[&str]) -> Pty {
    let mut cmd = bin();
    cmd.current_dir(dir)
        .env("HEADROOM_RUNTIME_DIR", runtime)
        .arg("train")
        .args(args);
    Pty::spawn(cmd, 120, 40)
}

/// The step `headroom ls` shows for the run named `name`, once it is listed.
fn listed_step(dir: &Path, runtime: &Path, name: &str) -> Option<u64> {
    let out = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .current_dir(dir)
        .env("HEADROOM_RUNTIME_DIR", runtime)
        .arg("ls")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().find_map(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        (cols.first() == Some(&name))
            .then(|| cols.get(4)?.split('/').next()?.parse().ok())
            .flatten()
    })
}

/// Waits until `headroom ls` shows `name` past its first step, then stops it with `q`.
fn train_a_step_then_quit(pty: &mut Pty, dir: &Path, runtime: &Path, name: &str) -> String {
    assert!(
        pty.wait_for("\x1b[?1049h", WAIT),
        "no dashboard: {}",
        tail(&pty.output())
    );
    let start = Instant::now();
    while listed_step(dir, runtime, name).unwrap_or(0) < 1 {
        assert!(
            start.elapsed() < WAIT,
            "headroom ls never showed {name} past step 1; screen: {}",
            tail(&pty.output())
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    pty.send(b"q");
    let status = pty.wait_exit(WAIT).expect("no exit after q");
    let out = pty.output();
    assert!(status.success(), "exit {status:?}: {}", tail(&out));
    out
}

fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join("latest"))
        .unwrap_or_else(|e| panic!("{}/latest: {e}", root.display()))
}

fn step_of(latest: &str) -> u64 {
    latest.trim().trim_start_matches("step-").parse().unwrap()
}

#[test]
fn the_readme_command_twice_takes_the_next_run_dir_and_resume_by_name_continues_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, runtime) = (tmp.path(), tmp.path().join("rt"));
    let first: PathBuf = dir.join("runs/default");
    let second: PathBuf = dir.join("runs/default-2");

    let mut pty = train(dir, &runtime, &[]);
    train_a_step_then_quit(&mut pty, dir, &runtime, "default");
    let first_latest = latest(&first);

    // The same command again: the directory is taken, so the run goes to the next one.
    let mut pty = train(dir, &runtime, &[]);
    let out = train_a_step_then_quit(&mut pty, dir, &runtime, "default-2");
    assert!(
        out.contains("this one is default-2 in runs/default-2"),
        "the summary says where the run went: {}",
        tail(&out)
    );
    assert!(
        out.contains("--resume runs/default-2"),
        "and how to go on: {}",
        tail(&out)
    );
    let second_step = step_of(&latest(&second));
    assert_eq!(latest(&first), first_latest, "the first run is untouched");

    // `--resume default` on a terminal: a numbered choice, newest first; Enter takes it.
    let target = (second_step + 1).to_string();
    let mut pty = train(
        dir,
        &runtime,
        &[
            "--resume",
            "default",
            "--steps",
            &target,
            "--close-on-finish",
        ],
    );
    assert!(
        pty.wait_for("resume which (1-2, Enter: 1)?", WAIT),
        "no choice offered: {}",
        tail(&pty.output())
    );
    let offered = pty.output();
    let (one, two) = (
        offered.find("1  runs/default-2").expect("default-2 first"),
        offered.find("2  runs/default ").expect("default second"),
    );
    assert!(one < two, "{offered}");
    pty.send(b"\n");
    let status = pty.wait_exit(WAIT).expect("the resumed run did not finish");
    let out = pty.output();
    assert!(status.success(), "exit {status:?}: {}", tail(&out));
    assert!(out.contains("completed at step"), "{}", tail(&out));
    assert_eq!(
        step_of(&latest(&second)),
        second_step + 1,
        "default-2 went on by one step"
    );
    assert_eq!(
        latest(&first),
        first_latest,
        "the first run is still untouched"
    );
    assert!(
        !dir.join("runs/default-3").exists(),
        "a resume takes no new directory"
    );

    // Off a terminal the newest is taken without asking: default-2 again, whose
    // checkpoint (the refusal to train a finished run names it) is the step just saved.
    let out = bin()
        .current_dir(dir)
        .env("HEADROOM_RUNTIME_DIR", &runtime)
        .args(["train", "--headless", "--resume", "default", "--steps"])
        .arg((second_step + 1).to_string())
        .output()
        .unwrap();
    let said = common::stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    let expected = format!("runs/default-2/step-{:06} is at step", second_step + 1);
    assert!(said.contains(&expected), "{said}");
}
