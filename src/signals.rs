//! Signals. Every catchable signal whose default action would end the process is handled,
//! so no way a run is ended by its surroundings costs the work since its last checkpoint
//! (the table in docs/RELIABILITY.md, "Signals", says what each does and which test holds
//! it):
//!
//! - SIGINT, SIGTERM, SIGQUIT, SIGPWR (a UPS's power warning), SIGXCPU (a CPU-time limit's
//!   warning before SIGKILL), SIGVTALRM and SIGPROF (where nothing else, a profiler or
//!   libtorch, handles them), and SIGHUP (the terminal or ssh link went away) stop the run:
//!   the step in progress is given up at its next micro-batch, the last completed step is
//!   checkpointed, exit 0. The stop is said at once, with the step the checkpoint will be of.
//! - SIGUSR1 and SIGUSR2 stop the same way by default, or checkpoint at the step's end and
//!   go on (`run.on_usr1` / `run.on_usr2` = "checkpoint", `--on-usr1` / `--on-usr2`).
//! - SIGXFSZ (a write passed `ulimit -f`) is said; the write fails with "File too large"
//!   and is reported where it happened (a failed save keeps the last good checkpoint).
//!
//! Asking a second time ends the process at once (exit 130): checkpoints are written whole
//! or not at all, so the last one on disk stays good. SIGHUP and SIGXCPU repeated are the
//! same event (the kernel sends SIGXCPU every second past the soft limit), not the user
//! insisting. So is the same signal again within [`SAME_REQUEST`] of the first (SIGINT and
//! SIGQUIT excepted: a keyboard sends those once per key press): GNU `timeout`, a
//! supervisor that signals the process group, or `kill -TERM PID` followed by
//! `kill -TERM -PGID` deliver one request twice, microseconds apart. SIGTSTP, while the
//! dashboard owns the terminal, asks the screen to hand the terminal back before the
//! process stops.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use crossbeam_channel::Sender;
use headroom_core::{Bus, Command, Level, Notice, OnUserSignal, Telemetry};
use headroom_trainer::stop::StopSwitch;
use signal_hook::consts::*;

use crate::out;

/// What the signal thread tells the screen.
#[derive(Clone, Default)]
pub struct Flags {
    /// A stop was asked for by a signal (a failed run's screen, which waits for `q`, closes).
    pub stop: Arc<AtomicBool>,
    /// The terminal hung up: the screen must stop drawing and let the run go on headless.
    pub hangup: Arc<AtomicBool>,
    /// SIGTSTP: the screen restores the terminal, then stops the process.
    pub suspend: Arc<AtomicBool>,
    /// The trainer has ended (its last checkpoint written): only the log and the viewers
    /// are being closed. A second stop then says so instead of "the step in progress".
    pub ended: Arc<AtomicBool>,
    /// The first stop request: who asked and when (a repeat within [`SAME_REQUEST`] is it
    /// again, not a second request).
    pub first_stop: Arc<Mutex<Option<(String, Instant)>>>,
}

/// The same stop signal again within this of the first is the same request delivered
/// twice (to the process and to its group), not someone insisting; a deliberate second
/// request comes later than a person can react.
pub const SAME_REQUEST: Duration = Duration::from_secs(1);

/// What a signal asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop with a checkpoint; a second stop request ends the process at once.
    Stop,
    /// Stop, where a repeat is the same event (SIGHUP, SIGXCPU), not a second request.
    StopOnce,
    /// A checkpoint at the end of the step in progress; training goes on.
    Checkpoint,
    /// Said, nothing else (SIGXFSZ: the write that crossed the limit reports its failure).
    Note,
}

/// The signals handled and what each asks for, given the run's settings.
pub fn actions(on_usr1: OnUserSignal, on_usr2: OnUserSignal) -> Vec<(i32, Action)> {
    let user = |a: OnUserSignal| match a {
        OnUserSignal::Stop => Action::Stop,
        OnUserSignal::Checkpoint => Action::Checkpoint,
    };
    let mut list = vec![
        (SIGINT, Action::Stop),
        (SIGTERM, Action::Stop),
        (SIGQUIT, Action::Stop),
        (SIGHUP, Action::StopOnce),
        (SIGUSR1, user(on_usr1)),
        (SIGUSR2, user(on_usr2)),
        (SIGXCPU, Action::StopOnce),
        (libc::SIGPWR, Action::Stop),
        (SIGXFSZ, Action::Note),
    ];
    // Timer signals are someone's machinery when a handler is already in place (a
    // sampling profiler preloaded into the process); only their default, which ends the
    // process, is replaced.
    for sig in [SIGVTALRM, SIGPROF] {
        if is_default(sig) {
            list.push((sig, Action::Stop));
        }
    }
    list
}

/// Whether `sig` still has its default disposition.
fn is_default(sig: i32) -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into `old`.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_DFL
    }
}

/// The signal's name, as `kill -l` prints it with SIG in front.
pub fn name(sig: i32) -> String {
    match sig {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGQUIT => "SIGQUIT".into(),
        SIGHUP => "SIGHUP".into(),
        SIGUSR1 => "SIGUSR1".into(),
        SIGUSR2 => "SIGUSR2".into(),
        SIGXCPU => "SIGXCPU".into(),
        SIGXFSZ => "SIGXFSZ".into(),
        SIGVTALRM => "SIGVTALRM".into(),
        SIGPROF => "SIGPROF".into(),
        SIGTSTP => "SIGTSTP".into(),
        s if s == libc::SIGPWR => "SIGPWR".into(),
        s => format!("signal {s}"),
    }
}

/// Where the signal thread (and the line-mode `q` reader) reaches the run.
#[derive(Clone)]
pub struct Wiring {
    pub commands: Sender<Command>,
    pub flags: Flags,
    /// The dashboard owns the terminal (then SIGTSTP is handled and a forced exit
    /// restores the terminal).
    pub screen: bool,
    pub checkpoints: PathBuf,
    /// The run's stream socket, removed by a forced exit.
    pub socket: Option<PathBuf>,
    /// Given up between micro-batches on a stop.
    pub stop: StopSwitch,
    /// Acknowledgements go here: the screen, the log and headless stderr all show them.
    /// Released once the trainer has ended ([`release_bus`]): the log's queue closes only
    /// when every bus is gone.
    pub bus: SharedBus,
    pub on_usr1: OnUserSignal,
    pub on_usr2: OnUserSignal,
}

/// A bus that can be let go of while the thread holding it lives on.
pub type SharedBus = Arc<Mutex<Option<Bus>>>;

pub fn share_bus(bus: &Bus) -> SharedBus {
    Arc::new(Mutex::new(Some(bus.clone())))
}

pub fn release_bus(bus: &SharedBus) {
    bus.lock().unwrap_or_else(|p| p.into_inner()).take();
}

fn say(bus: &SharedBus, notice: Notice) {
    if let Some(bus) = bus.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        bus.send(Telemetry::Notice(notice));
    }
}

/// Starts the thread that turns signals into commands and flags.
pub fn forward(w: Wiring) -> Result<()> {
    let table = actions(w.on_usr1, w.on_usr2);
    let mut wanted: Vec<i32> = table.iter().map(|(s, _)| *s).collect();
    if w.screen {
        wanted.push(SIGTSTP);
    }
    let mut signals =
        signal_hook::iterator::Signals::new(&wanted).context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal == SIGTSTP {
                    w.flags.suspend.store(true, Ordering::SeqCst);
                    continue;
                }
                let action = table
                    .iter()
                    .find(|(s, _)| *s == signal)
                    .map_or(Action::Stop, |(_, a)| *a);
                on_signal(&w, signal, action);
            }
        })
        .context("spawning the signal thread")?;
    Ok(())
}

fn on_signal(w: &Wiring, signal: i32, action: Action) {
    let sig = name(signal);
    let say = |level: Level, text: String| say(&w.bus, Notice::new(level, "signal", text));
    match action {
        Action::Note => say(
            Level::Warn,
            format!(
                "{sig}: a write passed the file-size limit (ulimit -f); it fails with \"File \
                 too large\" and is reported where it happened; training goes on"
            ),
        ),
        Action::Checkpoint => {
            let p = w.stop.progress();
            let when = if p.in_step {
                format!("at the end of step {}, in progress", p.steps_done + 1)
            } else {
                format!("of step {}", p.steps_done)
            };
            say(
                Level::Info,
                format!(
                    "{sig}: a checkpoint {when} (run.on_{} = \"checkpoint\"); training goes on",
                    sig.trim_start_matches("SIG").to_lowercase()
                ),
            );
            let _ = w.commands.try_send(Command::Checkpoint);
        }
        Action::Stop | Action::StopOnce => {
            if signal == SIGHUP {
                w.flags.hangup.store(true, Ordering::SeqCst);
            }
            ask_stop(w, &sig, action == Action::StopOnce);
        }
    }
}

/// A request to stop from `who` (a signal's name, `q`): the first gives the step in
/// progress up at its next micro-batch and says at once what the checkpoint will be of;
/// a second ends the process now (unless `repeat_is_same`: then it is ignored).
pub fn ask_stop(w: &Wiring, who: &str, repeat_is_same: bool) {
    let first = {
        let mut first = w.flags.first_stop.lock().unwrap_or_else(|p| p.into_inner());
        first
            .get_or_insert_with(|| (who.to_string(), Instant::now()))
            .clone()
    };
    if w.flags.stop.swap(true, Ordering::SeqCst) {
        if repeat_is_same {
            return;
        }
        let (first_who, at) = first;
        let since = at.elapsed();
        if first_who == who && is_machinery(who) && since < SAME_REQUEST {
            say(
                &w.bus,
                Notice::new(
                    Level::Info,
                    "stop",
                    format!(
                        "{who} again {:.3} s later: the same request (a signal sent to the \
                         process and to its group arrives twice); the stop goes on. Send it \
                         again after {} s to exit at once",
                        since.as_secs_f64(),
                        SAME_REQUEST.as_secs()
                    ),
                ),
            );
            return;
        }
        if let Some(s) = &w.socket {
            crate::rundir::remove_run(s);
        }
        let screen = w.screen && !w.flags.hangup.load(Ordering::SeqCst);
        exit_now(screen, &forced_exit_text(who, w));
    }
    let progress = w.stop.request();
    say(
        &w.bus,
        Notice::new(
            Level::Warn,
            "stop",
            format!("{who}: {}", progress.stop_text()),
        ),
    );
    let _ = w.commands.try_send(Command::Stop);
}

/// Whether a repeat of `who` within [`SAME_REQUEST`] is one delivery doubled: signals that
/// programs send. A keyboard's (Ctrl-C, Ctrl-\) reaches the process once per key press,
/// so pressing it again is a person insisting, however soon; so is `q`.
fn is_machinery(who: &str) -> bool {
    who.starts_with("SIG") && who != "SIGINT" && who != "SIGQUIT"
}

/// What a second request to stop leaves, said exactly: where the run was decides it.
pub fn forced_exit_text(why: &str, w: &Wiring) -> String {
    exit_text(why, &w.stop, &w.flags, &w.checkpoints)
}

/// [`forced_exit_text`] from its parts (the dashboard's second `q` has no [`Wiring`]).
pub fn exit_text(why: &str, stop: &StopSwitch, flags: &Flags, checkpoints: &Path) -> String {
    let p = stop.progress();
    let what = if flags.ended.load(Ordering::SeqCst) {
        "the run had ended and written its checkpoint; exiting without waiting for its log \
         and viewers to close (the log may lack its last records)"
            .to_string()
    } else if p.in_step {
        format!(
            "exiting without finishing step {}, in progress",
            p.steps_done + 1
        )
    } else {
        format!(
            "exiting before the run finished stopping after step {} (a checkpoint being \
             written is left incomplete and ignored)",
            p.steps_done
        )
    };
    format!(
        "headroom: asked twice to stop ({why} again): {what}; {}",
        last_checkpoint_text(checkpoints)
    )
}

/// The second ask: give the terminal back and end now, without waiting for the step.
fn exit_now(screen: bool, text: &str) -> ! {
    if screen {
        use crossterm::{cursor::Show, execute, terminal};
        let _ = terminal::disable_raw_mode();
        let _ = execute!(
            std::io::stdout(),
            terminal::Clear(terminal::ClearType::All),
            terminal::LeaveAlternateScreen,
            Show
        );
    }
    out::err(text);
    exit_mid_step(130)
}

/// Ends the process while the trainer thread may be inside a libtorch op. `exit` would
/// run the C++ static destructors (libtorch's thread pools among them) under that op,
/// and the process could die of a signal instead of exiting with `code` (seen once in CI
/// as a second SIGTERM's run ending without an exit status). Nothing is lost by skipping
/// them: checkpoints are written whole or not at all, and what is said went to stderr,
/// which is unbuffered (stdout is not flushed: a thread blocked writing to a stuck pipe
/// holds its lock, and waiting for it would not be "at once").
pub fn exit_mid_step(code: i32) -> ! {
    // SAFETY: _exit ends the process at once; no Rust state is observed after it.
    unsafe { libc::_exit(code) }
}

/// Which checkpoint a run leaves behind, from the checkpoint directory's `latest`.
pub fn last_checkpoint_text(checkpoints: &Path) -> String {
    match headroom_trainer::checkpoint::latest_step_dir(checkpoints) {
        Some(dir) => format!("the last checkpoint, {}, is intact", dir.display()),
        None => format!(
            "no checkpoint had been written to {} yet",
            checkpoints.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signal_that_would_end_the_process_is_handled_and_user_signals_follow_the_setting() {
        let stop = actions(OnUserSignal::Stop, OnUserSignal::Checkpoint);
        let of = |sig: i32| stop.iter().find(|(s, _)| *s == sig).map(|(_, a)| *a);
        for sig in [SIGINT, SIGTERM, SIGQUIT, SIGUSR1, libc::SIGPWR] {
            assert_eq!(of(sig), Some(Action::Stop), "{}", name(sig));
        }
        assert_eq!(of(SIGUSR2), Some(Action::Checkpoint));
        assert_eq!(of(SIGHUP), Some(Action::StopOnce));
        assert_eq!(of(SIGXCPU), Some(Action::StopOnce));
        assert_eq!(of(SIGXFSZ), Some(Action::Note));
        // No handler is in place in the test process: the timers are taken too.
        assert_eq!(of(SIGVTALRM), Some(Action::Stop));
        assert_eq!(of(SIGPROF), Some(Action::Stop));
    }

    #[test]
    fn a_second_request_says_what_was_cut_short() {
        let dir = tempfile::tempdir().unwrap();
        let (stop, flags) = (StopSwitch::new(), Flags::default());
        stop.publish(7, true);
        let text = exit_text("SIGTERM", &stop, &flags, dir.path());
        assert!(text.contains("without finishing step 8"), "{text}");
        stop.publish(8, false);
        let text = exit_text("SIGTERM", &stop, &flags, dir.path());
        assert!(text.contains("finished stopping after step 8"), "{text}");
        flags.ended.store(true, Ordering::SeqCst);
        let text = exit_text("SIGTERM", &stop, &flags, dir.path());
        assert!(
            text.contains("had ended") && !text.contains("step in progress"),
            "{text}"
        );
    }
}
