//! The live loop (`drive`) on a recording backend with scripted keys and telemetry: what
//! ends it, what it sends to the trainer, what it says when it cannot send, and how it
//! behaves when the terminal is suspended, hung up or broken.
//!
//! Ordering is made deterministic by waiting on what the loop does (a command arriving,
//! a channel drained, a key taken from a rendezvous channel), never by sleeping.
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use crossterm::event::{Event, KeyCode, KeyEvent, KeyModifiers};
use headroom_core::policy::{Profile, Thresholds};
use headroom_core::{Command, Record, RunStatus, RunSummary, StepMetrics, Telemetry};
use headroom_ui::{
    drive_with, Control, DashboardExit, DashboardOptions, Feed, Link, Mode, ReplayControl,
    ReplayHandle, Suspend,
};
use ratatui::backend::{Backend, ClearType, TestBackend, WindowSize};
use ratatui::buffer::Cell;
use ratatui::layout::{Position, Size};
use ratatui::Terminal;

mod support;

const WAIT: Duration = Duration::from_secs(5);

/// What the loop did to its terminal, shared with the test.
#[derive(Clone, Default)]
struct Probe {
    draws: Arc<AtomicUsize>,
    clears: Arc<AtomicUsize>,
    suspends: Arc<AtomicUsize>,
    /// Every draw fails as on a dead tty.
    fail_draws: Arc<AtomicBool>,
    /// The hang-up flag, raised during this draw (1-based), as if SIGHUP came mid-frame.
    hangup_during_draw: Option<(usize, Arc<AtomicBool>)>,
}

/// A TestBackend that counts what is done to it and can fail like a terminal that went
/// away.
struct ProbeBackend {
    inner: TestBackend,
    probe: Probe,
}

impl Backend for ProbeBackend {
    type Error = io::Error;

    fn draw<'a, I>(&mut self, content: I) -> io::Result<()>
    where
        I: Iterator<Item = (u16, u16, &'a Cell)>,
    {
        if self.probe.fail_draws.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(5)); // EIO
        }
        let n = self.probe.draws.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some((at, flag)) = &self.probe.hangup_during_draw {
            if n == *at {
                flag.store(true, Ordering::SeqCst);
            }
        }
        let Ok(()) = self.inner.draw(content);
        Ok(())
    }
    fn hide_cursor(&mut self) -> io::Result<()> {
        let Ok(()) = self.inner.hide_cursor();
        Ok(())
    }
    fn show_cursor(&mut self) -> io::Result<()> {
        let Ok(()) = self.inner.show_cursor();
        Ok(())
    }
    fn get_cursor_position(&mut self) -> io::Result<Position> {
        let Ok(p) = self.inner.get_cursor_position();
        Ok(p)
    }
    fn set_cursor_position<P: Into<Position>>(&mut self, position: P) -> io::Result<()> {
        let Ok(()) = self.inner.set_cursor_position(position);
        Ok(())
    }
    fn clear(&mut self) -> io::Result<()> {
        self.probe.clears.fetch_add(1, Ordering::SeqCst);
        let Ok(()) = self.inner.clear();
        Ok(())
    }
    fn clear_region(&mut self, clear_type: ClearType) -> io::Result<()> {
        if clear_type == ClearType::All {
            self.probe.clears.fetch_add(1, Ordering::SeqCst);
        }
        let Ok(()) = self.inner.clear_region(clear_type);
        Ok(())
    }
    fn size(&self) -> io::Result<Size> {
        let Ok(s) = self.inner.size();
        Ok(s)
    }
    fn window_size(&mut self) -> io::Result<WindowSize> {
        let Ok(s) = self.inner.window_size();
        Ok(s)
    }
    fn flush(&mut self) -> io::Result<()> {
        let Ok(()) = self.inner.flush();
        Ok(())
    }
}

/// Counts suspensions instead of stopping the test process.
struct CountingHost(Arc<AtomicUsize>);

impl Suspend for CountingHost {
    fn suspend(&mut self) -> io::Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[derive(Default)]
struct Setup {
    command_room: usize,
    queued: Vec<Command>,
    close_on_finish: bool,
    probe: Probe,
    mode: Mode,
}

/// A queue of the feed, taking bare messages (at the run's time 0) as the tests write
/// them, or records at a time.
#[derive(Clone)]
struct Tx(Sender<Record>);

impl Tx {
    fn send(&self, msg: Telemetry) -> Result<(), &'static str> {
        self.0
            .send(Record::new(0.0, 0.0, msg))
            .map_err(|_| "the loop is gone")
    }
    fn send_at(&self, t: f64, msg: Telemetry) {
        self.0.send(Record::new(0.0, t, msg)).expect("loop alive");
    }
    /// False when the queue is full (or the loop gone).
    fn try_send(&self, msg: Telemetry) -> bool {
        self.0.try_send(Record::new(0.0, 0.0, msg)).is_ok()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

struct Harness {
    keys: Sender<io::Result<Event>>,
    events: Tx,
    metrics: Tx,
    link: Sender<Link>,
    /// What a replay's keys asked of the replay thread.
    replay: Receiver<ReplayControl>,
    commands: Receiver<Command>,
    opts: DashboardOptions,
    probe: Probe,
    running: JoinHandle<(io::Result<DashboardExit>, Terminal<ProbeBackend>)>,
}

impl Harness {
    /// Starts the loop with a command queue of `command_room`, pre-filled with `queued`.
    fn start(command_room: usize, queued: &[Command]) -> Harness {
        Harness::with(Setup {
            command_room,
            queued: queued.to_vec(),
            ..Setup::default()
        })
    }

    fn with(setup: Setup) -> Harness {
        // Zero capacity: a press returns once the loop has taken the key, and the loop
        // handles a key completely before it takes the next one.
        let (keys, key_rx) = bounded(0);
        let (events, event_rx) = bounded(16);
        let (metrics, metric_rx) = bounded(16);
        let (link, link_rx) = bounded(16);
        let (replay_tx, replay) = bounded(16);
        let (cmd_tx, commands) = bounded(setup.command_room.max(1));
        for c in &setup.queued {
            cmd_tx
                .try_send(c.clone())
                .expect("room for the pre-filled commands");
        }
        let mut opts = DashboardOptions::from_env("test");
        opts.color = false;
        opts.frame_interval = Duration::from_millis(10);
        opts.close_on_finish = setup.close_on_finish;
        opts.mode = setup.mode.clone();
        let control = match setup.mode {
            Mode::Replay { .. } => Control::Replay(ReplayHandle {
                control: replay_tx,
                state: Default::default(),
            }),
            _ => Control::Commands(cmd_tx.clone()),
        };
        let mut probe = setup.probe;
        if let Some((_, flag)) = &mut probe.hangup_during_draw {
            opts.hangup = Arc::clone(flag);
        }
        let (loop_opts, loop_probe) = (opts.clone(), probe.clone());
        let running = std::thread::spawn(move || {
            let backend = ProbeBackend {
                inner: TestBackend::new(100, 30),
                probe: loop_probe.clone(),
            };
            let mut terminal = Terminal::new(backend).expect("test backend");
            let feed = Feed {
                events: event_rx,
                metrics: metric_rx,
                dropped: Arc::new(AtomicU64::new(0)),
                control,
                select_rank: None,
                link: link_rx,
            };
            let mut host = CountingHost(Arc::clone(&loop_probe.suspends));
            let exit = drive_with(&mut terminal, feed, &key_rx, &loop_opts, &mut host);
            // Commands queued for a trainer stay readable after the loop returned.
            drop(cmd_tx);
            (exit, terminal)
        });
        Harness {
            keys,
            events: Tx(events),
            metrics: Tx(metrics),
            link,
            replay,
            commands,
            opts,
            probe,
            running,
        }
    }

    fn press(&self, c: char) {
        self.press_code(KeyCode::Char(c));
    }

    fn press_code(&self, code: KeyCode) {
        self.press_key(KeyEvent::new(code, KeyModifiers::NONE));
    }

    fn press_key(&self, key: KeyEvent) {
        self.keys.send(Ok(Event::Key(key))).expect("loop alive");
    }

    /// Sends a lifecycle event and waits until the loop has taken it, so a key sent next
    /// is handled after it.
    fn event(&self, msg: Telemetry) {
        self.events.send(msg).expect("loop alive");
        wait_for("the loop to take the event", || self.events.is_empty());
    }

    fn next_command(&self) -> Command {
        self.commands
            .recv_timeout(WAIT)
            .expect("the loop should have sent a command")
    }

    /// Waits for the loop to return by itself, channels still open.
    fn ends_by_itself(&self, why: &str) {
        wait_for(why, || self.running.is_finished());
    }

    fn end(self) -> (DashboardExit, String) {
        let Harness {
            keys,
            events,
            running,
            ..
        } = self;
        // Disconnecting the events channel ends a loop that has not ended yet.
        drop(events);
        let (exit, terminal) = running.join().expect("loop thread");
        drop(keys);
        let screen = format!("{}", terminal.backend().inner);
        (exit.expect("loop ok"), screen)
    }
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn summary() -> RunSummary {
    RunSummary {
        steps_done: 12,
        total_steps: 12,
        stopped_by_user: false,
        last_loss: Some(2.5),
        last_val_loss: None,
        tokens_seen: 1000,
        elapsed_s: 3.0,
        checkpoint: None,
        memory: Default::default(),
    }
}

#[test]
fn quit_sends_stop_and_a_second_quit_leaves_without_waiting() {
    let h = Harness::start(8, &[]);
    h.press('q');
    assert_eq!(h.next_command(), Command::Stop);
    h.press('q');
    let (exit, _) = h.end();
    assert!(exit.force_quit, "second q while stopping is a force quit");
    assert!(exit.summary.is_none());
}

/// A completed run's final charts are worth reading: the screen stays, saying so, until
/// `q`, as a failed run's does.
#[test]
fn finished_keeps_the_screen_until_q_and_ends_with_the_summary() {
    let mut h = Harness::start(8, &[]);
    h.event(Telemetry::Finished(summary()));
    h.feed_ends(false);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!h.running.is_finished(), "the screen closed by itself");
    let (exit, screen, _) = h.quit();
    assert_eq!(exit.summary, Some(summary()));
    assert!(!exit.force_quit && exit.failure.is_none());
    assert!(
        screen.contains("the run finished: q closes the screen"),
        "{screen}"
    );
    assert!(screen.contains(" q  close"), "{screen}");
}

/// `q` asked to leave: once the stop it sent lands, the screen closes by itself (the
/// checkpoint written, the summary printed after), with no second key.
#[test]
fn a_stop_asked_with_q_closes_the_screen_once_the_run_stopped() {
    let h = Harness::start(8, &[]);
    h.press('q');
    std::thread::sleep(Duration::from_millis(100));
    h.events
        .send(Telemetry::Finished(RunSummary {
            stopped_by_user: true,
            ..summary()
        }))
        .unwrap();
    h.ends_by_itself("the loop to close after the stop q asked for");
    let (exit, _) = h.end();
    assert!(exit.summary.is_some_and(|s| s.stopped_by_user));
    assert!(!exit.force_quit);
}

#[test]
fn close_on_finish_ends_the_loop_at_once() {
    let h = Harness::with(Setup {
        close_on_finish: true,
        ..Setup::default()
    });
    h.events.send(Telemetry::Finished(summary())).unwrap();
    h.ends_by_itself("the loop to close on finish");
    let (exit, _) = h.end();
    assert_eq!(exit.summary, Some(summary()));
    assert!(!exit.force_quit && exit.failure.is_none());
}

#[test]
fn a_signal_closes_a_finished_screen() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Finished(summary()));
    h.opts.signalled.store(true, Ordering::SeqCst);
    h.ends_by_itself("the signal to close the finished screen");
    let (exit, _) = h.end();
    assert_eq!(exit.summary, Some(summary()));
}

/// SIGHUP: the terminal is gone. The loop returns within a frame and never draws again,
/// even with fresh telemetry making the screen dirty.
#[test]
fn a_hang_up_ends_the_loop_without_drawing_again() {
    let flag = Arc::new(AtomicBool::new(false));
    let h = Harness::with(Setup {
        probe: Probe {
            hangup_during_draw: Some((2, Arc::clone(&flag))),
            ..Probe::default()
        },
        ..Setup::default()
    });
    // The first frame, then a status change: its frame is the second draw, during which
    // the hang-up arrives.
    wait_for("the first frame", || {
        h.probe.draws.load(Ordering::SeqCst) >= 1
    });
    h.events
        .send(Telemetry::Status {
            status: RunStatus::Running,
        })
        .unwrap();
    h.ends_by_itself("the loop to notice the hang-up");
    let _ = h.events.try_send(Telemetry::Status {
        status: RunStatus::Paused,
    });
    let draws = Arc::clone(&h.probe.draws);
    let (exit, _) = h.end();
    assert!(exit.hangup, "{exit:?}");
    assert!(exit.screen_lost.is_none() && !exit.force_quit, "{exit:?}");
    assert_eq!(draws.load(Ordering::SeqCst), 2, "drew after the hang-up");
}

/// A tty that died without a signal answers EIO: the loop reports the screen lost and
/// returns Ok, so the run can go on without it.
#[test]
fn a_draw_error_loses_the_screen_not_the_run() {
    let probe = Probe::default();
    probe.fail_draws.store(true, Ordering::SeqCst);
    let h = Harness::with(Setup {
        probe,
        ..Setup::default()
    });
    h.ends_by_itself("the loop to give up its screen");
    let (exit, _) = h.end();
    let why = exit.screen_lost.expect("the screen is reported lost");
    assert!(why.contains("drawing failed"), "{why}");
    assert!(!exit.hangup && exit.summary.is_none());
}

#[test]
fn an_input_error_loses_the_screen_not_the_run() {
    let h = Harness::start(8, &[]);
    h.keys.send(Err(io::Error::from_raw_os_error(5))).unwrap();
    h.ends_by_itself("the loop to give up its screen");
    let (exit, _) = h.end();
    let why = exit.screen_lost.expect("the screen is reported lost");
    assert!(why.contains("reading the terminal failed"), "{why}");
}

/// Ctrl-Z in raw mode is a key: the loop hands the terminal to its host to suspend,
/// then redraws the whole screen when it comes back.
#[test]
fn ctrl_z_suspends_through_the_terminal_and_redraws_everything() {
    let h = Harness::start(8, &[]);
    wait_for("the first frame", || {
        h.probe.draws.load(Ordering::SeqCst) >= 1
    });
    assert_eq!(h.probe.clears.load(Ordering::SeqCst), 0);
    h.press_key(KeyEvent::new(KeyCode::Char('z'), KeyModifiers::CONTROL));
    // Taken by then: the next key is only taken after Ctrl-Z was handled.
    h.press('w');
    assert_eq!(h.probe.suspends.load(Ordering::SeqCst), 1);
    assert_eq!(h.probe.clears.load(Ordering::SeqCst), 1, "no full redraw");
    assert!(h.commands.is_empty(), "suspending sends nothing");
    let (exit, _) = h.end();
    assert!(!exit.force_quit && exit.screen_lost.is_none());
}

/// SIGTSTP from outside (`kill -TSTP`) reaches the loop as a flag: the same suspension,
/// once per signal.
#[test]
fn an_external_stop_signal_suspends_the_same_way() {
    let h = Harness::start(8, &[]);
    h.opts.suspend.store(true, Ordering::SeqCst);
    wait_for("the suspension", || {
        h.probe.suspends.load(Ordering::SeqCst) == 1
    });
    wait_for("the flag to be taken", || {
        !h.opts.suspend.load(Ordering::SeqCst)
    });
    wait_for("the full redraw", || {
        h.probe.clears.load(Ordering::SeqCst) == 1
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        h.probe.suspends.load(Ordering::SeqCst),
        1,
        "once per signal"
    );
    h.end();
}

/// While paused, the screen shows no stale rate and offers resume, not pause.
#[test]
fn a_paused_run_offers_resume_and_shows_no_stale_rate() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.metrics.send(step_report(1, 12)).unwrap();
    wait_for("the step to be taken", || h.metrics.is_empty());
    h.event(Telemetry::Status {
        status: RunStatus::Paused,
    });
    // A key is handled, and drawn, after the event before it.
    h.press('w');
    let (_, screen) = h.end();
    assert!(screen.contains(" p  resume"), "{screen}");
    assert!(!screen.contains(" p  pause"), "{screen}");
    assert!(!screen.contains("samples/s"), "{screen}");
    assert!(screen.contains("paused: no steps running"), "{screen}");
}

fn step_report(step: u64, micro_batch: usize) -> Telemetry {
    Telemetry::Step(StepMetrics {
        total_steps: 10,
        loss: 1.0,
        lr: Some(1e-3),
        grad_norm: Some(1.0),
        step_time_s: 0.1,
        tokens_per_s: 1.0,
        samples_per_s: 1.0,
        accum_steps: 1,
        effective_batch: micro_batch,
        tokens_seen: 0,
        ..support::step(step, micro_batch)
    })
}

/// A failure keeps the screen, with its reason, after the trainer is gone: `q` closes it.
#[test]
fn failed_holds_the_screen_until_q_and_ends_with_the_reason() {
    let mut h = Harness::start(8, &[]);
    h.event(Telemetry::Failed {
        reason: "trainer panicked: boom".into(),
    });
    h.feed_ends(false);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!h.running.is_finished(), "the screen closed by itself");
    let (exit, screen, _) = h.quit();
    assert_eq!(exit.failure.as_deref(), Some("trainer panicked: boom"));
    assert!(exit.summary.is_none() && !exit.force_quit);
    assert!(
        screen.contains("failed: trainer panicked: boom"),
        "{screen}"
    );
}

/// SIGTERM reaches a running trainer, not the loop; once the run has failed there is no
/// trainer to hear it, so the failed screen closes on the signal itself.
#[test]
fn a_signal_closes_a_failed_screen() {
    let h = Harness::start(8, &[]);
    h.opts.signalled.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !h.running.is_finished(),
        "a running trainer's loop waits for it"
    );
    h.event(Telemetry::Failed {
        reason: "boom".into(),
    });
    let deadline = std::time::Instant::now() + WAIT;
    while !h.running.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "still open after the signal"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (exit, _) = h.end();
    assert_eq!(exit.failure.as_deref(), Some("boom"));
}

#[test]
fn trainer_going_away_ends_the_loop() {
    let h = Harness::start(8, &[]);
    let (exit, _) = h.end();
    assert!(exit.summary.is_none() && exit.failure.is_none() && !exit.force_quit);
}

#[test]
fn pause_key_sends_what_the_confirmed_status_calls_for() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.press('p');
    assert_eq!(h.next_command(), Command::Pause);
    h.event(Telemetry::Status {
        status: RunStatus::Paused,
    });
    h.press('p');
    assert_eq!(h.next_command(), Command::Resume);
    h.press('c');
    assert_eq!(h.next_command(), Command::Checkpoint);
    h.end();
}

#[test]
fn a_full_command_queue_is_reported_on_screen() {
    let h = Harness::start(1, &[Command::Checkpoint]);
    h.press('c');
    // Taken only after the first press was handled (and drawn).
    h.press('w');
    let queue = h.commands.clone();
    let (_, screen) = h.end();
    assert!(
        screen.contains("Checkpoint not sent: the trainer's command queue is full (1 waiting)"),
        "{screen}"
    );
    assert_eq!(queue.len(), 1, "only the command queued before");
}

#[test]
fn the_threshold_editor_is_modal_in_the_live_loop() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.event(Telemetry::ThresholdsChanged {
        thresholds: Thresholds::default(),
        profile: Some(Profile::Balanced),
        source: "config".into(),
    });
    h.press('t');
    // Inside the editor: q and f are inert, arrows edit, Enter sends.
    h.press('q');
    h.press('f');
    h.press_code(KeyCode::Up);
    h.press_code(KeyCode::Enter);
    assert_eq!(
        h.next_command(),
        Command::SetThresholds {
            thresholds: Thresholds::new(0.91, 0.92, 0.95, 0.97).unwrap()
        },
        "q and f must not have sent anything first"
    );
    h.press_code(KeyCode::Esc);
    h.press('f');
    assert_eq!(h.next_command(), Command::FreeCache);
    h.end();
}

#[test]
fn batch_keys_pin_around_the_reported_micro_batch() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    // Steps travel on the metrics channel; the loop applies them as they come.
    h.metrics.send(step_report(1, 12)).unwrap();
    wait_for("the step to be taken", || h.metrics.is_empty());
    h.press('+');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 24 });
    h.press('-');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 6 });
    h.press('b');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 12 });
    h.end();
}

impl Harness {
    fn attached() -> Harness {
        Harness::with(Setup {
            command_room: 8,
            mode: Mode::Attached {
                address: "/tmp/headroom/run.sock".into(),
            },
            ..Setup::default()
        })
    }

    /// Sends link news and waits until the loop has taken it.
    fn link(&self, news: Link) {
        self.link.send(news).expect("loop alive");
        wait_for("the loop to take the link news", || self.link.is_empty());
    }

    /// Makes the loop draw what it has taken (a resize always redraws).
    fn frame(&self) {
        let n = self.probe.draws.load(Ordering::SeqCst);
        self.keys
            .send(Ok(Event::Resize(100, 30)))
            .expect("loop alive");
        wait_for("a frame", || self.probe.draws.load(Ordering::SeqCst) > n);
    }

    /// The trainer's side goes quiet for good: its event queue ends (a trainer thread
    /// after its last word) and, with `metrics_too`, the metrics queue as well (a feed
    /// that closed). The loop keeps what it has taken.
    fn feed_ends(&mut self, metrics_too: bool) {
        self.events = Tx(bounded(1).0);
        if metrics_too {
            self.metrics = Tx(bounded(1).0);
        }
    }

    /// Leaves with `q` (a viewer's loop does not end when its feed does).
    fn quit(self) -> (DashboardExit, String, Receiver<Command>) {
        self.press('q');
        let Harness {
            running, commands, ..
        } = self;
        let (exit, terminal) = running.join().expect("loop thread");
        let screen = format!("{}", terminal.backend().inner);
        (exit.expect("loop ok"), screen, commands)
    }
}

#[test]
fn attached_q_detaches_at_once_and_sends_nothing() {
    let h = Harness::attached();
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    let (exit, _, commands) = h.quit();
    assert!(exit.detached && !exit.force_quit);
    assert!(
        commands.try_recv().is_err(),
        "a viewer's q must not stop the run"
    );
}

#[test]
fn attached_stop_asks_y_n_and_only_y_sends_stop() {
    let h = Harness::attached();
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.press('S');
    h.press('n');
    h.press('S');
    h.press('x'); // neither: the question stays
    std::thread::sleep(Duration::from_millis(30));
    assert!(h.commands.try_recv().is_err(), "sent before y");
    h.press('y');
    assert_eq!(h.next_command(), Command::Stop);
    // A viewer that stopped the run still sees it end, then leaves.
    h.event(Telemetry::Finished(RunSummary {
        stopped_by_user: true,
        ..summary()
    }));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!h.running.is_finished(), "the final screen stays until q");
    let (exit, screen, _) = h.quit();
    assert!(!exit.detached, "nothing left running to detach from");
    assert!(
        screen.contains("the run stopped: q closes the screen"),
        "{screen}"
    );
}

#[test]
fn a_lost_link_shows_a_banner_and_a_reconnect_starts_afresh() {
    let h = Harness::attached();
    h.link(Link::Connected {
        run_id: "tiny-1".into(),
    });
    h.events.send_at(
        3.0,
        Telemetry::Notice(headroom_core::Notice::new(
            headroom_core::Level::Info,
            "test",
            "from the first connection",
        )),
    );
    wait_for("the record", || h.events.is_empty());
    h.link(Link::Lost {
        reason: "the run's socket closed".into(),
    });
    h.link(Link::Retrying {
        attempt: 1,
        in_s: 2.0,
    });
    h.frame();
    // Keys that would send a command do nothing while the link is down.
    h.press('c');
    h.link(Link::Connected {
        run_id: "tiny-1".into(),
    });
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.frame();
    let (exit, screen, commands) = h.quit();
    assert!(
        commands.try_recv().is_err(),
        "a command went into a lost link"
    );
    assert!(exit.detached);
    assert!(screen.contains("connected to run tiny-1"), "{screen}");
    assert!(
        !screen.contains("from the first connection") && !screen.contains("connection lost"),
        "the old picture survived the reconnect: {screen}"
    );
}

#[test]
fn a_lost_link_keeps_the_last_picture_under_a_banner() {
    let h = Harness::attached();
    h.events.send_at(
        3.0,
        Telemetry::Notice(headroom_core::Notice::new(
            headroom_core::Level::Info,
            "test",
            "the last picture",
        )),
    );
    h.link(Link::Lost {
        reason: "the run's socket closed".into(),
    });
    h.link(Link::Retrying {
        attempt: 2,
        in_s: 2.0,
    });
    h.frame();
    let (_, screen, _) = h.quit();
    assert!(screen.contains("the last picture"), "{screen}");
    assert!(
        screen.contains("connection lost: the run's socket closed · retrying in 2 s"),
        "{screen}"
    );
}

/// The feed ending under a viewer (the run is gone) keeps the screen until q.
#[test]
fn a_closed_feed_keeps_a_viewers_screen() {
    let mut h = Harness::attached();
    h.link(Link::Closed {
        reason: "the run ended".into(),
    });
    h.feed_ends(true);
    std::thread::sleep(Duration::from_millis(60));
    assert!(
        !h.running.is_finished(),
        "the viewer's screen closed by itself"
    );
    let n = h.probe.draws.load(Ordering::SeqCst);
    assert!(n > 0);
    let (exit, screen, _) = h.quit();
    assert!(exit.detached);
    assert!(
        screen.contains("connection closed: the run ended"),
        "{screen}"
    );
}

#[test]
fn a_replay_steers_the_replay_and_sends_no_commands() {
    let h = Harness::with(Setup {
        command_room: 8,
        mode: Mode::Replay {
            source: "run.jsonl".into(),
        },
        ..Setup::default()
    });
    h.event(Telemetry::Status {
        status: RunStatus::Running,
    });
    h.press('c');
    h.press('f');
    h.press(' ');
    h.press('+');
    h.press('G');
    wait_for("the replay controls", || h.replay.len() == 3);
    let asked: Vec<ReplayControl> = h.replay.try_iter().collect();
    assert_eq!(
        asked,
        [
            ReplayControl::TogglePause,
            ReplayControl::Faster,
            ReplayControl::JumpToEnd
        ]
    );
    h.frame();
    let (exit, screen, commands) = h.quit();
    assert!(commands.try_recv().is_err());
    assert!(!exit.force_quit && !exit.detached);
    assert!(
        screen.contains("commands are disabled in a replay"),
        "{screen}"
    );
}

/// A replay jumped to its end (`--end`, `G`) has its records ahead of its clock: the
/// screen's "the run finished" is stamped at the run's end, among its last events, not
/// at the clock's 0s.
#[test]
fn a_replays_end_is_stamped_at_the_runs_time() {
    let h = Harness::with(Setup {
        command_room: 8,
        mode: Mode::Replay {
            source: "run.jsonl".into(),
        },
        ..Setup::default()
    });
    h.events.send_at(
        3.0,
        Telemetry::Status {
            status: RunStatus::Running,
        },
    );
    h.events.send_at(3.4, Telemetry::Finished(summary()));
    wait_for("the loop to take the events", || h.events.is_empty());
    h.frame();
    let (_, screen, _) = h.quit();
    assert!(
        screen.contains("3s [ui] the run finished: q closes the replay"),
        "{screen}"
    );
    assert!(!screen.contains("0s [ui]"), "{screen}");
}
