//! The batch controller: a pure policy from step observations and thresholds to
//! [`Decision`]s. The trainer applies them at step boundaries and logs every one.
//!
//! It works in tokens (micro-batch × sequence length), and asks four questions, one module
//! each (docs/CONTROLLER.md draws the whole):
//! - what memory costs: [`Estimate`](super::estimate::Estimate), the peak at (micro-batch,
//!   length) and how sure;
//! - what a reading means: [`Evidence`](super::evidence::Evidence), the first step, a
//!   shrink that did or did not lower usage, a growth that overshot, drift, ceilings;
//! - what to do: [`decision`](super::decision), grow, hold or shrink under target less
//!   the margin, for the length the [`Horizon`](super::horizon::Horizon) plans for;
//! - the reflexes that need no model: [`reflexes`](super::reflexes), critical, emergency,
//!   an OOM and its retry.
//!
//! This file holds the state they share and the calls the trainer makes. No decision but
//! an OOM takes the micro-batch below half of what it was, and a pinned micro-batch is
//! never resized except by an OOM (which unpins it); the controller then only warns.
use serde::{Deserialize, Serialize};

use super::decision::Plan;
use super::estimate::Estimate;
pub use super::estimate::ERROR_WINDOW;
use super::evidence::{Evidence, PendingShrink};
use super::horizon::Horizon;
use super::memory_model::MemoryModel;
pub use super::messages::{Decision, OomOutcome, ResizeReason, StepObservation, Upcoming};
use super::reflexes::OomReflex;
use super::thresholds::{ThresholdError, Thresholds};

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
    /// the lengths to come ([`Controller::before_step_ahead`]).
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

#[derive(Debug, Clone)]
pub struct Controller {
    pub(super) cfg: ControllerConfig,
    pub(super) thresholds: Thresholds,
    pub(super) size: Size,
    pub(super) estimate: Estimate,
    pub(super) evidence: Evidence,
    pub(super) horizon: Horizon,
    pub(super) plan: Plan,
    pub(super) oom: OomReflex,
}

impl Controller {
    pub fn new(
        cfg: ControllerConfig,
        thresholds: Thresholds,
        limit_bytes: u64,
        micro_batch: usize,
    ) -> Controller {
        let mb = micro_batch.clamp(cfg.min_micro_batch.max(1), cfg.max_micro_batch.max(1));
        Controller {
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

    pub fn micro_batch(&self) -> usize {
        self.size.micro_batch
    }
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }
    pub fn limit_bytes(&self) -> u64 {
        self.estimate.limit_bytes()
    }
    pub fn model(&self) -> &MemoryModel {
        self.estimate.model()
    }
    pub fn ceiling_tokens(&self) -> Option<u64> {
        self.evidence.ceiling.tokens()
    }
    pub fn is_pinned(&self) -> bool {
        self.size.pinned
    }
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }
    pub fn baseline(&self) -> Option<u64> {
        self.estimate.baseline()
    }

    /// Replaces the thresholds if valid; a rejected set leaves the old ones in force.
    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        self.thresholds.set(t)?;
        self.plan.warned = false;
        Ok(())
    }

    /// Memory in use before the first step, once the model (and, if the trainer creates
    /// it up front, the optimizer state) exists. The fixed part of a step's peak is at
    /// least this (gradients and workspace come on top), so with one size measured the
    /// line through it over-predicts larger sizes: growth can go as far as that line
    /// allows instead of stalling on a proportional guess.
    pub fn set_baseline(&mut self, bytes: u64) {
        self.estimate.set_baseline(bytes);
    }

    /// The limit usage is measured against, when it moves during a run (the trainer passes
    /// min(configured, available) each step).
    pub fn set_limit(&mut self, bytes: u64) {
        if self.estimate.set_limit(bytes) {
            self.plan.warned = false;
        }
    }

    /// True after a shrink that did not lower usage, until usage falls under target.
    pub fn is_unresponsive(&self) -> bool {
        self.evidence.shrink.is_unresponsive()
    }

    /// Predicted peak bytes of `micro_batch` sequences of `seq_len`.
    pub fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        self.estimate.predicted_bytes(micro_batch, seq_len)
    }

    /// Predicted usage (fraction of the limit) of `micro_batch` sequences of `seq_len`.
    pub fn predicted_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        self.estimate.predicted_usage(micro_batch, seq_len)
    }

    /// The share of the limit kept free below target for the model's own error.
    pub fn margin(&self) -> f64 {
        self.estimate.margin()
    }

    /// Pins the micro-batch to `n` (clamped to the allowed range); the controller then
    /// only warns.
    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        let to = n.clamp(self.floor(), self.cap());
        self.size.pinned = true;
        self.resize(to, ResizeReason::Pinned, 0.0)
            .into_iter()
            .collect()
    }

    pub fn unpin(&mut self) {
        self.size.pinned = false;
        self.size.steps_at_size = 0;
    }

    /// The forecast for the next step, whose sequences are `seq_len` long: shrinks (or,
    /// pinned, warns) when it is predicted above warning. Plans growth for the configured
    /// longest length.
    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        self.forecast(seq_len, None)
    }

    /// As [`before_step`](Self::before_step), told the longest sequence within the
    /// trainer's horizon of upcoming steps: growth is planned for what is actually coming,
    /// and the micro-batch shrinks before a longer length arrives rather than when it
    /// does.
    pub fn before_step_ahead(&mut self, seq_len: usize, upcoming: Upcoming) -> Vec<Decision> {
        self.forecast(seq_len, Some(upcoming))
    }

    /// Feeds one successful step's measurement; returns what to change.
    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        let mut out = Vec::new();
        let r = self.read(obs, &mut out);
        if !self.reflexes(&r, &mut out) {
            self.decide(&r, &mut out);
        }
        out
    }

    pub(super) fn cap(&self) -> usize {
        self.cfg.max_micro_batch.max(1)
    }
    pub(super) fn floor(&self) -> usize {
        self.cfg.min_micro_batch.max(1)
    }
    /// Whether the rules may resize at all (pinned or not adaptive: they only warn).
    pub(super) fn may_resize(&self) -> bool {
        self.cfg.adaptive && !self.size.pinned
    }

    /// The model's largest micro-batch predicted under target (less the margin).
    pub(super) fn fit_target(&self, seq_len: usize) -> Option<usize> {
        self.estimate
            .fit_under(self.thresholds.target - self.margin(), seq_len, false)
    }

    /// The smallest size one decision may take `micro_batch` to, except after an OOM.
    pub(super) fn half_of(&self, micro_batch: usize) -> usize {
        micro_batch.div_ceil(2).max(self.floor())
    }

    /// Lowers the ceiling to `tokens` (never below one sequence of the planned length) if
    /// that is lower; the decision when it changed.
    pub(super) fn learn_ceiling(
        &mut self,
        micro_batch: usize,
        tokens: u64,
        seq_len: usize,
        usage: f64,
    ) -> Option<Decision> {
        let longest = self.horizon.plan_seq(seq_len).max(self.cfg.max_seq_len);
        let one = (self.floor() * longest) as u64 + 1;
        self.evidence.ceiling.learn(micro_batch, tokens, one, usage)
    }

    pub(super) fn resize(
        &mut self,
        to: usize,
        reason: ResizeReason,
        usage: f64,
    ) -> Option<Decision> {
        let to = to.clamp(self.floor(), self.cap());
        if to == self.size.micro_batch {
            return None;
        }
        let from = self.size.micro_batch;
        self.size.micro_batch = to;
        self.size.steps_at_size = 0;
        self.size.shrunk_to_fit =
            to < from && !matches!(reason, ResizeReason::Oom | ResizeReason::Emergency);
        self.evidence.over_target = 0;
        self.evidence.shrink.resized(to > from);
        self.evidence.grown_from = (to > from && reason == ResizeReason::Grow).then_some(from);
        self.plan.warned = false;
        self.plan.probe.resized();
        let seq = self.horizon.plan_seq(0);
        Some(Decision::Resize {
            from,
            to,
            reason,
            usage,
            predicted: self.predicted_usage(to, seq),
        })
    }

    /// A shrink for usage measured (or, `first` false, forecast) at the size in force with
    /// sequences of `seq_len`: at most to half, at least by one, judged by the next
    /// reading.
    pub(super) fn shrink(
        &mut self,
        to: usize,
        reason: ResizeReason,
        usage: f64,
        seq_len: usize,
        first: bool,
    ) -> Option<Decision> {
        let from = self.size.micro_batch;
        let to = to.clamp(self.half_of(from), from.saturating_sub(1).max(1));
        let d = self.resize(to, reason, usage)?;
        self.evidence.shrink.expect(Some(PendingShrink {
            from,
            before: usage,
            seq_len,
            guessed: !self.estimate.is_fitted(),
            first,
        }));
        Some(d)
    }
}
