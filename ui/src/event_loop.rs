//! The live loop: input, telemetry and a frame tick, multiplexed with `select!`.
//! Telemetry only updates state and marks the screen dirty; drawing happens at most once
//! per tick (the frame cap) or right after a key, so a flood of messages never turns into
//! a flood of frames, and a busy trainer never delays a key.
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, never, select, tick, Receiver, Sender, TrySendError};
use crossterm::event::{self, Event, KeyEventKind};
use headroom_core::{Command, Level, Notice, RunSummary, Telemetry};
use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::Terminal;

use crate::app::{App, Reaction};
use crate::keys::action_for;
use crate::terminal::TerminalGuard;
use crate::view::render;

#[derive(Debug, Clone)]
pub struct DashboardOptions {
    pub run_name: String,
    /// False when NO_COLOR is set: decided once here, never inside draw.
    pub color: bool,
    /// Minimum time between frames.
    pub frame_interval: Duration,
    /// Set by SIGINT/SIGTERM. A running trainer hears those itself (they stop it and the
    /// loop ends with its summary); a failed run's screen, which waits for `q`, closes.
    pub signalled: Arc<AtomicBool>,
}

impl DashboardOptions {
    pub fn from_env(run_name: &str) -> DashboardOptions {
        DashboardOptions {
            run_name: run_name.to_string(),
            color: std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            frame_interval: Duration::from_millis(50),
            signalled: Arc::new(AtomicBool::new(false)),
        }
    }
}

#[derive(Debug, Default)]
pub struct DashboardExit {
    pub summary: Option<RunSummary>,
    pub failure: Option<String>,
    /// The user quit without waiting for the trainer to finish.
    pub force_quit: bool,
}

/// Runs the dashboard until the run finishes or fails, the trainer goes away, or the
/// user force-quits. The terminal is restored before this returns, whatever happens.
pub fn run_dashboard(
    events: Receiver<Telemetry>,
    metrics: Receiver<Telemetry>,
    commands: Sender<Command>,
    dropped: Arc<AtomicU64>,
    opts: DashboardOptions,
) -> io::Result<DashboardExit> {
    let guard = TerminalGuard::enter()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;

    let input = InputReader::spawn()?;
    let result = drive(
        &mut terminal,
        &events,
        metrics,
        &commands,
        &dropped,
        &input.events,
        &opts,
    );
    // Before the terminal goes back to the shell: a reader still running would swallow
    // the user's next keystrokes.
    input.finish();
    drop(guard);
    result
}

/// The loop itself, over any backend and any source of terminal events: the live
/// dashboard passes crossterm's; benchmarks and tests pass a recording backend and
/// scripted keys.
pub fn drive<B: Backend>(
    terminal: &mut Terminal<B>,
    events: &Receiver<Telemetry>,
    mut metrics: Receiver<Telemetry>,
    commands: &Sender<Command>,
    dropped: &AtomicU64,
    input: &Receiver<io::Result<Event>>,
    opts: &DashboardOptions,
) -> io::Result<DashboardExit> {
    let mut app = App::new(&opts.run_name, opts.color);
    let frames = tick(opts.frame_interval);
    let mut events = events.clone();
    let started = Instant::now();
    let mut exit = DashboardExit::default();
    let mut dirty = true;
    loop {
        let mut draw_now = false;
        select! {
            recv(input) -> ev => match ev {
                Ok(Ok(Event::Key(key))) if key.kind != KeyEventKind::Release => {
                    if let Some(action) = action_for(key, app.key_context()) {
                        match app.handle(action) {
                            Reaction::Nothing => {}
                            Reaction::Send(cmd) => send_command(&mut app, commands, cmd),
                            Reaction::Exit => {
                                exit.force_quit = !app.is_over();
                                break;
                            }
                        }
                        draw_now = true;
                    }
                }
                Ok(Ok(Event::Resize(_, _))) => draw_now = true,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(io::Error::other("terminal input reader stopped")),
            },
            recv(events) -> msg => match msg {
                Ok(msg) => {
                    app.apply(&msg);
                    dirty = true;
                    match msg {
                        Telemetry::Finished(s) => { exit.summary = Some(s); break; }
                        // The screen stays, with the reason and the state the run failed
                        // in, until the user has read it (`q`).
                        Telemetry::Failed { reason } => {
                            exit.failure = Some(reason);
                            app.apply(&Telemetry::Notice(Notice::new(
                                Level::Error,
                                "ui",
                                "the run failed: q closes the screen (the reason is printed again)",
                            )));
                        }
                        _ => {}
                    }
                }
                // After a failure the trainer is gone by design; otherwise it left without
                // a last word, and main reports its join result.
                Err(_) if app.is_over() => events = never(),
                Err(_) => break,
            },
            recv(metrics) -> msg => match msg {
                Ok(msg) => { app.apply(&msg); dirty = true; }
                Err(_) => metrics = never(),
            },
            recv(frames) -> _ => {
                let now = started.elapsed().as_secs_f64();
                let n_dropped = dropped.load(Ordering::Relaxed);
                // The header's clock and the drop counter change with no telemetry at all
                // (a paused run, a stalled sampler); redraw for them too.
                let clock_moved = now.floor() != app.elapsed.floor();
                let drops_moved = n_dropped != app.dropped;
                app.set_elapsed(now);
                app.set_dropped(n_dropped);
                draw_now = dirty || clock_moved || drops_moved;
                if app.is_over() && opts.signalled.load(Ordering::SeqCst) {
                    break;
                }
            },
        }
        if draw_now {
            terminal
                .draw(|f| render(f, &app))
                .map_err(|e| io::Error::other(e.to_string()))?;
            dirty = false;
        }
    }
    Ok(exit)
}

/// The trainer may be inside a long step: queue, never block.
fn send_command(app: &mut App, commands: &Sender<Command>, cmd: Command) {
    if let Err(TrySendError::Full(cmd)) = commands.try_send(cmd) {
        // Said on screen: a key that silently did nothing would read as a hung trainer.
        let text = format!(
            "{cmd:?} not sent: the trainer's command queue is full ({} waiting)",
            commands.len()
        );
        app.apply(&Telemetry::Notice(Notice::new(Level::Warn, "ui", text)));
    }
    // Disconnected: the trainer is gone, and the events channel says so next.
}

/// Reads terminal events on a thread of its own, polling so it can be told to stop.
struct InputReader {
    events: Receiver<io::Result<Event>>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl InputReader {
    fn spawn() -> io::Result<InputReader> {
        let (tx, rx) = bounded(64);
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("input".into())
            .spawn(move || {
                while !stop_flag.load(Ordering::SeqCst) {
                    match event::poll(Duration::from_millis(50)) {
                        Ok(true) => {
                            if tx.send(event::read()).is_err() {
                                break;
                            }
                        }
                        Ok(false) => {}
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            break;
                        }
                    }
                }
            })?;
        Ok(InputReader {
            events: rx,
            stop,
            thread,
        })
    }

    /// Stops the reader and waits for it (one poll interval at most).
    fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        // A reader blocked on a full channel wakes with an error once this is gone.
        drop(self.events);
        let _ = self.thread.join();
    }
}
