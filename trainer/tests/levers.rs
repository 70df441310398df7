//! The two memory levers of the built-in model on the CPU: bf16 compute trains like fp32,
//! and activation checkpointing gives the plain gradients.
use headroom_core::policy::Decision;
use headroom_core::{Checkpointing, Precision, RunConfig};
use headroom_trainer::data::Dataset;
use headroom_trainer::step::{train_step, StepPlan};
use tch::Kind;

mod common;
use common::*;

fn plan(cfg: &RunConfig, step: u64) -> StepPlan {
    StepPlan {
        seed: cfg.run.seed,
        step,
        effective_batch: 8,
        micro_batch: 4,
        seq_len: cfg.data.seq_len,
        lr: 3e-3,
        grad_clip: 1.0,
        inject_oom: false,
    }
}

/// Losses of `steps` steps of `cfg` from its seed.
fn losses(cfg: &RunConfig, data: &Dataset, steps: u64) -> Vec<f64> {
    let (model, mut opt) = fresh(cfg);
    (1..=steps)
        .map(|s| {
            train_step(&model, &mut opt, data, &plan(cfg, s))
                .unwrap()
                .loss
        })
        .collect()
}

/// bf16 must train: over 25 steps the loss falls from ln(256) ≈ 5.55 as fp32's does, and
/// the mean of the last 5 losses is within 3% of fp32's (measured: under 0.01% after 25 steps,
/// 0.03% after 40; the margin is for other BLAS builds). It must also differ from fp32,
/// or the lever did nothing.
#[test]
fn bf16_trains_within_three_percent_of_fp32() {
    let cfg = tiny();
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let fp32 = losses(&cfg, &data, 25);
    let mut bf = cfg.clone();
    bf.model.precision = Precision::Bf16;
    let bf16 = losses(&bf, &data, 25);
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    let (a, b) = (tail(&fp32), tail(&bf16));
    assert!(a < 0.75 * fp32[0], "fp32 did not train: {fp32:?}");
    assert!(b < 0.75 * bf16[0], "bf16 did not train: {bf16:?}");
    let rel = (a - b).abs() / a;
    eprintln!("last-5 mean loss: fp32 {a:.4}, bf16 {b:.4} ({rel:.4} apart)");
    assert!(rel < 0.03, "bf16 {b:.4} vs fp32 {a:.4}: {rel:.4} apart");
    assert_ne!(fp32, bf16, "bf16 computed exactly what fp32 did");
}

/// Under bf16 the parameters, their gradients and the AdamW moments stay float32.
#[test]
fn bf16_keeps_float32_master_weights_and_moments() {
    let mut cfg = tiny();
    cfg.model.precision = Precision::Bf16;
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let (model, mut opt) = fresh(&cfg);
    train_step(&model, &mut opt, &data, &plan(&cfg, 1)).unwrap();
    for (name, p) in model.named_parameters() {
        assert_eq!(p.kind(), Kind::Float, "{name}");
        assert_eq!(p.grad().kind(), Kind::Float, "{name}'s gradient");
    }
    for (name, t) in opt.state_tensors() {
        if name != "step" {
            assert_eq!(t.kind(), Kind::Float, "{name}");
        }
    }
    let idx = tch::Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]);
    assert_eq!(model.forward(&idx).unwrap().kind(), Kind::BFloat16);
}

/// One step's gradients with each checkpointing mode against the plain ones. Recomputing
/// runs the same kernels on the same inputs; only the order in which a shared weight's
/// gradients are summed (the tied embedding gets the head's first) may differ, so the
/// gradients agree to float32 rounding: within 1e-5 of each tensor's largest entry
/// (measured: 0 to 2e-7). Under bf16 the recomputed blocks run the same bf16 kernels, so
/// the same bound holds there.
#[test]
fn checkpointed_gradients_equal_the_plain_ones() {
    let mut base = tiny();
    base.model.n_layer = 3;
    let data = Dataset::load("", 0.1, base.data.seq_len).unwrap();
    for precision in [Precision::Fp32, Precision::Bf16] {
        base.model.precision = precision;
        let step_grads = |cfg: &RunConfig| {
            let (model, mut opt) = fresh(cfg);
            let out = train_step(&model, &mut opt, &data, &plan(cfg, 2)).unwrap();
            // Clipping scales the gradients in place by a factor of the norm: compare
            // the unclipped ones through the norm and the clipped ones directly.
            (out, grads(&model), params(&model))
        };
        let (plain, plain_grads, plain_params) = step_grads(&base);
        for mode in [
            Checkpointing::Blocks,
            Checkpointing::Every(2),
            Checkpointing::Every(5),
        ] {
            let mut cfg = base.clone();
            cfg.model.checkpoint = mode;
            let (out, g, p) = step_grads(&cfg);
            let what = format!("{precision} {mode}");
            assert!(
                (out.loss - plain.loss).abs() <= 1e-6 * plain.loss,
                "{what}: loss {} vs {}",
                out.loss,
                plain.loss
            );
            assert!(
                (out.grad_norm - plain.grad_norm).abs() <= 1e-5 * plain.grad_norm,
                "{what}: norm {} vs {}",
                out.grad_norm,
                plain.grad_norm
            );
            let d = max_rel_diff_per_tensor(&g, &plain_grads);
            eprintln!("{what}: gradients differ by {d:e}");
            assert!(d < 1e-5, "{what}: gradients differ by {d}");
            let d = max_rel_diff(&p, &plain_params);
            assert!(
                d < 1e-4,
                "{what}: parameters after the update differ by {d}"
            );
        }
    }
}

/// A checkpoint of an fp32 run resumes in bf16 with checkpointing: it loads (float32
/// weights and moments either way), the run goes on, and the change is said.
#[test]
fn a_resume_with_other_levers_trains_on_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny();
    cfg.run.steps = 3;
    let first = run(opts(cfg.clone(), &dir.path().join("a"), None));
    first.result.unwrap();
    cfg.run.steps = 5;
    cfg.model.precision = Precision::Bf16;
    cfg.model.checkpoint = Checkpointing::Blocks;
    let resumed = run(opts(
        cfg,
        &dir.path().join("b"),
        Some(dir.path().join("a/step-000003")),
    ));
    assert_eq!(resumed.result.unwrap().steps_done, 5);
    let said: Vec<String> = resumed
        .events
        .iter()
        .filter_map(|e| match e {
            headroom_core::Telemetry::Notice(n) => Some(n.text.clone()),
            _ => None,
        })
        .collect();
    let said = said.join("\n");
    assert_contains(
        &said,
        &[
            "resuming in bf16 a run trained in fp32 up to step 3",
            "activation checkpointing is blocks (it was none",
        ],
    );
}

/// Both levers switched from the dashboard between steps: each command is confirmed with
/// the step it takes effect at, the first step after the switch is a lever decision with its peak against
/// the last one's before it, and the run's checkpoint records the new settings.
#[test]
fn levers_switch_live_at_a_step_boundary() {
    use crossbeam_channel::bounded;
    use headroom_core::{Bus, Command, Telemetry};
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny();
    cfg.run.steps = 10_000;
    cfg.memory.adaptive = false;
    let (bus, rx) = Bus::new(false);
    let (tx, cmd_rx) = bounded(16);
    let handle = headroom_trainer::runner::spawn(opts(cfg, dir.path(), None), bus, cmd_rx).unwrap();
    let next = || rx.events.recv_timeout(Duration::from_secs(30)).unwrap().msg;
    // Paused once a step has run and been measured.
    loop {
        if let Ok(m) = rx.metrics.recv_timeout(Duration::from_secs(30)) {
            if matches!(m.msg, Telemetry::StepMemory(_)) {
                break;
            }
        }
    }
    tx.send(Command::Pause).unwrap();
    let mut applied = Vec::new();
    let commands = [
        Command::SetPrecision {
            precision: Precision::Bf16,
        },
        Command::SetCheckpointing {
            checkpoint: Checkpointing::Blocks,
        },
        Command::SetCheckpointing {
            checkpoint: Checkpointing::Blocks,
        },
    ];
    for c in &commands {
        tx.send(c.clone()).unwrap();
    }
    while applied.len() < 4 {
        if let Telemetry::CommandApplied { applied: a, .. } = next() {
            applied.push(a);
        }
    }
    let step = applied[0]
        .strip_prefix("paused after step ")
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{applied:?}"));
    assert_eq!(
        applied[1..],
        [
            format!("precision fp32 → bf16 from step {}", step + 1),
            format!(
                "activation checkpointing none → blocks from step {}",
                step + 1
            ),
            "activation checkpointing is already blocks".to_string(),
        ]
    );
    tx.send(Command::Resume).unwrap();
    // The switch is a controller decision about the first step with it, once measured.
    let (about, decision) = loop {
        if let Telemetry::Decision { step, decision } = next() {
            if matches!(decision, Decision::Lever { .. }) {
                break (step, decision);
            }
        }
    };
    assert_eq!(about, step + 1);
    let Decision::Lever {
        change,
        source,
        before,
        after,
        freed_bytes,
    } = decision
    else {
        unreachable!()
    };
    assert_eq!(
        (change.as_str(), source.as_str()),
        (
            "precision fp32 → bf16, activation checkpointing none → blocks",
            "command"
        )
    );
    let before = before.expect("a step ran before the switch");
    assert_eq!((before.step, after.step), (step, step + 1));
    assert_eq!((after.micro_batch, after.seq_len), (8, 32));
    assert!(after.peak_bytes > 0);
    assert_eq!(
        freed_bytes,
        Some(before.peak_bytes as i64 - after.peak_bytes as i64)
    );
    tx.send(Command::Stop).unwrap();
    let summary = handle.join().unwrap();
    let saved = headroom_trainer::runner::read_checkpoint_config(std::path::Path::new(
        &summary.checkpoint.unwrap(),
    ))
    .unwrap();
    assert_eq!(
        (saved.model.precision, saved.model.checkpoint),
        (Precision::Bf16, Checkpointing::Blocks)
    );
}
