//! `memory.auto_checkpoint` by a real cause: a hard cap (RLIMIT_DATA) at which one
//! sequence does not fit with every block's activations kept, and does with them
//! recomputed. With the setting the run turns checkpointing on by itself, trains, and logs
//! the switch as a controller decision; without it the run stops with its message.
mod common;

use std::path::Path;
use std::process::Output;

use common::{bin, logged_steps, of_kind, read_log, stderr};

/// Many thin layers over a long-ish sequence: activations dominate the step's memory
/// (parameters, gradients and moments are a few MiB), and the step stays short.
fn config(checkpoint: &str, auto: bool) -> String {
    format!(
        "[data]\nseq_len = 512\n\
         [model]\nn_layer = 48\nn_head = 2\nn_embd = 32\ncheckpoint = \"{checkpoint}\"\n\
         [run]\neval_batches = 1\nthreads = 1\ncheckpoint_every = 0\n\
         [memory]\nadaptive = false\nmin_micro_batch = 1\nauto_checkpoint = {auto}\n"
    )
}

/// Above the recomputed step's peak: about half of what keeping the 48 blocks'
/// activations adds at this length (measured: 440 MiB kept, 392 MiB recomputed).
const ROOM: u64 = 24 << 20;

/// `headroom train` at micro-batch 1 under a hard cap of `budget`, logging to
/// `<name>.jsonl`.
fn train(dir: &Path, name: &str, cfg: String, budget: &str, steps: &str) -> Output {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, cfg).unwrap();
    bin()
        .current_dir(dir)
        .args(["train", "--headless", "--device", "cpu", "--config"])
        .arg(&path)
        .args([
            "--steps",
            steps,
            "--batch-size",
            "1",
            "--effective-batch",
            "1",
        ])
        .args(["--memory-budget", budget, "--hard-limit", "--log"])
        .arg(format!("{name}.jsonl"))
        .arg("--checkpoint-dir")
        .arg(format!("ck-{name}"))
        .output()
        .unwrap()
}

/// The largest step peak, bytes, of a run under a generous cap (the same allocator
/// settings as under the tight one).
fn peak(dir: &Path, checkpoint: &str) -> u64 {
    let name = format!("calibrate-{checkpoint}");
    let out = train(dir, &name, config(checkpoint, false), "4GiB", "2");
    assert!(out.status.success(), "{}", stderr(&out));
    of_kind(&read_log(&dir.join(format!("{name}.jsonl"))), "step_memory")
        .iter()
        .map(|m| m["peak_bytes"].as_u64().unwrap())
        .max()
        .unwrap()
}

#[test]
fn the_smallest_micro_batch_that_does_not_fit_turns_checkpointing_on_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The cap a little above the peak with every block recomputed, measured here (this
    // machine's libtorch and allocator, not a constant); that the plain step does not fit
    // under it is what the first run shows.
    let recomputed = peak(d, "blocks");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let cap_bytes = recomputed + ROOM;
    let cap = format!("{}MiB", cap_bytes >> 20);

    // Without the setting: the run stops, with its message and a checkpoint.
    let out = train(d, "off", config("none", false), &cap, "2");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ran out of memory 3 times in a row at micro-batch 1"),
        "{err}"
    );
    let log = read_log(&d.join("off.jsonl"));
    assert!(logged_steps(&log).is_empty());
    assert!(of_kind(&log, "decision")
        .iter()
        .all(|r| r["decision"]["decision"] != "lever"));

    // With it: the same cap, checkpointing turned on after the smallest micro-batch ran
    // out of memory, and the run trains to the end.
    let out = train(d, "on", config("none", true), &cap, "2");
    assert!(out.status.success(), "cap {cap}: {}", stderr(&out));
    let log = read_log(&d.join("on.jsonl"));
    let ooms = of_kind(&log, "oom");
    assert!(!ooms.is_empty() && ooms.iter().all(|o| o["micro_batch"] == 1 && o["step"] == 1));
    assert!(of_kind(&log, "notice").iter().any(|n| n["text"]
        .as_str()
        .unwrap()
        .contains("activation checkpointing is now on (memory.auto_checkpoint)")));
    let levers: Vec<_> = of_kind(&log, "decision")
        .into_iter()
        .filter(|r| r["decision"]["decision"] == "lever")
        .collect();
    assert_eq!(levers.len(), 1, "{levers:?}");
    let lever = &levers[0]["decision"];
    assert_eq!(levers[0]["step"], 1);
    assert_eq!(lever["change"], "activation checkpointing none → blocks");
    assert_eq!(lever["source"], "controller");
    // Nothing ran before it to compare with; the step that now fits is under the cap.
    assert!(
        lever["before"].is_null() && lever["freed_bytes"].is_null(),
        "{lever}"
    );
    assert_eq!(lever["after"]["micro_batch"], 1);
    assert_eq!(logged_steps(&log), [1, 2]);
    let memory = of_kind(&log, "step_memory");
    for m in &memory {
        assert!(m["peak_bytes"].as_u64().unwrap() < cap_bytes, "{m}");
    }
    assert_eq!(log.last().unwrap()["kind"], "finished");
    println!(
        "peak with blocks recomputed {:.0} MiB; cap {cap}",
        mib(recomputed)
    );
}
