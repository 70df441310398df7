//! Validation and checkpoints: what this trainer keeps of a run between its steps.
use std::path::PathBuf;

use headroom_core::Level;
use tch::{Kind, Tensor};

use super::{attempt, first_line, Failure, Trainer};
use crate::checkpoint::{self, CheckpointError, CheckpointState};
use crate::oom;
use crate::step;

impl Trainer {
    pub(super) fn evaluate(&mut self) -> Result<(), String> {
        let val_loss = self.evaluate_fitting()?;
        let (sum, n) = self.losses_since_eval;
        // No step since the last evaluation (a run stopped before its first step): the
        // freshest figure there is stands in, so the record never holds a NaN.
        let train_loss = if n > 0 {
            sum / n as f64
        } else {
            self.session.last_loss().unwrap_or(val_loss)
        };
        let step = self.session.step();
        self.losses_since_eval = (0.0, 0);
        self.last_eval_step = Some(step);
        let tokens = (self.val_offsets.len() * self.data.seq_len()) as u64;
        self.session.eval(step, val_loss, train_loss, tokens);
        Ok(())
    }

    /// Validation as the session's evaluation phase (`validation`): the windows in
    /// batches of the training micro-batch, each batch in chunks of the size the
    /// controller gives (core/src/policy/eval.rs), each chunk's peak measured as a step's
    /// is. A chunk that runs out of memory is retried smaller, its own windows only, and
    /// the smaller size is kept for the next batch and the next validation; training's
    /// micro-batch is not touched. The pass ends with its `eval_memory` record, failed or
    /// not. The result does not depend on the chunks ([`step::validation_sum`]).
    fn evaluate_fitting(&mut self) -> Result<f64, String> {
        self.session.eval_begin("validation");
        let result = self.validation_pass();
        self.session.eval_end();
        result
    }

    fn validation_pass(&mut self) -> Result<f64, String> {
        let step = self.session.step();
        let failed = |e: &dyn std::fmt::Display| format!("validation at step {step} failed: {e}");
        let offsets = self.val_offsets.clone();
        if offsets.is_empty() {
            return Ok(f64::NAN);
        }
        let seq = self.data.seq_len();
        let asked = self.micro_batch().max(1);
        let mut total = Tensor::f_zeros([], (Kind::Double, self.device)).map_err(|e| failed(&e))?;
        for batch in offsets.chunks(asked) {
            let mut size = self.session.eval_size(batch.len(), seq).max(1);
            let mut rest = batch;
            while !rest.is_empty() {
                let (part, after) = rest.split_at(size.min(rest.len()));
                let inject = part.len() > 1 && {
                    self.eval_chunks_tried += 1;
                    self.inject_eval_oom.remove(&self.eval_chunks_tried)
                };
                if let Err(e) = self.meter.reset() {
                    self.session.notice(Level::Warn, "memory", e);
                }
                let (model, data, sum) = (&self.model, &self.data, &total);
                match attempt(self.hard_limit, || {
                    sum.f_add(&step::validation_sum(model, data, part, inject)?)
                }) {
                    Ok(t) => {
                        total = t;
                        match self.meter.peak() {
                            Ok(peak) => {
                                let limit = self.meter.current_limit();
                                self.session.eval_chunk(part.len(), seq, peak, limit);
                            }
                            Err(e) => self.session.notice(Level::Warn, "memory", e),
                        }
                        rest = after;
                    }
                    Err(Failure::Oom(e)) => {
                        let _ = oom::free_cached(self.device);
                        // Said by the session: an `eval_oom` record and an `eval_size`
                        // decision (the event log's line).
                        match self.session.eval_oom(part.len(), seq, &e) {
                            Some(smaller) => size = smaller,
                            None => {
                                return Err(failed(&format_args!(
                                    "one validation window of {seq} tokens does not fit in \
                                     memory ({})",
                                    first_line(&e)
                                )))
                            }
                        }
                    }
                    Err(Failure::Other(e)) => return Err(failed(&e)),
                }
            }
        }
        step::validation_mean(&self.data, offsets.len(), &total).map_err(|e| failed(&e))
    }

    /// Saves the current state (once per step: a second request reports the first save).
    pub(super) fn checkpoint(&mut self) -> Result<PathBuf, CheckpointError> {
        let step = self.session.step();
        let path = match &self.saved {
            Some((saved, path)) if *saved == step => path.clone(),
            _ => {
                let state = CheckpointState::new(
                    step,
                    self.session.tokens_seen(),
                    &self.cfg,
                    &self.model,
                    self.micro_batch(),
                )
                .with_corpus(Some(self.corpus.clone()))
                .with_controller(self.session.controller().map(|c| c.journal().clone()));
                let save =
                    || checkpoint::save(&self.checkpoint_dir, &self.model, &self.opt, &state);
                let path = match save() {
                    Ok(path) => path,
                    Err(first) => {
                        // Most often a full disk: older checkpoints go first, the newest
                        // one stays whatever happens, and the save is tried once more.
                        let keep = self.saved.as_ref().map(|s| s.1.as_path());
                        let removed = checkpoint::prune_all_but(&self.checkpoint_dir, keep);
                        if removed.is_empty() {
                            return Err(first);
                        }
                        self.session.notice(
                            Level::Warn,
                            "checkpoint",
                            format!(
                                "saving step {step} failed ({first}); deleted older \
                                 checkpoints ({}) to make room and trying again",
                                removed.join(", ")
                            ),
                        );
                        save()?
                    }
                };
                self.saved = Some((step, path.clone()));
                path
            }
        };
        self.session
            .checkpoint_saved(step, path.display().to_string());
        Ok(path)
    }

    /// What is on disk after a failed save: said exactly, since that is what the user keeps.
    pub(super) fn kept_text(&self) -> String {
        let step_now = self.session.step();
        match &self.saved {
            Some((step, path)) if path.join("state.json").exists() => format!(
                "Kept: the checkpoint of step {step} at {} ({} steps behind), untouched; \
                 continue from it with --resume {} once there is room",
                path.display(),
                step_now - step,
                self.checkpoint_dir.display()
            ),
            _ => format!(
                "No checkpoint of this run is on disk: the {} steps trained are lost; free \
                 space in {} (or choose another --checkpoint-dir) and start again",
                step_now - self.start_step,
                self.checkpoint_dir.display()
            ),
        }
    }
}
