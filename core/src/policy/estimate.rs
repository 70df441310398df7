//! What memory costs: the estimate the controller plans with, and how sure it is.
//!
//! `peak ≈ fixed + tokens × cost per token`, fitted from the run's own readings
//! ([`MemoryModel`]), trusted only as far as it has been earned:
//! - one size measured: the fixed part is the baseline measured before the first step
//!   (never above the lowest reading), which can only under-state it; for growth the
//!   reading is taken one noise high, so the line through both over-predicts every larger
//!   size;
//! - one length at sizes too close for their difference to be more than noise: the
//!   steepest line the noise allows through the largest size ([`Estimate::growth_line`]);
//! - lengths that vary: the cost of a token as a line in the length
//!   ([`MemoryModel::length_fit`]), extrapolated beyond the longest measured between "no
//!   cheaper than it" and "all of it quadratic"; until the lengths span enough for that,
//!   readings at (or nearest below) the length, scaled by the ratio of the lengths.
//!
//! How sure: the margin, the largest error the fitted model made over its last
//! [`ERROR_WINDOW`] predictions (at least 1%, 2% while the fit rests on two sizes, at most
//! 3% of the limit). Readings the batch does not set are kept out: censored ones at a
//! high-water mark (a floor), and a jump from outside memory moves the fixed part only.
use std::collections::VecDeque;

use super::memory_model::{median, MemoryModel};
use super::messages::StepObservation;

/// Predictions whose error sets the planning margin.
pub const ERROR_WINDOW: usize = 16;
pub(super) const MIN_MARGIN: f64 = 0.01;
/// While the fit rests on two sizes it has not been checked against a third: step peaks
/// scatter by about 1% run to run on CPU, so keep more room until it has.
const YOUNG_MARGIN: f64 = 0.02;
const MAX_MARGIN: f64 = 0.03;
/// A reading this far (share of the limit) above a model that has been right is memory
/// taken from outside the batch (see [`Estimate::jumped`]).
const JUMP: f64 = 0.03;

/// The estimate of what a step's peak will be, in bytes and as a share of the limit.
#[derive(Debug, Clone)]
pub struct Estimate {
    model: MemoryModel,
    /// Memory in use before the first step (model, and optimizer state if it exists).
    baseline: Option<u64>,
    /// |predicted − measured| / limit of the fitted model's latest predictions.
    errors: VecDeque<f64>,
    /// The longest sequence among the model's readings.
    max_seq_seen: usize,
    /// A peak measured twice to the byte at different sizes: memory held at a high-water
    /// mark. Readings at or under it do not follow the batch.
    floor_bytes: Option<u64>,
    /// How far one reading may lie from the batch's own peak, as a share of it.
    noise: f64,
    /// The readings count a fragmented heap
    /// ([`ControllerConfig::heap_fragments`](super::ControllerConfig::heap_fragments)).
    heap_fragments: bool,
    /// What usages are shares of: the limit told, or the one the errors taught when lower.
    limit_bytes: u64,
    /// The limit the trainer told.
    told_bytes: u64,
    /// A limit taught by errors the trainer's limit did not explain (it fell silently):
    /// what a size that failed would have peaked at.
    fell_to: Option<u64>,
}

impl Estimate {
    pub fn new(noise: f64, heap_fragments: bool, limit_bytes: u64) -> Estimate {
        Estimate {
            model: MemoryModel::new(),
            baseline: None,
            errors: VecDeque::with_capacity(ERROR_WINDOW),
            max_seq_seen: 0,
            floor_bytes: None,
            noise: noise.clamp(0.0, 0.2),
            heap_fragments,
            limit_bytes: limit_bytes.max(1),
            told_bytes: limit_bytes.max(1),
            fell_to: None,
        }
    }

    pub fn model(&self) -> &MemoryModel {
        &self.model
    }
    pub fn baseline(&self) -> Option<u64> {
        self.baseline
    }
    pub fn set_baseline(&mut self, bytes: u64) {
        self.baseline = Some(bytes);
    }
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }
    /// True when the limit changed.
    pub fn set_limit(&mut self, bytes: u64) -> bool {
        self.told_bytes = bytes.max(1);
        self.limit_in_force()
    }
    /// The limit fell to `bytes` or below without the trainer's limit saying so: usages are
    /// shares of it from now on (true when that changed the limit in force).
    pub fn limit_fell(&mut self, bytes: u64) -> bool {
        self.fell_to = Some(self.fell_to.map_or(bytes, |f| f.min(bytes)).max(1));
        self.limit_in_force()
    }
    /// The limit errors taught is forgotten (their ceiling was raised).
    pub fn forget_fallen_limit(&mut self) -> bool {
        self.fell_to = None;
        self.limit_in_force()
    }
    /// Whether errors taught a limit lower than the trainer's.
    pub fn limit_has_fallen(&self) -> bool {
        self.fell_to.is_some_and(|f| f < self.told_bytes)
    }
    fn limit_in_force(&mut self) -> bool {
        let bytes = self
            .fell_to
            .map_or(self.told_bytes, |f| f.min(self.told_bytes));
        let changed = bytes != self.limit_bytes;
        self.limit_bytes = bytes;
        changed
    }
    pub fn noise(&self) -> f64 {
        self.noise
    }
    /// The longest length the readings cover: beyond it every cost is extrapolated.
    pub fn longest_measured(&self) -> usize {
        self.max_seq_seen
    }
    /// Two sizes or more measured: the fixed part and the cost per token separate.
    pub fn is_fitted(&self) -> bool {
        self.model.is_fitted()
    }
    pub fn distinct_sizes(&self) -> usize {
        self.model.distinct_sizes()
    }
    /// The fixed part assumed while only one size has been measured: the baseline, never
    /// above the lowest reading.
    pub fn one_size_fixed(&self) -> f64 {
        let lowest = self.model.points().map(|p| p.1).min().unwrap_or(0);
        self.baseline.map_or(0.0, |b| b.min(lowest) as f64)
    }

    /// (fixed bytes, bytes per token at `seq_len`) of the model as far as it is earned.
    /// `inflate`: with one size measured, take its reading one noise high (for
    /// growth, where a low reading would over-reach).
    pub fn cost_at(&self, seq_len: usize, inflate: bool) -> Option<(f64, f64)> {
        let (fit_fixed, slope) = self.model.coefficients()?;
        let seq_len = seq_len.max(1);
        if !self.model.is_fitted() {
            return self.one_size_cost(seq_len, inflate);
        }
        let fixed = fit_fixed
            .max(self.baseline.map_or(0.0, |b| b as f64))
            .max(0.0);
        if !self.lengths_vary() {
            // One length: the fit's slope is the cost of its tokens.
            // Between sizes too close for their difference to be more than noise, the line
            // growth follows is the estimate for prediction too: a fitted slope that fell
            // back to proportional (fixed 0, every byte per token) would predict a size just
            // grown to far past the limit, and the forecast would halve it before it ran.
            let s = self.model.points().next().map_or(0, |p| p.2);
            if let Some((fixed, per)) = self.growth_line(slope) {
                return Some((fixed, per * stretch(seq_len, s)));
            }
            return Some((fixed, slope.max(0.0) * stretch(seq_len, s)));
        }
        // Lengths vary: a token costs more in a longer sequence, and a line through all
        // lengths averages that away. Fit the cost of a token as a line in the length.
        if let Some(fit) = self.model.length_fit_over(self.heap_fragments) {
            return self.length_cost(seq_len, fit);
        }
        Some(self.nearest_cost(seq_len, fixed, slope)).filter(|c| c.1 > 0.0)
    }

    /// [`cost_at`](Self::cost_at) with one size measured: the reading above the fixed
    /// part assumed, per token, stretched to a longer length as if all quadratic.
    fn one_size_cost(&self, seq_len: usize, inflate: bool) -> Option<(f64, f64)> {
        let fixed = self.one_size_fixed();
        let per = self
            .model
            .points()
            .map(|(t, p, s)| {
                let high = if inflate && self.baseline.is_some() {
                    p as f64 * (1.0 + self.noise)
                } else {
                    p as f64
                };
                (high - fixed).max(0.0) / t as f64 * stretch(seq_len, s)
            })
            .fold(0.0, f64::max);
        (per > 0.0).then_some((fixed, per))
    }

    /// [`cost_at`](Self::cost_at) from the fit across lengths `(fixed, a, b)`.
    fn length_cost(&self, seq_len: usize, (f, a, b): (f64, f64, f64)) -> Option<(f64, f64)> {
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
        (per > 0.0).then_some((fixed, per))
    }

    /// [`cost_at`](Self::cost_at) with too few lengths to fit the cost across them: what
    /// tokens cost in readings at (or, scaled, nearest below) the length asked about.
    /// Readings whose token counts differ only because the length crept (one micro-batch
    /// on a ramp) cannot separate the fixed part from the per-token cost: their fitted
    /// slope is noise, and near zero it puts the whole peak in the fixed part and grows
    /// far past what fits (29 to 173, 3.4× the limit). Their fixed part is the baseline's,
    /// as with one size.
    fn nearest_cost(&self, seq_len: usize, fixed: f64, slope: f64) -> (f64, f64) {
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
            .map(|(t, p, s)| (p as f64 - fixed).max(0.0) / t as f64 * stretch(seq_len, s))
            .collect();
        let per = if near.is_empty() {
            slope * stretch(seq_len, self.max_seq_seen)
        } else {
            median(near)
        };
        (fixed, per)
    }

    fn lengths_vary(&self) -> bool {
        let mut seqs = self.model.points().map(|p| p.2);
        let first = seqs.next();
        seqs.any(|s| Some(s) != first)
    }

    /// (fixed bytes, bytes per token) to grow along, with one length measured at two sizes
    /// or more: the line through the largest size measured, as steep as the readings
    /// allow. Between two close sizes the difference of their peaks is mostly noise
    /// (readings scatter by up to the meter's noise): the fitted slope may be near zero
    /// (growth far past what fits) or negative (the fit falls back to proportional and
    /// growth stalls for good). The steepest slope within the noise bounds growth from
    /// above; the line through the baseline, when there is one, bounds it too, so growth
    /// is never less than the one-size rule allowed.
    pub fn growth_line(&self, fitted_slope: f64) -> Option<(f64, f64)> {
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
        let noise = self.noise * p_hi;
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

    /// Whether predictions follow [`growth_line`](Self::growth_line): one length
    /// measured, at sizes too close for their difference to be more than noise.
    pub fn noise_bound(&self) -> bool {
        let Some((_, slope)) = self.model.coefficients() else {
            return false;
        };
        !self.lengths_vary() && self.growth_line(slope).is_some()
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

    /// The fitted line itself (one length), for judging a shrink by the least drop that
    /// following memory shows; with lengths that vary, the prediction.
    pub fn fitted_bytes(&self, micro_batch: usize, seq_len: usize) -> Option<u64> {
        let lengths_vary = self.model.points().any(|p| p.2 != seq_len);
        match self.model.coefficients() {
            Some((fixed, slope)) if !lengths_vary => {
                Some((fixed + slope * (micro_batch * seq_len) as f64).max(0.0) as u64)
            }
            _ => self.predicted_bytes(micro_batch, seq_len),
        }
    }

    /// Whether the fit has a slope of its own (two sizes, a positive fixed part): one that
    /// fell back to proportional says no more than one size does.
    pub fn has_own_slope(&self) -> bool {
        self.model
            .coefficients()
            .is_some_and(|(fixed, _)| self.model.is_fitted() && fixed > 0.0)
    }

    /// Readings at this very size and length, oldest first.
    pub fn readings_at(&self, tokens: u64, seq_len: usize) -> Vec<f64> {
        self.model
            .points()
            .filter(|p| p.0 == tokens && p.2 == seq_len)
            .map(|p| p.1 as f64)
            .collect()
    }

    /// The usage the next step is expected at: what the latest readings at this very
    /// size and length measured when there are some (a young fit's slope between two
    /// close sizes is mostly noise), else the model's prediction.
    pub fn forecast_usage(&self, micro_batch: usize, seq_len: usize) -> Option<f64> {
        let here = self.readings_at((micro_batch * seq_len) as u64, seq_len);
        if here.is_empty() {
            return self.predicted_usage(micro_batch, seq_len);
        }
        Some(median(here) / self.limit_bytes as f64)
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

    /// The largest micro-batch predicted under `fraction` of the limit.
    pub fn fit_under(&self, fraction: f64, seq_len: usize, inflate: bool) -> Option<usize> {
        let goal = fraction * self.limit_bytes as f64;
        let (fixed, per) = self.cost_at(seq_len, inflate)?;
        let per_seq = per * seq_len.max(1) as f64;
        Some(((goal - fixed) / per_seq).max(0.0).floor() as usize)
    }

    /// Forgets the readings (they describe a footprint that is gone).
    pub fn forget(&mut self) {
        self.model.clear();
        self.errors.clear();
        self.max_seq_seen = 0;
    }

    /// Memory outside the batch moved by `delta` bytes: every reading and the baseline
    /// with it, and the model's record of errors no longer applies.
    pub fn shift(&mut self, delta: f64) {
        self.model.shift(delta);
        self.baseline = self.baseline.map(|b| (b as f64 + delta).max(0.0) as u64);
        self.errors.clear();
    }

    /// Takes in one step's reading, `trusted` when it says what the batch costs (not the
    /// first step's, not while memory does not follow the batch): scores the prediction,
    /// moves the fixed part on a jump, keeps censored readings out of the fit.
    pub fn take(&mut self, obs: StepObservation, trusted: bool) {
        if trusted {
            self.score(obs);
            // A reading far above what a model that has been right predicted, at a length
            // it has measured: memory was taken from outside the batch (another process,
            // the device shared). That moves the fixed part, not what a token costs: shift
            // every reading by the jump so one decision lands near what fits now, instead
            // of learning a steeper slope from it over several.
            if self.jumped(obs) {
                self.errors.clear();
            }
        }
        // A peak equal to the byte to one at another size measured a floor the batch no
        // longer reaches (freed heap pages kept mapped, a cache at its high-water mark):
        // neither reading says what the batch costs, and a fit through them makes a short
        // sequence look as dear as a long one. Readings at or under that floor are
        // censored, readings above it are the batch's own.
        let tokens = (obs.micro_batch * obs.seq_len) as u64;
        let floor = self
            .floor_bytes
            .is_some_and(|f| obs.peak_bytes <= f + f / 1_000_000);
        if trusted && !floor && self.model.forget_floor(tokens, obs.peak_bytes) {
            self.floor_bytes = Some(obs.peak_bytes.max(self.floor_bytes.unwrap_or(0)));
        } else if trusted && !floor {
            self.model.observe_at(tokens, obs.peak_bytes, obs.seq_len);
            self.max_seq_seen = self.max_seq_seen.max(obs.seq_len);
        }
    }

    /// Records the fitted model's error on `obs`. Only lengths already measured: the
    /// stretch beyond them is a bound, not the model's error.
    fn score(&mut self, obs: StepObservation) {
        if !self.model.is_fitted() || obs.seq_len > self.max_seq_seen {
            return;
        }
        let Some(p) = self.predicted_bytes(obs.micro_batch, obs.seq_len) else {
            return;
        };
        if self.errors.len() == ERROR_WINDOW {
            self.errors.pop_front();
        }
        let err = (obs.peak_bytes as f64 - p as f64) / self.limit_bytes as f64;
        // The steep line a growth from close sizes follows is a bound from above: a
        // reading under it is what it is for, not an error. Counted, it would widen the
        // margin after the growth it planned landed low, and hold the run below its fit
        // (controller_drives.rs:
        // `a_growth_along_the_noise_bound_that_lands_low_is_not_the_models_error`).
        let err = if self.noise_bound() {
            err.max(0.0)
        } else {
            err.abs()
        };
        self.errors.push_back(err);
    }

    /// Whether `obs` reads a jump in the fixed part: a settled size (three readings or
    /// more at this very size and length) reads far above them, or a model that has been
    /// right reads far above its prediction. Shifts the model (and the baseline, part of
    /// the same fixed memory) by the jump.
    fn jumped(&mut self, obs: StepObservation) -> bool {
        if obs.seq_len > self.max_seq_seen || self.floor_bytes.is_some() {
            return false;
        }
        let limit = self.limit_bytes as f64;
        let here = self.readings_at((obs.micro_batch * obs.seq_len) as u64, obs.seq_len);
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

    /// Whether the latest `streak` readings at this size and length sit within the scatter
    /// of the readings before them (at least `earlier` of them, enough to know it): a
    /// size settled under `target` reads over it now and then without its footprint
    /// moving.
    pub fn within_own_noise(
        &self,
        tokens: u64,
        seq_len: usize,
        streak: usize,
        earlier: usize,
        target: f64,
    ) -> bool {
        let here = self.readings_at(tokens, seq_len);
        if streak == 0 || here.len() < streak + earlier {
            return false;
        }
        let (earlier, recent) = here.split_at(here.len() - streak);
        let m = median(earlier.to_vec());
        let spread = earlier.iter().map(|r| (r - m).abs()).fold(0.0, f64::max);
        // Settled under target of the limit as it is now (a limit that dropped puts the
        // same bytes over it: that is not scatter).
        m <= target * self.limit_bytes as f64 && median(recent.to_vec()) - m <= spread
    }
}

/// How much dearer a token is at `seq_len` than at the measured length `s`, at most: as if
/// all of its cost were quadratic in the length.
fn stretch(seq_len: usize, s: usize) -> f64 {
    if s > 0 && seq_len > s {
        seq_len as f64 / s as f64
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn obs(step: u64, micro_batch: usize, seq_len: usize, peak_bytes: u64) -> StepObservation {
        StepObservation {
            step,
            micro_batch,
            seq_len,
            peak_bytes,
        }
    }

    /// 300 MiB fixed, 16 KiB per token.
    fn truth(mb: usize, seq: usize) -> u64 {
        300 * MIB + (mb * seq) as u64 * 16 * 1024
    }

    #[test]
    fn one_size_over_predicts_larger_sizes_and_a_baseline_tells_the_fixed_part() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        e.take(obs(2, 4, 64, truth(4, 64)), true);
        assert!(!e.is_fitted());
        // No baseline: all of it scales with tokens, far over the truth.
        let proportional = e.fit_under(0.9, 64, true).unwrap();
        // A baseline under the fixed part: the line through it still over-predicts.
        e.set_baseline(280 * MIB);
        let with_baseline = e.fit_under(0.9, 64, true).unwrap();
        let feasible = (1..)
            .take_while(|&mb| truth(mb, 64) < LIMIT * 9 / 10)
            .count();
        assert!(proportional < with_baseline && with_baseline <= feasible);
        assert!(e.predicted_bytes(40, 64).unwrap() >= truth(40, 64));
    }

    #[test]
    fn close_sizes_grow_along_the_steepest_line_the_noise_allows() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        // 1% apart in tokens, the second reading 1% low: the fitted slope is negative.
        e.take(obs(2, 100, 64, truth(100, 64)), true);
        e.take(obs(3, 101, 64, truth(101, 64) * 99 / 100), true);
        assert!(e.noise_bound());
        // The bound from above: never under the truth at a larger size.
        assert!(e.predicted_bytes(400, 64).unwrap() >= truth(400, 64));
        assert!(e.fit_under(0.9, 64, true).unwrap() > 101);
    }

    #[test]
    fn a_limit_taught_by_errors_is_in_force_under_the_one_told_until_forgotten() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        assert!(!e.set_limit(LIMIT));
        assert!(e.limit_fell(LIMIT / 4 * 3));
        assert!(e.limit_has_fallen());
        assert_eq!(e.limit_bytes(), LIMIT / 4 * 3);
        // Told again, the lower of the two stays in force; a lower told limit wins.
        assert!(!e.set_limit(LIMIT));
        assert!(e.set_limit(LIMIT / 2));
        assert_eq!(e.limit_bytes(), LIMIT / 2);
        assert!(!e.limit_has_fallen());
        assert!(e.set_limit(LIMIT));
        assert!(
            !e.limit_fell(LIMIT / 10 * 9),
            "never raised by a later error"
        );
        assert!(e.forget_fallen_limit());
        assert_eq!(e.limit_bytes(), LIMIT);
    }

    #[test]
    fn the_margin_is_the_fits_largest_recent_error_within_its_bounds() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        assert_eq!(e.margin(), YOUNG_MARGIN);
        for (i, mb) in [10usize, 40, 80, 120].into_iter().enumerate() {
            e.take(obs(2 + i as u64, mb, 64, truth(mb, 64)), true);
        }
        assert_eq!(e.margin(), MIN_MARGIN);
        // A reading 2.5% of the limit over the fit.
        e.take(obs(9, 80, 64, truth(80, 64) + LIMIT / 40), true);
        assert!((e.margin() - 0.025).abs() < 1e-3, "{}", e.margin());
        e.take(obs(10, 80, 64, truth(80, 64) + LIMIT / 10), true);
        assert_eq!(e.margin(), MAX_MARGIN);
    }

    #[test]
    fn a_peak_equal_at_two_sizes_is_a_floor_and_readings_under_it_are_censored() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        let mark = 800 * MIB;
        e.take(obs(2, 40, 64, mark), true);
        e.take(obs(3, 20, 64, mark), true);
        assert!(e.model().is_empty(), "neither says what the batch costs");
        e.take(obs(4, 10, 64, mark), true);
        assert!(e.model().is_empty());
        // Above the floor: the batch's own.
        e.take(obs(5, 60, 64, mark + 50 * MIB), true);
        assert_eq!(e.model().len(), 1);
        // Untrusted readings are never fitted.
        e.take(obs(6, 70, 64, mark + 60 * MIB), false);
        assert_eq!(e.model().len(), 1);
    }

    #[test]
    fn a_jump_at_a_settled_size_moves_the_fixed_part_not_the_cost() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        e.set_baseline(250 * MIB);
        for (i, mb) in [10usize, 40, 40, 40].into_iter().enumerate() {
            e.take(obs(2 + i as u64, mb, 64, truth(mb, 64)), true);
        }
        let (_, per) = e.cost_at(64, false).unwrap();
        let outside = LIMIT / 10;
        e.take(obs(9, 40, 64, truth(40, 64) + outside), true);
        let (_, after) = e.cost_at(64, false).unwrap();
        assert!((after - per).abs() < 1e-6 * per, "{per} → {after}");
        assert_eq!(e.baseline(), Some(250 * MIB + outside));
        let p = e.predicted_bytes(10, 64).unwrap() as f64;
        assert!((p - (truth(10, 64) + outside) as f64).abs() < 0.01 * LIMIT as f64);
    }

    #[test]
    fn lengths_that_vary_cost_more_per_token_when_longer_but_never_more_than_quadratic() {
        let mut e = Estimate::new(0.02, false, LIMIT);
        let peak = |mb: usize, s: usize| 300 * MIB + (mb * s) as u64 * (8 * 1024 + 64 * s as u64);
        for (i, s) in [64usize, 80, 96, 112, 128, 72, 88, 104]
            .into_iter()
            .enumerate()
        {
            e.take(obs(2 + i as u64, 8 + i % 3, s, peak(8 + i % 3, s)), true);
        }
        let (_, at_64) = e.cost_at(64, false).unwrap();
        let (_, at_128) = e.cost_at(128, false).unwrap();
        assert!(at_128 > at_64);
        let (_, at_512) = e.cost_at(512, false).unwrap();
        assert!(at_512 >= at_128 && at_512 <= at_128 * 4.0 + 1e-6);
    }
}
