//! The one way telemetry reaches a screen: a [`Feed`]. The in-process bus, a socket
//! client attached to a running run and a replayed log all hand the dashboard the same
//! thing: two queues of [`Record`]s (lifecycle events, never dropped; high-rate metrics,
//! which may have gaps), a drop counter, a way back ([`Control`]) and the state of the
//! link to the run.
//!
//! Ordering contract for a feed that can lose and regain its source (the socket client):
//! send [`Link::Lost`] after the last record of the lost connection is queued, and
//! [`Link::Connected`] before the first record of the next one. The screen reads link
//! news before records, takes what was queued before a `Lost` into the last picture, and
//! on a `Connected` starts the run's state afresh for the catch-up that follows.
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::{never, Receiver, Sender};
use headroom_core::{Command, Record};

pub struct Feed {
    /// Lifecycle events (status, decisions, notices, the run's start and end): never
    /// dropped on the way.
    pub events: Receiver<Record>,
    /// Steps and samples: a slow screen misses some (counted in `dropped`).
    pub metrics: Receiver<Record>,
    /// High-rate records dropped on the way; shown on screen.
    pub dropped: Arc<AtomicU64>,
    /// Where the screen's keys go.
    pub control: Control,
    /// Where a job's rank selection goes (an attached client switches the panels to that
    /// rank's stream); `None` where nothing can switch (in-process, a replay).
    pub select_rank: Option<Sender<u32>>,
    /// News of the connection to the run: `never()` where there is no connection to
    /// lose (in-process; a replay, unless its log is truncated under it).
    pub link: Receiver<Link>,
}

impl Feed {
    /// The in-process dashboard's feed: the bus's screen queues and the trainer's command
    /// queue.
    pub fn in_process(
        events: Receiver<Record>,
        metrics: Receiver<Record>,
        commands: Sender<Command>,
        dropped: Arc<AtomicU64>,
    ) -> Feed {
        Feed {
            events,
            metrics,
            dropped,
            control: Control::Commands(commands),
            select_rank: None,
            link: never(),
        }
    }
}

/// Where keys that act on the run go.
#[derive(Debug, Clone)]
pub enum Control {
    /// A live run: commands to the trainer, in-process or over the socket.
    Commands(Sender<Command>),
    /// A replayed log: no run to command, only the replay to steer.
    Replay(ReplayHandle),
}

/// The replay thread's controls and what it reports back (read at each frame).
#[derive(Debug, Clone)]
pub struct ReplayHandle {
    pub control: Sender<ReplayControl>,
    pub state: Arc<Mutex<ReplayState>>,
}

impl ReplayHandle {
    /// The latest state, or a default one if the replay thread panicked holding it.
    pub fn snapshot(&self) -> ReplayState {
        match self.state.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }
}

/// News of the connection to a run.
#[derive(Debug, Clone, PartialEq)]
pub enum Link {
    /// (Re)connected; a catch-up of the run follows, so the screen starts afresh.
    Connected { run_id: String },
    /// The connection dropped; the last picture stays while the client retries.
    Lost { reason: String },
    /// The next attempt, `in_s` seconds from now.
    Retrying { attempt: u32, in_s: f64 },
    /// No more attempts: the run ended, or the server refused this viewer.
    Closed { reason: String },
    /// The selected rank's stream cannot be shown (another machine, gone); the panels
    /// stay on the rank they show. Not news of this connection: it stays up.
    RankUnreachable { rank: u32, reason: String },
}

/// Keys of a replay, for the replay thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayControl {
    TogglePause,
    /// Deliver up to and including the next `step` record, then pause.
    StepOne,
    /// Deliver everything left at once.
    JumpToEnd,
    /// Twice the speed (at most [`MAX_SPEED`]).
    Faster,
    /// Half the speed (at least [`MIN_SPEED`]).
    Slower,
    /// Show this rank's log in the panels (a job's replay).
    SelectRank(u32),
}

pub const MIN_SPEED: f64 = 1.0 / 16.0;
pub const MAX_SPEED: f64 = 1024.0;

/// Where a replay is, as its thread last reported it. The position moves on between
/// reports at `speed` while playing, up to the next record's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayState {
    /// The replay clock (the run's seconds) at `since`.
    pub position: f64,
    pub since: Instant,
    /// When the next record is due; `None` when nothing is pending (end of log).
    pub next_t: Option<f64>,
    /// The last record's time in the log, as far as it is known.
    pub total: f64,
    pub speed: f64,
    pub paused: bool,
    /// Every record of the log has been delivered (and the log is not followed).
    pub ended: bool,
    /// Tailing a log that is still being written.
    pub following: bool,
    /// Lines that were not records.
    pub skipped: u64,
}

impl Default for ReplayState {
    fn default() -> ReplayState {
        ReplayState {
            position: 0.0,
            since: Instant::now(),
            next_t: None,
            total: 0.0,
            speed: 1.0,
            paused: false,
            ended: false,
            following: false,
            skipped: 0,
        }
    }
}

impl ReplayState {
    /// The replay clock at `now`: moving while playing, never past the next record (the
    /// thread delivers it then) and never back.
    pub fn position_at(&self, now: Instant) -> f64 {
        if self.paused || self.ended {
            return self.position;
        }
        let moved =
            self.position + now.saturating_duration_since(self.since).as_secs_f64() * self.speed;
        match self.next_t {
            Some(next) => moved.min(next.max(self.position)),
            None => self.position,
        }
    }
}
