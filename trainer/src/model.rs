//! A byte-level GPT (nanoGPT layout): token and position embeddings, pre-norm blocks of
//! causal self-attention and a 4x GELU MLP, a final LayerNorm, and a head optionally tied
//! to the token embedding.
//!
//! Every forward op is a fallible `f_*` call so that an out-of-memory error on a GPU comes
//! back as a `TchError` the trainer can act on instead of a panic. There is no dropout:
//! a run must be reproducible from its seed.
//!
//! Two levers trade compute for memory. bf16 casts the operands of every linear layer
//! and of attention to bfloat16, as `torch.autocast` does: the parameters stay float32
//! (the casts' backward brings their gradients back to float32), LayerNorm and the loss
//! run in float32, and the residual stream stays float32 (a float32 tensor plus a
//! bfloat16 one is float32). Activation checkpointing runs chosen blocks without a graph
//! and recomputes them, with one, in backward (see [`Gpt::loss_backward`]). With fp32 and
//! no checkpointing every op is the one this model always ran: results are bit-identical.
use std::sync::Mutex;

use headroom_core::config::{Checkpointing, ModelSection, Precision};
use tch::nn::{self, Init};
use tch::{Device, Kind, Reduction, TchError, Tensor};

use crate::compute;
use crate::data::VOCAB_SIZE;

const LN_EPS: f64 = 1e-5;
const INIT_STD: f64 = 0.02;

struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(p: nn::Path, dim: i64) -> Result<Self, TchError> {
        Ok(LayerNorm {
            weight: p.f_ones("weight", &[dim])?,
            bias: p.f_zeros("bias", &[dim])?,
        })
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        let dim = xs.size().last().copied().unwrap_or(0);
        xs.f_layer_norm([dim], Some(&self.weight), Some(&self.bias), LN_EPS, true)
    }
}

struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    fn new(p: nn::Path, inp: i64, out: i64) -> Result<Self, TchError> {
        Ok(Linear {
            weight: p.f_var("weight", &[out, inp], normal())?,
            bias: p.f_zeros("bias", &[out])?,
        })
    }

    /// In `kind`: float32 runs the one op it always did; bfloat16 casts the input, the
    /// weight and the bias first.
    fn forward(&self, xs: &Tensor, kind: Kind) -> Result<Tensor, TchError> {
        if kind == Kind::Float {
            return xs.f_linear(&self.weight, Some(&self.bias));
        }
        cast(xs, kind)?.f_linear(&cast(&self.weight, kind)?, Some(&cast(&self.bias, kind)?))
    }
}

/// `t` in `kind`, without a copy when it already is.
fn cast(t: &Tensor, kind: Kind) -> Result<Tensor, TchError> {
    if t.kind() == kind {
        Ok(t.shallow_clone())
    } else {
        t.f_to_kind(kind)
    }
}

/// The kind linear layers and attention compute in.
fn compute_kind(p: Precision) -> Kind {
    match p {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        // Refused before it gets here (config validation, the session's answer to a
        // command): fp16 needs a loss scaler the built-in trainer has not.
        Precision::Fp16 => Kind::Half,
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

impl Block {
    fn new(p: nn::Path, c: i64) -> Result<Self, TchError> {
        Ok(Block {
            ln_1: LayerNorm::new(&p / "ln_1", c)?,
            c_attn: Linear::new(&p / "attn" / "c_attn", c, 3 * c)?,
            attn_proj: Linear::new(&p / "attn" / "c_proj", c, c)?,
            ln_2: LayerNorm::new(&p / "ln_2", c)?,
            c_fc: Linear::new(&p / "mlp" / "c_fc", c, 4 * c)?,
            mlp_proj: Linear::new(&p / "mlp" / "c_proj", 4 * c, c)?,
        })
    }

    /// `xs` is the float32 residual stream; the linear layers and attention compute in
    /// `kind`, and what they add to the stream is promoted back to float32.
    fn forward(&self, xs: &Tensor, n_head: i64, kind: Kind) -> Result<Tensor, TchError> {
        let (b, t, c) = xs.size3()?;
        let qkv = self.c_attn.forward(&self.ln_1.forward(xs)?, kind)?;
        let parts = qkv.f_split(c, 2)?;
        let heads = |x: &Tensor| -> Result<Tensor, TchError> {
            x.f_view([b, t, n_head, c / n_head])?.f_transpose(1, 2)
        };
        let (q, k, v) = (heads(&parts[0])?, heads(&parts[1])?, heads(&parts[2])?);
        let att = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        )?;
        let att = att.f_transpose(1, 2)?.f_contiguous()?.f_view([b, t, c])?;
        let xs = xs.f_add(&self.attn_proj.forward(&att, kind)?)?;
        let h = self
            .c_fc
            .forward(&self.ln_2.forward(&xs)?, kind)?
            .f_gelu("none")?;
        xs.f_add(&self.mlp_proj.forward(&h, kind)?)
    }
}

/// The model and the store that owns its parameters.
pub struct Gpt {
    vs: nn::VarStore,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `None` when the head shares `wte`.
    lm_head: Option<Tensor>,
    n_head: i64,
    seq_len: i64,
    /// Where the parameters live (the VarStore's own idea stays CPU: it built them).
    device: Device,
    precision: Precision,
    checkpoint: Checkpointing,
}

fn normal() -> Init {
    Init::Randn {
        mean: 0.0,
        stdev: INIT_STD,
    }
}

impl Gpt {
    /// Builds a model initialised from `seed` alone, on `device`.
    ///
    /// The weights are drawn on the CPU under a process-wide lock right after seeding
    /// torch's global generator: other threads (a second run, parallel tests) cannot
    /// interleave draws, and a CPU and a GPU run start from the same weights.
    pub fn new(
        cfg: &ModelSection,
        seq_len: usize,
        device: Device,
        seed: u64,
    ) -> Result<Gpt, TchError> {
        static INIT: Mutex<()> = Mutex::new(());
        let mut model = {
            let _lock = INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            tch::manual_seed(seed as i64);
            Gpt::init(cfg, seq_len)?
        };
        model.precision = cfg.precision;
        model.checkpoint = cfg.checkpoint;
        if device != Device::Cpu {
            let _guard = tch::no_grad_guard();
            for (_, mut var) in model.vs.variables() {
                // set_data swaps the storage under the same handle, so the clones this
                // struct keeps follow the move.
                var.f_set_data(&var.f_to_device(device)?)?;
            }
            model.device = device;
        }
        Ok(model)
    }

    fn init(cfg: &ModelSection, seq_len: usize) -> Result<Gpt, TchError> {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let c = cfg.n_embd as i64;
        let wte = root.f_var("wte", &[VOCAB_SIZE, c], normal())?;
        let wpe = root.f_var("wpe", &[seq_len as i64, c], normal())?;
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::new(&root / "h" / i, c))
            .collect::<Result<Vec<_>, _>>()?;
        let ln_f = LayerNorm::new(&root / "ln_f", c)?;
        let lm_head = if cfg.tie_weights {
            None
        } else {
            Some((&root / "lm_head").f_var("weight", &[VOCAB_SIZE, c], normal())?)
        };
        drop(root);
        Ok(Gpt {
            vs,
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            n_head: cfg.n_head as i64,
            seq_len: seq_len as i64,
            device: Device::Cpu,
            precision: Precision::Fp32,
            checkpoint: Checkpointing::None,
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Takes effect at the next forward: the parameters and the optimizer state do not
    /// change (they are float32 either way).
    pub fn set_precision(&mut self, p: Precision) {
        self.precision = p;
    }

    pub fn checkpointing(&self) -> Checkpointing {
        self.checkpoint
    }

    /// Takes effect at the next forward.
    pub fn set_checkpointing(&mut self, c: Checkpointing) {
        self.checkpoint = c;
    }

    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Every parameter with its name, sorted by name: a stable order for the optimizer's
    /// state and for fingerprints.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Parameter names and shapes: what a checkpoint must match to be loadable.
    pub fn fingerprint(&self) -> Vec<(String, Vec<i64>)> {
        self.named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.size()))
            .collect()
    }

    /// The parameter count a config gives, without building anything: a config too big
    /// for the machine is refused with numbers before a single byte is allocated. Wide
    /// arithmetic: absurd sizes must not wrap into plausible ones.
    pub fn parameters_for(cfg: &ModelSection, seq_len: usize) -> u128 {
        let (c, l, v) = (cfg.n_embd as u128, cfg.n_layer as u128, VOCAB_SIZE as u128);
        let linear = |i: u128, o: u128| i * o + o;
        let block =
            2 * (2 * c) + linear(c, 3 * c) + linear(c, c) + linear(c, 4 * c) + linear(4 * c, c);
        let head = if cfg.tie_weights { 0 } else { v * c };
        v * c + seq_len as u128 * c + l * block + 2 * c + head
    }

    pub fn num_parameters(&self) -> u64 {
        self.named_parameters()
            .iter()
            .map(|(_, t)| t.numel() as u64)
            .sum()
    }

    /// Logits `[B, T, 256]` for byte indices `[B, T]` (T at most the model's seq_len);
    /// bfloat16 under bf16.
    pub fn forward(&self, idx: &Tensor) -> Result<Tensor, TchError> {
        let mut xs = self.embed(idx)?;
        for block in &self.blocks {
            xs = self.block(block, &xs)?;
        }
        self.head(&xs)
    }

    /// Token plus position embeddings: the float32 residual stream's start.
    fn embed(&self, idx: &Tensor) -> Result<Tensor, TchError> {
        let (_, t) = idx.size2()?;
        if t > self.seq_len {
            return Err(TchError::Shape(format!(
                "sequence of {t} exceeds the model's context of {}",
                self.seq_len
            )));
        }
        let tok = Tensor::f_embedding(&self.wte, idx, -1, false, false)?;
        let pos = self.wpe.f_narrow(0, 0, t)?;
        tok.f_add(&pos)
    }

    fn block(&self, block: &Block, xs: &Tensor) -> Result<Tensor, TchError> {
        block.forward(xs, self.n_head, compute_kind(self.precision))
    }

    /// The final LayerNorm and the output head.
    fn head(&self, xs: &Tensor) -> Result<Tensor, TchError> {
        let xs = self.ln_f.forward(xs)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.wte);
        match compute_kind(self.precision) {
            Kind::Float => xs.f_linear(head, None::<Tensor>),
            kind => cast(&xs, kind)?.f_linear(&cast(head, kind)?, None::<Tensor>),
        }
    }

    /// Cross-entropy of the next-byte predictions, mean or sum over all tokens.
    pub fn loss(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        reduction: Reduction,
    ) -> Result<Tensor, TchError> {
        cross_entropy(&self.forward(idx)?, targets, reduction)
    }

    /// Forward and backward of one micro-batch: the gradients of `scale` × its mean loss
    /// are added to the parameters' `.grad`. Returns that scaled loss, detached.
    ///
    /// With checkpointing, libtorch's C++ API has no helper, so this is one: the forward
    /// runs each recomputed block without a graph and keeps only its input; the head's
    /// backward yields the gradient of the last block's output; walking the blocks back,
    /// a recomputed block is run again with a graph from its kept input, and each block's
    /// output is given its upstream gradient ([`compute::backward_with`]), which yields
    /// the gradient of its input for the block before. The embeddings' output takes the
    /// last one. Only one recomputed block's activations exist at a time.
    pub fn loss_backward(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<Tensor, TchError> {
        if !self.checkpoint.is_on() {
            let loss = self
                .loss(idx, targets, Reduction::Mean)?
                .f_mul_scalar(scale)?;
            loss.f_backward()?;
            return loss.f_detach();
        }
        let x0 = self.embed(idx)?;
        // Per block: its input (a leaf, so backward stops there and leaves its gradient),
        // and its output with a graph when the block keeps its activations.
        let mut saved: Vec<(Tensor, Option<Tensor>)> = Vec::with_capacity(self.blocks.len());
        let mut xs = x0.f_detach()?;
        for (i, block) in self.blocks.iter().enumerate() {
            let input = xs.f_set_requires_grad(true)?;
            let (out, kept) = if self.checkpoint.recomputes(i) {
                let _no_graph = tch::no_grad_guard();
                (self.block(block, &input)?, None)
            } else {
                let out = self.block(block, &input)?;
                (out.f_detach()?, Some(out))
            };
            saved.push((input, kept));
            xs = out;
        }
        let last = xs.f_set_requires_grad(true)?;
        let loss =
            cross_entropy(&self.head(&last)?, targets, Reduction::Mean)?.f_mul_scalar(scale)?;
        loss.f_backward()?;
        let mut grad = last.f_grad()?;
        drop(last);
        for ((input, kept), block) in saved.into_iter().zip(&self.blocks).rev() {
            let out = match kept {
                Some(out) => out,
                None => self.block(block, &input)?,
            };
            compute::backward_with(&out, &grad)?;
            grad = input.f_grad()?;
        }
        compute::backward_with(&x0, &grad)?;
        loss.f_detach()
    }
}

/// Mean or summed cross-entropy of `logits` `[B, T, 256]` against `targets` `[B, T]`, in
/// float32 whatever the logits' kind.
fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    reduction: Reduction,
) -> Result<Tensor, TchError> {
    logits
        .f_view([-1, VOCAB_SIZE])?
        .f_to_kind(Kind::Float)?
        .f_cross_entropy_loss(
            &targets.f_reshape([-1])?,
            None::<Tensor>,
            reduction,
            -100,
            0.0,
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::IndexOp;

    fn cfg(tie_weights: bool) -> ModelSection {
        ModelSection {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            tie_weights,
            ..Default::default()
        }
    }

    #[test]
    fn shapes_and_parameter_names() {
        let tied = Gpt::new(&cfg(true), 8, Device::Cpu, 1).unwrap();
        let untied = Gpt::new(&cfg(false), 8, Device::Cpu, 1).unwrap();
        assert_eq!(
            untied.num_parameters() - tied.num_parameters(),
            (VOCAB_SIZE * 16) as u64
        );
        let names: Vec<String> = untied.fingerprint().into_iter().map(|p| p.0).collect();
        assert!(names.contains(&"lm_head.weight".to_string()));
        assert!(names.contains(&"h.1.attn.c_attn.weight".to_string()));
        for (model, c) in [(&tied, cfg(true)), (&untied, cfg(false))] {
            assert_eq!(
                Gpt::parameters_for(&c, 8),
                u128::from(model.num_parameters())
            );
        }
        let idx = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6]).view([2, 3]);
        assert_eq!(tied.forward(&idx).unwrap().size(), [2, 3, VOCAB_SIZE]);
        let too_long = Tensor::zeros([1, 9], (Kind::Int64, Device::Cpu));
        assert!(tied.forward(&too_long).is_err());
    }

    #[test]
    fn attention_is_causal() {
        let m = Gpt::new(&cfg(true), 8, Device::Cpu, 1).unwrap();
        let a = Tensor::from_slice(&[10i64, 20, 30, 40]).view([1, 4]);
        let b = Tensor::from_slice(&[10i64, 20, 30, 99]).view([1, 4]);
        let (la, lb) = (m.forward(&a).unwrap(), m.forward(&b).unwrap());
        assert!(la
            .i((.., ..3, ..))
            .allclose(&lb.i((.., ..3, ..)), 0.0, 0.0, false));
        assert!(!la
            .i((.., 3, ..))
            .allclose(&lb.i((.., 3, ..)), 1e-6, 1e-6, false));
    }

    #[test]
    fn same_seed_same_weights() {
        let a = Gpt::new(&cfg(true), 8, Device::Cpu, 7).unwrap();
        let b = Gpt::new(&cfg(true), 8, Device::Cpu, 7).unwrap();
        let c = Gpt::new(&cfg(true), 8, Device::Cpu, 8).unwrap();
        let wte = |m: &Gpt| {
            m.named_parameters()
                .into_iter()
                .find(|p| p.0 == "wte")
                .unwrap()
                .1
        };
        assert!(wte(&a).equal(&wte(&b)));
        assert!(!wte(&a).equal(&wte(&c)));
    }
}
