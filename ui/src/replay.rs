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
//! - A log named `….zst` is zstd-framed, and a log rotated into numbered segments is
//!   played as one, its segments first (docs/LOG_SCHEMA.md, "Compressed and rotated
//!   logs"; [`headroom_core::logfile::read`]). A followed log goes on across a rotation.
//! - `start_at_end` on a compressed log does not decode all of it: the earlier frames are
//!   shown by their index's events and one record per kind, the last frames whole
//!   ([`headroom_core::logfile::end`]), and a notice says how much was summarised.
//!
//! The thread blocks on its control queue while paused or waiting, and sleeps between
//! looks at a followed file: it never spins. It ends when the screen drops the feed.
use std::fs::File;
use std::io::{self, Read as _, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use headroom_core::logfile::end::{self, End};
use headroom_core::logfile::read::{ChainLines, Line, Origin};
use headroom_core::logfile::{chain, is_compressed};
use headroom_core::units::fmt_count;
use headroom_core::{BadRecord, Level, Notice, Record, Telemetry};

use crate::feed::{
    Control, Feed, Link, ReplayControl, ReplayHandle, ReplayState, MAX_SPEED, MIN_SPEED,
};
use crate::job::rank_of_name;

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
    replay_job_feed(&[path.to_path_buf()], opts)
}

/// Starts replaying one log, or a torchrun job's logs (one per rank, any order): the
/// rows of every rank come from rank 0's log (rank 0 alone gathers them), and the panels
/// show one rank's log at a time, switched with the screen's rank keys. Several logs must
/// each be a different rank's (its run is named `….rankR`).
pub fn replay_job_feed(paths: &[PathBuf], opts: ReplayOptions) -> io::Result<Feed> {
    let mut sources = Vec::with_capacity(paths.len());
    let mut total = 0.0f64;
    for path in paths {
        let files = chain(path);
        let mut len = 0;
        for file in &files {
            let named = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", file.display()));
            len += File::open(file)
                .and_then(|f| f.metadata())
                .map_err(named)?
                .len();
        }
        if len == 0 && !opts.follow {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: the log is empty: no records to replay", path.display()),
            ));
        }
        let compressed = files.iter().any(|f| is_compressed(f));
        let last = match compressed {
            true => end::last_time(path),
            false => last_time(files.last().unwrap_or(path)),
        };
        total = total.max(last.unwrap_or(0.0));
        // A compressed log's end is found from its index; where that fails, it is read
        // whole like any other.
        let at_end = (opts.start_at_end && compressed)
            .then(|| end::open_at_end(path).ok())
            .flatten();
        let source = match at_end {
            Some(end) => Source::at_end(path.clone(), end),
            None => Source::new(path.clone(), ChainLines::open(path)?),
        };
        sources.push(source);
    }
    if sources.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "no log to replay: give a log written with --log (or one log per rank of a job)",
        ));
    }
    if sources.len() > 1 {
        rank_sources(&mut sources)?;
    }
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
    // The panels start on rank 0's log (sorted first), whose rows are the job's.
    let job = sources.len() > 1;
    let select_rank = job.then(|| {
        let (select_tx, select_rx) = bounded::<u32>(16);
        let control = control_tx.clone();
        std::thread::Builder::new()
            .name("replay-ranks".into())
            .spawn(move || {
                for rank in select_rx.iter() {
                    if control.send(ReplayControl::SelectRank(rank)).is_err() {
                        break;
                    }
                }
            })
            .map(|_| select_tx)
    });
    let select_rank = select_rank.transpose()?;
    let mut player = Player {
        sources,
        shown: 0,
        screen: (events.clone(), metrics.clone()),
        out: Out {
            events: events_tx,
            metrics: metrics_tx,
            link: link_tx,
        },
        control: control_rx,
        state: Arc::clone(&state),
        follow: opts.follow,
        position: None,
        since: Instant::now(),
        total,
        speed,
        paused: false,
        stepping: false,
        jumping: opts.start_at_end,
        skipped: 0,
        damaged: 0,
        ended: false,
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
        select_rank,
        link,
    })
}

/// Names each of a job's logs by the rank its run says it is, rank 0 first; a log that is
/// no rank's, or two of one rank, is an error that says what to give.
fn rank_sources(sources: &mut [Source]) -> io::Result<()> {
    for s in sources.iter_mut() {
        let name = first_run_name(&s.path).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: no run_started record in its first lines: replay several logs only \
                     of one torchrun job's ranks (or one log alone)",
                    s.path.display()
                ),
            )
        })?;
        let rank = rank_of_name(&name).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: its run '{name}' is not a torchrun rank's (named ….rankN): replay \
                     several logs only of one job's ranks, or replay this log alone",
                    s.path.display()
                ),
            )
        })?;
        s.rank = Some(rank);
    }
    sources.sort_by_key(|s| s.rank);
    for pair in sources.windows(2) {
        if pair[0].rank == pair[1].rank {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} and {} are both rank {}'s: give one log per rank",
                    pair[0].path.display(),
                    pair[1].path.display(),
                    pair[0].rank.unwrap_or(0)
                ),
            ));
        }
    }
    Ok(())
}

/// The run's name from a log's `run_started` record, looked for in its first lines.
fn first_run_name(path: &Path) -> Option<String> {
    let mut lines = ChainLines::open(path).ok()?;
    (0..64)
        .map_while(|_| match lines.next_line() {
            Ok(Line::Whole(line)) => Some(line),
            _ => None,
        })
        .find_map(|line| match Record::from_line(line.trim()).ok()?.msg {
            Telemetry::RunStarted(info) => Some(info.run_name),
            _ => None,
        })
}

/// The `t` of the last record in a plain log's tail, if there is one.
fn last_time(path: &Path) -> Option<f64> {
    let mut file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let from = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut tail = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    text.lines()
        .rev()
        .find_map(|line| Record::from_line(line.trim()).ok().map(|r| r.t))
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

/// One log being played: its lines, and its next record once read.
struct Source {
    path: PathBuf,
    /// Records played before `lines` (a compressed log's end: its summary and last
    /// frames), parsed ahead, and how many of them were read.
    head: Vec<Parsed>,
    head_read: usize,
    lines: ChainLines,
    /// Where `lines` started, when not at the log's start.
    origin: Option<Origin>,
    /// The next record, read but not yet due.
    pending: Option<Record>,
    /// Decoded bytes of `lines` before `pending`'s line: what a switch of the panels to
    /// this log delivers at once (after the head).
    before_pending: u64,
    /// `pending` came from the head.
    pending_from_head: bool,
    /// The rank the log is of, in a job's replay.
    rank: Option<u32>,
}

impl Source {
    /// Decoded bytes of `lines` whose records have been played (the pending one
    /// excepted).
    fn delivered_bytes(&self) -> u64 {
        match self.pending {
            Some(_) => self.before_pending,
            None => self.lines.position(),
        }
    }

    /// Records of the head played (the pending one excepted).
    fn delivered_head(&self) -> usize {
        self.head_read - usize::from(self.pending.is_some() && self.pending_from_head)
    }

    fn new(path: PathBuf, lines: ChainLines) -> Source {
        Source {
            path,
            head: Vec::new(),
            head_read: 0,
            lines,
            origin: None,
            pending: None,
            before_pending: 0,
            pending_from_head: false,
            rank: None,
        }
    }

    /// A compressed log from its end: the summary and the last frames first, with a
    /// notice of what was summarised where the whole records begin, and one of each
    /// damaged frame skipped where its records would have been.
    fn at_end(path: PathBuf, end: End) -> Source {
        let End {
            mut lines,
            whole_from,
            summarized,
            rest,
            origin,
            damage,
        } = end;
        let mut head = parse_all(std::mem::take(&mut lines));
        // From the back: each insertion leaves the places before it as they were.
        let mut notices: Vec<(usize, Level, f64, String)> = damage
            .into_iter()
            .map(|(at, d)| {
                let at = at.min(head.len());
                (at, Level::Warn, t_before(&head, at), d.to_string())
            })
            .collect();
        if summarized > 0 {
            let at = whole_from.min(head.len());
            let (t, text) = jump_notice(&head, at, summarized);
            notices.push((at, Level::Info, t, text));
        }
        notices.sort_by_key(|n| n.0);
        for (at, level, t, text) in notices.into_iter().rev() {
            let msg = Telemetry::Notice(Notice::new(level, "replay", text));
            head.insert(at, Ok(Record::new(0.0, t, msg)));
        }
        Source {
            head,
            origin: Some(origin),
            ..Source::new(path, rest)
        }
    }
}

/// A line read as a record (or why it is not one).
type Parsed = Result<Record, BadRecord>;

/// Parses `lines` on the machine's cores: a week's log's end is some 50,000 records, whose
/// parsing is most of the time `--end` takes.
fn parse_all(lines: Vec<String>) -> Vec<Parsed> {
    let parse = |chunk: &[String]| -> Vec<Parsed> {
        chunk.iter().map(|l| Record::from_line(l.trim())).collect()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if threads == 1 || lines.len() < 4096 {
        return parse(&lines);
    }
    let chunk = lines.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = lines
            .chunks(chunk)
            .map(|c| (c, s.spawn(move || parse(c))))
            .collect();
        // A thread that cannot run leaves its part to this one.
        parts
            .into_iter()
            .flat_map(|(c, h)| h.join().unwrap_or_else(|_| parse(c)))
            .collect()
    })
}

/// What a jump to a compressed log's end says: how many steps (records, in a log
/// without steps) before the first one shown whole are shown one point per frame; and the
/// time to say it at.
fn jump_notice(head: &[Parsed], whole_from: usize, summarized: u64) -> (f64, String) {
    let parsed = |p: &Parsed| p.as_ref().ok().cloned();
    let start_step = head[..whole_from]
        .iter()
        .take(64)
        .filter_map(parsed)
        .find_map(|r| match r.msg {
            Telemetry::RunStarted(info) => Some(info.start_step),
            _ => None,
        })
        .unwrap_or(0);
    let first_whole = head[whole_from..]
        .iter()
        .take(64)
        .filter_map(parsed)
        .find_map(|r| match r.msg {
            Telemetry::Step(s) => Some((r.t, s.step)),
            _ => None,
        });
    let t = t_before(head, whole_from);
    match first_whole {
        Some((t, step)) => {
            let before = step.saturating_sub(start_step + 1);
            (
                t,
                format!(
                    "jumped to the end: {} steps before step {} are shown one point per \
                     frame (play without --end for every step)",
                    fmt_count(before),
                    fmt_count(step)
                ),
            )
        }
        None => (
            t,
            format!(
                "jumped to the end: {} records before t={t:.1} s are shown one point per \
                 frame (play without --end for every record)",
                fmt_count(summarized)
            ),
        ),
    }
}

/// The `t` of the last record before `head[at]` (0 when none).
fn t_before(head: &[Parsed], at: usize) -> f64 {
    head[..at]
        .iter()
        .rev()
        .find_map(|p| p.as_ref().ok())
        .map_or(0.0, |r| r.t)
}

/// The next line of `src` that is not blank; `None` at its end (for now, when followed);
/// an error (said) stops the following.
fn read_line(src: &mut Source, follow: &mut bool) -> Result<Option<String>, String> {
    loop {
        let line = match src.lines.next_line() {
            Ok(Line::Whole(line)) => line,
            Ok(Line::End) if *follow => return Ok(None),
            Ok(Line::End) => match src.lines.rest() {
                Some(line) => line,
                None => return Ok(None),
            },
            Err(e) => {
                *follow = false;
                return Err(format!("reading {} failed: {e}", src.path.display()));
            }
        };
        if !line.trim().is_empty() {
            return Ok(Some(line));
        }
    }
}

/// How reading a log's next record went.
enum Read {
    Pending,
    /// The end of the file (for now, when followed).
    End,
    /// The file could not be read (why): said, and the logs are not followed any more.
    Failed(String),
}

struct Player {
    sources: Vec<Source>,
    /// The source whose records the panels show (a job's: one rank's log at a time).
    shown: usize,
    /// The screen's own queues, emptied of the old rank's records on a switch.
    screen: (Receiver<Record>, Receiver<Record>),
    out: Out,
    control: Receiver<ReplayControl>,
    state: Arc<Mutex<ReplayState>>,
    follow: bool,
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
    /// Damaged stretches of compressed logs skipped (each said when met).
    damaged: u64,
    /// Every log was played to its end (not followed).
    ended: bool,
}

impl Player {
    fn run(&mut self) {
        // Ends quietly when the screen is gone.
        let _ = self.play();
    }

    fn play(&mut self) -> Result<(), Gone> {
        loop {
            let Some(i) = self.earliest()? else {
                if !self.follow {
                    self.finish()?;
                    return self.serve_ranks();
                }
                self.jumping = false;
                self.stepping = false;
                self.publish();
                // Nothing to play: wait for a control or the next look at the files.
                match self.control.recv_timeout(FOLLOW_POLL) {
                    Ok(c) => self.obey(c)?,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Err(Gone),
                }
                if self.sources.iter().any(|s| s.lines.truncated()) {
                    self.restart()?;
                }
                continue;
            };
            let t = self.sources[i].pending.as_ref().map_or(0.0, |r| r.t);
            self.position.get_or_insert(t);
            if self.jumping || self.stepping || t <= self.now() {
                if let Some(rec) = self.sources[i].pending.take() {
                    self.deliver(i, rec)?;
                }
                continue;
            }
            if self.paused {
                self.publish();
                match self.control.recv() {
                    Ok(c) => self.obey(c)?,
                    Err(_) => return Err(Gone),
                }
                continue;
            }
            // A long quiet stretch of the run is shortened.
            let now = self.now();
            if t - now > MAX_GAP_S {
                self.rebase(t - MAX_GAP_S);
            }
            self.publish();
            let wait = Duration::from_secs_f64(((t - self.now()) / self.speed).max(0.0));
            match self.control.recv_timeout(wait) {
                Ok(c) => self.obey(c)?,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(Gone),
            }
        }
    }

    /// The source whose pending record comes first (reading where none is pending);
    /// `None` when every log is at its end (for now).
    fn earliest(&mut self) -> Result<Option<usize>, Gone> {
        let mut best: Option<(usize, f64)> = None;
        for i in 0..self.sources.len() {
            if self.sources[i].pending.is_none() {
                let read = self.read_next(i);
                // A damaged stretch of a compressed log was skipped: said before the
                // records after it, and the replay goes on.
                for d in self.sources[i].lines.take_damage() {
                    self.damaged += 1;
                    self.notice(Level::Warn, d.to_string())?;
                }
                match read {
                    Read::Pending => {}
                    Read::End => continue,
                    Read::Failed(text) => {
                        self.notice(Level::Error, text)?;
                        continue;
                    }
                }
            }
            let t = self.sources[i]
                .pending
                .as_ref()
                .map_or(f64::INFINITY, |r| r.t);
            if best.is_none_or(|(_, b)| t < b) {
                best = Some((i, t));
            }
        }
        Ok(best.map(|(i, _)| i))
    }

    /// Reads source `i` until a record is pending.
    fn read_next(&mut self, i: usize) -> Read {
        let Player {
            sources,
            follow,
            total,
            skipped,
            ..
        } = self;
        // Only a job's panels read a log's head again (a switch of rank).
        let keep_head = sources.len() > 1;
        let src = &mut sources[i];
        loop {
            let start = src.lines.position();
            let from_head = src.head_read < src.head.len();
            let parsed = if from_head {
                let slot = &mut src.head[src.head_read];
                src.head_read += 1;
                match keep_head {
                    true => slot.clone(),
                    false => std::mem::replace(slot, Err(BadRecord::NoKind)),
                }
            } else {
                match read_line(src, follow) {
                    Ok(Some(line)) => Record::from_line(line.trim()),
                    Ok(None) => return Read::End,
                    Err(text) => return Read::Failed(text),
                }
            };
            match parsed {
                Ok(rec) => {
                    *total = total.max(rec.t);
                    src.pending = Some(rec);
                    src.before_pending = start;
                    src.pending_from_head = from_head;
                    return Read::Pending;
                }
                Err(BadRecord::UnknownKind(_)) => {}
                Err(_) => *skipped += 1,
            }
        }
    }

    /// After the end of a job's logs, the panels can still move between its ranks; a lone
    /// log's replay is over (its thread ends, and the screen sees its queues close).
    fn serve_ranks(&mut self) -> Result<(), Gone> {
        if self.sources.len() == 1 {
            return Ok(());
        }
        loop {
            match self.control.recv() {
                Ok(c) => self.obey(c)?,
                Err(_) => return Err(Gone),
            }
        }
    }

    /// Whether source `i`'s record reaches the screen: everything of a lone log; of a
    /// job's, the shown rank's records and rank 0's rows.
    fn shows(&self, i: usize, rec: &Record) -> bool {
        if self.sources.len() == 1 {
            return true;
        }
        match rec.msg {
            Telemetry::JobRanks(_) => self.sources[i].rank == Some(0),
            _ => i == self.shown,
        }
    }

    fn deliver(&mut self, i: usize, rec: Record) -> Result<(), Gone> {
        // The clock never goes back, and a record delivered early (a jump, a step)
        // takes it to the record's time.
        let at = self.now().max(rec.t);
        self.rebase(at);
        if !self.shows(i, &rec) {
            return Ok(());
        }
        let is_step = matches!(rec.msg, Telemetry::Step(_));
        self.out.send(rec)?;
        if self.stepping && is_step {
            self.stepping = false;
            self.paused = true;
            self.publish();
        }
        Ok(())
    }

    fn obey(&mut self, c: ReplayControl) -> Result<(), Gone> {
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
            ReplayControl::SelectRank(rank) => self.show_rank(rank)?,
        }
        if self.position.is_some() {
            self.rebase(now);
        }
        self.publish();
        Ok(())
    }

    /// Moves the panels to rank `rank`'s log: a fresh picture, and everything of that log
    /// up to where the replay stands delivered at once.
    fn show_rank(&mut self, rank: u32) -> Result<(), Gone> {
        let Some(i) = self.sources.iter().position(|s| s.rank == Some(rank)) else {
            let given: Vec<String> = self
                .sources
                .iter()
                .filter_map(|s| s.rank.map(|r| r.to_string()))
                .collect();
            let reason = format!(
                "this replay has no log of rank {rank} (it has rank {}'s; give every rank's \
                 log to headroom replay)",
                given.join(", ")
            );
            return self
                .out
                .link
                .send(Link::RankUnreachable { rank, reason })
                .map_err(|_| Gone);
        };
        if i == self.shown {
            return Ok(());
        }
        self.shown = i;
        // What the old rank's log queued would land in the new rank's picture.
        while self.screen.0.try_recv().is_ok() || self.screen.1.try_recv().is_ok() {}
        let src = &self.sources[i];
        let run_id = format!("rank {rank}'s log {}", src.path.display());
        self.out
            .link
            .send(Link::Connected { run_id })
            .map_err(|_| Gone)?;
        let head = src.delivered_head();
        let upto = match head < src.head.len() {
            true => 0,
            false => src.delivered_bytes(),
        };
        let again = match &src.origin {
            Some(origin) => ChainLines::resume(&src.path, origin),
            None => ChainLines::open(&src.path),
        };
        let played: Vec<Record> = src.head[..head]
            .iter()
            .filter_map(|p| p.as_ref().ok().cloned())
            .collect();
        let mut lines = Vec::new();
        let Ok(mut again) = again else {
            let text = format!(
                "{} cannot be read again for rank {rank}'s panels",
                src.path.display()
            );
            return self.notice(Level::Error, text);
        };
        // What was played of the log is read again, up to where it stands: decoding a
        // compressed one from its start (or from where its end was found).
        while again.position() < upto {
            match again.next_line() {
                Ok(Line::Whole(line)) if again.position() <= upto => lines.push(line),
                Ok(Line::End) => {
                    lines.extend(again.rest().filter(|_| again.position() <= upto));
                    break;
                }
                _ => break,
            }
        }
        let read = lines
            .iter()
            .filter_map(|l| Record::from_line(l.trim()).ok());
        for rec in played.into_iter().chain(read) {
            if !matches!(rec.msg, Telemetry::JobRanks(_)) {
                self.out.send(rec)?;
            }
        }
        Ok(())
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

    fn publish(&self) {
        let mut s = match self.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        *s = ReplayState {
            position: self.position.unwrap_or(0.0),
            since: self.since,
            next_t: self
                .sources
                .iter()
                .filter_map(|s| s.pending.as_ref().map(|r| r.t))
                .reduce(f64::min),
            total: self.total,
            speed: self.speed,
            paused: self.paused,
            ended: self.ended,
            following: self.follow,
            skipped: self.skipped,
        };
    }

    /// The end of a log that does not grow: said once, with what was skipped.
    fn finish(&mut self) -> Result<(), Gone> {
        let end = self.position.unwrap_or(0.0).max(self.total);
        self.rebase(end);
        self.ended = true;
        self.publish();
        let (mut level, mut text) = match self.skipped {
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
        if self.damaged > 0 {
            let n = self.damaged;
            level = Level::Warn;
            text += &format!(
                "; {n} damaged stretch{} of the log skipped (said where met)",
                if n == 1 { "" } else { "es" }
            );
        }
        self.notice(level, text)
    }

    fn notice(&mut self, level: Level, text: String) -> Result<(), Gone> {
        let t = self.position.unwrap_or(0.0);
        let msg = Telemetry::Notice(Notice::new(level, "replay", text));
        self.out.send(Record::new(0.0, t, msg))
    }

    /// A followed log was truncated: play every log again from its start, on a fresh
    /// screen (the same rank's panels).
    fn restart(&mut self) -> Result<(), Gone> {
        let mut reopened = Vec::with_capacity(self.sources.len());
        for s in &self.sources {
            match ChainLines::open(&s.path) {
                Ok(lines) => reopened.push(lines),
                // Gone for a moment: looked at again at the next poll.
                Err(_) => return Ok(()),
            }
        }
        for (s, lines) in self.sources.iter_mut().zip(reopened) {
            *s = Source {
                rank: s.rank,
                ..Source::new(s.path.clone(), lines)
            };
        }
        self.position = None;
        self.total = 0.0;
        self.skipped = 0;
        self.damaged = 0;
        let src = &self.sources[self.shown];
        let run_id = format!("{} (the log restarted)", src.path.display());
        self.out
            .link
            .send(Link::Connected { run_id })
            .map_err(|_| Gone)?;
        self.publish();
        Ok(())
    }
}
