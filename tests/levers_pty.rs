//! The memory levers from the keyboard, on a real pseudo-terminal: `a` turns activation
//! checkpointing on and `m` switches to bf16 on a running dashboard; the trainer confirms
//! each (its answer on the screen and in the log), and the first step that ran with it is
//! recorded as a lever decision with the peaks before and after, on the screen too.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::pty::{tail, Pty};
use common::screen::Screen;
use common::{fixture, of_kind};

const WAIT: Duration = Duration::from_secs(60);
const COLS: u16 = 160;
const ROWS: u16 = 40;

/// The log's complete lines so far (the writer may be mid-line).
fn log_so_far(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn wait_log(
    path: &Path,
    pty: &Pty,
    done: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let start = Instant::now();
    while start.elapsed() < WAIT {
        let log = log_so_far(path);
        if done(&log) {
            return log;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the log never showed it; screen:\n{}", screen(pty).text());
}

fn screen(pty: &Pty) -> Screen {
    Screen::of(&pty.output(), COLS as usize, ROWS as usize)
}

fn wait_screen(pty: &Pty, needle: &str) {
    let start = Instant::now();
    while start.elapsed() < WAIT {
        if screen(pty).contains(needle) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{needle:?} never on screen:\n{}", screen(pty).text());
}

fn lever_decisions(log: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    of_kind(log, "decision")
        .into_iter()
        .filter(|r| r["decision"]["decision"] == "lever")
        .collect()
}

/// Presses `key`; returns the trainer's answer (its `command_applied` text) once logged,
/// and the lever decision about the first step that ran with the switch.
fn press(
    pty: &mut Pty,
    log_path: &Path,
    key: &[u8],
    command: &str,
    seen: usize,
) -> (String, serde_json::Value) {
    pty.send(key);
    let log = wait_log(log_path, pty, |log| lever_decisions(log).len() > seen);
    let applied: Vec<_> = of_kind(&log, "command_applied")
        .into_iter()
        .filter(|r| r["command"]["command"] == command)
        .collect();
    assert_eq!(applied.len(), 1, "{applied:?}");
    let answer = applied[0]["applied"].as_str().unwrap().to_string();
    (answer, lever_decisions(&log)[seen].clone())
}

#[test]
fn a_and_m_switch_the_levers_and_the_trainer_confirms_each() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny model at a fixed micro-batch: a switch's first step runs at the shape of
    // the step before it, so what it freed is a direct difference.
    let cfg = dir.path().join("tiny.toml");
    let base = std::fs::read_to_string(fixture("tiny.toml")).unwrap();
    // The start's probe (micro-batches 4 and 8) must see its two peaks apart: at 128
    // tokens a sequence they differ by megabytes, and on one thread no pool's scratch of
    // another size hides that (the panel's first split is that probe's).
    let base = base.replace("seq_len = 32", "seq_len = 128");
    std::fs::write(&cfg, base.replace("[memory]", "[memory]\nadaptive = false")).unwrap();
    let mut cmd = common::long_command(dir.path(), &cfg);
    cmd.args(["--threads", "1"]);
    let mut pty = Pty::spawn(cmd, COLS, ROWS);
    let log_path = dir.path().join("run.jsonl");
    wait_log(&log_path, &pty, |log| common::logged_steps(log).len() >= 2);

    let (answer, lever) = press(&mut pty, &log_path, b"a", "set_checkpointing", 0);
    assert!(
        answer.starts_with("activation checkpointing none → blocks from step "),
        "{answer}"
    );
    let d = &lever["decision"];
    assert_eq!(d["change"], "activation checkpointing none → blocks");
    assert_eq!(d["source"], "command");
    let from: u64 = answer.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(
        lever["step"].as_u64(),
        Some(from),
        "about the first step with it"
    );
    assert_eq!(d["after"]["step"].as_u64(), Some(from));
    assert_eq!(d["before"]["step"].as_u64(), Some(from - 1));
    let freed =
        d["before"]["peak_bytes"].as_i64().unwrap() - d["after"]["peak_bytes"].as_i64().unwrap();
    assert_eq!(d["freed_bytes"].as_i64(), Some(freed), "{d}");
    // On the screen: the trainer's answer, and the decision in the event log.
    wait_screen(&pty, &answer);
    wait_screen(
        &pty,
        &format!("step {from}: activation checkpointing none → blocks (command): step peak"),
    );

    let (answer, lever) = press(&mut pty, &log_path, b"m", "set_precision", 1);
    assert!(
        answer.starts_with("precision fp32 → bf16 from step "),
        "{answer}"
    );
    let d = &lever["decision"];
    assert_eq!(d["change"], "precision fp32 → bf16");
    let from: u64 = answer.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(lever["step"].as_u64(), Some(from));
    assert!(d["freed_bytes"].is_i64(), "{d}");
    wait_screen(&pty, &answer);
    wait_screen(
        &pty,
        &format!("step {from}: precision fp32 → bf16 (command): step peak"),
    );

    pty.send(b"q");
    let status = pty.wait_exit(WAIT).expect("headroom did not exit after q");
    assert!(status.success(), "{}", tail(&pty.output()));
    let log = common::read_log(&log_path);
    // The memory panel's split follows each lever: the start's, then one per switch, each
    // with fewer activation bytes per token than the one before (blocks, then bf16).
    let per_token: Vec<f64> = of_kind(&log, "plan_split")
        .iter()
        .map(|s| s["activations_per_token"].as_f64().unwrap())
        .collect();
    assert_eq!(per_token.len(), 3, "{per_token:?}");
    assert!(
        per_token[1] < per_token[0] && per_token[2] < per_token[1],
        "{per_token:?}"
    );
    // The run's checkpoint keeps the switched levers.
    let saved = of_kind(&log, "checkpoint_saved");
    let ck = saved.last().expect("a checkpoint at the stop")["path"]
        .as_str()
        .unwrap();
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join(ck).join("state.json")).unwrap(),
    )
    .unwrap();
    let model = &state["config"]["model"];
    assert_eq!(
        (model["precision"].as_str(), model["checkpoint"].as_str()),
        (Some("bf16"), Some("blocks")),
        "{model}"
    );
}
