//! The JSONL run log: one object per telemetry message, `{"ts":…,"t":…,"kind":…,…}`.
//! Schema: docs/LOG_SCHEMA.md.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use crossbeam_channel::Receiver;
use headroom_core::{Bus, Level, LogLine, Notice, Telemetry};

pub struct LogWriter {
    thread: JoinHandle<Option<String>>,
}

/// Opens (creates or truncates) the log before anything runs, so an unwritable path is an
/// error at start, not a silent loss later.
pub fn open(path: &Path) -> Result<BufWriter<File>> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "cannot create the directory of log {}; choose another --log path",
                path.display()
            )
        })?;
    }
    let file = File::create(path).with_context(|| {
        format!(
            "cannot write log {}; choose another --log path",
            path.display()
        )
    })?;
    Ok(BufWriter::new(file))
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
    pub fn start(
        mut out: BufWriter<File>,
        path: PathBuf,
        lines: Receiver<LogLine>,
        ui: Bus,
    ) -> LogWriter {
        let thread = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || {
                let mut failed: Option<String> = None;
                for line in lines.iter() {
                    if failed.is_some() {
                        continue;
                    }
                    let lifecycle = !line.msg.is_high_rate();
                    let mut res = writeln!(out, "{}", render(&line));
                    // Flush on lifecycle events so a crash loses at most a few steps'
                    // figures, never the record of what happened.
                    if res.is_ok() && (lifecycle || lines.is_empty()) {
                        res = out.flush();
                    }
                    if let Err(e) = res {
                        let msg = format!(
                            "writing log {} failed ({e}); logging stopped, training continues",
                            path.display()
                        );
                        ui.send(Telemetry::Notice(Notice::new(
                            Level::Warn,
                            "log",
                            msg.clone(),
                        )));
                        failed = Some(msg);
                    }
                }
                if failed.is_none() {
                    if let Err(e) = out.flush() {
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
        let err = open(&blocker.join("run.jsonl")).unwrap_err();
        assert!(format!("{err:#}").contains("--log"), "{err:#}");
    }
}
