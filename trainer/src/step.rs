//! One optimizer step over an effective batch, accumulated over micro-batches; and the
//! streaming validation pass.
use tch::{Device, Kind, Reduction, TchError, Tensor};

use crate::data::Dataset;
use crate::model::Gpt;
use crate::oom;
use crate::optim::AdamW;

/// What one step does. The micro-batch is an argument, not a property of the data or the
/// model, so a controller may change it between steps (or retry a step with a smaller one)
/// without changing which sequences the step trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPlan {
    pub seed: u64,
    /// 1-based number of the step being taken; selects the batch.
    pub step: u64,
    pub effective_batch: usize,
    pub micro_batch: usize,
    /// Tokens per sequence this step (at most the dataset's `seq_len`).
    pub seq_len: usize,
    pub lr: f64,
    /// Global gradient-norm limit; 0 disables clipping.
    pub grad_clip: f64,
    /// Fault injection (`--inject-oom`): after the first micro-batch's backward, ask the
    /// allocator for an impossible amount, so a real out-of-memory error leaves the step
    /// with gradients half-accumulated, as a natural one would.
    pub inject_oom: bool,
}

impl StepPlan {
    pub fn accum_steps(&self) -> usize {
        self.effective_batch.div_ceil(self.micro_batch.max(1))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Mean cross-entropy over every token of the effective batch.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
}

/// How [`train_step_until`] ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stepped {
    Done(StepOutcome),
    /// A stop was asked for between micro-batches: the optimizer never ran, so the
    /// parameters and the optimizer state are still those of the previous step; the
    /// partial gradients are left for the caller to drop.
    Abandoned {
        /// Micro-batches that had completed (their work is lost).
        micro_batches_done: usize,
    },
}

/// Forward and backward over every micro-batch, then clip and update. The gradients are
/// zeroed first, so a step retried after a failure starts clean.
pub fn train_step(
    model: &Gpt,
    opt: &mut AdamW,
    data: &Dataset,
    plan: &StepPlan,
) -> Result<StepOutcome, TchError> {
    match train_step_until(model, opt, data, plan, &mut |_| false)? {
        Stepped::Done(out) => Ok(out),
        Stepped::Abandoned { .. } => unreachable!("nothing asked to abandon the step"),
    }
}

/// Where [`train_step_until`] asks whether to give the step up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// Before a micro-batch.
    MicroBatch,
    /// After the last one, before the update: the last chance; past it the update (short,
    /// and all-or-nothing) always completes.
    Update,
}

/// [`train_step`], asking `abandon` at every micro-batch boundary whether to give the step
/// up: a stop then waits for one micro-batch, not for the whole step.
pub fn train_step_until(
    model: &Gpt,
    opt: &mut AdamW,
    data: &Dataset,
    plan: &StepPlan,
    abandon: &mut dyn FnMut(Boundary) -> bool,
) -> Result<Stepped, TchError> {
    let e = plan.effective_batch;
    let b = plan.micro_batch.max(1);
    if e == 0 {
        return Err(TchError::Shape("an effective batch of 0 sequences".into()));
    }
    let device = model.device();
    opt.zero_grad();
    let mut loss_sum = Tensor::f_zeros([], (Kind::Float, device))?;
    let mut first = 0;
    while first < e {
        if abandon(Boundary::MicroBatch) {
            return Ok(Stepped::Abandoned {
                micro_batches_done: first.div_ceil(b),
            });
        }
        let len = b.min(e - first);
        let (x, y) = data.train_batch(plan.seed, plan.step, first, len, plan.seq_len, device)?;
        // Each micro-batch's mean weighted by its share of the batch: the gradients then
        // sum to exactly the full batch's mean gradient, uneven last micro-batch included.
        let loss = model.loss_backward(&x, &y, len as f64 / e as f64)?;
        loss_sum = loss_sum.f_add(&loss)?;
        first += len;
        if plan.inject_oom {
            return Err(oom::provoke(device));
        }
    }

    if abandon(Boundary::Update) {
        return Ok(Stepped::Abandoned {
            micro_batches_done: e.div_ceil(b),
        });
    }
    let grads = opt.grads();
    let norm = global_norm(&grads, device)?;
    if plan.grad_clip > 0.0 {
        // Computed on the device: no host round-trip to decide the scale.
        let coef = norm
            .f_add_scalar(1e-6)?
            .f_reciprocal()?
            .f_mul_scalar(plan.grad_clip)?
            .f_clamp_max(1.0)?;
        let _guard = tch::no_grad_guard();
        for mut g in grads {
            let _ = g.f_mul_(&coef)?;
        }
    }
    opt.step(plan.lr)?;

    // The step's one host synchronisation: loss and norm read together.
    let both = Tensor::f_stack(&[loss_sum, norm], 0)?
        .f_to_kind(Kind::Double)?
        .f_to_device(Device::Cpu)?;
    let v = Vec::<f64>::try_from(&both)?;
    Ok(Stepped::Done(StepOutcome {
        loss: v[0],
        grad_norm: v[1],
    }))
}

fn global_norm(grads: &[Tensor], device: Device) -> Result<Tensor, TchError> {
    if grads.is_empty() {
        return Tensor::f_zeros([], (Kind::Float, device));
    }
    let norms = grads
        .iter()
        .map(|g| g.f_norm())
        .collect::<Result<Vec<_>, _>>()?;
    Tensor::f_stack(&norms, 0)?.f_norm()
}

/// Mean cross-entropy over the validation windows at `offsets`, `chunk` windows at a time:
/// memory grows with the chunk, not with the validation set.
pub fn evaluate(
    model: &Gpt,
    data: &Dataset,
    offsets: &[usize],
    chunk: usize,
) -> Result<f64, TchError> {
    if offsets.is_empty() {
        return Ok(f64::NAN);
    }
    let device = model.device();
    let mut total = Tensor::f_zeros([], (Kind::Double, device))?;
    for part in offsets.chunks(chunk.max(1)) {
        total = total.f_add(&validation_sum(model, data, part, false)?)?;
    }
    validation_mean(data, offsets.len(), &total)
}

/// The cross-entropy of every token of the validation windows at `part`, summed in
/// double precision, as a scalar on the model's device (no host synchronisation). Each
/// token's loss is taken in float32 and summed as a double, so a total over chunks does
/// not depend on where the chunks were cut (a float32 sum per chunk did, by its rounding).
/// `inject_oom` (`HEADROOM_INJECT_EVAL_OOM`): after the forward, ask the allocator for an
/// impossible amount, so the chunk fails with the allocator's own out-of-memory error at
/// the point a natural one would surface, its activations still held.
pub fn validation_sum(
    model: &Gpt,
    data: &Dataset,
    part: &[usize],
    inject_oom: bool,
) -> Result<Tensor, TchError> {
    let device = model.device();
    let _guard = tch::no_grad_guard();
    let (x, y) = data.val_batch(part, device)?;
    let per_token = model.loss(&x, &y, Reduction::None)?;
    if inject_oom {
        return Err(oom::provoke(device));
    }
    per_token.f_to_kind(Kind::Double)?.f_sum(Kind::Double)
}

/// The mean loss per token of `windows` validation windows whose summed loss is `total`
/// ([`validation_sum`]s added): one host synchronisation.
pub fn validation_mean(data: &Dataset, windows: usize, total: &Tensor) -> Result<f64, TchError> {
    let tokens = (windows * data.seq_len()) as f64;
    let total = f64::try_from(&total.f_to_device(Device::Cpu)?)?;
    Ok(total / tokens)
}
