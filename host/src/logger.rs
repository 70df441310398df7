//! The JSONL run log: one object per telemetry message, `{"ts":…,"t":…,"kind":…,…}`,
//! plain or zstd-framed (a name ending in `.zst`), rotated into numbered segments when
//! asked. Schema and format: docs/LOG_SCHEMA.md; the encoding: core/src/logfile.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use headroom_core::logfile::{self, FrameWriter, Rotate};
use headroom_core::{Bus, Level, Notice, Record, Telemetry};

use crate::log_thinning::Thinning;

pub struct LogWriter {
    thread: JoinHandle<Option<String>>,
    path: PathBuf,
    /// Records taken off the queue so far: [`LogWriter::finish`] tells a writer still
    /// working through its queue from one stuck in a write.
    taken: Arc<AtomicU64>,
}

/// How long a finishing log writer may go without taking a record before it is given up
/// as stuck (its reader stopped reading): the run's exit waits at most this on a dead log.
pub const LOG_STALL: Duration = Duration::from_millis(250);

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
    rotate: Option<Rotate>,
}

/// How long a compressed log may hold a high-rate record before making it readable: each
/// flush ends a zstd block, and flushing every record of a fast run would cost most of
/// the compression. Records that are not high-rate are flushed at once.
pub const ZST_FLUSH: Duration = Duration::from_secs(1);

/// Where a Python run's `log=` goes: the path itself when it is new, empty or not a
/// regular file (a FIFO, /dev/stdout), else the first free `STEM-2.EXT`, `STEM-3.EXT`, …
/// beside it: a script or notebook cell run again keeps the earlier run's log, as a fresh
/// `headroom train` keeps the earlier run's checkpoints (`runs/NAME-N`).
pub fn next_free(path: &Path) -> PathBuf {
    // A name whose rotated segments lie beside it is an earlier run's log too.
    let taken = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() > 0)
            || !logfile::segments(p).is_empty()
    };
    if !taken(path) {
        return path.to_path_buf();
    }
    let (stem, ext) = logfile::names::split_name(path);
    (2u32..)
        .map(|n| path.with_file_name(format!("{stem}-{n}{ext}")))
        .find(|p| !p.exists() && !taken(p))
        .expect("some numbered name is free")
}

/// Opens the log (creating it and its directory when missing) before anything runs, so an
/// unwritable path is an error at start, not a silent loss later. Nothing is truncated
/// yet. `inputs` are files the run reads (config, corpus): a log on one of them would
/// overwrite it, so that is an error too, as is a log anywhere inside `checkpoints` (the
/// run's checkpoint directory: pruning deletes step directories, and a log on `latest` or
/// `state.json` would destroy the checkpoint). A FIFO is waited for up to `fifo_wait`
/// for its reader, saying so.
pub fn open(
    path: &Path,
    inputs: &[(&str, &Path)],
    checkpoints: Option<&Path>,
    fifo_wait: Duration,
) -> Result<PendingLog> {
    if let Some(checkpoints) = checkpoints.filter(|c| is_within(path, c)) {
        bail!(
            "--log {} is inside the checkpoint directory {}, whose files the run replaces \
             and prunes; put the log elsewhere (e.g. --log {}.jsonl)",
            path.display(),
            checkpoints.display(),
            checkpoints.display()
        );
    }
    if let Some(first) = logfile::segments(path).first() {
        bail!(
            "--log {} has rotated segments of an earlier log beside it ({} …), which a replay \
             of this name would play before the new run; move them away or choose another \
             --log path",
            path.display(),
            first.display()
        );
    }
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
    let file = if is_fifo(path) {
        open_fifo(path, fifo_wait)
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            // Not yet: `commit` truncates once the run has started.
            .truncate(false)
            .open(path)
            .map_err(anyhow::Error::new)
    };
    match file {
        Ok(file) => Ok(PendingLog {
            path: path.to_path_buf(),
            file,
            created_file,
            created_dirs,
            rotate: None,
        }),
        Err(e) => {
            remove_dirs(&created_dirs);
            Err(e.context(format!(
                "cannot write log {}; choose another --log path",
                path.display()
            )))
        }
    }
}

fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// Opening a FIFO for writing blocks until it has a reader, and a run that hangs silently
/// at start looks dead. Non-blocking opens fail (ENXIO) until a reader comes: retry for
/// `wait`, say once what is awaited, then give up naming the fix.
fn open_fifo(path: &Path, wait: Duration) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let started = Instant::now();
    let mut said = false;
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
        {
            Ok(file) => {
                // Writes may block from now on: the writer thread is off the training path
                // and the bus never waits for it.
                set_blocking(&file)?;
                return Ok(file);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {}
            Err(e) => return Err(e.into()),
        }
        if started.elapsed() >= wait {
            bail!(
                "the FIFO has no reader after {:.0} s; start its reader first (e.g. `cat {} &`) \
                 or log to a regular file",
                wait.as_secs_f64(),
                path.display()
            );
        }
        if !said {
            crate::out::err(&format!(
                "headroom: waiting up to {:.0} s for a reader of the FIFO {} (--log)",
                wait.as_secs_f64(),
                path.display()
            ));
            said = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn set_blocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `path` is `dir` or lies under it, links and `..` resolved as far as the paths
/// exist (the log file and the checkpoint directory may not exist yet).
fn is_within(path: &Path, dir: &Path) -> bool {
    let (path, dir) = (resolve(path), resolve(dir));
    path.starts_with(&dir)
}

/// The absolute path with its longest existing prefix canonicalized and the rest appended.
fn resolve(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut missing = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(real) = cur.canonicalize() {
            let mut out = real;
            for part in missing.iter().rev() {
                out.push(part);
            }
            return out;
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                missing.push(name.to_os_string());
                cur = parent;
            }
            _ => return abs,
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
    /// Rotate the log when it reaches a size or an age (`--log-rotate`, `log_rotate=`).
    /// Only a regular file rotates: a FIFO or `/dev/stdout` cannot be renamed away.
    pub fn with_rotation(mut self, rotate: Option<Rotate>) -> PendingLog {
        self.rotate = rotate;
        self
    }

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
    fn commit(self) -> std::io::Result<(Sink, Option<Rotate>)> {
        let regular = self.file.metadata()?.is_file();
        if regular {
            self.file.set_len(0)?;
        }
        let sink = Sink::new(&self.path, self.file)?;
        Ok((sink, self.rotate.filter(|_| regular)))
    }
}

/// The open log file, in its format.
enum Sink {
    Plain { out: BufWriter<File>, written: u64 },
    Zst(FrameWriter<BufWriter<File>>),
}

impl Sink {
    fn new(path: &Path, file: File) -> std::io::Result<Sink> {
        let out = BufWriter::new(file);
        Ok(if logfile::is_compressed(path) {
            Sink::Zst(FrameWriter::new(out)?)
        } else {
            Sink::Plain { out, written: 0 }
        })
    }

    fn write(&mut self, rec: &Record) -> std::io::Result<()> {
        match self {
            Sink::Plain { out, written } => {
                let line = rec.to_line();
                *written += line.len() as u64 + 1;
                writeln!(out, "{line}")
            }
            Sink::Zst(w) => w.write_record(rec),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Plain { out, .. } => out.flush(),
            Sink::Zst(w) => w.flush(),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Sink::Plain { written, .. } => *written,
            Sink::Zst(w) => w.bytes_written(),
        }
    }

    /// The file complete: a compressed one ends its last frame and index.
    fn close(self) -> std::io::Result<()> {
        match self {
            Sink::Plain { mut out, .. } => out.flush(),
            Sink::Zst(w) => w.finish()?.flush(),
        }
    }
}

/// Renames the live file to the next numbered segment, ends it there (a compressed one
/// with its last index) and opens a fresh one at `path`. When the rename fails the sink
/// comes back untouched, to go on writing where it was.
fn rotate(
    path: &Path,
    sink: Sink,
    segment: u32,
) -> Result<std::io::Result<Sink>, (Box<Sink>, String)> {
    let renamed = logfile::segment_path(path, segment);
    if let Err(e) = std::fs::rename(path, &renamed) {
        return Err((
            Box::new(sink),
            format!("renaming it to {} failed: {e}", renamed.display()),
        ));
    }
    Ok(sink
        .close()
        .and_then(|()| File::create(path))
        .and_then(|file| Sink::new(path, file)))
}

impl LogWriter {
    /// Writes until every sender of `lines` is gone. A write failure (disk full, ...) is
    /// told once on screen through `ui`, then the writer keeps draining without writing,
    /// so the trainer never blocks on a dead log. Err: the writer's thread could not start
    /// (a hard cap with no room left for its stack), said as what the run does without it.
    pub fn start(log: PendingLog, lines: Receiver<Record>, ui: Bus) -> Result<LogWriter, String> {
        let path = log.path.clone();
        let taken = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&taken);
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
                let compressed = logfile::is_compressed(&path);
                let (mut out, rotation) = match log.commit() {
                    Ok((sink, rotation)) => (Some(sink), rotation),
                    Err(e) => {
                        warn(&mut failed, e);
                        (None, None)
                    }
                };
                let mut rotation = rotation.map(|r| (r, Instant::now(), 0u32));
                let mut thinning = Thinning::default();
                // A compressed log's high-rate records wait at most ZST_FLUSH for a flush.
                let mut unflushed_since: Option<Instant> = None;
                loop {
                    let line = match unflushed_since {
                        Some(since) => match lines.recv_deadline(since + ZST_FLUSH) {
                            Ok(line) => line,
                            Err(RecvTimeoutError::Timeout) => {
                                unflushed_since = None;
                                if let Some(Err(e)) = out.as_mut().map(Sink::flush) {
                                    warn(&mut failed, e);
                                    out = None;
                                }
                                continue;
                            }
                            Err(RecvTimeoutError::Disconnected) => break,
                        },
                        None => match lines.recv() {
                            Ok(line) => line,
                            Err(_) => break,
                        },
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    // After a failure: keep draining, write nothing.
                    let Some(w) = out.as_mut() else {
                        continue;
                    };
                    // A reading may wait for the rest of its slot (log_thinning); the
                    // flush below is still due for what was written before it.
                    let (held, line) = thinning.offer(line);
                    let wrote = held.is_some() || line.is_some();
                    let lifecycle = line.as_ref().is_some_and(|l| !l.msg.is_high_rate());
                    let mut res = Ok(());
                    for rec in held.iter().chain(line.iter()) {
                        res = res.and_then(|()| w.write(rec));
                    }
                    // Flush on lifecycle events so a crash loses at most a few steps'
                    // figures, never the record of what happened; a plain log also when
                    // the queue is empty, a compressed one a second later at most.
                    let now = lifecycle || (!compressed && lines.is_empty());
                    if res.is_ok() && now {
                        res = w.flush();
                        unflushed_since = None;
                    } else if res.is_ok() && wrote {
                        unflushed_since.get_or_insert_with(Instant::now);
                    }
                    if let Err(e) = res {
                        warn(&mut failed, e);
                        out = None;
                        continue;
                    }
                    let due = rotation.as_ref().is_some_and(|(r, opened, _)| match r {
                        Rotate::Size(max) => w.bytes() >= *max,
                        Rotate::Every(age) => opened.elapsed() >= *age,
                    });
                    if due {
                        let (_, opened, segment) = rotation.as_mut().expect("due");
                        *segment += 1;
                        let sink = out.take().expect("written above");
                        match rotate(&path, sink, *segment) {
                            Ok(Ok(fresh)) => {
                                out = Some(fresh);
                                *opened = Instant::now();
                                unflushed_since = None;
                            }
                            Ok(Err(e)) => warn(&mut failed, e),
                            Err((sink, why)) => {
                                out = Some(*sink);
                                rotation = None;
                                let text = format!(
                                    "log {} cannot rotate ({why}); it goes on growing under \
                                     its name",
                                    path.display()
                                );
                                ui.send(Telemetry::Notice(Notice::new(Level::Warn, "log", text)));
                            }
                        }
                    }
                }
                if let Some(mut w) = out.take() {
                    let last = thinning.take().map_or(Ok(()), |h| w.write(&h));
                    if let Err(e) = last.and_then(|()| w.close()) {
                        failed = Some(format!("flushing log {} failed: {e}", path.display()));
                    }
                }
                failed
            })
            .map_err(|e| {
                format!(
                    "the log writer's thread could not start ({e}): this run writes no log \
                     ({} stays empty); the screen and attached viewers still get every record",
                    path.display()
                )
            })?;
        Ok(LogWriter {
            thread,
            path,
            taken,
        })
    }

    /// Waits for the last line, up to `wait` while the writer works through its queue and
    /// [`LOG_STALL`] once it makes no progress; returns the write error, if one happened. A
    /// writer stuck in a write (a FIFO whose reader stopped reading) is left behind, said,
    /// and dies with the process: the run's end must not wait on its log.
    pub fn finish(self, wait: Duration) -> Option<String> {
        let deadline = Instant::now() + wait;
        let (mut seen, mut moved) = (self.taken.load(Ordering::Relaxed), Instant::now());
        while !self.thread.is_finished() {
            let now = Instant::now();
            let taken = self.taken.load(Ordering::Relaxed);
            if taken != seen {
                (seen, moved) = (taken, now);
            }
            if now >= deadline || now.duration_since(moved) >= LOG_STALL {
                return Some(format!(
                    "the log writer is stuck writing {} (its reader stopped reading); what it \
                     had not written by now is lost",
                    self.path.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.thread
            .join()
            .unwrap_or_else(|_| Some("log writer panicked".into()))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_earlier_runs_log_is_kept_and_the_next_free_name_taken() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("gpt.jsonl");
        assert_eq!(next_free(&log), log, "new");
        std::fs::write(&log, "").unwrap();
        assert_eq!(next_free(&log), log, "empty: nothing to keep");
        std::fs::write(&log, "{}\n").unwrap();
        assert_eq!(next_free(&log), dir.path().join("gpt-2.jsonl"));
        std::fs::write(dir.path().join("gpt-2.jsonl"), "{}\n").unwrap();
        assert_eq!(next_free(&log), dir.path().join("gpt-3.jsonl"));
        assert_eq!(next_free(Path::new("/dev/null")), Path::new("/dev/null"));
    }

    use super::*;
    use headroom_core::RunStatus;
    use std::os::unix::fs::OpenOptionsExt;

    const WAIT: Duration = Duration::from_secs(2);

    #[test]
    fn a_log_inside_the_checkpoint_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("runs/x");
        std::fs::create_dir_all(ck.join("step-000002")).unwrap();
        std::fs::write(ck.join("latest"), "step-000002\n").unwrap();
        for inside in [
            ck.join("latest"),
            ck.join("step-000002/state.json"),
            ck.join("new/run.jsonl"),
            dir.path().join("runs/./x/../x/log.jsonl"),
            ck.clone(),
        ] {
            let err = format!("{:#}", open(&inside, &[], Some(&ck), WAIT).err().unwrap());
            assert!(
                err.contains("inside the checkpoint directory"),
                "{inside:?}: {err}"
            );
        }
        assert_eq!(
            std::fs::read_to_string(ck.join("latest")).unwrap(),
            "step-000002\n"
        );
        // Beside it is fine, including a name that only starts the same.
        open(&dir.path().join("runs/x.jsonl"), &[], Some(&ck), WAIT)
            .unwrap()
            .abandon();
        open(&dir.path().join("runs/xy/log.jsonl"), &[], Some(&ck), WAIT)
            .unwrap()
            .abandon();
    }

    #[test]
    fn a_fifo_without_a_reader_is_an_error_after_the_wait_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("log.fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t0 = Instant::now();
        let err = format!(
            "{:#}",
            open(&fifo, &[], None, Duration::from_millis(300))
                .err()
                .unwrap()
        );
        assert!(err.contains("no reader") && err.contains("--log"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // With a reader it opens.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let log = open(&fifo, &[], None, WAIT).unwrap();
        assert!(is_fifo(&log.path));
        drop(reader);
    }

    #[test]
    fn a_writer_stuck_on_a_full_fifo_does_not_hold_up_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("log.fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // A reader that never reads.
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let (bus, rx) = Bus::with_capacities(true, 64, 64, 16);
        let writer = LogWriter::start(
            open(&fifo, &[], None, WAIT).unwrap(),
            rx.log.unwrap(),
            bus.ui_only(),
        )
        .unwrap();
        let t0 = Instant::now();
        // Records of 4 KiB: the pipe's 64 KiB fill after a handful, and the writer blocks.
        for _ in 0..2_000 {
            bus.send(Telemetry::Notice(Notice::new(
                Level::Info,
                "test",
                "x".repeat(4096),
            )));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the sender waited on the log"
        );
        assert!(bus.sink_losses().log > 0);
        drop(bus);
        let err = writer.finish(Duration::from_millis(300)).unwrap();
        assert!(err.contains("stuck"), "{err}");
    }

    #[test]
    fn records_are_flat_objects_with_kind_and_timestamps() {
        let line = Record {
            ts: 1.7e9,
            t: 0.25,
            msg: Telemetry::Status {
                status: RunStatus::Paused,
            },
        };
        let v: serde_json::Value = serde_json::from_str(&line.to_line()).unwrap();
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
        let err = open(&blocker.join("run.jsonl"), &[], None, WAIT)
            .err()
            .unwrap();
        assert!(format!("{err:#}").contains("--log"), "{err:#}");
    }

    #[test]
    fn a_log_on_an_input_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("corpus.txt");
        std::fs::write(&corpus, "text").unwrap();
        let via_dots = dir.path().join(".").join("corpus.txt");
        let err = open(&via_dots, &[("corpus", &corpus)], None, WAIT)
            .err()
            .unwrap();
        let err = format!("{err:#}");
        assert!(err.contains("--log") && err.contains("corpus"), "{err}");
        assert_eq!(std::fs::read_to_string(&corpus).unwrap(), "text");
    }

    #[test]
    fn an_abandoned_log_leaves_no_trace() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("old.jsonl");
        std::fs::write(&old, "previous run\n").unwrap();
        open(&old, &[], None, WAIT).unwrap().abandon();
        assert_eq!(std::fs::read_to_string(&old).unwrap(), "previous run\n");

        let new = dir.path().join("a/b/run.jsonl");
        let log = open(&new, &[], None, WAIT).unwrap();
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
        let writer = LogWriter::start(
            open(&path, &[], None, WAIT).unwrap(),
            rx.log.unwrap(),
            bus.ui_only(),
        )
        .unwrap();
        bus.send(Telemetry::Status {
            status: RunStatus::Paused,
        });
        drop(bus);
        assert_eq!(writer.finish(WAIT), None);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(text.contains("\"paused\""), "{text}");
    }

    /// A reading held for its slot (log_thinning) does not hold back the flush of what
    /// was written before it: a reader of the live log sees every record written once the
    /// queue is empty.
    #[test]
    fn a_held_reading_does_not_hold_back_the_records_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl");
        let (bus, rx) = Bus::new(true);
        let log = open(&path, &[], None, WAIT).unwrap();
        // Both queued before the writer starts: the first is written with the queue not
        // empty (no flush then), the reading after it is held.
        bus.send(Telemetry::Segments(headroom_core::SegmentMap::default()));
        bus.send(Telemetry::Sample(headroom_core::SystemSample::default()));
        let writer = LogWriter::start(log, rx.log.unwrap(), bus.ui_only()).unwrap();
        // At once, not at the writer's 1 s timer for unflushed records (ZST_FLUSH).
        let deadline = Instant::now() + ZST_FLUSH * 7 / 10;
        let text = loop {
            let text = std::fs::read_to_string(&path).unwrap();
            if text.contains("segments") || Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            text.contains("\"kind\":\"segments\""),
            "not flushed: {text:?}"
        );
        assert!(
            !text.contains("\"sample\""),
            "the reading waits for its slot: {text}"
        );
        drop(bus);
        assert_eq!(writer.finish(WAIT), None);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"kind\":\"sample\""),
            "written at the end: {text}"
        );
    }

    /// Notices of `n` bytes of text no compressor can shrink: a log that grows on disk.
    fn noisy(i: u64, n: usize) -> Telemetry {
        let text: String = (0..n as u64)
            .map(|k| (b'a' + (headroom_core::units::splitmix64(i * 7919 + k) % 26) as u8) as char)
            .collect();
        Telemetry::Notice(Notice::new(Level::Info, "test", text))
    }

    fn zst_lines(path: &Path) -> Vec<String> {
        let bytes = std::fs::read(path).unwrap();
        let text = String::from_utf8(zstd::decode_all(&bytes[..]).unwrap()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn a_zst_log_is_zstd_framed_jsonl_that_ends_with_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl.zst");
        let (bus, rx) = Bus::new(true);
        let writer = LogWriter::start(
            open(&path, &[], None, WAIT).unwrap(),
            rx.log.unwrap(),
            bus.ui_only(),
        )
        .unwrap();
        for i in 0..100 {
            bus.send(Telemetry::Status {
                status: if i % 2 == 0 {
                    RunStatus::Paused
                } else {
                    RunStatus::Running
                },
            });
        }
        drop(bus);
        assert_eq!(writer.finish(WAIT), None);
        let lines = zst_lines(&path);
        assert_eq!(lines.len(), 100);
        assert!(lines[0].contains("\"paused\"") && lines[1].contains("\"running\""));
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            headroom_core::logfile::index::frame_len_from_trailer(&bytes).is_some(),
            "a finished compressed log ends with an index frame"
        );
    }

    #[test]
    fn a_rotated_log_is_a_chain_of_segments_holding_every_record_once_in_order() {
        for name in ["run.jsonl", "run.jsonl.zst"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(name);
            // Room for every notice on the unread screen queue too: no loss notices.
            let (bus, rx) = Bus::with_capacities(true, 4096, 64, 8192);
            let writer = LogWriter::start(
                open(&path, &[], None, WAIT)
                    .unwrap()
                    .with_rotation(Some(Rotate::Size(1 << 20))),
                rx.log.unwrap(),
                bus.ui_only(),
            )
            .unwrap();
            // 3.5 MiB that does not compress: three full segments and the live file.
            for i in 0..875 {
                bus.send(noisy(i, 4096));
            }
            drop(bus);
            assert_eq!(writer.finish(Duration::from_secs(30)), None, "{name}");
            let chain = logfile::chain(&path);
            assert_eq!(chain.len(), 4, "{name}: {chain:?}");
            assert_eq!(chain[0], logfile::segment_path(&path, 1));
            let mut seen = Vec::new();
            for file in &chain {
                let lines = if logfile::is_compressed(file) {
                    zst_lines(file)
                } else {
                    std::fs::read_to_string(file)
                        .unwrap()
                        .lines()
                        .map(str::to_string)
                        .collect()
                };
                if file != &path {
                    // At the size, past it by what zstd still held (a block or two).
                    let size = std::fs::metadata(file).unwrap().len();
                    assert!(
                        (1 << 20..(1 << 20) + (512 << 10)).contains(&size),
                        "{file:?} {size}"
                    );
                }
                seen.extend(
                    lines
                        .iter()
                        .map(|l| match Record::from_line(l).unwrap().msg {
                            Telemetry::Notice(n) => n.text,
                            other => panic!("{other:?}"),
                        }),
                );
            }
            let expected: Vec<String> = (0..875)
                .map(|i| match noisy(i, 4096) {
                    Telemetry::Notice(n) => n.text,
                    _ => unreachable!(),
                })
                .collect();
            let first_bad = seen.iter().zip(&expected).position(|(a, b)| a != b);
            assert!(
                seen == expected,
                "{name}: every record once, in order: {} of {}, first differing {first_bad:?}",
                seen.len(),
                expected.len()
            );
            // The next run on this name is refused; a Python run takes the next free name.
            let err = format!("{:#}", open(&path, &[], None, WAIT).err().unwrap());
            assert!(err.contains("rotated segments"), "{err}");
            let (stem, ext) = logfile::names::split_name(&path);
            assert_eq!(next_free(&path), dir.path().join(format!("{stem}-2{ext}")));
        }
    }

    #[test]
    fn next_free_keeps_the_whole_log_ending() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("gpt.jsonl.zst");
        std::fs::write(&log, "x").unwrap();
        assert_eq!(next_free(&log), dir.path().join("gpt-2.jsonl.zst"));
        // A name whose live file is gone but whose segments remain is taken too.
        let other = dir.path().join("b.jsonl");
        std::fs::write(dir.path().join("b.1.jsonl"), "{}\n").unwrap();
        assert_eq!(next_free(&other), dir.path().join("b-2.jsonl"));
    }
}
