//! Evaluation as its own phase of a run: each batch's chunk size from the controller
//! (core/src/policy/eval.rs), each chunk's peak and out-of-memory error taken in, and one
//! `eval_memory` record when the pass ends. The driver runs the chunks (the built-in's
//! validation, the Python package's `run.evaluate`, the HF Trainer's `prediction_step`,
//! Lightning's validation and test steps) and combines their results.
use std::time::Instant;

use headroom_core::{EvalMemory, Telemetry};

use super::Session;

/// The pass in progress.
pub(super) struct EvalPass {
    phase: String,
    started: Instant,
    record: EvalMemory,
}

impl Session {
    /// An evaluation pass begins (`phase`: `eval`, `validation`, `test`, `predict`); one
    /// still open ends first.
    pub fn eval_begin(&mut self, phase: &str) {
        self.eval_end();
        self.eval_pass = Some(EvalPass {
            phase: phase.to_string(),
            started: Instant::now(),
            record: EvalMemory {
                step: self.step,
                phase: phase.to_string(),
                batches: 0,
                samples: 0,
                asked: 0,
                size: 0,
                chunks: 0,
                seq_len: 1,
                peak_bytes: 0,
                limit_bytes: 0,
                usage: 0.0,
                ooms: 0,
                seconds: 0.0,
            },
        });
    }

    /// Whether a pass is open.
    pub fn evaluating(&self) -> bool {
        self.eval_pass.is_some()
    }

    /// The chunk size for an evaluation batch of `asked` samples of `seq_len` tokens
    /// (opens a pass named `eval` when none is). Without a controller, as asked.
    pub fn eval_size(&mut self, asked: usize, seq_len: usize) -> usize {
        if self.eval_pass.is_none() {
            self.eval_begin("eval");
        }
        let (size, decisions) = match self.controller.as_mut() {
            Some(c) => c.eval_size(asked, seq_len),
            None => (asked.max(1), Vec::new()),
        };
        self.decided(self.step, decisions);
        if let Some(p) = self.eval_pass.as_mut() {
            let r = &mut p.record;
            r.batches += 1;
            r.samples += asked as u64;
            r.asked = r.asked.max(asked);
            r.size = size;
            r.seq_len = r.seq_len.max(seq_len);
        }
        size
    }

    /// An evaluation chunk of `size` samples completed at `peak_bytes` of `limit_bytes`.
    pub fn eval_chunk(&mut self, size: usize, seq_len: usize, peak_bytes: u64, limit_bytes: u64) {
        if let Some(c) = self.controller.as_mut() {
            c.eval_measured(size, seq_len, peak_bytes);
        }
        if let Some(p) = self.eval_pass.as_mut() {
            let r = &mut p.record;
            r.chunks += 1;
            if peak_bytes >= r.peak_bytes {
                r.peak_bytes = peak_bytes;
                r.limit_bytes = limit_bytes.max(1);
                r.usage = peak_bytes as f64 / r.limit_bytes as f64;
            }
        }
    }

    /// An evaluation chunk of `size` ran out of memory: the size to retry its samples
    /// with, `None` when one sample does not fit (the driver then fails the evaluation).
    /// Without a controller, halved.
    pub fn eval_oom(&mut self, size: usize, seq_len: usize, error: &str) -> Option<usize> {
        let (retry, decision) = match self.controller.as_mut() {
            Some(c) => {
                let (retry, d) = c.eval_oom(size, seq_len);
                (retry, Some(d))
            }
            None => ((size > 1).then_some(size / 2), None),
        };
        let phase = match self.eval_pass.as_mut() {
            Some(p) => {
                p.record.ooms += 1;
                p.record.chunks += 1;
                if let Some(n) = retry {
                    p.record.size = n;
                }
                p.phase.clone()
            }
            None => "eval".to_string(),
        };
        self.send(Telemetry::EvalOom {
            step: self.step,
            phase,
            size,
            seq_len,
            retry_with: retry,
            error: error.lines().next().unwrap_or_default().to_string(),
        });
        self.decided(self.step, decision.into_iter().collect());
        retry
    }

    /// The pass ends: its `eval_memory` record (none when no pass was open or it ran no
    /// batch).
    pub fn eval_end(&mut self) -> Option<EvalMemory> {
        let p = self.eval_pass.take()?;
        if p.record.batches == 0 {
            return None;
        }
        let mut record = p.record;
        record.seconds = p.started.elapsed().as_secs_f64();
        self.send(Telemetry::EvalMemory(record.clone()));
        Some(record)
    }
}
