//! The viewer's side of the stream protocol: the handshake, `headroom ls`'s status query,
//! and a [`Feed`] for the dashboard that survives a dropped connection by reconnecting.
use std::io::{self, BufReader};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use headroom_core::protocol::{
    check_version, version_string, ClientHello, ClientLine, RunStatusLine, ServerControl,
    ServerHello, ServerLine, Want, MAX_SERVER_LINE,
};
use headroom_core::{BadRecord, Command, Level, Notice, Record, Telemetry};
use headroom_ui::feed::{Control, Feed, Link};

use headroom_host::conn::{read_line_limited, send_line, Conn, Target};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a connection could not be made, for the one line the user is shown.
#[derive(Debug)]
pub enum ConnectError {
    /// Nothing listens there (a stale socket, a wrong port).
    Refused(String),
    /// Something answered, but not as a headroom run would, or refused us with a reason.
    Refusal(String),
    Other(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Refused(s) | ConnectError::Refusal(s) | ConnectError::Other(s) => {
                f.write_str(s)
            }
        }
    }
}

/// An open, greeted connection.
pub struct Session {
    pub hello: ServerHello,
    pub conn: Conn,
    pub reader: BufReader<Conn>,
}

/// Connects and greets: our hello, then the server's (or its one error line).
pub fn handshake(
    target: &Target,
    token: Option<&str>,
    want: Want,
) -> Result<Session, ConnectError> {
    let mut conn = Conn::connect(target, CONNECT_TIMEOUT).map_err(|e| match e.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => {
            ConnectError::Refused(format!("nothing answers at {target} ({e})"))
        }
        _ => ConnectError::Other(format!("cannot connect to {target}: {e}")),
    })?;
    let hello = ClientLine::Hello(ClientHello {
        protocol: version_string(),
        client: "headroom".into(),
        client_version: env!("CARGO_PKG_VERSION").into(),
        want,
        token: token.map(str::to_string),
    });
    let io_err = |e: io::Error| ConnectError::Other(format!("{target}: {e}"));
    send_line(&mut conn, &hello.to_line()).map_err(io_err)?;
    conn.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(io_err)?;
    let mut reader = BufReader::new(conn.try_clone().map_err(io_err)?);
    let first = read_line_limited(&mut reader, MAX_SERVER_LINE)
        .map_err(|e| ConnectError::Other(format!("{target} did not answer: {e}")))?
        .ok_or_else(|| ConnectError::Refusal(format!("{target} closed the connection")))?;
    match ServerLine::parse(&first) {
        Ok(ServerLine::Control(ServerControl::Hello(hello))) => {
            check_version(&hello.protocol).map_err(ConnectError::Refusal)?;
            conn.set_read_timeout(None).map_err(io_err)?;
            Ok(Session {
                hello,
                conn,
                reader,
            })
        }
        Ok(ServerLine::Control(ServerControl::Error { message, .. })) => Err(
            ConnectError::Refusal(format!("{target} refused the connection: {message}")),
        ),
        _ => Err(ConnectError::Refusal(format!(
            "{target} is not a headroom run (it answered something else)"
        ))),
    }
}

/// A run's one-line status (what `headroom ls` shows).
pub fn status(target: &Target, token: Option<&str>) -> Result<RunStatusLine, ConnectError> {
    let mut s = handshake(target, token, Want::Status)?;
    s.conn
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| ConnectError::Other(e.to_string()))?;
    match read_line_limited(&mut s.reader, MAX_SERVER_LINE) {
        Ok(Some(line)) => match ServerLine::parse(&line) {
            Ok(ServerLine::Control(ServerControl::RunStatus(st))) => Ok(st),
            _ => Err(ConnectError::Refusal(format!(
                "{target} answered the status query with something else"
            ))),
        },
        _ => Err(ConnectError::Other(format!(
            "{target} did not say its status"
        ))),
    }
}

/// How a connection's stream ended.
enum StreamEnd {
    /// The run ended (finished or failed) and said so.
    RunEnded,
    /// The server told us why it closed (a fatal error line).
    Closed(String),
    /// The connection dropped without a word.
    Dropped(String),
    /// The screen went away: nobody is watching.
    NobodyWatching,
}

/// The dashboard's feed over a greeted session: a thread reads the stream into the
/// feed's queues and reconnects when the connection drops (not when the run ended).
pub fn attach_feed(first: Session, target: Target, token: Option<String>) -> Feed {
    let (events_tx, events) = bounded::<Record>(1024);
    let (metrics_tx, metrics) = bounded::<Record>(512);
    let (link_tx, link) = bounded::<Link>(16);
    let (commands_tx, commands_rx) = bounded::<Command>(64);
    let dropped = Arc::new(AtomicU64::new(0));
    let writer: Arc<Mutex<Option<Conn>>> = Arc::new(Mutex::new(None));
    {
        let writer = Arc::clone(&writer);
        let events_tx = events_tx.clone();
        std::thread::Builder::new()
            .name("attach-commands".into())
            .spawn(move || send_commands(commands_rx, writer, events_tx))
            .expect("a thread for commands");
    }
    let counter = Arc::clone(&dropped);
    std::thread::Builder::new()
        .name("attach-stream".into())
        .spawn(move || {
            let mut session = Some(first);
            let mut attempt = 0u32;
            loop {
                let end = match session.take() {
                    Some(s) => {
                        attempt = 0;
                        let _ = link_tx.try_send(Link::Connected {
                            run_id: s.hello.run_id.clone(),
                        });
                        *writer.lock().unwrap() = s.conn.try_clone().ok();
                        let end = read_stream(s.reader, &events_tx, &metrics_tx, &counter);
                        *writer.lock().unwrap() = None;
                        end
                    }
                    None => StreamEnd::Dropped(String::new()),
                };
                let reason = match end {
                    StreamEnd::NobodyWatching => return,
                    StreamEnd::RunEnded => {
                        let _ = link_tx.send(Link::Closed {
                            reason: "the run has ended".into(),
                        });
                        return;
                    }
                    StreamEnd::Closed(why) | StreamEnd::Dropped(why) => why,
                };
                if attempt == 0
                    && !reason.is_empty()
                    && link_tx
                        .send(Link::Lost {
                            reason: reason.clone(),
                        })
                        .is_err()
                {
                    return;
                }
                if let Target::Unix(p) = &target {
                    if !p.exists() {
                        let _ = link_tx.send(Link::Closed {
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
                if link_tx
                    .send(Link::Retrying {
                        attempt,
                        in_s: wait.as_secs_f64(),
                    })
                    .is_err()
                {
                    return;
                }
                std::thread::sleep(wait);
                match handshake(&target, token.as_deref(), Want::Stream) {
                    Ok(s) => session = Some(s),
                    Err(e @ ConnectError::Refusal(_)) => {
                        // Told why: retrying will not change it (a wrong token, another
                        // protocol version).
                        let _ = link_tx.send(Link::Closed {
                            reason: e.to_string(),
                        });
                        return;
                    }
                    Err(_) => {}
                }
            }
        })
        .expect("a thread for the stream");
    Feed {
        events,
        metrics,
        dropped,
        control: Control::Commands(commands_tx),
        link,
    }
}

/// Reads one connection's stream into the feed's queues until it ends.
fn read_stream(
    mut reader: BufReader<Conn>,
    events: &Sender<Record>,
    metrics: &Sender<Record>,
    dropped: &AtomicU64,
) -> StreamEnd {
    let mut ended = false;
    loop {
        let line = match read_line_limited(&mut reader, MAX_SERVER_LINE) {
            Ok(Some(line)) => line,
            Ok(None) if ended => return StreamEnd::RunEnded,
            Ok(None) => return StreamEnd::Dropped("the run closed the connection".into()),
            Err(e) => return StreamEnd::Dropped(format!("the connection failed: {e}")),
        };
        let record = match ServerLine::parse(&line) {
            Ok(ServerLine::Record(r)) => r,
            Ok(ServerLine::Control(c)) => match c {
                ServerControl::Dropped { records } => {
                    dropped.fetch_add(records, Ordering::Relaxed);
                    continue;
                }
                ServerControl::Error {
                    message,
                    fatal: true,
                    ..
                } => return StreamEnd::Closed(message),
                ServerControl::Error { message, .. } => Record::new(
                    0.0,
                    0.0,
                    note(Level::Warn, format!("the run said: {message}")),
                ),
                _ => continue,
            },
            // A newer producer's record kind: skipped, as the protocol says.
            Err(BadRecord::UnknownKind(_)) => continue,
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
        if record.msg.is_high_rate() {
            match metrics.try_send(record) {
                Err(TrySendError::Full(_)) => {
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => return StreamEnd::NobodyWatching,
                Ok(()) => {}
            }
        } else if events.send(record).is_err() {
            return StreamEnd::NobodyWatching;
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

/// An attach argument: a socket path, `HOST:PORT`, or a run's name (or `name-pid`, or a
/// pid) among the local runs.
pub fn target_of(arg: &str, runs: &[(String, u32, std::path::PathBuf)]) -> Result<Target, String> {
    let p = Path::new(arg);
    if arg.contains('/') || arg.ends_with(".sock") {
        return Ok(Target::Unix(p.to_path_buf()));
    }
    let matches: Vec<&(String, u32, std::path::PathBuf)> = runs
        .iter()
        .filter(|(name, pid, _)| {
            name == arg || format!("{name}-{pid}") == arg || pid.to_string() == arg
        })
        .collect();
    match matches.as_slice() {
        [one] => return Ok(Target::Unix(one.2.clone())),
        [] => {}
        many => {
            return Err(format!(
                "{} runs are named {arg}: give one as NAME-PID ({})",
                many.len(),
                many.iter()
                    .map(|(n, p, _)| format!("{n}-{p}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    }
    if arg
        .rsplit_once(':')
        .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
    {
        return Ok(Target::Tcp(arg.to_string()));
    }
    Err(format!(
        "no running run is named {arg} (see `headroom ls`); give a run's name, its socket's \
         path or HOST:PORT"
    ))
}
