//! Serves a run's telemetry stream (docs/PROTOCOL.md) to any number of viewers, on an
//! owner-only Unix socket and, when asked, on TCP behind a token.
//!
//! One hub thread owns the catch-up state and fans every record out to one bounded queue
//! per viewer; it never waits on a viewer. Each viewer has a writer (draining its queue
//! into the socket) and a reader (its commands). A viewer that reads slowly loses
//! high-rate records first (counted, and told with a `dropped` line); one that falls so
//! far behind that an event would be lost is told and disconnected. Nothing a viewer
//! does — garbage, a 100 MB line, a flood of commands, never reading — reaches the
//! trainer except a valid command, checked as a key press is.
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, select, Receiver, Sender, TrySendError};
use headroom_core::protocol::{
    check_version, code, version_string, CatchUp, CatchUpLimits, ClientHello, ClientLine, JobRank,
    ServerControl, ServerHello, Want, MAX_CLIENT_LINE,
};
use headroom_core::{Bus, Command, Level, Notice, Record, Telemetry};

use crate::conn::{read_line_limited, send_line, Conn};
use crate::rundir;

/// Live records a viewer may have queued; high-rate records only while it is at most half
/// full, so that events keep room.
const VIEWER_QUEUE: usize = 2048;

/// The most records a catch-up holds, which a new viewer's queue takes on top.
fn catch_up_room() -> usize {
    let l = CatchUpLimits::default();
    2 * l.steps + l.samples + l.events + 8
}
/// At most this many viewers at once; more are told the server is busy.
const MAX_VIEWERS: usize = 32;
/// A client has this long to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// A write that makes no progress for this long ends the connection (a viewer that
/// stopped reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Commands a viewer may send in a burst, and per second after it.
const COMMAND_BURST: f64 = 20.0;
const COMMANDS_PER_S: f64 = 10.0;
/// Refused commands after which a flooding viewer is disconnected.
const FLOOD_LIMIT: u64 = 200;

/// What `--listen` asked for.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub run_name: String,
    /// `HOST:PORT`, `:PORT` or `PORT` (loopback unless a host is named).
    pub listen: Option<String>,
    pub producer: String,
    /// The job this run is one rank of (`headroom ls` groups ranks by job).
    pub job: Option<JobRank>,
}

/// Where a run is served, for the messages that say so.
#[derive(Debug, Clone)]
pub struct Addresses {
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    pub token_file: Option<PathBuf>,
}

pub struct Server {
    addresses: Addresses,
    stop: Arc<AtomicBool>,
    hub: Option<JoinHandle<()>>,
    listeners: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// Serves a run's stream on its socket (and TCP when asked), telling where on `bus`. A run
/// that cannot serve still trains: the reason is told on screen and in the log.
pub fn serve_run(
    opts: &ServeOptions,
    records: Receiver<Record>,
    commands: Sender<Command>,
    bus: &Bus,
) -> Option<Server> {
    let notice =
        |level, text: String| bus.send(Telemetry::Notice(Notice::new(level, "serve", text)));
    let name = &opts.run_name;
    match Server::start(opts, records, commands, bus.without_viewers()) {
        Ok(s) => {
            let a = s.addresses();
            let mut text = format!(
                "serving on {} (attach with: headroom attach {name})",
                a.socket.display()
            );
            if let (Some(tcp), Some(token)) = (a.tcp, &a.token_file) {
                text += &format!(
                    "; also on tcp {tcp} (token in {}: headroom attach {tcp} --token-file FILE)",
                    token.display()
                );
            }
            notice(Level::Info, text);
            Some(s)
        }
        Err(e) => {
            notice(
                Level::Warn,
                format!(
                    "not serving the stream ({e}); the run goes on, but `headroom attach` \
                     cannot reach it"
                ),
            );
            None
        }
    }
}

/// `--listen`'s value as an address: a bare port (or `:PORT`) is loopback.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    let with_host = if let Some(port) = s.strip_prefix(':') {
        format!("127.0.0.1:{port}")
    } else if s.parse::<u16>().is_ok() {
        format!("127.0.0.1:{s}")
    } else {
        s.to_string()
    };
    with_host
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            format!(
                "--listen {s}: not an address; give PORT (loopback), HOST:PORT or [IPv6]:PORT, \
                 e.g. --listen 7878 or --listen 0.0.0.0:7878"
            )
        })
}

/// What every connection thread shares.
struct Shared {
    run_name: String,
    run_id: String,
    producer: String,
    job: Option<JobRank>,
    pid: u32,
    token: Option<String>,
    commands: Sender<Command>,
    joins: Sender<Join>,
    run_over: AtomicBool,
    viewers: AtomicUsize,
    stop: Arc<AtomicBool>,
    /// Taken at [`Server::finish`]: held longer, it would keep the log's queue open and
    /// the log writer waiting for the end of its records.
    notices: std::sync::Mutex<Option<Bus>>,
    next_id: AtomicU64,
}

enum Join {
    Stream {
        queue: Sender<Arc<str>>,
        viewer: Arc<Viewer>,
    },
    Status {
        reply: Sender<String>,
    },
}

/// A connected viewer as the hub sees it.
struct Viewer {
    peer: String,
    /// Disconnected for falling behind: its writer says why and closes.
    evicted: AtomicBool,
    /// High-rate records it missed and has not been told of yet.
    unreported_drops: AtomicU64,
}

struct Attached {
    queue: Sender<Arc<str>>,
    viewer: Arc<Viewer>,
}

impl Server {
    /// Starts serving the records that reach `records` (the bus's server sink). Commands
    /// from viewers go to `commands`; the server's own notices (a refused client, a viewer
    /// disconnected for falling behind) go to `notices`, which must not feed the server.
    pub fn start(
        opts: &ServeOptions,
        records: Receiver<Record>,
        commands: Sender<Command>,
        notices: Bus,
    ) -> io::Result<Server> {
        let dir = rundir::dir()?;
        let pid = std::process::id();
        let paths = rundir::paths(&dir, &opts.run_name, pid);
        let tcp_addr = opts
            .listen
            .as_deref()
            .map(parse_listen)
            .transpose()
            .map_err(io::Error::other)?;
        // A socket left by a process that had our pid before: nobody listens on it.
        let _ = std::fs::remove_file(&paths.socket);
        let unix = UnixListener::bind(&paths.socket).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot listen on {}: {e}", paths.socket.display()),
            )
        })?;
        std::fs::set_permissions(&paths.socket, std::fs::Permissions::from_mode(0o600))?;
        let (tcp, token) = match tcp_addr {
            Some(addr) => {
                let listener = TcpListener::bind(addr).map_err(|e| {
                    rundir::remove_run(&paths.socket);
                    io::Error::new(e.kind(), format!("--listen {addr}: {e}"))
                })?;
                let token = rundir::write_token(&paths.token)?;
                (Some(listener), Some(token))
            }
            None => (None, None),
        };
        let tcp_local = tcp.as_ref().map(|l| l.local_addr()).transpose()?;
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let stop = Arc::new(AtomicBool::new(false));
        let (join_tx, join_rx) = bounded::<Join>(64);
        let shared = Arc::new(Shared {
            run_name: opts.run_name.clone(),
            run_id: format!("{}-{pid}-{started}", opts.run_name),
            producer: opts.producer.clone(),
            job: opts.job.clone(),
            pid,
            token,
            commands,
            joins: join_tx,
            run_over: AtomicBool::new(false),
            viewers: AtomicUsize::new(0),
            stop: Arc::clone(&stop),
            notices: std::sync::Mutex::new(Some(notices)),
            next_id: AtomicU64::new(1),
        });
        let hub = {
            let shared = Arc::clone(&shared);
            let tcp_text = tcp_local.map(|a| a.to_string());
            std::thread::Builder::new()
                .name("serve-hub".into())
                .spawn(move || hub(records, join_rx, shared, tcp_text))?
        };
        let mut listeners = Vec::new();
        {
            let shared = Arc::clone(&shared);
            listeners.push(
                std::thread::Builder::new()
                    .name("serve-unix".into())
                    .spawn(move || {
                        for conn in unix.incoming() {
                            if shared.stop.load(Ordering::SeqCst) {
                                break;
                            }
                            if let Ok(conn) = conn {
                                accept(Conn::Unix(conn), &shared);
                            }
                        }
                    })?,
            );
        }
        if let Some(tcp) = tcp {
            let shared = Arc::clone(&shared);
            listeners.push(std::thread::Builder::new().name("serve-tcp".into()).spawn(
                move || {
                    for conn in tcp.incoming() {
                        if shared.stop.load(Ordering::SeqCst) {
                            break;
                        }
                        if let Ok(conn) = conn {
                            let _ = conn.set_nodelay(true);
                            accept(Conn::Tcp(conn), &shared);
                        }
                    }
                },
            )?);
        }
        Ok(Server {
            addresses: Addresses {
                socket: paths.socket,
                tcp: tcp_local,
                token_file: tcp_local.map(|_| paths.token),
            },
            stop,
            hub: Some(hub),
            listeners,
            shared,
        })
    }

    pub fn addresses(&self) -> &Addresses {
        &self.addresses
    }

    /// Removes the socket and token now, for an exit that will not wait for
    /// [`Server::finish`] (a second stop request).
    pub fn abandon(&self) {
        rundir::remove_run(&self.addresses.socket);
    }

    /// After every sender of the records is gone: lets the hub hand the last records to
    /// the viewers (each writer gets a moment to send them), then stops listening and
    /// removes the socket.
    pub fn finish(mut self, wait: Duration) {
        if let Some(hub) = self.hub.take() {
            let deadline = Instant::now() + wait;
            while !hub.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if hub.is_finished() {
                let _ = hub.join();
            }
        }
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared
            .notices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        // The listeners sit in accept(): one connection each wakes them to see `stop`
        // (before the socket's name goes, or there is nothing left to connect to).
        let _ = UnixStream::connect(&self.addresses.socket);
        if let Some(addr) = self.addresses.tcp {
            let _ = TcpStream::connect_timeout(&wake_address(addr), Duration::from_millis(200));
        }
        rundir::remove_run(&self.addresses.socket);
        // Bounded: the run's exit must never wait on a listener.
        let deadline = Instant::now() + Duration::from_secs(1);
        for l in self.listeners.drain(..) {
            while !l.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if l.is_finished() {
                let _ = l.join();
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where to connect to reach a listener bound to `addr` (an unspecified address is
/// reachable on loopback).
fn wake_address(addr: SocketAddr) -> SocketAddr {
    let mut a = addr;
    if a.ip().is_unspecified() {
        a.set_ip(if a.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    a
}

fn hub(records: Receiver<Record>, joins: Receiver<Join>, shared: Arc<Shared>, tcp: Option<String>) {
    let started = Instant::now();
    let mut catch_up = CatchUp::new(CatchUpLimits::default());
    let mut viewers: Vec<Attached> = Vec::new();
    loop {
        select! {
            recv(records) -> r => match r {
                Ok(r) => {
                    if matches!(r.msg, Telemetry::Finished(_) | Telemetry::Failed { .. }) {
                        shared.run_over.store(true, Ordering::SeqCst);
                    }
                    catch_up.keep(&r);
                    let line: Arc<str> = r.to_line().into();
                    let high_rate = r.msg.is_high_rate();
                    viewers.retain(|v| deliver(v, &line, high_rate));
                }
                // The run is over and every sender gone: the viewers' queues close with
                // the last records in them, and each writer ends after sending them.
                Err(_) => break,
            },
            recv(joins) -> j => match j {
                Ok(Join::Stream { queue, viewer }) => {
                    let hello = ServerControl::Hello(hello_of(&shared, true)).to_line();
                    let lines = catch_up.records();
                    let n = lines.len();
                    // The queue is empty and has room for a whole catch-up.
                    let mut ok = queue.try_send(hello.into()).is_ok();
                    for r in lines {
                        ok &= queue.try_send(r.to_line().into()).is_ok();
                    }
                    ok &= queue
                        .try_send(ServerControl::CaughtUp { records: n }.to_line().into())
                        .is_ok();
                    if ok {
                        viewers.push(Attached { queue, viewer });
                    }
                }
                Ok(Join::Status { reply }) => {
                    let mut line = catch_up.status_line(
                        shared.pid,
                        viewers.len(),
                        started.elapsed().as_secs_f64(),
                    );
                    line.tcp = tcp.clone();
                    line.job = shared.job.clone();
                    if line.run_name.is_empty() {
                        line.run_name = shared.run_name.clone();
                    }
                    let _ = reply.try_send(ServerControl::RunStatus(line).to_line());
                }
                Err(_) => {}
            },
        }
    }
    // From here a client that connects gets the hello and an error: nothing more comes.
    shared.run_over.store(true, Ordering::SeqCst);
}

/// Hands one record to a viewer without waiting; false once the viewer is gone.
fn deliver(v: &Attached, line: &Arc<str>, high_rate: bool) -> bool {
    if v.viewer.evicted.load(Ordering::SeqCst) {
        return false;
    }
    if high_rate && v.queue.len() >= VIEWER_QUEUE / 2 {
        v.viewer.unreported_drops.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    let drops = v.viewer.unreported_drops.swap(0, Ordering::Relaxed);
    if drops > 0 {
        let note = ServerControl::Dropped { records: drops }.to_line();
        if v.queue.try_send(note.into()).is_err() {
            v.viewer
                .unreported_drops
                .fetch_add(drops, Ordering::Relaxed);
        }
    }
    match v.queue.try_send(Arc::clone(line)) {
        Ok(()) => true,
        Err(TrySendError::Disconnected(_)) => false,
        Err(TrySendError::Full(_)) => {
            // An event would be lost: never silently. The viewer is told (its writer sends
            // the reason once it can) and disconnected; the run does not wait for it.
            // The writer says so once it wakes (its queue closes now).
            v.viewer.evicted.store(true, Ordering::SeqCst);
            false
        }
    }
}

fn hello_of(shared: &Shared, commands: bool) -> ServerHello {
    ServerHello {
        protocol: version_string(),
        run_id: shared.run_id.clone(),
        run_name: shared.run_name.clone(),
        producer: shared.producer.clone(),
        producer_version: env!("CARGO_PKG_VERSION").to_string(),
        pid: shared.pid,
        commands,
    }
}

/// Hands a new connection to a thread of its own: the accept loop never waits on a client.
fn accept(conn: Conn, shared: &Arc<Shared>) {
    let shared = Arc::clone(shared);
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name(format!("viewer-{id}"))
        .spawn(move || serve_viewer(conn, id, shared));
    // Out of threads: the connection was dropped with the closure, which closes it.
    drop(spawned);
}

/// Sends one error line and closes.
fn refuse(conn: &mut Conn, code_: &str, message: &str) {
    let _ = send_line(conn, &ServerControl::error(code_, message, true).to_line());
    linger_close(conn);
}

/// Closes so that what was sent arrives: what the client sent and was not read (a hello
/// refused before reading it, the rest of a line too long) is drained a moment first,
/// since closing over unread data resets the connection and can lose the last line.
fn linger_close(conn: &mut Conn) {
    conn.shutdown_write();
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 8192];
    let (mut drained, deadline) = (0, Instant::now() + Duration::from_millis(200));
    while drained < 1 << 20 && Instant::now() < deadline {
        match std::io::Read::read(conn, &mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    conn.close();
}

/// The whole life of one connection: the handshake, then a status answer or the stream.
fn serve_viewer(mut conn: Conn, id: u64, shared: Arc<Shared>) {
    let peer = conn.peer();
    let Some((hello, reader)) = handshake(&mut conn, &peer, &shared) else {
        return;
    };
    if hello.want == Want::Status {
        answer_status(conn, &shared);
        return;
    }
    attach(conn, reader, peer, id, shared);
}

/// Checks who connects and reads their hello: the peer's uid on a Unix socket, the hello
/// within [`HELLO_TIMEOUT`], the protocol's version and, over TCP, the run's token. A
/// connection that fails a check is told why and closed (`None`); one that passes
/// comes back with its hello and the reader of what it sends next.
fn handshake(
    conn: &mut Conn,
    peer: &str,
    shared: &Shared,
) -> Option<(ClientHello, BufReader<Conn>)> {
    if let Some(uid) = conn.peer_uid() {
        if uid != rundir::uid() {
            notice(
                shared,
                Level::Warn,
                format!("refused a connection from uid {uid}: only the run's owner may attach"),
            );
            refuse(conn, code::FORBIDDEN, "only the run's owner may connect");
            return None;
        }
    }
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = conn.set_read_timeout(Some(HELLO_TIMEOUT));
    let read_half = conn.try_clone().ok()?;
    let mut reader = BufReader::with_capacity(8192, read_half);
    let hello = match read_line_limited(&mut reader, MAX_CLIENT_LINE) {
        Ok(Some(line)) => ClientLine::parse(&line),
        Ok(None) => return None,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            refuse(conn, code::TOO_LONG, &format!("{e}; closing"));
            return None;
        }
        Err(_) => {
            refuse(
                conn,
                code::HANDSHAKE,
                "no hello within 5 s: send {\"kind\":\"hello\",\"protocol\":\"1.0\",...} first",
            );
            return None;
        }
    };
    let hello = match hello {
        Ok(ClientLine::Hello(h)) => h,
        Ok(_) => {
            refuse(
                conn,
                code::HANDSHAKE,
                "the first line must be a hello (see docs/PROTOCOL.md)",
            );
            return None;
        }
        Err(e) => {
            refuse(
                conn,
                code::HANDSHAKE,
                &format!("{e}; the first line must be a hello"),
            );
            return None;
        }
    };
    if let Err(e) = check_version(&hello.protocol) {
        refuse(conn, code::VERSION, &e);
        return None;
    }
    if matches!(conn, Conn::Tcp(_)) {
        let ok = match (&shared.token, &hello.token) {
            (Some(want), Some(got)) => rundir::same_token(want, got),
            _ => false,
        };
        if !ok {
            let why = if hello.token.is_none() {
                "no token"
            } else {
                "a wrong token"
            };
            notice(
                shared,
                Level::Warn,
                format!("refused a TCP viewer from {peer}: {why}"),
            );
            refuse(
                conn,
                code::UNAUTHORIZED,
                "this address needs the run's token: pass --token-file FILE or set \
                 HEADROOM_TOKEN",
            );
            return None;
        }
    }
    Some((hello, reader))
}

/// A `status` hello: the server's hello and the hub's one-line status, then close.
fn answer_status(mut conn: Conn, shared: &Shared) {
    let (tx, rx) = bounded(1);
    if shared.joins.send(Join::Status { reply: tx }).is_ok() {
        if let Ok(line) = rx.recv_timeout(Duration::from_secs(2)) {
            let hello = ServerControl::Hello(hello_of(shared, false)).to_line();
            let _ = send_line(&mut conn, &hello).and_then(|_| send_line(&mut conn, &line));
        }
    }
    conn.close();
}

/// A viewer that passed the handshake joins the hub's stream: its writer on this thread,
/// its reader of commands on a second one, until either ends.
fn attach(mut conn: Conn, reader: BufReader<Conn>, peer: String, id: u64, shared: Arc<Shared>) {
    if shared.viewers.fetch_add(1, Ordering::SeqCst) >= MAX_VIEWERS {
        shared.viewers.fetch_sub(1, Ordering::SeqCst);
        refuse(
            &mut conn,
            code::BUSY,
            &format!("{MAX_VIEWERS} viewers are attached already; try again later"),
        );
        return;
    }
    let viewer = Arc::new(Viewer {
        peer,
        evicted: AtomicBool::new(false),
        unreported_drops: AtomicU64::new(0),
    });
    let (queue, lines) = bounded::<Arc<str>>(VIEWER_QUEUE + catch_up_room());
    let (replies, replies_rx) = bounded::<String>(16);
    let (bye, bye_rx) = bounded::<()>(0);
    let joined = shared
        .joins
        .send(Join::Stream {
            queue,
            viewer: Arc::clone(&viewer),
        })
        .is_ok();
    if joined {
        let _ = reader.get_ref().set_read_timeout(None);
        let reading = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("viewer-{id}-in"))
                .spawn(move || {
                    read_commands(reader, &shared, replies);
                    drop(bye);
                })
        };
        if reading.is_ok() {
            if let WriterEnd::TooSlow(why) =
                write_lines(&mut conn, &lines, &replies_rx, &bye_rx, &viewer)
            {
                notice(
                    &shared,
                    Level::Warn,
                    format!(
                        "viewer {id} ({}) could not keep up ({why}) and was disconnected; \
                         the run went on",
                        viewer.peer
                    ),
                );
            }
        }
    }
    // A fatal error line (a line too long, a flood, too slow) may be the last thing sent.
    linger_close(&mut conn);
    shared.viewers.fetch_sub(1, Ordering::SeqCst);
}

/// Why a viewer's writer stopped.
enum WriterEnd {
    /// The viewer left, or the run ended and everything was sent.
    Done,
    /// The viewer fell behind: events no longer fit its queue, or a write made no
    /// progress for [`WRITE_TIMEOUT`].
    TooSlow(&'static str),
}

/// Drains the viewer's queue into its socket, and the reader's replies to it.
fn write_lines(
    conn: &mut Conn,
    lines: &Receiver<Arc<str>>,
    replies: &Receiver<String>,
    bye: &Receiver<()>,
    viewer: &Viewer,
) -> WriterEnd {
    let mut out = io::BufWriter::with_capacity(64 * 1024, conn);
    loop {
        let item = select! {
            recv(lines) -> l => l.map(|l| l.to_string()),
            recv(replies) -> r => r,
            recv(bye) -> _ => return WriterEnd::Done,
        };
        if viewer.evicted.load(Ordering::SeqCst) {
            let why = ServerControl::error(
                code::TOO_SLOW,
                "this viewer read too slowly to keep every event and was disconnected; the \
                 run goes on (attach again to catch up)",
                true,
            );
            let _ = out.flush();
            let _ = send_line(out.get_mut(), &why.to_line());
            return WriterEnd::TooSlow("its queue of events was full");
        }
        let Ok(line) = item else {
            // The hub let go: the run is over and every record has been queued.
            let _ = out.flush();
            return WriterEnd::Done;
        };
        let wrote = out
            .write_all(line.as_bytes())
            .and_then(|_| out.write_all(b"\n"));
        // Flushed whenever nothing more is waiting, so a quiet stream is never held back.
        let flushed = if lines.is_empty() && replies.is_empty() {
            out.flush()
        } else {
            Ok(())
        };
        if let Err(e) = wrote.and(flushed) {
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    WriterEnd::TooSlow("it read nothing for 10 s")
                }
                _ => WriterEnd::Done,
            };
        }
    }
}

/// Reads a viewer's lines: commands, checked as a key press is, then queued to the
/// trainer; anything else is answered with an error line to that viewer alone.
fn read_commands(mut reader: BufReader<Conn>, shared: &Shared, replies: Sender<String>) {
    let mut bucket = COMMAND_BURST;
    let mut last = Instant::now();
    let mut refused = 0u64;
    let reply = |code_: &str, message: String, fatal: bool| {
        let _ = replies.try_send(ServerControl::error(code_, message, fatal).to_line());
    };
    loop {
        let line = match read_line_limited(&mut reader, MAX_CLIENT_LINE) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                reply(code::TOO_LONG, format!("{e}; closing"), true);
                // Let the writer send it before the socket goes.
                std::thread::sleep(Duration::from_millis(100));
                break;
            }
            Err(_) => break,
        };
        if line.trim().is_empty() {
            continue;
        }
        let command = match ClientLine::parse(&line) {
            Ok(ClientLine::Command(c)) => c,
            Ok(ClientLine::Hello(_)) => {
                reply(code::BAD_LINE, "hello was already said".into(), false);
                continue;
            }
            Err(e) => {
                reply(code::BAD_LINE, e, false);
                continue;
            }
        };
        let now = Instant::now();
        bucket =
            (bucket + now.duration_since(last).as_secs_f64() * COMMANDS_PER_S).min(COMMAND_BURST);
        last = now;
        if bucket < 1.0 {
            refused += 1;
            if refused >= FLOOD_LIMIT {
                reply(
                    code::FLOOD,
                    format!("{refused} commands over the rate limit: disconnecting"),
                    true,
                );
                std::thread::sleep(Duration::from_millis(100));
                break;
            }
            reply(
                code::FLOOD,
                format!(
                    "too many commands: at most {COMMANDS_PER_S} a second (bursts of \
                     {COMMAND_BURST}); {command:?} was not applied"
                ),
                false,
            );
            continue;
        }
        bucket -= 1.0;
        if let Err(why) = check_command(&command, shared) {
            reply(code::COMMAND, why, false);
            continue;
        }
        match shared.commands.try_send(command) {
            Ok(()) => {}
            Err(TrySendError::Full(c)) => reply(
                code::COMMAND,
                format!("{c:?} not applied: the trainer's command queue is full; try again"),
                false,
            ),
            Err(TrySendError::Disconnected(c)) => reply(
                code::COMMAND,
                format!("{c:?} not applied: the run has ended"),
                false,
            ),
        }
    }
}

/// The checks a key press gets before its command is sent (the trainer checks again).
fn check_command(command: &Command, shared: &Shared) -> Result<(), String> {
    if shared.run_over.load(Ordering::SeqCst) {
        return Err(format!("{command:?} not applied: the run has ended"));
    }
    match command {
        Command::SetThresholds { thresholds } => thresholds
            .validate()
            .map_err(|e| format!("thresholds not applied: {e}")),
        Command::PinMicroBatch { micro_batch: 0 } => {
            Err("pin not applied: the micro-batch must be at least 1".into())
        }
        _ => Ok(()),
    }
}

fn notice(shared: &Shared, level: Level, text: String) {
    if let Some(bus) = shared
        .notices
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        bus.send(Telemetry::Notice(Notice::new(level, "serve", text)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_defaults_to_loopback_unless_a_host_is_named() {
        assert_eq!(parse_listen("7878").unwrap().to_string(), "127.0.0.1:7878");
        assert_eq!(parse_listen(":7878").unwrap().to_string(), "127.0.0.1:7878");
        assert_eq!(parse_listen("0.0.0.0:9").unwrap().to_string(), "0.0.0.0:9");
        assert_eq!(parse_listen("[::1]:9").unwrap().to_string(), "[::1]:9");
        assert!(parse_listen("nope").unwrap_err().contains("--listen 7878"));
    }
}
