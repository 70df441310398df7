//! Runs the real binary on a pseudo-terminal, so raw mode, the alternate screen and their
//! restoration happen as they do for a user.
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::screen::Screen;

pub struct Pty {
    master: std::fs::File,
    pub child: Child,
    output: Arc<Mutex<Vec<u8>>>,
    cols: u16,
    rows: u16,
}

impl Pty {
    pub fn spawn(mut cmd: Command, cols: u16, rows: u16) -> Pty {
        let (mut master, mut slave) = (0, 0);
        let size = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: openpty writes two fds; the null pointers mean default name/termios.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &size,
            )
        };
        assert_eq!(rc, 0, "openpty failed");
        // SAFETY: both fds were just returned by openpty and are owned here.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        // openpty does not set close-on-exec: a child holding the master keeps its own
        // terminal open after the test is gone, blocked forever writing to a full pty.
        // SAFETY: F_SETFD on a descriptor we own.
        let rc = unsafe { libc::fcntl(master.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        assert_eq!(rc, 0, "FD_CLOEXEC on the pty master");
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave.try_clone().unwrap()));
        // A terminal that draws, unless the test chose one.
        if !cmd.get_envs().any(|(k, _)| k == "TERM") {
            cmd.env("TERM", "xterm-256color");
        }
        // SAFETY: setsid and TIOCSCTTY are async-signal-safe; they make the pty the
        // child's controlling terminal, as a shell would.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawning on a pty");
        drop(slave);
        let master = std::fs::File::from(master);
        let output = Arc::new(Mutex::new(Vec::new()));
        let (mut reader, sink) = (master.try_clone().unwrap(), Arc::clone(&output));
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            // EIO once the child and every copy of the slave are gone.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            master,
            child,
            output,
            cols,
            rows,
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).unwrap();
        self.master.flush().unwrap();
    }

    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// The output gathered since the start or the previous take, removed from the
    /// buffer: a long run's test keeps only what it needs instead of every byte.
    pub fn take_output(&self) -> Vec<u8> {
        std::mem::take(&mut *self.output.lock().unwrap())
    }

    /// Waits until `needle` is on a row of the screen, or whole in the raw output (an
    /// escape sequence, or a line that scrolled away between two looks). The screen, not
    /// the bytes: a redraw writes only the cells that changed, so a line that moved or
    /// changed in place is never whole in the stream.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        let start = Instant::now();
        let mut screen = Screen::new(self.cols as usize, self.rows as usize);
        let mut read = 0;
        loop {
            let out = self.output.lock().unwrap().clone();
            // take_output may have emptied the buffer since the last look.
            if out.len() < read {
                read = 0;
                screen = Screen::new(self.cols as usize, self.rows as usize);
            }
            // Up to the last whole character and escape sequence: the rest comes with the
            // next read.
            let new = &out[read..];
            let whole = match std::str::from_utf8(new) {
                Ok(s) => s,
                Err(e) => std::str::from_utf8(&new[..e.valid_up_to()]).unwrap(),
            };
            read += screen.feed_complete(whole);
            if screen.contains(needle) || String::from_utf8_lossy(&out).contains(needle) {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// (canonical mode, echo) of the terminal right now: both off while a TUI holds raw
    /// mode, both on for a restored shell terminal.
    pub fn line_discipline(&self) -> (bool, bool) {
        // SAFETY: tcgetattr fills the struct for a valid tty fd.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::tcgetattr(self.master.as_raw_fd(), &mut t) };
        assert_eq!(rc, 0, "tcgetattr on the pty");
        (t.c_lflag & libc::ICANON != 0, t.c_lflag & libc::ECHO != 0)
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        None
    }
}

/// A test that fails (panics) mid-way must not leave its headroom running forever: the
/// child is killed with the test.
impl Drop for Pty {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last 2000 bytes of a screen's output (cut at a character boundary), for messages.
pub fn tail(s: &str) -> &str {
    let mut i = s.len().saturating_sub(2000);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}
