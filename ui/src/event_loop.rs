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
use ratatui::backend::{Backend, ClearType, CrosstermBackend};
use ratatui::Terminal;

use crate::app::{App, Reaction};
use crate::keys::action_for;
use crate::terminal::{NoTerminal, Suspend, TerminalGuard};
use crate::view::render;

#[derive(Debug, Clone)]
pub struct DashboardOptions {
    pub run_name: String,
    /// False when NO_COLOR is set: decided once here, never inside draw.
    pub color: bool,
    /// Minimum time between frames.
    pub frame_interval: Duration,
    /// Set by SIGINT/SIGTERM. A running trainer hears those itself (they stop it and the
    /// loop ends with its summary); an ended run's screen, which waits for `q`, closes.
    pub signalled: Arc<AtomicBool>,
    /// Close as soon as the run finishes, instead of keeping its final screen (charts,
    /// log, summary line) until `q`, as a failed run's screen is kept.
    pub close_on_finish: bool,
    /// Set by the binary's signal thread on a SIGTSTP from outside (`kill -TSTP`; Ctrl-Z
    /// itself arrives as a key in raw mode). At the next frame tick the loop hands the
    /// terminal back and stops the process, as for Ctrl-Z, and redraws on `fg`.
    pub suspend: Arc<AtomicBool>,
    /// Set on SIGHUP: the terminal is gone. The loop returns at the next frame tick
    /// without drawing again, so the run can go on without a screen.
    pub hangup: Arc<AtomicBool>,
}

impl DashboardOptions {
    pub fn from_env(run_name: &str) -> DashboardOptions {
        DashboardOptions {
            run_name: run_name.to_string(),
            color: std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            frame_interval: Duration::from_millis(50),
            signalled: Arc::new(AtomicBool::new(false)),
            close_on_finish: false,
            suspend: Arc::new(AtomicBool::new(false)),
            hangup: Arc::new(AtomicBool::new(false)),
        }
    }
}

#[derive(Debug, Default)]
pub struct DashboardExit {
    pub summary: Option<RunSummary>,
    pub failure: Option<String>,
    /// The user quit without waiting for the trainer to finish.
    pub force_quit: bool,
    /// The terminal hung up (SIGHUP). The trainer was not told anything: the caller
    /// decides whether the run goes on without a screen.
    pub hangup: bool,
    /// Drawing on or reading the terminal failed (a dead tty answers EIO), and why. As
    /// with a hang-up, the run itself is untouched.
    pub screen_lost: Option<String>,
}

/// Runs the dashboard until the run has ended and the user closes the screen (or, with
/// `close_on_finish`, until it finishes), the trainer goes away, the user force-quits, or
/// the terminal is lost. The terminal is restored before this returns, whatever happens.
pub fn run_dashboard(
    events: Receiver<Telemetry>,
    metrics: Receiver<Telemetry>,
    commands: Sender<Command>,
    dropped: Arc<AtomicU64>,
    opts: DashboardOptions,
) -> io::Result<DashboardExit> {
    let mut guard = TerminalGuard::enter()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;

    let input = InputReader::spawn()?;
    let result = drive_with(
        &mut terminal,
        &events,
        metrics,
        &commands,
        &dropped,
        &input.events,
        &opts,
        &mut guard,
    );
    // Before the terminal goes back to the shell: a reader still running would swallow
    // the user's next keystrokes.
    input.finish();
    // ratatui's Terminal shows the cursor when dropped and, when that fails, says so with
    // `eprintln!`, which panics on a hung-up terminal: the panic ended the process under a
    // trainer in mid-step. The guard below shows the cursor (ignoring errors) anyway.
    std::mem::forget(terminal);
    drop(guard);
    result
}

/// The loop itself, over any backend and any source of terminal events: the live
/// dashboard passes crossterm's; benchmarks and tests pass a recording backend and
/// scripted keys. Suspending (Ctrl-Z) only redraws: there is no real terminal to give
/// back; [`drive_with`] takes one.
pub fn drive<B: Backend>(
    terminal: &mut Terminal<B>,
    events: &Receiver<Telemetry>,
    metrics: Receiver<Telemetry>,
    commands: &Sender<Command>,
    dropped: &AtomicU64,
    input: &Receiver<io::Result<Event>>,
    opts: &DashboardOptions,
) -> io::Result<DashboardExit> {
    drive_with(
        terminal,
        events,
        metrics,
        commands,
        dropped,
        input,
        opts,
        &mut NoTerminal,
    )
}

/// [`drive`], with `host` handing the terminal back while the process is suspended.
#[allow(clippy::too_many_arguments)]
pub fn drive_with<B: Backend>(
    terminal: &mut Terminal<B>,
    events: &Receiver<Telemetry>,
    mut metrics: Receiver<Telemetry>,
    commands: &Sender<Command>,
    dropped: &AtomicU64,
    input: &Receiver<io::Result<Event>>,
    opts: &DashboardOptions,
    host: &mut dyn Suspend,
) -> io::Result<DashboardExit> {
    let mut app = App::new(&opts.run_name, opts.color);
    let frames = tick(opts.frame_interval);
    let mut events = events.clone();
    let started = Instant::now();
    let mut exit = DashboardExit::default();
    let mut dirty = true;
    loop {
        let mut draw_now = false;
        let mut suspend_now = false;
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
                            Reaction::Suspend => suspend_now = true,
                        }
                        draw_now = true;
                    }
                }
                Ok(Ok(Event::Resize(_, _))) => draw_now = true,
                Ok(Ok(_)) => {}
                // A terminal that cannot be read is gone (a hung-up tty answers EIO); the
                // run does not depend on it.
                Ok(Err(e)) => {
                    lose_screen(&mut exit, opts, format!("reading the terminal failed: {e}"));
                    break;
                }
                Err(_) => return Err(io::Error::other("terminal input reader stopped")),
            },
            recv(events) -> msg => match msg {
                Ok(msg) => {
                    app.apply(&msg);
                    dirty = true;
                    match msg {
                        Telemetry::Finished(s) => {
                            let how = if s.stopped_by_user { "stopped" } else { "finished" };
                            exit.summary = Some(s);
                            // `q` here asked to leave: the stop it sent has landed. Only a
                            // run that ended on its own (or was stopped from elsewhere)
                            // keeps its final charts for the user to read.
                            if opts.close_on_finish || app.stop_requested {
                                break;
                            }
                            // The final charts stay, as a failed run's screen does.
                            app.apply(&Telemetry::Notice(Notice::new(
                                Level::Info,
                                "ui",
                                format!("the run {how}: q closes the screen (the summary is printed after)"),
                            )));
                        }
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
                // After the run ended the trainer is gone by design; otherwise it left
                // without a last word, and main reports its join result.
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
                suspend_now |= opts.suspend.swap(false, Ordering::SeqCst);
            },
        }
        // Checked before anything touches the terminal: after a hang-up, a write could
        // only fail.
        if opts.hangup.load(Ordering::SeqCst) {
            exit.hangup = true;
            break;
        }
        if suspend_now {
            if let Err(e) = host.suspend() {
                lose_screen(
                    &mut exit,
                    opts,
                    format!("taking the terminal back failed: {e}"),
                );
                break;
            }
            // The shell wrote over the screen meanwhile and the window may have changed
            // size: the next frame is drawn whole.
            if let Err(e) = redraw_whole(terminal) {
                lose_screen(&mut exit, opts, format!("clearing the screen failed: {e}"));
                break;
            }
            draw_now = true;
        }
        if draw_now {
            if let Err(e) = terminal.draw(|f| render(f, &app)) {
                lose_screen(&mut exit, opts, format!("drawing failed: {e}"));
                break;
            }
            dirty = false;
        }
    }
    Ok(exit)
}

/// The terminal failed under the loop: a hang-up if one was signalled, else said why.
fn lose_screen(exit: &mut DashboardExit, opts: &DashboardOptions, why: String) {
    if opts.hangup.load(Ordering::SeqCst) {
        exit.hangup = true;
    } else {
        exit.screen_lost = Some(why);
    }
}

/// Makes the next frame draw every cell, on a cleared screen. Not ratatui's `clear`: it
/// asks the terminal where the cursor is and gives up after 2 s without an answer (a slow
/// ssh link, a multiplexer, a test pty), which lost the screen after every Ctrl-Z. Two
/// swaps reset both buffers, so the next diff is against nothing.
fn redraw_whole<B: Backend>(terminal: &mut Terminal<B>) -> Result<(), B::Error> {
    terminal.backend_mut().clear_region(ClearType::All)?;
    terminal.swap_buffers();
    terminal.swap_buffers();
    Ok(())
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
        let tty = Tty::open();
        let thread = std::thread::Builder::new()
            .name("input".into())
            .spawn(move || {
                while !stop_flag.load(Ordering::SeqCst) {
                    // Asked of the terminal itself before crossterm is: once the terminal
                    // has hung up, crossterm's reader loops forever on reads that return
                    // nothing (a core at 100% and a join that never returns, seen when
                    // an ssh link or a tmux pane went away).
                    if tty
                        .as_ref()
                        .is_some_and(|t| t.hung_up(Duration::from_millis(50)))
                    {
                        let gone =
                            io::Error::new(io::ErrorKind::BrokenPipe, "the terminal hung up");
                        let _ = tx.send(Err(gone));
                        break;
                    }
                    // Zero: the wait was above; this also collects resizes.
                    let timeout = if tty.is_some() {
                        Duration::ZERO
                    } else {
                        Duration::from_millis(50)
                    };
                    match event::poll(timeout) {
                        Ok(true) => match event::read() {
                            // A signal (SIGCONT after a suspend, SIGWINCH) interrupted the
                            // read: nothing was lost, read again.
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            ev => {
                                if tx.send(ev).is_err() {
                                    break;
                                }
                            }
                        },
                        Ok(false) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
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

    /// Stops the reader and waits for it (one poll interval), but not forever: a reader
    /// caught inside crossterm when the terminal hung up never comes back, and the run must
    /// still end. Left behind, it dies with the process.
    fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        // A reader blocked on a full channel wakes with an error once this is gone.
        drop(self.events);
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.thread.is_finished() {
            let _ = self.thread.join();
        }
    }
}

/// The terminal crossterm reads keys from (stdin when it is one, as crossterm chooses),
/// watched for a hang-up.
struct Tty {
    fd: std::os::fd::RawFd,
}

impl Tty {
    fn open() -> Option<Tty> {
        // SAFETY: isatty only inspects the descriptor.
        (unsafe { libc::isatty(libc::STDIN_FILENO) } == 1).then_some(Tty {
            fd: libc::STDIN_FILENO,
        })
    }

    /// Waits up to `wait` for input; true when the terminal is gone (hung up, closed).
    fn hung_up(&self, wait: Duration) -> bool {
        let mut fds = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut fds, 1, wait.as_millis() as i32) };
        n > 0 && fds.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
    }
}
