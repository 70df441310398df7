//! Signals. Every way a run is told to end (SIGINT, SIGTERM, SIGQUIT, and SIGHUP when the
//! terminal or ssh link goes away) stops it gracefully: the step in progress finishes and
//! a checkpoint is written. Asking a second time (SIGINT, SIGTERM or SIGQUIT again) ends
//! the process at once: checkpoints are written whole or not at all, so the last one on
//! disk stays good. SIGTSTP, while the dashboard owns the terminal, asks the screen to
//! hand the terminal back before the process stops.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use crossbeam_channel::Sender;
use headroom_core::Command;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGTSTP};

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
}

/// Starts the thread that turns signals into commands and flags. `screen`: the dashboard
/// owns the terminal (then SIGTSTP is handled and a forced exit restores the terminal).
/// `socket`: the run's stream socket, removed by a forced exit.
pub fn forward(
    commands: Sender<Command>,
    flags: Flags,
    screen: bool,
    checkpoints: PathBuf,
    socket: Option<PathBuf>,
) -> Result<()> {
    let mut wanted = vec![SIGINT, SIGTERM, SIGQUIT, SIGHUP];
    if screen {
        wanted.push(SIGTSTP);
    }
    let mut signals =
        signal_hook::iterator::Signals::new(&wanted).context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                match signal {
                    SIGTSTP => flags.suspend.store(true, Ordering::SeqCst),
                    SIGHUP => {
                        flags.hangup.store(true, Ordering::SeqCst);
                        // A hang-up repeated is the same event, not the user insisting.
                        if !flags.stop.swap(true, Ordering::SeqCst) {
                            let _ = commands.try_send(Command::Stop);
                        }
                    }
                    _ => {
                        if flags.stop.swap(true, Ordering::SeqCst) {
                            if let Some(s) = &socket {
                                crate::rundir::remove_run(s);
                            }
                            exit_now(screen && !flags.hangup.load(Ordering::SeqCst), &checkpoints);
                        }
                        let _ = commands.try_send(Command::Stop);
                    }
                }
            }
        })
        .context("spawning the signal thread")?;
    Ok(())
}

/// The second ask: give the terminal back and end now, without waiting for the step.
fn exit_now(screen: bool, checkpoints: &Path) -> ! {
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
    out::err(&format!(
        "headroom: asked twice to stop: exiting without finishing the step in progress; {}",
        last_checkpoint_text(checkpoints)
    ));
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
