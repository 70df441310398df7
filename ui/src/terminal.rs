//! Owning the terminal: raw mode and the alternate screen while a [`TerminalGuard`]
//! lives, the user's terminal back on every exit path (return, `?`, panic).
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::ThreadId;

use crossterm::cursor::{Hide, Show};
use crossterm::execute;
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};

/// Set while the screen is ours: other threads' panic messages would garble it.
static SCREEN_ACTIVE: AtomicBool = AtomicBool::new(false);
static UI_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Other threads' panic messages, held while the screen is up and printed once it is gone,
/// so they are delayed, never lost.
static DEFERRED: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// A panic loop on some thread must not grow this without bound.
const MAX_DEFERRED: usize = 16;

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
    for message in take_deferred() {
        eprintln!("{message}");
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
        restore();
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
