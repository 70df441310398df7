//! The batch controller: a pure policy from step observations and thresholds to
//! [`Decision`]s. The trainer applies them at step boundaries and logs every one.
//!
//! It works in tokens (micro-batch × sequence length): the memory model is fitted per
//! token, the learned ceiling is a token count, and growth is planned for the longest
//! sequence still to come: the longest within the trainer's horizon when it says
//! ([`Controller::before_step_ahead`]) and the lengths have only risen so far, else the
//! configured maximum (random lengths may bring it on any step), and never shorter than
//! the longest it has been told of (a horizon's own longest moves every step).
//!
//! The model is trusted only as far as it has been earned:
//! - the run's first step is not a reading of the footprint (optimizer state appears
//!   during it, so it peaks low); it can still trigger a shrink, never growth;
//! - with one size measured, the fixed part is the memory measured before the first step
//!   ([`Controller::set_baseline`]), which can only under-state it, and the reading is
//!   taken 2% high for noise: the line through both over-predicts every larger size, so
//!   growth along it is safe however far it goes. Without a baseline the line goes
//!   through zero and one growth is at most ×`probe_growth`; when even one more sequence
//!   is not predicted under target, one sequence more is probed if it is predicted under
//!   critical, else the controller says once why it holds;
//! - once fitted at one length, growth follows the line through the largest size measured
//!   with the steepest slope the readings allow when the sizes are too close for their
//!   difference to be more than noise (a slope taken from noise either overshoots or, when
//!   negative, stalls growth for good);
//! - once lengths vary, the cost of a token is fitted as a line in the length
//!   ([`MemoryModel::length_fit`]: attention makes long sequences cost more per token);
//!   for a length longer than any measured the line is extrapolated, never cheaper than
//!   the longest measured and never dearer than scaling it by the ratio of the lengths (as
//!   if all of it were quadratic). Until the lengths span enough to fit that, readings at
//!   (or nearest below) the length, scaled by that ratio, set the cost.
//!
//! Rules, in order, after each step (usage = peak / limit):
//! - usage ≥ critical: learn a ceiling and shrink to the model's fit under target, at
//!   least by one and at most to half (emergency: free cached memory too);
//! - the first reading after a growth over target: the growth overshot; back to the fit
//!   (not below where it came from) with a ceiling at the overshot size, at once rather
//!   than after the drift rule's six steps;
//! - usage above target (up to warning) for 3 steps in a row at one size: free cached
//!   memory; 3 more: shrink to the model's fit (at least by one, at most to half) and set
//!   a ceiling, since the footprint drifted rather than spiked;
//! - usage > warning: warn once (growth stops);
//! - usage < target, `patience` steps measured at this size: grow to the model's fit under
//!   target (at most ×`max_growth` once fitted), never to or above the learned ceiling,
//!   and only when the gain is at least `min_gain` (hysteresis: between target and
//!   critical nothing moves, so a steady state never oscillates).
//!
//! No decision but an OOM takes the micro-batch below half of what it was: a step's
//! reading is one number, and when memory stops following the batch (a cache, retained
//! heap pages, another process) a model fitted through it would take the run to the
//! minimum. An OOM at a size that has run cleanly many times is not the batch's doing: the
//! same size is retried once before anything is learned.
//!
//! A step at or above critical also sets a ceiling: with a non-negative fixed part, a
//! micro-batch of `tokens × target / usage` tokens would still be at or above target, so
//! growth stays below that until the ceiling is forgotten (else the robust fit, which
//! treats the one bad reading as an outlier, would grow straight back). No ceiling is ever
//! below one sequence at the planned length, nor below half the tokens that set it.
//!
//! A shrink that does not lower usage (whatever rule made it) means the memory is not the
//! batch's (allocator cache, heap fragmentation, another process): the controller frees
//! the cache, warns, forgets the readings (a fit through equal peaks would say every token
//! is expensive) and, until usage falls under target, neither shrinks for usage (emergency
//! included: it only frees the cache) nor learns ceilings from it. An OOM is still
//! recovered. A shrink is not judged when its outcome cannot tell: one made on the first
//! step (which lacks the optimizer state), or one by less than 40% planned on one size
//! (which assumed the least fixed part there could be); with one size and no baseline, a
//! fall larger than the noise is the batch's memory following it. Until a shrink made on
//! a reading is judged by the next, the forecast does not shrink again at that length on
//! the same evidence.
//!
//! Every size is planned under target minus a margin: the largest error the fitted model
//! made over its last [`ERROR_WINDOW`] predictions (at least 1%, 2% while the fit rests on
//! two sizes, at most 3% of the limit), so noisy readings land under target rather than on
//! it.
//!
//! Before each step the next batch is forecast; above warning it is a warning, and the
//! micro-batch shrinks to fit before the step runs. A longer length within the horizon
//! predicted above warning shrinks the micro-batch before it arrives; while growth waits
//! for such a length, the controller says so once. A pinned micro-batch is never resized
//! except by an OOM (which unpins it); the controller then only warns.
use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::memory_model::MemoryModel;
use super::thresholds::{ThresholdError, Thresholds};

/// Steps above target (below warning) at one size before shrinking: one reading there is
/// noise, several in a row are drift.
const OVER_TARGET_STEPS: u32 = 3;

/// Predictions whose error sets the planning margin.
pub const ERROR_WINDOW: usize = 16;
const MIN_MARGIN: f64 = 0.01;
/// While the fit rests on two sizes it has not been checked against a third: step peaks
/// scatter by about 1% run to run on CPU, so keep more room until it has.
const YOUNG_MARGIN: f64 = 0.02;
const MAX_MARGIN: f64 = 0.03;
/// A shrink expected to lower usage by at least this share of the limit, that lowered it
/// by less than a quarter of that, marks the footprint as not following the batch.
const MIN_EXPECTED_DROP: f64 = 0.01;
/// How far a process's resident set scatters from step to step at one size (the default
/// [`ControllerConfig::reading_noise`]). With one size measured, its reading is taken this
/// much higher: a low one would under-state what a token costs.
pub const RSS_NOISE: f64 = 0.02;
/// The same for a CUDA allocator's peak plus the memory outside it, which repeats to the
/// byte at one size (docs/GPU.md: 88.2% at every step after settling); the share left is
/// for what moves outside the allocator (cuBLAS workspaces, the context).
pub const ALLOCATOR_NOISE: f64 = 0.005;
/// The least gain worth a growth once the fit rests on three sizes or more.
const SETTLED_GAIN: f64 = 0.1;
/// Clean steps at a size after which an OOM there is not taken as the batch's.
const SETTLED_STEPS: u32 = 5;
/// How far (share of the limit) under target less the margin the model must predict the
/// planned length before a size shrunk for it grows back while that length has not been
/// measured: less is within what the extrapolation moves by as readings at longer lengths
/// come in, and growing on it would shrink again as the lengths keep rising.
const REGROW_ROOM: f64 = 0.05;
/// A reading this far (share of the limit) above a model that has been right is memory
/// taken from outside the batch (see `Controller::jumped`).
const JUMP: f64 = 0.03;
/// Steps before a longer length arrives within which the controller makes room for it
/// even on a bound (see `forecast`).
const YOUNG_LEAD: u64 = 3;

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
        }
    }
}

/// What one step measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepObservation {
    pub step: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
    /// The step's peak memory, bytes.
    pub peak_bytes: u64,
}

/// The longest sequence within the trainer's horizon of upcoming steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upcoming {
    /// The longest sequence length from the next step to the end of the horizon.
    pub seq_len: usize,
    /// The first step that feeds it.
    pub step: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeReason {
    /// Usage under target: room to grow.
    Grow,
    /// Usage at or above critical.
    Critical,
    /// Usage at or above emergency.
    Emergency,
    /// The next batch (or a longer one within the horizon) was forecast above warning.
    Forecast,
    /// The step ran out of memory.
    Oom,
    /// The user pinned the micro-batch.
    Pinned,
    /// Usage stayed above target for several steps at one size (the allocator's
    /// footprint drifted up, e.g. heap fragmentation after an OOM), or a growth landed
    /// above target.
    OverTarget,
}

/// What the controller decided, with the numbers that caused it. Usages are fractions of
/// the limit (the budget on CPU, device memory on CUDA).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    /// Change the micro-batch (accumulation steps follow; the effective batch does not).
    Resize {
        from: usize,
        to: usize,
        reason: ResizeReason,
        /// The measured (or, for a forecast, predicted) usage that triggered it.
        usage: f64,
        /// Predicted usage at the new size, when the model can tell.
        predicted: Option<f64>,
    },
    /// Return cached allocator memory to the device (`emptyCache`).
    EmptyCache { usage: f64 },
    /// Sizes of this many tokens or more are avoided: `micro_batch` ran out of memory
    /// (`usage` 1.0) or peaked at `usage` ≥ critical (or stayed over target), and with a
    /// non-negative fixed part `tokens` would still be at or above target.
    CeilingLearned {
        micro_batch: usize,
        tokens: u64,
        usage: f64,
    },
    /// The ceiling was raised after a long run without OOMs; `None` when dropped.
    CeilingRaised { tokens: Option<u64> },
    /// Usage above warning, measured or forecast, that did not (or could not) resize;
    /// also why growth holds (a longer length is coming, or the fixed part is unknown).
    Warning {
        usage: f64,
        forecast: bool,
        text: String,
    },
}

/// What to do after an OOM.
#[derive(Debug, Clone, PartialEq)]
pub struct OomOutcome {
    pub decisions: Vec<Decision>,
    /// Retry the step with this micro-batch; `None`: give up (it failed repeatedly at
    /// the smallest size).
    pub retry_with: Option<usize>,
}

/// A shrink whose effect the next step at the same length shows.
#[derive(Debug, Clone, Copy)]
struct PendingShrink {
    from: usize,
    /// Usage measured (or forecast) at `from`.
    before: f64,
    seq_len: usize,
    /// The model had one size when the shrink was decided: its fixed part was a guess.
    guessed: bool,
    /// Decided on the run's first step.
    first: bool,
}

#[derive(Debug, Clone)]
pub struct Controller {
    cfg: ControllerConfig,
    thresholds: Thresholds,
    limit_bytes: u64,
    model: MemoryModel,
    micro_batch: usize,
    pinned: bool,
    ceiling_tokens: Option<u64>,
    /// Trusted readings at the current size.
    steps_at_size: u32,
    /// Consecutive steps measured above target at the current size.
    steps_over_target: u32,
    clean_steps: u64,
    ooms_at_min: u32,
    warned: bool,
    /// |predicted − measured| / limit of the fitted model's latest predictions.
    errors: VecDeque<f64>,
    /// The longest sequence among the model's readings.
    max_seq_seen: usize,
    pending_shrink: Option<PendingShrink>,
    /// The last shrink did not lower usage: memory is held apart from the batch.
    unresponsive: bool,
    /// Memory in use before the first step (model, and optimizer state if it exists).
    baseline: Option<u64>,
    /// Whether the run's first step has been observed.
    seen_first: bool,
    /// The size grown from, until the first reading at the new size.
    grown_from: Option<usize>,
    upcoming: Option<Upcoming>,
    /// The longest length any step has run (kept when readings are forgotten).
    longest_run: usize,
    /// A step ran shorter than one before it: the lengths are not a ramp, and any later
    /// step may bring the longest the run feeds (see `plan_seq`).
    lengths_fall: bool,
    /// Why growth holds, said once per size held at: `(false, size)` for an unknown fixed
    /// part (once), `(true, size)` for a longer length to come. Not once per length: on a
    /// ramp the longest length in view grows every step, and a line per step would bury
    /// everything else.
    hold_said: Option<(bool, usize)>,
    /// The OOM being retried at the same size (micro-batch, sequence length).
    retrying: Option<(usize, usize)>,
    /// The longest length the controller had been told of before this step.
    foreseen: usize,
    /// A one-sequence probe past the worst case of the fixed part, until its first
    /// reading: the forecast (that same worst case) must not take it back before it runs,
    /// or the run grows and shrinks by one every step.
    probing: bool,
    /// The micro-batch shrank to make room for a length not yet measured: growth waits
    /// until that length has run, unless the model shows plain room ([`REGROW_ROOM`]).
    shrunk_ahead: bool,
    /// The step whose reading said why growth holds: no growth at it or the next.
    hold_step: Option<u64>,
    /// The latest step observed.
    last_step: u64,
    /// A longer length came into view at the latest forecast (on a ramp, every step).
    rising: bool,
    /// Consecutive readings after which the model showed plain room at the planned length
    /// for a size shrunk ahead of it (one reading moves a young fit by that much).
    room_readings: u32,
    /// A peak measured twice to the byte at different sizes: memory held at a high-water
    /// mark. Readings at or under it do not follow the batch.
    floor_bytes: Option<u64>,
    /// The one probe past a worst case above critical was made.
    risk_probed: bool,
    /// That probe is the size in force, until its first reading.
    risk_probe: bool,
    /// The size in force was reached by shrinking to the model's fit (a reading over
    /// target or critical, a forecast): the readings said the sizes above it do not fit,
    /// so the one-size rules that take any gain (or one sequence more) to learn a second
    /// size do not apply to it. After the drift rule forgets the readings, they grew back
    /// by a sequence or two on the next step and undid the shrink.
    shrunk_to: bool,
    /// The reading being acted on is the run's first step's.
    on_first: bool,
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
            cfg,
            thresholds,
            limit_bytes: limit_bytes.max(1),
            model: MemoryModel::new(),
            micro_batch: mb,
            pinned: false,
            ceiling_tokens: None,
            steps_at_size: 0,
            steps_over_target: 0,
            clean_steps: 0,
            ooms_at_min: 0,
            warned: false,
            errors: VecDeque::with_capacity(ERROR_WINDOW),
            max_seq_seen: 0,
            pending_shrink: None,
            unresponsive: false,
            baseline: None,
            seen_first: false,
            grown_from: None,
            upcoming: None,
            longest_run: 0,
            lengths_fall: false,
            hold_said: None,
            retrying: None,
            foreseen: 0,
            probing: false,
            shrunk_ahead: false,
            hold_step: None,
            last_step: 0,
            rising: false,
            room_readings: 0,
            floor_bytes: None,
            risk_probed: false,
            risk_probe: false,
            shrunk_to: false,
            on_first: false,
        }
    }

    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }
    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }
    pub fn model(&self) -> &MemoryModel {
        &self.model
    }
    pub fn ceiling_tokens(&self) -> Option<u64> {
        self.ceiling_tokens
    }
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }
    pub fn baseline(&self) -> Option<u64> {
        self.baseline
    }

    /// Replaces the thresholds if valid; a rejected set leaves the old ones in force.
    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ThresholdError> {
        self.thresholds.set(t)?;
        self.warned = false;
        Ok(())
    }

    /// Memory in use before the first step, once the model (and, if the trainer creates
    /// it up front, the optimizer state) exists. The fixed part of a step's peak is at
    /// least this (gradients and workspace come on top), so with one size measured the
    /// line through it over-predicts larger sizes: growth can go as far as that line
    /// allows instead of stalling on a proportional guess.
    pub fn set_baseline(&mut self, bytes: u64) {
        self.baseline = Some(bytes);
    }

    /// The limit usage is measured against, when it moves during a run (the trainer passes
    /// min(configured, available) each step).
    pub fn set_limit(&mut self, bytes: u64) {
        let bytes = bytes.max(1);
        if bytes != self.limit_bytes {
            self.limit_bytes = bytes;
            self.warned = false;
        }
    }

    /// True after a shrink that did not lower usage, until usage falls under target.
    pub fn is_unresponsive(&self) -> bool {
        self.unresponsive
    }

    /// The fixed part assumed while only one size has been measured: the baseline, never
    /// above the lowest reading.
    fn one_size_fixed(&self) -> f64 {
        let lowest = self.model.points().map(|p| p.1).min().unwrap_or(0);
        self.baseline.map_or(0.0, |b| b.min(lowest) as f64)
    }

    /// (fixed bytes, bytes per token at `seq_len`) of the model as far as it is earned.
    /// `inflate`: with one size measured, take its reading one noise high (for
    /// growth, where a low reading would over-reach).
    fn cost_at(&self, seq_len: usize, inflate: bool) -> Option<(f64, f64)> {
        let (fit_fixed, slope) = self.model.coefficients()?;
        let seq_len = seq_len.max(1);
        if !self.model.is_fitted() {
            let fixed = self.one_size_fixed();
            let per = self
                .model
                .points()
                .map(|(t, p, s)| {
                    let stretch = if s > 0 && seq_len > s {
                        seq_len as f64 / s as f64
                    } else {
                        1.0
                    };
                    let high = if inflate && self.baseline.is_some() {
                        p as f64 * (1.0 + self.noise())
                    } else {
                        p as f64
                    };
                    (high - fixed).max(0.0) / t as f64 * stretch
                })
                .fold(0.0, f64::max);
            return (per > 0.0).then_some((fixed, per));
        }
        let fixed = fit_fixed
            .max(self.baseline.map_or(0.0, |b| b as f64))
            .max(0.0);
        let lengths_vary = {
            let mut seqs = self.model.points().map(|p| p.2);
            let first = seqs.next();
            seqs.any(|s| Some(s) != first)
        };
        let stretch = |s: usize| {
            if s > 0 && seq_len > s {
                seq_len as f64 / s as f64
            } else {
                1.0
            }
        };
        if !lengths_vary {
            // One length: the fit's slope is the cost of its tokens.
            // Between sizes too close for their difference to be more than noise, the line
            // growth follows is the estimate for prediction too: a fitted slope that fell
            // back to proportional (fixed 0, every byte per token) put a size just grown to
            // at 957% of the limit, and the forecast halved it before it ran.
            let s = self.model.points().next().map_or(0, |p| p.2);
            if let Some((fixed, per)) = self.growth_line(slope) {
                return Some((fixed, per * stretch(s)));
            }
            return Some((fixed, slope.max(0.0) * stretch(s)));
        }
        // Lengths vary: a token costs more in a longer sequence, and a line through all
        // lengths averages that away. Fit the cost of a token as a line in the length.
        if let Some((f, a, b)) = self.model.length_fit() {
            let fixed = f.max(self.baseline.map_or(0.0, |b| b as f64)).max(0.0);
            let at = |l: usize| a + b * l as f64;
            let seen = self.max_seq_seen.max(1);
            let per = if seq_len > seen {
                // Beyond the lengths measured the line is an extrapolation: never cheaper
                // than the longest measured, never dearer than all of it quadratic.
                at(seq_len)
                    .max(at(seen))
                    .min(at(seen) * seq_len as f64 / seen as f64)
            } else {
                at(seq_len)
            };
            return (per > 0.0).then_some((fixed, per));
        }
        // Too few lengths to fit that: take what tokens cost in readings at (or, scaled,
        // nearest below) the length asked about. Readings whose token counts differ only
        // because the length crept (one micro-batch on a ramp) cannot separate the fixed
        // part from the per-token cost: their fitted slope is noise, and near zero it put
        // the whole peak in the fixed part and grew 29 to 173 (3.4× the limit). Their
        // fixed part is the baseline's, as with one size.
        let (lo_t, hi_t) = self
            .model
            .points()
            .fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
        let fixed = if hi_t * 4 < lo_t * 5 {
            self.one_size_fixed()
        } else {
            fixed
        };
        let reference = seq_len.min(self.max_seq_seen).max(1);
        let near: Vec<f64> = self
            .model
            .points()
            .filter(|p| p.2 * 5 >= reference * 4)
            .map(|(t, p, s)| (p as f64 - fixed).max(0.0) / t as f64 * stretch(s))
            .collect();
        let per = if near.is_empty() {
            slope * stretch(self.max_seq_seen)
        } else {
            median(near)
        };
        (per > 0.0).then_some((fixed, per))
    }

    /// (fixed bytes, bytes per token) to grow along, with one length measured at two sizes
    /// or more: the line through the largest size measured, as steep as the readings
    /// allow. Between two close sizes the difference of their peaks is mostly noise
    /// (readings scatter by up to [`ControllerConfig::reading_noise`]): the fitted slope
    /// may be near zero (growth far past what fits) or negative (the fit falls back to
    /// proportional and growth stalls for good). The steepest slope within the noise bounds growth from
    /// above; the line through the baseline, when there is one, bounds it too, so growth
    /// is never less than the one-size rule allowed.
    fn growth_line(&self, fitted_slope: f64) -> Option<(f64, f64)> {
        let mut sizes: Vec<(u64, Vec<f64>)> = Vec::new();
        for (t, p, _) in self.model.points() {
            match sizes.iter_mut().find(|s| s.0 == t) {
                Some(s) => s.1.push(p as f64),
                None => sizes.push((t, vec![p as f64])),
            }
        }
        sizes.sort_by_key(|s| s.0);
        let (t_lo, p_lo) = sizes.first().map(|s| (s.0 as f64, median(s.1.clone())))?;
        let (t_hi, p_hi) = sizes.last().map(|s| (s.0 as f64, median(s.1.clone())))?;
        if t_hi <= t_lo {
            return None;
        }
        let noise = self.noise() * p_hi;
        // Sizes far enough apart that their difference is more signal than noise: the
        // fit (robust over every reading) is the better estimate.
        let (fit_fixed, _) = self.model.coefficients()?;
        if p_hi - p_lo >= 2.0 * noise && fit_fixed > 0.0 {
            return None;
        }
        let mut steepest = (p_hi - p_lo + noise) / (t_hi - t_lo);
        if let Some(b) = self.baseline {
            steepest = steepest.min((p_hi + noise - b as f64).max(0.0) / t_hi);
        }
        // A fit that fell back to proportional (fixed part 0) has no slope of its own.
        let fitted_slope = if fit_fixed > 0.0 { fitted_slope } else { 0.0 };
        let per = steepest.max(fitted_slope).max(0.0);
        (per > 0.0).then(|| ((p_hi - per * t_hi).max(0.0), per))
    }

    /// Whether predictions follow [`Controller::growth_line`]: one length measured, at
    /// sizes too close for their difference to be more than noise.
    fn noise_bound(&self) -> bool {
        let Some((_, slope)) = self.model.coefficients() else {
            return false;
        };
        let mut seqs = self.model.points().map(|p| p.2);
        let first = seqs.next();
        !seqs.any(|s| Some(s) != first) && self.growth_line(slope).is_some()
    }

    /// Predicted peak bytes of `micro_batch` sequences of `seq_len`.
    pub fn predicted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        let (fixed, per) = self.cost_at(seq_len, false)?;
        let tokens = (micro_batch * seq_len.max(1)) as f64;
        Some((fixed + per * tokens).max(0.0) as u64)
    }

    /// Predicted usage (fraction of the limit) of `micro_batch` sequences of `seq_len`.
    pub fn predicted_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        self.predicted_bytes(micro_batch, seq_len)
            .map(|b| b as f64 / self.limit_bytes as f64)
    }

    /// The usage the next step is expected at: what the latest readings at this very
    /// size and length measured when there are some (a young fit's slope between two
    /// close sizes is mostly noise), else the model's prediction.
    fn forecast_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        let tokens = (micro_batch * seq_len) as u64;
        let here: Vec<f64> = self
            .model
            .points()
            .filter(|p| p.0 == tokens && p.2 == seq_len)
            .map(|p| p.1 as f64)
            .collect();
        if here.is_empty() {
            return self.predicted_usage(micro_batch, seq_len);
        }
        Some(median(here) / self.limit_bytes as f64)
    }

    /// Pins the micro-batch to `n` (clamped to the allowed range); the controller then
    /// only warns.
    pub fn pin(&mut self, n: usize) -> Vec<Decision> {
        let to = n.clamp(
            self.cfg.min_micro_batch.max(1),
            self.cfg.max_micro_batch.max(1),
        );
        self.pinned = true;
        self.resize(to, ResizeReason::Pinned, 0.0)
            .into_iter()
            .collect()
    }

    pub fn unpin(&mut self) {
        self.pinned = false;
        self.steps_at_size = 0;
    }

    /// [`ControllerConfig::reading_noise`], kept within what is sane for a share.
    fn noise(&self) -> f64 {
        self.cfg.reading_noise.clamp(0.0, 0.2)
    }

    fn cap(&self) -> usize {
        self.cfg.max_micro_batch.max(1)
    }
    fn floor(&self) -> usize {
        self.cfg.min_micro_batch.max(1)
    }

    /// The length growth is planned for: the longest to come, as far as the controller
    /// knows, and never shorter than the longest it has been told of or run. A horizon
    /// moves every step: planning for only its own longest would grow when a long length
    /// drops out of it and shrink when the next one comes in (random lengths churn), and
    /// a length seen once in a schedule comes again.
    fn plan_seq(&self, seq_len: usize) -> usize {
        // Lengths that fall as well as rise (random, bucketed) can bring the longest the
        // run feeds on any step, past the horizon's view: a size planned for the horizon's
        // longest is shrunk again when a longer one comes into view, long after the run
        // settled (37 of 400 simulated random-length runs). A ramp only rises, and
        // the horizon lets it use the room its shorter lengths leave.
        let ahead = match self.upcoming {
            Some(u) if !(self.lengths_fall && self.cfg.max_seq_len > 0) => u.seq_len,
            _ => self.cfg.max_seq_len,
        };
        ahead.max(seq_len).max(self.foreseen).max(1)
    }

    /// Largest micro-batch under the learned ceiling for `seq_len`.
    fn ceiling_batch(&self, seq_len: usize) -> usize {
        match self.ceiling_tokens {
            Some(c) => ((c.saturating_sub(1) / seq_len.max(1) as u64) as usize).max(self.floor()),
            None => usize::MAX,
        }
    }

    /// The share of the limit kept free below target for the model's own error.
    pub fn margin(&self) -> f64 {
        let floor = if self.model.distinct_sizes() < 3 {
            YOUNG_MARGIN
        } else {
            MIN_MARGIN
        };
        self.errors
            .iter()
            .copied()
            .fold(0.0, f64::max)
            .clamp(floor, MAX_MARGIN)
    }

    /// The model's largest micro-batch predicted under target (less the margin).
    fn fit_target(&self, seq_len: usize) -> Option<usize> {
        self.fit_under(self.thresholds.target - self.margin(), seq_len, false)
    }

    /// The model's largest micro-batch predicted under `fraction` of the limit.
    fn fit_under(&self, fraction: f64, seq_len: usize, inflate: bool) -> Option<usize> {
        let goal = fraction * self.limit_bytes as f64;
        let (fixed, per) = self.cost_at(seq_len, inflate)?;
        let per_seq = per * seq_len.max(1) as f64;
        Some(((goal - fixed) / per_seq).max(0.0).floor() as usize)
    }

    /// The smallest size one decision may take `micro_batch` to, except after an OOM.
    fn half_of(&self, micro_batch: usize) -> usize {
        micro_batch.div_ceil(2).max(self.floor())
    }

    /// Forgets the model's readings (they describe a footprint that is gone).
    fn forget_readings(&mut self) {
        self.model.clear();
        self.errors.clear();
        self.max_seq_seen = 0;
    }

    /// Lowers the ceiling to `tokens` (never below one sequence of the planned length) if
    /// that is lower; the decision when it changed.
    fn learn_ceiling(
        &mut self,
        micro_batch: usize,
        tokens: u64,
        seq_len: usize,
        usage: f64,
    ) -> Option<Decision> {
        self.clean_steps = 0;
        let longest = self.plan_seq(seq_len).max(self.cfg.max_seq_len);
        let one = (self.floor() * longest) as u64 + 1;
        let tokens = tokens.max(one);
        if self.ceiling_tokens.is_some_and(|c| c <= tokens) {
            return None;
        }
        self.ceiling_tokens = Some(tokens);
        Some(Decision::CeilingLearned {
            micro_batch,
            tokens,
            usage,
        })
    }

    fn resize(&mut self, to: usize, reason: ResizeReason, usage: f64) -> Option<Decision> {
        let to = to.clamp(self.floor(), self.cap());
        if to == self.micro_batch {
            return None;
        }
        let from = self.micro_batch;
        self.micro_batch = to;
        self.steps_at_size = 0;
        self.steps_over_target = 0;
        self.warned = false;
        self.pending_shrink = None;
        self.probing = false;
        self.risk_probe = false;
        self.grown_from = (to > from && reason == ResizeReason::Grow).then_some(from);
        // Halving after an OOM or an emergency is a guess, not a judgement of the sizes
        // above: those may still be probed.
        self.shrunk_to =
            to < from && !matches!(reason, ResizeReason::Oom | ResizeReason::Emergency);
        if to > from {
            self.unresponsive = false;
        }
        let seq = self.plan_seq(0);
        Some(Decision::Resize {
            from,
            to,
            reason,
            usage,
            predicted: self.predicted_usage(to, seq),
        })
    }

    /// A shrink for usage measured at `from` with sequences of `seq_len`.
    fn shrink(
        &mut self,
        to: usize,
        reason: ResizeReason,
        usage: f64,
        seq_len: usize,
    ) -> Option<Decision> {
        let from = self.micro_batch;
        let to = to.clamp(self.half_of(from), from.saturating_sub(1).max(1));
        let d = self.resize(to, reason, usage)?;
        let shrink = PendingShrink {
            from,
            before: usage,
            seq_len,
            guessed: !self.model.is_fitted(),
            first: self.on_first,
        };
        // A forecast's shrink right after one made on a reading, before any step ran: the
        // reading is what the next step is judged against (a forecast is the model's, and
        // judged against one a reading of 95% after 10 → 5 → 3 "stayed" at 94%).
        self.pending_shrink = match self.pending_shrink {
            Some(p) if p.seq_len == seq_len => Some(PendingShrink {
                from: p.from,
                before: p.before,
                ..shrink
            }),
            _ => Some(shrink),
        };
        Some(d)
    }

    /// The forecast for the next step, whose sequences are `seq_len` long: shrinks (or,
    /// pinned, warns) when it is predicted above warning. Plans growth for the configured
    /// longest length.
    pub fn before_step(&mut self, seq_len: usize) -> Vec<Decision> {
        self.upcoming = None;
        self.forecast(seq_len)
    }

    /// As [`before_step`](Self::before_step), told the longest sequence within the
    /// trainer's horizon of upcoming steps: growth is planned for what is actually coming,
    /// and the micro-batch shrinks before a longer length arrives rather than when it
    /// does.
    pub fn before_step_ahead(&mut self, seq_len: usize, upcoming: Upcoming) -> Vec<Decision> {
        self.upcoming = Some(upcoming);
        self.forecast(seq_len)
    }

    fn forecast(&mut self, seq_len: usize) -> Vec<Decision> {
        let mut out = Vec::new();
        self.on_first = false;
        let unforeseen = seq_len > self.foreseen;
        // A longer length came into view: on a ramp, one every step.
        let rising = self.plan_seq(seq_len) > self.foreseen;
        self.rising = rising;
        self.foreseen = self.foreseen.max(self.plan_seq(seq_len));
        let Some(pred) = self.forecast_usage(self.micro_batch, seq_len) else {
            return out;
        };
        // A shrink made on the latest reading is judged by the next one: shrinking again
        // before it, on the model fitted through that same reading, doubles the step down
        // on one number (a held high-water mark took 50 → 25 → 13 of a feasible 100).
        let judging = self.pending_shrink.is_some_and(|p| seq_len <= p.seq_len);
        let may_resize = !self.pinned
            && self.cfg.adaptive
            && !self.unresponsive
            && !judging
            && (!self.probing || (pred >= self.thresholds.critical && !self.risk_probe));
        if pred > self.thresholds.warning {
            out.push(Decision::Warning {
                usage: pred,
                forecast: true,
                text: format!(
                    "the next batch ({} × {seq_len} tokens) is forecast at {:.0}% of the limit, above warning {:.0}%",
                    self.micro_batch,
                    pred * 100.0,
                    self.thresholds.warning * 100.0
                ),
            });
            if may_resize {
                let fit = self.fit_target(seq_len).unwrap_or(0);
                // A length nobody announced is about to run: going there in halves would
                // run it predicted over warning. Announced lengths were made room for in
                // halves ahead of time.
                let fit = if unforeseen && fit >= 1 {
                    self.half_of(self.micro_batch).min(fit)
                } else {
                    fit
                };
                let shrunk = if unforeseen && fit >= 1 {
                    self.resize(fit, ResizeReason::Forecast, pred)
                } else {
                    self.shrink(fit, ResizeReason::Forecast, pred, seq_len)
                };
                if let Some(mut d) = shrunk {
                    if let Decision::Resize { to, predicted, .. } = &mut d {
                        *predicted = self.predicted_usage(*to, seq_len);
                    }
                    out.push(d);
                }
            }
            return out;
        }
        // A longer length to come: make room before it arrives.
        let plan = self.plan_seq(seq_len);
        if plan <= seq_len || self.upcoming.is_none() {
            return out;
        }
        let Some(ahead) = self.predicted_usage(self.micro_batch, plan) else {
            return out;
        };
        // Above warning at the longest length in view: make room for it (under target less
        // the margin). The longest the run feeds, just come into view, must fit under
        // target itself: the size runs it for good, and one left between target and
        // warning would be shrunk again by the drift rule once it arrives.
        let last = self.cfg.max_seq_len > 0 && plan >= self.cfg.max_seq_len;
        let trigger = if rising && last {
            self.thresholds.target
        } else {
            self.thresholds.warning
        };
        // Before the readings span enough lengths to fit what a token costs in a longer
        // sequence, the cost there is a bound (all of it quadratic), not an estimate: on a
        // ramp it put the size for a length 16 steps away at 70% of the limit, and the
        // next readings grew it back. Shrinking for such a length waits for the fit, or
        // until the length is near; the forecast of each step's own length keeps the
        // steps before it safe.
        // With random lengths the longest the run feeds is planned for before it is in
        // view: not known to be near either.
        let far = match self.upcoming {
            Some(u) if u.seq_len == plan => u.step > self.last_step + 1 + YOUNG_LEAD,
            Some(_) => self.lengths_fall,
            None => false,
        };
        let bound_only = plan > self.max_seq_seen && self.model.length_fit().is_none() && far;
        if ahead > trigger && may_resize && !bound_only {
            let fit = self.fit_target(plan).unwrap_or(0);
            if let Some(mut d) = self.shrink(fit, ResizeReason::Forecast, ahead, plan) {
                // The next step is shorter: whether the shrink helped cannot be read from
                // it.
                self.pending_shrink = None;
                self.shrunk_ahead = true;
                if let Decision::Resize { to, predicted, .. } = &mut d {
                    *predicted = self.predicted_usage(*to, plan);
                }
                out.push(d);
            }
        }
        out
    }

    /// Feeds one successful step's measurement; returns what to change.
    pub fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        let mut out = Vec::new();
        let tokens = (obs.micro_batch * obs.seq_len) as u64;
        let usage = obs.peak_bytes as f64 / self.limit_bytes as f64;
        let t = self.thresholds;
        let first = !self.seen_first;
        self.seen_first = true;
        self.on_first = first;
        self.last_step = self.last_step.max(obs.step);
        self.retrying = None;
        let current = obs.micro_batch == self.micro_batch;
        self.probing &= !current;
        self.lengths_fall |= obs.seq_len < self.longest_run;
        self.longest_run = self.longest_run.max(obs.seq_len);
        // The one-sequence probe past the worst case read at or above critical: back to
        // the size it came from, which ran cleanly (halving would put it below what fits,
        // and a retained heap's high-water mark would never let it grow back).
        let risk_probed = self.risk_probe && current;
        self.risk_probe &= !current;
        if usage < t.target {
            self.unresponsive = false;
        }
        let mut after_first_shrink = false;
        if current {
            if let Some(p) = self.pending_shrink.take() {
                after_first_shrink = p.first;
                // A shorter length only lowers usage further, so it judges the shrink too
                // (with random lengths the same length rarely comes next); so does a longer
                // one whose batch is still smaller, a sequence costing at most
                // quadratically in its length. With random lengths and memory held at a
                // high-water mark, waiting for a length no longer than the one shrunk at
                // let the emergency rule halve four times on the same reading.
                if shrunk_batch_share(p, obs) < 1.0 {
                    out.extend(self.check_shrink_worked(obs, p, usage));
                }
            }
        }
        let grown_from = if current {
            self.grown_from.take()
        } else {
            None
        };
        let trusted = !first && !self.unresponsive;
        // Only lengths already measured: the stretch beyond them is a bound, not the
        // model's error.
        if trusted && self.model.is_fitted() && obs.seq_len <= self.max_seq_seen {
            if let Some(p) = self.predicted_bytes(obs.micro_batch, obs.seq_len) {
                if self.errors.len() == ERROR_WINDOW {
                    self.errors.pop_front();
                }
                let err = (obs.peak_bytes as f64 - p as f64) / self.limit_bytes as f64;
                // The steep line a growth from close sizes follows is a bound from above:
                // a reading under it is what it is for, not an error. Counted, it kept 3%
                // free after the growth it planned landed low, and a run that fits 148
                // held at 122.
                let err = if self.noise_bound() {
                    err.max(0.0)
                } else {
                    err.abs()
                };
                self.errors.push_back(err);
            }
        }
        // A reading far above what a model that has been right predicted, at a length it
        // has measured: memory was taken from outside the batch (another process, the
        // device shared). That moves the fixed part, not what a token costs: shift every
        // reading by the jump so one decision lands near what fits now, instead of
        // learning a steeper slope from it over several.
        if trusted && !first && self.jumped(obs) {
            self.errors.clear();
        }
        // The first step allocates the optimizer state as it goes, so it peaks lower than
        // the steps after it; while usage does not follow the batch, a reading says
        // nothing about its cost.
        // A peak equal to the byte to one at another size measured a floor the batch no
        // longer reaches (freed heap pages kept mapped, a cache at its high-water mark):
        // neither reading says what the batch costs, and a fit through them makes a short
        // sequence look as dear as a long one. Readings at or under that floor are
        // censored, readings above it are the batch's own.
        let floor = self
            .floor_bytes
            .is_some_and(|f| obs.peak_bytes <= f + f / 1_000_000);
        if trusted && !floor && self.model.forget_floor(tokens, obs.peak_bytes) {
            self.floor_bytes = Some(obs.peak_bytes.max(self.floor_bytes.unwrap_or(0)));
        } else if trusted && !floor {
            self.model.observe_at(tokens, obs.peak_bytes, obs.seq_len);
            self.max_seq_seen = self.max_seq_seen.max(obs.seq_len);
        }
        self.ooms_at_min = 0;
        if current && !first {
            self.steps_at_size = self.steps_at_size.saturating_add(1);
        }
        self.clean_steps += 1;
        if let Some(c) = self.ceiling_tokens {
            if self.clean_steps >= self.cfg.forget_every {
                self.clean_steps = 0;
                let raised = c + c / 10 + 1;
                let max_tokens = (self.cap() * self.plan_seq(obs.seq_len)) as u64;
                self.ceiling_tokens = (raised <= max_tokens).then_some(raised);
                out.push(Decision::CeilingRaised {
                    tokens: self.ceiling_tokens,
                });
            }
        }
        let seq = self.plan_seq(obs.seq_len);
        if self.max_seq_seen >= seq {
            // The length the size was shrunk for has run: readings check it now.
            self.shrunk_ahead = false;
        }
        let may_resize = self.cfg.adaptive && !self.pinned;
        if usage >= t.critical && self.unresponsive {
            // Not the batch's memory: shrinking would only give up throughput. The cache
            // is still worth freeing.
            if usage >= t.emergency {
                out.push(Decision::EmptyCache { usage });
            }
            return out;
        }
        if usage >= t.critical {
            let bound = ((tokens as f64 * t.target / usage).floor() as u64).max(tokens / 2);
            out.extend(self.learn_ceiling(obs.micro_batch, bound.max(1), obs.seq_len, usage));
        }
        if usage >= t.emergency {
            out.push(Decision::EmptyCache { usage });
        }
        if usage >= t.critical && may_resize && risk_probed && obs.micro_batch > self.floor() {
            let reason = if usage >= t.emergency {
                ResizeReason::Emergency
            } else {
                ResizeReason::Critical
            };
            out.extend(self.resize(obs.micro_batch - 1, reason, usage));
            // A reading there as high as this one is memory the probe left behind.
            self.pending_shrink = Some(PendingShrink {
                from: obs.micro_batch,
                before: usage,
                seq_len: obs.seq_len,
                guessed: !self.model.is_fitted(),
                first: self.on_first,
            });
            return out;
        }
        if usage >= 1.0 && may_resize && current {
            // Past the limit (a soft budget): what a hard one would have failed with an
            // OOM, and memory that followed the batch so far.
            let mut to = self.after_oom(obs.micro_batch, obs.seq_len, first);
            if after_first_shrink {
                // Right after a shrink made on the first step, which could not be judged:
                // a reading still past the limit may be memory held at that step's mark
                // (it read 285% at 400, then 270% at 50, and the one-size fit took the run
                // to 13 of a feasible 100). Half, and the next reading judges it.
                to = to.max(self.half_of(obs.micro_batch));
            }
            let from = self.micro_batch;
            out.extend(self.resize(to, ResizeReason::Emergency, usage));
            self.pending_shrink = (self.micro_batch < from).then_some(PendingShrink {
                from,
                before: usage,
                seq_len: obs.seq_len,
                guessed: !self.model.is_fitted(),
                first: self.on_first,
            });
            return out;
        }
        if usage >= t.critical && may_resize && current {
            let reason = if usage >= t.emergency {
                ResizeReason::Emergency
            } else {
                ResizeReason::Critical
            };
            // Emergency: half, safety over throughput (the memory has followed the batch so
            // far, else this rule would not be reached).
            let fit = match reason {
                ResizeReason::Emergency => 0,
                _ => self.fit_target(seq).unwrap_or(0),
            };
            out.extend(self.shrink(fit, reason, usage, obs.seq_len));
            return out;
        }
        if usage > t.target && current {
            self.steps_over_target += 1;
        } else {
            self.steps_over_target = 0;
        }
        let over = usage > t.target && usage <= t.warning;
        if let Some(from) = grown_from {
            // Readings scatter by about MIN_MARGIN around the batch's own peak: one just
            // over target is as likely a size that fits on a high reading (and the drift
            // rule still sees it if it persists). Shrinking on it cost a fourth adjustment
            // and, once settled, undid a growth to the feasible size.
            if usage > t.target + MIN_MARGIN && usage < t.critical && may_resize && !first {
                // The growth overshot: the fit now includes the reading that shows it.
                let fit = self.fit_target(seq).unwrap_or(from);
                out.extend(self.learn_ceiling(obs.micro_batch, tokens, obs.seq_len, usage));
                out.extend(self.shrink(
                    fit.max(from),
                    ResizeReason::OverTarget,
                    usage,
                    obs.seq_len,
                ));
                return out;
            }
        }
        if over && self.within_own_noise(tokens, obs.seq_len) {
            // A settled size whose readings scatter about target: the streak over it is
            // that scatter, not drift. Shrinking on it undid a landing at the feasible size
            // a hundred steps later.
            self.steps_over_target = 0;
        }
        if over && may_resize && !self.unresponsive && self.steps_over_target == OVER_TARGET_STEPS {
            // The allocator's cache may be what grew: free it before giving up samples.
            out.push(Decision::EmptyCache { usage });
            return out;
        }
        if over
            && may_resize
            && !self.unresponsive
            && self.steps_over_target >= 2 * OVER_TARGET_STEPS
        {
            // The fit still describes the old footprint: shed the excess at the fitted
            // cost per token, then forget the old readings so growth is planned from the
            // new footprint only (else it would grow straight back).
            let goal = (t.target - self.margin()) * self.limit_bytes as f64;
            let excess = obs.peak_bytes as f64 - goal;
            let to = match self.cost_at(seq, false) {
                Some((_, per)) if per > 0.0 => {
                    let shed = (excess / (per * seq as f64)).ceil().max(1.0) as usize;
                    self.micro_batch.saturating_sub(shed)
                }
                _ => self.micro_batch * 9 / 10,
            };
            // As at critical: this many tokens stay above target whatever the fit says.
            let bound = ((tokens as f64 * t.target / usage).floor() as u64).max(tokens / 2);
            out.extend(self.learn_ceiling(obs.micro_batch, bound.max(1), obs.seq_len, usage));
            self.forget_readings();
            out.extend(self.shrink(to, ResizeReason::OverTarget, usage, obs.seq_len));
            if let Some(p) = &mut self.pending_shrink {
                // Planned on the fitted cost, before the readings were forgotten.
                p.guessed = false;
            }
            return out;
        }
        if usage > t.warning {
            if !self.warned && !self.unresponsive {
                self.warned = true;
                let what = if self.pinned {
                    "the micro-batch is pinned; unpin it to let headroom shrink it"
                } else if !self.cfg.adaptive {
                    "adaptation is off (memory.adaptive = false)"
                } else {
                    "growth stops"
                };
                out.push(Decision::Warning {
                    usage,
                    forecast: false,
                    text: format!(
                        "step {} peaked at {:.0}% of the limit, above warning {:.0}%; {what}",
                        obs.step,
                        usage * 100.0,
                        t.warning * 100.0
                    ),
                });
            }
            return out;
        }
        if usage < t.target && may_resize && self.steps_at_size >= self.cfg.patience {
            out.extend(self.grow(obs, usage, seq));
        }
        out
    }

    /// Whether the latest readings at this size and length (the streak the drift rule
    /// counts) sit within the scatter of the readings before them at the same size: a
    /// size settled near target reads over it now and then without its footprint moving.
    fn within_own_noise(&self, tokens: u64, seq_len: usize) -> bool {
        let streak = self.steps_over_target as usize;
        let here: Vec<f64> = self
            .model
            .points()
            .filter(|p| p.0 == tokens && p.2 == seq_len)
            .map(|p| p.1 as f64)
            .collect();
        // Enough earlier readings to know the size's own scatter.
        if streak == 0 || here.len() < streak + 2 * OVER_TARGET_STEPS as usize {
            return false;
        }
        let (earlier, recent) = here.split_at(here.len() - streak);
        let m = median(earlier.to_vec());
        let spread = earlier.iter().map(|r| (r - m).abs()).fold(0.0, f64::max);
        // Settled under target of the limit as it is now (a limit that dropped puts the
        // same bytes over it: that is not scatter).
        m <= self.thresholds.target * self.limit_bytes as f64
            && median(recent.to_vec()) - m <= spread
    }

    /// Whether `obs` reads a jump in the fixed part (see `observe`): a settled size (three
    /// readings or more at this very size and length) reads far above them, or a model
    /// that has been right reads far above its prediction. Shifts the model (and the
    /// baseline, part of the same fixed memory) by the jump.
    fn jumped(&mut self, obs: StepObservation) -> bool {
        if obs.seq_len > self.max_seq_seen || self.floor_bytes.is_some() {
            return false;
        }
        let limit = self.limit_bytes as f64;
        let tokens = (obs.micro_batch * obs.seq_len) as u64;
        let here: Vec<f64> = self
            .model
            .points()
            .filter(|p| p.0 == tokens && p.2 == obs.seq_len)
            .map(|p| p.1 as f64)
            .collect();
        let (expected, err) = if here.len() >= 3 {
            let m = median(here.clone());
            let spread = here.iter().map(|r| (r - m).abs()).fold(0.0, f64::max);
            (m, spread / limit)
        } else if self.model.is_fitted() && self.errors.len() >= 3 {
            match self.predicted_bytes(obs.micro_batch, obs.seq_len) {
                Some(p) => (p as f64, self.errors.iter().copied().fold(0.0, f64::max)),
                None => return false,
            }
        } else {
            return false;
        };
        let jump = (obs.peak_bytes as f64 - expected) / limit;
        if jump < JUMP.max(3.0 * err) {
            return false;
        }
        self.model.shift(jump * limit);
        self.baseline = self.baseline.map(|b| b + (jump * limit) as u64);
        true
    }

    /// Growth from a step under target, planned for sequences of `seq`.
    fn grow(&mut self, obs: StepObservation, usage: f64, seq: usize) -> Vec<Decision> {
        let mut out = Vec::new();
        // While longer lengths keep coming into view, growth keeps the same room as a
        // shrink for them does (else the next one takes it back).
        let Some(fit) = self.fit_under(self.thresholds.target - self.margin(), seq, true) else {
            return out;
        };
        let mb = self.micro_batch;
        let fitted = self.model.is_fitted();
        let factor = if fitted && self.noise_bound() {
            // Sizes too close to tell their cost from noise: growth follows the steepest
            // line within the noise, a bound from above, not the fit.
            self.cfg.max_growth * self.cfg.max_growth
        } else if fitted {
            self.cfg.max_growth
        } else if self.baseline.is_some() {
            // The line through the baseline over-predicts every larger size.
            self.cfg.max_growth * self.cfg.max_growth
        } else {
            self.cfg.probe_growth
        };
        let bound =
            ((mb as f64 * factor).min(usize::MAX as f64 / 2.0).floor() as usize).max(mb + 1);
        let limit = bound.min(self.cap()).min(self.ceiling_batch(seq));
        // Shrunk for a length that has not run yet: the model's cost there is an
        // extrapolation that moves as readings at longer lengths come in. Growing back on
        // such a move while the lengths keep rising only shrinks again a few steps later:
        // wait for the length to run, unless the model shows plain room. And a size said
        // to hold holds at least until the next reading.
        let plain = self
            .predicted_usage(mb, seq)
            .is_some_and(|u| u < self.thresholds.target - self.margin() - REGROW_ROOM);
        self.room_readings = if plain { self.room_readings + 1 } else { 0 };
        let waits = (self.shrunk_ahead && seq > self.max_seq_seen && self.room_readings < 2)
            || self.hold_step.is_some_and(|h| obs.step <= h + 1);
        let cand = if waits {
            fit.min(limit).min(mb)
        } else {
            fit.min(limit)
        };
        // Once the fit has been checked against a third size, the last few percent are
        // not worth another adjustment (they are within the fit's own error).
        let min_gain = if self.model.distinct_sizes() >= 3 {
            self.cfg.min_gain.max(SETTLED_GAIN)
        } else {
            self.cfg.min_gain
        };
        let gain = (mb as f64 * min_gain).ceil().max(1.0) as usize;
        // Room to spare: more than noise and the margin away from target.
        let room = usage < self.thresholds.target - self.margin() - 2.0 * MIN_MARGIN;
        let learning = !fitted && room && !self.shrunk_to;
        // Nor, on a settled fit, is a growth whose predicted rise in usage is within what
        // readings scatter by (both ends of the noise): it cannot be told from noise, may land
        // over target and be undone. With a large fixed part a tenth more sequences is
        // that little memory, and the margin's decay (the young fit's errors leaving the
        // window) made such a growth, 20 steps after the run had settled near target, a
        // fourth adjustment.
        // A growth that lands well under target cannot be undone by noise, however little
        // usage it adds: on a large limit (host memory, a tiny model) every growth is
        // "within noise" of the limit, and the rule had frozen such runs at micro-batch 1.
        let (rise, lands_clear) = match (
            self.predicted_usage(cand, seq),
            self.predicted_usage(mb, seq),
        ) {
            (Some(to), Some(now)) => (
                to - now,
                to < self.thresholds.target - self.margin() - 2.0 * MIN_MARGIN,
            ),
            _ => (f64::INFINITY, false),
        };
        // Only at a length measured: beyond it the cost is a bound (all attention), whose
        // small steps are how a ramp learns the curve.
        let worth = cand >= mb + gain
            && (self.model.distinct_sizes() < 3
                || seq > self.max_seq_seen
                || rise >= 2.0 * MIN_MARGIN
                || lands_clear);
        if worth || (learning && cand > mb) {
            // Unfitted, any gain is worth it: a second size is what separates the fixed
            // part from the per-token cost.
            out.extend(self.resize(cand, ResizeReason::Grow, usage));
            return out;
        }
        if learning && limit > mb && !waits {
            // Not even one more sequence is predicted under target, but the prediction
            // assumes the worst of the fixed part: probe one more if even that worst
            // case stays under critical.
            let probe = (mb + 1).min(limit);
            if self
                .predicted_usage(probe, seq)
                .is_some_and(|u| u < self.thresholds.critical)
            {
                out.extend(self.resize(probe, ResizeReason::Grow, usage));
                self.probing = true;
                return out;
            }
            // The worst case of the fixed part says even one more could reach critical,
            // but the step runs well under target: holding there for good gives up the
            // room the first failure stalled in. Probe one more, once per run (an
            // OOM or a reading over critical there is recovered and sets a ceiling).
            // Only at the length planned for: with lengths to come longer than any run,
            // the worst case there is a bound the forecast acts on, not a stall.
            if !self.risk_probed && seq == obs.seq_len {
                self.risk_probed = true;
                out.extend(self.resize(probe, ResizeReason::Grow, usage));
                self.probing = true;
                self.risk_probe = true;
                return out;
            }
            if !matches!(self.hold_said, Some((false, _))) {
                self.hold_said = Some((false, mb));
                self.hold_step = Some(obs.step);
                out.push(Decision::Warning {
                    usage,
                    forecast: true,
                    text: format!(
                        "holding at {mb}: with one size measured the fixed part of the memory \
                         is not known, and {} × {seq} could reach {:.0}% of the limit{}",
                        mb + 1,
                        self.predicted_usage(mb + 1, seq).unwrap_or(1.0) * 100.0,
                        if self.baseline.is_some() {
                            ""
                        } else {
                            "; a baseline measured before the first step would tell"
                        }
                    ),
                });
            }
            return out;
        }
        // Holding for a longer length still to come: say so once.
        if seq > obs.seq_len && cand < mb + gain {
            let now = self.fit_target(obs.seq_len).unwrap_or(0).min(limit.max(mb));
            if now >= mb + gain && self.hold_said.map(|h| h.1) != Some(mb) {
                self.hold_said = Some((true, mb));
                self.hold_step = Some(obs.step);
                let when = match self.upcoming {
                    Some(u) if u.seq_len == seq => format!("arrives by step {}", u.step),
                    _ => "may come (the longest the run feeds)".to_string(),
                };
                out.push(Decision::Warning {
                    usage: self.predicted_usage(mb, seq).unwrap_or(usage),
                    forecast: true,
                    text: if fit.min(limit) > mb {
                        format!(
                            "holding at {mb}: length {seq} {when} and has not run yet; {now} \
                             would fit length {} now",
                            obs.seq_len
                        )
                    } else {
                        format!(
                            "holding at {mb}: length {seq} {when} and {} × {seq} is the most \
                             that fits; {now} would fit length {} now",
                            fit.max(mb).min(limit.max(mb)),
                            obs.seq_len
                        )
                    },
                });
            }
        }
        out
    }

    /// The first step at the same length after a shrink from `p.from`: if usage did not
    /// follow, the memory is not the batch's, and shrinking further would only give up
    /// throughput.
    fn check_shrink_worked(
        &mut self,
        obs: StepObservation,
        p: PendingShrink,
        usage: f64,
    ) -> Vec<Decision> {
        let from = p.from;
        let before = p.before;
        // The fit's own slope, not the steepest within the noise that growth follows: that
        // one bounds the cost from above, and the least drop that following memory shows
        // is what a shrink is judged by. A fit that fell back to proportional (its slope
        // noise) says no more than one size does.
        let fitted = self
            .model
            .coefficients()
            .is_some_and(|(fixed, _)| self.model.is_fitted() && fixed > 0.0);
        let lengths_vary = self.model.points().any(|p| p.2 != obs.seq_len);
        let predicted = |c: &Controller, mb: usize| match c.model.coefficients() {
            Some((fixed, slope)) if !lengths_vary => {
                Some((fixed + slope * (mb * obs.seq_len) as f64).max(0.0) as u64)
            }
            _ => c.predicted_bytes(mb, obs.seq_len),
        };
        let expected = match (
            fitted,
            predicted(self, from),
            predicted(self, obs.micro_batch),
        ) {
            (true, Some(a), Some(b)) => a.saturating_sub(b) as f64 / self.limit_bytes as f64,
            // One size measured: only the part above the fixed part follows the batch. Taking
            // all of it as the batch's expected a halving to halve usage; with a fixed part
            // of 0.83 of the limit a shrink from 112% that lowered usage to 98% was judged
            // not to have worked, and the run held at critical for the rest of its steps.
            _ => {
                let fixed = self.one_size_fixed() / self.limit_bytes as f64;
                (before - fixed).max(0.0) * (1.0 - shrunk_batch_share(p, obs))
            }
        };
        // Without a baseline the fixed part is unknown: a fall larger than readings scatter
        // by (both ends of the noise) is the batch's memory going, whatever the guess
        // expected (a fixed part of 0.83 held a run at critical for 195 steps).
        let moved = before - usage > 2.0 * self.noise() * before;
        let followed =
            before - usage >= expected / 4.0 || (moved && !fitted && self.baseline.is_none());
        // Planned on one size, a shrink by less than 40% assumed the least fixed part
        // there could be: with a large one its effect is within the noise, and judging it
        // held a run at 95% for 148 steps (656 → 604 read 95.6% then 95.2%). The readings
        // at both sizes now fit the fixed part; the next shrink, planned on them, is judged.
        // Nor does a shrink made on the run's first step, which peaks low (optimizer state
        // appears during it): the state arriving reads as memory that did not follow the
        // batch, and runs halved from 99% to a size reading 95–96% held there for 94 and
        // 111 steps. The next shrink is judged (and is at most a half, see `observe`).
        let small = obs.micro_batch as f64 > 0.6 * p.from as f64;
        let unjudged = (p.guessed && small) || p.first;
        if expected < MIN_EXPECTED_DROP || followed || unjudged {
            return Vec::new();
        }
        self.unresponsive = true;
        // The shrink did not lower usage: it said nothing about the sizes above.
        self.shrunk_to = false;
        self.forget_readings();
        vec![
            Decision::EmptyCache { usage },
            Decision::Warning {
                usage,
                forecast: false,
                text: format!(
                    "step {}: usage stayed at {:.0}% although the micro-batch shrank from {from} \
                     to {} (it was {:.0}%): the memory is held apart from the batch (allocator \
                     cache, fragmentation or another process); holding at {} and freeing the cache",
                    obs.step,
                    usage * 100.0,
                    obs.micro_batch,
                    before * 100.0,
                    obs.micro_batch
                ),
            },
        ]
    }

    /// The size to go to from `micro_batch`, which did not fit in the limit: the fit, at
    /// most half. When no step has run yet, an eighth: halving from a start far too large
    /// fails step after step, while from an eighth the baseline's line grows back safely
    /// in one move.
    fn after_oom(&self, micro_batch: usize, seq_len: usize, nothing_ran: bool) -> usize {
        match self.fit_target(self.plan_seq(seq_len)) {
            Some(f) => f.min(micro_batch / 2),
            None if nothing_ran => micro_batch / 8,
            None => micro_batch / 2,
        }
    }

    /// A step at `micro_batch` × `seq_len` ran out of memory: learn the ceiling, free the
    /// cache, and pick the size to retry the same samples with.
    pub fn on_oom(&mut self, micro_batch: usize, seq_len: usize) -> OomOutcome {
        let tokens = (micro_batch * seq_len) as u64;
        let mut decisions = vec![Decision::EmptyCache { usage: 1.0 }];
        // A size that has run cleanly many times at this length or longer did not
        // outgrow the memory: something else took it (a spike, another process). Retry it
        // once; a second OOM there is taken as real.
        let settled = micro_batch == self.micro_batch
            && self.steps_at_size >= SETTLED_STEPS
            && !self.unresponsive
            && seq_len <= self.max_seq_seen
            && self.retrying != Some((micro_batch, seq_len));
        self.pinned = false;
        self.pending_shrink = None;
        self.grown_from = None;
        if settled {
            self.retrying = Some((micro_batch, seq_len));
            return OomOutcome {
                decisions,
                retry_with: Some(micro_batch),
            };
        }
        // The retried size failed again: the memory outside the batch grew by at least
        // what the model left between this size and the limit. Move the fixed part by that
        // so the size retried with is planned from the memory left.
        if self.retrying == Some((micro_batch, seq_len)) {
            if let Some(p) = self.predicted_bytes(micro_batch, seq_len) {
                let gap = self.limit_bytes as f64 - p as f64;
                if gap > 0.0 {
                    self.model.shift(gap);
                    self.baseline = self.baseline.map(|b| b + gap as u64);
                    self.errors.clear();
                }
            }
        }
        self.retrying = None;
        decisions.extend(self.learn_ceiling(micro_batch, tokens, seq_len, 1.0));
        self.unresponsive = false;
        self.micro_batch = micro_batch;
        if micro_batch <= self.floor() {
            self.ooms_at_min += 1;
            let retry_with = (self.ooms_at_min < self.cfg.max_ooms_at_min).then_some(micro_batch);
            return OomOutcome {
                decisions,
                retry_with,
            };
        }
        // The one-sequence probe failed: back to the size it came from, which ran.
        let to = if self.risk_probe && micro_batch == self.micro_batch {
            micro_batch - 1
        } else {
            self.after_oom(micro_batch, seq_len, !self.seen_first)
        };
        decisions.extend(self.resize(to, ResizeReason::Oom, 1.0));
        OomOutcome {
            decisions,
            retry_with: Some(self.micro_batch),
        }
    }
}

/// At most this share of the batch's memory at the shrink's size and length is left in
/// `obs`, if memory follows the batch: tokens scale it, and a token in a longer sequence
/// costs at most that much more (all of it attention).
fn shrunk_batch_share(p: PendingShrink, obs: StepObservation) -> f64 {
    let stretch = (obs.seq_len as f64 / p.seq_len.max(1) as f64).max(1.0);
    obs.micro_batch as f64 / p.from.max(1) as f64 * stretch * stretch
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
