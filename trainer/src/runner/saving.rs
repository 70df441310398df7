//! Validation and checkpoints: what this trainer keeps of a run between its steps.
use std::path::PathBuf;

use headroom_core::Level;

use super::{attempt, Failure, Trainer};
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

    /// Validation in chunks of the current micro-batch, halved after an out-of-memory error
    /// (the result does not depend on the chunk).
    fn evaluate_fitting(&mut self) -> Result<f64, String> {
        let mut chunk = self.micro_batch();
        loop {
            let (model, data, offsets) = (&self.model, &self.data, &self.val_offsets);
            match attempt(self.hard_limit, || {
                step::evaluate(model, data, offsets, chunk)
            }) {
                Ok(v) => return Ok(v),
                Err(Failure::Oom(_)) if chunk > 1 => {}
                Err(Failure::Oom(e) | Failure::Other(e)) => {
                    return Err(format!(
                        "validation at step {} failed: {e}",
                        self.session.step()
                    ));
                }
            }
            let _ = oom::free_cached(self.device);
            self.session.notice(
                Level::Warn,
                "memory",
                format!(
                    "validation ran out of memory in chunks of {chunk}; retrying in chunks of {}",
                    chunk / 2
                ),
            );
            chunk /= 2;
        }
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
