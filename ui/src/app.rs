//! The dashboard's state: everything the screen shows, folded from telemetry. Pure: no
//! terminal, no clock (time is handed in), so every update is unit-tested.
//!
//! The state is one type, [`App`]; what changes it lives beside it: the telemetry fold
//! (`fold`), what a key does (`input`) and the merging of a command's confirmation into
//! the entry that announced it (`echo`).
use std::collections::{BTreeMap, VecDeque};

use headroom_core::units::{fmt_bytes, fmt_count, fmt_duration};
use headroom_core::{
    EvalMetrics, Hint, HintKind, Level, RunInfo, RunLevers, RunStatus, RunSummary, SegmentMap,
    StepMetrics, SystemSample,
};

use crate::editor::ThresholdEditor;
use crate::eval::EvalState;
use crate::heap::HeapState;
use crate::history::{History, Merge};
use crate::job::{rank_of_name, JobView};
use crate::keys::{dashboard_context, KeyContext};
use crate::mode::{LinkView, Mode, ReplayView};
use crate::policy::PolicyState;
use echo::Echo;

mod echo;
mod fold;
mod input;

pub use input::{Reaction, READ_ONLY};

/// Points kept per chart; halving keeps the whole run in this budget.
const HISTORY_POINTS: usize = 512;
/// Entries kept in the event log.
const EVENT_LOG_LEN: usize = 500;

#[derive(Debug, Clone, PartialEq)]
pub struct LogEntry {
    /// The run's time (seconds since its start) of the record that made it.
    pub t: f64,
    pub level: Level,
    pub text: String,
    /// Set while this entry announces what a command's confirmation would say again.
    echo: Option<Echo>,
}

/// The panel keys like arrows act on; drawn with a highlighted border.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Events,
    MemoryChart,
    LossChart,
}

impl Focus {
    const ORDER: [Focus; 3] = [Focus::Events, Focus::MemoryChart, Focus::LossChart];

    fn shifted(self, by: isize) -> Focus {
        let i = Self::ORDER.iter().position(|f| *f == self).unwrap_or(0) as isize;
        Self::ORDER[(i + by).rem_euclid(Self::ORDER.len() as isize) as usize]
    }
}

/// How much of the past the memory-history chart shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    OneMinute,
    FiveMinutes,
    FifteenMinutes,
    WholeRun,
}

impl Window {
    pub fn seconds(self) -> Option<f64> {
        match self {
            Window::OneMinute => Some(60.0),
            Window::FiveMinutes => Some(300.0),
            Window::FifteenMinutes => Some(900.0),
            Window::WholeRun => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Window::OneMinute => "1m",
            Window::FiveMinutes => "5m",
            Window::FifteenMinutes => "15m",
            Window::WholeRun => "run",
        }
    }

    fn next(self) -> Window {
        match self {
            Window::OneMinute => Window::FiveMinutes,
            Window::FiveMinutes => Window::FifteenMinutes,
            Window::FifteenMinutes => Window::WholeRun,
            Window::WholeRun => Window::OneMinute,
        }
    }
}

/// Memory as the gauge shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryNow {
    pub used: u64,
    pub capacity: u64,
    /// GPU memory (NVML) or, on CPU, the process's resident set against host memory.
    pub on_gpu: bool,
}

#[derive(Debug, Clone)]
pub struct App {
    pub run_name: String,
    pub color: bool,
    pub info: Option<RunInfo>,
    pub status: RunStatus,
    pub failure: Option<String>,
    /// The user asked to stop; the trainer has not confirmed yet.
    pub stop_requested: bool,
    pub last_step: Option<StepMetrics>,
    pub last_eval: Option<EvalMetrics>,
    /// Evaluation as its own phase: the last pass's memory, a failed evaluation.
    pub eval: EvalState,
    pub sample: Option<SystemSample>,
    /// The allocator's latest segment map (CUDA runs).
    pub segments: Option<SegmentMap>,
    /// The heap's figures (CPU runs).
    pub heap: HeapState,
    /// The plan's split of a step, for the memory panel's stacked bar.
    pub breakdown: crate::breakdown::BreakdownState,
    pub summary: Option<RunSummary>,
    /// Training loss by step.
    pub loss: History,
    /// Validation loss by step.
    pub val_loss: History,
    /// Memory in use by the run's seconds (see [`MemoryNow`]).
    pub memory: History,
    pub events: VecDeque<LogEntry>,
    /// The header's clock: the run's seconds as the screen last set them.
    pub elapsed: f64,
    /// The run's time of the newest record applied; `None` before the first.
    pub run_t: Option<f64>,
    pub dropped: u64,
    pub show_help: bool,
    /// The full-screen event list, every entry in full.
    pub show_events: bool,
    pub focus: Focus,
    /// Entries of the event log scrolled past (0: the newest is on top).
    pub event_scroll: usize,
    pub window: Window,
    /// Thresholds, step peaks and the controller's decisions.
    pub policy: PolicyState,
    /// The threshold editor, while it is open.
    pub editor: Option<ThresholdEditor>,
    /// In-process, attached or replay: decides what `q` does and which keys act.
    pub mode: Mode,
    /// The connection to the run (attached views).
    pub link: LinkView,
    /// Where a replay is (replays), as given at each frame.
    pub replay: Option<ReplayView>,
    /// "stop the run? y/n" is asked (attached views).
    pub confirm_stop: bool,
    /// A torchrun job's rows, once rank 0 sent some, and the rank selected.
    pub job: Option<JobView>,
    /// A replay of several ranks' logs, which can move the panels between them.
    pub replay_has_ranks: bool,
    /// The live hints up now (raised and not yet cleared), by kind.
    pub hints: BTreeMap<HintKind, Hint>,
}

impl App {
    pub fn new(run_name: &str, color: bool) -> App {
        App {
            run_name: run_name.to_string(),
            color,
            info: None,
            status: RunStatus::Starting,
            failure: None,
            stop_requested: false,
            last_step: None,
            last_eval: None,
            eval: EvalState::default(),
            sample: None,
            segments: None,
            heap: HeapState::default(),
            breakdown: Default::default(),
            summary: None,
            loss: History::new(HISTORY_POINTS, Merge::Mean),
            val_loss: History::new(HISTORY_POINTS, Merge::Mean),
            memory: History::new(HISTORY_POINTS, Merge::Max),
            events: VecDeque::with_capacity(EVENT_LOG_LEN),
            elapsed: 0.0,
            run_t: None,
            dropped: 0,
            show_help: false,
            show_events: false,
            focus: Focus::Events,
            event_scroll: 0,
            window: Window::FiveMinutes,
            policy: PolicyState::new(HISTORY_POINTS),
            editor: None,
            mode: Mode::InProcess,
            link: LinkView::Up,
            replay: None,
            confirm_stop: false,
            job: None,
            replay_has_ranks: false,
            hints: BTreeMap::new(),
        }
    }

    pub fn with_mode(mut self, mode: Mode) -> App {
        self.mode = mode;
        self
    }

    /// Starts the run's state afresh for a catch-up that follows (a reconnect, a log that
    /// restarted), keeping how the user looks at it: mode, link, focus, window, overlays.
    pub fn reset_run(&mut self) {
        let mut fresh = App::new(&self.run_name, self.color);
        fresh.mode = std::mem::take(&mut self.mode);
        fresh.link = std::mem::take(&mut self.link);
        fresh.replay = self.replay;
        fresh.show_help = self.show_help;
        fresh.show_events = self.show_events;
        fresh.focus = self.focus;
        fresh.window = self.window;
        fresh.dropped = self.dropped;
        // Rank 0's rows and the selection outlive a switch of the panels to another
        // rank's stream (which starts the run's state afresh).
        fresh.job = self.job.take();
        fresh.replay_has_ranks = self.replay_has_ranks;
        *self = fresh;
    }

    /// The rank whose stream the panels show: a torchrun rank's name ends in `.rankR`.
    pub fn panels_rank(&self) -> Option<u32> {
        rank_of_name(&self.run_name)
    }

    /// Which meaning keys have right now: the editor and the y/n question are modal.
    pub fn key_context(&self) -> KeyContext {
        match (&self.editor, self.confirm_stop) {
            (_, true) => KeyContext::ConfirmStop,
            (Some(_), _) => KeyContext::ThresholdEditor,
            (None, _) => dashboard_context(&self.mode),
        }
    }

    pub fn set_replay(&mut self, view: Option<ReplayView>) {
        self.replay = view;
    }

    /// Time is given, not read, so rendering is deterministic under test.
    pub fn set_elapsed(&mut self, secs: f64) {
        self.elapsed = secs;
    }

    pub fn set_dropped(&mut self, n: u64) {
        self.dropped = n;
    }

    /// True once the run has ended one way or the other.
    pub fn is_over(&self) -> bool {
        matches!(self.status, RunStatus::Finished | RunStatus::Failed)
    }

    /// The run is winding down: asked to stop, or the trainer said it is stopping.
    pub fn is_stopping(&self) -> bool {
        !self.is_over() && (self.stop_requested || self.status == RunStatus::Stopping)
    }

    /// Whether a command sent now would be acted on: the trainer reads commands between
    /// steps, and none once it is stopping or gone, or while the link to it is down. A
    /// replay has no run to command.
    pub fn takes_commands(&self) -> bool {
        !self.is_over() && !self.is_stopping() && self.link.is_up() && !self.mode.is_replay()
    }

    /// The levers the run switches itself, as last confirmed: its own word, else
    /// `headroom train`'s config (a log from before runs said it); none for a run that
    /// keeps its own.
    pub fn levers(&self) -> RunLevers {
        let Some(info) = self.info.as_ref() else {
            return RunLevers::default();
        };
        info.levers.unwrap_or_else(|| match &info.config {
            Some(c) => RunLevers {
                precision: Some(c.model.precision),
                checkpointing: Some(c.model.checkpoint),
                half: None,
            },
            None => RunLevers::default(),
        })
    }

    /// The micro-batch the next step runs at, as last reported.
    pub fn micro_batch(&self) -> Option<usize> {
        self.policy
            .micro_batch()
            .or(self.last_step.as_ref().map(|s| s.micro_batch))
    }

    /// An entry of the screen's own, at the header's time.
    fn log(&mut self, level: Level, text: impl Into<String>) {
        self.log_at(self.elapsed, level, text.into(), None);
    }

    fn log_t(&mut self, t: f64, level: Level, text: impl Into<String>) {
        self.log_at(t, level, text.into(), None);
    }

    fn log_at(&mut self, t: f64, level: Level, text: String, echo: Option<Echo>) {
        if self.events.len() == EVENT_LOG_LEN {
            self.events.pop_back();
        }
        // A reader scrolled into the past keeps looking at the same entries.
        if self.event_scroll > 0 {
            self.event_scroll = (self.event_scroll + 1).min(EVENT_LOG_LEN - 1);
        }
        self.events.push_front(LogEntry {
            t,
            level,
            text,
            echo,
        });
    }

    pub fn memory_now(&self) -> Option<MemoryNow> {
        let s = self.sample.as_ref()?;
        Some(match &s.gpu {
            Some(g) => MemoryNow {
                used: g.mem_used,
                capacity: g.mem_total,
                on_gpu: true,
            },
            None => MemoryNow {
                used: s.host.process_rss,
                capacity: s.host.mem_total,
                on_gpu: false,
            },
        })
    }

    pub fn total_steps(&self) -> u64 {
        self.last_step
            .as_ref()
            .map(|s| s.total_steps)
            .or(self.info.as_ref().map(|i| i.total_steps))
            .unwrap_or(0)
    }

    pub fn step(&self) -> u64 {
        self.last_step
            .as_ref()
            .map(|s| s.step)
            .or(self.info.as_ref().map(|i| i.start_step))
            .unwrap_or(0)
    }

    /// Seconds left at the last step's pace.
    pub fn eta(&self) -> Option<f64> {
        let s = self.last_step.as_ref()?;
        Some(s.total_steps.saturating_sub(s.step) as f64 * s.step_time_s)
    }

    /// `running`, `paused`, `stopping (requested)`, `failed: reason`...
    pub fn status_text(&self) -> String {
        match (&self.status, &self.failure) {
            (RunStatus::Failed, Some(r)) => format!("failed: {r}"),
            (RunStatus::Running, _) if self.stop_requested => "stop requested".into(),
            (s, _) => s.label().into(),
        }
    }

    pub fn progress_line(&self) -> String {
        let (step, total) = (self.step(), self.total_steps());
        // A run that gave no total (a Python loop) has no share done and no ETA.
        if total == 0 {
            return format!("step {}", fmt_count(step));
        }
        let pct = 100.0 * step as f64 / total as f64;
        // A paused or ended run has no pace to extrapolate.
        let eta = match self.eta() {
            Some(secs) if self.status != RunStatus::Paused && !self.is_over() => fmt_duration(secs),
            _ => "--".into(),
        };
        // Not grouped by thousands here: scripts and tests read "/1000000" off the header.
        format!("step {step}/{total} ({pct:.0}%)  ETA {eta}")
    }

    /// The model's size for the header; a run that named no model (a watch-only Python
    /// run) says so rather than "0.00M params".
    pub fn model_line(&self) -> Option<String> {
        self.info.as_ref().map(|i| match i.parameters {
            0 => "model not given".into(),
            n => format!("{:.2}M params", n as f64 / 1e6),
        })
    }

    pub fn device_line(&self) -> String {
        let Some(info) = &self.info else {
            return "device: starting…".into();
        };
        match self.sample.as_ref().and_then(|s| s.gpu.as_ref()) {
            Some(g) => format!("{} · {} · {}", info.device, g.name, fmt_bytes(g.mem_total)),
            // CUDA without NVML (or after it stopped answering): the name is the label.
            None if info.device_name == info.device => info.device.clone(),
            None => format!("{} · {}", info.device, info.device_name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::editor::EditStatus;
    use crate::keys::Action;
    use headroom_core::{Command, GpuStats, HostStats, Notice, Telemetry};

    fn status(s: RunStatus) -> Telemetry {
        Telemetry::Status { status: s }
    }

    #[test]
    fn pause_key_follows_the_confirmed_status() {
        let mut app = App::new("t", false);
        assert_eq!(app.handle(Action::TogglePause), Reaction::Nothing);
        app.apply(&status(RunStatus::Running));
        assert_eq!(
            app.handle(Action::TogglePause),
            Reaction::Send(Command::Pause)
        );
        // Pressing again before the trainer confirms still asks to pause: the screen
        // never assumes the command took effect.
        assert_eq!(
            app.handle(Action::TogglePause),
            Reaction::Send(Command::Pause)
        );
        app.apply(&status(RunStatus::Paused));
        assert_eq!(
            app.handle(Action::TogglePause),
            Reaction::Send(Command::Resume)
        );
    }

    #[test]
    fn quit_asks_once_then_exits() {
        let mut app = App::new("t", false);
        app.apply(&status(RunStatus::Running));
        assert_eq!(app.handle(Action::Quit), Reaction::Send(Command::Stop));
        assert_eq!(app.status_text(), "stop requested");
        assert_eq!(app.handle(Action::Quit), Reaction::Exit);
    }

    #[test]
    fn failure_sets_status_and_reason() {
        let mut app = App::new("t", false);
        app.apply(&Telemetry::Failed {
            reason: "trainer panicked: boom".into(),
        });
        assert!(app.is_over());
        assert_eq!(app.status_text(), "failed: trainer panicked: boom");
        assert_eq!(app.events[0].level, Level::Error);
        assert_eq!(app.handle(Action::Checkpoint), Reaction::Nothing);
    }

    #[test]
    fn event_log_is_newest_first_and_bounded() {
        let mut app = App::new("t", false);
        for i in 0..EVENT_LOG_LEN + 20 {
            app.apply(&Telemetry::Notice(Notice::new(
                Level::Info,
                "x",
                format!("n{i}"),
            )));
        }
        assert_eq!(app.events.len(), EVENT_LOG_LEN);
        assert!(app.events[0]
            .text
            .ends_with(&format!("n{}", EVENT_LOG_LEN + 19)));
    }

    #[test]
    fn scrolled_event_log_stays_put_when_new_entries_arrive() {
        let mut app = App::new("t", false);
        for i in 0..30 {
            app.apply(&Telemetry::Notice(Notice::new(
                Level::Info,
                "x",
                format!("n{i}"),
            )));
        }
        app.handle(Action::Scroll(5));
        let seen = app.events[app.event_scroll].text.clone();
        app.apply(&Telemetry::Notice(Notice::new(Level::Info, "x", "newer")));
        assert_eq!(app.events[app.event_scroll].text, seen);
        app.handle(Action::Scroll(1000));
        assert_eq!(
            app.event_scroll,
            app.events.len() - 1,
            "clamped to the oldest"
        );
        app.handle(Action::ScrollTop);
        assert_eq!(app.event_scroll, 0);
    }

    #[test]
    fn scrolling_needs_the_event_log_focused() {
        let mut app = App::new("t", false);
        for i in 0..5 {
            app.apply(&Telemetry::Notice(Notice::new(
                Level::Info,
                "x",
                format!("n{i}"),
            )));
        }
        app.handle(Action::FocusNext);
        assert_eq!(app.focus, Focus::MemoryChart);
        app.handle(Action::Scroll(2));
        assert_eq!(app.event_scroll, 0);
        app.handle(Action::FocusPrev);
        app.handle(Action::Scroll(2));
        assert_eq!(app.event_scroll, 2);
    }

    #[test]
    fn window_cycles_through_every_choice() {
        let mut app = App::new("t", false);
        let mut seen = vec![app.window];
        for _ in 0..4 {
            app.handle(Action::CycleWindow);
            seen.push(app.window);
        }
        assert_eq!(seen.first(), seen.last());
        assert!(seen.contains(&Window::WholeRun) && seen.contains(&Window::OneMinute));
    }

    #[test]
    fn memory_is_gpu_when_nvml_answers_else_process_rss() {
        let mut app = App::new("t", false);
        let mut sample = SystemSample {
            host: HostStats {
                process_rss: 100,
                mem_total: 1000,
                ..Default::default()
            },
            ..Default::default()
        };
        app.apply(&Telemetry::Sample(sample.clone()));
        assert_eq!(
            app.memory_now(),
            Some(MemoryNow {
                used: 100,
                capacity: 1000,
                on_gpu: false
            })
        );
        sample.gpu = Some(GpuStats {
            mem_used: 7,
            mem_total: 80,
            ..Default::default()
        });
        app.apply(&Telemetry::Sample(sample));
        assert!(app.memory_now().unwrap().on_gpu);
        assert_eq!(app.memory.last().unwrap().1, 7.0);
    }

    mod memory_controls {
        use super::*;
        use crate::keys::action_for;
        use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
        use headroom_core::policy::{Profile, Thresholds};

        /// The way a key travels in the live loop: key → action (in the app's context)
        /// → reaction.
        fn press(app: &mut App, code: KeyCode) -> Reaction {
            let key = KeyEvent::new(code, KeyModifiers::NONE);
            match action_for(key, app.key_context()) {
                Some(action) => app.handle(action),
                None => Reaction::Nothing,
            }
        }

        fn running_at(micro_batch: usize) -> App {
            let mut app = App::new("t", false);
            app.apply(&status(RunStatus::Running));
            app.apply(&Telemetry::ThresholdsChanged {
                thresholds: Thresholds::default(),
                profile: Some(Profile::Balanced),
                source: "config".into(),
            });
            app.apply(&Telemetry::Step(StepMetrics {
                step: 3,
                total_steps: 10,
                loss: 1.0,
                lr: Some(1e-3),
                grad_norm: Some(1.0),
                step_time_s: 0.1,
                tokens_per_s: 1.0,
                samples_per_s: 1.0,
                micro_batch,
                accum_steps: 2,
                effective_batch: micro_batch * 2,
                seq_len: 64,
                tokens_seen: 0,
            }));
            app
        }

        fn confirm(app: &mut App, t: Thresholds, profile: Option<Profile>) {
            app.apply(&Telemetry::ThresholdsChanged {
                thresholds: t,
                profile,
                source: "command".into(),
            });
        }

        #[test]
        fn editor_sends_the_edited_thresholds_and_shows_them_only_once_confirmed() {
            let mut app = running_at(16);
            assert_eq!(press(&mut app, KeyCode::Char('t')), Reaction::Nothing);
            assert_eq!(app.key_context(), KeyContext::ThresholdEditor);
            // target 0.90 → 0.88 (down twice), then emergency (left wraps) up to 0.98.
            press(&mut app, KeyCode::Down);
            press(&mut app, KeyCode::Char('-'));
            press(&mut app, KeyCode::Char('h'));
            press(&mut app, KeyCode::Char('+'));
            let want = Thresholds::new(0.88, 0.92, 0.95, 0.98).unwrap();
            assert_eq!(
                press(&mut app, KeyCode::Enter),
                Reaction::Send(Command::SetThresholds { thresholds: want })
            );
            // Sent is not in force.
            assert_eq!(app.policy.thresholds, Some(Thresholds::default()));
            assert!(app.editor.is_some(), "open until the trainer answers");
            confirm(&mut app, want, None);
            assert_eq!(app.policy.thresholds, Some(want));
            assert_eq!(app.policy.profile, None);
            assert!(app.editor.is_none(), "closed by the confirmation");
            assert_eq!(app.key_context(), KeyContext::Dashboard);
        }

        #[test]
        fn an_invalid_draft_is_explained_and_nothing_is_sent() {
            let mut app = running_at(16);
            press(&mut app, KeyCode::Char('t'));
            press(&mut app, KeyCode::Char('k'));
            press(&mut app, KeyCode::Char('k')); // target 0.92 = warning
            assert_eq!(press(&mut app, KeyCode::Enter), Reaction::Nothing);
            let ed = app.editor.as_ref().unwrap();
            let EditStatus::Refused(why) = &ed.status else {
                panic!("{:?}", ed.status)
            };
            assert!(why.contains("must be greater than target"), "{why}");
            assert_eq!(app.policy.thresholds, Some(Thresholds::default()));
        }

        #[test]
        fn a_refusal_from_the_trainer_is_shown_in_the_editor_and_the_log() {
            let mut app = running_at(16);
            press(&mut app, KeyCode::Char('t'));
            press(&mut app, KeyCode::Up);
            let Reaction::Send(command) = press(&mut app, KeyCode::Enter) else {
                panic!("valid draft not sent")
            };
            let text = "refused: threshold target = 0.91 is not allowed; 0.90,0.92,0.95,0.97 stay in force";
            app.apply(&Telemetry::CommandApplied {
                command,
                applied: text.into(),
            });
            assert_eq!(
                app.editor.as_ref().unwrap().status,
                EditStatus::Refused(text.into())
            );
            assert_eq!(app.events[0].level, Level::Warn);
            assert_eq!(app.policy.thresholds, Some(Thresholds::default()));
        }

        #[test]
        fn esc_cancels_the_editor_and_sends_nothing() {
            let mut app = running_at(16);
            press(&mut app, KeyCode::Char('t'));
            press(&mut app, KeyCode::Up);
            // Run controls are inert while editing.
            assert_eq!(press(&mut app, KeyCode::Char('q')), Reaction::Nothing);
            assert!(!app.stop_requested);
            assert_eq!(press(&mut app, KeyCode::Esc), Reaction::Nothing);
            assert!(app.editor.is_none());
            assert_eq!(app.policy.thresholds, Some(Thresholds::default()));
        }

        #[test]
        fn esc_closes_help_over_the_editor_first() {
            let mut app = running_at(16);
            press(&mut app, KeyCode::Char('t'));
            press(&mut app, KeyCode::Char('?'));
            assert!(app.show_help && app.editor.is_some());
            press(&mut app, KeyCode::Esc);
            assert!(!app.show_help && app.editor.is_some());
            press(&mut app, KeyCode::Esc);
            assert!(app.editor.is_none());
        }

        #[test]
        fn shift_p_cycles_the_draft_in_the_editor_and_sends_a_profile_outside() {
            let mut app = running_at(16);
            assert_eq!(
                press(&mut app, KeyCode::Char('P')),
                Reaction::Send(Command::SetProfile {
                    profile: Profile::Conservative
                })
            );
            press(&mut app, KeyCode::Char('t'));
            assert_eq!(press(&mut app, KeyCode::Char('P')), Reaction::Nothing);
            assert_eq!(
                app.editor.as_ref().unwrap().draft,
                Profile::Conservative.thresholds()
            );
            assert_eq!(
                press(&mut app, KeyCode::Enter),
                Reaction::Send(Command::SetThresholds {
                    thresholds: Profile::Conservative.thresholds()
                })
            );
        }

        #[test]
        fn b_pins_the_current_size_then_unpins_once_confirmed() {
            let mut app = running_at(16);
            let pin = press(&mut app, KeyCode::Char('b'));
            assert_eq!(
                pin,
                Reaction::Send(Command::PinMicroBatch { micro_batch: 16 })
            );
            // Not pinned until the trainer says so: b again still asks to pin.
            assert_eq!(press(&mut app, KeyCode::Char('b')), pin);
            app.apply(&Telemetry::CommandApplied {
                command: Command::PinMicroBatch { micro_batch: 16 },
                applied: "micro-batch pinned at 16, 2 accumulation steps".into(),
            });
            assert!(app.policy.pinned);
            assert_eq!(
                press(&mut app, KeyCode::Char('b')),
                Reaction::Send(Command::Unpin)
            );
        }

        #[test]
        fn plus_and_minus_pin_twice_and_half_the_current_size() {
            let mut app = running_at(16);
            assert_eq!(
                press(&mut app, KeyCode::Char('+')),
                Reaction::Send(Command::PinMicroBatch { micro_batch: 32 })
            );
            assert_eq!(
                press(&mut app, KeyCode::Char('-')),
                Reaction::Send(Command::PinMicroBatch { micro_batch: 8 })
            );
            // A resize the controller made is the new current size.
            app.apply(&Telemetry::Decision {
                step: 3,
                decision: headroom_core::policy::Decision::Resize {
                    from: 16,
                    to: 1,
                    reason: headroom_core::policy::ResizeReason::Critical,
                    usage: 0.96,
                    predicted: None,
                },
            });
            assert_eq!(
                press(&mut app, KeyCode::Char('-')),
                Reaction::Send(Command::PinMicroBatch { micro_batch: 1 }),
                "never below one"
            );
        }

        #[test]
        fn batch_keys_before_the_first_step_say_why_they_did_nothing() {
            let mut app = App::new("t", false);
            app.apply(&status(RunStatus::Running));
            assert_eq!(press(&mut app, KeyCode::Char('b')), Reaction::Nothing);
            assert!(app.events[0].text.contains("no micro-batch"));
        }

        #[test]
        fn f_frees_the_cache_and_nothing_is_sent_once_the_run_is_over() {
            let mut app = running_at(16);
            assert_eq!(
                press(&mut app, KeyCode::Char('f')),
                Reaction::Send(Command::FreeCache)
            );
            app.apply(&Telemetry::Failed {
                reason: "boom".into(),
            });
            for c in ['f', 'b', '+', 'P'] {
                assert_eq!(press(&mut app, KeyCode::Char(c)), Reaction::Nothing, "{c}");
            }
            assert_eq!(press(&mut app, KeyCode::Char('t')), Reaction::Nothing);
            assert!(app.editor.is_none());
        }

        #[test]
        fn ooms_are_counted_marked_and_logged() {
            let mut app = running_at(32);
            app.set_elapsed(7.0);
            app.apply(&Telemetry::Oom {
                step: 41,
                micro_batch: 32,
                seq_len: 64,
                retry_with: Some(16),
                error: "out of memory".into(),
            });
            assert_eq!(app.policy.ooms, 1);
            assert_eq!(
                app.policy.marks.back().map(|m| (m.t, m.kind)),
                Some((7.0, crate::policy::MarkKind::Oom))
            );
            assert_eq!(
                app.events[0].text,
                "step 41: out of memory at micro-batch 32 × 64 tokens, retrying with 16"
            );
            assert_eq!(app.micro_batch(), Some(16));
        }
    }
}
