//! `headroom plan`, the plan's prediction beside each step's peak in a run's log, and a
//! run's last words when one sequence does not fit, through the binary.
mod common;

use common::{bin, of_kind, read_log, stderr, train_tiny};

#[test]
fn plan_prints_every_lever_with_the_largest_micro_batch() {
    let out = bin()
        .args(["plan", "--device", "cpu", "--threads", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}{text}", stderr(&out));
    for needle in [
        "4 layers × 128 wide, 4 heads, 64 tokens",
        "parameters",
        "AdamW moments",
        "attention",
        "MLP",
        "logits",
        "norms",
        "measured (forward and backward of 64 tokens per sequence)",
        "largest mb",
        "* fp32 · none",
        "  bf16 · none",
        "  fp32 · blocks",
        "  bf16 · blocks",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
    // Each lever row ends in its largest micro-batch: fewer sequences fit fp32 without
    // checkpointing than bf16 with blocks.
    let largest = |row: &str| -> usize {
        let line = text.lines().find(|l| l.contains(row)).unwrap();
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert!(largest("fp32 · none") < largest("bf16 · blocks"), "{text}");
}

#[test]
fn bad_plan_input_is_one_clear_error() {
    for (args, needle) in [
        (&["plan", "--batch-size", "0"][..], "--batch-size"),
        (&["plan", "--precision", "fp8"][..], "fp32, bf16 or fp16"),
        // A Python run's half precision, not the built-in trainer's (no loss scaler).
        (
            &["plan", "--precision", "fp16"][..],
            "fp16 needs a loss scaler",
        ),
        (&["plan", "--memory-budget", "lots"][..], "--memory-budget"),
        (&["plan", "--device", "cuda:7"][..], "cuda"),
    ] {
        let out = bin().args(args).output().unwrap();
        let err = stderr(&out);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Every step of a built-in run logs the plan's prediction beside its measured peak
/// (`plan_check`, the record Python runs given `plan=` write).
#[test]
fn a_run_logs_the_plans_prediction_beside_each_peak() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(
        dir.path(),
        &[
            "--steps",
            "4",
            "--batch-size",
            "16",
            // One thread: the pool's scratch per thread is noise in peaks held to 10%,
            // and how much of it a step touches depends on the machine's cores.
            "--threads",
            "1",
            "--log",
            "run.jsonl",
            "--checkpoint-dir",
            "ck",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let log = read_log(&dir.path().join("run.jsonl"));
    let notes = of_kind(&log, "notice");
    let plan = notes
        .iter()
        .find(|n| n["source"] == "plan")
        .expect("a plan notice");
    let text = plan["text"].as_str().unwrap();
    if text.contains("failed") {
        // The tiny model's activations can be lost in the resident set's noise; the run
        // says so and goes on. What must hold then: no plan_check pretends otherwise.
        assert!(of_kind(&log, "plan_check").is_empty(), "{text}");
        return;
    }
    let split = of_kind(&log, "plan_split");
    assert_eq!(split.len(), 1, "the panel's split, once");
    assert!(split[0]["activations_per_token"].as_f64().unwrap() > 0.0);
    let checks = of_kind(&log, "plan_check");
    let memory = of_kind(&log, "step_memory");
    assert_eq!(checks.len(), memory.len(), "one per measured step");
    for (c, m) in checks.iter().zip(&memory) {
        assert_eq!(c["step"], m["step"]);
        assert_eq!(c["peak_bytes"], m["peak_bytes"]);
        let (p, k) = (
            c["planned_bytes"].as_f64().unwrap(),
            c["peak_bytes"].as_f64().unwrap(),
        );
        // The process (~370 MiB) dominates a tiny model's step: the plan is close.
        assert!((p - k).abs() / k < 0.10, "planned {p}, measured {k}: {c}");
    }
}

/// A sequence of 8192 bytes needs about 700 MiB in fp32 under a 640 MiB cap: the run
/// stops at micro-batch 1, and its last words say which lever fits, by how much.
/// (Measured beside it: with --activation-checkpoint blocks the same step peaks at
/// about 510 MiB, and trains.)
#[test]
fn last_words_name_the_lever_that_would_fit() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("long.toml"), "[data]\nseq_len = 8192\n").unwrap();
    let out = bin()
        .current_dir(dir.path())
        .args([
            "train",
            "--headless",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--config",
            "long.toml",
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--effective-batch",
            "1",
            "--memory-budget",
            "640MiB",
            "--hard-limit",
            "--checkpoint-dir",
            "ck",
        ])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("at micro-batch 1"), "{err}");
    let words = err
        .split("What would fit: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no last words in {err}"));
    assert!(
        words.contains("for one sequence of 8192 tokens with fp32 · checkpoint none"),
        "{words}"
    );
    assert!(words.contains("against the limit of 640 MiB"), "{words}");
    let blocks = words
        .split("; ")
        .find(|p| p.starts_with("--activation-checkpoint blocks:"))
        .unwrap_or_else(|| panic!("no checkpointing lever in {words}"));
    assert!(blocks.contains("less): fits, "), "{blocks}");
    assert!(words.contains("data.seq_len = "), "{words}");
}
