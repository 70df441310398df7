//! Commands at a step boundary: the session answers them; what only this trainer can do
//! (a checkpoint, freeing the cache, switching a lever on its model) comes back here.
use crossbeam_channel::{Receiver, TryRecvError};
use headroom_core::config::{Checkpointing, Precision};
use headroom_core::Command;
use headroom_host::session::Handled;

use super::{Flow, Trainer};
use crate::oom;

impl Trainer {
    /// Acts on every waiting command; blocks while paused.
    pub(super) fn drain_commands(&mut self, commands: &Receiver<Command>) -> Result<Flow, String> {
        loop {
            let cmd = if let Some(c) = self.pending.pop_front() {
                c
            } else if self.session.paused() {
                match commands.recv() {
                    Ok(c) => c,
                    // Nobody can resume us any more: stop cleanly rather than hang.
                    Err(_) => return Ok(self.stop(None)),
                }
            } else {
                match commands.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => return Ok(Flow::Continue),
                    Err(TryRecvError::Disconnected) => return Ok(self.stop(None)),
                }
            };
            if let Command::Stop = cmd {
                return Ok(self.stop(Some(cmd)));
            }
            if let Handled::Driver(cmd) = self.session.handle(cmd) {
                let text = self.carry_out(&cmd);
                self.session.answer(cmd, text);
            }
        }
    }

    fn stop(&mut self, cmd: Option<Command>) -> Flow {
        self.session.stop(cmd);
        Flow::Stop
    }

    /// What the session hands back, done; what it did.
    fn carry_out(&mut self, cmd: &Command) -> String {
        match *cmd {
            Command::Checkpoint => match self.checkpoint() {
                Ok(path) => format!(
                    "checkpoint of step {} at {}",
                    self.session.step(),
                    path.display()
                ),
                Err(e) => format!("checkpoint failed: {e}"),
            },
            // The session answers a switch to what is in force already.
            Command::SetPrecision { precision } => self
                .switch_precision(precision, "command")
                .unwrap_or_default(),
            Command::SetCheckpointing { checkpoint } => self
                .switch_checkpointing(checkpoint, "command")
                .unwrap_or_default(),
            Command::FreeCache => {
                let (what, before) = oom::held(self.device);
                match oom::free_cached(self.device) {
                    Ok(()) => {
                        let after = oom::held(self.device).1;
                        format!("cached memory freed: {what} {before} → {after}")
                    }
                    Err(e) => format!("freeing cached memory failed: {e}"),
                }
            }
            // The session answers every other command itself.
            _ => String::new(),
        }
    }

    /// A precision switch, from the next step on; what the run's checkpoints record too.
    pub(super) fn switch_precision(
        &mut self,
        to: Precision,
        source: &'static str,
    ) -> Option<String> {
        let was = self.model.precision();
        if was == to {
            return None;
        }
        self.model.set_precision(to);
        self.cfg.model.precision = to;
        Some(self.session.switched_precision(was, to, source))
    }

    /// An activation-checkpointing switch, from the next step on.
    pub(super) fn switch_checkpointing(
        &mut self,
        to: Checkpointing,
        source: &'static str,
    ) -> Option<String> {
        let was = self.model.checkpointing();
        if was == to {
            return None;
        }
        self.model.set_checkpointing(to);
        self.cfg.model.checkpoint = to;
        Some(self.session.switched_checkpointing(was, to, source))
    }
}
