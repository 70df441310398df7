//! Bounded time series for charts. When full, adjacent points are merged pairwise and
//! later points are bucketed twice as coarsely, so the whole run stays visible in fixed
//! memory (burn-train's TUI does the same).

/// How two samples become one when the resolution halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Keep the mean: for noisy curves such as the loss.
    Mean,
    /// Keep the maximum: for memory, where hiding a peak would hide the risk.
    Max,
    /// Keep the minimum: for the micro-batch, where hiding a shrink would hide the risk.
    Min,
}

#[derive(Debug, Clone)]
pub struct History {
    points: Vec<(f64, f64)>,
    capacity: usize,
    merge: Merge,
    /// Raw samples per stored point.
    stride: usize,
    /// The bucket being filled: (last x, merged y, samples so far).
    pending: Option<(f64, f64, usize)>,
}

impl History {
    pub fn new(capacity: usize, merge: Merge) -> History {
        History {
            points: Vec::with_capacity(capacity),
            capacity: capacity.max(2),
            merge,
            stride: 1,
            pending: None,
        }
    }

    pub fn push(&mut self, x: f64, y: f64) {
        if !y.is_finite() {
            return;
        }
        let (px, py, n) = match self.pending.take() {
            None => (x, y, 1),
            Some((_, acc, n)) => (x, self.combine(acc, n, y, 1), n + 1),
        };
        if n < self.stride {
            self.pending = Some((px, py, n));
            return;
        }
        self.points.push((px, py));
        if self.points.len() >= self.capacity {
            self.halve();
        }
    }

    fn combine(&self, a: f64, na: usize, b: f64, nb: usize) -> f64 {
        match self.merge {
            Merge::Mean => (a * na as f64 + b * nb as f64) / (na + nb) as f64,
            Merge::Max => a.max(b),
            Merge::Min => a.min(b),
        }
    }

    fn halve(&mut self) {
        let merged: Vec<(f64, f64)> = self
            .points
            .chunks(2)
            .map(|c| match c {
                [a, b] => (b.0, self.combine(a.1, 1, b.1, 1)),
                [a] => *a,
                _ => unreachable!("chunks(2) yields one or two"),
            })
            .collect();
        self.points = merged;
        self.stride *= 2;
    }

    /// Stored points plus the bucket being filled, oldest first.
    pub fn points(&self) -> Vec<(f64, f64)> {
        let mut out = self.points.clone();
        if let Some((x, y, _)) = self.pending {
            out.push((x, y));
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty() && self.pending.is_none()
    }

    pub fn last(&self) -> Option<(f64, f64)> {
        self.pending
            .map(|(x, y, _)| (x, y))
            .or_else(|| self.points.last().copied())
    }

    /// (min, max) of y over what is stored.
    pub fn y_range(&self) -> Option<(f64, f64)> {
        let pts = self.points();
        let first = pts.first()?.1;
        Some(
            pts.iter()
                .fold((first, first), |(lo, hi), p| (lo.min(p.1), hi.max(p.1))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_bounded_and_keeps_the_whole_span() {
        let mut h = History::new(64, Merge::Mean);
        for i in 0..10_000 {
            h.push(i as f64, 1.0);
        }
        let pts = h.points();
        assert!(pts.len() <= 64, "{} points", pts.len());
        assert!(pts.len() >= 16, "halving must not collapse the series");
        assert!(pts.first().unwrap().0 < 300.0, "oldest part still present");
        assert_eq!(pts.last().unwrap().0, 9_999.0, "newest point present");
        assert!(pts.windows(2).all(|w| w[0].0 < w[1].0), "x stays ordered");
    }

    #[test]
    fn max_merge_keeps_a_peak_that_mean_would_hide() {
        let mut max = History::new(4, Merge::Max);
        let mut mean = History::new(4, Merge::Mean);
        for (i, y) in [1.0, 9.0, 1.0, 1.0, 1.0, 1.0].iter().enumerate() {
            max.push(i as f64, *y);
            mean.push(i as f64, *y);
        }
        assert_eq!(max.y_range().unwrap().1, 9.0);
        assert!(mean.y_range().unwrap().1 < 9.0);
    }

    #[test]
    fn ignores_non_finite_values() {
        let mut h = History::new(8, Merge::Mean);
        h.push(0.0, f64::NAN);
        h.push(1.0, f64::INFINITY);
        assert!(h.is_empty());
        h.push(2.0, 3.0);
        assert_eq!(h.last(), Some((2.0, 3.0)));
    }
}
