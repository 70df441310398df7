//! The one way telemetry leaves the trainer and the sampler.
//!
//! Every message goes to the UI and, when a log is open, to the log writer. Lifecycle
//! events and decisions block until there is room (they are rare and must not be lost);
//! high-rate figures are offered with `try_send` and counted when a consumer lags, so a
//! slow screen or disk never slows a training step.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};

use crate::telemetry::Telemetry;

/// Room for lifecycle events: far more than a run produces between two frames.
const EVENT_CAPACITY: usize = 1024;
/// Room for high-rate figures: a few seconds of a fast run.
const METRIC_CAPACITY: usize = 512;
/// The log writer keeps up with disk speed; this absorbs bursts.
const LOG_CAPACITY: usize = 8192;

/// A log record: the message plus when it was sent.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    /// Seconds since the bus was created (the run's start).
    pub t: f64,
    pub msg: Telemetry,
}

#[derive(Clone)]
pub struct Bus {
    events: Sender<Telemetry>,
    metrics: Sender<Telemetry>,
    log: Option<Sender<LogLine>>,
    started: Instant,
    dropped: Arc<AtomicU64>,
}

pub struct BusReceivers {
    /// Lifecycle events and decisions, never dropped.
    pub events: Receiver<Telemetry>,
    /// Steps and samples; may have gaps, see [`Bus::dropped`].
    pub metrics: Receiver<Telemetry>,
    /// Every message, stamped; `None` unless a log was asked for.
    pub log: Option<Receiver<LogLine>>,
}

impl Bus {
    pub fn new(with_log: bool) -> (Bus, BusReceivers) {
        let (etx, erx) = bounded(EVENT_CAPACITY);
        let (mtx, mrx) = bounded(METRIC_CAPACITY);
        let (log_tx, log_rx) = if with_log {
            let (tx, rx) = bounded(LOG_CAPACITY);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let bus = Bus {
            events: etx,
            metrics: mtx,
            log: log_tx,
            started: Instant::now(),
            dropped: Arc::new(AtomicU64::new(0)),
        };
        let rx = BusReceivers {
            events: erx,
            metrics: mrx,
            log: log_rx,
        };
        (bus, rx)
    }

    pub fn send(&self, msg: Telemetry) {
        if let Some(log) = &self.log {
            let line = LogLine {
                ts: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0),
                t: self.started.elapsed().as_secs_f64(),
                msg: msg.clone(),
            };
            // Steps go to the log losslessly (the log is the run's record); samples and
            // segment maps are sensor readings and may be dropped like on screen.
            let lossless = !matches!(line.msg, Telemetry::Sample(_) | Telemetry::Segments(_));
            self.offer(log, line, lossless);
        }
        if msg.is_high_rate() {
            self.offer(&self.metrics, msg, false);
        } else {
            self.offer(&self.events, msg, true);
        }
    }

    fn offer<T>(&self, tx: &Sender<T>, item: T, lossless: bool) {
        if lossless {
            // Err only when the receiver is gone (UI closed): nothing left to tell.
            let _ = tx.send(item);
        } else if let Err(TrySendError::Full(_)) = tx.try_send(item) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A bus that reaches the UI only: for the log writer's own notices, which must not
    /// feed back into the log channel it drains.
    pub fn ui_only(&self) -> Bus {
        Bus {
            log: None,
            ..self.clone()
        }
    }

    /// High-rate messages dropped so far because a consumer lagged.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Shared counter, for a UI that wants to show drops without holding a `Bus`.
    pub fn dropped_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{Notice, SystemSample};

    #[test]
    fn high_rate_messages_are_dropped_and_counted_events_are_not() {
        let (bus, rx) = Bus::new(false);
        for _ in 0..METRIC_CAPACITY + 10 {
            bus.send(Telemetry::Sample(SystemSample::default()));
        }
        assert_eq!(bus.dropped(), 10);
        assert_eq!(rx.metrics.len(), METRIC_CAPACITY);
        bus.send(Telemetry::Notice(Notice::new(
            crate::telemetry::Level::Info,
            "test",
            "hello",
        )));
        assert_eq!(rx.events.len(), 1);
    }

    #[test]
    fn log_gets_every_message_stamped_in_order() {
        let (bus, rx) = Bus::new(true);
        bus.send(Telemetry::Failed { reason: "a".into() });
        bus.send(Telemetry::Sample(SystemSample::default()));
        let log = rx.log.unwrap();
        let first = log.recv().unwrap();
        let second = log.recv().unwrap();
        assert_eq!(first.msg.kind(), "failed");
        assert_eq!(second.msg.kind(), "sample");
        assert!(first.t <= second.t && first.ts > 1.0e9);
    }
}
