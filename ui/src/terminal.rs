//! Owning the terminal: raw mode and the alternate screen while a [`TerminalGuard`]
//! holds them, the user's terminal back on every exit path (return, `?`, panic), while
//! the process is suspended (Ctrl-Z, SIGTSTP), and after a hang-up, when there is no
//! terminal left to restore and nothing may fail or wait on it.
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::ThreadId;

use crossterm::cursor::{Hide, Show};
use crossterm::execute;
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, Clear, ClearType, EnterAlternateScreen, LeaveAlternateScreen,
};

/// Set while the screen is ours: other threads' panic messages would garble it.
static SCREEN_ACTIVE: AtomicBool = AtomicBool::new(false);
static UI_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Other threads' panic messages, held while the screen is up and printed once it is gone,
/// so they are delayed, never lost.
static DEFERRED: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// A panic loop on some thread must not grow this without bound.
const MAX_DEFERRED: usize = 16;

/// What the live loop needs from its terminal besides drawing on it.
pub trait Suspend {
    /// Hands the terminal back to the shell, stops the process until it is continued
    /// (`fg`), then takes the terminal again. The caller redraws everything after.
    fn suspend(&mut self) -> io::Result<()>;
}

pub struct TerminalGuard {
    /// Raw mode (and perhaps the alternate screen) are ours and must be given back.
    on_screen: bool,
}

impl TerminalGuard {
    pub fn enter() -> io::Result<TerminalGuard> {
        let _ = UI_THREAD.set(std::thread::current().id());
        let mut guard = TerminalGuard { on_screen: false };
        guard.take()?;
        Ok(guard)
    }

    /// Raw mode, the alternate screen, no cursor.
    fn take(&mut self) -> io::Result<()> {
        if self.on_screen {
            return Ok(());
        }
        enable_raw_mode()?;
        // From here on, leaving restores whatever part succeeded.
        self.on_screen = true;
        write_enter(&mut io::stdout())?;
        SCREEN_ACTIVE.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Gives the terminal back: cleared, main screen, cooked mode, cursor shown. Never
    /// fails: after a hang-up there is no terminal, and errors are the expected answer.
    pub fn leave(&mut self) {
        if std::mem::take(&mut self.on_screen) {
            restore();
        }
    }

    /// Takes the terminal again after [`TerminalGuard::leave`].
    pub fn resume(&mut self) -> io::Result<()> {
        self.take()
    }
}

impl Suspend for TerminalGuard {
    fn suspend(&mut self) -> io::Result<()> {
        self.leave();
        stop_this_process();
        self.resume()
    }
}

/// For a loop drawing on no real terminal (tests, benchmarks): nothing to hand back.
pub struct NoTerminal;

impl Suspend for NoTerminal {
    fn suspend(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Stops the process as the shell's Ctrl-Z would have, and returns once it is continued.
/// SIGSTOP rather than SIGTSTP: the binary catches SIGTSTP to come here, and SIGSTOP can
/// neither be caught nor ignored.
fn stop_this_process() {
    // SAFETY: raise only delivers a signal to this process; it touches no memory.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
}

fn write_enter(out: &mut impl Write) -> io::Result<()> {
    execute!(out, EnterAlternateScreen, Hide)
}

/// Cleared before leaving: a terminal with no alternate screen (or a multiplexer that
/// keeps it) would otherwise leave the last frame under the shell's prompt.
fn write_leave(out: &mut impl Write) -> io::Result<()> {
    execute!(out, Clear(ClearType::All), LeaveAlternateScreen, Show)?;
    out.flush()
}

/// Every step is tried and every error ignored, so a dead terminal (hang-up) costs
/// nothing: writes to it fail at once.
fn restore() {
    SCREEN_ACTIVE.store(false, Ordering::SeqCst);
    let _ = disable_raw_mode();
    let _ = write_leave(&mut io::stdout());
    // Not eprintln!, which panics when stderr is gone.
    let mut err = io::stderr();
    for message in take_deferred() {
        let _ = writeln!(err, "{message}");
    }
}

fn take_deferred() -> Vec<String> {
    std::mem::take(&mut *DEFERRED.lock().unwrap_or_else(PoisonError::into_inner))
}

fn defer(message: String) {
    let mut held = DEFERRED.lock().unwrap_or_else(PoisonError::into_inner);
    if held.len() < MAX_DEFERRED {
        held.push(message);
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Installs a panic hook that, for a panic on the UI thread (the one that created the
/// [`TerminalGuard`]), restores the terminal before the message is printed, so it is
/// readable and the shell is usable. A panic on another thread while the screen is up
/// must not tear down a live screen nor print over it: the trainer catches its own panics
/// and reports them as `Failed`, which the screen shows. Its message (with the location
/// the `Failed` reason lacks) is held and printed when the terminal is restored.
pub fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let on_ui_thread = UI_THREAD.get() == Some(&std::thread::current().id());
        let screen_active = SCREEN_ACTIVE.load(Ordering::SeqCst);
        if on_ui_thread && screen_active {
            restore();
            previous(info);
        } else if screen_active {
            let thread = std::thread::current();
            defer(format!(
                "thread '{}' {info}",
                thread.name().unwrap_or("<unnamed>")
            ));
        } else {
            previous(info);
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last frame is wiped on the alternate screen before the shell's screen returns.
    #[test]
    fn leaving_clears_the_screen_first_then_shows_the_cursor() {
        let mut out: Vec<u8> = Vec::new();
        write_leave(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let at = |seq: &str| {
            text.find(seq)
                .unwrap_or_else(|| panic!("{seq:?} in {text:?}"))
        };
        assert!(at("\x1b[2J") < at("\x1b[?1049l"), "{text:?}");
        assert!(at("\x1b[?1049l") < at("\x1b[?25h"), "{text:?}");
    }

    /// Other threads' panics under a live screen are held, not printed over it nor lost.
    #[test]
    fn other_threads_panic_is_held_while_the_screen_is_up() {
        install_panic_hook();
        SCREEN_ACTIVE.store(true, Ordering::SeqCst);
        let joined = std::thread::Builder::new()
            .name("trainer".into())
            .spawn(|| panic!("boom in the trainer"))
            .map(|h| h.join());
        SCREEN_ACTIVE.store(false, Ordering::SeqCst);
        // Back to the default hook so other tests' failures print as usual.
        let _ = std::panic::take_hook();
        assert!(
            matches!(joined, Ok(Err(_))),
            "the thread must have panicked"
        );
        // Tests run in parallel: another test that panicked inside this window was held
        // too. Its message is printed, not swallowed, and does not fail this test.
        let (held, others): (Vec<String>, Vec<String>) = take_deferred()
            .into_iter()
            .partition(|m| m.starts_with("thread 'trainer' "));
        for message in others {
            eprintln!("{message}");
        }
        assert_eq!(held.len(), 1, "{held:?}");
        assert!(
            held[0].starts_with("thread 'trainer' panicked at"),
            "{held:?}"
        );
        assert!(held[0].contains("boom in the trainer"), "{held:?}");
    }
}
