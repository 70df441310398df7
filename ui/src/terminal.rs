//! Owning the terminal: raw mode and the alternate screen while a [`TerminalGuard`]
//! lives, the user's terminal back on every exit path (return, `?`, panic).
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;

use crossterm::cursor::{Hide, Show};
use crossterm::execute;
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};

/// Set while the screen is ours: other threads' panic messages would garble it.
static SCREEN_ACTIVE: AtomicBool = AtomicBool::new(false);
static UI_THREAD: OnceLock<ThreadId> = OnceLock::new();

pub struct TerminalGuard {
    _private: (),
}

impl TerminalGuard {
    pub fn enter() -> io::Result<TerminalGuard> {
        let _ = UI_THREAD.set(std::thread::current().id());
        enable_raw_mode()?;
        // From here on, Drop restores whatever part succeeded.
        let guard = TerminalGuard { _private: () };
        execute!(io::stdout(), EnterAlternateScreen, Hide)?;
        SCREEN_ACTIVE.store(true, Ordering::SeqCst);
        Ok(guard)
    }
}

fn restore() {
    SCREEN_ACTIVE.store(false, Ordering::SeqCst);
    let _ = disable_raw_mode();
    let mut out = io::stdout();
    let _ = execute!(out, LeaveAlternateScreen, Show);
    let _ = out.flush();
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore();
    }
}

/// Installs a panic hook that, for a panic on the UI thread, restores the terminal before
/// the message is printed (so it is readable and the shell is usable). A panic on another
/// thread while the screen is up is not printed over it: the trainer catches its own
/// panics and reports them as `Failed`, which the screen shows and main prints after.
pub fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let on_ui_thread = UI_THREAD.get() == Some(&std::thread::current().id());
        if on_ui_thread {
            if SCREEN_ACTIVE.load(Ordering::SeqCst) {
                restore();
            }
            previous(info);
        } else if !SCREEN_ACTIVE.load(Ordering::SeqCst) {
            previous(info);
        }
    }));
}
