//! A watch-only run's step records, taken off the training thread. `run.report()` hands
//! the step's figures to this thread and returns: reading the step's peak (the kernel's
//! VmHWM, 25 µs of /proc/self/status), restarting the peak window, the limit and the
//! session's records (the log, the viewers) happen here, in the order the steps came.
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use headroom_core::Level;
use headroom_host::procmem;
use headroom_host::session::{Measured, Session, StepDone, StepPeak};
use pyo3::prelude::*;

/// The session, shared by the Python thread's calls and the reporter's records.
pub type Shared = Arc<Mutex<Session>>;

/// The session, also after a panic elsewhere left its lock poisoned: its records are
/// still what the run has.
pub fn lock(session: &Shared) -> MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(|p| p.into_inner())
}

/// A step's loss: a number, or a device tensor read here (its `.item()` waits for the
/// device on this thread, not on the training thread; torch releases the GIL meanwhile).
pub enum Loss {
    Value(f64),
    Tensor(Py<PyAny>),
}

/// Where a step's peak comes from.
pub enum Peak {
    /// The resident set's high-water mark, read (and its window restarted) here.
    Rss,
    /// A Python callable returning the peak since its last call and restarting the
    /// window (CUDA: the allocator's peak), called here under the GIL.
    Python(Py<PyAny>),
}

/// One completed step of a watch-only run, as `run.report()` gave it.
pub struct Report {
    pub step: u64,
    pub loss: Loss,
    pub samples: usize,
    pub seq_len: usize,
    pub step_time_s: f64,
    pub lr: Option<f64>,
    pub grad_norm: Option<f64>,
    pub peak: Peak,
    /// A `headroom.plan`'s prediction for the step, to set beside its peak.
    pub planned_bytes: Option<u64>,
}

enum Job {
    Report(Report),
    /// Answered once every report before it is recorded.
    Flush(Sender<()>),
}

/// What the training thread and the reporter share.
#[derive(Default)]
struct Queue {
    jobs: Mutex<Vec<Job>>,
    stop: AtomicBool,
    /// A device tensor's loss read here that was NaN or infinite: the step and the value,
    /// for the training thread to raise at its next report.
    diverged: Mutex<Option<(u64, f64)>>,
    any_diverged: AtomicBool,
    said_peak_failed: AtomicBool,
}

/// How often the reporter looks for reports while they come, and at most how long it
/// sleeps once they stop. A report only appends to the queue: waking the thread for each
/// one (a futex call) cost more than the rest of the report on this machine's kernel.
const TICK: Duration = Duration::from_millis(1);
const IDLE_TICK: Duration = Duration::from_millis(20);

/// The thread that records reported steps.
pub struct Reporter {
    queue: Arc<Queue>,
    /// `None` when the thread could not be started (a hard cap leaves no room for its
    /// stack): each report is then recorded in place, as before.
    thread: Option<JoinHandle<()>>,
    session: Shared,
    limits: Limits,
}

/// What the records need besides the session.
#[derive(Clone, Copy)]
pub struct Limits {
    pub cuda: bool,
    /// The configured limit: the budget, host memory or the device's memory.
    pub limit: u64,
}

fn unpoisoned<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Reporter {
    pub fn start(session: Shared, limits: Limits) -> Reporter {
        // Unbounded: a report never waits for the disk or a viewer. The log writer and the
        // server already bound what they hold; this queue holds a step's figures only
        // until the next tick.
        let queue = Arc::new(Queue::default());
        let (shared, theirs) = (queue.clone(), session.clone());
        let thread = std::thread::Builder::new()
            .name("headroom-reporter".into())
            .spawn(move || record_all(&theirs, limits, &shared))
            .ok();
        Reporter {
            queue,
            thread,
            session,
            limits,
        }
    }

    /// The first diverged device loss not yet taken.
    pub fn take_diverged(&self) -> Option<(u64, f64)> {
        self.queue.any_diverged.store(false, Ordering::Relaxed);
        unpoisoned(&self.queue.diverged).take()
    }

    pub fn has_diverged(&self) -> bool {
        self.queue.any_diverged.load(Ordering::Relaxed)
    }

    pub fn report(&self, r: Report) {
        if self.thread.is_some() {
            unpoisoned(&self.queue.jobs).push(Job::Report(r));
        } else {
            record_one(&self.session, self.limits, &self.queue, r);
        }
    }

    /// Waits until every report so far is recorded (before anything that reads or resets
    /// the peak on the caller's thread, or ends the run).
    pub fn flush(&self) {
        let Some(thread) = &self.thread else { return };
        let (ack_tx, ack_rx) = bounded(1);
        unpoisoned(&self.queue.jobs).push(Job::Flush(ack_tx));
        thread.thread().unpark();
        let _ = ack_rx.recv();
    }

    /// Records what is queued and ends the thread.
    pub fn stop(&mut self) {
        self.queue.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.stop();
    }
}

fn record_all(session: &Shared, limits: Limits, queue: &Queue) {
    let mut tick = TICK;
    loop {
        // Read before the queue: a stop seen here finds every report made before it.
        let stopping = queue.stop.load(Ordering::SeqCst);
        let jobs = std::mem::take(&mut *unpoisoned(&queue.jobs));
        tick = if jobs.is_empty() {
            (tick * 2).min(IDLE_TICK)
        } else {
            TICK
        };
        for job in jobs {
            match job {
                Job::Report(r) => record_one(session, limits, queue, r),
                Job::Flush(ack) => {
                    let _ = ack.send(());
                }
            }
        }
        if stopping {
            return;
        }
        std::thread::park_timeout(tick);
    }
}

fn record_one(session: &Shared, limits: Limits, queue: &Queue, r: Report) {
    // Python first, the session's lock after: the training thread takes that lock while
    // it holds the GIL.
    let (peak, loss) = read(&r);
    if matches!(r.loss, Loss::Tensor(_)) && !loss.is_finite() {
        unpoisoned(&queue.diverged).get_or_insert((r.step, loss));
        queue.any_diverged.store(true, Ordering::Relaxed);
    }
    let peak = peak.unwrap_or_else(|e| {
        if !queue.said_peak_failed.swap(true, Ordering::Relaxed) {
            lock(session).notice(
                Level::Warn,
                "memory",
                format!("a step's peak could not be read ({e}); the resident set stands for it"),
            );
        }
        procmem::rss_bytes().unwrap_or(0)
    });
    record(&mut lock(session), limits, &r, loss, peak);
}

/// The step's peak and its loss (NaN when a tensor could not be read).
fn read(r: &Report) -> (Result<u64, String>, f64) {
    let peak = match &r.peak {
        Peak::Rss => {
            let peak = procmem::peak_rss_bytes();
            // Where the kernel refuses the reset (`clear_refs`), a peak is the process's
            // so far, as Python's meter then says too.
            let _ = procmem::reset_peak_rss();
            peak
        }
        Peak::Python(f) => Python::attach(|py| {
            f.call0(py)
                .and_then(|v| v.extract::<u64>(py))
                .map_err(|e| e.to_string())
        }),
    };
    let loss = match &r.loss {
        Loss::Value(v) => *v,
        Loss::Tensor(t) => Python::attach(|py| {
            t.call_method0(py, "item")
                .and_then(|v| v.extract::<f64>(py))
                .unwrap_or(f64::NAN)
        }),
    };
    (peak, loss)
}

/// A watch-only step's records: its memory, the plan's check, its figures.
pub fn record(s: &mut Session, limits: Limits, r: &Report, loss: f64, peak_bytes: u64) {
    let limit = if limits.cuda {
        limits.limit
    } else {
        procmem::current_cpu_limit(limits.limit)
    };
    let peak = StepPeak {
        step: r.step,
        micro_batch: r.samples,
        seq_len: r.seq_len,
        peak_bytes,
        predicted_bytes: None,
        limit_bytes: limit,
        configured_limit_bytes: limits.limit,
    };
    s.measured(Measured {
        step: r.step,
        peak_bytes,
        micro_batch: r.samples,
        seq_len: r.seq_len,
    });
    s.step_memory(peak);
    s.observe(peak);
    if let Some(planned_bytes) = r.planned_bytes {
        s.plan_check(headroom_core::PlanCheck {
            step: r.step,
            micro_batch: r.samples,
            planned_bytes,
            peak_bytes,
        });
    }
    s.step_done(StepDone {
        step: r.step,
        loss,
        lr: r.lr,
        grad_norm: r.grad_norm,
        micro_batch: r.samples,
        effective_batch: r.samples,
        seq_len: r.seq_len,
        step_time_s: r.step_time_s,
        tokens: (r.samples * r.seq_len) as u64,
    });
}
