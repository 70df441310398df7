//! What a rule proposes. The rules (decision.rs, reflexes.rs) read the controller's
//! [`State`](super::state::State) and return moves; the controller applies them in order
//! (`Controller::apply`, controller.rs), the one place the state is written and the
//! decisions are made. A move carries what the rule decided (the size, the reason, the
//! usage it acted on); what only the write itself can tell (where a clamp lands, the
//! prediction for the size it lands at) is worked out as it is applied.
use super::evidence::PendingShrink;
use super::messages::ResizeReason;
use super::state::{HoldReason, Probe};

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Move {
    /// Any change of size, to `to` clamped to the allowed range: a growth, a pin, an OOM's
    /// retry size, a forecast's step down. The decision's prediction is for sequences of
    /// `predict_at` (else the length the horizon plans for).
    Resize {
        to: usize,
        reason: ResizeReason,
        usage: f64,
        predict_at: Option<usize>,
    },
    /// A shrink for `usage` measured (or, `first` false, forecast) at the size in force
    /// with sequences of `seq_len`: at most to half, at least by one; `judge` says how the
    /// next reading judges it.
    Shrink {
        to: usize,
        reason: ResizeReason,
        usage: f64,
        seq_len: usize,
        first: bool,
        judge: Judge,
        predict_at: Option<usize>,
    },
    /// Grow by one sequence past what the estimate can promise (see [`Probe`]).
    Probe { to: usize, usage: f64, kind: Probe },
    /// What the next reading at the size in force judges (`None`: nothing).
    Expect(Option<PendingShrink>),
    /// Lower the ceiling to `tokens` (never below one sequence of the planned length).
    LearnCeiling {
        micro_batch: usize,
        tokens: u64,
        seq_len: usize,
        usage: f64,
    },
    /// Free the allocator's cache.
    EmptyCache { usage: f64 },
    /// Say something; `once`: the warning above warning, said once per size.
    Warn {
        usage: f64,
        forecast: bool,
        text: String,
        once: bool,
    },
    /// Growth holds at `at`, and says why (once per size; once per run for the fixed part).
    Hold {
        why: HoldReason,
        at: usize,
        step: u64,
        usage: f64,
        text: String,
    },
    /// The footprint drifted: the readings describe the old one and are forgotten.
    ForgetReadings,
    /// The streak over target sits within the size's own scatter: it is not drift.
    StreakIsNoise,
    /// Readings in a row that showed plain room at the planned length (regrowth).
    RoomReadings(u32),
    /// A shrink did not lower usage: the memory is held apart from the batch. Its readings
    /// are forgotten, and the size it reached says nothing about the sizes above.
    HeldApart,
    /// An OOM: the micro-batch unpins, and no reading judges a shrink or a growth.
    OomSeen,
    /// Retry the size that ran out of memory once: it had run cleanly many times.
    RetrySame { micro_batch: usize, seq_len: usize },
    /// The retried size failed again: the memory outside the batch grew by `bytes` (or the
    /// limit fell by it, or neither). The readings to come judge it ([`OutsideMove`]).
    ///
    /// [`OutsideMove`]: super::state::OutsideMove
    OutsideGrew { bytes: f64 },
    /// A reading saw the memory the fixed part was moved up for: the move stands.
    OutsideSeen,
    /// A reading did not see it (it read the fit as it was before the move): one more in
    /// a row, kept out of the fit.
    OutsideUnseen,
    /// Readings in a row did not see it: the fixed part moves back by `bytes`.
    OutsideBack { bytes: f64 },
    /// An OOM after a move was undone, before a size settled (or any OOM once that
    /// happened): the limit fell, silently, to `bytes` or below.
    LimitFell { bytes: u64 },
    /// The OOM is taken as the batch's: `micro_batch` is the size in force until the
    /// retry size is chosen, and memory held apart from the batch has let go.
    OomAt { micro_batch: usize },
}

/// How the reading after a shrink judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Judge {
    /// Whether usage followed, by what the estimate expected.
    Next,
    /// As `Next`, planned on the fitted cost (before the readings were forgotten).
    Fitted,
    /// Not at all: it made room for a longer length, and the next step is shorter.
    /// Growth waits for that length.
    Ahead,
}

/// What a rule proposes after a reading: its moves, and whether they settle the step
/// (no later rule is asked).
#[derive(Debug, Default)]
pub(super) struct Proposal {
    pub moves: Vec<Move>,
    pub settles: bool,
}

impl Proposal {
    pub fn settle(moves: Vec<Move>) -> Proposal {
        Proposal {
            moves,
            settles: true,
        }
    }
    pub fn pass(moves: Vec<Move>) -> Proposal {
        Proposal {
            moves,
            settles: false,
        }
    }
}
