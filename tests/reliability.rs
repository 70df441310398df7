//! The reliability suite: bad input and faults, through the real binary.
//! docs/RELIABILITY.md lists every case, what held and what did not.
//!
//! Every refused input must give exit code 2, one line on stderr that names the thing
//! that is wrong and the fix, no panic text, and leave the directory exactly as it was:
//! each case runs with `--log run.jsonl` over the log of an earlier run, which must
//! survive byte for byte, and no checkpoint directory (or anything else) may appear.
//!
//! Not repeated here (covered by tests/cli_errors.rs): malformed TOML, an unknown key in
//! a section, a missing config file, a missing / empty / binary (NUL bytes) corpus,
//! `--batch-size 0`, `--log` and `--checkpoint-dir` under a regular file, `--resume` of
//! a path that does not exist. By tests/memory_control.rs: `--thresholds` out of order
//! or not four values, `--profile greedy`, bad `--memory-budget`, `--hard-limit` without
//! a budget, `--inject-oom 0`. By tests/signals.rs: SIGINT and SIGTERM mid-run.
mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{bin, fixture, of_kind, read_log, stderr};

/// What the earlier run's log holds; a refused run must leave it alone.
const OLD_LOG: &str = "{\"kind\":\"finished\",\"note\":\"an earlier run's log\"}\n";

/// Every file (with its bytes) and directory under `dir`.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(dir).unwrap().to_path_buf();
            if path.is_symlink() {
                // A link (maybe dangling) is what it points to.
                let to = std::fs::read_link(&path).unwrap();
                out.insert(rel, Some(to.to_string_lossy().as_bytes().to_vec()));
            } else if path.is_dir() {
                out.insert(rel, None);
                todo.push(path);
            } else {
                out.insert(rel, Some(std::fs::read(&path).unwrap()));
            }
        }
    }
    out
}

fn assert_no_panic(text: &str) {
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE", "thread '"] {
        assert!(!text.contains(bad), "panic text ({bad:?}) in: {text}");
    }
}

/// Exit 2, one `headroom: error:` line holding every needle, no panic.
fn assert_refused(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.starts_with("headroom: error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert_no_panic(&err);
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
}

/// `headroom train --headless ARGS --log run.jsonl` in `dir` (which holds an earlier
/// run's log) must be refused naming `needles`, and change nothing in `dir`.
fn refused(dir: &Path, args: &[&str], needles: &[&str]) {
    let log = dir.join("run.jsonl");
    if !log.exists() {
        std::fs::write(&log, OLD_LOG).unwrap();
    }
    let before = snapshot(dir);
    let mut cmd = bin();
    cmd.current_dir(dir)
        .args(["train", "--headless"])
        .args(args);
    if !args.contains(&"--log") {
        cmd.args(["--log", "run.jsonl"]);
    }
    let out = cmd.output().unwrap();
    assert_refused(&out, needles);
    let after = snapshot(dir);
    let changed: Vec<_> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .collect();
    assert!(
        changed.is_empty(),
        "{args:?}: refused, yet these changed: {changed:?}"
    );
}

/// A config file `bad.toml` holding `text`, in a fresh directory, must be refused.
fn refused_config(text: &str, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.toml"), text).unwrap();
    refused(dir.path(), &["--config", "bad.toml"], needles);
}

/// The tiny fixture with `args`, in a fresh directory, must be refused.
fn refused_flags(args: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let tiny = fixture("tiny.toml");
    let mut all = vec!["--config", tiny.to_str().unwrap()];
    all.extend_from_slice(args);
    refused(dir.path(), &all, needles);
}

// ---- 1. Config ----------------------------------------------------------------------

#[test]
fn config_wrong_types_name_the_line_and_key() {
    refused_config(
        "[optim]\nlr = \"fast\"\n",
        &[
            "bad.toml",
            "line 2 (`lr = \"fast\"`)",
            "expected f64",
            "configs/default.toml",
        ],
    );
    refused_config(
        "[model]\ntie_weights = \"yes\"\n",
        &["bad.toml", "tie_weights", "bool"],
    );
    refused_config(
        "[data]\nlengths = \"sometimes\"\n",
        &["lengths", "sometimes", "fixed", "ramp", "random"],
    );
    refused_config(
        "[batch]\nmicro_batch = -3\n",
        &["line 2", "micro_batch", "-3"],
    );
    refused_config(
        "[batch]\nmicro_batch = 99999999999999999999\n",
        &["micro_batch", "99999999999999999999"],
    );
    // A key outside its section (here `steps`, which belongs in [run]).
    refused_config(
        "steps = 3\n",
        &["bad.toml", "line 1", "unknown field `steps`", "run"],
    );
}

#[test]
fn config_values_out_of_range_name_the_key_and_the_fix() {
    for (text, needles) in [
        (
            "[optim]\nlr = 0.0\n",
            &["optim.lr", "0 is out of range", "3e-3"][..],
        ),
        (
            "[optim]\nlr = -1e-3\n",
            &["optim.lr", "-0.001", "out of range"],
        ),
        ("[optim]\nlr = nan\n", &["optim.lr", "NaN", "out of range"]),
        (
            "[optim]\neps = inf\n",
            &["optim.eps", "inf", "out of range"],
        ),
        (
            "[optim]\ngrad_clip = nan\n",
            &["optim.grad_clip", "NaN", "0 to turn clipping off"],
        ),
        ("[run]\nname = \"..\"\n", &["run.name", "not . or .."]),
        (
            "[memory]\nmemory_budget = \"1\"\n",
            &["memory.memory_budget", "1 B", "1GiB"],
        ),
        (
            "[optim]\nlr = 1e-3\nmin_lr = 1e-2\n",
            &["optim.min_lr", "between 0 and optim.lr"],
        ),
        ("[optim]\nbeta2 = 1.0\n", &["optim.beta2", "[0, 1)"]),
        ("[optim]\neps = 0.0\n", &["optim.eps", "small positive"]),
        ("[data]\nseq_len = 0\n", &["data.seq_len", "2 to 65536"]),
        (
            "[data]\nseq_len = 1000000\n",
            &["data.seq_len", "2 to 65536"],
        ),
        (
            "[data]\nval_fraction = 0.9\n",
            &["data.val_fraction", "(0, 0.5]"],
        ),
        (
            "[data]\nlengths = \"ramp\"\nseq_len = 64\nmin_seq_len = 65\n",
            &["data.min_seq_len", "above data.seq_len"],
        ),
        ("[model]\nn_layer = 0\n", &["model", "at least 1"]),
        (
            "[model]\nn_embd = 130\n",
            &["model.n_embd", "n_head", "multiple"],
        ),
        ("[run]\nsteps = 0\n", &["run.steps", "at least 1"]),
        (
            "[run]\neval_batches = 0\n",
            &["run.eval_batches", "at least 1"],
        ),
        ("[run]\nsample_hz = 0.0\n", &["run.sample_hz", "(0, 100]"]),
        ("[run]\nname = \"a/b\"\n", &["run.name", "no slashes"]),
        (
            "[run]\ndevice = \"tpu\"\n",
            &["run.device", "tpu", "cuda:N"],
        ),
        (
            "[memory]\nmemory_budget = \"lots\"\n",
            &["memory.memory_budget", "lots"],
        ),
        (
            "[memory]\nmin_micro_batch = 0\n",
            &["memory.min_micro_batch", "at least 1"],
        ),
        (
            "[memory]\nmin_micro_batch = 8\nmax_micro_batch = 4\n",
            &["memory.max_micro_batch", "below memory.min_micro_batch"],
        ),
    ] {
        refused_config(text, needles);
    }
}

#[test]
fn invalid_thresholds_are_refused_from_the_file_and_the_flag() {
    refused_config(
        "[memory]\nthresholds = \"0.9,0.92,0.95,1.2\"\n",
        &["memory.thresholds", "emergency = 1.2", "outside (0, 1]"],
    );
    refused_config(
        "[memory]\nthresholds = \"0.9,0.85,0.95,0.97\"\n",
        &["memory.thresholds", "warning = 0.85", "strictly"],
    );
    refused_config(
        "[memory]\nthresholds = \"0,0.5,0.6,0.7\"\n",
        &["memory.thresholds", "target = 0", "outside (0, 1]"],
    );
    refused_flags(
        &["--thresholds", "0.9,0.92,0.95,1.2"],
        &["--thresholds", "emergency = 1.2", "outside (0, 1]"],
    );
    refused_flags(&["--thresholds", "0.9,0.92,0.95,x"], &["--thresholds", "x"]);
}

#[test]
fn zero_and_absurd_batch_sizes_are_refused() {
    // `--batch-size 0` is tests/cli_errors.rs's.
    refused_flags(
        &["--batch-size", "1000000000000"],
        &["--batch-size", "1000000000000", "absurdly large", "65536"],
    );
    refused_flags(
        &["--effective-batch", "1000000000000"],
        &["--effective-batch", "absurdly large", "65536"],
    );
    refused_flags(
        &["--batch-size", "16", "--effective-batch", "8"],
        &[
            "--effective-batch",
            "smaller than the micro-batch",
            "--batch-size",
        ],
    );
    refused_flags(&["--steps", "0"], &["--steps", "at least 1"]);
    refused_config(
        "[batch]\nmicro_batch = 1000000000000\n",
        &["batch.micro_batch", "absurdly large"],
    );
    refused_config(
        "[batch]\nmicro_batch = 16\neffective_batch = 8\n",
        &["batch.effective_batch", "smaller than the micro-batch"],
    );

    // Beyond what the flag's type holds: clap refuses it (its own two-line format).
    for args in [
        &["--batch-size", "1000000000000000000000000"][..],
        &["--batch-size", "-1"],
        &["--steps", "many"],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = bin()
            .current_dir(dir.path())
            .args(["train", "--headless"])
            .args(args)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(args[1]), "{args:?}: {err}");
        assert_no_panic(&err);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}

// ---- 2. Corpus ----------------------------------------------------------------------

/// The tiny fixture on corpus file `name` holding `bytes`, in a fresh directory.
fn refused_corpus(name: &str, bytes: &[u8], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(name), bytes).unwrap();
    let tiny = fixture("tiny.toml");
    refused(
        dir.path(),
        &["--config", tiny.to_str().unwrap(), "--corpus", name],
        needles,
    );
}

#[test]
fn corpus_that_is_not_utf8_text_is_refused() {
    // Latin-1 text: no NUL byte (tests/cli_errors.rs has the NUL case), but not UTF-8.
    let latin1 = b"caf\xe9 au lait, na\xefve r\xe9sum\xe9. ".repeat(200);
    refused_corpus(
        "latin1.txt",
        &latin1,
        &[
            "latin1.txt",
            "looks binary",
            "not valid UTF-8 at byte 3",
            "--corpus",
        ],
    );
    // Endless devices: refused at the first bad byte. Before, the whole stream was read
    // into memory first, until allocation failed ("out of memory; check its permissions").
    let dir = tempfile::tempdir().unwrap();
    let tiny = fixture("tiny.toml");
    for (dev, needles) in [
        (
            "/dev/zero",
            &["/dev/zero", "looks binary", "a NUL byte at offset 0"][..],
        ),
        (
            "/dev/urandom",
            &["/dev/urandom", "looks binary", "--corpus"],
        ),
    ] {
        refused(
            dir.path(),
            &["--config", tiny.to_str().unwrap(), "--corpus", dev],
            needles,
        );
    }
}

#[test]
fn corpus_that_is_a_directory_is_named_as_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("texts")).unwrap();
    let tiny = fixture("tiny.toml");
    refused(
        dir.path(),
        &["--config", tiny.to_str().unwrap(), "--corpus", "texts"],
        &[
            "corpus texts is a directory",
            "pass a text file to --corpus",
        ],
    );
}

/// `data.corpus` in a config file that leads nowhere: each named before the log is
/// touched and the trainer starts, by the part of the path that stops it, with the key to
/// fix. Before, a file used as a directory was "Not a directory (os error 20); check its
/// permissions", a dangling link a corpus that "does not exist", and a directory of texts
/// only "a directory".
#[test]
fn corpus_paths_in_a_config_that_lead_nowhere_name_what_stops_them() {
    let tiny = std::fs::read_to_string(fixture("tiny.toml")).unwrap();
    let cases: [(&str, &[&str]); 4] = [
        (
            "notes.txt/train.txt",
            &[
                "notes.txt is a file, not a directory",
                "fix data.corpus in run.toml",
            ],
        ),
        (
            "nope/train.txt",
            &["there is no directory nope", "fix data.corpus in run.toml"],
        ),
        (
            "link.txt",
            &["link.txt is a symbolic link to gone.txt, which does not exist"],
        ),
        (
            "texts",
            &[
                "corpus texts is a directory; pass a text file to data.corpus in run.toml",
                "2 file(s) (a.txt, b.txt)",
                "cat texts/* > corpus.txt",
            ],
        ),
    ];
    for (corpus, needles) in cases {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("notes.txt"), "some text").unwrap();
        std::os::unix::fs::symlink("gone.txt", d.join("link.txt")).unwrap();
        std::fs::create_dir(d.join("texts")).unwrap();
        for f in ["a.txt", "b.txt"] {
            std::fs::write(d.join("texts").join(f), "text").unwrap();
        }
        let config = tiny.replace("[data]\n", &format!("[data]\ncorpus = \"{corpus}\"\n"));
        std::fs::write(d.join("run.toml"), config).unwrap();
        refused(d, &["--config", "run.toml"], needles);
    }
}

#[test]
fn corpus_shorter_than_one_sequence_is_refused() {
    // tiny.toml: seq_len 32, so a window needs 34 bytes in each split.
    refused_corpus(
        "short.txt",
        b"ten bytes!",
        &[
            "short.txt",
            "too small",
            "training split",
            "data.seq_len = 32",
        ],
    );
    // Enough to train on, not enough to hold out 10% for validation.
    let text: Vec<u8> = b"To be, or not to be, that is the question. ".repeat(7);
    assert_eq!(text.len(), 301);
    refused_corpus(
        "tail.txt",
        &text,
        &["tail.txt", "validation split", "data.val_fraction"],
    );
}

#[test]
fn a_log_on_the_corpus_or_the_config_is_refused_before_it_destroys_them() {
    // Before: `--log corpus.txt` truncated the corpus, then reported it "empty".
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read(fixture("../../assets/tinyshakespeare.txt")).unwrap();
    std::fs::write(dir.path().join("corpus.txt"), &text[..20_000]).unwrap();
    std::fs::copy(fixture("tiny.toml"), dir.path().join("tiny.toml")).unwrap();
    refused(
        dir.path(),
        &[
            "--config",
            "tiny.toml",
            "--corpus",
            "corpus.txt",
            "--log",
            "./corpus.txt",
        ],
        &["--log ./corpus.txt is the corpus", "choose another --log"],
    );
    refused(
        dir.path(),
        &["--config", "tiny.toml", "--log", "tiny.toml"],
        &["--log tiny.toml is the config", "choose another --log"],
    );
}

// ---- 3. Checkpoints for --resume ----------------------------------------------------

/// A real checkpoint: `--steps N` of the tiny fixture (its text passed through `edit`,
/// saved as `dir/tiny.toml`) in `dir/ck`.
fn make_checkpoint(dir: &Path, steps: u64, edit: impl FnOnce(String) -> String) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = edit(std::fs::read_to_string(fixture("tiny.toml")).unwrap());
    std::fs::write(dir.join("tiny.toml"), cfg).unwrap();
    let out = bin()
        .current_dir(dir)
        .args(["train", "--headless", "--config", "tiny.toml"])
        .args(["--steps", &steps.to_string(), "--checkpoint-dir", "ck"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    dir.join("ck")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

fn truncate(path: &Path, keep: f64) {
    let len = std::fs::metadata(path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len((len as f64 * keep) as u64).unwrap();
}

/// XORs `n` bytes at the middle of the file (well past the safetensors header).
fn flip_middle(path: &Path, n: usize) {
    let mut b = std::fs::read(path).unwrap();
    let mid = b.len() / 2;
    for x in &mut b[mid..mid + n] {
        *x ^= 0xff;
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn damaged_checkpoints_are_refused_and_left_as_they_are() {
    let root = tempfile::tempdir().unwrap();
    let good = make_checkpoint(&root.path().join("good"), 3, |c| c);
    // The other shape: the same fixture with n_embd 64.
    let wide = make_checkpoint(&root.path().join("wide"), 3, |c| {
        c.replace("n_embd = 32", "n_embd = 64")
    });
    const STEP: &str = "step-000003";
    const NEXT: &str = "resume from another step-NNNNNN directory or start a fresh run";

    type Damage<'a> = Box<dyn Fn(&Path) + 'a>;
    let cases: Vec<(&str, Damage, Vec<&str>)> = vec![
        (
            "truncated model",
            Box::new(|ck| truncate(&ck.join(STEP).join("model.safetensors"), 0.5)),
            vec!["model.safetensors", "truncated or corrupt", NEXT],
        ),
        (
            // Before the checksums, this one loaded: resumed at a loss of ~1e5.
            "flipped bytes in the model's tensors",
            Box::new(|ck| flip_middle(&ck.join(STEP).join("model.safetensors"), 64)),
            vec!["model.safetensors", "checksum", "state.json recorded", NEXT],
        ),
        (
            "zeroed tail of the optimizer state (same length)",
            Box::new(|ck| {
                let p = ck.join(STEP).join("optimizer.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                let n = b.len();
                b[n - 4096..].fill(0);
                std::fs::write(&p, b).unwrap();
            }),
            vec!["optimizer.safetensors", "checksum", NEXT],
        ),
        (
            "garbage safetensors header",
            Box::new(|ck| {
                let p = ck.join(STEP).join("model.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                b[8..40].fill(0xff);
                std::fs::write(&p, b).unwrap();
            }),
            vec!["model.safetensors", "truncated or corrupt", NEXT],
        ),
        (
            "truncated optimizer state",
            Box::new(|ck| truncate(&ck.join(STEP).join("optimizer.safetensors"), 0.3)),
            vec!["optimizer.safetensors", "truncated or corrupt"],
        ),
        (
            "missing optimizer state",
            Box::new(|ck| {
                std::fs::remove_file(ck.join(STEP).join("optimizer.safetensors")).unwrap()
            }),
            vec!["incomplete", "optimizer.safetensors is missing", NEXT],
        ),
        (
            "truncated state.json",
            Box::new(|ck| truncate(&ck.join(STEP).join("state.json"), 0.5)),
            vec!["state.json", "truncated or corrupt", "invalid JSON"],
        ),
        (
            "empty state.json",
            Box::new(|ck| truncate(&ck.join(STEP).join("state.json"), 0.0)),
            vec!["state.json", "truncated or corrupt"],
        ),
        (
            "state.json from a newer format",
            Box::new(|ck| {
                edit_json(&ck.join(STEP).join("state.json"), |v| {
                    v["format_version"] = 2.into();
                    v["a_field_from_the_future"] = true.into();
                })
            }),
            vec![
                "newer headroom",
                "format 2",
                "reads format 1",
                "upgrade headroom",
            ],
        ),
        (
            "model file of another shape (n_embd 64 for 32)",
            Box::new({
                let wide = wide.join(STEP).join("model.safetensors");
                move |ck| {
                    std::fs::copy(&wide, ck.join(STEP).join("model.safetensors")).unwrap();
                }
            }),
            vec!["model.safetensors", "h.0.attn.c_attn.bias", "[192]", "[96]"],
        ),
        (
            "state.json config of another shape",
            Box::new(|ck| {
                edit_json(&ck.join(STEP).join("state.json"), |v| {
                    v["config"]["model"]["n_embd"] = 64.into();
                })
            }),
            vec!["different model", "h.0.attn.c_attn.bias", "[96]", "[192]"],
        ),
        (
            "latest names a missing step",
            Box::new(|ck| std::fs::write(ck.join("latest"), "step-000099\n").unwrap()),
            vec!["incomplete", "step-000099 is missing"],
        ),
        (
            "latest holds garbage",
            Box::new(|ck| std::fs::write(ck.join("latest"), "not-a-step\n").unwrap()),
            vec!["latest", "'not-a-step' is not a step-NNNNNN name"],
        ),
    ];
    for (what, damage, needles) in &cases {
        let dir = root.path().join(what.replace(' ', "_"));
        copy_dir(&good, &dir.join("ck"));
        damage(&dir.join("ck"));
        eprintln!("case: {what}");
        refused(&dir, &["--resume", "ck", "--steps", "6"], needles);
    }
}

#[test]
fn resume_paths_that_are_not_checkpoints_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let good = make_checkpoint(&root.path().join("good"), 3, |c| c);
    let dir = root.path().join("case");
    copy_dir(&good, &dir.join("ck"));
    std::fs::write(dir.join("notes.txt"), "not a checkpoint").unwrap();
    std::fs::create_dir(dir.join("empty")).unwrap();
    for (args, needles) in [
        (
            &["--resume", "notes.txt"][..],
            &["notes.txt is not a headroom checkpoint", "--resume"][..],
        ),
        (
            &["--resume", "empty"],
            &["empty is not a headroom checkpoint", "--resume"],
        ),
        (
            &["--resume", "ck", "--config", "ck/../x.toml"],
            &["--resume", "drop --config"],
        ),
        (
            &["--resume", "ck", "--seed", "7"],
            &["--seed cannot change when resuming"],
        ),
        // Already at its end: more steps are needed.
        (
            &["--resume", "ck", "--steps", "3"],
            &["at step 3", "raise --steps above 3"],
        ),
    ] {
        refused(&dir, args, needles);
    }
}

#[test]
fn checkpoints_without_checksums_still_resume() {
    // Written before state.json carried checksums: loaded unchecked, as before.
    let root = tempfile::tempdir().unwrap();
    let ck = make_checkpoint(root.path(), 3, |c| c);
    let state = ck.join("step-000003/state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(text.contains("\"checksums\""), "new checkpoints carry them");
    edit_json(&state, |v| {
        v.as_object_mut().unwrap().remove("checksums");
    });
    let out = bin()
        .current_dir(root.path())
        .args(["train", "--headless", "--resume", "ck", "--steps", "4"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

// ---- 4. Paths that cannot be written ------------------------------------------------

#[test]
fn unwritable_paths_name_the_flag_and_leave_nothing() {
    // Under a regular file: tests/cli_errors.rs. Here: the path itself is the wrong kind.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("logs")).unwrap();
    std::fs::write(dir.path().join("ck"), "a file").unwrap();
    let tiny = fixture("tiny.toml");
    let tiny = tiny.to_str().unwrap();
    refused(
        dir.path(),
        &["--config", tiny, "--log", "logs"],
        &["cannot write log logs", "--log", "Is a directory"],
    );
    refused(
        dir.path(),
        &["--config", tiny, "--checkpoint-dir", "ck"],
        &["ck", "it is a file, not a directory", "--checkpoint-dir"],
    );
    // A log whose directory does not exist yet is created (tests/headless_run.rs), but
    // a run refused after that check takes both away again.
    refused(
        dir.path(),
        &[
            "--config",
            tiny,
            "--corpus",
            "missing.txt",
            "--log",
            "new/logs/run.jsonl",
        ],
        &["missing.txt", "--corpus"],
    );
    refused(
        dir.path(),
        &[
            "--config",
            tiny,
            "--checkpoint-dir",
            "ck/sub",
            "--log",
            "new/run.jsonl",
        ],
        &["ck/sub", "--checkpoint-dir"],
    );
}

// ---- 5. Faults ----------------------------------------------------------------------

/// Every record of a log that may end in a line cut short by SIGKILL.
fn read_killed_log(path: &Path) -> Vec<serde_json::Value> {
    let Ok(f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect()
}

fn losses(log: &[serde_json::Value]) -> BTreeMap<u64, f64> {
    of_kind(log, "step")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
        .collect()
}

fn latest_step(ck: &Path) -> u64 {
    let name = std::fs::read_to_string(ck.join("latest")).unwrap();
    name.trim()
        .strip_prefix("step-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("latest: {name:?}"))
}

/// Waits until `log` holds a step record; false after `limit`.
fn wait_for_a_step(log: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains("\"kind\":\"step\"") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// Starts `headroom train --headless --resume ck --steps STEPS --log LOG` in `dir`.
fn spawn_resume(dir: &Path, steps: &str, log: &Path) -> std::process::Child {
    bin()
        .current_dir(dir)
        .args(["train", "--headless", "--resume", "ck", "--steps", steps])
        .arg("--log")
        .arg(log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// SIGTERM (a graceful stop), then the exit must be clean.
fn stop(child: std::process::Child, what: &str) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{what}: {err}");
    assert_no_panic(&err);
}

/// A checkpoint after every step, and SIGKILL at staggered moments: ten times in a
/// row, each run resuming the directory the previous one was killed in. Every resume
/// must start from the step `latest` names, and every step any of the runs logged must
/// have exactly the loss of one uninterrupted run from the same start (so each
/// checkpoint was whole, not just loadable).
#[test]
fn sigkill_while_checkpointing_always_leaves_a_resumable_checkpoint() {
    const KILLS: u64 = 10;
    // Far more than any run gets through: the schedule is the same for all of them.
    const STEPS: &str = "1000000";
    let dir = tempfile::tempdir().unwrap();
    let ck = make_checkpoint(dir.path(), 2, |c| {
        c.replace("checkpoint_every = 0", "checkpoint_every = 1")
    });
    let reference = dir.path().join("reference");
    copy_dir(&ck, &reference.join("ck"));

    let mut logged: Vec<(u64, BTreeMap<u64, f64>)> = Vec::new();
    let mut mid_write = 0;
    for i in 0..=KILLS {
        let from = latest_step(&ck);
        assert!(
            ck.join(format!("step-{from:06}/state.json")).exists(),
            "latest names a whole step directory"
        );
        let log = dir.path().join(format!("run{i}.jsonl"));
        let mut child = spawn_resume(dir.path(), STEPS, &log);
        let started = wait_for_a_step(&log, Duration::from_secs(60));
        if !started || i == KILLS {
            // The last one (or one that never stepped) stops gracefully and reports.
            stop(child, &format!("resume {i} from step {from}"));
            assert!(started, "resume {i} from step {from} never stepped");
        } else {
            // 0 to 57 ms after the first step: densest early, where the first save
            // (the slowest: new files, first fsyncs) is under way.
            std::thread::sleep(Duration::from_micros(700 * i * i));
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            child.wait().unwrap();
            let leftovers = std::fs::read_dir(&ck)
                .unwrap()
                .filter(|e| {
                    let name = e.as_ref().unwrap().file_name();
                    let name = name.to_string_lossy();
                    name.starts_with(".tmp-") || name == "latest.tmp"
                })
                .count();
            mid_write += usize::from(leftovers > 0);
        }
        let records = read_killed_log(&log);
        let run_started = of_kind(&records, "run_started");
        assert_eq!(
            run_started[0]["start_step"].as_u64(),
            Some(from),
            "resume {i} started where latest pointed"
        );
        logged.push((from, losses(&records)));
    }

    // The uninterrupted run, as far as the furthest of them got.
    let furthest = logged
        .iter()
        .filter_map(|(_, l)| l.keys().max().copied())
        .max()
        .unwrap();
    let log = reference.join("run.jsonl");
    let child = spawn_resume(&reference, STEPS, &log);
    let start = Instant::now();
    while !losses(&read_killed_log(&log)).contains_key(&furthest) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "reference stalled"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    stop(child, "the reference run");
    let uninterrupted = losses(&read_killed_log(&log));
    let mut compared = 0;
    for (i, (from, losses)) in logged.iter().enumerate() {
        assert!(
            losses.contains_key(&(from + 1)),
            "run {i} logged its first step"
        );
        for (step, loss) in losses {
            assert_eq!(
                Some(loss),
                uninterrupted.get(step),
                "step {step} of run {i} (resumed at {from})"
            );
            compared += 1;
        }
    }
    eprintln!(
        "{KILLS} kills up to step {furthest}: after {mid_write} a half-written checkpoint \
         (.tmp-*, latest.tmp) was left; {compared} logged losses equal the uninterrupted run's"
    );
    // Not asserted: how often a kill lands mid-write depends on the disk (7 to 10 of 10
    // on the machine docs/RELIABILITY.md names; on tmpfs, where fsync is free, fewer).
}

#[test]
fn a_full_disk_under_the_log_warns_and_training_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--config"])
        .arg(fixture("tiny.toml"))
        .args(["--log", "/dev/full", "--checkpoint-dir", "ck"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert_no_panic(&err);
    assert!(
        err.contains("writing log /dev/full failed")
            && err.contains("No space left on device")
            && err.contains("training continues"),
        "{err}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("completed at step 20/20"), "{stdout}");
    assert_eq!(latest_step(&dir.path().join("ck")), 20);
}

/// Five out-of-memory errors in a row (micro-batch 8 shrinks at each): the run completes
/// with every step once and the losses of a run that never failed.
#[test]
fn a_burst_of_injected_ooms_changes_nothing_that_is_learned() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--config"])
            .arg(fixture("tiny.toml"))
            .args(["--steps", "10", "--checkpoint-dir", name, "--log"])
            .arg(format!("{name}.jsonl"))
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert_no_panic(&stderr(&out));
        read_log(&dir.path().join(format!("{name}.jsonl")))
    };
    let clean = run("clean", &[]);
    let faulty = run("faulty", &["--inject-oom", "2,3,4,5,6"]);
    let ooms: Vec<u64> = of_kind(&faulty, "oom")
        .iter()
        .map(|o| {
            assert!(o["retry_with"].as_u64().is_some(), "retried: {o}");
            o["step"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(ooms, [2, 3, 4, 5, 6]);
    let (a, b) = (losses(&clean), losses(&faulty));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    assert_eq!(a.len(), 10, "every step once");
    for (step, la) in &a {
        let lb = b[step];
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {step}: {la} clean, {lb} after the OOMs"
        );
    }
    let tokens = |log: &[serde_json::Value]| of_kind(log, "finished")[0]["tokens_seen"].clone();
    assert_eq!(
        tokens(&clean),
        tokens(&faulty),
        "no sample lost or repeated"
    );
}
