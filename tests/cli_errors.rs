//! Bad input gives one clear line naming the problem and the fix, a non-zero exit, and
//! nothing written half-way.
mod common;

use common::{bin, stderr, train_tiny};

fn assert_error(out: &std::process::Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.starts_with("headroom: error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
}

#[test]
fn missing_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(dir.path(), &["--corpus", "no/such/file.txt"]);
    assert_error(&out, &["no/such/file.txt"]);
}

#[test]
fn empty_corpus() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("empty.txt"), "").unwrap();
    let out = train_tiny(dir.path(), &["--corpus", "empty.txt"]);
    assert_error(&out, &["empty"]);
}

#[test]
fn binary_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(dir.path().join("blob.bin"), bytes).unwrap();
    let out = train_tiny(dir.path(), &["--corpus", "blob.bin"]);
    assert_error(&out, &["binary"]);
}

#[test]
fn malformed_toml() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[run\nsteps = 3\n").unwrap();
    let out = bin()
        .args(["train", "--headless", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_error(&out, &["bad.toml", "invalid"]);
}

#[test]
fn unknown_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("typo.toml");
    std::fs::write(&cfg, "[model]\nn_layers = 2\n").unwrap();
    let out = bin()
        .args(["train", "--headless", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_error(&out, &["n_layers"]);
}

#[test]
fn zero_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(dir.path(), &["--batch-size", "0"]);
    assert_error(&out, &["--batch-size", "at least 1"]);
}

#[test]
fn missing_config_file() {
    let out = bin()
        .args(["train", "--headless", "--config", "/no/such.toml"])
        .output()
        .unwrap();
    assert_error(&out, &["/no/such.toml", "--config"]);
}

#[test]
fn unwritable_log() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "x").unwrap();
    let out = train_tiny(dir.path(), &["--log", "file/run.jsonl"]);
    assert_error(&out, &["file/run.jsonl", "--log"]);
}

#[test]
fn unwritable_checkpoint_dir() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "x").unwrap();
    let out = train_tiny(dir.path(), &["--checkpoint-dir", "file/ckpt"]);
    assert_error(&out, &["file/ckpt", "--checkpoint-dir"]);
}

#[test]
fn resume_from_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "nowhere"])
        .output()
        .unwrap();
    assert_error(&out, &["nowhere"]);
}

#[test]
fn help_and_version() {
    let out = bin().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(env!("CARGO_PKG_VERSION")));
    let out = bin().args(["train", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--corpus",
        "--device",
        "--steps",
        "--batch-size",
        "--effective-batch",
        "--seed",
        "--headless",
        "--log",
        "--checkpoint-dir",
        "--resume",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}
