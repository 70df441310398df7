//! Decision traces: every call into the controller, with its inputs, the decisions it
//! returned and the state the trainer reads after it, folded into one hash per run. The
//! recorded hashes are kept in `core/tests/traces/`; a test replays the same runs and
//! compares, run by run, so any change of behaviour (a decision, a number in one, a step
//! it comes at) fails it.
//!
//! To re-record after a change of behaviour that is meant (a separate commit, with the
//! simulator table in docs/BENCHMARKS.md measured again):
//! `HEADROOM_TRACE_RECORD=1 cargo test -p headroom-core --release --test <name> -- --nocapture`
//! prints `TRACE <key> <hash>` lines instead of checking; sort them into the file.
//! `HEADROOM_TRACE_DUMP=<dir>` also writes each run's full trace, one file per key, to
//! diff against a dump from the recorded commit.
#![allow(dead_code)]
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Debug;
use std::ops::Deref;
use std::rc::Rc;

use headroom_core::policy::{
    Controller, ControllerConfig, Decision, OomOutcome, StepObservation, ThresholdError,
    Thresholds, Upcoming,
};

/// FNV-1a over the trace's text, and the text itself when dumping.
#[derive(Debug, Clone)]
pub struct TraceHash {
    hash: u64,
    calls: u64,
    text: Option<String>,
}

impl Default for TraceHash {
    fn default() -> Self {
        TraceHash {
            hash: 0xcbf2_9ce4_8422_2325,
            calls: 0,
            text: dump_dir().map(|_| String::new()),
        }
    }
}

impl TraceHash {
    /// Adds one line of the trace.
    pub fn line(&mut self, line: &str) {
        self.calls += 1;
        for b in line.bytes().chain([b'\n']) {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
        }
        if let Some(t) = &mut self.text {
            t.push_str(line);
            t.push('\n');
        }
    }

    pub fn hex(&self) -> String {
        format!("{:016x}", self.hash)
    }

    /// Writes the full text under `HEADROOM_TRACE_DUMP`, when set.
    pub fn dump(&self, key: &str) {
        if let (Some(dir), Some(text)) = (dump_dir(), &self.text) {
            let name: String = key
                .chars()
                .map(|c| if c.is_alphanumeric() { c } else { '_' })
                .collect();
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(format!("{dir}/{name}.txt"), text).unwrap();
        }
    }
}

fn dump_dir() -> Option<String> {
    std::env::var("HEADROOM_TRACE_DUMP").ok()
}

/// Record mode: print the hashes rather than check them.
pub fn recording() -> bool {
    std::env::var("HEADROOM_TRACE_RECORD").is_ok()
}

/// The recorded hashes of `file` (under `core/tests/traces/`), by key.
pub fn recorded(file: &str) -> HashMap<String, String> {
    let path = format!("{}/tests/traces/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, h)| (k.to_string(), h.to_string()))
        .collect()
}

/// Compares `runs` (key, hash) with the recorded ones in `file`; in record mode prints
/// them. Returns the keys that differ or were never recorded.
pub fn compare(file: &str, runs: &[(String, String)]) -> Vec<String> {
    if recording() {
        for (k, h) in runs {
            println!("TRACE {k} {h}");
        }
        return Vec::new();
    }
    let want = recorded(file);
    runs.iter()
        .filter(|(k, h)| want.get(k) != Some(h))
        .map(|(k, h)| format!("{k}: {h} (recorded {:?})", want.get(k)))
        .collect()
}

thread_local! {
    /// The traces of the controllers this test thread created, in creation order.
    /// `None` outside a [`TestTrace`] (the simulator's runs check their own traces).
    static RUNS: RefCell<Option<Vec<Rc<RefCell<TraceHash>>>>> = const { RefCell::new(None) };
}

/// Checks, when dropped at the end of a test (not while it panics), the traces of every
/// [`Traced`] controller the test created against `unit.txt` under the test's `name`.
pub struct TestTrace(&'static str);

pub fn test_trace(name: &'static str) -> TestTrace {
    RUNS.with(|r| *r.borrow_mut() = Some(Vec::new()));
    TestTrace(name)
}

impl Drop for TestTrace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let runs: Vec<(String, String)> = RUNS.with(|r| {
            r.borrow_mut()
                .take()
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let key = format!("{} {i}", self.0);
                    t.borrow().dump(&key);
                    (key, t.borrow().hex())
                })
                .collect()
        });
        let bad = compare("unit.txt", &runs);
        assert!(bad.is_empty(), "decision traces changed: {bad:#?}");
    }
}

/// A [`Controller`] whose every call is traced. Reading methods come through `Deref`;
/// every method that changes the controller is wrapped here (there is no `DerefMut`, so
/// one that is not cannot be called by mistake).
pub struct Traced {
    c: Controller,
    trace: Rc<RefCell<TraceHash>>,
}

impl Deref for Traced {
    type Target = Controller;
    fn deref(&self) -> &Controller {
        &self.c
    }
}

impl Traced {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit_bytes: u64,
        micro_batch: usize,
    ) -> Traced {
        let trace = Rc::new(RefCell::new(TraceHash::default()));
        RUNS.with(|r| {
            if let Some(runs) = r.borrow_mut().as_mut() {
                runs.push(trace.clone());
            }
        });
        let t = Traced {
            c: Controller::new(cfg.clone(), thresholds, limit_bytes, micro_batch),
            trace,
        };
        // A field added after the traces were recorded is left out, so a run whose
        // decisions it does not change keeps its recorded hash (the decisions are hashed).
        let cfg_text = format!("{cfg:?}")
            .replace(", heap_fragments: false", "")
            .replace(", heap_fragments: true", "");
        t.log(
            &format!("new {cfg_text} {thresholds:?} {limit_bytes} {micro_batch}"),
            &(),
        );
        t
    }

    /// One call: what went in, what came out, and what the trainer reads after it.
    fn log(&self, call: &str, out: &impl Debug) {
        let c = &self.c;
        self.trace.borrow_mut().line(&format!(
            "{call} -> {out:?} | mb {} margin {:?} ceiling {:?} unresponsive {} pinned {}",
            c.micro_batch(),
            c.margin(),
            c.ceiling_tokens(),
            c.is_unresponsive(),
            c.is_pinned()
        ));
    }

    pub fn set_baseline(&mut self, bytes: u64) {
        self.c.set_baseline(bytes);
        self.log(&format!("baseline {bytes}"), &());
    }

    pub fn set_limit(&mut self, bytes: u64) {
        self.c.set_limit(bytes);
        self.log(&format!("limit {bytes}"), &());
    }

    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        let r = self.c.set_thresholds(t);
        self.log(&format!("thresholds {t:?}"), &r);
        r
    }

    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        let ds = self.c.before_step(seq_len);
        self.log(&format!("before {seq_len}"), &ds);
        ds
    }

    pub fn before_step_ahead(&mut self, seq_len: usize, up: Upcoming) -> Vec<Decision> {
        let ds = self.c.before_step_ahead(seq_len, up);
        self.log(&format!("before {seq_len} {up:?}"), &ds);
        ds
    }

    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        let ds = self.c.observe(obs);
        self.log(&format!("observe {obs:?}"), &ds);
        ds
    }

    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        let out = self.c.on_oom(micro_batch, seq_len);
        self.log(&format!("oom {micro_batch} {seq_len}"), &out);
        out
    }

    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        let ds = self.c.pin(n);
        self.log(&format!("pin {n}"), &ds);
        ds
    }

    pub fn unpin(&mut self) {
        self.c.unpin();
        self.log("unpin", &());
    }

    /// This run's trace so far.
    pub fn trace(&self) -> TraceHash {
        self.trace.borrow().clone()
    }
}
