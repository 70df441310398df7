//! Where a run's records go besides the screen: the log, the stream server and the
//! sampler feeding the bus. Started and ended the same way whoever drives the run.
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use headroom_core::{Bus, BusReceivers, Command, Level, Notice, Record, Telemetry};

use crate::logger::{LogWriter, PendingLog};
use crate::sampler::Sampler;
use crate::server::{self, ServeOptions, Server};

/// How long the end waits for attached viewers to take the last records.
const VIEWERS_WAIT: Duration = Duration::from_secs(2);
/// A log writer still working through its queue is waited for this long (a slow disk);
/// one that takes nothing for a quarter of a second is stuck on its reader and left.
const LOG_WAIT: Duration = Duration::from_secs(5);

/// A run's bus: the screen's channels, the log's (when `with_log`) and the stream
/// server's, with live hints from the run's own figures (core/src/hints.rs).
/// `HEADROOM_LOG_QUEUE` sizes the log's queue (default 8192 records): the stalled-reader
/// tests reach a full queue in seconds through the same path.
pub fn run_bus(with_log: bool) -> (Bus, BusReceivers) {
    let log_queue = std::env::var("HEADROOM_LOG_QUEUE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(8192);
    let (bus, rx) = Bus::with_sinks_sized(with_log, true, log_queue);
    (bus.with_hints(), rx)
}

/// A run's log writer, stream server and sampler.
#[derive(Default)]
pub struct Sinks {
    log: Option<LogWriter>,
    server: Option<Server>,
    sampler: Option<Sampler>,
}

impl Sinks {
    /// Starts the log writer (on `log`, opened earlier, writing `lines`, the bus's log
    /// channel, where the first records have waited) and the stream server (on `records`,
    /// when the bus serves), which takes viewers' commands into `commands`.
    pub fn start(
        bus: &Bus,
        log: Option<PendingLog>,
        lines: Option<Receiver<Record>>,
        records: Option<Receiver<Record>>,
        commands: Sender<Command>,
        opts: ServeOptions,
    ) -> Sinks {
        let log = match (log, lines) {
            (Some(log), Some(lines)) => match LogWriter::start(log, lines, bus.ui_only()) {
                Ok(writer) => Some(writer),
                Err(why) => {
                    bus.send(Telemetry::Notice(Notice::new(Level::Warn, "log", why)));
                    None
                }
            },
            (Some(log), None) => {
                log.abandon();
                None
            }
            _ => None,
        };
        let server = records.and_then(|r| server::serve_run(&opts, r, commands, bus));
        Sinks {
            log,
            server,
            sampler: None,
        }
    }

    /// The sampler, started by the driver (a Python run starts it without the GIL).
    pub fn with_sampler(mut self, sampler: Sampler) -> Sinks {
        self.sampler = Some(sampler);
        self
    }

    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// No more samples: the sampler's hold on the bus goes.
    pub fn stop_sampler(&mut self) {
        self.sampler.take();
    }

    /// Ends the sinks once the run's last records are on the bus and every other hold on
    /// it is gone: attached viewers get them before the socket goes (first, since the
    /// server's notices reach the log), then the log is flushed. A warning about the log,
    /// if any.
    pub fn close(mut self) -> Option<String> {
        self.stop_sampler();
        if let Some(server) = self.server.take() {
            server.finish(VIEWERS_WAIT);
        }
        self.log.take().and_then(|w| w.finish(LOG_WAIT))
    }
}
