//! AdamW over moment tensors we own.
//!
//! tch's `nn::Optimizer` keeps its state inside libtorch where nothing can read it, so a
//! resumed run would restart the moments from zero and diverge from the uninterrupted run.
//! Owning m and v makes them checkpointable and makes optimizer memory visible.
//!
//! The update is libtorch's fused AdamW (`torch.optim.AdamW(fused=True)`'s kernel): one
//! pass over each parameter's elements, in place, where a per-parameter chain of a dozen
//! ops allocated a dozen temporaries and read memory a dozen times. It is all-or-nothing
//! as the step's retry needs: it allocates nothing, so an out-of-memory error cannot
//! strike half-way; every list is checked before it runs, and the step counter moves only
//! after it succeeded. Its arithmetic equals `torch.optim.AdamW`'s within float32
//! rounding (trainer/tests/adamw_matches_torch.rs holds it to 1e-6 relative against
//! torch's own numbers).
use std::fmt;

use headroom_core::config::OptimSection;
use tch::{Device, Kind, TchError, Tensor};

use crate::compute::{self, AdamWArgs, AdamWGroup};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl From<&OptimSection> for AdamWConfig {
    fn from(o: &OptimSection) -> Self {
        AdamWConfig {
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        }
    }
}

struct Slot {
    name: String,
    param: Tensor,
    m: Tensor,
    v: Tensor,
    /// Decoupled weight decay applies to matrices (weights, embeddings), not to biases
    /// or LayerNorm gains: shrinking those toward zero only hurts.
    decay: bool,
}

pub struct AdamW {
    slots: Vec<Slot>,
    cfg: AdamWConfig,
    /// Updates applied so far (drives bias correction).
    t: u64,
    /// The number of the step being taken, as the fused kernel reads it: a float32 scalar
    /// on the parameters' device, allocated once.
    step_number: Tensor,
}

/// Why optimizer state from a checkpoint does not fit.
#[derive(Debug, Clone, PartialEq)]
pub struct StateError(pub String);

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StateError {}

const STEP_KEY: &str = "step";

impl AdamW {
    /// One slot per parameter, moments zeroed on the parameter's device.
    pub fn new(params: Vec<(String, Tensor)>, cfg: AdamWConfig) -> Result<AdamW, TchError> {
        let slots = params
            .into_iter()
            .map(|(name, param)| {
                Ok(Slot {
                    m: param.f_zeros_like()?,
                    v: param.f_zeros_like()?,
                    decay: param.dim() >= 2,
                    name,
                    param,
                })
            })
            .collect::<Result<Vec<_>, TchError>>()?;
        let device = slots.first().map_or(Device::Cpu, |s| s.param.device());
        let step_number = Tensor::f_zeros([], (Kind::Float, device))?;
        Ok(AdamW {
            slots,
            cfg,
            t: 0,
            step_number,
        })
    }

    pub fn steps_taken(&self) -> u64 {
        self.t
    }

    /// Bytes held by the moments.
    pub fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| 2 * s.m.numel() as u64 * s.m.kind().elt_size_in_bytes() as u64)
            .sum()
    }

    /// Sets every gradient to zero (gradients stay allocated: the next backward reuses
    /// them instead of allocating again).
    pub fn zero_grad(&mut self) {
        for s in &mut self.slots {
            s.param.zero_grad();
        }
    }

    /// The gradients that exist (a parameter no loss reached has none).
    pub fn grads(&self) -> Vec<Tensor> {
        self.slots
            .iter()
            .map(|s| s.param.grad())
            .filter(|g| g.defined())
            .collect()
    }

    /// One AdamW update at learning rate `lr`, from the gradients in place. Like
    /// torch.optim, a parameter without a gradient is left alone; decoupled weight decay
    /// goes to the matrices only (two groups, as the trainer's twin in PyTorch has).
    pub fn step(&mut self, lr: f64) -> Result<(), TchError> {
        let t = self.t + 1;
        let _guard = tch::no_grad_guard();
        // Exact in float32 up to 2^24 steps, as torch's own float32 step tensors.
        let _ = self.step_number.f_fill_(t as f64)?;
        let grads: Vec<Tensor> = self.slots.iter().map(|s| s.param.grad()).collect();
        // What could make the kernel fail part-way is checked before either group runs.
        for (s, g) in self.slots.iter().zip(&grads) {
            if g.defined()
                && (g.size() != s.param.size()
                    || g.kind() != s.param.kind()
                    || g.device() != s.param.device())
            {
                return Err(TchError::Shape(format!(
                    "the gradient of {} is {:?} {:?} on {:?}, its parameter {:?} {:?} on {:?}",
                    s.name,
                    g.kind(),
                    g.size(),
                    g.device(),
                    s.param.kind(),
                    s.param.size(),
                    s.param.device()
                )));
            }
        }
        for decay in [true, false] {
            let mut group = AdamWGroup {
                params: Vec::new(),
                grads: Vec::new(),
                exp_avgs: Vec::new(),
                exp_avg_sqs: Vec::new(),
                step: &self.step_number,
            };
            for (s, g) in self.slots.iter().zip(&grads) {
                if s.decay == decay && g.defined() {
                    group.params.push(&s.param);
                    group.grads.push(g);
                    group.exp_avgs.push(&s.m);
                    group.exp_avg_sqs.push(&s.v);
                }
            }
            let weight_decay = if decay { self.cfg.weight_decay } else { 0.0 };
            compute::fused_adamw(
                &group,
                AdamWArgs {
                    lr,
                    beta1: self.cfg.beta1,
                    beta2: self.cfg.beta2,
                    weight_decay,
                    eps: self.cfg.eps,
                },
            )?;
        }
        self.t = t;
        Ok(())
    }

    /// `m.<param>`, `v.<param>` and `step` (int64 `[1]`), for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.slots.len() + 1);
        for s in &self.slots {
            out.push((format!("m.{}", s.name), s.m.shallow_clone()));
            out.push((format!("v.{}", s.name), s.v.shallow_clone()));
        }
        out.push((
            STEP_KEY.to_string(),
            Tensor::from_slice(&[self.t as i64]).to_kind(Kind::Int64),
        ));
        out
    }

    /// Restores what [`AdamW::state_tensors`] wrote. Checks everything before changing
    /// anything, so a mismatch leaves the optimizer as it was.
    pub fn load_state(&mut self, named: &[(String, Tensor)]) -> Result<(), StateError> {
        let find = |key: &str| named.iter().find(|(n, _)| n == key).map(|(_, t)| t);
        let step = find(STEP_KEY)
            .ok_or_else(|| StateError("the optimizer state has no step counter".into()))?;
        let t = step
            .f_int64_value(&[0])
            .map_err(|e| StateError(format!("the optimizer step counter is unreadable: {e}")))?;
        let mut pairs = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let mut pair = Vec::with_capacity(2);
            for which in ["m", "v"] {
                let key = format!("{which}.{}", s.name);
                let src = find(&key)
                    .ok_or_else(|| StateError(format!("the optimizer state lacks {key}")))?;
                if src.size() != s.param.size() {
                    return Err(StateError(format!(
                        "optimizer moment {key} has shape {:?} but the parameter has {:?}",
                        src.size(),
                        s.param.size()
                    )));
                }
                pair.push(src);
            }
            pairs.push(pair);
        }
        let _guard = tch::no_grad_guard();
        for (s, pair) in self.slots.iter_mut().zip(pairs) {
            for (dst, src) in [(&mut s.m, pair[0]), (&mut s.v, pair[1])] {
                src.f_to_kind(dst.kind())
                    .and_then(|x| dst.f_copy_(&x))
                    .map_err(|e| StateError(format!("cannot restore {}: {e}", s.name)))?;
            }
        }
        self.t = t.max(0) as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn cfg() -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }

    fn param(values: &[f32], shape: &[i64]) -> Tensor {
        Tensor::from_slice(values)
            .view(shape)
            .set_requires_grad(true)
    }

    fn set_grad(p: &Tensor, g: &[f32]) {
        let mut grad = p.grad();
        if !grad.defined() {
            // A backward pass creates the gradient; give it ones, then overwrite.
            p.sum(Kind::Float).backward();
            grad = p.grad();
        }
        let _guard = tch::no_grad_guard();
        grad.copy_(&Tensor::from_slice(g).view(p.size().as_slice()));
    }

    #[test]
    fn first_step_matches_the_formula_and_decays_only_matrices() {
        let w = param(&[1.0, -2.0, 3.0, 0.5], &[2, 2]);
        let b = param(&[1.0, 1.0], &[2]);
        let mut opt = AdamW::new(
            vec![
                ("w".into(), w.shallow_clone()),
                ("b".into(), b.shallow_clone()),
            ],
            cfg(),
        )
        .unwrap();
        set_grad(&w, &[0.1, -0.2, 0.0, 0.4]);
        set_grad(&b, &[0.3, -0.3]);
        opt.step(0.01).unwrap();
        // Step 1: m̂ = g, v̂ = g², so the update is lr * g / (|g| + eps) ≈ lr * sign(g).
        let w_new = Vec::<f32>::try_from(&w.flatten(0, -1)).unwrap();
        let expect = [
            1.0 * (1.0 - 0.001) - 0.01,
            -2.0 * (1.0 - 0.001) + 0.01,
            3.0 * (1.0 - 0.001),
            0.5 * (1.0 - 0.001) - 0.01,
        ];
        for (got, want) in w_new.iter().zip(expect) {
            assert!((got - want).abs() < 1e-6, "{w_new:?} vs {expect:?}");
        }
        let b_new = Vec::<f32>::try_from(&b).unwrap();
        assert!((b_new[0] - 0.99).abs() < 1e-6 && (b_new[1] - 1.01).abs() < 1e-6);
        assert_eq!(opt.steps_taken(), 1);
    }

    #[test]
    fn state_round_trips_and_a_mismatch_changes_nothing() {
        let w = param(&[1.0, 2.0], &[1, 2]);
        let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], cfg()).unwrap();
        set_grad(&w, &[0.5, -0.5]);
        opt.step(0.01).unwrap();
        let saved: Vec<(String, Tensor)> = opt
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();

        let w2 = param(&[1.0, 2.0], &[1, 2]);
        let mut fresh = AdamW::new(vec![("w".into(), w2.shallow_clone())], cfg()).unwrap();
        fresh.load_state(&saved).unwrap();
        assert_eq!(fresh.steps_taken(), 1);
        for ((na, a), (nb, b)) in fresh.state_tensors().iter().zip(&saved) {
            assert_eq!(na, nb);
            assert!(a.to_device(Device::Cpu).equal(b));
        }

        let wrong: Vec<(String, Tensor)> = saved
            .iter()
            .map(|(n, t)| {
                let t = if n == "v.w" {
                    Tensor::zeros([3], (Kind::Float, Device::Cpu))
                } else {
                    t.copy()
                };
                (n.clone(), t)
            })
            .collect();
        let mut other = AdamW::new(vec![("w".into(), w2.shallow_clone())], cfg()).unwrap();
        let err = other.load_state(&wrong).unwrap_err().to_string();
        assert!(err.contains("v.w"), "{err}");
        assert_eq!(other.steps_taken(), 0);
        assert_eq!(
            other.state_tensors()[0]
                .1
                .abs()
                .sum(Kind::Float)
                .double_value(&[]),
            0.0
        );
    }
}
