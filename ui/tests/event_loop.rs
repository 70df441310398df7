//! The live loop (`drive`) on a TestBackend with scripted keys and telemetry: what ends
//! it, what it sends to the trainer, and what it says when it cannot send.
//!
//! Ordering is made deterministic by waiting on what the loop does (a command arriving,
//! a channel drained, a key taken from a rendezvous channel), never by sleeping.
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use crossterm::event::{Event, KeyCode, KeyEvent, KeyModifiers};
use headroom_core::policy::{Profile, Thresholds};
use headroom_core::{Command, RunStatus, RunSummary, StepMetrics, Telemetry};
use headroom_ui::{drive, DashboardExit, DashboardOptions};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

const WAIT: Duration = Duration::from_secs(5);

struct Harness {
    keys: Sender<io::Result<Event>>,
    events: Sender<Telemetry>,
    metrics: Sender<Telemetry>,
    commands: Receiver<Command>,
    signalled: Arc<AtomicBool>,
    running: JoinHandle<(io::Result<DashboardExit>, Terminal<TestBackend>)>,
}

impl Harness {
    /// Starts the loop with a command queue of `command_room`, pre-filled with `queued`.
    fn start(command_room: usize, queued: &[Command]) -> Harness {
        // Zero capacity: a press returns once the loop has taken the key, and the loop
        // handles a key completely before it takes the next one.
        let (keys, key_rx) = bounded(0);
        let (events, event_rx) = bounded(16);
        let (metrics, metric_rx) = bounded(16);
        let (cmd_tx, commands) = bounded(command_room);
        for c in queued {
            cmd_tx
                .try_send(c.clone())
                .expect("room for the pre-filled commands");
        }
        let opts = DashboardOptions {
            run_name: "test".into(),
            color: false,
            frame_interval: Duration::from_millis(10),
            signalled: Arc::new(AtomicBool::new(false)),
        };
        let signalled = Arc::clone(&opts.signalled);
        let running = std::thread::spawn(move || {
            let mut terminal = Terminal::new(TestBackend::new(100, 30)).expect("test backend");
            let dropped = AtomicU64::new(0);
            let exit = drive(
                &mut terminal,
                &event_rx,
                metric_rx,
                &cmd_tx,
                &dropped,
                &key_rx,
                &opts,
            );
            (exit, terminal)
        });
        Harness {
            keys,
            events,
            metrics,
            commands,
            signalled,
            running,
        }
    }

    fn press(&self, c: char) {
        self.press_code(KeyCode::Char(c));
    }

    fn press_code(&self, code: KeyCode) {
        let key = KeyEvent::new(code, KeyModifiers::NONE);
        self.keys.send(Ok(Event::Key(key))).expect("loop alive");
    }

    /// Sends a lifecycle event and waits until the loop has taken it, so a key sent next
    /// is handled after it.
    fn event(&self, msg: Telemetry) {
        self.events.send(msg).expect("loop alive");
        let deadline = std::time::Instant::now() + WAIT;
        while !self.events.is_empty() {
            assert!(std::time::Instant::now() < deadline, "loop never took it");
            std::thread::yield_now();
        }
    }

    fn next_command(&self) -> Command {
        self.commands
            .recv_timeout(WAIT)
            .expect("the loop should have sent a command")
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
        let screen = format!("{}", terminal.backend());
        (exit.expect("loop ok"), screen)
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

#[test]
fn finished_ends_the_loop_with_the_summary() {
    let h = Harness::start(8, &[]);
    h.events.send(Telemetry::Finished(summary())).unwrap();
    let (exit, _) = h.end();
    assert_eq!(exit.summary, Some(summary()));
    assert!(!exit.force_quit && exit.failure.is_none());
}

/// A failure keeps the screen, with its reason, after the trainer is gone: `q` closes it.
#[test]
fn failed_holds_the_screen_until_q_and_ends_with_the_reason() {
    let h = Harness::start(8, &[]);
    h.event(Telemetry::Failed {
        reason: "trainer panicked: boom".into(),
    });
    let Harness {
        keys,
        events,
        running,
        ..
    } = h;
    drop(events); // the trainer thread ends after its last word
    std::thread::sleep(Duration::from_millis(100));
    assert!(!running.is_finished(), "the screen closed by itself");
    keys.send(Ok(Event::Key(KeyEvent::new(
        KeyCode::Char('q'),
        KeyModifiers::NONE,
    ))))
    .unwrap();
    let (exit, terminal) = running.join().expect("loop thread");
    let exit = exit.expect("loop ok");
    assert_eq!(exit.failure.as_deref(), Some("trainer panicked: boom"));
    assert!(exit.summary.is_none() && !exit.force_quit);
    let screen = format!("{}", terminal.backend());
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
    h.signalled.store(true, Ordering::SeqCst);
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
    h.metrics
        .send(Telemetry::Step(StepMetrics {
            step: 1,
            total_steps: 10,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            step_time_s: 0.1,
            tokens_per_s: 1.0,
            samples_per_s: 1.0,
            micro_batch: 12,
            accum_steps: 1,
            effective_batch: 12,
            seq_len: 64,
            tokens_seen: 0,
        }))
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while !h.metrics.is_empty() {
        assert!(std::time::Instant::now() < deadline, "loop never took it");
        std::thread::yield_now();
    }
    h.press('+');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 24 });
    h.press('-');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 6 });
    h.press('b');
    assert_eq!(h.next_command(), Command::PinMicroBatch { micro_batch: 12 });
    h.end();
}
