//! What a key does: the state it changes on the screen, and the command it asks the
//! run for (sent by the event loop, shown once the trainer confirms it).
use headroom_core::config::Checkpointing;
use headroom_core::{Command, Level, RunStatus};

use super::{App, Focus};
use crate::editor::{next_profile, ThresholdEditor};
use crate::feed::ReplayControl;
use crate::job::rank_of_name;
use crate::keys::Action;
use crate::mode::Mode;

/// What a command key says in a replay.
pub const READ_ONLY: &str = "commands are disabled in a replay: it only shows the log";

/// What the event loop must do after a key.
#[derive(Debug, Clone, PartialEq)]
pub enum Reaction {
    Nothing,
    Send(Command),
    /// Leave now, without waiting for the trainer.
    Exit,
    /// Hand the terminal back and stop the process until the shell continues it.
    Suspend,
    /// Leave an attached view; the run goes on.
    Detach,
    /// Steer the replay.
    Replay(ReplayControl),
    /// Show this rank of the job: the client switches the panels to its stream.
    SelectRank(u32),
}

impl App {
    /// Applies a key's action; the caller sends the command, if any.
    pub fn handle(&mut self, action: Action) -> Reaction {
        if self.confirm_stop {
            return self.handle_confirm(action);
        }
        if let Some(reaction) = self.handle_editor(action) {
            return reaction;
        }
        if self.mode.is_replay() && sends_command(action) {
            self.say_read_only();
            return Reaction::Nothing;
        }
        match action {
            // A viewer leaves; the run goes on. Once it is over there is nothing to leave
            // running: closing is all `q` does.
            Action::Quit if self.mode.is_attached() && !self.is_over() => Reaction::Detach,
            Action::Quit if self.mode != Mode::InProcess => Reaction::Exit,
            Action::Quit if self.stop_requested || self.is_over() => Reaction::Exit,
            Action::Quit => {
                self.stop_requested = true;
                self.show_help = false;
                self.editor = None;
                // Said at once; the trainer gives the step in progress up at its next
                // micro-batch and saves the last completed one.
                let text = match self.last_step.as_ref().map(|s| s.step) {
                    Some(n) => format!(
                        "stopping: the step in progress is abandoned at its next micro-batch; \
                         the checkpoint will be of step {n} (q again: quit now)"
                    ),
                    None => "stopping: no step has completed yet (q again: quit now)".into(),
                };
                self.log(Level::Info, text);
                Reaction::Send(Command::Stop)
            }
            Action::Suspend => Reaction::Suspend,
            // Decided by the status the trainer confirmed, not by what was last pressed.
            Action::TogglePause if !self.takes_commands() => Reaction::Nothing,
            Action::TogglePause => match self.status {
                RunStatus::Running => Reaction::Send(Command::Pause),
                RunStatus::Paused => Reaction::Send(Command::Resume),
                _ => Reaction::Nothing,
            },
            Action::Checkpoint if self.takes_commands() => Reaction::Send(Command::Checkpoint),
            Action::Checkpoint => Reaction::Nothing,
            Action::ToggleHelp => {
                self.show_help = !self.show_help;
                Reaction::Nothing
            }
            Action::ToggleEvents => {
                self.show_events = !self.show_events;
                self.show_help = false;
                Reaction::Nothing
            }
            // The topmost overlay first: help, then the event list.
            Action::Back if self.show_help => {
                self.show_help = false;
                Reaction::Nothing
            }
            Action::Back => {
                self.show_events = false;
                Reaction::Nothing
            }
            Action::FocusNext => {
                self.focus = self.focus.shifted(1);
                Reaction::Nothing
            }
            Action::FocusPrev => {
                self.focus = self.focus.shifted(-1);
                Reaction::Nothing
            }
            Action::Scroll(by) if self.focus == Focus::Events || self.show_events => {
                let max = self.events.len().saturating_sub(1);
                self.event_scroll = self
                    .event_scroll
                    .saturating_add_signed(by as isize)
                    .min(max);
                Reaction::Nothing
            }
            Action::Scroll(_) => Reaction::Nothing,
            Action::ScrollTop => {
                self.event_scroll = 0;
                Reaction::Nothing
            }
            Action::CycleWindow => {
                self.window = self.window.next();
                Reaction::Nothing
            }
            Action::EditThresholds if self.takes_commands() => {
                self.show_help = false;
                // Starts from what is in force; before the trainer reported any, from the
                // default it will most likely report.
                let start = self.policy.thresholds.unwrap_or_default();
                self.editor = Some(ThresholdEditor::new(start));
                Reaction::Nothing
            }
            Action::CycleProfile if self.takes_commands() => {
                let next = next_profile(self.policy.profile);
                Reaction::Send(Command::SetProfile { profile: next })
            }
            Action::TogglePin if self.policy.pinned && self.takes_commands() => {
                Reaction::Send(Command::Unpin)
            }
            Action::TogglePin => self.pin_at(|n| n),
            Action::DoubleBatch => self.pin_at(|n| n.saturating_mul(2)),
            Action::HalveBatch => self.pin_at(|n| n / 2),
            Action::FreeCache if self.takes_commands() => Reaction::Send(Command::FreeCache),
            Action::TogglePrecision if self.takes_commands() => match self.levers().precision {
                Some(now) => Reaction::Send(Command::SetPrecision {
                    precision: self.levers().other_precision(now),
                }),
                None => self.not_the_runs("precision", "precision=\"fp32\""),
            },
            Action::ToggleCheckpointing if self.takes_commands() => {
                match self.levers().checkpointing {
                    Some(now) => Reaction::Send(Command::SetCheckpointing {
                        checkpoint: if now.is_on() {
                            Checkpointing::None
                        } else {
                            Checkpointing::Blocks
                        },
                    }),
                    None => self
                        .not_the_runs("activation checkpointing", "checkpoint_blocks=[the blocks]"),
                }
            }
            Action::StopRun if self.mode.is_attached() && self.takes_commands() => {
                self.confirm_stop = true;
                self.show_help = false;
                self.editor = None;
                Reaction::Nothing
            }
            Action::Replay(control) if self.mode.is_replay() => Reaction::Replay(control),
            Action::ShiftRank(by) => match self.job.as_ref().and_then(|j| j.shifted(by)) {
                Some(rank) => self.select_rank(rank),
                None => Reaction::Nothing,
            },
            Action::PickRank(rank) => self.select_rank(rank),
            Action::StopRun | Action::Replay(_) | Action::Confirm(_) => Reaction::Nothing,
            // A finished run takes no commands; the editor's keys need the editor.
            Action::EditThresholds
            | Action::CycleProfile
            | Action::FreeCache
            | Action::TogglePrecision
            | Action::ToggleCheckpointing
            | Action::SelectThreshold(_)
            | Action::AdjustThreshold(_)
            | Action::ApplyThresholds => Reaction::Nothing,
        }
    }

    /// A lever key on a run that keeps that lever: said, nothing sent.
    fn not_the_runs(&mut self, lever: &str, how: &str) -> Reaction {
        self.log(
            Level::Warn,
            format!(
                "this run's {lever} is its script's, not headroom's (a Python run hands it \
                 over with headroom.Run({how}))"
            ),
        );
        Reaction::Nothing
    }

    /// Pins the micro-batch at `f(current)`; nothing when no step has reported one.
    fn pin_at(&mut self, f: impl Fn(usize) -> usize) -> Reaction {
        if !self.takes_commands() {
            return Reaction::Nothing;
        }
        match self.micro_batch() {
            Some(n) => Reaction::Send(Command::PinMicroBatch {
                micro_batch: f(n).max(1),
            }),
            None => {
                self.log(Level::Warn, "no micro-batch to pin before the first step");
                Reaction::Nothing
            }
        }
    }

    /// Marks `rank` selected and asks for its panels, where a client can switch them.
    fn select_rank(&mut self, rank: u32) -> Reaction {
        let Some(job) = &mut self.job else {
            return Reaction::Nothing;
        };
        if !job.select(rank) {
            let n = job.rows.world_size;
            let text = format!(
                "no rank {rank}: the job has {n} (0-{})",
                n.saturating_sub(1)
            );
            self.log(Level::Warn, text);
            return Reaction::Nothing;
        }
        if self.mode.is_replay() && !self.replay_has_ranks {
            let panels = rank_of_name(&self.run_name);
            if panels != Some(rank) {
                let shown = panels.map_or("the log's".to_string(), |p| format!("rank {p}'s"));
                job.unreachable = Some((
                    rank,
                    format!("this replay has {shown} log only (replay rank {rank}'s log to see its panels)"),
                ));
            }
            return Reaction::Nothing;
        }
        Reaction::SelectRank(rank)
    }

    /// The answer to "stop the run? y/n": only `y` sends the stop.
    fn handle_confirm(&mut self, action: Action) -> Reaction {
        match action {
            Action::Confirm(true) => {
                self.confirm_stop = false;
                if !self.takes_commands() {
                    return Reaction::Nothing;
                }
                self.stop_requested = true;
                self.log(
                    Level::Info,
                    "stop requested: the run stops with a checkpoint of its last completed step (q detaches)",
                );
                Reaction::Send(Command::Stop)
            }
            Action::Confirm(false) | Action::Back => {
                self.confirm_stop = false;
                self.log(Level::Info, "stop cancelled: the run goes on");
                Reaction::Nothing
            }
            Action::Quit => {
                self.confirm_stop = false;
                self.handle(Action::Quit)
            }
            Action::Suspend => Reaction::Suspend,
            _ => Reaction::Nothing,
        }
    }

    /// Said once per press, and never twice in a row in the log.
    pub fn say_read_only(&mut self) {
        if self.events.front().is_some_and(|e| e.text == READ_ONLY) {
            return;
        }
        self.log(Level::Warn, READ_ONLY);
    }

    /// Keys of the threshold editor; `None` when it is not open.
    fn handle_editor(&mut self, action: Action) -> Option<Reaction> {
        let (over, help) = (self.is_over(), self.show_help);
        let ed = self.editor.as_mut()?;
        match action {
            Action::SelectThreshold(by) => ed.select(by),
            Action::AdjustThreshold(by) => ed.adjust(by),
            Action::CycleProfile => ed.cycle_profile(),
            // Nobody left to send it to.
            Action::ApplyThresholds if over => self.editor = None,
            Action::ApplyThresholds => {
                // Checked here first so a typo is explained at once, with nothing sent.
                return Some(match ed.submit() {
                    Some(t) => Reaction::Send(Command::SetThresholds { thresholds: t }),
                    None => Reaction::Nothing,
                });
            }
            // Esc closes the help shown over the editor before the editor itself.
            Action::Back if !help => self.editor = None,
            _ => return None,
        }
        Some(Reaction::Nothing)
    }
}

/// Whether a key's action would send the run a command (in some state of the run).
fn sends_command(action: Action) -> bool {
    matches!(
        action,
        Action::TogglePause
            | Action::Checkpoint
            | Action::EditThresholds
            | Action::CycleProfile
            | Action::TogglePin
            | Action::DoubleBatch
            | Action::HalveBatch
            | Action::FreeCache
            | Action::TogglePrecision
            | Action::ToggleCheckpointing
            | Action::StopRun
    )
}
