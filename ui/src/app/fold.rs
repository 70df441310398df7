//! The telemetry fold: each record of the run, and each word on the link to it, folded
//! into the state the screen shows.
use headroom_core::units::fmt_count;
use headroom_core::{Command, Level, Record, RunStatus, Telemetry};

use super::echo::echo_of;
use super::App;
use crate::describe::eval_pass;
use crate::editor::EditStatus;
use crate::feed::Link;
use crate::job::JobView;
use crate::mode::{LinkView, Mode};
use crate::policy::is_refusal;

impl App {
    /// News of the connection: shown, and a reconnect starts the run's state afresh (its
    /// catch-up follows).
    pub fn apply_link(&mut self, news: &Link) {
        match news {
            Link::Connected { run_id } => {
                if self.run_t.is_some() || !self.link.is_up() {
                    self.reset_run();
                }
                self.link = LinkView::Up;
                let text = match self.mode {
                    Mode::Replay { .. } => format!("replaying {run_id}"),
                    _ => format!("connected to run {run_id}"),
                };
                self.log(Level::Info, text);
            }
            Link::Lost { reason } => {
                self.link = LinkView::Lost {
                    reason: reason.clone(),
                    retry: None,
                };
                self.confirm_stop = false;
                self.editor = None;
                self.log(Level::Warn, format!("connection lost: {reason}"));
            }
            Link::Retrying { attempt, in_s } => {
                let reason = match &self.link {
                    LinkView::Lost { reason, .. } => reason.clone(),
                    _ => "not connected".to_string(),
                };
                self.link = LinkView::Lost {
                    reason,
                    retry: Some((*attempt, *in_s)),
                };
            }
            Link::Closed { reason } => {
                self.link = LinkView::Closed {
                    reason: reason.clone(),
                };
                self.confirm_stop = false;
                self.editor = None;
                self.log(Level::Warn, format!("connection closed: {reason}"));
            }
            Link::RankUnreachable { rank, reason } => {
                if let Some(job) = &mut self.job {
                    job.unreachable = Some((*rank, reason.clone()));
                }
                self.log(
                    Level::Warn,
                    format!("rank {rank}'s panels cannot be shown: {reason}"),
                );
            }
        }
    }

    /// A record of the run: its state folded in at the run's own time, so a catch-up
    /// burst spreads over the charts as the run lived it.
    pub fn apply_record(&mut self, record: &Record) {
        self.run_t = Some(self.run_t.map_or(record.t, |t| t.max(record.t)));
        self.apply_at(record.t, &record.msg);
    }

    /// A message at the header's time (the screen's own notices, tests).
    pub fn apply(&mut self, msg: &Telemetry) {
        self.apply_at(self.elapsed, msg);
    }

    /// The screen's own word on the run's latest record (its end): stamped no earlier than
    /// that record, since a replay's records can run ahead of its clock (`--end`, `G`).
    pub fn apply_after_latest(&mut self, msg: &Telemetry) {
        let t = self.run_t.map_or(self.elapsed, |r| r.max(self.elapsed));
        self.apply_at(t, msg);
    }

    fn apply_at(&mut self, t: f64, msg: &Telemetry) {
        self.breakdown.observe(msg);
        self.eval.observe(msg);
        if let Some((level, text)) = self.policy.apply(t, msg) {
            self.log_at(t, level, text, echo_of(msg));
        }
        match msg {
            Telemetry::RunStarted(info) => {
                let model = match info.parameters {
                    0 => "model not given".to_string(),
                    n => format!("{:.2}M parameters", n as f64 / 1e6),
                };
                let steps = match info.total_steps {
                    0 => format!(
                        "from step {}, no total given",
                        fmt_count(info.start_step + 1)
                    ),
                    n => format!("steps {}..{}", info.start_step + 1, n),
                };
                self.log_t(
                    t,
                    Level::Info,
                    format!(
                        "run '{}' started on {} ({model}, {steps})",
                        info.run_name, info.device
                    ),
                );
                self.run_name = info.run_name.clone();
                self.info = Some(info.clone());
            }
            Telemetry::Step(s) => {
                self.loss.push(s.step as f64, s.loss);
                self.last_step = Some(s.clone());
            }
            Telemetry::Eval(e) => {
                self.val_loss.push(e.step as f64, e.val_loss);
                self.log_t(
                    t,
                    Level::Info,
                    format!(
                        "eval at step {}: val {:.4}, train {:.4}",
                        e.step, e.val_loss, e.train_loss
                    ),
                );
                self.last_eval = Some(e.clone());
            }
            // The pass's OOMs were logged as they came (`policy`); its end says what it
            // ran at, and for a pass with no loss to report (prediction, a script's own
            // evaluation) it is the only entry the pass gets.
            Telemetry::EvalMemory(m) => {
                if let Some(text) = eval_pass(m).into_iter().next() {
                    self.log_t(t, Level::Info, text);
                }
            }
            Telemetry::Sample(s) => {
                self.heap.observe(s.heap.as_ref(), self.step());
                self.sample = Some(s.clone());
                if let Some(m) = self.memory_now() {
                    self.memory.push(t, m.used as f64);
                }
            }
            Telemetry::Segments(map) => self.segments = Some(map.clone()),
            Telemetry::JobRanks(rows) => match &mut self.job {
                Some(job) => job.update(rows.clone(), t),
                None => self.job = Some(JobView::new(rows.clone(), t, self.panels_rank())),
            },
            Telemetry::Status { status } => {
                self.status = *status;
                self.log_at(
                    t,
                    Level::Info,
                    format!("status: {}", status.label()),
                    echo_of(msg),
                );
            }
            Telemetry::Notice(n) => self.log_t(t, n.level, format!("[{}] {}", n.source, n.text)),
            Telemetry::CheckpointSaved { step, path } => {
                self.log_t(t, Level::Info, format!("checkpoint at step {step}: {path}"))
            }
            Telemetry::CommandApplied { command, applied } => {
                self.command_applied(t, command, applied)
            }
            Telemetry::ThresholdsChanged { thresholds, .. } => {
                // The values sent are in force: the edit is done.
                if let Some(ed) = &self.editor {
                    if ed.status == EditStatus::Sent(*thresholds) {
                        self.editor = None;
                    }
                }
            }
            Telemetry::Finished(s) => {
                self.status = RunStatus::Finished;
                let how = if s.stopped_by_user {
                    "stopped"
                } else {
                    "completed"
                };
                let at = match s.total_steps {
                    0 => format!("step {}", s.steps_done),
                    n => format!("step {}/{n}", s.steps_done),
                };
                self.log_t(t, Level::Info, format!("run {how} at {at}"));
                self.summary = Some(s.clone());
            }
            Telemetry::Hint(h) => {
                let (level, what) = if h.raised {
                    self.hints.insert(h.hint, h.clone());
                    (Level::Warn, "hint")
                } else {
                    self.hints.remove(&h.hint);
                    (Level::Info, "hint cleared")
                };
                self.log_t(t, level, format!("{what}: {}: {}", h.hint.label(), h.text));
            }
            Telemetry::Failed { reason } => {
                self.status = RunStatus::Failed;
                self.failure = Some(reason.clone());
                self.log_t(t, Level::Error, format!("run failed: {reason}"));
            }
            _ => {}
        }
    }

    fn command_applied(&mut self, t: f64, command: &Command, applied: &str) {
        if let (false, Some(levers)) = (
            is_refusal(applied),
            self.info.as_mut().and_then(|i| i.levers.as_mut()),
        ) {
            levers.switched(command);
        }
        let model = self
            .info
            .as_mut()
            .and_then(|i| i.config.as_mut())
            .map(|c| &mut c.model);
        if let (false, Some(model)) = (is_refusal(applied), model) {
            match command {
                Command::SetPrecision { precision } => model.precision = *precision,
                Command::SetCheckpointing { checkpoint } => model.checkpoint = *checkpoint,
                _ => {}
            }
        }
        if !is_refusal(applied) {
            if !self.merge_answer(t, command, applied) {
                self.log_t(t, Level::Info, applied);
            }
            return;
        }
        self.log_t(t, Level::Warn, applied);
        // A refused threshold change is shown where it was made, with the draft kept so
        // it can be fixed; the old values stay in force (nothing was confirmed).
        let threshold_change = matches!(
            command,
            Command::SetThresholds { .. } | Command::SetProfile { .. }
        );
        if let (true, Some(ed)) = (threshold_change, &mut self.editor) {
            ed.status = EditStatus::Refused(applied.to_string());
        }
    }
}
