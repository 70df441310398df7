//! The planner against a real step: the plan a probe makes (two forward/backward passes
//! at small sizes) predicts the peak of a full training step (forward, backward,
//! clipping, AdamW update) at a larger micro-batch, measured the same way a run measures
//! it. One test function: the CPU peak is the process's resident set, which a test
//! running beside it would disturb.
use headroom_core::plan::Plan;
use headroom_core::RunConfig;
use headroom_trainer::data::Dataset;
use headroom_trainer::model::Gpt;
use headroom_trainer::optim::{AdamW, AdamWConfig};
use headroom_trainer::peak::PeakMeter;
use headroom_trainer::plan_probe;
use headroom_trainer::step::{train_step, StepPlan};
use tch::Device;

/// (plan, predicted, measured) for `cfg` probed at `sizes`, checked at `check`.
fn plan_and_step(cfg: &RunConfig, sizes: [usize; 2], check: usize) -> (Plan, u64, u64) {
    let data = Dataset::load("", 0.1, cfg.data.seq_len).unwrap();
    let model = Gpt::new(&cfg.model, cfg.data.seq_len, Device::Cpu, 1).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim)).unwrap();
    let meter = PeakMeter::new(Device::Cpu, Some(64 << 30)).unwrap();
    let probe = plan_probe::probe(
        &model,
        &mut opt,
        &data,
        &meter,
        sizes,
        cfg.data.seq_len,
        1,
        Some(1e-4),
    )
    .unwrap();
    let plan = Plan::from_probe(plan_probe::shape(cfg), probe, 64 << 30, 0.9).unwrap();
    let predicted = plan.predict(plan_probe::lever(cfg), check, cfg.data.seq_len);
    // The step a run takes at this micro-batch (the probe allocated the gradients, as a
    // run's earlier steps would have), measured as the run measures it.
    let mut measured = 0;
    for step in 1..=1 {
        let sp = StepPlan {
            seed: 1,
            step,
            effective_batch: check,
            micro_batch: check,
            seq_len: cfg.data.seq_len,
            lr: 1e-4,
            grad_clip: 1.0,
            inject_oom: false,
        };
        // As a run does before a step smaller than the one before it.
        let _ = headroom_trainer::oom::free_cached(Device::Cpu);
        meter.reset().unwrap();
        train_step(&model, &mut opt, &data, &sp).unwrap();
        measured = meter.peak().unwrap();
    }
    (plan, predicted, measured)
}

fn error(predicted: u64, measured: u64) -> f64 {
    (predicted as f64 - measured as f64) / measured as f64
}

#[test]
fn the_plan_predicts_a_real_steps_peak() {
    let t0 = std::time::Instant::now();
    tch::set_num_threads(1);
    // configs/default.toml's model, at a length where activations dominate the step
    // (the process's own ~370 MiB would otherwise hide any error in them).
    let mut cfg = RunConfig::default();
    cfg.data.seq_len = 256;
    let (plan, predicted, measured) = plan_and_step(&cfg, [4, 8], 24);
    let fixed = plan.fixed(plan_probe::lever(&cfg));
    let (act_p, act_m) = (predicted - fixed, measured.saturating_sub(fixed));
    eprintln!(
        "default model, 24 × 256 tokens: predicted {predicted} B, measured {measured} B \
         ({:+.1}%); activations {act_p} B vs {act_m} B ({:+.1}%); calibration {:.2}",
        100.0 * error(predicted, measured),
        100.0 * error(act_p, act_m),
        plan.calibration
    );
    assert!(
        act_m > fixed / 2,
        "activations must weigh: {act_m} on {fixed}"
    );
    assert!(
        error(predicted, measured).abs() < 0.10,
        "step peak: predicted {predicted}, measured {measured}"
    );
    assert!(
        error(act_p, act_m).abs() < 0.25,
        "activations: predicted {act_p}, measured {act_m}"
    );

    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
    // configs/gpu.toml's shape (12 × 768, 12 heads) on the CPU, 16 tokens: there the
    // AdamW update of 85 M parameters is the step's peak, not the activations.
    let mut gpu = RunConfig::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/gpu.toml"
    )))
    .unwrap();
    gpu.data.seq_len = 16;
    let (plan, predicted, measured) = plan_and_step(&gpu, [2, 4], 8);
    eprintln!(
        "gpu preset shape, 8 × 16 tokens: predicted {predicted} B, measured {measured} B \
         ({:+.1}%); update {} B measured",
        100.0 * error(predicted, measured),
        plan.update_bytes()
    );
    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(
        error(predicted, measured).abs() < 0.10,
        "step peak: predicted {predicted}, measured {measured}"
    );
}
