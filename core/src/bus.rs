//! The one way telemetry leaves the trainer and the sampler.
//!
//! Every message goes to each sink: the screen (two queues: lifecycle events and
//! high-rate figures) and, when one is open, the log writer. Nothing here ever waits on a
//! sink: a log whose reader stopped reading, a terminal that stopped drawing or, later, a
//! socket viewer must never stall a training step or a stop. Each sink has its own bounded
//! queue. High-rate figures that do not fit are dropped and counted ([`Bus::dropped`]).
//! Lifecycle events and log records that do not fit are lost only while their sink is
//! stalled, and never silently: the loss is counted per sink ([`Bus::sink_losses`]), the
//! other sinks are told when the stall starts, and the stalled sink itself receives a
//! record of the gap (how many it missed) as soon as it reads again.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};

use crate::hints::HintEngine;
use crate::record::Record;
use crate::telemetry::{Level, Notice, Telemetry};

/// Room for lifecycle events: far more than a run produces between two frames.
const EVENT_CAPACITY: usize = 1024;
/// Room for high-rate figures: a few seconds of a fast run.
const METRIC_CAPACITY: usize = 512;
/// The log writer keeps up with disk speed; this absorbs bursts (seconds of the fastest
/// run the flood test drives).
const LOG_CAPACITY: usize = 8192;

/// How one sink fared: what it lost while it stalled.
#[derive(Debug, Default)]
struct SinkHealth {
    /// Records that must not be lost but were, because the sink's queue was full.
    lost: AtomicU64,
    /// Lost since the sink last accepted a record: told to it when it reads again.
    unreported: AtomicU64,
    /// In a stall now (its queue was full at the last lossless offer).
    stalled: AtomicBool,
}

/// One consumer's bounded queue and its health.
#[derive(Clone)]
struct Sink<T> {
    tx: Sender<T>,
    health: Arc<SinkHealth>,
}

impl<T> Sink<T> {
    fn new(capacity: usize) -> (Sink<T>, Receiver<T>) {
        let (tx, rx) = bounded(capacity);
        let sink = Sink {
            tx,
            health: Arc::default(),
        };
        (sink, rx)
    }
}

/// What became of a lossless offer.
enum Offer {
    Delivered,
    /// The sink's queue is full: the record is lost and counted; `first` is true for the
    /// first loss of a stall, which the other sinks are told about.
    Lost {
        first: bool,
    },
    /// The consumer is gone (a closed screen): nothing left to tell.
    Gone,
}

#[derive(Clone)]
pub struct Bus {
    events: Sink<Record>,
    metrics: Sender<Record>,
    log: Option<Sink<Record>>,
    /// The stream server's hub, which fans records out to attached viewers.
    serve: Option<Sink<Record>>,
    started: Instant,
    dropped: Arc<AtomicU64>,
    /// Live hints computed from what passes through (a run's bus; none for a viewer's).
    hints: Option<Arc<Mutex<HintEngine>>>,
    /// The run has said how it ended (its summary, or why it failed): its record ends
    /// there, so sensor readings after it (a dashboard open until `q`) stay off the log
    /// and the stream.
    ended: Arc<AtomicBool>,
}

pub struct BusReceivers {
    /// Lifecycle events and decisions; lost only while the screen is stalled, and then
    /// followed by a notice saying how many.
    pub events: Receiver<Record>,
    /// Steps and samples; may have gaps, see [`Bus::dropped`].
    pub metrics: Receiver<Record>,
    /// Every message, stamped; `None` unless a log was asked for.
    pub log: Option<Receiver<Record>>,
    /// Every message, stamped, for the stream server; `None` unless serving.
    pub serve: Option<Receiver<Record>>,
}

/// Per sink, records that had to be kept but were lost because the sink stalled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkLosses {
    pub screen: u64,
    pub log: u64,
    pub viewers: u64,
}

impl Bus {
    pub fn new(with_log: bool) -> (Bus, BusReceivers) {
        Bus::with_capacities(with_log, EVENT_CAPACITY, METRIC_CAPACITY, LOG_CAPACITY)
    }

    /// [`Bus::new`], with a sink for the stream server when `serve` is true.
    pub fn with_sinks(with_log: bool, serve: bool) -> (Bus, BusReceivers) {
        Bus::with_sinks_sized(with_log, serve, LOG_CAPACITY)
    }

    /// [`Bus::with_sinks`] with the log's queue holding `log` records (a stalled log
    /// reader's test fills a small one in seconds instead of minutes).
    pub fn with_sinks_sized(with_log: bool, serve: bool, log: usize) -> (Bus, BusReceivers) {
        let (mut bus, mut rx) =
            Bus::with_capacities(with_log, EVENT_CAPACITY, METRIC_CAPACITY, log.max(1));
        if serve {
            let (sink, srx) = Sink::new(LOG_CAPACITY);
            bus.serve = Some(sink);
            rx.serve = Some(srx);
        }
        (bus, rx)
    }

    /// [`Bus::new`] with chosen queue sizes (tests make stalls quick to reach).
    pub fn with_capacities(
        with_log: bool,
        events: usize,
        metrics: usize,
        log: usize,
    ) -> (Bus, BusReceivers) {
        let (events, erx) = Sink::new(events);
        let (mtx, mrx) = bounded(metrics);
        let (log_sink, log_rx) = if with_log {
            let (sink, rx) = Sink::new(log);
            (Some(sink), Some(rx))
        } else {
            (None, None)
        };
        let bus = Bus {
            events,
            metrics: mtx,
            log: log_sink,
            serve: None,
            started: Instant::now(),
            dropped: Arc::new(AtomicU64::new(0)),
            hints: None,
            ended: Arc::new(AtomicBool::new(false)),
        };
        let rx = BusReceivers {
            events: erx,
            metrics: mrx,
            log: log_rx,
            serve: None,
        };
        (bus, rx)
    }

    /// This bus computes live hints from the records it carries and sends them on the
    /// same path: the trainer's and the sampler's figures meet here, whichever thread
    /// sends them, so a hint sees both (and a Python run gets the same hints as
    /// `headroom train`).
    pub fn with_hints(mut self) -> Bus {
        self.hints = Some(Arc::new(Mutex::new(HintEngine::new())));
        self
    }

    /// Hands `msg` to every sink without ever waiting (the hints' lock is held for the
    /// rules' arithmetic only, a few times per step).
    pub fn send(&self, msg: Telemetry) {
        let hints = match &self.hints {
            Some(engine) if !matches!(msg, Telemetry::Hint(_)) => engine
                .lock()
                .map(|mut e| e.observe(&msg, self.started.elapsed().as_secs_f64()))
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        self.deliver(msg);
        for hint in hints {
            self.deliver(Telemetry::Hint(hint));
        }
    }

    fn deliver(&self, msg: Telemetry) {
        if matches!(msg, Telemetry::Finished(_) | Telemetry::Failed { .. }) {
            self.ended.store(true, Ordering::SeqCst);
        }
        let record = self.stamp(msg);
        let reading = matches!(record.msg, Telemetry::Sample(_) | Telemetry::Segments(_));
        if reading && self.ended.load(Ordering::SeqCst) {
            if let Err(TrySendError::Full(_)) = self.metrics.try_send(record) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        if let Some(log) = &self.log {
            self.offer_record(log, "log", "the log's reader", record.clone());
        }
        if let Some(serve) = &self.serve {
            self.offer_record(serve, "viewers", "the stream server", record.clone());
        }
        if record.msg.is_high_rate() {
            if let Err(TrySendError::Full(_)) = self.metrics.try_send(record) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            let first = self.offer_lossless(&self.events, record, |lost| {
                self.stamp(gap_notice("screen", lost))
            });
            if first {
                let note = Notice::new(
                    Level::Warn,
                    "ui",
                    "the screen stopped reading: its events are being lost (counted); \
                     training goes on",
                );
                let note = self.stamp(Telemetry::Notice(note));
                for sink in [&self.log, &self.serve].into_iter().flatten() {
                    let _ = sink.tx.try_send(note.clone());
                }
            }
        }
    }

    /// A record sink (the log, the viewers' hub): steps go to it losslessly (the log is
    /// the run's record, and a viewer's charts are drawn from it); samples and segment
    /// maps are sensor readings and may be dropped like on screen.
    fn offer_record(&self, sink: &Sink<Record>, name: &str, reader: &str, record: Record) {
        let lossless = !matches!(record.msg, Telemetry::Sample(_) | Telemetry::Segments(_));
        if !lossless {
            if let Err(TrySendError::Full(_)) = sink.tx.try_send(record) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let first = self.offer_lossless(sink, record, |lost| self.stamp(gap_notice(name, lost)));
        if first {
            self.tell_screen(Notice::new(
                Level::Warn,
                name,
                format!(
                    "{reader} stopped reading: records are being lost (counted; the {name} \
                     gets a note of the gap when it reads again); training goes on"
                ),
            ));
        }
    }

    /// Offers a record that must not be lost. Returns true when this starts a stall.
    fn offer_lossless<T>(&self, sink: &Sink<T>, item: T, gap: impl Fn(u64) -> T) -> bool {
        match offer(sink, item, gap) {
            Offer::Delivered | Offer::Gone => false,
            Offer::Lost { first } => first,
        }
    }

    fn tell_screen(&self, notice: Notice) {
        let _ = offer(
            &self.events,
            self.stamp(Telemetry::Notice(notice)),
            |lost| self.stamp(gap_notice("screen", lost)),
        );
    }

    fn stamp(&self, msg: Telemetry) -> Record {
        Record {
            ts: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
            t: self.started.elapsed().as_secs_f64(),
            msg,
        }
    }

    /// A bus that reaches the screen only: for the log writer's own notices, which must
    /// not feed back into the log queue it drains, nor keep the stream server's queue
    /// open after the run (the server ends when every sender of its records is gone).
    pub fn ui_only(&self) -> Bus {
        Bus {
            log: None,
            serve: None,
            ..self.clone()
        }
    }

    /// A bus that reaches the screen and the log but not the viewers: for the stream
    /// server's own notices, which must not feed back into the hub it drains.
    pub fn without_viewers(&self) -> Bus {
        Bus {
            serve: None,
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

    /// Records that should have reached a sink but were lost while it stalled.
    pub fn sink_losses(&self) -> SinkLosses {
        SinkLosses {
            screen: self.events.health.lost.load(Ordering::Relaxed),
            log: self
                .log
                .as_ref()
                .map_or(0, |l| l.health.lost.load(Ordering::Relaxed)),
            viewers: self
                .serve
                .as_ref()
                .map_or(0, |l| l.health.lost.load(Ordering::Relaxed)),
        }
    }
}

/// The record a stalled sink receives once it reads again.
fn gap_notice(sink: &str, lost: u64) -> Telemetry {
    Telemetry::Notice(Notice::new(
        Level::Warn,
        sink,
        format!(
            "{lost} records were lost here: this {sink} stopped reading for a while and the \
             run did not wait for it"
        ),
    ))
}

fn offer<T>(sink: &Sink<T>, item: T, gap: impl Fn(u64) -> T) -> Offer {
    let h = &sink.health;
    // Claimed with a swap: the trainer and the sampler send at once, and a count read
    // then subtracted could be reported twice (and wrap below zero).
    let unreported = h.unreported.swap(0, Ordering::Relaxed);
    if unreported > 0 {
        // The note of the gap goes first, so a reader sees it where the gap is.
        match sink.tx.try_send(gap(unreported)) {
            Ok(()) => {}
            Err(TrySendError::Disconnected(_)) => return Offer::Gone,
            Err(TrySendError::Full(_)) => {
                h.unreported.fetch_add(unreported, Ordering::Relaxed);
            }
        }
    }
    match sink.tx.try_send(item) {
        Ok(()) => {
            h.stalled.store(false, Ordering::Relaxed);
            Offer::Delivered
        }
        Err(TrySendError::Disconnected(_)) => Offer::Gone,
        Err(TrySendError::Full(_)) => {
            h.lost.fetch_add(1, Ordering::Relaxed);
            h.unreported.fetch_add(1, Ordering::Relaxed);
            let first = !h.stalled.swap(true, Ordering::Relaxed);
            Offer::Lost { first }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::SystemSample;

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
        bus.send(status());
        bus.send(Telemetry::Sample(SystemSample::default()));
        let log = rx.log.unwrap();
        let first = log.recv().unwrap();
        let second = log.recv().unwrap();
        assert_eq!(first.msg.kind(), "status");
        assert_eq!(second.msg.kind(), "sample");
        assert!(first.t <= second.t && first.ts > 1.0e9);
    }

    /// A dashboard stays open after the run ended, its sampler still reading: the log and
    /// the stream end with the run's end, the screen keeps its readings.
    #[test]
    fn readings_after_the_runs_end_reach_the_screen_only() {
        let (bus, rx) = Bus::with_sinks(true, true);
        bus.send(Telemetry::Sample(SystemSample::default()));
        bus.send(Telemetry::Failed { reason: "a".into() });
        bus.send(Telemetry::Sample(SystemSample::default()));
        bus.send(Telemetry::Segments(Default::default()));
        for sink in [rx.log.unwrap(), rx.serve.unwrap()] {
            let kinds: Vec<_> = sink.try_iter().map(|r| r.msg.kind()).collect();
            assert_eq!(kinds, ["sample", "failed"]);
        }
        assert_eq!(rx.metrics.try_iter().count(), 3);
    }

    fn status() -> Telemetry {
        Telemetry::Status {
            status: crate::telemetry::RunStatus::Running,
        }
    }

    #[test]
    fn a_stalled_log_never_blocks_the_sender_and_its_loss_is_counted_and_told() {
        let (bus, rx) = Bus::with_capacities(true, 64, 8, 4);
        let log = rx.log.unwrap();
        // Nobody reads the log: without the stall rule the fifth send would block forever.
        let sender = std::thread::spawn(move || {
            for _ in 0..10 {
                bus.send(status());
            }
            bus
        });
        let bus = sender.join().unwrap();
        assert_eq!(bus.sink_losses().log, 6);
        assert_eq!(bus.sink_losses().screen, 0);
        // The screen heard about the stall once, beside the ten statuses.
        let notices: Vec<_> = rx
            .events
            .try_iter()
            .filter(|m| matches!(&m.msg, Telemetry::Notice(n) if n.source == "log"))
            .collect();
        assert_eq!(notices.len(), 1, "{notices:?}");
        // The log reads again: the gap is written where it happened, before what follows.
        let kept: Vec<_> = log.try_iter().collect();
        assert_eq!(kept.len(), 4);
        bus.send(status());
        let next: Vec<_> = log.try_iter().map(|l| l.msg).collect();
        match &next[0] {
            Telemetry::Notice(n) => assert!(n.text.starts_with("6 records were lost"), "{n:?}"),
            other => panic!("expected the gap note first, got {other:?}"),
        }
        assert_eq!(next[1], status());
        assert_eq!(bus.sink_losses().log, 6, "nothing more lost once it reads");
    }

    #[test]
    fn a_stalled_screen_loses_events_without_blocking_and_is_told_the_gap() {
        let (bus, rx) = Bus::with_capacities(false, 2, 8, 4);
        for _ in 0..5 {
            bus.send(status());
        }
        assert_eq!(bus.sink_losses().screen, 3);
        assert_eq!(rx.events.try_iter().count(), 2);
        bus.send(status());
        let first = rx.events.try_recv().unwrap().msg;
        assert!(
            matches!(&first, Telemetry::Notice(n) if n.text.starts_with("3 records were lost")),
            "{first:?}"
        );
    }

    /// Senders on several threads (the trainer and the sampler) stall the same sink:
    /// every record is either delivered or counted in exactly one gap note. (The swap in
    /// `offer` closes a window too narrow for this test to hit reliably; the test holds
    /// the accounting as a whole.)
    #[test]
    fn with_several_senders_every_record_is_delivered_or_counted_in_a_gap() {
        let (bus, rx) = Bus::with_capacities(false, 4, 8, 4);
        let senders: Vec<_> = (0..2)
            .map(|_| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        bus.send(status());
                    }
                })
            })
            .collect();
        let (mut delivered, mut gaps) = (0u64, 0u64);
        let mut tally = |m: Telemetry| match m {
            Telemetry::Notice(n) => {
                gaps += n.text.split(' ').next().unwrap().parse::<u64>().unwrap();
            }
            _ => delivered += 1,
        };
        while senders.iter().any(|t| !t.is_finished()) {
            if let Ok(m) = rx.events.try_recv() {
                tally(m.msg);
            }
        }
        for t in senders {
            t.join().unwrap();
        }
        rx.events.try_iter().for_each(|r| tally(r.msg));
        // One more, after the drain, carries any gap not yet told.
        bus.send(status());
        rx.events.try_iter().for_each(|r| tally(r.msg));
        assert_eq!(
            delivered + gaps,
            40_001,
            "{delivered} delivered, {gaps} in gap notes"
        );
        assert_eq!(gaps, bus.sink_losses().screen);
    }
}
