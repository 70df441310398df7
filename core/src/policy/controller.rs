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
            // room the issue's first failure stalled in. Probe one more, once per run (an
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
                    // No percentage: from one reading it would be an extrapolation
                    // (919% was seen), read as a risk that was never measured.
                    text: format!(
                        "holding at {mb}: only one size has been measured, so how much of \
                         the memory grows with the batch is not known yet; {} × {seq} is not \
                         tried while it could pass the critical threshold{}",
                        mb + 1,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Profile;

    const MIB: u64 = 1 << 20;
    const LIMIT: u64 = 4096 * MIB;

    /// A linear device: 700 MiB fixed, 400 KiB per token, optional ±noise.
    struct Sim {
        fixed: u64,
        per_token: u64,
        noise: f64,
        rng: u64,
    }

    impl Sim {
        fn new(noise: f64) -> Sim {
            Sim {
                fixed: 700 * MIB,
                per_token: 400 * 1024,
                noise,
                rng: 42,
            }
        }
        fn peak(&mut self, mb: usize, seq: usize) -> u64 {
            self.rng = self
                .rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (self.rng >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            let exact = (self.fixed + self.per_token * (mb * seq) as u64) as f64;
            (exact * (1.0 + self.noise * u)) as u64
        }
        /// Largest micro-batch whose true peak is under `fraction` of LIMIT.
        fn largest(&self, fraction: f64, seq: usize) -> usize {
            ((fraction * LIMIT as f64 - self.fixed as f64) / (self.per_token * seq as u64) as f64)
                .floor() as usize
        }
    }

    fn cfg(seq: usize) -> ControllerConfig {
        ControllerConfig {
            max_micro_batch: 4096,
            max_seq_len: seq,
            ..Default::default()
        }
    }

    fn resizes(ds: &[Decision]) -> Vec<(usize, usize, ResizeReason)> {
        ds.iter()
            .filter_map(|d| match d {
                Decision::Resize {
                    from, to, reason, ..
                } => Some((*from, *to, *reason)),
                _ => None,
            })
            .collect()
    }

    /// Runs `steps` steps at a fixed seq_len; returns every resize.
    fn drive(
        c: &mut Controller,
        sim: &mut Sim,
        seq: usize,
        steps: u64,
    ) -> Vec<(u64, usize, usize, ResizeReason)> {
        resizes_of(&drive_with(c, 1..=steps, |_| seq, |mb, s| sim.peak(mb, s)).0)
    }

    #[test]
    fn reaches_the_feasible_size_from_far_below_in_three_adjustments_and_holds() {
        // Up to 256× below: ×4 while one size is known, then ×8, ×8.
        for (seq, start) in [(64usize, 1usize), (128, 1), (32, 2), (16, 4)] {
            let mut sim = Sim::new(0.0);
            let best = sim.largest(0.90, seq);
            assert!(best >= 50 * start, "far below: start {start}, best {best}");
            let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, start);
            let changes = drive(&mut c, &mut sim, seq, 200);
            assert!(
                changes.len() <= 3,
                "seq {seq}: {} adjustments: {changes:?}",
                changes.len()
            );
            assert!(changes.iter().all(|c| c.3 == ResizeReason::Grow));
            let mb = c.micro_batch();
            assert!(mb <= best, "seq {seq}: {mb} is above the feasible {best}");
            assert!(
                mb as f64 >= 0.9 * best as f64,
                "seq {seq}: {mb} not within 10% of {best}"
            );
        }
    }

    /// An allocator's peak repeats to the byte (a CUDA run), yet the controller had
    /// assumed every reading may be 2% off: from micro-batch 1 over a fixed part of 75%,
    /// each growth could only go as far as that assumed scatter allowed (1 → 2 → 10 → 72
    /// → 286 of a feasible 307). Told its meter is exact: 1 → 2 → 32 → 256 (87.5%; the
    /// last few percent are not worth a fourth adjustment).
    #[test]
    fn an_exact_meter_is_not_held_to_the_resident_sets_scatter() {
        let seq = 64;
        let run = |reading_noise: f64| {
            let mut sim = Sim {
                fixed: 3072 * MIB,
                per_token: 32 * 1024,
                noise: 0.0,
                rng: 1,
            };
            let best = sim.largest(0.90, seq);
            let config = ControllerConfig {
                reading_noise,
                ..cfg(seq)
            };
            let mut c = Controller::new(config, Thresholds::default(), LIMIT, 1);
            // Before the first step: the model, not yet the optimizer state.
            c.set_baseline(2600 * MIB);
            let (ds, worst) = drive_with(&mut c, 1..=60, |_| seq, |mb, s| sim.peak(mb, s));
            (resizes_of(&ds), c.micro_batch(), best, worst)
        };
        let (changes, mb, best, worst) = run(ALLOCATOR_NOISE);
        assert!(changes.len() <= 3, "{changes:?}");
        // Within 10% of the feasible size, or (the last growth not worth its few
        // percent) within 3.5% of the limit under target.
        let usage = (3072 * MIB + 32 * 1024 * (mb * seq) as u64) as f64 / LIMIT as f64;
        assert!(
            mb <= best && (mb as f64 >= 0.9 * best as f64 || usage >= 0.865),
            "{mb} vs {best} at {usage}: {changes:?}"
        );
        assert!(worst < Thresholds::default().target, "{worst}");
        // The resident set's scatter, assumed of the same exact readings, takes more.
        let (changes, ..) = run(RSS_NOISE);
        assert!(changes.len() > 3, "{changes:?}");
    }

    /// A tiny batch on a huge limit (a small model on host memory): every growth adds
    /// less usage than readings scatter by, yet lands far under target; the controller
    /// must still grow back between OOMs (injected faults, as trainer/tests/control.rs).
    #[test]
    fn growth_far_under_target_is_never_held_as_within_noise() {
        let seq = 64;
        let mut sim = Sim {
            fixed: 200 * MIB,
            per_token: 64,
            noise: 0.0,
            rng: 1,
        };
        let config = ControllerConfig {
            max_micro_batch: 8,
            ..cfg(seq)
        };
        let mut c = Controller::new(config, Thresholds::default(), 24 * 1024 * MIB, 4);
        for step in 1..=12u64 {
            if [2, 5, 9].contains(&step) {
                let mb = c.micro_batch();
                let retry = c.on_oom(mb, seq).retry_with.expect("retried");
                assert!(retry < mb, "step {step}: retried with {retry} after {mb}");
            }
            c.before_step(seq);
            let mb = c.micro_batch();
            c.observe(StepObservation {
                step,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: sim.peak(mb, seq),
            });
        }
        // Each OOM's retry was smaller than the size it struck at: between them the
        // controller grew back under the ceiling it learned, though every growth was
        // "within noise" of a 24 GiB limit.
    }

    #[test]
    fn no_oscillation_at_steady_state_with_noisy_readings() {
        let seq = 128;
        let mut sim = Sim::new(0.01);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 2);
        drive(&mut c, &mut sim, seq, 20);
        let settled = c.micro_batch();
        let later = drive(&mut c, &mut sim, seq, 200);
        assert!(later.is_empty(), "resized at steady state: {later:?}");
        assert_eq!(c.micro_batch(), settled);
        let best = sim.largest(0.90, seq);
        assert!(settled as f64 >= 0.85 * best as f64, "{settled} vs {best}");
    }

    /// Readings that scatter ±2% around the truth: the margin learned from the model's
    /// errors keeps every settled step under target, not just on average.
    #[test]
    fn noisy_readings_settle_under_target() {
        let seq = 128;
        let t = Thresholds::default();
        let mut sim = Sim::new(0.02);
        let mut c = Controller::new(cfg(seq), t, LIMIT, 1);
        drive(&mut c, &mut sim, seq, 30);
        assert!(
            c.margin() > MIN_MARGIN,
            "noise widens the margin: {}",
            c.margin()
        );
        for s in 31..=300 {
            let mb = c.micro_batch();
            let peak = sim.peak(mb, seq);
            let usage = peak as f64 / LIMIT as f64;
            assert!(usage < t.target, "step {s}: {usage} at micro-batch {mb}");
            c.observe(StepObservation {
                step: s,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: peak,
            });
        }
        assert!(c.micro_batch() as f64 >= 0.9 * sim.largest(t.target, seq) as f64);
    }

    #[test]
    fn varying_sequence_length_never_crosses_critical() {
        let max_seq = 512;
        let t = Thresholds::default();
        let mut sim = Sim::new(0.005);
        let mut c = Controller::new(cfg(max_seq), t, LIMIT, 1);
        let mut rng = 7u64;
        let mut worst: f64 = 0.0;
        for s in 1..=300u64 {
            rng = crate::policy::controller::tests::next(rng);
            // A curriculum that ramps up, plus random lengths up to the maximum.
            let seq = if s < 100 {
                16 + (s as usize * 4).min(max_seq - 16)
            } else {
                16 + (rng % (max_seq as u64 - 15)) as usize
            };
            c.before_step(seq);
            let mb = c.micro_batch();
            let peak = sim.peak(mb, seq);
            worst = worst.max(peak as f64 / LIMIT as f64);
            c.observe(StepObservation {
                step: s,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: peak,
            });
        }
        assert!(worst < t.critical, "peak usage {worst}");
        assert!(worst > 0.5, "the controller did grow: {worst}");
    }

    /// A curriculum longer than the configured maximum: the forecast catches it.
    #[test]
    fn forecast_shrinks_before_a_longer_batch_arrives() {
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(64), Thresholds::default(), LIMIT, 1);
        drive(&mut c, &mut sim, 64, 10);
        let mb = c.micro_batch();
        let ds = c.before_step(256);
        assert!(ds
            .iter()
            .any(|d| matches!(d, Decision::Warning { forecast: true, .. })));
        let r = resizes(&ds);
        assert_eq!(r.len(), 1, "{ds:?}");
        assert_eq!((r[0].0, r[0].2), (mb, ResizeReason::Forecast));
        assert!(r[0].1 <= sim.largest(0.90, 256));
        // Pinned: the same forecast only warns.
        let mut p = Controller::new(cfg(64), Thresholds::default(), LIMIT, 1);
        drive(&mut p, &mut sim, 64, 10);
        p.pin(p.micro_batch());
        let ds = p.before_step(256);
        assert!(resizes(&ds).is_empty());
        assert!(matches!(ds[0], Decision::Warning { forecast: true, .. }));
    }

    pub(super) fn next(x: u64) -> u64 {
        x.wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
            >> 1
    }

    #[test]
    fn oom_learns_a_ceiling_that_growth_respects_and_slowly_forgets() {
        let seq = 64;
        // The device really fails above 60 sequences although the model would allow more
        // (fragmentation, another process): the ceiling must hold growth below it.
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(
            ControllerConfig {
                forget_every: 50,
                ..cfg(seq)
            },
            Thresholds::default(),
            LIMIT,
            120,
        );
        let out = c.on_oom(120, seq);
        assert!(out
            .decisions
            .iter()
            .any(|d| matches!(d, Decision::EmptyCache { .. })));
        assert!(out.decisions.contains(&Decision::CeilingLearned {
            micro_batch: 120,
            tokens: 120 * 64,
            usage: 1.0
        }));
        // Nothing measured yet: an eighth, not half (a start far too large would fail
        // step after step by halves).
        assert_eq!(out.retry_with, Some(15));
        let out = c.on_oom(60, seq);
        assert_eq!(c.ceiling_tokens(), Some(60 * 64));
        let retry = out.retry_with.unwrap();
        assert!(retry <= 30);
        let mut max_seen = 0;
        for s in 1..=40u64 {
            c.before_step(seq);
            let mb = c.micro_batch();
            max_seen = max_seen.max(mb);
            c.observe(StepObservation {
                step: s,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: sim.peak(mb, seq),
            });
        }
        assert_eq!(max_seen, 59, "grows to just under the ceiling");
        // After forget_every clean steps the ceiling rises by 10%.
        let ds = drive(&mut c, &mut sim, seq, 20);
        assert!(c.ceiling_tokens().unwrap() > 60 * 64);
        assert!(ds.iter().any(|d| d.3 == ResizeReason::Grow), "{ds:?}");
    }

    /// Measured on a CPU run under an 800 MiB cap: after OOMs at 256 and 128, growth from
    /// the first two real readings stays under target less the margin.
    #[test]
    fn growth_after_ooms_plans_under_target_less_margin() {
        let limit = 800 * MIB;
        let mut c = Controller::new(cfg(64), Thresholds::default(), limit, 256);
        c.on_oom(256, 64);
        c.on_oom(128, 64);
        // Nothing measured: an eighth of 128 (the run measured its readings at 64).
        assert_eq!(c.micro_batch(), 16);
        c.pin(64);
        c.unpin();
        let obs = |step, micro_batch, peak_bytes| StepObservation {
            step,
            micro_batch,
            seq_len: 64,
            peak_bytes,
        };
        // The first step peaks low (optimizer state) and is not a reading of the footprint.
        c.observe(obs(1, 64, 600_000_000));
        assert_eq!(c.micro_batch(), 64);
        c.observe(obs(2, 64, 657_674_240));
        let mb = c.micro_batch();
        let peak = 720_179_200 + (mb as i64 - 73) * 108_515 * 64;
        c.observe(obs(3, mb, peak as u64));
        let mb = c.micro_batch();
        assert!(mb > 73, "grew again: {mb}");
        let predicted = c.predicted_usage(mb, 64).unwrap();
        assert!(
            predicted <= 0.9 - YOUNG_MARGIN + 1e-9,
            "grew to {mb}, predicted at {predicted}"
        );
    }

    /// The footprint creeps up at a fixed size (fragmentation): one reading above target
    /// moves nothing, three in a row free the cache, three more shrink once, and then it
    /// holds.
    #[test]
    fn sustained_drift_above_target_frees_the_cache_then_shrinks_once() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 8);
        drive(&mut c, &mut sim, seq, 10);
        let settled = c.micro_batch();
        sim.fixed += (0.04 * LIMIT as f64) as u64;
        let mut changes = Vec::new();
        let mut frees = Vec::new();
        for s in 11..=40 {
            let mb = c.micro_batch();
            let ds = c.observe(StepObservation {
                step: s,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: sim.peak(mb, seq),
            });
            if ds.iter().any(|d| matches!(d, Decision::EmptyCache { .. })) {
                frees.push(s);
            }
            for (f, t, r) in resizes(&ds) {
                changes.push((s, f, t, r));
            }
        }
        assert_eq!(
            frees,
            vec![13],
            "the cache first, after three steps over target"
        );
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0].0, 16, "then three more steps");
        assert_eq!(
            (changes[0].1, changes[0].3),
            (settled, ResizeReason::OverTarget)
        );
        let usage = sim.peak(c.micro_batch(), seq) as f64 / LIMIT as f64;
        assert!(usage < 0.9, "{usage}");
    }

    /// Steps `steps` times with sequence lengths from `seq_at` and peaks from `peak`;
    /// returns every decision by step and the highest usage measured.
    fn drive_with(
        c: &mut Controller,
        steps: std::ops::RangeInclusive<u64>,
        seq_at: impl Fn(u64) -> usize,
        mut peak: impl FnMut(usize, usize) -> u64,
    ) -> (Vec<(u64, Decision)>, f64) {
        let mut all = Vec::new();
        let mut worst: f64 = 0.0;
        for s in steps {
            let seq = seq_at(s);
            all.extend(c.before_step(seq).into_iter().map(|d| (s, d)));
            let mb = c.micro_batch();
            let p = peak(mb, seq);
            worst = worst.max(p as f64 / LIMIT as f64);
            let ds = c.observe(StepObservation {
                step: s,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: p,
            });
            all.extend(ds.into_iter().map(|d| (s, d)));
        }
        (all, worst)
    }

    fn obs(step: u64, micro_batch: usize, seq_len: usize, peak_bytes: u64) -> StepObservation {
        StepObservation {
            step,
            micro_batch,
            seq_len,
            peak_bytes,
        }
    }

    fn resizes_of(ds: &[(u64, Decision)]) -> Vec<(u64, usize, usize, ResizeReason)> {
        ds.iter()
            .filter_map(|(s, d)| match d {
                Decision::Resize {
                    from, to, reason, ..
                } => Some((*s, *from, *to, *reason)),
                _ => None,
            })
            .collect()
    }

    /// Measured in the controller benchmark: usage held at 91% by memory the batch does
    /// not own. Freeing the cache and one shrink are worth trying; shrinking every three
    /// steps after that (it went from 93 to 50) only gives up throughput.
    #[test]
    fn over_target_stops_shrinking_when_usage_does_not_follow() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 8);
        drive(&mut c, &mut sim, seq, 10);
        let stuck = (0.9136 * LIMIT as f64) as u64;
        let (ds, _) = drive_with(&mut c, 11..=200, |_| seq, |_, _| stuck);
        let r = resizes_of(&ds);
        assert_eq!(r.len(), 1, "one shrink, then hold: {r:?}");
        assert_eq!(r[0].3, ResizeReason::OverTarget);
        let frees = ds
            .iter()
            .filter(|(_, d)| matches!(d, Decision::EmptyCache { .. }))
            .count();
        assert_eq!(
            frees, 2,
            "before the shrink and when it did not help: {ds:?}"
        );
        assert!(c.is_unresponsive());
        assert!(ds.iter().any(|(_, d)| matches!(d,
            Decision::Warning { text, .. } if text.contains("held apart from the batch"))));
        // The memory comes back: usage falls under target and growth resumes.
        let (ds, worst) = drive_with(&mut c, 201..=260, |_| seq, |mb, s| sim.peak(mb, s));
        assert!(!c.is_unresponsive());
        assert!(resizes_of(&ds).iter().any(|r| r.3 == ResizeReason::Grow));
        assert!(worst < 0.9, "{worst}");
    }

    /// Measured in the controller benchmark: usage stuck at critical while the critical
    /// rule shrank by one per step (62 to 34), and then the model, fitted through equal
    /// peaks, put the micro-batch at 1.
    #[test]
    fn critical_does_not_ratchet_down_when_usage_is_stuck() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 8);
        drive(&mut c, &mut sim, seq, 10);
        let settled = c.micro_batch();
        let stuck = (0.96 * LIMIT as f64) as u64;
        let (ds, _) = drive_with(&mut c, 11..=100, |_| seq, |_, _| stuck);
        let r = resizes_of(&ds);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].3, ResizeReason::Critical);
        assert!(
            c.micro_batch() as f64 >= 0.8 * settled as f64,
            "{} from {settled}",
            c.micro_batch()
        );
        assert!(c.is_unresponsive());
        // Issue 11: emergency halving while the memory is not the batch's is how a soft
        // budget collapsed to one sequence. It frees the cache and holds; an OOM is still
        // recovered.
        let mb = c.micro_batch();
        let ds = c.observe(StepObservation {
            step: 101,
            micro_batch: mb,
            seq_len: seq,
            peak_bytes: (0.98 * LIMIT as f64) as u64,
        });
        assert!(resizes(&ds).is_empty(), "{ds:?}");
        assert!(ds.iter().any(|d| matches!(d, Decision::EmptyCache { .. })));
        assert_eq!(c.on_oom(mb, seq).retry_with, Some(mb / 2));
    }

    /// Attention's cost per token grows with the sequence, which a fit in tokens cannot
    /// see. Measured in the controller benchmark: grown to 95 at 26 tokens (predicted 87%
    /// at 64), the run then read 96% at 52 tokens and 99% at 64.
    #[test]
    fn a_length_ramp_stays_under_critical_when_attention_is_quadratic() {
        let max_seq = 64usize;
        let t = Thresholds::default();
        // 700 MiB fixed, 100 KiB per token, 6 KiB per token per token of context.
        let peak = |mb: usize, seq: usize| {
            700 * MIB + (mb * seq) as u64 * (100 * 1024 + 6 * 1024 * seq as u64)
        };
        let ramp = |s: u64| (16 + s as usize / 2).min(max_seq);
        let mut c = Controller::new(cfg(max_seq), t, LIMIT, 1);
        let (ds, worst) = drive_with(&mut c, 1..=300, ramp, peak);
        assert!(
            worst < t.critical,
            "peak usage {worst}: {:?}",
            resizes_of(&ds)
        );
        // Once the longest length has been measured, it still finds the feasible size.
        let best = (1..4096)
            .take_while(|&mb| peak(mb, max_seq) < (0.9 * LIMIT as f64) as u64)
            .count();
        assert!(
            c.micro_batch() as f64 >= 0.85 * best as f64 && c.micro_batch() <= best,
            "{} vs {best}",
            c.micro_batch()
        );
    }

    /// Benchmark: an emergency at 70 shrank to 35 and the robust fit, which treats the one
    /// bad reading as an outlier, grew straight back to 67. A footprint with a step in it
    /// (allocator rounding) shows the same: the emergency must bound later growth.
    #[test]
    fn an_emergency_sets_a_ceiling_so_the_run_does_not_grow_back_into_it() {
        let seq = 64;
        let t = Thresholds::default();
        // Linear up to 100 sequences, then 10% more of the limit at once.
        let peak = |mb: usize, seq: usize| {
            let jump = if mb > 100 { LIMIT / 10 } else { 0 };
            700 * MIB + (mb * seq) as u64 * 400 * 1024 + jump
        };
        let mut c = Controller::new(cfg(seq), t, LIMIT, 8);
        let (ds, _) = drive_with(&mut c, 1..=20, |_| seq, peak);
        let first = ds
            .iter()
            .position(|(_, d)| {
                matches!(
                    d,
                    Decision::Resize {
                        reason: ResizeReason::Emergency | ResizeReason::Critical,
                        ..
                    }
                )
            })
            .expect("the step in the footprint is hit once");
        assert!(ds[..(first + 2).min(ds.len())]
            .iter()
            .any(|(_, d)| matches!(d, Decision::CeilingLearned { .. })));
        let ceiling = c.ceiling_tokens().unwrap();
        let (ds, worst) = drive_with(&mut c, 21..=150, |_| seq, peak);
        assert!(
            worst < t.critical,
            "grew back into it ({worst}): {:?}",
            resizes_of(&ds)
        );
        assert!(c.ceiling_tokens().unwrap() <= ceiling);
        assert!(c.micro_batch() >= 80, "{}", c.micro_batch());
    }

    #[test]
    fn repeated_oom_at_one_gives_up() {
        let mut c = Controller::new(cfg(64), Thresholds::default(), LIMIT, 2);
        assert_eq!(c.on_oom(2, 64).retry_with, Some(1));
        assert_eq!(c.on_oom(1, 64).retry_with, Some(1));
        assert_eq!(c.on_oom(1, 64).retry_with, Some(1));
        assert_eq!(c.on_oom(1, 64).retry_with, None);
    }

    #[test]
    fn critical_shrinks_and_emergency_frees_cache_and_shrinks_hard() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 8);
        drive(&mut c, &mut sim, seq, 5);
        let mb = c.micro_batch();
        // Something else takes memory: the same size now reads 96%.
        let ds = c.observe(StepObservation {
            step: 6,
            micro_batch: mb,
            seq_len: seq,
            peak_bytes: (0.96 * LIMIT as f64) as u64,
        });
        let r = resizes(&ds);
        assert_eq!(r[0].2, ResizeReason::Critical, "{ds:?}");
        assert!(r[0].1 < mb);
        // Emergency at a settled size whose memory has followed the batch (a shrink
        // that did not help would mark it as not the batch's: see
        // critical_does_not_ratchet_down_when_usage_is_stuck).
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 8);
        drive(&mut c, &mut sim, seq, 5);
        let mb = c.micro_batch();
        let ds = c.observe(StepObservation {
            step: 7,
            micro_batch: mb,
            seq_len: seq,
            peak_bytes: (0.99 * LIMIT as f64) as u64,
        });
        assert!(ds.iter().any(|d| matches!(d, Decision::EmptyCache { .. })));
        let r = resizes(&ds);
        assert_eq!(r[0].2, ResizeReason::Emergency);
        assert!(r[0].1 <= mb.div_ceil(2));
    }

    #[test]
    fn pinned_only_warns_and_unpin_resumes_growth() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 4);
        let pin = c.pin(1000);
        assert_eq!(resizes(&pin), vec![(4, 1000, ResizeReason::Pinned)]);
        let ds = drive(&mut c, &mut sim, seq, 10);
        assert!(ds.is_empty(), "pinned but resized: {ds:?}");
        assert_eq!(c.micro_batch(), 1000);
        // 1000 × 64 tokens is far above critical: one warning, not ten.
        let mut warnings = 0;
        for s in 0..5 {
            let ds = c.observe(StepObservation {
                step: s,
                micro_batch: 1000,
                seq_len: seq,
                peak_bytes: sim.peak(1000, seq),
            });
            warnings += ds
                .iter()
                .filter(|d| {
                    matches!(
                        d,
                        Decision::Warning {
                            forecast: false,
                            ..
                        }
                    )
                })
                .count();
            assert!(resizes(&ds).is_empty());
        }
        assert!(warnings <= 1);
        c.unpin();
        let ds = drive(&mut c, &mut sim, seq, 3);
        assert!(ds.iter().any(|d| d.3 == ResizeReason::Critical
            || d.3 == ResizeReason::Emergency
            || d.3 == ResizeReason::Forecast));
        assert!(c.micro_batch() <= sim.largest(0.95, seq));
    }

    #[test]
    fn invalid_thresholds_are_rejected_and_the_old_kept() {
        let mut c = Controller::new(cfg(64), Profile::Conservative.thresholds(), LIMIT, 4);
        let bad = Thresholds {
            target: 0.9,
            warning: 0.8,
            critical: 0.95,
            emergency: 0.97,
        };
        let err = c.set_thresholds(bad).unwrap_err();
        assert!(err.0.contains("warning"), "{err}");
        assert_eq!(c.thresholds(), Profile::Conservative.thresholds());
        c.set_thresholds(Profile::Aggressive.thresholds()).unwrap();
        assert_eq!(c.thresholds(), Profile::Aggressive.thresholds());
    }

    #[test]
    fn not_adaptive_never_resizes_but_warns() {
        let seq = 64;
        let mut sim = Sim::new(0.0);
        let mut c = Controller::new(
            ControllerConfig {
                adaptive: false,
                ..cfg(seq)
            },
            Thresholds::default(),
            LIMIT,
            4,
        );
        assert!(drive(&mut c, &mut sim, seq, 10).is_empty());
        let ds = c.observe(StepObservation {
            step: 11,
            micro_batch: 4,
            seq_len: seq,
            peak_bytes: LIMIT,
        });
        assert!(resizes(&ds).is_empty());
        assert!(ds.iter().any(|d| matches!(d, Decision::Warning { .. })));
    }
    /// Issue 11, failure 1: micro-batch 1 at 49% of an 800 MiB budget never grew (the
    /// proportional fit rounds to 1). The baseline measured before the first step tells
    /// the fixed part.
    #[test]
    fn a_small_start_grows_when_the_fixed_part_is_large() {
        let limit = 800 * MIB;
        let seq = 64;
        // 380 MiB fixed (350 of it present before step 1), 12 KiB per token.
        let peak = |mb: usize, _| 380 * MIB + (mb * seq) as u64 * 12 * 1024;
        let mut c = Controller::new(
            ControllerConfig {
                max_micro_batch: 256,
                ..cfg(seq)
            },
            Thresholds::default(),
            limit,
            1,
        );
        c.set_baseline(350 * MIB);
        let (ds, worst) = drive_with(&mut c, 1..=60, |_| seq, peak);
        let best = (1..=256)
            .take_while(|&mb| (peak(mb, seq) as f64) < 0.9 * limit as f64)
            .count();
        let r = resizes_of(&ds);
        assert!(r.len() <= 3, "{r:?}");
        assert!(c.micro_batch() as f64 >= 0.9 * best as f64 && c.micro_batch() <= best);
        assert!(worst * LIMIT as f64 / (limit as f64) < 0.9, "{worst}");
    }

    /// One step as the trainer runs it: told the longest length within `horizon` steps
    /// of `len`, then observed at the peak `peak` gives. Returns its decisions and peak.
    fn step_told_ahead(
        c: &mut Controller,
        s: u64,
        horizon: u64,
        len: &impl Fn(u64) -> usize,
        peak: &impl Fn(usize, usize) -> u64,
    ) -> (Vec<Decision>, u64) {
        let seq = len(s);
        let upcoming = (s + 1..=s + horizon).fold(
            Upcoming {
                seq_len: seq,
                step: s,
            },
            |best, k| {
                if len(k) > best.seq_len {
                    Upcoming {
                        seq_len: len(k),
                        step: k,
                    }
                } else {
                    best
                }
            },
        );
        let mut ds = c.before_step_ahead(seq, upcoming);
        let mb = c.micro_batch();
        let p = peak(mb, seq);
        ds.extend(c.observe(StepObservation {
            step: s,
            micro_batch: mb,
            seq_len: seq,
            peak_bytes: p,
        }));
        (ds, p)
    }

    /// The device both random-length tests run on: 900 MiB fixed, a token costing more in
    /// a longer sequence.
    fn attention_peak(mb: usize, seq: usize) -> u64 {
        900 * MIB + (mb * seq) as u64 * (30 * 1024 + 200 * seq as u64)
    }

    /// Resizes by step: (step, (from, to, reason)).
    type Changes = Vec<(u64, (usize, usize, ResizeReason))>;

    /// 200 steps from micro-batch 1, told the longest length of the next 16 each step:
    /// the controller, its resizes by step, and the worst usage.
    fn run_told_ahead(max_seq: usize, len: impl Fn(u64) -> usize) -> (Controller, Changes, f64) {
        let mut c = Controller::new(cfg(max_seq), Thresholds::default(), LIMIT, 1);
        c.set_baseline(850 * MIB);
        let mut changes = Vec::new();
        let mut worst: f64 = 0.0;
        for s in 1..=200u64 {
            let (ds, p) = step_told_ahead(&mut c, s, 16, &len, &attention_peak);
            worst = worst.max(p as f64 / LIMIT as f64);
            changes.extend(resizes(&ds).into_iter().map(|r| (s, r)));
        }
        (c, changes, worst)
    }

    /// Asserts the micro-batch is at most the largest whose peak at `seq` is under 90%,
    /// and within 10% of it.
    fn assert_feasible_at(c: &Controller, seq: usize) {
        let best = (1..4096)
            .take_while(|&mb| (attention_peak(mb, seq) as f64) < 0.9 * LIMIT as f64)
            .count();
        assert!(
            c.micro_batch() as f64 >= 0.9 * best as f64 && c.micro_batch() <= best,
            "{} vs {best}",
            c.micro_batch()
        );
    }

    /// Issue 11: random lengths with the trainer's 16-step horizon. Planned for the
    /// horizon's own longest, the size grew when a long length left the horizon and shrank
    /// when the next came in. Planned for the longest told so far, with the cost of a token
    /// fitted as a line in the length, it settles and stays.
    #[test]
    fn random_lengths_settle_without_churn() {
        let max_seq = 256usize;
        let len =
            |s: u64| 32 + (next(s.wrapping_mul(0x9e37_79b9)) % (max_seq as u64 - 31)) as usize;
        let (c, changes, worst) = run_told_ahead(max_seq, len);
        assert!(worst < Thresholds::default().critical, "{worst}");
        // Learning the curve takes a few adjustments early on; none after.
        assert!(changes.len() <= 6, "{changes:?}");
        assert!(changes.iter().all(|c| c.0 <= 20), "settled: {changes:?}");
        let longest = (1..=216).map(len).max().unwrap();
        assert_feasible_at(&c, longest);
    }

    /// Issue 11: random lengths whose longest (the configured 256) first comes at step
    /// 150. Planned for the horizon's longest, the run settled for the lengths up to 200
    /// and shrank when 256 came into view, 130 steps after it had settled. Once the
    /// lengths fall as well as rise, any step may bring the longest the run feeds: the run
    /// settles for it and does not move when it comes.
    #[test]
    fn random_lengths_settle_for_the_longest_the_run_feeds() {
        let max_seq = 256usize;
        let len = |s: u64| {
            if s == 150 {
                max_seq
            } else {
                32 + (next(s.wrapping_mul(0x9e37_79b9)) % 169) as usize
            }
        };
        let (c, changes, worst) = run_told_ahead(max_seq, len);
        assert!(worst < Thresholds::default().critical, "{worst}");
        assert!(changes.iter().all(|c| c.0 <= 20), "settled: {changes:?}");
        assert_feasible_at(&c, max_seq);
    }

    /// Issue 10: a ramp 64 → 256 over 60 steps held 16 with no word and then peaked at
    /// 95%. Told the longest length to come, the controller grows for it, says why it
    /// holds, and the longest length never crosses critical.
    #[test]
    fn told_the_lengths_to_come_it_holds_for_them_and_says_why() {
        let limit = 1 << 30;
        let peak =
            |mb: usize, seq: usize| 300 * MIB + (mb * seq) as u64 * (40 * 1024 + 160 * seq as u64);
        let ramp =
            |s: u64| 64 + ((192.0 * (s.saturating_sub(1).min(60)) as f64 / 60.0).round() as usize);
        let mut c = Controller::new(
            ControllerConfig {
                max_micro_batch: 256,
                ..cfg(256)
            },
            Thresholds::default(),
            limit,
            16,
        );
        c.set_baseline(280 * MIB);
        let mut worst: f64 = 0.0;
        let mut said = Vec::new();
        for s in 1..=120u64 {
            let (ds, p) = step_told_ahead(&mut c, s, 80, &ramp, &peak);
            worst = worst.max(p as f64 / limit as f64);
            said.extend(ds.into_iter().filter_map(|d| match d {
                Decision::Warning { text, .. } if text.starts_with("holding at") => Some(text),
                _ => None,
            }));
        }
        assert!(worst < 0.95, "{worst}");
        let best = (1..=256)
            .take_while(|&mb| (peak(mb, 256) as f64) < 0.9 * limit as f64)
            .count();
        assert!(
            c.micro_batch() as f64 >= 0.9 * best as f64,
            "{} vs {best}",
            c.micro_batch()
        );
        assert!(
            said.iter()
                .any(|t| t.contains("length 256 arrives by step 61")),
            "{said:?}"
        );
        let mut sizes: Vec<&str> = said.iter().filter_map(|t| t.split(':').next()).collect();
        let n = sizes.len();
        sizes.dedup();
        assert_eq!(sizes.len(), n, "said once per size: {said:?}");
    }

    /// Seen in the simulator: memory that follows the batch, but a shrink judged not to
    /// have lowered it, so the run held at critical for the rest of its steps (111 to 199
    /// of 200). Three ways it was misjudged: a one-size expectation that took the whole
    /// reading as the batch's (a fixed part of 0.83 halves usage by far less than half), a
    /// shrink on the first step, whose reading lacks the optimizer state (the next reads
    /// higher at half the size), and a small shrink planned on one size without a
    /// baseline, whose effect was within the noise. Each run must get under critical and
    /// stay there, at most at the feasible size.
    #[test]
    fn a_shrink_that_lowered_usage_less_than_guessed_is_not_taken_as_held_memory() {
        // (fixed, feasible sequences under target, start, baseline, missing from step 1,
        // step 2 runs out of memory)
        let cases = [
            (0.83, 606.0, 2424, Some(0.59), 0.25, false),
            (0.76, 7.0, 28, Some(0.68), 0.32, false),
            (0.83, 328.0, 1312, None::<f64>, 0.2, true),
        ];
        for (fixed, feasible, start, baseline, first_low, oom) in cases {
            let per_seq = (0.9 - fixed) / (feasible + 0.5);
            let truth = |mb: usize| fixed + mb as f64 * per_seq;
            let mut c = Controller::new(cfg(64), Thresholds::default(), LIMIT, start);
            if let Some(b) = baseline {
                c.set_baseline((b * LIMIT as f64) as u64);
            }
            let mut n = 0u32;
            let mut peak = |mb: usize| {
                n += 1;
                let low = if n == 1 { first_low } else { 0.0 };
                let jitter = if n % 2 == 1 { 1.008 } else { 0.992 };
                ((truth(mb) - low) * jitter * LIMIT as f64) as u64
            };
            let mut ds = Vec::new();
            let mut from = 1;
            if oom {
                // A hard budget: the first step runs (without the optimizer state), the
                // second does not fit and is retried at the size the controller picks.
                ds.extend(
                    c.observe(obs(1, start, 64, peak(start)))
                        .into_iter()
                        .map(|d| (1, d)),
                );
                let out = c.on_oom(start, 64);
                ds.extend(out.decisions.into_iter().map(|d| (2, d)));
                let retry = out.retry_with.unwrap();
                ds.extend(
                    c.observe(obs(2, retry, 64, peak(retry)))
                        .into_iter()
                        .map(|d| (2, d)),
                );
                from = 3;
            }
            ds.extend(drive_with(&mut c, from..=60, |_| 64, |mb, _| peak(mb)).0);
            let r = resizes_of(&ds);
            let late_critical: Vec<u64> = (9..=60)
                .filter(|s| {
                    ds.iter().any(|(at, d)| {
                        at == s
                            && matches!(d, Decision::Resize { usage, .. }
                                | Decision::Warning { usage, .. }
                                | Decision::EmptyCache { usage } if *usage >= 0.95)
                    })
                })
                .collect();
            assert!(
                !c.is_unresponsive(),
                "fixed {fixed}: held as unresponsive: {r:?}"
            );
            assert!(
                truth(c.micro_batch()) * 1.008 < 0.95 && late_critical.is_empty(),
                "fixed {fixed}: ends at {} ({:.3}), critical after step 8 at \
                 {late_critical:?}: {r:?}",
                c.micro_batch(),
                truth(c.micro_batch())
            );
            assert!(c.micro_batch() as f64 <= feasible, "{r:?}");
        }
    }

    /// Seen in the simulator: a soft start far too large read 285% on its first step and
    /// every step after it read the same high-water mark (270%: freed heap pages kept
    /// mapped). The first step's shrink cannot be judged (that step lacks the optimizer
    /// state), so the next reading shrinks once more, by half at most, and the forecast
    /// must not halve again on that same reading before a step has judged it: it took
    /// 50 → 25 → 13, a seventh of what fits.
    #[test]
    fn a_mark_held_from_the_first_step_is_not_halved_on_twice() {
        let seq = 128;
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 400);
        c.set_baseline((0.2 * LIMIT as f64) as u64);
        let mut n = 0;
        let (ds, _) = drive_with(
            &mut c,
            1..=30,
            |_| seq,
            |_, _| {
                n += 1;
                let usage = if n == 1 { 2.8528 } else { 2.7021 };
                (usage * LIMIT as f64) as u64
            },
        );
        let r = resizes_of(&ds);
        assert!(r.len() <= 2, "{r:?}");
        assert!(r.iter().all(|x| x.2 * 2 >= x.1 || x.0 == 1), "{r:?}");
        assert!(c.micro_batch() >= 25, "{r:?}");
        assert!(c.is_unresponsive());
    }

    /// Issue 11's first failure through the binary (800 MiB hard cap, start 1, a fixed
    /// part of 49%, 148 fits under target): 1 → 8 → 122, then held at 122 (83%). The
    /// growth from 8 followed the steepest line the noise allows, which over-predicted 122
    /// as it should; counted as the model's error, that kept 3% of the limit free, and
    /// the landing growth fell under the 10% least gain. A reading under that bound is
    /// not an error: with readings scattering by 0.5% the margin stays near that, and the
    /// run lands within 5% of what fits by step 5 (it landed at 136 of 148 here before).
    #[test]
    fn a_growth_along_the_noise_bound_that_lands_low_is_not_the_models_error() {
        let seq = 64;
        let fixed = 0.49;
        let per_seq = (0.888 - fixed) / 144.0;
        let truth = |mb: usize| fixed + mb as f64 * per_seq;
        let feasible = (1..1000).take_while(|&mb| truth(mb) < 0.9).count();
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 1);
        c.set_baseline((0.45 * LIMIT as f64) as u64);
        let mut n = 0u32;
        let (ds, _) = drive_with(
            &mut c,
            1..=5,
            |_| seq,
            |mb, _| {
                n += 1;
                // Step 1 lacks the optimizer state; readings scatter by 0.5%.
                let low = if n == 1 { 0.03 } else { 0.0 };
                let jitter = [1.0, 1.0, 1.005, 0.995, 1.003][n as usize % 5];
                ((truth(mb) - low) * jitter * LIMIT as f64) as u64
            },
        );
        let r = resizes_of(&ds);
        let mb = c.micro_batch();
        assert!(
            mb as f64 >= 0.95 * feasible as f64 && mb <= feasible && r.len() <= 3,
            "{mb} of {feasible}: {r:?}"
        );
    }

    /// A size settled just under target reads over it now and then; six readings in a
    /// row over it is that scatter, not drift, when the size's earlier readings scattered
    /// as much: the drift rule shrank such a landing a hundred steps later (a reversal).
    /// A limit that drops under the same bytes is still drift.
    #[test]
    fn a_streak_over_target_within_the_sizes_own_scatter_is_not_drift() {
        let seq = 64;
        let mut c = Controller::new(cfg(seq), Thresholds::default(), LIMIT, 100);
        let mut n = 0u64;
        let reading = |n: u64| {
            // 89.6% ± 0.8%, with steps 60..=66 all on the high side.
            let high = (60..=66).contains(&n) || n.is_multiple_of(2);
            0.896 * if high { 1.008 } else { 0.992 }
        };
        let (ds, _) = drive_with(
            &mut c,
            1..=100,
            |_| seq,
            |_, _| {
                n += 1;
                (reading(n) * LIMIT as f64) as u64
            },
        );
        let shrinks: Vec<_> = resizes_of(&ds).into_iter().filter(|r| r.2 < r.1).collect();
        assert!(shrinks.is_empty(), "{shrinks:?}");
        // The limit drops by 2%: the same bytes now read 91.4% ± 0.8%, every step over
        // target, and the drift rule acts.
        c.set_limit((LIMIT as f64 * 0.98) as u64);
        let (ds, _) = drive_with(
            &mut c,
            101..=120,
            |_| seq,
            |_, _| {
                n += 1;
                (reading(n) * LIMIT as f64) as u64
            },
        );
        assert!(
            resizes_of(&ds)
                .iter()
                .any(|r| r.3 == ResizeReason::OverTarget),
            "{:?}",
            resizes_of(&ds)
        );
    }

    /// Seen in the simulator (a soft budget, random lengths, freed heap pages kept mapped):
    /// a start far too large ran past the limit, and every later step read the same
    /// high-water mark. The emergency rule halved on it four times in a row (382 → 68 →
    /// 34 → 17) because each next step was longer than the one shrunk at, so whether the
    /// shrink had lowered usage was never judged. A longer length whose batch is still
    /// far smaller judges it too. The shrink made on the first step is not judged (that
    /// step peaks low: the optimizer state arrives after it), so the second step's reading
    /// past the limit shrinks once more; the one after it is judged, and the run holds.
    #[test]
    fn a_high_water_mark_with_random_lengths_does_not_halve_again_and_again() {
        let lens = [216usize, 240, 250, 459, 343, 245, 212, 156, 300, 480];
        let mut c = Controller::new(cfg(512), Thresholds::default(), LIMIT, 3060);
        c.set_baseline((0.18 * LIMIT as f64) as u64);
        let mark = (1.1543 * LIMIT as f64) as u64;
        let (ds, _) = drive_with(
            &mut c,
            1..=lens.len() as u64,
            |s| lens[s as usize - 1],
            |mb, seq| {
                if mb == 3060 {
                    (1.2194 * LIMIT as f64) as u64
                } else {
                    // The batch's own peak is far below: the reading is the mark.
                    mark.max((0.21 * LIMIT as f64) as u64 + (mb * seq) as u64 * 40)
                }
            },
        );
        let r = resizes_of(&ds);
        assert!(r.len() <= 2, "two shrinks at most, then hold: {r:?}");
        assert!(r.iter().all(|x| x.0 <= 2), "held after step 2: {r:?}");
        assert!(c.is_unresponsive());
        assert!(c.micro_batch() >= 3060 / 64, "{}", c.micro_batch());
    }
}
