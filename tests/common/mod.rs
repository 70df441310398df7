//! Helpers shared by the end-to-end tests, which drive the real `headroom` binary.
#![allow(dead_code)]
pub mod pty;
pub mod screen;
pub mod stream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_headroom"));
    // Keep tests hermetic: no NVML notices differ between machines in what we assert.
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `headroom train --headless --config tiny.toml ARGS...` in `dir`.
pub fn train_tiny(dir: &Path, args: &[&str]) -> Output {
    bin()
        .current_dir(dir)
        .arg("train")
        .arg("--headless")
        .arg("--config")
        .arg(fixture("tiny.toml"))
        .args(args)
        .output()
        .expect("running headroom")
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every whole JSON record of a log a run is still writing: its writer may have put part
/// of a line out (a full buffer), the rest comes with its next write.
pub fn read_log_so_far(path: &Path) -> Vec<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad log line {l}: {e}")))
        .collect()
}

/// Every JSON record of a run log.
pub fn read_log(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad log line {l}: {e}")))
        .collect()
}

pub fn of_kind<'a>(log: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    log.iter().filter(|r| r["kind"] == kind).collect()
}

/// The `step` numbers of a log's step records, in order.
pub fn logged_steps(log: &[serde_json::Value]) -> Vec<u64> {
    of_kind(log, "step")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect()
}

/// `headroom train` on the tiny config in `dir`, far too many steps to finish by itself,
/// logging to `run.jsonl` and checkpointing to `ck`; more flags may follow.
pub fn long_tiny_command(dir: &Path) -> Command {
    long_command(dir, &fixture("tiny.toml"))
}

/// [`long_tiny_command`] with another config.
pub fn long_command(dir: &Path, config: &Path) -> Command {
    let mut cmd = bin();
    cmd.current_dir(dir)
        .args(["train", "--config"])
        .arg(config)
        .args([
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ]);
    cmd
}

/// The dashboard on a 100×30 pty over [`long_tiny_command`].
pub fn long_tiny_run(dir: &Path) -> pty::Pty {
    pty::Pty::spawn(long_tiny_command(dir), 100, 30)
}

/// The tiny config with the controller off (a fixed micro-batch), written into `dir`:
/// runs whose steps must split alike, or last as long as they were sized to.
pub fn tiny_fixed(dir: &Path) -> PathBuf {
    let config = dir.join("tiny-fixed.toml");
    let text = std::fs::read_to_string(fixture("tiny.toml")).unwrap();
    std::fs::write(
        &config,
        text.replace("[memory]\n", "[memory]\nadaptive = false\n"),
    )
    .unwrap();
    config
}

/// The tiny model's sequences per second on this machine, on one thread, at micro-batch
/// `batch` and `effective` sequences a step (its second step, past the first's warm-up):
/// a test that needs a step or a micro-batch to last some seconds sizes it from this,
/// measured the way it will run. A fixed count is long on one machine and short on a
/// faster one.
pub fn tiny_sequences_per_second(dir: &Path, batch: usize, effective: usize) -> f64 {
    let log = dir.join("rate.jsonl");
    let out = bin()
        .current_dir(dir)
        .args(["train", "--headless", "--threads", "1", "--config"])
        .arg(tiny_fixed(dir))
        .args(["--steps", "2", "--batch-size", &batch.to_string()])
        .args(["--effective-batch", &effective.to_string()])
        .arg("--log")
        .arg(&log)
        .output()
        .expect("running headroom");
    assert!(out.status.success(), "{}", stderr(&out));
    let records = read_log(&log);
    let step = of_kind(&records, "step").last().copied().expect("a step");
    let _ = std::fs::remove_file(&log);
    step["samples_per_s"].as_f64().expect("samples_per_s")
}
