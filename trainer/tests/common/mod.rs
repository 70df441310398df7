//! Helpers shared by the trainer's integration tests: tiny configs, runs to the end,
//! parameter comparisons.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver};
use headroom_core::{
    Bus, BusReceivers, Command, Record, RunConfig, RunStatus, RunSummary, Telemetry,
};
use headroom_trainer::model::Gpt;
use headroom_trainer::optim::{AdamW, AdamWConfig};
use headroom_trainer::runner::{self, TrainOptions};
use tch::{Device, Tensor};

pub fn tiny() -> RunConfig {
    let mut c = RunConfig::default();
    c.run.name = "test".into();
    c.run.device = "cpu".into();
    c.run.steps = 12;
    c.run.eval_every = 0;
    c.run.checkpoint_every = 0;
    c.run.eval_batches = 2;
    c.data.seq_len = 32;
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 32;
    c.batch.micro_batch = 8;
    c.batch.effective_batch = 0;
    c.memory.memory_budget = String::new();
    c.optim.warmup_steps = 4;
    c
}

pub fn opts(config: RunConfig, dir: &Path, resume: Option<PathBuf>) -> TrainOptions {
    TrainOptions {
        resume,
        ..TrainOptions::new(config, dir.to_path_buf())
    }
}

pub struct Run {
    pub result: Result<RunSummary, String>,
    pub events: Vec<Telemetry>,
    pub losses: Vec<(u64, f64)>,
}

/// Runs to the end with the command channel held open and untouched.
pub fn run(o: TrainOptions) -> Run {
    let (bus, rx) = Bus::new(false);
    let (_tx, cmd_rx) = bounded::<Command>(8);
    let handle = runner::spawn(o, bus, cmd_rx).unwrap_or_else(|e| panic!("spawn: {e}"));
    let result = handle.join();
    collect(result, &rx)
}

pub fn collect(result: Result<RunSummary, String>, rx: &BusReceivers) -> Run {
    let events: Vec<Telemetry> = rx.events.try_iter().map(|r| r.msg).collect();
    let losses = rx
        .metrics
        .try_iter()
        .filter_map(|m| match m.msg {
            Telemetry::Step(s) => Some((s.step, s.loss)),
            _ => None,
        })
        .collect();
    Run {
        result,
        events,
        losses,
    }
}

pub fn spawn_err(o: TrainOptions) -> String {
    let (bus, _rx) = Bus::new(false);
    let (_tx, cmd_rx) = bounded::<Command>(8);
    match runner::spawn(o, bus, cmd_rx) {
        Ok(h) => panic!("expected an error, the run started: {:?}", h.join()),
        Err(e) => e.to_string(),
    }
}

pub fn assert_contains(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "expected {n:?} in: {text}");
    }
}

pub fn params(model: &Gpt) -> Vec<(String, Vec<f32>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
        .collect()
}

pub fn saved_params(step_dir: &Path) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> =
        Tensor::read_safetensors(step_dir.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
            .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Largest |a - b| / max(|a|, |b|, 1e-3) over all parameters.
pub fn max_rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            let (x, y) = (f64::from(*x), f64::from(*y));
            worst = worst.max((x - y).abs() / x.abs().max(y.abs()).max(1e-3));
        }
    }
    worst
}

pub fn fresh(cfg: &RunConfig) -> (Gpt, AdamW) {
    let model = Gpt::new(&cfg.model, cfg.data.seq_len, Device::Cpu, cfg.run.seed).unwrap();
    let opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim)).unwrap();
    (model, opt)
}

pub fn grads(model: &Gpt) -> Vec<(String, Vec<f32>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.grad().flatten(0, -1)).unwrap()))
        .collect()
}

/// Largest |a - b| within a tensor relative to that tensor's largest |a|: the error that
/// summation order explains.
pub fn max_rel_diff_per_tensor(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    let mut worst = 0.0f64;
    for ((na, va), (_, vb)) in a.iter().zip(b) {
        let scale = va.iter().fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
        let diff = va
            .iter()
            .zip(vb)
            .fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs())));
        if scale > 0.0 {
            worst = worst.max(diff / scale);
        } else {
            assert_eq!(diff, 0.0, "{na}");
        }
    }
    worst
}

pub fn next_event(rx: &Receiver<Record>) -> Telemetry {
    rx.recv_timeout(Duration::from_secs(30))
        .expect("the trainer answers within 30 s")
        .msg
}

pub fn status(s: RunStatus) -> Telemetry {
    Telemetry::Status { status: s }
}

pub fn expect_applied(rx: &Receiver<Record>, cmd: Command, needle: &str) {
    match next_event(rx) {
        Telemetry::CommandApplied { command, applied } => {
            assert_eq!(command, cmd);
            assert!(applied.contains(needle), "{applied}");
        }
        other => panic!("expected CommandApplied({cmd:?}), got {other:?}"),
    }
}
