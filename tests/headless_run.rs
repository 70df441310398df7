//! A real (tiny) training run through the binary, headless, with a JSONL log.
mod common;

use common::{logged_steps, of_kind, read_log, stderr, train_tiny};

#[test]
fn headless_run_logs_every_step_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = train_tiny(
        dir.path(),
        &["--log", "logs/run.jsonl", "--checkpoint-dir", "ck"],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "stderr: {err}");
    // Nothing keeps the log writer waiting at the end (the stream server once held its
    // queue open: every run with a log waited 5 s and warned that the writer was stuck).
    assert!(!err.contains("warning"), "{err}");
    println!("tiny run with a log: {:?}", started.elapsed());

    let log = read_log(&dir.path().join("logs/run.jsonl"));
    let steps: Vec<u64> = logged_steps(&log);
    assert_eq!(
        steps,
        (1..=20).collect::<Vec<_>>(),
        "one step record per step"
    );
    for r in &log {
        assert!(r["ts"].as_f64().unwrap() > 1.0e9, "unix timestamp: {r}");
        assert!(r["t"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(of_kind(&log, "run_started").len(), 1);
    assert_eq!(log.last().unwrap()["kind"], "finished");
    let evals = of_kind(&log, "eval");
    assert!(evals.len() >= 2, "eval at step 10 and at the end");
    assert!(!of_kind(&log, "sample").is_empty(), "sampler ran");
    let first = of_kind(&log, "step")[0]["loss"].as_f64().unwrap();
    let last = evals.last().unwrap()["val_loss"].as_f64().unwrap();
    assert!(last < first, "the model learned: {first} -> {last}");

    // Progress on stderr, summary on stdout.
    assert!(err.contains("step     20/20"), "{err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("completed at step 20/20"), "{stdout}");
    assert!(
        dir.path().join("ck/latest").exists(),
        "final checkpoint written"
    );
}

#[test]
fn no_gpu_is_a_notice_not_a_failure() {
    // On this CI machine there is neither a driver nor a GPU: the run must say so and
    // go on. On a GPU machine the same run must simply succeed.
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(dir.path(), &["--steps", "2", "--log", "run.jsonl"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let log = read_log(&dir.path().join("run.jsonl"));
    let started = of_kind(&log, "run_started");
    let device = started[0]["device"].as_str().unwrap();
    if device == "cpu" {
        let notices = of_kind(&log, "notice");
        assert!(
            notices
                .iter()
                .any(|n| n["source"] == "nvml" || n["source"] == "device"),
            "expected a notice about the missing GPU/driver: {notices:?}"
        );
    }
}

#[test]
fn resume_continues_exactly_where_an_uninterrupted_run_would_be() {
    let dir = tempfile::tempdir().unwrap();
    let full = train_tiny(
        dir.path(),
        &[
            "--steps",
            "12",
            "--checkpoint-dir",
            "full",
            "--log",
            "full.jsonl",
        ],
    );
    assert!(full.status.success(), "{}", stderr(&full));
    let half = train_tiny(
        dir.path(),
        &[
            "--steps",
            "6",
            "--checkpoint-dir",
            "half",
            "--log",
            "half.jsonl",
        ],
    );
    assert!(half.status.success(), "{}", stderr(&half));
    let resumed = common::bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "half", "--steps", "12"])
        .args(["--log", "resumed.jsonl"])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));

    let losses = |name: &str| -> Vec<(u64, f64)> {
        of_kind(&read_log(&dir.path().join(name)), "step")
            .iter()
            .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
            .collect()
    };
    let full = losses("full.jsonl");
    let resumed = losses("resumed.jsonl");
    assert_eq!(
        resumed.first().map(|r| r.0),
        Some(7),
        "resumed after step 6"
    );
    assert_eq!(
        &full[6..],
        &resumed[..],
        "steps 7..12 identical (CPU, same seed)"
    );
}

/// What the README's fidelity paragraph says of a resume whose micro-batch sequence
/// differs from the uninterrupted run's (what an adaptive run's live memory readings do):
/// the gradient is the same sum in another order, so the losses agree to rounding, not to
/// the bit. Measured here with the micro-batch 4 × 4 before and 8 × 2 after the resume.
#[test]
fn a_resume_at_another_micro_batch_agrees_to_rounding() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny config with the controller off (its last section is [memory]), so each
    // side keeps the micro-batch it is given.
    let fixed = dir.path().join("fixed.toml");
    let tiny = std::fs::read_to_string(common::fixture("tiny.toml")).unwrap();
    std::fs::write(&fixed, format!("{tiny}\nadaptive = false\n")).unwrap();
    for (name, steps) in [("full", "12"), ("half", "6")] {
        let out = common::bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--config"])
            .arg(&fixed)
            .args([
                "--effective-batch",
                "16",
                "--batch-size",
                "4",
                "--steps",
                steps,
            ])
            .args(["--checkpoint-dir", name, "--log", &format!("{name}.jsonl")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let resumed = common::bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "half", "--steps", "12"])
        .args(["--batch-size", "8", "--log", "resumed.jsonl"])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let steps = |name: &str| -> Vec<(f64, u64)> {
        of_kind(&read_log(&dir.path().join(name)), "step")
            .iter()
            .map(|r| {
                (
                    r["loss"].as_f64().unwrap(),
                    r["micro_batch"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let (full, resumed) = (steps("full.jsonl"), steps("resumed.jsonl"));
    assert_eq!(resumed.len(), 6);
    assert!(full[6..].iter().all(|s| s.1 == 4) && resumed.iter().all(|s| s.1 == 8));
    let worst = full[6..]
        .iter()
        .zip(&resumed)
        .map(|(a, b)| ((a.0 - b.0) / a.0).abs())
        .fold(0.0f64, f64::max);
    eprintln!("largest relative loss difference over 6 resumed steps: {worst:.2e}");
    assert!(worst < 1e-5, "{worst:e}: more than rounding");
}

/// A checkpoint directory moved elsewhere (a backup, another machine) resumes into itself:
/// the directory its config named at the start is relative to where that run ran, and
/// writing (and pruning) there would touch another run's checkpoints.
#[test]
fn resume_saves_where_it_was_resumed_from() {
    let dir = tempfile::tempdir().unwrap();
    let first = train_tiny(dir.path(), &["--steps", "4", "--checkpoint-dir", "ck"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let backup = dir.path().join("backup");
    std::fs::create_dir(&backup).unwrap();
    std::fs::rename(dir.path().join("ck"), backup.join("ck")).unwrap();
    // A different run now owns ./ck.
    std::fs::create_dir(dir.path().join("ck")).unwrap();
    std::fs::write(dir.path().join("ck/keep"), "another run").unwrap();
    let resumed = common::bin()
        .current_dir(dir.path())
        .args([
            "train",
            "--headless",
            "--resume",
            "backup/ck",
            "--steps",
            "6",
        ])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert_eq!(
        std::fs::read_to_string(backup.join("ck/latest"))
            .unwrap()
            .trim(),
        "step-000006"
    );
    let untouched: Vec<_> = std::fs::read_dir(dir.path().join("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(untouched, ["keep"]);
    // Resumed from one step directory, it saves beside it.
    let again = common::bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "backup/ck/step-000006"])
        .args(["--steps", "8"])
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(backup.join("ck/step-000008/state.json").exists());
}

/// `--threads` reaches libtorch, and the run says how many it uses either way.
#[test]
fn threads_are_set_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let notices = |args: &[&str]| -> Vec<String> {
        // Each run replaces the previous one's checkpoints in runs/tiny.
        let out = train_tiny(dir.path(), &[args, &["--overwrite"]].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        of_kind(&read_log(&dir.path().join("t.jsonl")), "notice")
            .iter()
            .filter(|n| n["source"] == "torch")
            .map(|n| n["text"].as_str().unwrap().to_string())
            .collect()
    };
    let set = notices(&["--steps", "2", "--threads", "1", "--log", "t.jsonl"]);
    assert_eq!(
        set,
        ["libtorch uses 1 intra-op thread (run.threads)"],
        "{set:?}"
    );
    let default = notices(&["--steps", "2", "--log", "t.jsonl"]);
    assert_eq!(default.len(), 1, "{default:?}");
    assert!(default[0].contains("(its default)"), "{default:?}");
    let out = train_tiny(dir.path(), &["--threads", "5000"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("run.threads (--threads)"),
        "{}",
        stderr(&out)
    );
}

/// An adaptive run resumed from a checkpoint of its own goes on with the controller it
/// had (the checkpoint's journal of the controller's calls, replayed), so it splits every
/// later step as the uninterrupted run does and ends with bit-identical parameters. The
/// OOM at step 3 teaches the controller a ceiling under the effective batch: a fresh
/// controller (what a checkpoint without the journal gives) does not know it and grows
/// past it, which changes the split and leaves the parameters equal only to rounding.
#[test]
fn an_adaptive_resume_replays_the_controller_and_matches_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let full = train_tiny(
        dir.path(),
        &[
            "--steps",
            "12",
            "--effective-batch",
            "64",
            "--batch-size",
            "8",
            "--inject-oom",
            "3",
            "--checkpoint-every",
            "6",
            "--checkpoint-dir",
            "full",
            "--log",
            "full.jsonl",
        ],
    );
    assert!(full.status.success(), "{}", stderr(&full));
    let resume = |from: &str, name: &str| {
        let out = common::bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--resume", from, "--steps", "12"])
            .args(["--checkpoint-dir", name, "--log", &format!("{name}.jsonl")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    };
    resume("full/step-000006", "resumed");
    // The same checkpoint as one written before the journal existed.
    let old = dir.path().join("old/step-000006");
    std::fs::create_dir_all(&old).unwrap();
    for f in std::fs::read_dir(dir.path().join("full/step-000006")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), old.join(f.file_name())).unwrap();
    }
    let state = old.join("state.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert!(json["controller"]["calls"].as_array().unwrap().len() > 6);
    json.as_object_mut().unwrap().remove("controller");
    std::fs::write(&state, json.to_string()).unwrap();
    resume("old/step-000006", "fresh");

    let steps = |name: &str| -> Vec<(u64, u64, f64)> {
        of_kind(&read_log(&dir.path().join(name)), "step")
            .iter()
            .map(|r| {
                (
                    r["step"].as_u64().unwrap(),
                    r["micro_batch"].as_u64().unwrap(),
                    r["loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let (full, resumed, fresh) = (
        steps("full.jsonl"),
        steps("resumed.jsonl"),
        steps("fresh.jsonl"),
    );
    let sizes = |s: &[(u64, u64, f64)]| s.iter().map(|r| r.1).collect::<Vec<_>>();
    eprintln!(
        "micro-batches: uninterrupted {:?}, resumed {:?}, resumed without the journal {:?}",
        sizes(&full),
        sizes(&resumed),
        sizes(&fresh)
    );
    assert_eq!(&full[6..], &resumed[..], "steps 7..12: sizes and losses");
    let checksums = |name: &str| {
        let state = dir.path().join(name).join("step-000012/state.json");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
        json["checksums"].clone()
    };
    assert_eq!(
        checksums("full"),
        checksums("resumed"),
        "parameters and optimizer state bit-identical at step 12"
    );
    // The test's power: without the journal the split differs, and so do the bits.
    assert_ne!(
        sizes(&full[6..]),
        sizes(&fresh),
        "a fresh controller splits alike"
    );
    assert_ne!(checksums("full"), checksums("fresh"));
    let worst = full[6..]
        .iter()
        .zip(&fresh)
        .map(|(a, b)| ((a.2 - b.2) / a.2).abs())
        .fold(0.0f64, f64::max);
    eprintln!("without the journal: largest relative loss difference {worst:.2e}");
    assert!(worst < 1e-5, "{worst:e}: more than rounding");
}

#[test]
fn an_oom_snapshot_asked_on_the_cpu_is_said_off_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(
        dir.path(),
        &[
            "--steps",
            "3",
            "--inject-oom",
            "2",
            "--oom-snapshot",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let log = read_log(&dir.path().join("run.jsonl"));
    let said: Vec<&str> = of_kind(&log, "notice")
        .iter()
        .filter_map(|n| n["text"].as_str())
        .collect();
    assert!(
        said.iter()
            .any(|t| t.starts_with("oom_snapshot: off on the CPU")),
        "{said:?}"
    );
    assert_eq!(of_kind(&log, "oom").len(), 1, "the OOM happened");
    let pickles: Vec<_> = std::fs::read_dir(dir.path().join("ck"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("pickle"))
        .collect();
    assert!(pickles.is_empty(), "{pickles:?}");
}

/// A `.zst` log holds what a plain one does, `headroom cat` prints it for jq, and a name
/// with an earlier run's rotated segments beside it is refused before anything runs.
#[test]
fn a_compressed_log_holds_the_plain_logs_records_and_cat_prints_them() {
    let dir = tempfile::tempdir().unwrap();
    for log in ["run.jsonl", "run.jsonl.zst"] {
        let out = train_tiny(dir.path(), &["--log", log, "--steps", "40", "--overwrite"]);
        assert!(out.status.success(), "{log}: {}", stderr(&out));
    }
    let plain = read_log(&dir.path().join("run.jsonl"));
    let zst = dir.path().join("run.jsonl.zst");
    let cat = common::bin().arg("cat").arg(&zst).output().unwrap();
    assert!(cat.status.success(), "{}", stderr(&cat));
    let text = String::from_utf8(cat.stdout).unwrap();
    let packed: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert_eq!(logged_steps(&packed), (1..=40).collect::<Vec<_>>());
    let kinds = |log: &[serde_json::Value]| {
        let mut k: Vec<String> = log.iter().map(|r| r["kind"].to_string()).collect();
        k.sort();
        k
    };
    // Samples come at their own rate, and a second run's notices differ (the first's
    // checkpoints overwritten): the two runs differ there only.
    let no_samples = |log: &[serde_json::Value]| -> Vec<serde_json::Value> {
        log.iter()
            .filter(|r| r["kind"] != "sample" && r["kind"] != "notice")
            .cloned()
            .collect()
    };
    assert_eq!(kinds(&no_samples(&packed)), kinds(&no_samples(&plain)));
    assert!(
        std::fs::metadata(&zst).unwrap().len() * 3
            < std::fs::metadata(dir.path().join("run.jsonl"))
                .unwrap()
                .len(),
        "compressed to under a third"
    );
    // Losses are the same to single precision.
    let losses = |log: &[serde_json::Value]| -> Vec<f64> {
        of_kind(log, "step")
            .iter()
            .map(|r| r["loss"].as_f64().unwrap())
            .collect()
    };
    for (a, b) in losses(&packed).iter().zip(losses(&plain)) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }

    std::fs::copy(&zst, dir.path().join("run.1.jsonl.zst")).unwrap();
    let out = train_tiny(
        dir.path(),
        &["--log", "run.jsonl.zst", "--steps", "2", "--overwrite"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("rotated segments"),
        "{}",
        stderr(&out)
    );
    let out = train_tiny(dir.path(), &["--log", "x.jsonl", "--log-rotate", "30m"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("30min"), "{}", stderr(&out));
}

/// Where a distribution puts jemalloc; `None` on a machine without it.
fn jemalloc() -> Option<std::path::PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
        "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
        "/usr/lib64/libjemalloc.so.2",
        "/usr/lib/libjemalloc.so.2",
    ]
    .iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.exists())
}

/// Under another malloc (preloaded) the run says so at its start, and glibc's heap
/// allowance is off; under glibc's nothing is said.
#[test]
fn another_malloc_preloaded_is_said_and_glibc_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let said = |log: &str| -> Vec<String> {
        of_kind(&read_log(&dir.path().join(log)), "notice")
            .iter()
            .filter_map(|n| n["text"].as_str().map(str::to_string))
            .filter(|t| t.contains("malloc here is not glibc's"))
            .collect()
    };
    let out = train_tiny(dir.path(), &["--log", "glibc.jsonl", "--steps", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(said("glibc.jsonl").is_empty());
    let Some(lib) = jemalloc() else {
        eprintln!("skipped the preloaded half: no libjemalloc.so.2 on this machine");
        return;
    };
    let out = common::bin()
        .current_dir(dir.path())
        .env("LD_PRELOAD", &lib)
        .args(["train", "--headless", "--config"])
        .arg(common::fixture("tiny.toml"))
        .args(["--log", "je.jsonl", "--steps", "2", "--overwrite"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let notes = said("je.jsonl");
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains(&*lib.to_string_lossy()), "{}", notes[0]);
}
