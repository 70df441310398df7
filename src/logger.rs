//! The JSONL run log: one object per telemetry message, `{"ts":…,"t":…,"kind":…,…}`.
//! Schema: docs/LOG_SCHEMA.md.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use anyhow::{bail, Context, Result};
use crossbeam_channel::Receiver;
use headroom_core::{Bus, Level, LogLine, Notice, Telemetry};

pub struct LogWriter {
    thread: JoinHandle<Option<String>>,
}

/// A log file that was checked at start but not yet truncated. The run may still fail
/// before training (a bad corpus, a corrupt checkpoint): then [`PendingLog::abandon`]
/// leaves an existing file as it was and removes what [`open`] created, so a failed start
/// never costs the previous run's log. [`LogWriter::start`] truncates it.
pub struct PendingLog {
    path: PathBuf,
    file: File,
    created_file: bool,
    /// Directories `open` created, deepest first.
    created_dirs: Vec<PathBuf>,
}

/// Opens the log (creating it and its directory when missing) before anything runs, so an
/// unwritable path is an error at start, not a silent loss later. Nothing is truncated
/// yet. `inputs` are files the run reads (config, corpus): a log on one of them would
/// overwrite it, so that is an error too.
pub fn open(path: &Path, inputs: &[(&str, &Path)]) -> Result<PendingLog> {
    for (what, input) in inputs {
        if same_file(path, input) {
            bail!(
                "--log {} is the {what} {}; logging there would overwrite it; choose another \
                 --log path",
                path.display(),
                input.display()
            );
        }
    }
    let mut created_dirs = Vec::new();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        created_dirs = dir
            .ancestors()
            .filter(|d| !d.as_os_str().is_empty())
            .take_while(|d| !d.exists())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "cannot create the directory of log {}; choose another --log path",
                path.display()
            )
        })?;
    }
    let created_file = !path.exists();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        // Not yet: `commit` truncates once the run has started.
        .truncate(false)
        .open(path);
    match file {
        Ok(file) => Ok(PendingLog {
            path: path.to_path_buf(),
            file,
            created_file,
            created_dirs,
        }),
        Err(e) => {
            remove_dirs(&created_dirs);
            Err(anyhow::Error::new(e).context(format!(
                "cannot write log {}; choose another --log path",
                path.display()
            )))
        }
    }
}

/// Whether `a` and `b` name the same existing file (links and `..` included).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

fn remove_dirs(dirs: &[PathBuf]) {
    for d in dirs {
        // Only while empty: whatever someone else put there stays.
        let _ = std::fs::remove_dir(d);
    }
}

impl PendingLog {
    /// The run did not start: leave no trace of the log.
    pub fn abandon(self) {
        drop(self.file);
        if self.created_file {
            let _ = std::fs::remove_file(&self.path);
        }
        remove_dirs(&self.created_dirs);
    }

    /// The run started: truncate (regular files only: `/dev/null` or a pipe cannot be)
    /// and write from the start.
    fn commit(self) -> std::io::Result<BufWriter<File>> {
        if self.file.metadata()?.is_file() {
            self.file.set_len(0)?;
        }
        Ok(BufWriter::new(self.file))
    }
}

/// Renders one record. The message's own fields sit beside `ts`, `t` and `kind`.
pub fn render(line: &LogLine) -> String {
    let mut value = serde_json::to_value(&line.msg)
        .unwrap_or_else(|e| serde_json::json!({ "kind": "log_error", "error": e.to_string() }));
    if let Some(obj) = value.as_object_mut() {
        obj.insert("ts".into(), serde_json::json!(line.ts));
        obj.insert("t".into(), serde_json::json!(line.t));
    }
    value.to_string()
}

impl LogWriter {
    /// Writes until every sender of `lines` is gone. A write failure (disk full, ...) is
    /// told once on screen through `ui`, then the writer keeps draining without writing,
    /// so the trainer never blocks on a dead log.
    pub fn start(log: PendingLog, lines: Receiver<LogLine>, ui: Bus) -> LogWriter {
        let thread = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || {
                let path = log.path.clone();
                let mut failed: Option<String> = None;
                let warn = |failed: &mut Option<String>, e: std::io::Error| {
                    let msg = format!(
                        "writing log {} failed ({e}); logging stopped, training continues",
                        path.display()
                    );
                    ui.send(Telemetry::Notice(Notice::new(
                        Level::Warn,
                        "log",
                        msg.clone(),
                    )));
                    *failed = Some(msg);
                };
                let mut out = match log.commit() {
                    Ok(out) => Some(out),
                    Err(e) => {
                        warn(&mut failed, e);
                        None
                    }
                };
                for line in lines.iter() {
                    // After a failure: keep draining, write nothing.
                    let Some(w) = out.as_mut() else {
                        continue;
                    };
                    let lifecycle = !line.msg.is_high_rate();
                    let mut res = writeln!(w, "{}", render(&line));
                    // Flush on lifecycle events so a crash loses at most a few steps'
                    // figures, never the record of what happened.
                    if res.is_ok() && (lifecycle || lines.is_empty()) {
                        res = w.flush();
                    }
                    if let Err(e) = res {
                        warn(&mut failed, e);
                        out = None;
                    }
                }
                if let Some(w) = out.as_mut() {
                    if let Err(e) = w.flush() {
                        failed = Some(format!("flushing log {} failed: {e}", path.display()));
                    }
                }
                failed
            })
            .expect("spawning the log writer");
        LogWriter { thread }
    }

    /// Waits for the last line; returns the write error, if one happened.
    pub fn finish(self) -> Option<String> {
        self.thread
            .join()
            .unwrap_or_else(|_| Some("log writer panicked".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::RunStatus;

    #[test]
    fn records_are_flat_objects_with_kind_and_timestamps() {
        let line = LogLine {
            ts: 1.7e9,
            t: 0.25,
            msg: Telemetry::Status {
                status: RunStatus::Paused,
            },
        };
        let v: serde_json::Value = serde_json::from_str(&render(&line)).unwrap();
        assert_eq!(v["kind"], "status");
        assert_eq!(v["status"], "paused");
        assert_eq!(v["t"], 0.25);
        assert_eq!(v["ts"], 1.7e9);
    }

    #[test]
    fn unwritable_path_is_an_error_naming_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, "x").unwrap();
        let err = open(&blocker.join("run.jsonl"), &[]).err().unwrap();
        assert!(format!("{err:#}").contains("--log"), "{err:#}");
    }

    #[test]
    fn a_log_on_an_input_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("corpus.txt");
        std::fs::write(&corpus, "text").unwrap();
        let via_dots = dir.path().join(".").join("corpus.txt");
        let err = open(&via_dots, &[("corpus", &corpus)]).err().unwrap();
        let err = format!("{err:#}");
        assert!(err.contains("--log") && err.contains("corpus"), "{err}");
        assert_eq!(std::fs::read_to_string(&corpus).unwrap(), "text");
    }

    #[test]
    fn an_abandoned_log_leaves_no_trace() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("old.jsonl");
        std::fs::write(&old, "previous run\n").unwrap();
        open(&old, &[]).unwrap().abandon();
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "previous run\n");

        let new = dir.path().join("a/b/run.jsonl");
        let log = open(&new, &[]).unwrap();
        assert!(new.exists(), "created at open: the path is proven writable");
        log.abandon();
        assert!(!dir.path().join("a").exists(), "its directories went too");
    }

    #[test]
    fn a_started_log_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl");
        std::fs::write(&path, "a much longer previous run\n").unwrap();
        let (bus, rx) = Bus::new(true);
        let writer = LogWriter::start(open(&path, &[]).unwrap(), rx.log.unwrap(), bus.ui_only());
        bus.send(Telemetry::Status {
            status: RunStatus::Paused,
        });
        drop(bus);
        assert_eq!(writer.finish(), None);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("\"paused\""), "{text}");
    }
}
