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
    fit: Option<(f64, f64)>,
}

impl MemoryModel {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one step's peak at a micro-batch of `tokens` tokens and refits.
    pub fn observe(&mut self, tokens: u64, peak_bytes: u64) {
        if tokens == 0 {
            return;
        }
        if self.points.len() == WINDOW {
            self.points.remove(0);
        }
        self.points.push((tokens, peak_bytes));
        self.fit = self.refit();
    }

    /// Forgets every observation (the footprint changed under the fit).
    pub fn clear(&mut self) {
        self.points.clear();
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
        let mut slopes = Vec::new();
        for (i, &(x1, y1)) in self.points.iter().enumerate() {
            for &(x2, y2) in &self.points[i + 1..] {
                if x1 != x2 {
                    slopes.push((y2 as f64 - y1 as f64) / (x2 as f64 - x1 as f64));
                }
            }
        }
        if slopes.is_empty() {
            return proportional();
        }
        let slope = median(slopes);
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

fn median(mut v: Vec<f64>) -> f64 {
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
