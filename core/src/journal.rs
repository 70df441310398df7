//! The controller's inputs, kept so a resume can rebuild its state.
//!
//! The controller is a pure function of the calls the trainer makes on it (observations,
//! OOMs, the limit, commands), but its state has no serialised form of its own. A resumed
//! run that started a fresh controller at the saved micro-batch relearned what the
//! uninterrupted run already knew (a ceiling an OOM taught, the sizes it measured) and
//! split its steps differently: equal losses to rounding, not to the bit. So every call
//! that changes the controller goes through [`Journaled`], which records it; the record
//! goes into the checkpoint's state.json (the Python package's: `run.state_dict()`), and a
//! resume replays it into a new controller built as the first one was. About 75 bytes of JSON per step (measured: 3060 bytes
//! after 40 steps of the tiny test model), so 7.5 MB after 100 000 steps.
use std::ops::Deref;

use crate::policy::{
    Controller, ControllerConfig, Decision, OomOutcome, StepObservation, ThresholdError,
    Thresholds, Upcoming,
};
use serde::{Deserialize, Serialize};

/// How the controller was built and every call that changed it since, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerJournal {
    /// The limit it was built with (the resolved budget, host or device memory).
    pub limit: u64,
    /// The micro-batch it started at.
    pub start_micro_batch: usize,
    pub thresholds: Thresholds,
    pub calls: Vec<Call>,
}

/// One call on the controller. Short tags: a long run records one of each per step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Call {
    /// `set_baseline(bytes)`.
    #[serde(rename = "b")]
    Baseline(u64),
    /// `set_limit(bytes)`.
    #[serde(rename = "l")]
    Limit(u64),
    /// `before_step_ahead(seq_len, Upcoming { seq_len, step })`.
    #[serde(rename = "a")]
    Ahead(usize, usize, u64),
    /// `before_step(seq_len)` (no horizon: the Python package's loops).
    #[serde(rename = "s")]
    Before(usize),
    /// `observe(StepObservation { step, micro_batch, seq_len, peak_bytes })`.
    #[serde(rename = "o")]
    Observe(u64, usize, usize, u64),
    /// `on_oom(micro_batch, seq_len)`.
    #[serde(rename = "m")]
    Oom(usize, usize),
    /// `pin(micro_batch)`.
    #[serde(rename = "p")]
    Pin(usize),
    #[serde(rename = "u")]
    Unpin,
    /// `set_thresholds(t)` (accepted ones only: a refused call changes nothing).
    #[serde(rename = "t")]
    Thresholds(Thresholds),
    /// `eval_size(asked, seq_len)`.
    #[serde(rename = "es")]
    EvalSize(usize, usize),
    /// `eval_measured(size, seq_len, peak_bytes)`.
    #[serde(rename = "em")]
    EvalMeasured(usize, usize, u64),
    /// `eval_oom(size, seq_len)`.
    #[serde(rename = "eo")]
    EvalOom(usize, usize),
}

/// A controller whose changing calls are recorded. Reading calls reach the controller
/// itself through `Deref`; a changing call not wrapped here does not compile.
#[derive(Debug, Clone)]
pub struct Journaled {
    controller: Controller,
    journal: ControllerJournal,
}

impl Deref for Journaled {
    type Target = Controller;
    fn deref(&self) -> &Controller {
        &self.controller
    }
}

impl Journaled {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit: u64,
        micro_batch: usize,
    ) -> Journaled {
        Journaled {
            controller: Controller::new(cfg, thresholds, limit, micro_batch),
            journal: ControllerJournal {
                limit,
                start_micro_batch: micro_batch,
                thresholds,
                calls: Vec::new(),
            },
        }
    }

    /// The controller a run with `journal` had: built the same way, every call replayed
    /// (their decisions were carried out then, and are dropped now).
    pub fn replay(cfg: ControllerConfig, journal: &ControllerJournal) -> Journaled {
        let mut c = Journaled::new(
            cfg,
            journal.thresholds,
            journal.limit,
            journal.start_micro_batch,
        );
        for call in &journal.calls {
            c.call(*call);
        }
        c
    }

    pub fn journal(&self) -> &ControllerJournal {
        &self.journal
    }

    fn call(&mut self, call: Call) {
        match call {
            Call::Baseline(b) => self.set_baseline(b),
            Call::Limit(l) => self.set_limit(l),
            Call::Ahead(seq, seq_len, step) => {
                self.before_step_ahead(seq, Upcoming { seq_len, step });
            }
            Call::Before(seq) => {
                self.before_step(seq);
            }
            Call::Observe(step, micro_batch, seq_len, peak_bytes) => {
                self.observe(StepObservation {
                    step,
                    micro_batch,
                    seq_len,
                    peak_bytes,
                });
            }
            Call::Oom(mb, seq) => {
                self.on_oom(mb, seq);
            }
            Call::Pin(n) => {
                self.pin(n);
            }
            Call::Unpin => self.unpin(),
            Call::Thresholds(t) => {
                // Recorded only once accepted: a replay accepts it again.
                let _ = self.set_thresholds(t);
            }
            Call::EvalSize(asked, seq) => {
                self.eval_size(asked, seq);
            }
            Call::EvalMeasured(size, seq, peak) => self.eval_measured(size, seq, peak),
            Call::EvalOom(size, seq) => {
                self.eval_oom(size, seq);
            }
        }
    }

    pub fn set_baseline(&mut self, bytes: u64) {
        self.controller.set_baseline(bytes);
        self.journal.calls.push(Call::Baseline(bytes));
    }

    pub fn set_limit(&mut self, bytes: u64) {
        self.controller.set_limit(bytes);
        self.journal.calls.push(Call::Limit(bytes));
    }

    pub fn before_step_ahead(&mut self, seq_len: usize, upcoming: Upcoming) -> Vec<Decision> {
        self.journal
            .calls
            .push(Call::Ahead(seq_len, upcoming.seq_len, upcoming.step));
        self.controller.before_step_ahead(seq_len, upcoming)
    }

    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        self.journal.calls.push(Call::Before(seq_len));
        self.controller.before_step(seq_len)
    }

    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        self.journal.calls.push(Call::Observe(
            obs.step,
            obs.micro_batch,
            obs.seq_len,
            obs.peak_bytes,
        ));
        self.controller.observe(obs)
    }

    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        self.journal.calls.push(Call::Oom(micro_batch, seq_len));
        self.controller.on_oom(micro_batch, seq_len)
    }

    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        self.journal.calls.push(Call::Pin(n));
        self.controller.pin(n)
    }

    pub fn unpin(&mut self) {
        self.journal.calls.push(Call::Unpin);
        self.controller.unpin();
    }

    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        self.controller.set_thresholds(t)?;
        self.journal.calls.push(Call::Thresholds(t));
        Ok(())
    }

    pub fn eval_size(&mut self, asked: usize, seq_len: usize) -> (usize, Vec<Decision>) {
        self.journal.calls.push(Call::EvalSize(asked, seq_len));
        self.controller.eval_size(asked, seq_len)
    }

    pub fn eval_measured(&mut self, size: usize, seq_len: usize, peak_bytes: u64) {
        self.journal
            .calls
            .push(Call::EvalMeasured(size, seq_len, peak_bytes));
        self.controller.eval_measured(size, seq_len, peak_bytes);
    }

    pub fn eval_oom(&mut self, size: usize, seq_len: usize) -> (Option<usize>, Decision) {
        self.journal.calls.push(Call::EvalOom(size, seq_len));
        self.controller.eval_oom(size, seq_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replayed journal is the controller it recorded: same size, same forecasts, and
    /// the same answer to the next reading; a fresh one at the same size answers otherwise.
    #[test]
    fn a_replayed_journal_answers_as_the_controller_it_recorded() {
        let cfg = ControllerConfig {
            max_micro_batch: 64,
            max_seq_len: 32,
            ..ControllerConfig::default()
        };
        let gib = 1u64 << 30;
        let mut c = Journaled::new(cfg.clone(), Thresholds::default(), 8 * gib, 8);
        c.set_baseline(gib);
        let ahead = |step| Upcoming { seq_len: 32, step };
        // A step at 8 MiB per sequence over a 1 GiB baseline.
        let run = |c: &mut Journaled, step: u64| {
            c.before_step_ahead(32, ahead(step));
            c.set_limit(8 * gib);
            let mb = c.micro_batch();
            c.observe(StepObservation {
                step,
                micro_batch: mb,
                seq_len: 32,
                peak_bytes: gib + mb as u64 * (8 << 20),
            })
        };
        run(&mut c, 1);
        run(&mut c, 2);
        // An OOM teaches a ceiling a fresh controller would not know.
        let mb = c.micro_batch();
        c.on_oom(mb, 32);
        run(&mut c, 3);
        let json = serde_json::to_string(c.journal()).unwrap();
        let journal: ControllerJournal = serde_json::from_str(&json).unwrap();
        assert_eq!(&journal, c.journal());
        let mut replayed = Journaled::replay(cfg.clone(), &journal);
        assert_eq!(replayed.micro_batch(), c.micro_batch());
        assert_eq!(replayed.journal(), c.journal());
        let mut fresh = Journaled::new(cfg, Thresholds::default(), 8 * gib, c.micro_batch());
        fresh.set_baseline(gib);
        // Steps 4 to 7 at the same cost, on each.
        let sizes = |c: &mut Journaled| -> Vec<usize> {
            (4..8)
                .map(|step| {
                    run(c, step);
                    c.micro_batch()
                })
                .collect()
        };
        let (a, b, f) = (sizes(&mut c), sizes(&mut replayed), sizes(&mut fresh));
        assert_eq!(a, b, "the replayed controller decides as the original");
        assert_ne!(a, f, "a fresh controller forgets the ceiling");
    }
}
