//! A command from the dashboard, a viewer or a job: answered here, whoever drives the run.
//! Every answer's text is in this file; what only the driver can carry out (a checkpoint,
//! freeing a cache, a lever) is handed back to it, and its answer comes back through
//! [`Session::answer`].
use headroom_core::policy::{Profile, Thresholds};
use headroom_core::{Command, Level, Precision, RunStatus, Telemetry};

use super::Session;

/// What became of a command.
#[derive(Debug, Clone, PartialEq)]
pub enum Handled {
    /// Answered (or refused) here.
    Answered,
    /// The driver carries it out and answers with [`Session::answer`].
    Driver(Command),
}

impl Session {
    /// Acts on one command.
    pub fn handle(&mut self, cmd: Command) -> Handled {
        match cmd {
            Command::Stop => self.stop(Some(cmd)),
            Command::Pause if self.paused => {
                let text = format!("already paused after step {}", self.step);
                self.answer(cmd, text);
            }
            Command::Pause => {
                self.paused = true;
                self.status(RunStatus::Paused);
                let text = format!("paused after step {}", self.step);
                self.answer(cmd, text);
            }
            Command::Resume if self.paused => {
                self.paused = false;
                self.status(RunStatus::Running);
                let text = format!("resumed at step {}", self.step + 1);
                self.answer(cmd, text);
            }
            Command::Resume => self.answer(cmd, "already running".into()),
            Command::SetThresholds { thresholds } => self.set_thresholds(cmd, thresholds, None),
            Command::SetProfile { profile } => {
                self.set_thresholds(cmd, profile.thresholds(), Some(profile))
            }
            Command::PinMicroBatch { micro_batch } => self.pin(cmd, micro_batch),
            Command::Unpin => match self.controller.as_mut() {
                Some(c) => {
                    c.unpin();
                    self.answer(
                        cmd,
                        "micro-batch unpinned; the controller resizes again".into(),
                    );
                }
                None => self.answer(cmd, "refused: a watch-only run has no micro-batch".into()),
            },
            Command::SetPrecision { precision } => match self.precision {
                None => self.answer(
                    cmd,
                    "refused: this run's precision is set by its script (give \
                     headroom.Run(precision=\"fp32\") and the run switches autocast in its \
                     run.backward)"
                        .into(),
                ),
                Some(now) if now == precision => {
                    self.answer(cmd, format!("precision is already {precision}"))
                }
                Some(_) if precision != Precision::Fp32 && precision != self.half => self.answer(
                    cmd,
                    format!(
                        "refused: this run switches between fp32 and {half}, not {precision} \
                         (fp16 needs a loss scaler: a Python run's \
                         headroom.Run(precision=\"fp32\", half_precision=\"fp16\") has one)",
                        half = self.half
                    ),
                ),
                Some(_) => return Handled::Driver(cmd),
            },
            Command::SetCheckpointing { checkpoint } => match self.checkpointing {
                None => self.answer(
                    cmd,
                    "refused: this run's activation checkpointing is set by its script (give \
                     headroom.Run(checkpoint_blocks=[…]) with the modules to checkpoint)"
                        .into(),
                ),
                Some(now) if now == checkpoint => self.answer(
                    cmd,
                    format!("activation checkpointing is already {checkpoint}"),
                ),
                Some(_) => return Handled::Driver(cmd),
            },
            Command::Checkpoint | Command::FreeCache => return Handled::Driver(cmd),
        }
        Handled::Answered
    }

    /// What a command did, on the screen and in the log.
    pub fn answer(&self, command: Command, applied: String) {
        self.send(Telemetry::CommandApplied { command, applied });
    }

    /// A stop, from a command (answered) or because nobody can send one any more (the
    /// command channel closed). Said once, however often it is asked.
    pub fn stop(&mut self, cmd: Option<Command>) {
        self.paused = false;
        if !self.stop_requested {
            self.stop_requested = true;
            self.status(RunStatus::Stopping);
        }
        if let Some(cmd) = cmd {
            let text = if self.driver.script {
                format!(
                    "stopping after step {} (run.should_stop is set; the loop ends when it \
                     reads it); {}",
                    self.step,
                    self.stop_checkpoint_text(false)
                )
            } else {
                format!("stopping after step {}", self.step)
            };
            self.answer(cmd, text);
        }
    }

    /// A stop asked by a signal (`why`, e.g. "SIGTERM") in a script's run: as the
    /// dashboard's stop, said with its cause and what the loop does with it.
    pub fn signal_stop(&mut self, why: &str) {
        self.stop(None);
        let text = format!(
            "{why}: stopping; {} (a step in progress in run.backward() is abandoned at its \
             next micro-batch; a loop that only reports ends when it reads run.should_stop, \
             or at the next step's end; {why} again within 1 s is the same request, a \
             second signal later ends the process at once)",
            self.stop_checkpoint_text(true)
        );
        self.notice(Level::Warn, "signal", text);
    }

    /// What a stop saves, said where the stop is asked for. `mid_step`: asked during a
    /// step (a signal), which a watch-only loop finishes before the checkpoint.
    fn stop_checkpoint_text(&self, mid_step: bool) -> String {
        if self.driver.checkpoints && mid_step && self.controller.is_none() {
            "the checkpoint will be taken at the end of the step in progress".to_string()
        } else if self.driver.checkpoints {
            format!("the checkpoint will be of step {}", self.step)
        } else {
            "no checkpoint will be taken: this run has no on_checkpoint (give \
             headroom.Run(on_checkpoint=fn), fn(step) saving and returning the path)"
                .to_string()
        }
    }

    /// A threshold change: in force and confirmed, or refused with the old values kept
    /// and the reason said.
    fn set_thresholds(&mut self, cmd: Command, t: Thresholds, profile: Option<Profile>) {
        let old = self.thresholds();
        let result = match self.controller.as_mut() {
            Some(c) => c.set_thresholds(t),
            None => t.validate().map(|()| self.thresholds = t),
        };
        let text = match result {
            Ok(()) => {
                self.thresholds_changed("command", profile);
                match profile {
                    Some(p) => format!("profile {p}: thresholds {t}"),
                    None => format!("thresholds {t} in force"),
                }
            }
            Err(e) => format!("refused: {e}; {old} stay in force"),
        };
        self.answer(cmd, text);
    }

    fn pin(&mut self, cmd: Command, micro_batch: usize) {
        let step = self.step;
        let Some(c) = self.controller.as_mut() else {
            self.answer(
                cmd,
                "refused: a watch-only run has no micro-batch to pin (adaptive runs hand their \
                 batch to run.backward)"
                    .into(),
            );
            return;
        };
        let decisions = c.pin(micro_batch);
        let mb = c.micro_batch();
        self.decided(step, decisions);
        let note = if mb == micro_batch {
            String::new()
        } else {
            format!(" ({micro_batch} is outside the allowed range)")
        };
        let text = format!(
            "micro-batch pinned at {mb}{note}, {} accumulation steps",
            self.effective_batch.div_ceil(mb.max(1))
        );
        self.answer(cmd, text);
    }
}
