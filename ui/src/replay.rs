//! A run's JSONL log as a [`Feed`]: a thread reads it line by line and hands the records to
//! the screen paced by their own time (`t`, the run's seconds), as the run lived them.
//!
//! - Pacing: a record is due when the replay clock reaches its `t`; the clock runs at
//!   `speed` times the run's pace (1/16× to 1024×). A gap longer than [`MAX_GAP_S`] of the
//!   run's time (a run paused for an hour) is shortened to that: the clock jumps ahead.
//! - Controls ([`ReplayControl`]): pause and resume; one step (everything up to and
//!   including the next `step` record, at once, then paused); jump to the end (everything
//!   left at once); speed doubled or halved.
//! - `follow` tails a log still being written: at its end the thread looks again every
//!   [`FOLLOW_POLL`], waits for the rest of a half-written last line, and starts over
//!   when the file is truncated (the screen's state starts afresh too, through
//!   [`Link::Connected`]).
//! - Lines that are not records are skipped and counted (records of kinds this build does
//!   not know are skipped silently: a newer producer's); at the end of the log one notice
//!   says so, and that the replay reached the end.
//!
//! The thread blocks on its control queue while paused or waiting, and sleeps between
//! looks at a followed file: it never spins. It ends when the screen drops the feed.
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use headroom_core::{BadRecord, Level, Notice, Record, Telemetry};

use crate::feed::{
    Control, Feed, Link, ReplayControl, ReplayHandle, ReplayState, MAX_SPEED, MIN_SPEED,
};

/// The longest stretch of the run's time the replay waits through between two records.
pub const MAX_GAP_S: f64 = 2.0;
/// How often a followed log is looked at again once its end is reached.
pub const FOLLOW_POLL: Duration = Duration::from_millis(100);
/// Records queued for the screen: a jump to the end waits on the screen, never drops.
const QUEUE: usize = 1024;
/// How much of the log's end is read to learn its length in time before playing.
const TAIL_BYTES: u64 = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayOptions {
    /// Times the run's own pace (clamped to 1/16..1024).
    pub speed: f64,
    /// Tail a log still being written.
    pub follow: bool,
    /// Deliver everything at once: the final state first (a followed log then goes on
    /// live).
    pub start_at_end: bool,
}

impl Default for ReplayOptions {
    fn default() -> ReplayOptions {
        ReplayOptions {
            speed: 1.0,
            follow: false,
            start_at_end: false,
        }
    }
}

/// Starts replaying the log at `path`. A missing or unreadable file is an error naming
/// the path, and so is an empty one unless it is followed (a log just created).
pub fn replay_feed(path: &Path, opts: ReplayOptions) -> io::Result<Feed> {
    let named = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let file = File::open(path).map_err(named)?;
    let len = file.metadata().map_err(named)?.len();
    if len == 0 && !opts.follow {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: the log is empty: no records to replay", path.display()),
        ));
    }
    let total = last_time(path, len).unwrap_or(0.0);
    let (events_tx, events) = bounded(QUEUE);
    let (metrics_tx, metrics) = bounded(QUEUE);
    let (control_tx, control_rx) = bounded(64);
    let (link_tx, link) = bounded(8);
    let speed = if opts.speed.is_finite() && opts.speed > 0.0 {
        opts.speed.clamp(MIN_SPEED, MAX_SPEED)
    } else {
        1.0
    };
    let state = Arc::new(Mutex::new(ReplayState {
        total,
        speed,
        following: opts.follow,
        ..ReplayState::default()
    }));
    let mut player = Player {
        path: path.to_path_buf(),
        lines: Lines::new(file),
        out: Out {
            events: events_tx,
            metrics: metrics_tx,
            link: link_tx,
        },
        control: control_rx,
        state: Arc::clone(&state),
        follow: opts.follow,
        pending: None,
        position: None,
        since: Instant::now(),
        total,
        speed,
        paused: false,
        stepping: false,
        jumping: opts.start_at_end,
        skipped: 0,
    };
    std::thread::Builder::new()
        .name("replay".into())
        .spawn(move || player.run())?;
    Ok(Feed {
        events,
        metrics,
        dropped: Arc::new(AtomicU64::new(0)),
        control: Control::Replay(ReplayHandle {
            control: control_tx,
            state,
        }),
        select_rank: None,
        link,
    })
}

/// The `t` of the last record in the log's tail, if there is one. Read through a file of
/// its own: a cloned handle would share (and move) the player's offset.
fn last_time(path: &Path, len: u64) -> Option<f64> {
    let mut file = File::open(path).ok()?;
    let from = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut tail = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    text.lines()
        .rev()
        .find_map(|line| Record::from_line(line.trim()).ok().map(|r| r.t))
}

/// Whole lines of a file that may still be growing.
struct Lines {
    reader: BufReader<File>,
    /// Bytes taken from the file so far, a partial line included.
    offset: u64,
    partial: Vec<u8>,
}

enum Line {
    Whole(String),
    /// The end of the file for now; a half-written line waits in `partial`.
    End,
}

impl Lines {
    fn new(file: File) -> Lines {
        Lines {
            reader: BufReader::new(file),
            offset: 0,
            partial: Vec::new(),
        }
    }

    fn next(&mut self) -> io::Result<Line> {
        let n = self.reader.read_until(b'\n', &mut self.partial)?;
        self.offset += n as u64;
        if self.partial.last() == Some(&b'\n') {
            let line = String::from_utf8_lossy(&self.partial).into_owned();
            self.partial.clear();
            return Ok(Line::Whole(line));
        }
        Ok(Line::End)
    }

    /// What is left of a log that will not grow: a last line without its newline.
    fn rest(&mut self) -> Option<String> {
        (!self.partial.is_empty()).then(|| {
            let line = String::from_utf8_lossy(&self.partial).into_owned();
            self.partial.clear();
            line
        })
    }

    /// Shorter than what was read: the file was truncated (or replaced by a shorter one).
    fn truncated(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|m| m.len() < self.offset)
    }
}

/// Where records go; an error means the screen is gone.
struct Out {
    events: Sender<Record>,
    metrics: Sender<Record>,
    link: Sender<Link>,
}

struct Gone;

impl Out {
    fn send(&self, rec: Record) -> Result<(), Gone> {
        let queue = if rec.msg.is_high_rate() {
            &self.metrics
        } else {
            &self.events
        };
        queue.send(rec).map_err(|_| Gone)
    }
}

struct Player {
    path: PathBuf,
    lines: Lines,
    out: Out,
    control: Receiver<ReplayControl>,
    state: Arc<Mutex<ReplayState>>,
    follow: bool,
    /// The next record, read but not yet due.
    pending: Option<Record>,
    /// The replay clock at `since`; `None` before the first record.
    position: Option<f64>,
    since: Instant,
    total: f64,
    speed: f64,
    paused: bool,
    /// Delivering up to the next `step` record, then pausing.
    stepping: bool,
    /// Delivering everything left at once.
    jumping: bool,
    skipped: u64,
}

impl Player {
    fn run(&mut self) {
        // Ends quietly when the screen is gone.
        let _ = self.play();
    }

    fn play(&mut self) -> Result<(), Gone> {
        loop {
            let Some(rec) = self.pending.take() else {
                if self.read_next()? {
                    continue;
                }
                if !self.follow {
                    return self.finish();
                }
                self.jumping = false;
                self.stepping = false;
                self.publish(false);
                // Nothing to play: wait for a control or the next look at the file.
                match self.control.recv_timeout(FOLLOW_POLL) {
                    Ok(c) => self.obey(c),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Err(Gone),
                }
                if self.lines.truncated(&self.path) {
                    self.restart()?;
                }
                continue;
            };
            let t = rec.t;
            self.position.get_or_insert(t);
            if self.jumping || self.stepping || t <= self.now() {
                self.deliver(rec)?;
                continue;
            }
            self.pending = Some(rec);
            if self.paused {
                self.publish(false);
                match self.control.recv() {
                    Ok(c) => self.obey(c),
                    Err(_) => return Err(Gone),
                }
                continue;
            }
            // A long quiet stretch of the run is shortened.
            let now = self.now();
            if t - now > MAX_GAP_S {
                self.rebase(t - MAX_GAP_S);
            }
            self.publish(false);
            let wait = Duration::from_secs_f64(((t - self.now()) / self.speed).max(0.0));
            match self.control.recv_timeout(wait) {
                Ok(c) => self.obey(c),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(Gone),
            }
        }
    }

    /// Reads until a record is pending; false at the end of the file (for now).
    fn read_next(&mut self) -> Result<bool, Gone> {
        loop {
            let line = match self.lines.next() {
                Ok(Line::Whole(line)) => line,
                Ok(Line::End) if self.follow => return Ok(false),
                Ok(Line::End) => match self.lines.rest() {
                    Some(line) => line,
                    None => return Ok(false),
                },
                Err(e) => {
                    let text = format!("reading {} failed: {e}", self.path.display());
                    self.notice(Level::Error, text)?;
                    self.follow = false;
                    return Ok(false);
                }
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            match Record::from_line(line) {
                Ok(rec) => {
                    self.total = self.total.max(rec.t);
                    self.pending = Some(rec);
                    return Ok(true);
                }
                Err(BadRecord::UnknownKind(_)) => {}
                Err(_) => self.skipped += 1,
            }
        }
    }

    fn deliver(&mut self, rec: Record) -> Result<(), Gone> {
        let is_step = matches!(rec.msg, Telemetry::Step(_));
        // The clock never goes back, and a record delivered early (a jump, a step)
        // takes it to the record's time.
        let at = self.now().max(rec.t);
        self.rebase(at);
        self.out.send(rec)?;
        if self.stepping && is_step {
            self.stepping = false;
            self.paused = true;
            self.publish(false);
        }
        Ok(())
    }

    fn obey(&mut self, c: ReplayControl) {
        // The clock is read before anything changes its pace.
        let now = self.now();
        match c {
            ReplayControl::TogglePause => self.paused = !self.paused,
            ReplayControl::StepOne => {
                self.stepping = true;
                self.paused = false;
            }
            ReplayControl::JumpToEnd => {
                self.jumping = true;
                self.paused = false;
            }
            ReplayControl::Faster => self.speed = (self.speed * 2.0).min(MAX_SPEED),
            ReplayControl::Slower => self.speed = (self.speed / 2.0).max(MIN_SPEED),
        }
        if self.position.is_some() {
            self.rebase(now);
        }
        self.publish(false);
    }

    /// The replay clock now: moving while playing.
    fn now(&self) -> f64 {
        let Some(p) = self.position else {
            return 0.0;
        };
        if self.paused {
            return p;
        }
        p + self.since.elapsed().as_secs_f64() * self.speed
    }

    fn rebase(&mut self, position: f64) {
        self.position = Some(position);
        self.since = Instant::now();
    }

    fn publish(&self, ended: bool) {
        let mut s = match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        *s = ReplayState {
            position: self.position.unwrap_or(0.0),
            since: self.since,
            next_t: self.pending.as_ref().map(|r| r.t),
            total: self.total,
            speed: self.speed,
            paused: self.paused,
            ended,
            following: self.follow,
            skipped: self.skipped,
        };
    }

    /// The end of a log that does not grow: said once, with what was skipped.
    fn finish(&mut self) -> Result<(), Gone> {
        let end = self.position.unwrap_or(0.0).max(self.total);
        self.rebase(end);
        self.publish(true);
        let (level, text) = match self.skipped {
            0 => (
                Level::Info,
                "the replay reached the end of the log".to_string(),
            ),
            n => (
                Level::Warn,
                format!(
                    "the replay reached the end of the log; {n} line{} that {} not records \
                     skipped",
                    if n == 1 { "" } else { "s" },
                    if n == 1 { "was" } else { "were" }
                ),
            ),
        };
        self.notice(level, text)
    }

    fn notice(&mut self, level: Level, text: String) -> Result<(), Gone> {
        let t = self.position.unwrap_or(0.0);
        let msg = Telemetry::Notice(Notice::new(level, "replay", text));
        self.out.send(Record::new(0.0, t, msg))
    }

    /// The followed log was truncated: play it again from its start, on a fresh screen.
    fn restart(&mut self) -> Result<(), Gone> {
        let file = match File::open(&self.path) {
            Ok(f) => f,
            // Gone for a moment (rotated): looked at again at the next poll.
            Err(_) => return Ok(()),
        };
        self.lines = Lines::new(file);
        self.pending = None;
        self.position = None;
        self.total = 0.0;
        self.skipped = 0;
        let run_id = format!("{} (the log restarted)", self.path.display());
        self.out
            .link
            .send(Link::Connected { run_id })
            .map_err(|_| Gone)?;
        self.publish(false);
        Ok(())
    }
}
