//! The memory planner's arithmetic for the built-in GPT: where one training step's memory
//! goes, by what holds it, and what each lever (precision, activation checkpointing,
//! sequence length) would change. No libtorch: the trainer measures, this computes.
//!
//! Two sources meet here. The model's shapes say which tensors autograd keeps for the
//! backward pass, per token, by kind (attention, MLP, logits, norms) and which
//! temporaries the backward pass adds at its peak: that fixes the *proportions*. A probe
//! (one real step at two micro-batch sizes, [`Probe`]) fixes the *scale*: the difference
//! of the two measured peaks is the memory per sequence, and what is left at zero
//! sequences, less parameters, gradients and optimizer state, is the fixed overhead
//! (workspaces and allocator slack on CUDA; on the CPU also libtorch, the corpus and the
//! process itself). The measured slope over the shapes' slope is the calibration that
//! every other lever's prediction is scaled by: the allocator's rounding and the
//! kernels' own scratch are in the measurement, not in a table of constants.
use std::fmt;

use crate::config::{Checkpointing, Precision};
use crate::units::fmt_bytes;

/// Bytes of a float32 element: the residual stream, norm statistics, log-softmax.
const F32: f64 = 4.0;

/// The model's shapes, as the config gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub vocab: usize,
    pub seq_len: usize,
    pub tie_weights: bool,
}

/// One precision × checkpointing choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lever {
    pub precision: Precision,
    pub checkpoint: Checkpointing,
}

impl fmt::Display for Lever {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} · checkpoint {}", self.precision, self.checkpoint)
    }
}

/// The four choices a plan prints a row for.
pub const LEVERS: [Lever; 4] = [
    Lever {
        precision: Precision::Fp32,
        checkpoint: Checkpointing::None,
    },
    Lever {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::None,
    },
    Lever {
        precision: Precision::Fp32,
        checkpoint: Checkpointing::Blocks,
    },
    Lever {
        precision: Precision::Bf16,
        checkpoint: Checkpointing::Blocks,
    },
];

/// Activation memory per token by kind, bytes (from the shapes alone).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PerToken {
    /// Kept by the attention half of each block: its input in the compute kind, q/k/v, the
    /// attention output and its contiguous copy, the log-sum-exp per head.
    pub attention: f64,
    /// Kept by the MLP half: its input, the 4C hidden layer before and after GELU.
    pub mlp: f64,
    /// The output head: its input, and the float32 log-softmax of the 256 logits.
    pub logits: f64,
    /// LayerNorm inputs (the float32 residual stream) and their mean / rstd; with
    /// checkpointing, the kept inputs of the recomputed blocks.
    pub norms: f64,
    /// What the backward pass adds at its peak: gradients of one block's largest
    /// intermediates or of the logits, and with checkpointing one block recomputed.
    pub backward: f64,
}

impl PerToken {
    pub fn total(&self) -> f64 {
        self.attention + self.mlp + self.logits + self.norms + self.backward
    }

    fn scaled(&self, k: f64) -> PerToken {
        PerToken {
            attention: self.attention * k,
            mlp: self.mlp * k,
            logits: self.logits * k,
            norms: self.norms * k,
            backward: self.backward * k,
        }
    }

    /// Kind names and bytes, in print order.
    pub fn kinds(&self) -> [(&'static str, f64); 5] {
        [
            ("attention", self.attention),
            ("MLP", self.mlp),
            ("logits", self.logits),
            ("norms", self.norms),
            ("backward temporaries", self.backward),
        ]
    }
}

impl Shape {
    /// Parameters in linear layers and the head, which bf16 casts to bfloat16 copies
    /// that autograd keeps for the backward pass.
    fn linear_params_per_block(&self) -> f64 {
        let c = self.n_embd as f64;
        // c_attn, attn c_proj, c_fc, mlp c_proj, weights and biases.
        (c * 3.0 * c + 3.0 * c) + (c * c + c) + (c * 4.0 * c + 4.0 * c) + (4.0 * c * c + c)
    }

    /// The kept activations of one block per token, by kind, in `e`-byte compute
    /// elements: (attention, mlp, norms).
    fn block(&self, e: f64) -> (f64, f64, f64) {
        let (c, h) = (self.n_embd as f64, self.n_head as f64);
        // c_attn's input, q/k/v (one qkv tensor the views share), the attention output
        // and the contiguous copy attn_proj takes; the flash kernels keep a float32
        // log-sum-exp per head instead of the T × T scores.
        let attention = 6.0 * c * e + h * F32;
        // c_fc's input, its 4C output (GELU's input) and GELU's output (mlp_proj's input).
        let mlp = 9.0 * c * e;
        // Two LayerNorms: each keeps its float32 input and two statistics.
        let norms = 2.0 * (c * F32 + 2.0 * F32);
        (attention, mlp, norms)
    }

    /// Activation memory per token at the step's peak for `lever`, by kind.
    pub fn per_token(&self, lever: Lever) -> PerToken {
        let e = lever.precision.bytes();
        let (c, v, l) = (self.n_embd as f64, self.vocab as f64, self.n_layer);
        let (att, mlp, norms) = self.block(e);
        let full = att + mlp + norms;
        // Backward of a block holds the gradients of its widest intermediates (the two 4C
        // MLP tensors) and of the residual stream; the head's holds the logits' gradient
        // twice (log-softmax's and its input's), plus a bfloat16 copy under bf16.
        let block_bwd = 8.0 * c * e + 2.0 * c * F32;
        let head_bwd = 2.0 * v * F32 + if e < F32 { v * e } else { 0.0 };
        let kept_blocks = (0..l).filter(|&i| !lever.checkpoint.recomputes(i)).count() as f64;
        let recomputed = l as f64 - kept_blocks;
        // The final LayerNorm's input and statistics; the head's input and log-softmax.
        let head_norm = c * F32 + 2.0 * F32;
        let logits = c * e + v * F32;
        let backward = if recomputed > 0.0 {
            // One recomputed block at a time holds its activations and its gradients.
            (full + block_bwd).max(head_bwd)
        } else {
            block_bwd.max(head_bwd)
        };
        PerToken {
            attention: att * kept_blocks,
            mlp: mlp * kept_blocks,
            logits,
            // A recomputed block keeps only its float32 input.
            norms: norms * kept_blocks + recomputed * c * F32 + head_norm,
            backward,
        }
    }

    /// Bytes that do not grow with the batch but do with the lever: under bf16 the
    /// bfloat16 copies of the weights autograd keeps (all of them without checkpointing,
    /// one block's with, since recomputed blocks cast again).
    pub fn lever_fixed(&self, lever: Lever) -> f64 {
        if lever.precision == Precision::Fp32 {
            return 0.0;
        }
        let head = (self.vocab * self.n_embd) as f64;
        let per_block = self.linear_params_per_block();
        let kept = (0..self.n_layer)
            .filter(|&i| !lever.checkpoint.recomputes(i))
            .count() as f64;
        let blocks = if lever.checkpoint.is_on() {
            kept + 1.0
        } else {
            kept
        };
        2.0 * (head + per_block * blocks)
    }

    /// The attention scores a math (non-flash) kernel would keep per sequence: H × T × T
    /// float32 per block; the flash and memory-efficient kernels keep none of them.
    pub fn math_attention_scores(&self, seq_len: usize) -> f64 {
        (self.n_layer * self.n_head) as f64 * (seq_len * seq_len) as f64 * F32
    }
}

/// What one probe measured: the step peak at two micro-batch sizes of `seq_len` tokens,
/// with `lever`, and the bytes the model's own tensors hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    pub lever: Lever,
    /// Usually the model's; shorter when sequences of that length did not fit (every
    /// term here is per token, so the calibration carries over).
    pub seq_len: usize,
    pub sizes: [usize; 2],
    pub peaks: [u64; 2],
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// What the optimizer update adds on top of everything that is resident after the
    /// backward pass, measured; 0 when the probe made no update (a run's own probe must
    /// not change its parameters), and then taken from the shapes: the AdamW keeps new
    /// parameters and both new moments until all are computed, three times the
    /// parameters.
    pub update: u64,
}

/// Why a probe cannot make a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanError(pub String);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlanError {}

/// A step's memory for every lever, from the shapes and one probe.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub shape: Shape,
    pub probe: Probe,
    /// Measured slope over the shapes' slope for the probed lever (1.0: the shapes
    /// alone, no probe).
    pub calibration: f64,
    /// Peak at zero sequences less parameters, gradients, optimizer state and the probed
    /// lever's own fixed part (signed: a noisy probe may put it a little below zero).
    pub overhead: i64,
    /// The memory the run may use, and the share of it the controller grows up to.
    pub budget: u64,
    pub target: f64,
}

impl Plan {
    /// The plan the probe's two peaks give.
    pub fn from_probe(
        shape: Shape,
        probe: Probe,
        budget: u64,
        target: f64,
    ) -> Result<Plan, PlanError> {
        let [a, b] = probe.sizes;
        if a == 0 || a >= b {
            return Err(PlanError(format!(
                "probe sizes {a} and {b}: give two micro-batch sizes with 1 ≤ a < b"
            )));
        }
        let slope = (probe.peaks[1] as f64 - probe.peaks[0] as f64) / (b - a) as f64;
        if slope <= 0.0 {
            return Err(PlanError(format!(
                "the step peak did not grow from micro-batch {a} ({}) to {b} ({}): the \
                 activations are lost in the measurement's noise; probe larger sizes \
                 (--batch-size)",
                fmt_bytes(probe.peaks[0]),
                fmt_bytes(probe.peaks[1])
            )));
        }
        let formula = shape.per_token(probe.lever).total() * probe.seq_len as f64;
        let intercept = probe.peaks[0] as f64 - slope * a as f64;
        let model = (probe.parameters + probe.gradients + probe.optimizer) as f64;
        Ok(Plan {
            shape,
            probe,
            calibration: slope / formula,
            overhead: (intercept - model - shape.lever_fixed(probe.lever)).round() as i64,
            budget,
            target,
        })
    }

    /// A plan from the shapes alone, for when no probe step fit: `held` is what the
    /// process holds with the model and optimizer state built (their bytes included).
    pub fn from_shapes(shape: Shape, model: [u64; 3], held: u64, budget: u64, target: f64) -> Plan {
        let total: u64 = model.iter().sum();
        Plan {
            shape,
            probe: Probe {
                lever: LEVERS[0],
                seq_len: shape.seq_len,
                sizes: [0, 0],
                peaks: [0, 0],
                parameters: model[0],
                gradients: model[1],
                optimizer: model[2],
                update: 0,
            },
            calibration: 1.0,
            overhead: held as i64 - total as i64,
            budget,
            target,
        }
    }

    /// Whether two real steps measured this plan (false: the shapes alone).
    pub fn is_measured(&self) -> bool {
        self.probe.sizes[1] > 0
    }

    /// Parameters, gradients and optimizer state: what every step sits on.
    pub fn model_bytes(&self) -> u64 {
        self.probe.parameters + self.probe.gradients + self.probe.optimizer
    }

    /// Everything that does not grow with the batch, for `lever`.
    pub fn fixed(&self, lever: Lever) -> u64 {
        let v = self.model_bytes() as f64 + self.overhead as f64 + self.shape.lever_fixed(lever);
        v.max(0.0).round() as u64
    }

    /// Activation bytes per token by kind for `lever`, scaled by the probe's calibration.
    pub fn per_token(&self, lever: Lever) -> PerToken {
        self.shape.per_token(lever).scaled(self.calibration)
    }

    /// Activation bytes of one sequence of `seq_len` tokens (the attention term of the
    /// flash kernels grows linearly with it, like everything else here).
    pub fn per_sequence(&self, lever: Lever, seq_len: usize) -> f64 {
        self.per_token(lever).total() * seq_len as f64
    }

    /// The optimizer update's own transient (measured, or from the shapes).
    pub fn update_bytes(&self) -> u64 {
        match self.probe.update {
            0 => 3 * self.probe.parameters,
            n => n,
        }
    }

    /// The step's peak during the optimizer update, when the activations are gone: the
    /// floor under every micro-batch's peak.
    pub fn update_peak(&self) -> u64 {
        let v = self.model_bytes() as f64 + self.overhead as f64 + self.update_bytes() as f64;
        v.max(0.0).round() as u64
    }

    /// The step's predicted peak at `micro_batch` sequences of `seq_len` tokens: the
    /// backward pass's (fixed part plus activations) or the update's, whichever is higher.
    pub fn predict(&self, lever: Lever, micro_batch: usize, seq_len: usize) -> u64 {
        let backward = self.fixed(lever)
            + (self.per_sequence(lever, seq_len) * micro_batch as f64).round() as u64;
        backward.max(self.update_peak())
    }

    /// Bytes under target the batch may grow into.
    fn room(&self) -> f64 {
        self.target * self.budget as f64
    }

    /// The largest micro-batch whose predicted peak stays under target; None when not
    /// even one sequence fits.
    pub fn largest_micro_batch(&self, lever: Lever, seq_len: usize) -> Option<usize> {
        if self.update_peak() as f64 > self.room() {
            return None;
        }
        let room = self.room() - self.fixed(lever) as f64;
        let per = self.per_sequence(lever, seq_len);
        let n = (room / per).floor();
        (n >= 1.0).then(|| n.min(1e9) as usize)
    }

    /// The longest sequence one of which fits under target with `lever`; None when not
    /// even one token does.
    pub fn longest_sequence(&self, lever: Lever) -> Option<usize> {
        self.longest_under(lever, self.room())
    }

    fn longest_under(&self, lever: Lever, limit: f64) -> Option<usize> {
        if self.update_peak() as f64 > limit {
            return None;
        }
        let room = limit - self.fixed(lever) as f64;
        let n = (room / self.per_token(lever).total()).floor();
        (n >= 1.0).then(|| (n as usize).min(self.shape.seq_len))
    }

    /// The run's last words when micro-batch 1 of `seq_len` tokens ran out of memory with
    /// `now`: which lever would make one sequence fit under the limit (the budget, not the
    /// target: it is the limit that failed), predicted from this plan, and by how much (or
    /// that none alone does).
    pub fn levers_that_fit(&self, now: Lever, seq_len: usize) -> String {
        let at_one = |l: Lever| self.predict(l, 1, seq_len);
        let limit = self.budget;
        let mut out = format!(
            "the plan ({}) predicts {} for one sequence of {seq_len} tokens with {now}, \
             against the limit of {}",
            if self.is_measured() {
                "measured by a probe"
            } else {
                "from the model's shapes"
            },
            fmt_bytes(at_one(now)),
            fmt_bytes(limit)
        );
        let mut fits = Vec::new();
        let candidates = [
            (
                Lever {
                    precision: Precision::Bf16,
                    ..now
                },
                "--precision bf16",
            ),
            (
                Lever {
                    checkpoint: Checkpointing::Blocks,
                    ..now
                },
                "--activation-checkpoint blocks",
            ),
            (
                Lever {
                    precision: Precision::Bf16,
                    checkpoint: Checkpointing::Blocks,
                },
                "--precision bf16 --activation-checkpoint blocks",
            ),
        ];
        for (lever, flag) in candidates {
            if lever == now {
                continue;
            }
            let p = at_one(lever);
            let saved = at_one(now).saturating_sub(p);
            let verdict = if p <= limit {
                format!("fits, {} to spare", fmt_bytes(limit - p))
            } else {
                format!("still {} over", fmt_bytes(p - limit))
            };
            fits.push(format!(
                "{flag}: {} ({} less): {verdict}",
                fmt_bytes(p),
                fmt_bytes(saved)
            ));
        }
        match self.longest_under(now, limit as f64) {
            Some(t) if t < seq_len => fits.push(format!(
                "data.seq_len = {t} (from {seq_len}): {} fits",
                fmt_bytes(at_one_len(self, now, t))
            )),
            _ => fits.push(format!(
                "no shorter sequence fits with {now}: the fixed part alone is {}",
                fmt_bytes(self.fixed(now))
            )),
        }
        out += "; ";
        out += &fits.join("; ");
        out
    }
}

fn at_one_len(plan: &Plan, lever: Lever, seq_len: usize) -> u64 {
    plan.predict(lever, 1, seq_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        // configs/default.toml
        Shape {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            vocab: 256,
            seq_len: 64,
            tie_weights: true,
        }
    }

    fn probe(peaks: [u64; 2]) -> Probe {
        Probe {
            lever: LEVERS[0],
            seq_len: 64,
            sizes: [4, 8],
            peaks,
            parameters: 4 << 20,
            gradients: 4 << 20,
            optimizer: 8 << 20,
            update: 0,
        }
    }

    #[test]
    fn per_token_kinds_follow_the_shapes() {
        let s = shape();
        let fp32 = s.per_token(LEVERS[0]);
        // 6C compute elements of attention per block plus a float per head, ×4 blocks.
        assert_eq!(fp32.attention, 4.0 * (6.0 * 128.0 * 4.0 + 4.0 * 4.0));
        assert_eq!(fp32.mlp, 4.0 * 9.0 * 128.0 * 4.0);
        // bf16 halves what is kept in the compute kind, not the float32 stream.
        let bf16 = s.per_token(LEVERS[1]);
        assert_eq!(bf16.mlp * 2.0, fp32.mlp);
        assert_eq!(bf16.norms, fp32.norms);
        // Checkpointing keeps no block's attention or MLP, only inputs and one block.
        let ck = s.per_token(LEVERS[2]);
        assert_eq!((ck.attention, ck.mlp), (0.0, 0.0));
        assert!(ck.total() < fp32.total() / 2.0, "{ck:?} vs {fp32:?}");
        // every:2 lies between.
        let every2 = s.per_token(Lever {
            precision: Precision::Fp32,
            checkpoint: Checkpointing::Every(2),
        });
        assert!(ck.total() < every2.total() && every2.total() < fp32.total());
    }

    #[test]
    fn the_probe_fixes_slope_fixed_part_and_calibration() {
        let s = shape();
        let per_seq = s.per_token(LEVERS[0]).total() * 64.0;
        // A measurement 1.5× the shapes' activations, on 100 MiB of overhead.
        let model = 16u64 << 20;
        let peak = |n: usize| model + (100 << 20) + (1.5 * per_seq * n as f64) as u64;
        let plan = Plan::from_probe(s, probe([peak(4), peak(8)]), 1 << 30, 0.9).unwrap();
        assert!(
            (plan.calibration - 1.5).abs() < 1e-6,
            "{}",
            plan.calibration
        );
        assert!(
            (plan.overhead - (100 << 20)).abs() <= 1,
            "{}",
            plan.overhead
        );
        // Predictions through the probe's own points, and beyond them on the line.
        for n in [4, 8, 16] {
            let p = plan.predict(LEVERS[0], n, 64) as f64;
            assert!((p - peak(n) as f64).abs() <= 2.0, "{n}: {p} vs {}", peak(n));
        }
        let n = plan.largest_micro_batch(LEVERS[0], 64).unwrap();
        assert!(plan.predict(LEVERS[0], n, 64) as f64 <= 0.9 * (1u64 << 30) as f64);
        assert!(plan.predict(LEVERS[0], n + 1, 64) as f64 > 0.9 * (1u64 << 30) as f64);
        // Every other lever fits more.
        for l in &LEVERS[1..] {
            assert!(plan.largest_micro_batch(*l, 64).unwrap() > n, "{l}");
        }
        // Below where the activations outgrow it, the update's transient is the peak.
        let floor = model + (100 << 20) + 3 * (4 << 20);
        assert_eq!(plan.update_peak(), floor);
        let mut big = plan.clone();
        big.probe.update = 1 << 30;
        assert_eq!(big.predict(LEVERS[0], 1, 64), big.update_peak());
        assert_eq!(big.largest_micro_batch(LEVERS[0], 64), None);
    }

    #[test]
    fn a_probe_that_measured_no_growth_is_one_clear_error() {
        let e = Plan::from_probe(shape(), probe([500 << 20, 500 << 20]), 1 << 30, 0.9).unwrap_err();
        assert!(e.0.contains("--batch-size"), "{e}");
        let mut p = probe([1, 2]);
        p.sizes = [8, 8];
        assert!(Plan::from_probe(shape(), p, 1 << 30, 0.9).is_err());
    }

    #[test]
    fn last_words_name_the_lever_that_makes_one_sequence_fit() {
        let mut s = shape();
        s.seq_len = 8192;
        let model = [4 << 20, 4 << 20, 8 << 20];
        // 200 MiB held, a budget where one fp32 sequence does not fit but one
        // checkpointed one does.
        let plan0 = Plan::from_shapes(s, model, 200 << 20, 1 << 30, 1.0);
        let fp32 = plan0.predict(LEVERS[0], 1, 8192);
        let ck = plan0.predict(LEVERS[2], 1, 8192);
        let budget = (fp32 + ck) / 2;
        let plan = Plan::from_shapes(s, model, 200 << 20, budget, 0.9);
        let words = plan.levers_that_fit(LEVERS[0], 8192);
        assert!(words.contains("from the model's shapes"), "{words}");
        assert!(
            words.contains("--activation-checkpoint blocks: ") && words.contains("fits, "),
            "{words}"
        );
        let t = plan.longest_under(LEVERS[0], budget as f64).unwrap();
        assert!(
            t < 8192 && words.contains(&format!("data.seq_len = {t}")),
            "{words}"
        );
        assert!(plan.predict(LEVERS[0], 1, t) <= budget);
        assert!(plan.predict(LEVERS[0], 1, t + 1) > budget);
    }
}
