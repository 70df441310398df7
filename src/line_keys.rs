//! `q` on a terminal that cannot draw the dashboard (`TERM=dumb`, `TERM` unset): the run
//! goes on headless, and lines typed on the terminal are read in its ordinary line mode
//! (no raw mode, nothing to restore): `q` and Enter stops the run as the dashboard's `q`
//! does, a second `q` ends it at once.
use std::io::BufRead;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::signals::{self, Wiring};

/// Starts the reader when stdin is a terminal; says whether it did.
pub fn spawn(wiring: Wiring) -> bool {
    use std::io::IsTerminal;
    if !std::io::stdin().is_terminal() {
        return false;
    }
    // A read from the terminal by a background job would stop the whole process
    // (SIGTTIN); ignored, the read fails with EIO instead, and the reader waits for the
    // job to come back to the foreground.
    // SAFETY: setting a signal's disposition to SIG_IGN.
    unsafe { libc::signal(libc::SIGTTIN, libc::SIG_IGN) };
    std::thread::Builder::new()
        .name("line-keys".into())
        .spawn(move || read_lines(&wiring))
        .is_ok()
}

fn read_lines(w: &Wiring) {
    let stdin = std::io::stdin();
    let fd = stdin.as_raw_fd();
    let mut line = String::new();
    loop {
        if !foreground(fd) {
            std::thread::sleep(Duration::from_millis(500));
            continue;
        }
        line.clear();
        match stdin.lock().read_line(&mut line) {
            Ok(0) => return, // end of input (Ctrl-D): nothing more will be typed
            Ok(_) => {
                if is_quit(&line) {
                    signals::ask_stop(w, "q", false);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // EIO: in the background after all (or the terminal went away; SIGHUP says so).
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// Whether this process's group owns the terminal on `fd`.
fn foreground(fd: i32) -> bool {
    // SAFETY: plain queries on a descriptor we hold.
    unsafe { libc::tcgetpgrp(fd) == libc::getpgrp() }
}

/// `q` (or `Q`, or `quit`) alone on a line.
fn is_quit(line: &str) -> bool {
    matches!(line.trim(), "q" | "Q" | "quit")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_q_alone_on_a_line_stops() {
        assert!(is_quit("q\n") && is_quit(" Q \r\n") && is_quit("quit\n"));
        assert!(!is_quit("\n") && !is_quit("qq\n") && !is_quit("p\n"));
    }
}
