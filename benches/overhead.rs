//! headroom's overhead: training throughput of `headroom train --headless` (telemetry,
//! sampler, log writer and control loop all on) against a bare tch loop over the same
//! model, data, batch and steps, side by side in one process, alternating.
//!
//!     ./dev cargo bench --bench overhead            # 3 rounds of 200 steps
//!     ./dev cargo bench --bench overhead -- 5 300   # rounds, steps
//!     ./dev cargo bench --bench overhead -- 3 100 configs/gpu.toml   # on its device
//!
//! On a machine without a toolchain, run the built bench binary with `HEADROOM_BIN`
//! pointing at the `headroom` binary (the compiled-in path is the build machine's).
//!
//! Both sides are timed from the end of step 1 to the end of the last step, so start-up,
//! the final validation and the final checkpoint are outside both measurements. The bare
//! loop calls the same `train_step` the runner does: the difference is what headroom adds
//! around it.
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use headroom_core::config::DeviceChoice;
use headroom_core::RunConfig;
use headroom_trainer::data::Dataset;
use headroom_trainer::model::Gpt;
use headroom_trainer::optim::{AdamW, AdamWConfig};
use headroom_trainer::schedule::Schedule;
use headroom_trainer::step::{train_step, StepPlan};

fn config(steps: u64, path: Option<&str>) -> RunConfig {
    let mut c = match path {
        Some(p) => RunConfig::load(Path::new(p)).unwrap_or_else(|e| panic!("{e}")),
        None => RunConfig::default(),
    };
    c.run.steps = steps;
    c.run.eval_every = 0;
    c.run.checkpoint_every = 0;
    c.run.eval_batches = 1;
    // The control loop runs (peak measurement, model, forecast) but may not grow past the
    // bare loop's micro-batch: a different split would be different work, not overhead.
    c.memory.max_micro_batch = c.batch.micro_batch;
    c
}

/// Seconds from the end of step 1 to the end of step `steps`, bare.
fn bare(cfg: &RunConfig, device: tch::Device) -> f64 {
    let data = Dataset::load(&cfg.data.corpus, cfg.data.val_fraction, cfg.data.seq_len).unwrap();
    let model = Gpt::new(&cfg.model, cfg.data.seq_len, device, cfg.run.seed).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim)).unwrap();
    let schedule = Schedule::new(&cfg.optim, cfg.run.steps);
    let mut t1 = None;
    for step in 1..=cfg.run.steps {
        let plan = StepPlan {
            seed: cfg.run.seed,
            step,
            effective_batch: cfg.batch.effective(),
            micro_batch: cfg.batch.micro_batch,
            seq_len: cfg.data.seq_len,
            lr: schedule.lr_at(step),
            grad_clip: cfg.optim.grad_clip,
            inject_oom: false,
        };
        let out = train_step(&model, &mut opt, &data, &plan).unwrap();
        assert!(out.loss.is_finite());
        if step == 1 {
            t1 = Some(Instant::now());
        }
    }
    t1.unwrap().elapsed().as_secs_f64()
}

/// The same span measured by headroom's own log (`t` of step records).
fn headroom(cfg: &RunConfig, dir: &Path) -> f64 {
    let cfg_path = dir.join("bench.toml");
    std::fs::write(&cfg_path, cfg.to_toml()).unwrap();
    let log = dir.join("run.jsonl");
    let bin =
        std::env::var_os("HEADROOM_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_headroom").into());
    let out = Command::new(bin)
        .current_dir(dir)
        .args(["train", "--headless", "--config"])
        .arg(&cfg_path)
        .arg("--log")
        .arg(&log)
        // Each round replaces the previous round's checkpoints.
        .arg("--overwrite")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<f64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "step")
        .map(|r| r["t"].as_f64().unwrap())
        .collect();
    assert_eq!(steps.len() as u64, cfg.run.steps);
    steps[steps.len() - 1] - steps[0]
}

fn main() {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<u64> = raw.iter().filter_map(|a| a.parse().ok()).collect();
    let path = raw
        .iter()
        .find(|a| a.ends_with(".toml"))
        .map(String::as_str);
    let rounds = args.first().copied().unwrap_or(3);
    let steps = args.get(1).copied().unwrap_or(200);
    let cfg = config(steps, path);
    let device = match cfg.device().unwrap() {
        DeviceChoice::Cuda(n) => tch::Device::Cuda(n),
        DeviceChoice::Auto if tch::Cuda::is_available() => tch::Device::Cuda(0),
        _ => tch::Device::Cpu,
    };
    let dir = tempfile::tempdir().unwrap();
    println!(
        "{} model, micro-batch {} x {} tokens, {steps} steps, {rounds} rounds, {device:?}",
        path.unwrap_or("default"),
        cfg.batch.micro_batch,
        cfg.data.seq_len
    );
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        let b = bare(&cfg, device);
        let h = headroom(&cfg, dir.path());
        let ratio = h / b;
        println!(
            "round {round}: bare {:.3} s ({:.2} steps/s)  headroom {:.3} s ({:.2} steps/s)  headroom/bare {:.4}",
            b,
            (steps - 1) as f64 / b,
            h,
            (steps - 1) as f64 / h,
            ratio
        );
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median headroom/bare time ratio: {:.4} ({:+.2}% )",
        ratios[ratios.len() / 2],
        (ratios[ratios.len() / 2] - 1.0) * 100.0
    );
}
