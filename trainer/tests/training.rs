//! The trainer end to end on tiny models (CPU): accumulation, resume, bad input,
//! checkpoint atomicity, learning, and commands.
use std::path::{Path, PathBuf};
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use headroom_core::policy::{Profile, Thresholds};
use headroom_core::{Bus, Command, RunConfig, RunStatus, Telemetry};
use headroom_trainer::checkpoint;
use headroom_trainer::data::Dataset;
use headroom_trainer::runner;
use headroom_trainer::schedule::Schedule;
use headroom_trainer::step::{evaluate, train_step, StepPlan};

mod common;
use common::*;

#[test]
fn accumulated_micro_batches_equal_the_full_batch() {
    let mut cfg = tiny();
    // Adam's first update is lr * g / (|g| + eps), about lr * sign(g): for gradient
    // components near eps it turns float32 rounding of g (which the summation order
    // changes, ~1e-9 absolute here) into parameter differences of up to 2 lr; measured:
    // 1.3e-5 at eps 1e-8, 1.6e-5 at 1e-4, 2e-6 at 1e-3. A large eps keeps the update
    // close to linear in g, so the parameter comparison measures accumulation, not Adam's
    // conditioning. The gradients themselves are compared directly as well.
    cfg.optim.eps = 1e-3;
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let plan = |micro| StepPlan {
        seed: 5,
        step: 3,
        effective_batch: 8,
        micro_batch: micro,
        seq_len: cfg.data.seq_len,
        lr: 1e-3,
        grad_clip: 1.0,
        inject_oom: false,
    };
    let (model, mut opt) = fresh(&cfg);
    let full = train_step(&model, &mut opt, &data, &plan(8)).unwrap();
    let (ref_params, ref_grads) = (params(&model), grads(&model));
    // 4 + 4, 4 x 2, and an uneven 3 + 3 + 2.
    for micro in [4, 2, 3] {
        let (model, mut opt) = fresh(&cfg);
        let out = train_step(&model, &mut opt, &data, &plan(micro)).unwrap();
        assert!(
            (out.loss - full.loss).abs() < 1e-5 * full.loss,
            "micro {micro}"
        );
        assert!((out.grad_norm - full.grad_norm).abs() < 1e-5 * full.grad_norm);
        let g = max_rel_diff_per_tensor(&grads(&model), &ref_grads);
        assert!(g < 1e-5, "micro {micro}: gradients differ by {g}");
        let p = max_rel_diff(&params(&model), &ref_params);
        assert!(p < 1e-5, "micro {micro}: parameters differ by {p}");
    }
}

#[test]
fn same_seed_same_losses_bitwise() {
    let cfg = tiny();
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let losses = || {
        let (model, mut opt) = fresh(&cfg);
        (1..=3)
            .map(|s| {
                let plan = StepPlan {
                    seed: 1,
                    step: s,
                    effective_batch: 8,
                    micro_batch: 8,
                    seq_len: cfg.data.seq_len,
                    lr: 1e-3,
                    grad_clip: 1.0,
                    inject_oom: false,
                };
                train_step(&model, &mut opt, &data, &plan).unwrap().loss
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(), losses());
}

/// Each token's loss is summed in double precision, so where the chunks are cut does not
/// move the result: measured equal to the last bit for chunks of 1, 2, 3, 5, 7, 8 and 15
/// of 16 windows (a float32 sum per chunk, as before, moved it by up to 5.4e-8 relative,
/// chunks of 15). 1e-12 leaves room for a double sum taken in another order, nothing more.
#[test]
fn validation_does_not_depend_on_the_chunk_size() {
    let cfg = tiny();
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let (model, _) = fresh(&cfg);
    let offsets = data.val_offsets(16);
    let whole = evaluate(&model, &data, &offsets, 16).unwrap();
    assert!(
        (whole - 256f64.ln()).abs() < 0.5,
        "untrained loss near ln 256: {whole}"
    );
    for chunk in [5, 1, 7, 3, 8, 2, 15] {
        let v = evaluate(&model, &data, &offsets, chunk).unwrap();
        assert!(
            (v - whole).abs() <= 1e-12 * whole,
            "chunk {chunk}: {v} vs {whole}"
        );
    }
}

#[test]
fn resumed_run_matches_the_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    let mut cfg = tiny();
    cfg.run.checkpoint_every = 6;
    // Accumulation too, so the resumed path covers it.
    cfg.batch.micro_batch = 3;
    cfg.batch.effective_batch = 8;

    let a = run(opts(cfg.clone(), &a_dir, None));
    let a_summary = a.result.unwrap();
    assert_eq!(a_summary.steps_done, 12);
    assert_eq!(a.losses.len(), 12);

    // Resume from the state after step 6, as an interrupted run would have left it.
    let mid = a_dir.join("step-000006");
    assert_eq!(runner::read_checkpoint_config(&mid).unwrap(), cfg);
    let b = run(opts(cfg.clone(), &b_dir, Some(mid)));
    let b_summary = b.result.unwrap();
    assert_eq!(b_summary.steps_done, 12);
    assert_eq!(b_summary.tokens_seen, a_summary.tokens_seen);
    let Some(Telemetry::RunStarted(info)) = b.events.first() else {
        panic!("first event: {:?}", b.events.first())
    };
    assert_eq!(info.start_step, 6);

    assert_eq!(
        b.losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        (7..=12).collect::<Vec<_>>()
    );
    for ((sa, la), (sb, lb)) in a.losses[6..].iter().zip(&b.losses) {
        assert_eq!(sa, sb);
        // Bitwise equal here; the tolerance only allows for a BLAS whose results depend
        // on buffer alignment (MKL without CNR mode).
        assert!((la - lb).abs() <= 1e-6, "step {sa}: {la} vs {lb}");
    }
    let diff = max_rel_diff(
        &saved_params(&a_dir.join("step-000012")),
        &saved_params(&b_dir.join("step-000012")),
    );
    assert!(diff <= 1e-6, "final parameters differ by {diff}");
}

#[test]
fn training_lowers_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny();
    cfg.run.steps = 40;
    cfg.model.n_layer = 1;
    cfg.optim.warmup_steps = 5;
    let r = run(opts(cfg, dir.path(), None));
    let summary = r.result.unwrap();
    let first = r.losses[0].1;
    let last5: f64 = r.losses[35..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    assert!(last5 < first - 0.5, "loss {first} -> {last5}");
    let val = summary.last_val_loss.unwrap();
    assert!(val < first - 0.5, "val loss {val} vs initial {first}");
}

/// A checkpoint (2 steps) to break in various ways; returns its step directory.
fn make_checkpoint(root: &Path) -> PathBuf {
    let mut cfg = tiny();
    cfg.run.steps = 2;
    run(opts(cfg, root, None)).result.unwrap();
    root.join("step-000002")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn bad_input_is_a_clear_error_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ck = d.join("ck");
    let with_corpus = |corpus: &Path| {
        let mut c = tiny();
        c.data.corpus = corpus.to_string_lossy().into_owned();
        opts(c, &ck, None)
    };

    let err = spawn_err(with_corpus(&d.join("no/such.txt")));
    assert_contains(&err, &["no/such.txt", "does not exist", "--corpus"]);

    std::fs::write(d.join("empty.txt"), "").unwrap();
    assert_contains(
        &spawn_err(with_corpus(&d.join("empty.txt"))),
        &["empty.txt", "is empty"],
    );

    let blob: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(d.join("blob.bin"), blob).unwrap();
    assert_contains(
        &spawn_err(with_corpus(&d.join("blob.bin"))),
        &["looks binary", "NUL"],
    );

    std::fs::write(
        d.join("short.txt"),
        "To be, or not to be: that is the question.",
    )
    .unwrap();
    assert_contains(
        &spawn_err(with_corpus(&d.join("short.txt"))),
        &["too small", "data.seq_len"],
    );

    std::fs::write(d.join("file"), "x").unwrap();
    let err = spawn_err(opts(tiny(), &d.join("file/ck"), None));
    assert_contains(
        &err,
        &["cannot write checkpoints", "file/ck", "--checkpoint-dir"],
    );

    let err = spawn_err(opts(tiny(), &ck, Some(d.join("nowhere"))));
    assert_contains(&err, &["nowhere", "does not exist", "--resume"]);

    let good = make_checkpoint(&d.join("good"));
    let broken = |name: &str| {
        let p = d.join(name);
        copy_dir(&good, &p);
        p
    };

    let p = broken("truncated");
    let model = p.join("model.safetensors");
    let len = std::fs::metadata(&model).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap();
    f.set_len(len / 2).unwrap();
    let err = spawn_err(opts(tiny(), &ck, Some(p)));
    assert_contains(&err, &["model.safetensors", "truncated or corrupt"]);

    let p = broken("badjson");
    std::fs::write(p.join("state.json"), "{\"format_version\": 1, \"step\": ").unwrap();
    let err = spawn_err(opts(tiny(), &ck, Some(p.clone())));
    assert_contains(&err, &["state.json", "corrupt"]);
    let err = runner::read_checkpoint_config(&p).unwrap_err().to_string();
    assert_contains(&err, &["state.json", "corrupt"]);

    let p = broken("newer");
    let state = std::fs::read_to_string(p.join("state.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&state).unwrap();
    json["format_version"] = 2.into();
    json["something_new"] = true.into();
    std::fs::write(p.join("state.json"), json.to_string()).unwrap();
    let err = spawn_err(opts(tiny(), &ck, Some(p)));
    assert_contains(&err, &["newer headroom", "upgrade"]);

    let mut wider = tiny();
    wider.model.n_embd = 64;
    let err = spawn_err(opts(wider, &ck, Some(good.clone())));
    assert_contains(
        &err,
        &["different model", "h.0.attn.c_attn.bias", "[96]", "[192]"],
    );
    let mut deeper = tiny();
    deeper.model.n_layer = 3;
    let err = spawn_err(opts(deeper, &ck, Some(good.clone())));
    assert_contains(&err, &["different model", "h.2."]);

    let p = broken("no_optimizer");
    std::fs::remove_file(p.join("optimizer.safetensors")).unwrap();
    let err = spawn_err(opts(tiny(), &ck, Some(p)));
    assert_contains(&err, &["incomplete", "optimizer.safetensors"]);

    // A run already at its end cannot be resumed without more steps.
    let mut done = tiny();
    done.run.steps = 2;
    let err = spawn_err(opts(done, &ck, Some(good)));
    assert_contains(&err, &["step 2", "--steps"]);
}

#[test]
fn checkpoints_are_atomic_and_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ck");
    let mut cfg = tiny();
    cfg.run.steps = 8;
    cfg.run.checkpoint_every = 2;
    let r = run(opts(cfg, &root, None));
    let summary = r.result.unwrap();
    let saved: Vec<u64> = r
        .events
        .iter()
        .filter_map(|e| match e {
            Telemetry::CheckpointSaved { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(saved, [2, 4, 6, 8]);
    assert_eq!(
        summary.checkpoint.as_deref(),
        Some(root.join("step-000008").to_str().unwrap())
    );

    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".lock", "latest", "step-000006", "step-000008"]);
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap().trim(),
        "step-000008"
    );

    // A crash mid-write leaves a temp directory: loading ignores it.
    let tmp = root.join(".tmp-step-000010");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join("state.json"), "{garbage").unwrap();
    let ck = checkpoint::load(&root).unwrap();
    assert_eq!(
        (ck.state.step, ck.dir.clone()),
        (8, root.join("step-000008"))
    );
    // So does a crash before `latest` was replaced, or a lost `latest`.
    std::fs::remove_file(root.join("latest")).unwrap();
    assert_eq!(checkpoint::load(&root).unwrap().state.step, 8);
    // A step directory works directly too.
    assert_eq!(
        checkpoint::load(&root.join("step-000006"))
            .unwrap()
            .state
            .step,
        6
    );

    // The next save sweeps the stale temp directory.
    let mut more = tiny();
    more.run.steps = 10;
    run(opts(more, &root, Some(root.clone()))).result.unwrap();
    assert!(!tmp.exists());
    assert_eq!(checkpoint::load(&root).unwrap().state.step, 10);
}

/// Resumed from an older step, a run saves a step it saved before: the new one takes its
/// place in one swap (`latest` never names a missing directory) and nothing is left over.
#[test]
fn a_step_saved_twice_is_replaced_whole() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ck");
    let mut cfg = tiny();
    cfg.run.steps = 4;
    cfg.run.checkpoint_every = 2;
    run(opts(cfg, &root, None)).result.unwrap();
    let first = checkpoint::load(&root.join("step-000004")).unwrap().state;
    let mut again = tiny();
    again.run.steps = 4;
    again.run.checkpoint_every = 2;
    again.batch.micro_batch = first.micro_batch.unwrap() / 2;
    again.memory.adaptive = false;
    run(opts(again, &root, Some(root.join("step-000002"))))
        .result
        .unwrap();
    let second = checkpoint::load(&root).unwrap().state;
    assert_eq!(second.step, 4);
    assert_ne!(
        second.micro_batch, first.micro_batch,
        "the new save is in place"
    );
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".lock", "latest", "step-000002", "step-000004"]);
}

#[test]
fn commands_are_answered_with_what_was_applied() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ck");
    let mut cfg = tiny();
    cfg.run.steps = 10_000;
    let (bus, rx) = Bus::new(false);
    let (tx, cmd_rx): (Sender<Command>, _) = bounded(8);
    // Queued before the first step: the trainer must pause before training at all.
    tx.send(Command::Pause).unwrap();
    let handle = runner::spawn(opts(cfg, &root, None), bus, cmd_rx).unwrap();
    assert_eq!(handle.cuda_index(), None);

    assert!(matches!(next_event(&rx.events), Telemetry::RunStarted(_)));
    // The memory limit, thresholds and libtorch's threads, then the run proper.
    let mut next = next_event(&rx.events);
    while let Telemetry::Notice(n) = &next {
        assert!(n.source == "memory" || n.source == "torch", "{n:?}");
        next = next_event(&rx.events);
    }
    match next {
        Telemetry::ThresholdsChanged {
            thresholds,
            profile,
            source,
        } => {
            assert_eq!(thresholds, Thresholds::default());
            assert_eq!(
                (profile, source.as_str()),
                (Some(Profile::Balanced), "config")
            );
        }
        other => panic!("expected ThresholdsChanged, got {other:?}"),
    }
    // The start's plan (its probe's notice and the memory panel's split), then the run.
    let mut next = next_event(&rx.events);
    while matches!(&next, Telemetry::Notice(n) if n.source == "plan")
        || matches!(next, Telemetry::PlanSplit(_))
    {
        next = next_event(&rx.events);
    }
    assert_eq!(next, status(RunStatus::Running));
    assert_eq!(next_event(&rx.events), status(RunStatus::Paused));
    expect_applied(&rx.events, Command::Pause, "paused after step 0");

    tx.send(Command::Pause).unwrap();
    expect_applied(&rx.events, Command::Pause, "already paused");
    tx.send(Command::Checkpoint).unwrap();
    match next_event(&rx.events) {
        Telemetry::CheckpointSaved { step, path } => {
            assert_eq!(step, 0);
            assert!(Path::new(&path).join("state.json").exists());
        }
        other => panic!("expected CheckpointSaved, got {other:?}"),
    }
    expect_applied(&rx.events, Command::Checkpoint, "checkpoint of step 0");
    assert!(rx.metrics.try_recv().is_err(), "no step while paused");

    tx.send(Command::Resume).unwrap();
    assert_eq!(next_event(&rx.events), status(RunStatus::Running));
    expect_applied(&rx.events, Command::Resume, "resumed at step 1");
    let mut first = rx
        .metrics
        .recv_timeout(Duration::from_secs(30))
        .unwrap()
        .msg;
    // The step's plan check and memory come just before its metrics.
    while let Telemetry::StepMemory(_) | Telemetry::PlanCheck(_) = &first {
        match &first {
            Telemetry::StepMemory(m) => assert_eq!(m.step, 1),
            Telemetry::PlanCheck(c) => assert_eq!(c.step, 1),
            _ => unreachable!(),
        }
        first = rx
            .metrics
            .recv_timeout(Duration::from_secs(30))
            .unwrap()
            .msg;
    }
    assert!(
        matches!(first, Telemetry::Step(ref s) if s.step == 1),
        "{first:?}"
    );

    // After its first step the run says what its fixed memory is made of.
    let parts = next_event(&rx.events);
    assert!(matches!(parts, Telemetry::MemoryParts(_)), "{parts:?}");
    tx.send(Command::Checkpoint).unwrap();
    let saved_step = match next_event(&rx.events) {
        Telemetry::CheckpointSaved { step, .. } => step,
        other => panic!("expected CheckpointSaved, got {other:?}"),
    };
    assert!(saved_step >= 1);
    expect_applied(&rx.events, Command::Checkpoint, "checkpoint of step");

    tx.send(Command::Resume).unwrap();
    expect_applied(&rx.events, Command::Resume, "already running");
    tx.send(Command::Stop).unwrap();
    let summary = handle.join().unwrap();
    assert!(summary.stopped_by_user);
    assert!(summary.steps_done >= saved_step && summary.steps_done < 10_000);

    // A stop is prompt: one that lands mid-step gives the step up at its next
    // micro-batch (said in a notice, which may come before the stop's own answer); one
    // that lands between steps stops after the step. Either way it is answered.
    let rest: Vec<Telemetry> = rx.events.try_iter().map(|r| r.msg).collect();
    let kinds: Vec<&str> = rest.iter().map(|e| e.kind()).collect();
    assert!(rest.contains(&status(RunStatus::Stopping)), "{kinds:?}");
    assert!(
        rest.iter().any(|e| matches!(
            e,
            Telemetry::CommandApplied { command: Command::Stop, applied } if applied.contains("stop")
        )),
        "the stop was not answered: {rest:?}"
    );
    assert_eq!(kinds.last(), Some(&"finished"), "{kinds:?}");
    assert!(rest.contains(&status(RunStatus::Finished)));
    let Some(Telemetry::Finished(f)) = rest.last() else {
        unreachable!()
    };
    assert_eq!(f, &summary);
    let ck = checkpoint::load(&root).unwrap();
    assert_eq!(ck.state.step, summary.steps_done);
}

#[test]
fn a_closed_command_channel_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny();
    cfg.run.steps = 10_000;
    let (bus, rx) = Bus::new(false);
    let (tx, cmd_rx) = bounded::<Command>(1);
    drop(tx);
    let handle = runner::spawn(opts(cfg, dir.path(), None), bus, cmd_rx).unwrap();
    let r = collect(handle.join(), &rx);
    let summary = r.result.unwrap();
    assert!(summary.stopped_by_user);
    assert_eq!(summary.steps_done, 0);
    assert!(r.events.contains(&status(RunStatus::Stopping)));
}

#[test]
fn schedule_is_part_of_the_run() {
    // The runner's learning rates are the schedule's, step by step.
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny();
    let sched = Schedule::new(&cfg.optim, cfg.run.steps);
    let (bus, rx) = Bus::new(false);
    let (_tx, cmd_rx) = bounded::<Command>(1);
    let handle = runner::spawn(opts(cfg, dir.path(), None), bus, cmd_rx).unwrap();
    handle.join().unwrap();
    for m in rx.metrics.try_iter() {
        if let Telemetry::Step(s) = m.msg {
            assert_eq!(s.lr, Some(sched.lr_at(s.step)));
            assert!(s.tokens_per_s > 0.0 && s.grad_norm.is_some_and(|g| g > 0.0));
        }
    }
}

/// Throughput and quality of configs/default.toml on this machine (not part of the suite:
/// minutes on 2 cores). `cargo test --release -p headroom-trainer --test training --
/// --ignored --nocapture default_config`; HEADROOM_BENCH_STEPS overrides the step count.
#[test]
#[ignore]
fn default_config_benchmark() {
    let dir = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/default.toml");
    let mut cfg = RunConfig::load(&path).unwrap();
    if let Ok(steps) = std::env::var("HEADROOM_BENCH_STEPS") {
        cfg.run.steps = steps.parse().unwrap();
    }
    let started = std::time::Instant::now();
    let (bus, rx) = Bus::new(false);
    let (_tx, cmd_rx) = bounded::<Command>(1);
    let handle = runner::spawn(opts(cfg.clone(), dir.path(), None), bus, cmd_rx).unwrap();
    let mut times = Vec::new();
    loop {
        crossbeam_channel::select! {
            recv(rx.metrics) -> m => if let Ok(Telemetry::Step(s)) = m.map(|r| r.msg) {
                times.push(s.step_time_s);
                if s.step % 25 == 0 {
                    eprintln!("step {:4} loss {:.4} lr {:.2e} gnorm {:.3} {:.0} tok/s",
                        s.step, s.loss, s.lr.unwrap_or(0.0), s.grad_norm.unwrap_or(0.0), s.tokens_per_s);
                }
            },
            recv(rx.events) -> e => match e.map(|r| r.msg) {
                Ok(Telemetry::Eval(ev)) => eprintln!("eval step {} val {:.4} train {:.4}",
                    ev.step, ev.val_loss, ev.train_loss),
                Ok(Telemetry::Finished(_)) | Err(_) => break,
                _ => {}
            },
        }
    }
    let summary = handle.join().unwrap();
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    eprintln!(
        "{} steps in {:.1} s wall; {:.2} steps/s by step time; final val loss {:?}",
        summary.steps_done,
        started.elapsed().as_secs_f64(),
        1.0 / mean,
        summary.last_val_loss
    );
}

/// The room a fresh run asks the disk for is what its checkpoint then takes: the estimate
/// (parameters, moments, headers and state.json from the model's tensors) is above the
/// real size and within 10% of it, for the test model and a wider, deeper one.
#[test]
fn a_fresh_runs_checkpoint_size_estimate_is_its_real_size_within_ten_percent() {
    for (layers, width) in [(2, 32), (4, 128)] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = common::tiny();
        cfg.run.steps = 1;
        cfg.model.n_layer = layers;
        cfg.model.n_embd = width;
        let run = common::run(common::opts(cfg.clone(), dir.path(), None));
        run.result.as_ref().unwrap();
        let saved = headroom_trainer::checkpoint::latest_step_dir(dir.path()).unwrap();
        let real = headroom_trainer::checkpoint::size_on_disk(&saved);
        let (model, _) = common::fresh(&cfg);
        let estimate = headroom_trainer::checkpoint::estimated_size(&model.fingerprint());
        let ratio = estimate as f64 / real as f64;
        eprintln!("{layers}×{width}: estimate {estimate}, real {real} ({ratio:.3})");
        assert!((1.0..1.10).contains(&ratio), "{layers}×{width}: {ratio:.3}");
    }
}

/// The built-in run says what its fixed memory is made of, as a Python run does (one
/// `memory_parts` record, counted from the tensors after the first step): fp32 weights,
/// gradients of the same size, AdamW's two moments.
#[test]
fn a_run_says_its_fixed_memory_parts_once_after_its_first_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::tiny();
    cfg.run.steps = 3;
    let run = common::run(common::opts(cfg.clone(), dir.path(), None));
    run.result.as_ref().unwrap();
    let parts: Vec<_> = run
        .events
        .iter()
        .filter_map(|e| match e {
            headroom_core::Telemetry::MemoryParts(p) => Some(*p),
            _ => None,
        })
        .collect();
    assert_eq!(parts.len(), 1, "{parts:?}");
    let (model, _) = common::fresh(&cfg);
    let weights = 4 * model.num_parameters();
    assert_eq!(parts[0].parameters, weights);
    assert_eq!(parts[0].gradients, weights);
    assert_eq!(parts[0].optimizer, 2 * weights);
}
