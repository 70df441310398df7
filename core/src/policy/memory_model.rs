//! peak ≈ fixed + per_token × tokens, fitted from the run's own steps.
//!
//! Theil–Sen: the slope is the median of the slopes between every pair of observations
//! with different token counts, the intercept the median of the residuals. A few wild
//! readings (a one-off spike, a step that paid for a cache warm-up) move neither median,
//! which least squares would let drag the fit. Only the latest [`WINDOW`] observations
//! count, so the fit follows the run when memory behaviour changes (refit on every
//! observation; the window keeps that cheap: at most 2016 pairs).
use serde::{Deserialize, Serialize};

/// Observations kept for the fit.
pub const WINDOW: usize = 64;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryModel {
    /// (tokens in the micro-batch, peak bytes), oldest first.
    points: Vec<(u64, u64)>,
    /// The sequence length of each point (0 when not told).
    #[serde(default)]
    seqs: Vec<usize>,
    fit: Option<(f64, f64)>,
}

impl MemoryModel {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one step's peak at a micro-batch of `tokens` tokens and refits.
    pub fn observe(&mut self, tokens: u64, peak_bytes: u64) {
        self.observe_at(tokens, peak_bytes, 0);
    }

    /// As [`observe`](Self::observe), remembering the sequence length so a caller can ask
    /// what a token costs at one length ([`points`](Self::points)).
    pub fn observe_at(&mut self, tokens: u64, peak_bytes: u64, seq_len: usize) {
        if tokens == 0 {
            return;
        }
        if self.points.len() == WINDOW {
            // The oldest reading goes, unless it is the last of its size: a window of one
            // size (a run settled for WINDOW steps) could no longer separate the fixed part
            // from the per-token cost.
            let i = (0..self.points.len())
                .find(|&i| {
                    let x = self.points[i].0;
                    x == tokens || self.points.iter().filter(|p| p.0 == x).count() > 1
                })
                .unwrap_or(0);
            self.points.remove(i);
            if i < self.seqs.len() {
                self.seqs.remove(i);
            }
        }
        self.points.push((tokens, peak_bytes));
        self.seqs.push(seq_len);
        self.fit = self.refit();
    }

    /// (tokens, peak bytes, sequence length) of each reading in the window, oldest first.
    pub fn points(&self) -> impl Iterator<Item = (u64, u64, usize)> + '_ {
        self.points
            .iter()
            .zip(self.seqs.iter().copied().chain(std::iter::repeat(0)))
            .map(|(&(t, p), s)| (t, p, s))
    }

    /// Forgets the readings of exactly `peak_bytes` (they measured a floor, not the batch)
    /// and refits; true when there were any at a size other than `tokens`.
    pub fn forget_floor(&mut self, tokens: u64, peak_bytes: u64) -> bool {
        let same = |p: u64| p.abs_diff(peak_bytes) <= peak_bytes / 1_000_000;
        if !self.points.iter().any(|&(t, p)| t != tokens && same(p)) {
            return false;
        }
        let keep: Vec<bool> = self.points.iter().map(|&(_, p)| !same(p)).collect();
        let mut k = keep.iter();
        self.points.retain(|_| *k.next().unwrap());
        let mut k = keep.iter().chain(std::iter::repeat(&true));
        self.seqs.retain(|_| *k.next().unwrap());
        self.fit = self.refit();
        true
    }

    /// Adds `delta` bytes to every reading: memory taken (or given back) outside the batch
    /// moves the fixed part, not what a token costs.
    pub fn shift(&mut self, delta: f64) {
        for p in &mut self.points {
            p.1 = (p.1 as f64 + delta).max(0.0) as u64;
        }
        self.fit = self.refit();
    }

    /// Forgets every observation (the footprint changed under the fit).
    pub fn clear(&mut self) {
        self.points.clear();
        self.seqs.clear();
        self.fit = None;
    }

    pub fn len(&self) -> usize {
        self.points.len()
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// How many different sizes the window holds.
    pub fn distinct_sizes(&self) -> usize {
        let mut xs: Vec<u64> = self.points.iter().map(|p| p.0).collect();
        xs.sort_unstable();
        xs.dedup();
        xs.len()
    }

    /// True once two different sizes were seen, so fixed and per-token parts separate.
    pub fn is_fitted(&self) -> bool {
        let mut xs = self.points.iter().map(|p| p.0);
        match xs.next() {
            Some(first) => xs.any(|x| x != first),
            None => false,
        }
    }

    /// (fixed bytes, bytes per token). With one size seen, all memory is assumed to scale
    /// with tokens (fixed 0): that over-predicts larger sizes, the safe direction.
    pub fn coefficients(&self) -> Option<(f64, f64)> {
        self.fit
    }

    fn refit(&self) -> Option<(f64, f64)> {
        if self.points.is_empty() {
            return None;
        }
        let proportional = || {
            let ratios: Vec<f64> = self
                .points
                .iter()
                .map(|&(x, y)| y as f64 / x as f64)
                .collect();
            Some((0.0, median(ratios)))
        };
        // Each pair's slope weighs as much as its sizes are apart: between close sizes the
        // difference of two peaks is mostly noise, and a run that grew 1, 2, 16, 128, 929
        // had most of its pairs among the small sizes, whose median slope let it grow past
        // the limit.
        let mut slopes = Vec::new();
        for (i, &(x1, y1)) in self.points.iter().enumerate() {
            for &(x2, y2) in &self.points[i + 1..] {
                if x1 != x2 {
                    slopes.push((
                        (y2 as f64 - y1 as f64) / (x2 as f64 - x1 as f64),
                        x1.abs_diff(x2) as f64,
                    ));
                }
            }
        }
        if slopes.is_empty() {
            return proportional();
        }
        let slope = weighted_median(slopes);
        if slope.is_nan() || slope <= 0.0 {
            // Noise swamped the signal: keep the conservative estimate.
            return proportional();
        }
        let fixed = median(
            self.points
                .iter()
                .map(|&(x, y)| y as f64 - slope * x as f64)
                .collect(),
        );
        Some((fixed, slope))
    }

    /// (fixed bytes, bytes per token, bytes per token per token of length) of
    /// `peak ≈ fixed + tokens × (a + b × seq_len)`, fitted over readings at different
    /// lengths: attention makes a token in a longer sequence cost more, which a line in
    /// tokens alone averages away (and, with the batch fixed and lengths varying, bends its
    /// intercept low). `None` until the readings span lengths well enough to tell `b` from
    /// `a` and the fixed part.
    ///
    /// Least squares, then again without readings more than three robust deviations off
    /// (a one-off spike). A negative coefficient is noise: the fit drops that term, and
    /// of the two lines left keeps the one the readings follow better.
    pub fn length_fit(&self) -> Option<(f64, f64, f64)> {
        self.length_fit_over(false)
    }

    /// [`length_fit`](Self::length_fit), where `heap_fragments` says the readings count
    /// an allocator's fragmented heap
    /// ([`ControllerConfig::heap_fragments`](super::ControllerConfig::heap_fragments)):
    /// then a dropped term leaves the all-quadratic line whenever it is admissible, however
    /// well the straight one fits.
    pub fn length_fit_over(&self, heap_fragments: bool) -> Option<(f64, f64, f64)> {
        let pts: Vec<(f64, f64, f64)> = self
            .points()
            .filter(|p| p.2 > 0)
            .map(|(t, p, s)| (t as f64, t as f64 * s as f64, p as f64))
            .collect();
        let (lo, hi) = self
            .seqs
            .iter()
            .filter(|&&s| s > 0)
            .fold((usize::MAX, 0), |(lo, hi), &s| (lo.min(s), hi.max(s)));
        if pts.len() < 6 || hi * 10 < lo * 11 {
            return None;
        }
        let fit = |pts: &[(f64, f64, f64)]| -> Option<(f64, f64, f64)> {
            let full = least_squares(pts, true, true)?;
            if full.1 >= 0.0 && full.2 >= 0.0 {
                return Some(full);
            }
            // Of the two lines left, the one the readings follow. Preferring the
            // quadratic one whatever they said would bend a line in tokens (a small model,
            // its attention a sliver) into a curve over it at the longest lengths and
            // under it in the middle: the margin goes to its cap and the run settles well
            // below what fits (controller_drives.rs:
            // `random_lengths_over_a_line_in_tokens_settle_near_what_fits`). Over glibc's
            // heap the straight line is not to be trusted however well it fits: a fresh
            // heap's first readings follow one, and the fragmentation that comes later
            // adds most at the longest lengths, 5–16 points over it, enough to reach
            // critical (`a_fragmented_heap_keeps_the_quadratic_bound_across_lengths`).
            let mut reduced = [
                least_squares(pts, false, true),
                least_squares(pts, true, false),
            ]
            .into_iter()
            .flatten()
            .filter(|f| f.1 >= 0.0 && f.2 >= 0.0);
            if heap_fragments {
                // The all-quadratic one when admissible (it comes first).
                return reduced.next();
            }
            reduced.min_by(|x, y| squared_error(pts, *x).total_cmp(&squared_error(pts, *y)))
        };
        let first = fit(&pts)?;
        let resid: Vec<f64> = pts
            .iter()
            .map(|&(t, tl, y)| y - (first.0 + first.1 * t + first.2 * tl))
            .collect();
        let spread = 1.4826 * median(resid.iter().map(|r| r.abs()).collect());
        let kept: Vec<_> = pts
            .iter()
            .zip(&resid)
            .filter(|(_, r)| r.abs() <= 3.0 * spread)
            .map(|(p, _)| *p)
            .collect();
        if kept.len() == pts.len() || kept.len() < 6 {
            return Some(first);
        }
        fit(&kept).or(Some(first))
    }

    /// Predicted peak bytes for a micro-batch of `tokens` tokens.
    pub fn predict(&self, tokens: u64) -> Option<u64> {
        let (fixed, per) = self.fit?;
        Some((fixed + per * tokens as f64).max(0.0) as u64)
    }

    /// Largest number of tokens whose predicted peak is at most `limit_bytes`.
    pub fn max_tokens_under(&self, limit_bytes: u64) -> Option<u64> {
        let (fixed, per) = self.fit?;
        if per <= 0.0 {
            return None;
        }
        Some(((limit_bytes as f64 - fixed) / per).max(0.0).floor() as u64)
    }

    /// Largest micro-batch of `seq_len`-token sequences predicted to peak at most at
    /// `limit_bytes` (0 when not even one fits).
    pub fn max_batch_under(&self, limit_bytes: u64, seq_len: usize) -> Option<usize> {
        Some((self.max_tokens_under(limit_bytes)? / seq_len.max(1) as u64) as usize)
    }
}

/// `y ≈ c + a × t + b × tl` by least squares over (t, tl, y), with the terms not wanted
/// held at 0; `None` when the readings cannot separate the terms (too few, or one term
/// nearly a multiple of another).
fn least_squares(pts: &[(f64, f64, f64)], use_a: bool, use_b: bool) -> Option<(f64, f64, f64)> {
    // Scaled to order 1 so the normal equations stay well conditioned.
    let st = pts.iter().map(|p| p.0).fold(0.0, f64::max).max(1.0);
    let sl = pts.iter().map(|p| p.1).fold(0.0, f64::max).max(1.0);
    let sy = pts.iter().map(|p| p.2).fold(0.0, f64::max).max(1.0);
    let row = |p: &(f64, f64, f64)| {
        let mut x = vec![1.0];
        if use_a {
            x.push(p.0 / st);
        }
        if use_b {
            x.push(p.1 / sl);
        }
        x
    };
    let k = 1 + usize::from(use_a) + usize::from(use_b);
    if pts.len() < k + 2 {
        return None;
    }
    let mut m = vec![vec![0.0; k + 1]; k];
    for p in pts {
        let x = row(p);
        for i in 0..k {
            for j in 0..k {
                m[i][j] += x[i] * x[j];
            }
            m[i][k] += x[i] * p.2 / sy;
        }
    }
    let diag: Vec<f64> = (0..k).map(|i| m[i][i]).collect();
    // Gaussian elimination with partial pivoting.
    for c in 0..k {
        let piv = (c..k).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        m.swap(c, piv);
        // A pivot this small against its column's own scale: the term is (nearly) a
        // combination of the others.
        if m[c][c].abs() < 1e-6 * diag[c].max(1e-300) {
            return None;
        }
        let pivot = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                    *x -= f * p;
                }
            }
        }
    }
    let sol: Vec<f64> = (0..k).map(|i| m[i][k] / m[i][i]).collect();
    let mut it = sol.into_iter();
    let c = it.next()? * sy;
    let a = if use_a { it.next()? * sy / st } else { 0.0 };
    let b = if use_b { it.next()? * sy / sl } else { 0.0 };
    Some((c, a, b))
}

/// The sum of squared residuals of `(fixed, a, b)` over `(tokens, tokens × length, peak)`.
fn squared_error(pts: &[(f64, f64, f64)], (c, a, b): (f64, f64, f64)) -> f64 {
    pts.iter()
        .map(|&(t, tl, y)| (y - (c + a * t + b * tl)).powi(2))
        .sum()
}

/// The value at which half the total weight lies on either side.
fn weighted_median(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = v.iter().map(|p| p.1).sum();
    let mut acc = 0.0;
    for (i, &(x, w)) in v.iter().enumerate() {
        acc += w;
        if acc * 2.0 > total {
            return x;
        }
        if acc * 2.0 == total {
            return (x + v.get(i + 1).map_or(x, |n| n.0)) / 2.0;
        }
    }
    v.last().map_or(f64::NAN, |p| p.0)
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn one_size_is_proportional_and_conservative() {
        let mut m = MemoryModel::new();
        assert_eq!(m.predict(10), None);
        m.observe(1000, 600 * MIB);
        assert!(!m.is_fitted());
        // True model: 500 MiB + 0.1 MiB/token; proportional over-predicts 2000 tokens.
        assert!(m.predict(2000).unwrap() > 700 * MIB);
    }

    #[test]
    fn recovers_a_line_despite_outliers() {
        let mut m = MemoryModel::new();
        let truth = |t: u64| 500 * MIB + t * 100 * 1024;
        for (i, t) in [256u64, 512, 768, 1024, 2048, 4096, 512, 1024, 3000]
            .into_iter()
            .enumerate()
        {
            // Two wild readings: a spike and a dip.
            let y = match i {
                3 => truth(t) * 3,
                6 => truth(t) / 2,
                _ => truth(t),
            };
            m.observe(t, y);
        }
        let (fixed, per) = m.coefficients().unwrap();
        assert!(
            (fixed - (500 * MIB) as f64).abs() < 0.02 * (500 * MIB) as f64,
            "{fixed}"
        );
        assert!((per - 102_400.0).abs() < 0.02 * 102_400.0, "{per}");
        let p = m.predict(10_000).unwrap() as f64;
        assert!((p - truth(10_000) as f64).abs() < 0.02 * p);
        // 1 GiB limit: (1024 - 500) MiB / 100 KiB = 5365 tokens = 83 sequences of 64.
        let b = m.max_batch_under(1 << 30, 64).unwrap();
        assert!((82..=84).contains(&b), "{b}");
        assert_eq!(m.max_batch_under(400 * MIB, 64), Some(0));
    }

    /// A token in a longer sequence costs more (attention): the fit across lengths finds
    /// that, and the fixed part, where a line in tokens alone would not.
    #[test]
    fn length_fit_separates_the_attention_term() {
        let mut m = MemoryModel::new();
        let truth = |mb: u64, s: u64| 500 * MIB + mb * s * (40 * 1024 + 300 * s);
        let mut x = 7u64;
        for i in 0..40u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            let s = 32 + (x >> 33) % 225;
            let mb = 8 + i % 3;
            let y = if i == 17 {
                truth(mb, s) * 2
            } else {
                truth(mb, s)
            };
            m.observe_at(mb * s, y, s as usize);
        }
        let (f, a, b) = m.length_fit().unwrap();
        assert!(
            (f - (500 * MIB) as f64).abs() < 0.01 * (500 * MIB) as f64,
            "{f}"
        );
        assert!((a - 40.0 * 1024.0).abs() < 0.01 * 40.0 * 1024.0, "{a}");
        assert!((b - 300.0).abs() < 3.0, "{b}");
        // One length: nothing to separate.
        let mut one = MemoryModel::new();
        for mb in 1..10u64 {
            one.observe_at(mb * 64, truth(mb, 64), 64);
        }
        assert_eq!(one.length_fit(), None);
    }

    /// Readings that are a line in tokens (a token slightly cheaper in a longer sequence,
    /// as the hard-capped small model read): the straight line where memory follows
    /// tensors, the all-quadratic bound over a fragmented heap, whose later readings add
    /// most at the longest lengths.
    #[test]
    fn a_fragmented_heap_keeps_the_quadratic_bound_across_lengths() {
        let mut m = MemoryModel::new();
        let mut x = 11u64;
        for i in 0..30u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            let s = 32 + (x >> 33) % 225;
            let mb = 16 + i % 5;
            m.observe_at(mb * s, 400 * MIB + mb * s * (20 * 1024 - 4 * s), s as usize);
        }
        let (_, a, b) = m.length_fit_over(false).unwrap();
        assert!(a > 0.0 && b == 0.0, "the line the readings follow: {a} {b}");
        let (_, a, b) = m.length_fit_over(true).unwrap();
        assert!(a == 0.0 && b > 0.0, "all quadratic: {a} {b}");
        assert_eq!(m.length_fit(), m.length_fit_over(false));
    }

    #[test]
    fn refits_as_memory_behaviour_changes() {
        let mut m = MemoryModel::new();
        for i in 0..WINDOW as u64 {
            m.observe(100 + i * 10, 1000 + (100 + i * 10) * 2);
        }
        let (_, per) = m.coefficients().unwrap();
        assert!((per - 2.0).abs() < 1e-9);
        for i in 0..WINDOW as u64 {
            m.observe(100 + i * 10, 1000 + (100 + i * 10) * 5);
        }
        assert_eq!(m.len(), WINDOW);
        let (_, per) = m.coefficients().unwrap();
        assert!((per - 5.0).abs() < 1e-9, "{per}");
    }
}
