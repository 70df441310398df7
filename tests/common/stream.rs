//! A run serving its stream, and a bare protocol client, for the stream tests: the client
//! speaks docs/PROTOCOL.md by hand, so a test sees exactly what a viewer would.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{bin, fixture};

/// A headless tiny run with its own runtime directory; killed when dropped, so a failed
/// test leaves no process behind.
pub struct Served {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub runtime: PathBuf,
}

impl Served {
    /// `headroom train --headless` on the tiny config for many steps, logging to
    /// `run.jsonl`, with `args` after.
    pub fn start(args: &[&str]) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("rt");
        let mut cmd = bin();
        cmd.current_dir(dir.path())
            .env("HEADROOM_RUNTIME_DIR", &runtime)
            .args(["train", "--headless", "--config"])
            .arg(fixture("tiny.toml"))
            .args([
                "--steps",
                "1000000",
                "--checkpoint-dir",
                "ck",
                "--log",
                "run.jsonl",
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("out.txt")).unwrap())
            .stderr(std::fs::File::create(dir.path().join("err.txt")).unwrap());
        let child = cmd.spawn().expect("spawning headroom");
        Served {
            child,
            dir,
            runtime,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A `headroom` command that sees this run's runtime directory.
    pub fn cmd(&self) -> Command {
        let mut c = bin();
        c.current_dir(self.dir.path())
            .env("HEADROOM_RUNTIME_DIR", &self.runtime);
        c
    }

    /// The run's socket, once it exists (the run has started).
    pub fn socket(&self) -> PathBuf {
        let want = format!("-{}.sock", self.pid());
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(rd) = std::fs::read_dir(&self.runtime) {
                for e in rd.flatten() {
                    let p = e.path();
                    if p.to_string_lossy().ends_with(&want) {
                        return p;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "no socket in {} after 60 s: {}",
            self.runtime.display(),
            self.stderr()
        );
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("err.txt")).unwrap_or_default()
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("run.jsonl")
    }

    /// The step records logged so far.
    pub fn steps_logged(&self) -> u64 {
        std::fs::read_to_string(self.log())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"kind\":\"step\","))
            .count() as u64
    }

    /// Waits until at least `n` steps are logged.
    pub fn wait_steps(&self, n: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.steps_logged() < n {
            assert!(
                Instant::now() < deadline,
                "fewer than {n} steps after {timeout:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Open descriptors and resident KiB of the run's process.
    pub fn fds_and_rss(&self) -> (usize, u64) {
        let fds = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0);
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let rss = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (fds, rss)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A protocol client on a Unix socket.
pub struct Viewer {
    pub stream: UnixStream,
    reader: BufReader<UnixStream>,
}

pub fn hello_line(protocol: &str) -> String {
    json!({"kind": "hello", "protocol": protocol, "client": "test", "want": "stream"}).to_string()
}

impl Viewer {
    pub fn connect(socket: &Path) -> Viewer {
        let stream = UnixStream::connect(socket).expect("connecting to the run");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        Viewer { stream, reader }
    }

    /// Connected and greeted (protocol 1.0, stream).
    pub fn attach(socket: &Path) -> Viewer {
        let mut v = Viewer::connect(socket);
        v.send(&hello_line("1.0"));
        v
    }

    pub fn send(&mut self, line: &str) {
        self.stream.write_all(line.as_bytes()).unwrap();
        self.stream.write_all(b"\n").unwrap();
    }

    /// The next line as JSON; None at the end of the stream (or on a read error). A last
    /// line cut off by the close (no newline) is the end too: a viewer disconnected in
    /// the middle of a write gets what was written.
    pub fn next(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) if !line.ends_with('\n') => None,
            Ok(_) => Some(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"))),
        }
    }

    /// Lines up to and including the first that `pred` accepts.
    pub fn until(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut seen = Vec::new();
        loop {
            match self.next() {
                Some(v) => {
                    let done = pred(&v);
                    seen.push(v);
                    if done {
                        return seen;
                    }
                }
                None => panic!(
                    "the stream ended before {what}; last lines: {:?}",
                    seen.iter().rev().take(5).collect::<Vec<_>>()
                ),
            }
        }
    }

    /// The catch-up, after the server's hello (which must come first).
    pub fn catch_up(&mut self) -> (Value, Vec<Value>) {
        let hello = self.next().expect("the server's hello");
        assert_eq!(hello["kind"], "hello", "{hello}");
        let mut lines = self.until("caught_up", |v| v["kind"] == "caught_up");
        let end = lines.pop().unwrap();
        assert_eq!(end["records"].as_u64(), Some(lines.len() as u64));
        (hello, lines)
    }
}

/// Whether `v` is an `error` line with this code.
pub fn is_error(v: &Value, code: &str) -> bool {
    v["kind"] == "error" && v["code"] == code
}
