//! The dashboard's feed of an attached view. Each stream is read by its own thread (a
//! [`Pump`]) that reconnects after a drop; for a torchrun job a [`Switcher`] moves the
//! panels to the rank the user selects, by connecting to that rank's own socket, while
//! rank 0's stream keeps bringing every rank's row (rank 0 alone gathers them).
use std::io::BufReader;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use headroom_core::protocol::{
    ClientLine, JobRank, ServerControl, ServerLine, Want, MAX_SERVER_LINE,
};
use headroom_core::{BadRecord, Command, Level, Notice, Record, Telemetry};
use headroom_ui::feed::{Control, Feed, Link};
use headroom_ui::job::rank_of_name;

use crate::client::{self, handshake, ConnectError, Session};
use crate::conn::{read_line_limited, send_line, Conn, Target};
use crate::ls;

/// How often a waiting stream thread looks whether it was stopped.
const STOP_POLL: Duration = Duration::from_millis(100);

/// Where the streams that feed one screen put what they read.
#[derive(Clone)]
struct Sinks {
    events: Sender<Record>,
    metrics: Sender<Record>,
    link: Sender<Link>,
    dropped: Arc<AtomicU64>,
    /// The connection commands go out on: the panels' stream's (every rank fans a command
    /// out to the whole job).
    writer: Arc<Mutex<Option<Conn>>>,
    /// The job's id, as its rows name it.
    job_id: Arc<Mutex<Option<String>>>,
}

impl Sinks {
    fn note(&self, level: Level, text: String) {
        let _ = self
            .events
            .try_send(Record::new(0.0, 0.0, note(level, text)));
    }
}

/// What a stream contributes to the screen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The stream the panels show: its records, its link news, the command connection; the
    /// job's rows too when `rows` (rank 0's stream).
    Panels { rows: bool },
    /// Rank 0's stream while the panels show another rank: the job's rows only.
    Rows,
}

/// How a connection's stream ended.
enum StreamEnd {
    /// The run ended (finished or failed) and said so.
    RunEnded,
    /// The server told us why it closed (a fatal error line).
    Closed(String),
    /// The connection dropped without a word.
    Dropped(String),
    /// The screen went away, or the switcher stopped this stream.
    Stopped,
}

/// One stream, read into the feed by its own thread until it ends or is stopped.
struct Pump {
    stop: Arc<AtomicBool>,
    conn: Arc<Mutex<Option<Conn>>>,
    thread: JoinHandle<()>,
}

impl Pump {
    fn start(
        first: Session,
        target: Target,
        token: Option<String>,
        role: Role,
        sinks: Sinks,
    ) -> Pump {
        let stop = Arc::new(AtomicBool::new(false));
        let conn = Arc::new(Mutex::new(None));
        let (s, c) = (Arc::clone(&stop), Arc::clone(&conn));
        let thread = std::thread::Builder::new()
            .name("attach-stream".into())
            .spawn(move || pump(first, target, token, role, sinks, s, c))
            .expect("a thread for the stream");
        Pump { stop, conn, thread }
    }

    /// Stops the thread and waits for it: nothing it read reaches the screen after this.
    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(c) = self.conn.lock().unwrap().as_ref() {
            c.close();
        }
        let _ = self.thread.join();
    }
}

/// Sleeps `wait` unless stopped first; false when stopped.
fn sleep_unless(stop: &AtomicBool, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    while Instant::now() < until {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(STOP_POLL.min(until.saturating_duration_since(Instant::now())));
    }
    !stop.load(Ordering::SeqCst)
}

/// A stream's thread: reads, and reconnects when the connection drops (not when the run
/// ended or a server refused us). The panels' stream says so on the link; rank 0's rows
/// stream says so in the event log.
fn pump(
    first: Session,
    target: Target,
    token: Option<String>,
    role: Role,
    sinks: Sinks,
    stop: Arc<AtomicBool>,
    own: Arc<Mutex<Option<Conn>>>,
) {
    let panels = matches!(role, Role::Panels { .. });
    let say = |news: Link| -> bool {
        if panels {
            return sinks.link.send(news).is_ok();
        }
        match news {
            Link::Lost { reason } => sinks.note(
                Level::Warn,
                format!("the job's rows stopped: rank 0's stream: {reason} (reconnecting)"),
            ),
            Link::Closed { reason } => sinks.note(
                Level::Warn,
                format!("the job's rows stay as rank 0 last sent them: {reason}"),
            ),
            _ => {}
        }
        true
    };
    let mut session = Some(first);
    let mut attempt = 0u32;
    loop {
        let end = match session.take() {
            Some(s) => {
                attempt = 0;
                *own.lock().unwrap() = s.conn.try_clone().ok();
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                if panels {
                    let _ = sinks.link.try_send(Link::Connected {
                        run_id: s.hello.run_id.clone(),
                    });
                    *sinks.writer.lock().unwrap() = s.conn.try_clone().ok();
                }
                let end = read_stream(s.reader, role, &sinks, &stop);
                if panels {
                    *sinks.writer.lock().unwrap() = None;
                }
                end
            }
            None => StreamEnd::Dropped(String::new()),
        };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let reason = match end {
            StreamEnd::Stopped => return,
            StreamEnd::RunEnded => {
                say(Link::Closed {
                    reason: "the run has ended".into(),
                });
                return;
            }
            StreamEnd::Closed(why) | StreamEnd::Dropped(why) => why,
        };
        if attempt == 0
            && !reason.is_empty()
            && !say(Link::Lost {
                reason: reason.clone(),
            })
        {
            return;
        }
        if let Target::Unix(p) = &target {
            if !p.exists() {
                say(Link::Closed {
                    reason: format!(
                        "the run's socket {} is gone: the run has ended",
                        p.display()
                    ),
                });
                return;
            }
        }
        attempt += 1;
        let wait = Duration::from_secs(u64::from(attempt.min(5)));
        if !say(Link::Retrying {
            attempt,
            in_s: wait.as_secs_f64(),
        }) || !sleep_unless(&stop, wait)
        {
            return;
        }
        match handshake(&target, token.as_deref(), Want::Stream) {
            Ok(s) => session = Some(s),
            Err(e @ ConnectError::Refusal(_)) => {
                // Told why: retrying will not change it (a wrong token, another
                // protocol version).
                say(Link::Closed {
                    reason: e.to_string(),
                });
                return;
            }
            Err(_) => {}
        }
    }
}

/// Reads one connection's stream into the feed's queues until it ends.
fn read_stream(
    mut reader: BufReader<Conn>,
    role: Role,
    sinks: &Sinks,
    stop: &AtomicBool,
) -> StreamEnd {
    let mut ended = false;
    loop {
        let line = match read_line_limited(&mut reader, MAX_SERVER_LINE) {
            Ok(Some(line)) => line,
            Ok(None) if ended => return StreamEnd::RunEnded,
            Ok(None) => return StreamEnd::Dropped("the run closed the connection".into()),
            Err(e) => return StreamEnd::Dropped(format!("the connection failed: {e}")),
        };
        if stop.load(Ordering::SeqCst) {
            return StreamEnd::Stopped;
        }
        let record = match ServerLine::parse(&line) {
            Ok(ServerLine::Record(r)) => r,
            Ok(ServerLine::Control(c)) => match c {
                ServerControl::Dropped { records } if role != Role::Rows => {
                    sinks.dropped.fetch_add(records, Ordering::Relaxed);
                    continue;
                }
                ServerControl::Error {
                    message,
                    fatal: true,
                    ..
                } => return StreamEnd::Closed(message),
                ServerControl::Error { message, .. } if role != Role::Rows => Record::new(
                    0.0,
                    0.0,
                    note(Level::Warn, format!("the run said: {message}")),
                ),
                _ => continue,
            },
            // A newer producer's record kind: skipped, as the protocol says.
            Err(BadRecord::UnknownKind(_)) => continue,
            Err(_) if role == Role::Rows => continue,
            Err(e) => Record::new(
                0.0,
                0.0,
                note(Level::Warn, format!("unreadable line ({e})")),
            ),
        };
        ended |= matches!(
            record.msg,
            Telemetry::Finished(_) | Telemetry::Failed { .. }
        );
        let rows = matches!(record.msg, Telemetry::JobRanks(_));
        if let Telemetry::JobRanks(j) = &record.msg {
            let mut id = sinks.job_id.lock().unwrap();
            if id.is_none() {
                *id = Some(j.job.clone());
            }
        }
        let wanted = match role {
            Role::Panels { rows: with_rows } => with_rows || !rows,
            Role::Rows => rows,
        };
        if !wanted {
            continue;
        }
        if record.msg.is_high_rate() {
            match sinks.metrics.try_send(record) {
                Err(TrySendError::Full(_)) => {
                    sinks.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => return StreamEnd::Stopped,
                Ok(()) => {}
            }
        } else if sinks.events.send(record).is_err() {
            return StreamEnd::Stopped;
        }
    }
}

fn note(level: Level, text: String) -> Telemetry {
    Telemetry::Notice(Notice::new(level, "attach", text))
}

/// Sends the dashboard's commands on whatever connection is open.
fn send_commands(
    commands: Receiver<Command>,
    writer: Arc<Mutex<Option<Conn>>>,
    events: Sender<Record>,
) {
    for cmd in commands.iter() {
        let line = ClientLine::Command(cmd.clone()).to_line();
        let sent = match writer.lock().unwrap().as_mut() {
            Some(conn) => send_line(conn, &line).is_ok(),
            None => false,
        };
        if !sent {
            let text = format!("{cmd:?} not sent: not connected to the run");
            let _ = events.try_send(Record::new(0.0, 0.0, note(Level::Warn, text)));
        }
    }
}

/// Moves the panels between a job's ranks, as the screen asks.
struct Switcher {
    token: Option<String>,
    sinks: Sinks,
    /// The screen's own queues, to empty of the old rank's records before the new rank's
    /// catch-up starts.
    events: Receiver<Record>,
    metrics: Receiver<Record>,
    /// What the user attached to, and its rank.
    attached: (Target, Option<u32>),
    /// The job, when the attach argument named a local rank.
    job: Option<JobRank>,
    panels: Option<Pump>,
    panels_at: (Target, Option<u32>),
    rows: Option<Pump>,
}

impl Switcher {
    fn run(mut self, select: Receiver<u32>) {
        self.start_rows_if_needed();
        for rank in select.iter() {
            self.switch(rank);
        }
    }

    fn job_id(&self) -> Option<String> {
        self.job
            .as_ref()
            .map(|j| j.id.clone())
            .or_else(|| self.sinks.job_id.lock().unwrap().clone())
    }

    /// Where rank `rank`'s stream is served: what was attached, or a socket of this
    /// machine's runtime directory.
    fn target_of(&self, rank: u32) -> Result<Target, String> {
        if self.attached.1 == Some(rank) {
            return Ok(self.attached.0.clone());
        }
        let Some(id) = self.job_id() else {
            return Err("the job's id is not known yet (no rows from rank 0)".into());
        };
        let found = ls::scan(&mut |_| {}).map_err(|e| e.to_string())?;
        let resolved = client::rank_in(&id, &ls::runs(&found), rank)?;
        Ok(resolved.target)
    }

    fn token_for(&self, target: &Target) -> Option<String> {
        matches!(target, Target::Tcp(_))
            .then(|| self.token.clone())
            .flatten()
    }

    fn connect(&self, rank: u32) -> Result<(Target, Session), String> {
        let target = self.target_of(rank)?;
        let session = handshake(&target, self.token_for(&target).as_deref(), Want::Stream)
            .map_err(|e| e.to_string())?;
        Ok((target, session))
    }

    /// With the panels on another rank than 0, rank 0's stream brings the rows.
    fn start_rows_if_needed(&mut self) {
        if self.rows.is_some() || matches!(self.panels_at.1, Some(0) | None) {
            return;
        }
        match self.connect(0) {
            Ok((target, session)) => {
                let token = self.token_for(&target);
                self.rows = Some(Pump::start(
                    session,
                    target,
                    token,
                    Role::Rows,
                    self.sinks.clone(),
                ));
            }
            Err(why) => self.sinks.note(
                Level::Warn,
                format!("the job's rows come from rank 0, which cannot be reached: {why}"),
            ),
        }
    }

    fn switch(&mut self, rank: u32) {
        if self.panels_at.1 == Some(rank) {
            return;
        }
        let (target, session) = match self.connect(rank) {
            Ok(c) => c,
            Err(reason) => {
                let _ = self.sinks.link.send(Link::RankUnreachable { rank, reason });
                return;
            }
        };
        if let Some(old) = self.panels.take() {
            old.stop();
        }
        if rank == 0 {
            if let Some(rows) = self.rows.take() {
                rows.stop();
            }
        }
        // What the old rank's stream queued would land in the new rank's picture.
        while self.events.try_recv().is_ok() || self.metrics.try_recv().is_ok() {}
        let token = self.token_for(&target);
        self.panels = Some(Pump::start(
            session,
            target.clone(),
            token,
            Role::Panels { rows: rank == 0 },
            self.sinks.clone(),
        ));
        self.panels_at = (target, Some(rank));
        self.start_rows_if_needed();
    }
}

/// The dashboard's feed over a greeted session; `job` is the job and rank the attach
/// argument named, when it named a local rank.
pub fn feed(first: Session, target: Target, token: Option<String>, job: Option<JobRank>) -> Feed {
    let (events_tx, events) = bounded::<Record>(1024);
    let (metrics_tx, metrics) = bounded::<Record>(512);
    let (link_tx, link) = bounded::<Link>(16);
    let (commands_tx, commands_rx) = bounded::<Command>(64);
    let (select_tx, select_rx) = bounded::<u32>(16);
    let sinks = Sinks {
        events: events_tx,
        metrics: metrics_tx,
        link: link_tx,
        dropped: Arc::new(AtomicU64::new(0)),
        writer: Arc::new(Mutex::new(None)),
        job_id: Arc::new(Mutex::new(None)),
    };
    {
        let (writer, events) = (Arc::clone(&sinks.writer), sinks.events.clone());
        std::thread::Builder::new()
            .name("attach-commands".into())
            .spawn(move || send_commands(commands_rx, writer, events))
            .expect("a thread for commands");
    }
    let rank = job
        .as_ref()
        .map(|j| j.rank)
        .or_else(|| rank_of_name(&first.hello.run_name));
    let panels = Pump::start(
        first,
        target.clone(),
        token.clone(),
        // A lone run's stream, or rank 0's, carries everything there is.
        Role::Panels {
            rows: matches!(rank, Some(0) | None),
        },
        sinks.clone(),
    );
    let dropped = Arc::clone(&sinks.dropped);
    let switcher = Switcher {
        token,
        sinks,
        events: events.clone(),
        metrics: metrics.clone(),
        attached: (target.clone(), rank),
        job,
        panels: Some(panels),
        panels_at: (target, rank),
        rows: None,
    };
    std::thread::Builder::new()
        .name("attach-ranks".into())
        .spawn(move || switcher.run(select_rx))
        .expect("a thread for switching ranks");
    Feed {
        events,
        metrics,
        dropped,
        control: Control::Commands(commands_tx),
        select_rank: Some(select_tx),
        link,
    }
}
