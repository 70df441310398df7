//! What the controller keeps between calls: its configuration and thresholds, the size in
//! force, and one value of each question's state. The rules (decision.rs, reflexes.rs)
//! read a [`State`] and propose [`Move`](super::moves::Move)s; only the controller
//! (controller.rs) writes it.
use serde::{Deserialize, Serialize};

use super::estimate::Estimate;
use super::evidence::Evidence;
use super::horizon::Horizon;
use super::thresholds::Thresholds;

/// How far a process's resident set scatters from step to step at one size (the default
/// [`ControllerConfig::reading_noise`]). With one size measured, its reading is taken this
/// much higher: a low one would under-state what a token costs.
pub const RSS_NOISE: f64 = 0.02;
/// The same for a CUDA allocator's peak plus the memory outside it, which repeats to the
/// byte at one size (docs/GPU.md: 88.2% at every step after settling); the share left is
/// for what moves outside the allocator (cuBLAS workspaces, the context).
pub const ALLOCATOR_NOISE: f64 = 0.005;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerConfig {
    pub min_micro_batch: usize,
    pub max_micro_batch: usize,
    /// Off: the micro-batch never changes except after an OOM; warnings still come.
    pub adaptive: bool,
    /// Largest factor of one growth once the model is fitted.
    pub max_growth: f64,
    /// Largest factor of one growth while only one size has been measured and no
    /// baseline was given.
    pub probe_growth: f64,
    /// Grow only when the new size is at least this share larger (hysteresis).
    pub min_gain: f64,
    /// Steps measured at a size before growing from it.
    pub patience: u32,
    /// Clean steps after which a learned ceiling is raised by 10% (forgotten slowly).
    pub forget_every: u64,
    /// Longest sequence the run feeds: growth is planned for it unless the trainer tells
    /// the lengths to come
    /// ([`Controller::before_step_ahead`](super::Controller::before_step_ahead)).
    pub max_seq_len: usize,
    /// Consecutive OOMs at the smallest micro-batch before giving up.
    pub max_ooms_at_min: u32,
    /// How far one step's reading may lie from the batch's own peak, as a share of it:
    /// what separates a difference between two sizes' readings from noise. A process's
    /// resident set scatters by up to 2% run to run; an allocator's peak repeats to the
    /// byte for the same shapes, and assuming 2% there costs growths that the readings
    /// never needed.
    pub reading_noise: f64,
    /// The readings count memory an allocator keeps fragmented beyond the batch's: a
    /// resident set over glibc's heap (a CPU run without a hard cap or an mmap
    /// threshold), which runs 5–16 points over what the batch needs and most at the
    /// longest lengths. Across lengths, the estimate then keeps the all-quadratic bound
    /// rather than a straight line the early readings follow.
    #[serde(default)]
    pub heap_fragments: bool,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            min_micro_batch: 1,
            max_micro_batch: usize::MAX,
            adaptive: true,
            max_growth: 8.0,
            probe_growth: 4.0,
            min_gain: 0.05,
            patience: 1,
            forget_every: 200,
            max_seq_len: 0,
            max_ooms_at_min: 3,
            reading_noise: RSS_NOISE,
            heap_fragments: false,
        }
    }
}

/// The size in force and what is known of it.
#[derive(Debug, Clone)]
pub(super) struct Size {
    pub micro_batch: usize,
    pub pinned: bool,
    /// Trusted readings at this size.
    pub steps_at_size: u32,
    /// Reached by shrinking to the model's fit (a reading over target or critical, a
    /// forecast): the readings said the sizes above it do not fit, so the one-size rules
    /// that take any gain (or one sequence more) to learn a second size do not apply to
    /// it. After the drift rule forgets the readings, they grew back by a sequence or two
    /// on the next step and undid the shrink. Halving after an OOM or an emergency is a
    /// guess, not such a judgement.
    pub shrunk_to_fit: bool,
}

/// A growth by one sequence past what the estimate can promise, until its first reading:
/// the forecast (that same worst case) must not take it back before it runs, or the run
/// grows and shrinks by one every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The worst case of the fixed part stays under critical.
    OneMore,
    /// The worst case reaches critical, but the step ran well under target: tried once
    /// per run, and undone by one if it reads critical or fails.
    Risk,
}

/// The probes: the one in force, and whether the risky one was spent.
#[derive(Debug, Clone, Default)]
pub struct Probes {
    pub in_flight: Option<Probe>,
    pub risk_spent: bool,
}

impl Probes {
    /// A reading came; `current`: at the probed size. True on the risky probe's first.
    pub fn read(&mut self, current: bool) -> bool {
        let risk = self.in_flight == Some(Probe::Risk) && current;
        if current {
            self.in_flight = None;
        }
        risk
    }
    pub fn resized(&mut self) {
        self.in_flight = None;
    }
    pub fn is_risk(&self) -> bool {
        self.in_flight == Some(Probe::Risk)
    }
}

/// Why growth holds, said once per size held at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// With one size measured the fixed part is not known (said once per run).
    FixedPartUnknown,
    /// A longer length is coming.
    LongerLength,
}

/// Growth held for a size shrunk ahead of a longer length.
#[derive(Debug, Clone, Default)]
pub struct Regrowth {
    /// The micro-batch shrank to make room for a length not yet measured: growth waits
    /// until that length has run, unless the model shows plain room.
    pub shrunk_ahead: bool,
    /// Consecutive readings after which the model showed plain room at the planned length
    /// (one reading moves a young fit by that much).
    pub room_readings: u32,
}

/// What the decisions remember: what was said, and what growth waits for.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// The warning above warning was given at this size.
    pub warned: bool,
    /// Why growth holds, said at which size. Not once per length: on a ramp the longest
    /// length in view grows every step, and a line per step would bury everything else.
    pub held: Option<(HoldReason, usize)>,
    /// The step whose reading said why growth holds: no growth at it or the next.
    pub held_at: Option<u64>,
    pub regrowth: Regrowth,
    pub probe: Probes,
}

impl Plan {
    pub fn say_held(&mut self, why: HoldReason, size: usize, step: u64) {
        self.held = Some((why, size));
        self.held_at = Some(step);
    }
}

/// What the OOM reflex remembers between calls.
#[derive(Debug, Clone, Default)]
pub struct OomReflex {
    /// Consecutive OOMs at the smallest micro-batch.
    ooms_at_min: u32,
    /// The OOM being retried at the same size (micro-batch, sequence length).
    pub retrying: Option<(usize, usize)>,
    /// The fixed part moved up after a retried size failed again, and what the readings
    /// since have said of it.
    pub outside: OutsideMove,
}

/// The fixed part moved up by `bytes` after a retried size failed again
/// ([`Move::OutsideGrew`](super::moves::Move::OutsideGrew)): the least memory that can
/// have grown outside the batch, or the least the limit can have fallen by unsaid, or
/// neither (a passing spike, a hard cap met by address space the heap keeps rather than by
/// resident memory). Readings tell the first from the other two; only an error at a size
/// grown back to tells the second from the third.
///
/// ```text
///           OutsideGrew              a reading sees it
/// Clear ───────────────► Pending ───────────────────────► Clear (the move stands)
///   ▲                       │ 10 readings in a row do not (under target): undone
///   │ a size grown back     ▼
///   └── settles ──────── Undone ──── an OOM before a size settles ───► LimitFell
///                                          (the limit in force falls to what the failed
///                                           size would have peaked at; so at every OOM)
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum OutsideMove {
    #[default]
    Clear,
    /// Moved by `bytes`; `unseen` readings in a row since read the fit as it was before.
    Pending { bytes: f64, unseen: u32 },
    /// Undone at micro-batch `at`: the readings did not see the memory.
    Undone { at: usize },
    /// An undone move was followed by an OOM before a size settled: the limit falls
    /// without the trainer's limit saying so, and errors teach it from now on.
    LimitFell,
}

impl OomReflex {
    /// A step ran: the retry (if any) worked, and the smallest size is not failing.
    pub fn read(&mut self) {
        self.retrying = None;
        self.ooms_at_min = 0;
    }

    /// The size in force is `micro_batch`, `steps` clean steps at it: a size grown back to
    /// after an undone move that settles shows the limit did not fall under it.
    pub fn ran(&mut self, micro_batch: usize, steps: u32, settled: u32) {
        if let OutsideMove::Undone { at } = self.outside {
            if micro_batch > at && steps >= settled {
                self.outside = OutsideMove::Clear;
            }
        }
    }

    /// Whether an undone move is still to be proved: an OOM now says the limit fell.
    pub fn undone(&self) -> bool {
        matches!(self.outside, OutsideMove::Undone { .. })
    }

    /// Another OOM at the smallest size: whether to retry it (`max` in a row give up).
    pub fn at_min(&mut self, max: u32) -> bool {
        self.ooms_at_min += 1;
        self.ooms_at_min < max
    }
}

/// Everything the rules read. Written only by the controller, as it applies their moves.
#[derive(Debug, Clone)]
pub(super) struct State {
    pub cfg: ControllerConfig,
    pub thresholds: Thresholds,
    pub size: Size,
    pub estimate: Estimate,
    pub evidence: Evidence,
    pub horizon: Horizon,
    pub plan: Plan,
    pub oom: OomReflex,
}

impl State {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit_bytes: u64,
        micro_batch: usize,
    ) -> State {
        let mb = micro_batch.clamp(cfg.min_micro_batch.max(1), cfg.max_micro_batch.max(1));
        State {
            estimate: Estimate::new(cfg.reading_noise, cfg.heap_fragments, limit_bytes),
            horizon: Horizon::new(cfg.max_seq_len),
            cfg,
            thresholds,
            size: Size {
                micro_batch: mb,
                pinned: false,
                steps_at_size: 0,
                shrunk_to_fit: false,
            },
            evidence: Evidence::default(),
            plan: Plan::default(),
            oom: OomReflex::default(),
        }
    }

    pub fn cap(&self) -> usize {
        self.cfg.max_micro_batch.max(1)
    }
    pub fn floor(&self) -> usize {
        self.cfg.min_micro_batch.max(1)
    }
    /// Whether the rules may resize at all (pinned or not adaptive: they only warn).
    pub fn may_resize(&self) -> bool {
        self.cfg.adaptive && !self.size.pinned
    }

    /// The share of the limit kept free below target for the model's own error.
    pub fn margin(&self) -> f64 {
        self.estimate.margin()
    }

    /// Predicted usage (fraction of the limit) of `micro_batch` sequences of `seq_len`.
    pub fn predicted_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        self.estimate.predicted_usage(micro_batch, seq_len)
    }

    /// The model's largest micro-batch predicted under target (less the margin).
    pub fn fit_target(&self, seq_len: usize) -> Option<usize> {
        self.estimate
            .fit_under(self.thresholds.target - self.margin(), seq_len, false)
    }

    /// The smallest size one decision may take `micro_batch` to, except after an OOM.
    pub fn half_of(&self, micro_batch: usize) -> usize {
        micro_batch.div_ceil(2).max(self.floor())
    }
}

/// What the rules' tests build their situations from.
#[cfg(test)]
pub(super) mod fixtures {
    use super::{ControllerConfig, State, Thresholds};
    use crate::policy::evidence::Reading;
    use crate::policy::messages::StepObservation;

    pub const LIMIT: u64 = 1 << 30;

    /// A fresh controller's state at `micro_batch`, default configuration and thresholds.
    pub fn state(micro_batch: usize) -> State {
        State::new(
            ControllerConfig::default(),
            Thresholds::default(),
            LIMIT,
            micro_batch,
        )
    }

    /// A reading at `micro_batch` sequences of 64, at the size in force, after the first
    /// step, at `usage` of the limit.
    pub fn reading(micro_batch: usize, usage: f64) -> Reading {
        Reading {
            obs: StepObservation {
                step: 9,
                micro_batch,
                seq_len: 64,
                peak_bytes: (usage * LIMIT as f64) as u64,
            },
            tokens: (micro_batch * 64) as u64,
            usage,
            first: false,
            current: true,
            risk_probed: false,
            after_first_shrink: false,
            grown_from: None,
            seq: 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_ends_with_its_first_reading_and_the_risky_one_says_so() {
        let mut p = Probes {
            in_flight: Some(Probe::Risk),
            ..Default::default()
        };
        assert!(!p.read(false), "a reading at another size");
        assert!(p.is_risk());
        assert!(p.read(true));
        assert!(!p.is_risk() && !p.read(true));
        p.in_flight = Some(Probe::OneMore);
        p.resized();
        assert_eq!(p.in_flight, None);
    }

    #[test]
    fn the_smallest_size_is_retried_until_max_ooms_in_a_row_and_a_step_resets_the_count() {
        let mut o = OomReflex::default();
        assert!(o.at_min(3));
        assert!(o.at_min(3));
        assert!(!o.at_min(3));
        o.read();
        assert!(o.at_min(3));
        o.retrying = Some((8, 64));
        o.read();
        assert_eq!(o.retrying, None);
    }

    #[test]
    fn an_undone_move_is_proved_by_a_size_grown_back_to_settling() {
        let mut o = OomReflex {
            outside: OutsideMove::Undone { at: 2 },
            ..Default::default()
        };
        // At the size it was undone at, or not yet settled above it: still to be proved.
        o.ran(2, 50, 5);
        o.ran(8, 4, 5);
        assert!(o.undone());
        o.ran(8, 5, 5);
        assert_eq!(o.outside, OutsideMove::Clear);
    }
}
