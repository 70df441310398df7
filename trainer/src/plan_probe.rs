//! The planner's measurement: forward and backward of the model at two micro-batch sizes,
//! each peak measured as a run measures a step ([`PeakMeter`]), and the bytes the
//! model's own tensors hold. The arithmetic is `headroom_core::plan`.
//!
//! No optimizer update: the probe can then run on a run's own model before its first
//! step and leave training untouched (the gradients are zeroed after it, the parameters,
//! the moments and the data order never change). The update's own transient does not
//! grow with the batch; where activations dominate the step, it is below their peak.
use headroom_core::plan::{Lever, Plan, Probe, Shape};
use headroom_core::{Bus, RunConfig};
use headroom_host::procmem;
use tch::{Device, TchError, Tensor};

use crate::data::{Dataset, VOCAB_SIZE};
use crate::device;
use crate::model::Gpt;
use crate::optim::{AdamW, AdamWConfig};
use crate::peak::PeakMeter;

/// The model's shapes for the planner.
pub fn shape(cfg: &RunConfig) -> Shape {
    Shape {
        n_layer: cfg.model.n_layer,
        n_head: cfg.model.n_head,
        n_embd: cfg.model.n_embd,
        vocab: VOCAB_SIZE as usize,
        seq_len: cfg.data.seq_len,
        tie_weights: cfg.model.tie_weights,
    }
}

/// The run's configured precision × checkpointing.
pub fn lever(cfg: &RunConfig) -> Lever {
    Lever {
        precision: cfg.model.precision,
        checkpoint: cfg.model.checkpoint,
    }
}

/// The two sizes a probe measures for a run starting at `micro_batch`: half of it and
/// all of it (1 and 2 from 1).
pub fn sizes_for(micro_batch: usize) -> [usize; 2] {
    let large = micro_batch.max(2);
    [(large / 2).max(1), large]
}

fn bytes(ts: impl Iterator<Item = Tensor>) -> u64 {
    ts.filter(|t| t.defined())
        .map(|t| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64)
        .sum()
}

/// Bytes of the parameters, their gradients (once a backward pass made them) and the
/// optimizer's moments.
pub fn model_bytes(model: &Gpt, opt: &AdamW) -> [u64; 3] {
    let params = model.named_parameters();
    let p = bytes(params.iter().map(|(_, t)| t.shallow_clone()));
    // Before any backward pass the gradients do not exist yet; every step makes them.
    let g = bytes(params.iter().map(|(_, t)| t.grad())).max(p);
    [p, g, opt.state_bytes()]
}

/// Measures the model's step peak at `sizes` sequences of `seq_len` tokens (step 1's
/// samples of `seed`), each size once to warm up (lazy kernels, the gradients' first
/// allocation) and once measured. Leaves the gradients zeroed. `update_lr`: also make
/// one optimizer update at that rate and measure what it adds (never on a run's own
/// model: it changes the parameters).
#[allow(clippy::too_many_arguments)]
pub fn probe(
    model: &Gpt,
    opt: &mut AdamW,
    data: &Dataset,
    meter: &PeakMeter,
    sizes: [usize; 2],
    seq_len: usize,
    seed: u64,
    update_lr: Option<f64>,
) -> Result<Probe, TchError> {
    let meter_err = |e: String| TchError::Torch(format!("measuring the probe's peak: {e}"));
    let mut peaks = [0u64; 2];
    for (i, &n) in sizes.iter().enumerate() {
        for measured in [false, true] {
            opt.zero_grad();
            let (x, y) = data.train_batch(seed, 1, 0, n, seq_len, model.device())?;
            if measured {
                // What the step needs, not what an earlier, larger allocation left cached
                // (glibc's heap on the CPU, the caching allocator's segments on CUDA).
                let _ = crate::oom::free_cached(model.device());
            }
            meter.reset().map_err(meter_err)?;
            let loss = model.loss_backward(&x, &y, 1.0)?;
            drop((loss, x, y));
            if measured {
                peaks[i] = meter.peak().map_err(meter_err)?;
            }
        }
    }
    let mut update = 0;
    if let Some(lr) = update_lr {
        // From what is resident once the backward's memory is handed back (the gradients
        // stay: the update reads them).
        let _ = crate::oom::free_cached(model.device());
        meter.reset().map_err(meter_err)?;
        let before = meter.peak().map_err(meter_err)?;
        opt.step(lr)?;
        update = meter
            .peak()
            .map_err(meter_err)?
            .saturating_sub(before)
            .max(1);
    }
    opt.zero_grad();
    let [parameters, gradients, optimizer] = model_bytes(model, opt);
    Ok(Probe {
        lever: Lever {
            precision: model.precision(),
            checkpoint: model.checkpointing(),
        },
        seq_len,
        sizes,
        peaks,
        parameters,
        gradients,
        optimizer,
        update,
    })
}

/// `headroom plan`'s measurement in a process of its own: the model and optimizer a run
/// of `cfg` would build, probed at half the configured micro-batch and at all of it,
/// against the budget the run would have. Returns the plan and the device's label.
pub fn measure(cfg: &RunConfig) -> Result<(Plan, String), String> {
    let data = Dataset::load(&cfg.data.corpus, cfg.data.val_fraction, cfg.data.seq_len)
        .map_err(|e| e.to_string())?;
    let choice = cfg.device().map_err(|e| e.to_string())?;
    let (bus, _rx) = Bus::new(false);
    let dev = device::resolve(choice, &bus).map_err(|e| e.to_string())?;
    if cfg.run.threads > 0 {
        tch::set_num_threads(cfg.run.threads as i32);
    }
    let torch = |what: &'static str| {
        move |e: TchError| {
            format!(
                "{what} failed: {}",
                e.to_string().lines().next().unwrap_or("")
            )
        }
    };
    let model = Gpt::new(&cfg.model, cfg.data.seq_len, dev, cfg.run.seed)
        .map_err(torch("building the model"))?;
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim))
        .map_err(torch("allocating the optimizer state"))?;
    let mem = &cfg.memory;
    let mut budget = mem.budget_bytes().map_err(|e| e.to_string())?;
    if mem.is_auto_budget() && dev == Device::Cpu {
        // As a run resolves "auto": from the process once the model exists.
        if let (Some(held), Some(avail)) = (procmem::rss_bytes(), procmem::host_available_bytes()) {
            budget = Some(headroom_core::config::auto_budget(held, avail));
        }
    }
    let meter = PeakMeter::new(dev, budget)?;
    let target = mem.thresholds().map_err(|e| e.to_string())?.target;
    let sizes = sizes_for(cfg.batch.micro_batch);
    let lr = Some(cfg.optim.lr);
    let probe = probe(
        &model,
        &mut opt,
        &data,
        &meter,
        sizes,
        cfg.data.seq_len,
        cfg.run.seed,
        lr,
    )
    .map_err(|e| {
        format!(
            "probing micro-batches {} and {} of {} tokens: {}",
            sizes[0],
            sizes[1],
            cfg.data.seq_len,
            torch("the probe step")(e)
        )
    })?;
    let plan = Plan::from_probe(shape(cfg), probe, meter.limit(), target).map_err(|e| e.0)?;
    Ok((plan, device::label(dev)))
}
