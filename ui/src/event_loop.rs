//! The live loop: input, telemetry and a frame tick, multiplexed with `select!`.
//! Telemetry only updates state and marks the screen dirty; drawing happens at most once
//! per tick (the frame cap) or right after a key, so a flood of messages never turns into
//! a flood of frames, and a busy trainer never delays a key.
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, never, select, tick, Receiver, TryRecvError, TrySendError};
use crossterm::event::{self, Event, KeyEventKind};
use headroom_core::{Command, Level, Notice, Record, RunSummary, Telemetry};
use ratatui::backend::{Backend, ClearType, CrosstermBackend};
use ratatui::Terminal;

use crate::app::{App, Reaction};
use crate::feed::{Control, Feed, Link};
use crate::keys::action_for;
use crate::mode::{LinkView, Mode, ReplayView};
use crate::terminal::{NoTerminal, Suspend, TerminalGuard};
use crate::view::render;

/// Before the first frame tick, the shortest time between frames drawn as soon as the
/// records so far are in.
const EARLY_FRAME: Duration = Duration::from_millis(10);

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
    /// In the run's process, attached to it, or replaying its log.
    pub mode: Mode,
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
            mode: Mode::InProcess,
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
    /// An attached viewer left a run that goes on.
    pub detached: bool,
}

/// Runs the dashboard until the run has ended and the user closes the screen (or, with
/// `close_on_finish`, until it finishes), the trainer goes away, the user force-quits, or
/// the terminal is lost. The terminal is restored before this returns, whatever happens.
pub fn run_dashboard(feed: Feed, opts: DashboardOptions) -> io::Result<DashboardExit> {
    let mut guard = TerminalGuard::enter()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;

    let input = InputReader::spawn()?;
    let result = drive_with(&mut terminal, feed, &input.events, &opts, &mut guard);
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
    feed: Feed,
    input: &Receiver<io::Result<Event>>,
    opts: &DashboardOptions,
) -> io::Result<DashboardExit> {
    drive_with(terminal, feed, input, opts, &mut NoTerminal)
}

/// The run's clock as the records tell it: the newest record's time, moving on with the
/// wall clock since it arrived while the run is live (a paused run's clock runs too; an
/// ended run's or a lost link's stops).
#[derive(Debug, Default)]
struct RunClock {
    latest: Option<(f64, Instant)>,
}

impl RunClock {
    fn saw(&mut self, t: f64, at: Instant) {
        if self.latest.is_none_or(|(seen, _)| t >= seen) {
            self.latest = Some((t, at));
        }
    }

    fn at(&self, now: Instant, running: bool) -> f64 {
        match self.latest {
            Some((t, _)) if !running => t,
            Some((t, arrived)) => t + now.saturating_duration_since(arrived).as_secs_f64(),
            None => 0.0,
        }
    }
}

/// [`drive`], with `host` handing the terminal back while the process is suspended.
pub fn drive_with<B: Backend>(
    terminal: &mut Terminal<B>,
    feed: Feed,
    input: &Receiver<io::Result<Event>>,
    opts: &DashboardOptions,
    host: &mut dyn Suspend,
) -> io::Result<DashboardExit> {
    let Feed {
        mut events,
        mut metrics,
        dropped,
        control,
        select_rank,
        mut link,
    } = feed;
    let mut app = App::new(&opts.run_name, opts.color).with_mode(opts.mode.clone());
    app.replay_has_ranks = opts.mode.is_replay() && select_rank.is_some();
    let frames = tick(opts.frame_interval);
    let mut clock = RunClock::default();
    let mut exit = DashboardExit::default();
    let mut dirty = true;
    // A tick's first message comes one interval after the start: the screen stayed blank
    // for those 50 ms at every start (a third of the pip viewer's start to first frame).
    // Until that first tick, a frame is drawn as soon as the records queued so far are in.
    let mut ticked = false;
    let mut last_draw: Option<Instant> = None;
    loop {
        let mut draw_now = false;
        let mut suspend_now = false;
        // Link news before records: it says which picture the records after it belong
        // to (see the ordering contract in `feed`).
        loop {
            match link.try_recv() {
                Ok(news) => {
                    on_link(
                        &mut app, &mut exit, &mut clock, &events, &metrics, &link, news,
                    );
                    dirty = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    link = never();
                    break;
                }
            }
        }
        select! {
            recv(input) -> ev => match ev {
                Ok(Ok(Event::Key(key))) if key.kind != KeyEventKind::Release => {
                    if let Some(action) = action_for(key, app.key_context()) {
                        match app.handle(action) {
                            Reaction::Nothing => {}
                            Reaction::Send(cmd) => send_command(&mut app, &control, cmd),
                            Reaction::Replay(c) => {
                                if let Control::Replay(replay) = &control {
                                    // The replay thread takes controls between records;
                                    // a full queue means it has plenty to do already.
                                    let _ = replay.control.try_send(c);
                                }
                            }
                            Reaction::Exit => {
                                exit.force_quit = opts.mode == Mode::InProcess && !app.is_over();
                                break;
                            }
                            Reaction::Detach => {
                                exit.detached = true;
                                break;
                            }
                            Reaction::Suspend => suspend_now = true,
                            Reaction::SelectRank(rank) => {
                                // The client switches the panels and says if it cannot.
                                if let Some(tx) = &select_rank {
                                    let _ = tx.try_send(rank);
                                }
                            }
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
            // Woken here; handled above, before the next record.
            recv(link) -> news => match news {
                Ok(news) => {
                    on_link(&mut app, &mut exit, &mut clock, &events, &metrics, &link, news);
                    dirty = true;
                }
                Err(_) => link = never(),
            },
            recv(events) -> rec => match rec {
                Ok(rec) => {
                    on_record(&mut app, &mut clock, &rec);
                    dirty = true;
                    if ended(&mut app, &mut exit, opts, rec.msg) {
                        break;
                    }
                }
                // In-process, after the run ended the trainer is gone by design; otherwise
                // it left without a last word, and main reports its join result.
                Err(_) if opts.mode == Mode::InProcess && !app.is_over() => break,
                // A viewer keeps the last picture: the client says why in a `Closed` (or
                // has not: said here), a replay at its end says so itself.
                Err(_) => {
                    events = never();
                    if opts.mode.is_attached() && app.link.is_up() && !app.is_over() {
                        app.apply_link(&Link::Closed { reason: "the stream ended".into() });
                    }
                    dirty = true;
                }
            },
            recv(metrics) -> rec => match rec {
                Ok(rec) => {
                    on_record(&mut app, &mut clock, &rec);
                    dirty = true;
                }
                Err(_) => metrics = never(),
            },
            recv(frames) -> _ => {
                ticked = true;
                let now_instant = Instant::now();
                let now = match &control {
                    Control::Replay(replay) => {
                        let state = replay.snapshot();
                        let position = state.position_at(now_instant);
                        let view = ReplayView::of(&state, position);
                        let moved = app.replay.is_none_or(|old| !old.looks_like(&view));
                        app.set_replay(Some(view));
                        dirty |= moved;
                        position
                    }
                    Control::Commands(_) => {
                        clock.at(now_instant, !app.is_over() && app.link.is_up())
                    }
                };
                let n_dropped = dropped.load(Ordering::Relaxed);
                // The header's clock and the drop counter change with no telemetry at all
                // (a paused run, a stalled sampler); redraw for them too.
                let clock_moved = now.floor() != app.elapsed.floor();
                let drops_moved = n_dropped != app.dropped;
                app.set_elapsed(now);
                app.set_dropped(n_dropped);
                draw_now = dirty || clock_moved || drops_moved;
                // A signal closes an ended run's screen, and any viewer's: only the
                // in-process screen leaves the signal to the trainer.
                if opts.signalled.load(Ordering::SeqCst)
                    && (app.is_over() || opts.mode != Mode::InProcess)
                {
                    exit.detached = opts.mode.is_attached() && !app.is_over();
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
        let caught_up = events.is_empty() && metrics.is_empty();
        if !ticked && dirty && caught_up && last_draw.is_none_or(|t| t.elapsed() >= EARLY_FRAME) {
            draw_now = true;
        }
        if draw_now {
            if let Err(e) = terminal.draw(|f| render(f, &app)) {
                lose_screen(&mut exit, opts, format!("drawing failed: {e}"));
                break;
            }
            dirty = false;
            last_draw = Some(Instant::now());
        }
    }
    Ok(exit)
}

fn on_record(app: &mut App, clock: &mut RunClock, rec: &Record) {
    app.apply_record(rec);
    clock.saw(rec.t, Instant::now());
}

/// News of the link. Before a `Lost` or `Closed` is shown, what the connection queued
/// before it goes into the last picture (while no newer link news waits: records after a
/// quick `Connected` belong to the next picture). A `Connected` starts the run's state
/// afresh for its catch-up.
fn on_link(
    app: &mut App,
    exit: &mut DashboardExit,
    clock: &mut RunClock,
    events: &Receiver<Record>,
    metrics: &Receiver<Record>,
    link: &Receiver<Link>,
    news: Link,
) {
    match &news {
        Link::Lost { .. } | Link::Closed { .. } => {
            for queue in [events, metrics] {
                while link.is_empty() {
                    let Ok(rec) = queue.try_recv() else { break };
                    on_record(app, clock, &rec);
                }
            }
        }
        Link::Connected { .. } if app.run_t.is_some() || !app.link.is_up() => {
            *clock = RunClock::default();
            exit.summary = None;
            exit.failure = None;
        }
        _ => {}
    }
    if let (Link::Lost { .. }, LinkView::Closed { .. }) = (&news, &app.link) {
        return;
    }
    app.apply_link(&news);
}

/// The run's end, if `msg` says it ended: noted for the exit, said on screen. True when the
/// screen should close now.
fn ended(app: &mut App, exit: &mut DashboardExit, opts: &DashboardOptions, msg: Telemetry) -> bool {
    let closes = match opts.mode {
        Mode::InProcess => "q closes the screen (the summary is printed after)",
        Mode::Attached { .. } => "q closes the screen",
        Mode::Replay { .. } => "q closes the replay",
    };
    match msg {
        Telemetry::Finished(s) => {
            let how = if s.stopped_by_user {
                "stopped"
            } else {
                "finished"
            };
            exit.summary = Some(s);
            // `q` here asked to leave: the stop it sent has landed. Only a run that ended
            // on its own (or was stopped from elsewhere, or from a viewer, which stays)
            // keeps its final charts for the user to read.
            if opts.close_on_finish || (app.stop_requested && opts.mode == Mode::InProcess) {
                return true;
            }
            // The final charts stay, as a failed run's screen does.
            app.apply_after_latest(&Telemetry::Notice(Notice::new(
                Level::Info,
                "ui",
                format!("the run {how}: {closes}"),
            )));
        }
        // The screen stays, with the reason and the state the run failed in, until the
        // user has read it (`q`).
        Telemetry::Failed { reason } => {
            exit.failure = Some(reason);
            let again = match opts.mode {
                Mode::InProcess => "q closes the screen (the reason is printed again)",
                _ => closes,
            };
            app.apply_after_latest(&Telemetry::Notice(Notice::new(
                Level::Error,
                "ui",
                format!("the run failed: {again}"),
            )));
        }
        _ => {}
    }
    false
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

/// The trainer may be inside a long step: queue, never block. A replay has no run to
/// send to (its keys say so before this; this is the last guard).
fn send_command(app: &mut App, control: &Control, cmd: Command) {
    let commands = match control {
        Control::Commands(tx) => tx,
        Control::Replay(_) => return app.say_read_only(),
    };
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
