//! Activation checkpointing lowers a step's measured peak: the trainer's own meter (the
//! process's peak resident set since a reset), so this file holds one test and runs in a
//! process of its own, where no other test's tensors share the figure.
use headroom_core::{Checkpointing, RunConfig};
use headroom_host::procmem;
use headroom_trainer::data::Dataset;
use headroom_trainer::oom;
use headroom_trainer::peak::PeakMeter;
use headroom_trainer::step::{train_step, StepPlan};
use tch::Device;

mod common;
use common::*;

/// Bytes one step of `cfg` adds to the resident set at its peak, over what the process
/// held just before it (the heap trimmed first, so earlier steps' pages do not hide it).
fn step_growth(cfg: &RunConfig, data: &Dataset, meter: &PeakMeter) -> u64 {
    let (model, mut opt) = fresh(cfg);
    let plan = StepPlan {
        seed: 1,
        step: 1,
        effective_batch: 32,
        micro_batch: 32,
        seq_len: cfg.data.seq_len,
        lr: 1e-3,
        grad_clip: 1.0,
        inject_oom: false,
    };
    // A first step allocates the gradients: the measured one then holds only activations.
    train_step(&model, &mut opt, data, &plan).unwrap();
    oom::free_cached(Device::Cpu).unwrap();
    let before = procmem::rss_bytes().unwrap();
    meter.reset().unwrap();
    train_step(&model, &mut opt, data, &StepPlan { step: 2, ..plan }).unwrap();
    meter.peak().unwrap().saturating_sub(before)
}

/// 6 blocks of width 64 on 32 × 128 tokens: about 18 MiB of activations per block, so
/// keeping every block's costs about 90 MiB more than keeping one at a time. The
/// checkpointed step must grow the resident set by at most 60% of the plain one's
/// (measured on the 2-core dev machine: 40–45%, +53 to +64 MiB against +132 to +143;
/// the printed figures say). The heap is trimmed before each measured step, so the
/// checkpointed one does not run on pages the plain one left.
#[test]
fn checkpointing_lowers_the_measured_step_peak() {
    // One thread: a pool sized by the machine's cores adds its own buffers to the peaks.
    tch::set_num_threads(1);
    let mut plain = tiny();
    plain.data.seq_len = 128;
    plain.model.n_layer = 6;
    plain.model.n_embd = 64;
    let mut ck = plain.clone();
    ck.model.checkpoint = Checkpointing::Blocks;
    let data = Dataset::load("", 0.1, plain.data.seq_len).unwrap();
    let meter = PeakMeter::new(Device::Cpu, None).unwrap();
    assert!(meter.is_exact(), "this kernel refuses the peak reset");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for round in 0..1 {
        let a = step_growth(&plain, &data, &meter);
        let b = step_growth(&ck, &data, &meter);
        eprintln!(
            "round {round}: plain step +{:.1} MiB, checkpointed +{:.1} MiB ({:.0}%)",
            mib(a),
            mib(b),
            100.0 * b as f64 / a as f64
        );
        assert!(a > 40 << 20, "the plain step grew only {:.1} MiB", mib(a));
        assert!(
            (b as f64) < 0.6 * a as f64,
            "checkpointed +{:.1} MiB against plain +{:.1} MiB",
            mib(b),
            mib(a)
        );
    }
}
