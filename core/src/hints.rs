//! Live hints: the memory guides' troubleshooting tables turned into advice computed from
//! the run's own figures (step peaks, the sampler's allocator and host figures, the
//! controller's decisions). Pure rules over the telemetry stream: no clock, no libtorch.
//!
//! Each hint names the number that raised it and the lever that would help, with its
//! predicted effect where the figures allow one. A hint is raised once and cleared when
//! its cause goes; the clear threshold sits below the raise threshold (hysteresis), so a
//! figure hovering at the line does not flood the screen and the log.
use std::collections::{BTreeMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::policy::Decision;
use crate::telemetry::{AllocatorStats, GpuStats, StepMemory, SystemSample, Telemetry};
use crate::units::fmt_bytes;

const MIB: f64 = 1024.0 * 1024.0;

/// What a hint is about; one of each can be raised at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HintKind {
    /// The CUDA cache holds much more than tensors use, in split blocks it cannot return.
    Fragmentation,
    /// Memory this process's allocator does not hold: the CUDA context and other
    /// processes on the device, or other processes on the host lowering the CPU limit.
    OutsideAllocator,
    /// Activations (what grows with the micro-batch) are most of the step's peak.
    Activations,
    /// The optimizer's state is a large share of the step's peak.
    OptimizerState,
    /// A shrink of the micro-batch did not lower the step's peak.
    ShrinkIneffective,
    /// The step's peak rises at a constant micro-batch and length: a leak.
    Leak,
}

impl HintKind {
    pub fn label(self) -> &'static str {
        match self {
            HintKind::Fragmentation => "fragmentation",
            HintKind::OutsideAllocator => "outside the allocator",
            HintKind::Activations => "activations dominate",
            HintKind::OptimizerState => "optimizer state dominates",
            HintKind::ShrinkIneffective => "shrink did not help",
            HintKind::Leak => "leak",
        }
    }
}

/// One hint raised or cleared (the `hint` record of docs/LOG_SCHEMA.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hint {
    pub hint: HintKind,
    /// True when raised, false when its cause went.
    pub raised: bool,
    /// The last step completed when it changed.
    pub step: u64,
    /// The number that raised it (bytes, or bytes per step for a leak); on a clear, the
    /// same figure as it stands now.
    pub figure_bytes: u64,
    /// What was seen and, on a raise, the lever with its predicted effect.
    pub text: String,
}

/// Where a step's fixed memory goes, as the producer counted it (the `memory_parts`
/// record): parameters, their gradients and the optimizer's state, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryParts {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
}

// Thresholds: raise at the first figure, clear below the second.
/// Split blocks nobody uses, as a share of reserved memory, and at least this much.
const FRAG_RAISE: f64 = 0.20;
const FRAG_CLEAR: f64 = 0.10;
const FRAG_MIN_BYTES: u64 = 256 << 20;
/// Samples in a row the fragmentation must show before it is said, and the least time
/// they must span (mid-step samples see transient cache; at 20 Hz three samples are
/// 0.1 s of one step).
const FRAG_SAMPLES: usize = 3;
const FRAG_HOLD_S: f64 = 0.5;
/// Memory outside the allocator (or taken from the CPU limit by other processes), as a
/// share of the device (or the configured limit).
const OUTSIDE_RAISE: f64 = 0.15;
const OUTSIDE_CLEAR: f64 = 0.08;
/// Activations' share of the step's peak.
const ACT_RAISE: f64 = 0.60;
const ACT_CLEAR: f64 = 0.50;
/// The optimizer state's share of the step's peak.
const OPT_RAISE: f64 = 0.35;
const OPT_CLEAR: f64 = 0.25;
/// A shrink that left the peak above this share of the peak before it did not help.
const SHRINK_KEPT: f64 = 0.97;
/// Steps at one shape the leak rule looks at, and the least rise per step it calls a
/// leak: 1 MiB or 0.2% of the peak, whichever is more (allocator noise stays below).
const LEAK_WINDOW: usize = 6;
const LEAK_MIN_BYTES: f64 = MIB;
const LEAK_MIN_SHARE: f64 = 0.002;

#[derive(Debug, Clone, Copy)]
struct PendingShrink {
    from: usize,
    to: usize,
    peak_before: u64,
}

/// The rules' state: what was seen so far and which hints are up.
#[derive(Debug, Clone)]
pub struct HintEngine {
    target: f64,
    parts: Option<MemoryParts>,
    last: Option<StepMemory>,
    /// Peaks at the current shape (micro-batch, length), oldest first.
    same_shape: VecDeque<u64>,
    /// The latest peak at each (length, micro-batch): the points the activation slope
    /// is fitted to.
    by_size: BTreeMap<(usize, usize), u64>,
    shrink: Option<PendingShrink>,
    /// The peak before the shrink that did not help, while that hint is up.
    shrink_held: Option<u64>,
    /// Samples in a row with high fragmentation, and the run time of the first.
    frag_run: (usize, f64),
    /// The sampler reads an allocator: a CUDA run, whose outside memory comes from NVML.
    last_sample_cuda: bool,
    active: HashSet<HintKind>,
}

impl Default for HintEngine {
    fn default() -> Self {
        HintEngine::new()
    }
}

impl HintEngine {
    pub fn new() -> HintEngine {
        HintEngine {
            target: crate::policy::Thresholds::default().target,
            parts: None,
            last: None,
            same_shape: VecDeque::new(),
            by_size: BTreeMap::new(),
            shrink: None,
            shrink_held: None,
            frag_run: (0, 0.0),
            last_sample_cuda: false,
            active: HashSet::new(),
        }
    }

    /// The hints up now.
    pub fn active(&self) -> impl Iterator<Item = HintKind> + '_ {
        self.active.iter().copied()
    }

    /// Takes note of one message, sent at `t` seconds of the run; returns the hints it
    /// raised or cleared.
    pub fn observe(&mut self, msg: &Telemetry, t: f64) -> Vec<Hint> {
        match msg {
            Telemetry::RunStarted(info) => {
                // Every producer sends its `memory_parts` after its first step; until then
                // (and in logs of `headroom train` from before it did) the built-in's
                // shape: fp32 master weights and gradients, AdamW's two fp32 moments.
                if info.config.is_some() && self.parts.is_none() {
                    let p = info.parameters * 4;
                    self.parts = Some(MemoryParts {
                        parameters: p,
                        gradients: p,
                        optimizer: 2 * p,
                    });
                }
                Vec::new()
            }
            Telemetry::MemoryParts(parts) => {
                self.parts = Some(*parts);
                Vec::new()
            }
            Telemetry::ThresholdsChanged { thresholds, .. } => {
                self.target = thresholds.target;
                Vec::new()
            }
            Telemetry::Decision {
                decision: Decision::Resize { from, to, .. },
                ..
            } if to < from => {
                let peak_before = self
                    .last
                    .as_ref()
                    .filter(|m| m.micro_batch == *from)
                    .map(|m| m.peak_bytes);
                self.shrink = peak_before.map(|peak_before| PendingShrink {
                    from: *from,
                    to: *to,
                    peak_before,
                });
                Vec::new()
            }
            Telemetry::StepMemory(m) => self.step(m),
            Telemetry::Sample(s) => self.sample(s, t),
            _ => Vec::new(),
        }
    }

    /// Raises `kind` when `raise` holds and clears it when `clear` holds, once each.
    fn set(
        &mut self,
        kind: HintKind,
        step: u64,
        figure: u64,
        raise: bool,
        clear: bool,
        text: impl FnOnce(bool) -> String,
    ) -> Option<Hint> {
        let up = self.active.contains(&kind);
        let raised = if !up && raise {
            self.active.insert(kind);
            true
        } else if up && clear {
            self.active.remove(&kind);
            false
        } else {
            return None;
        };
        Some(Hint {
            hint: kind,
            raised,
            step,
            figure_bytes: figure,
            text: text(raised),
        })
    }

    fn step(&mut self, m: &StepMemory) -> Vec<Hint> {
        let same = self
            .last
            .as_ref()
            .is_some_and(|l| l.micro_batch == m.micro_batch && l.seq_len == m.seq_len);
        if !same {
            // The first step at a new shape warms up (new buffer sizes, the optimizer's
            // state on step 1): the window starts after it.
            self.same_shape.clear();
        } else {
            self.same_shape.push_back(m.peak_bytes);
            if self.same_shape.len() > LEAK_WINDOW {
                self.same_shape.pop_front();
            }
        }
        self.by_size
            .insert((m.seq_len, m.micro_batch), m.peak_bytes);
        self.last = Some(m.clone());
        let mut out = Vec::new();
        out.extend(self.leak(m));
        out.extend(self.shrink_kept(m));
        out.extend(self.activations(m));
        out.extend(self.optimizer(m));
        out.extend(self.limit_lowered(m));
        out
    }

    fn leak(&mut self, m: &StepMemory) -> Option<Hint> {
        if self.same_shape.len() < LEAK_WINDOW {
            return None;
        }
        let peaks: Vec<f64> = self.same_shape.iter().map(|&p| p as f64).collect();
        let slope = slope(&peaks);
        let min = LEAK_MIN_BYTES.max(LEAK_MIN_SHARE * m.peak_bytes as f64);
        // Every step at least half the rate higher than the one before: noise goes both
        // ways, and a warm-up's rises shrink step by step.
        let rising = peaks
            .windows(2)
            .filter(|w| w[1] - w[0] >= min / 2.0)
            .count();
        let raise = slope >= min && rising == peaks.len() - 1;
        let clear = slope < min / 2.0;
        let (mb, len, n) = (m.micro_batch, m.seq_len, peaks.len());
        self.set(
            HintKind::Leak,
            m.step,
            slope.max(0.0) as u64,
            raise,
            clear,
            |raised| {
                if raised {
                    format!(
                        "the step's peak rises {:.1} MiB per step at a constant micro-batch \
                         {mb} × {len} tokens (over the last {n} steps, now {}): something \
                         keeps tensors across steps (a list of losses kept without .item(), \
                         outputs held for logging, a growing cache); at this rate it reaches \
                         the limit in about {} steps",
                        slope / MIB,
                        fmt_bytes(m.peak_bytes),
                        steps_left(m, slope),
                    )
                } else {
                    format!(
                        "the step's peak no longer rises ({:.1} MiB per step over the last \
                         {n} steps)",
                        slope / MIB
                    )
                }
            },
        )
    }

    fn shrink_kept(&mut self, m: &StepMemory) -> Option<Hint> {
        if let Some(before) = self.shrink_held {
            // Up: cleared once a step at or below the size shrunk to peaks clearly lower.
            let gone = m.peak_bytes < (before as f64 * SHRINK_KEPT) as u64;
            let now = m.peak_bytes;
            let out = self.set(
                HintKind::ShrinkIneffective,
                m.step,
                now,
                false,
                gone,
                |_| {
                    format!(
                        "the step's peak fell to {} (from {} before the shrink): the memory \
                         the shrink could not free is back",
                        fmt_bytes(now),
                        fmt_bytes(before)
                    )
                },
            );
            if out.is_some() {
                self.shrink_held = None;
            }
            return out;
        }
        let s = self.shrink?;
        if m.micro_batch != s.to {
            return None;
        }
        self.shrink = None;
        let kept = m.peak_bytes as f64 >= s.peak_before as f64 * SHRINK_KEPT;
        if !kept {
            return None;
        }
        self.shrink_held = Some(s.peak_before);
        let now = m.peak_bytes;
        self.set(
            HintKind::ShrinkIneffective,
            m.step,
            now,
            true,
            false,
            |_| {
                format!(
                    "shrinking the micro-batch {} → {} did not lower the step's peak ({} \
                     before, {} after): what fills memory does not scale with the batch \
                     (memory kept across steps, a cache, another process); smaller batches \
                     will not help — find what holds it (the leak and outside-allocator \
                     hints, the allocator panel)",
                    s.from,
                    s.to,
                    fmt_bytes(s.peak_before),
                    fmt_bytes(now)
                )
            },
        )
    }

    /// The activation memory per sample at `m`'s length, and the fixed part: a straight
    /// line through the latest peak at each micro-batch seen at that length.
    fn fit(&self, seq_len: usize) -> Option<(f64, f64)> {
        let pts: Vec<(f64, f64)> = self
            .by_size
            .range((seq_len, 0)..=(seq_len, usize::MAX))
            .map(|(&(_, mb), &p)| (mb as f64, p as f64))
            .collect();
        if pts.len() < 2 {
            return None;
        }
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        if sxx <= 0.0 {
            return None;
        }
        let per_sample = sxy / sxx;
        (per_sample > 0.0).then(|| (per_sample, (my - per_sample * mx).max(0.0)))
    }

    fn activations(&mut self, m: &StepMemory) -> Option<Hint> {
        let (per_sample, fixed) = self.fit(m.seq_len)?;
        let act = per_sample * m.micro_batch as f64;
        let share = act / m.peak_bytes.max(1) as f64;
        let target = self.target;
        let room = target * m.limit_bytes as f64 - fixed;
        let fits = |per: f64| (room / per).floor().max(0.0) as u64;
        let (now_fits, bf16_fits) = (fits(per_sample), fits(per_sample / 2.0));
        let (mb, len) = (m.micro_batch, m.seq_len);
        self.set(
            HintKind::Activations,
            m.step,
            act as u64,
            share >= ACT_RAISE,
            share < ACT_CLEAR,
            |raised| {
                if raised {
                    format!(
                        "activations are {:.0}% of the step's peak ({} of {}: {} per sample \
                         of {len} tokens at micro-batch {mb}, fixed part {}): shorter \
                         sequences or a smaller micro-batch lower them in proportion; bf16 \
                         compute (about half the activation memory, from fp32) would allow \
                         micro-batch ≈ {bf16_fits} under the {:.0}% target instead of ≈ \
                         {now_fits}; activation checkpointing keeps only each block's input \
                         (most of the rest, for about a third more compute)",
                        share * 100.0,
                        fmt_bytes(act as u64),
                        fmt_bytes(m.peak_bytes),
                        fmt_bytes(per_sample as u64),
                        fmt_bytes(fixed as u64),
                        target * 100.0,
                    )
                } else {
                    format!(
                        "activations are {:.0}% of the step's peak now (micro-batch {mb})",
                        share * 100.0
                    )
                }
            },
        )
    }

    fn optimizer(&mut self, m: &StepMemory) -> Option<Hint> {
        let parts = self.parts?;
        if parts.optimizer == 0 {
            return None;
        }
        let share = parts.optimizer as f64 / m.peak_bytes.max(1) as f64;
        let frees = parts.optimizer.saturating_sub(parts.parameters);
        self.set(
            HintKind::OptimizerState,
            m.step,
            parts.optimizer,
            share >= OPT_RAISE,
            share < OPT_CLEAR,
            |raised| {
                if raised {
                    format!(
                        "the optimizer's state is {} ({:.0}% of the step's peak {}; the \
                         parameters are {}): an optimizer keeping one parameter-sized buffer \
                         (SGD with momentum) would free about {}; a factored or 8-bit one \
                         (Adafactor, 8-bit Adam) most of it",
                        fmt_bytes(parts.optimizer),
                        share * 100.0,
                        fmt_bytes(m.peak_bytes),
                        fmt_bytes(parts.parameters),
                        fmt_bytes(frees),
                    )
                } else {
                    format!(
                        "the optimizer's state is {:.0}% of the step's peak now",
                        share * 100.0
                    )
                }
            },
        )
    }

    /// CPU: other processes taking host memory lower the limit below the configured one.
    fn limit_lowered(&mut self, m: &StepMemory) -> Option<Hint> {
        // On CUDA the step's peak already counts other processes; NVML says how much.
        if m.configured_limit_bytes == 0 || self.last_sample_cuda {
            return None;
        }
        let taken = m.configured_limit_bytes.saturating_sub(m.limit_bytes);
        let share = taken as f64 / m.configured_limit_bytes as f64;
        self.set(
            HintKind::OutsideAllocator,
            m.step,
            taken,
            share >= OUTSIDE_RAISE,
            share < OUTSIDE_CLEAR,
            |raised| {
                if raised {
                    format!(
                        "other processes hold host memory this run's limit counted on: the \
                         limit fell from {} to {} ({} taken, {:.0}%); ending them gives the \
                         run that much back (the controller sizes batches to what is left)",
                        fmt_bytes(m.configured_limit_bytes),
                        fmt_bytes(m.limit_bytes),
                        fmt_bytes(taken),
                        share * 100.0
                    )
                } else {
                    format!(
                        "the limit is back to {} of the configured {}",
                        fmt_bytes(m.limit_bytes),
                        fmt_bytes(m.configured_limit_bytes)
                    )
                }
            },
        )
    }

    fn sample(&mut self, s: &SystemSample, t: f64) -> Vec<Hint> {
        let step = self.last.as_ref().map_or(0, |m| m.step);
        let mut out = Vec::new();
        if let Some(a) = &s.allocator {
            self.last_sample_cuda = true;
            out.extend(self.fragmentation(step, a, t));
            if let Some(g) = &s.gpu {
                out.extend(self.outside(step, a, g));
            }
        }
        out
    }

    fn fragmentation(&mut self, step: u64, a: &AllocatorStats, t: f64) -> Option<Hint> {
        let share = a.fragmentation();
        let high = share >= FRAG_RAISE && a.inactive_split >= FRAG_MIN_BYTES;
        self.frag_run = match (high, self.frag_run) {
            (false, _) => (0, t),
            (true, (0, _)) => (1, t),
            (true, (n, since)) => (n + 1, since),
        };
        let held = self.frag_run.0 >= FRAG_SAMPLES && t - self.frag_run.1 >= FRAG_HOLD_S;
        let unused = a.reserved.saturating_sub(a.allocated);
        self.set(
            HintKind::Fragmentation,
            step,
            unused,
            held,
            share < FRAG_CLEAR,
            |raised| {
                if raised {
                    format!(
                        "the allocator reserves {} but tensors use {}: {} above, {} of it in \
                         split blocks nobody uses ({:.0}% of reserved), which emptying the \
                         cache cannot return; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                         grows segments in place instead of splitting them and would give \
                         back most of the {}",
                        fmt_bytes(a.reserved),
                        fmt_bytes(a.allocated),
                        fmt_bytes(unused),
                        fmt_bytes(a.inactive_split),
                        share * 100.0,
                        fmt_bytes(a.inactive_split),
                    )
                } else {
                    format!(
                        "split blocks nobody uses are {:.0}% of reserved now ({})",
                        share * 100.0,
                        fmt_bytes(a.inactive_split)
                    )
                }
            },
        )
    }

    fn outside(&mut self, step: u64, a: &AllocatorStats, g: &GpuStats) -> Option<Hint> {
        if g.mem_total == 0 {
            return None;
        }
        let outside = g.mem_used.saturating_sub(a.reserved);
        let share = outside as f64 / g.mem_total as f64;
        self.set(
            HintKind::OutsideAllocator,
            step,
            outside,
            share >= OUTSIDE_RAISE,
            share < OUTSIDE_CLEAR,
            |raised| {
                if raised {
                    format!(
                        "{} of the device's {} ({:.0}%) is held outside this run's allocator \
                         (the CUDA context, other processes, libraries' workspaces): a \
                         device of its own or ending the other processes gives the run up \
                         to that much more",
                        fmt_bytes(outside),
                        fmt_bytes(g.mem_total),
                        share * 100.0
                    )
                } else {
                    format!(
                        "memory outside the allocator is {} now ({:.0}% of the device)",
                        fmt_bytes(outside),
                        share * 100.0
                    )
                }
            },
        )
    }
}

/// Least-squares slope of `ys` against 0, 1, 2, ...
fn slope(ys: &[f64]) -> f64 {
    let n = ys.len() as f64;
    let mx = (n - 1.0) / 2.0;
    let my = ys.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in ys.iter().enumerate() {
        let dx = i as f64 - mx;
        sxy += dx * (y - my);
        sxx += dx * dx;
    }
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// Steps until a peak rising `per_step` reaches `m`'s limit.
fn steps_left(m: &StepMemory, per_step: f64) -> u64 {
    (m.limit_bytes.saturating_sub(m.peak_bytes) as f64 / per_step.max(1.0)).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::ResizeReason;

    const MB: u64 = 1 << 20;

    fn mem(step: u64, mb: usize, peak: u64) -> Telemetry {
        Telemetry::StepMemory(StepMemory {
            step,
            micro_batch: mb,
            seq_len: 128,
            peak_bytes: peak,
            predicted_bytes: None,
            limit_bytes: 4096 * MB,
            configured_limit_bytes: 4096 * MB,
            usage: peak as f64 / (4096 * MB) as f64,
        })
    }

    std::thread_local! {
        /// The run clock of a test's messages (each test runs on its own thread).
        static CLOCK: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
    }

    /// Messages a quarter second apart (the sampler's old 4 Hz), on from the last one fed.
    fn feed(e: &mut HintEngine, msgs: impl IntoIterator<Item = Telemetry>) -> Vec<Hint> {
        feed_every(e, msgs, 0.25)
    }

    fn feed_every(
        e: &mut HintEngine,
        msgs: impl IntoIterator<Item = Telemetry>,
        every: f64,
    ) -> Vec<Hint> {
        msgs.into_iter()
            .flat_map(|m| {
                let t = CLOCK.get() + every;
                CLOCK.set(t);
                e.observe(&m, t)
            })
            .collect()
    }

    #[test]
    fn a_rising_peak_at_one_shape_is_a_leak_said_in_mib_per_step_then_cleared() {
        let mut e = HintEngine::new();
        // Flat for a while: nothing.
        assert!(feed(&mut e, (1..=8).map(|s| mem(s, 8, 500 * MB))).is_empty());
        // 4 MiB more every step.
        let got = feed(
            &mut e,
            (9..=16).map(|s| mem(s, 8, 500 * MB + (s - 8) * 4 * MB)),
        );
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].raised && got[0].hint == HintKind::Leak);
        assert_eq!(got[0].figure_bytes, 4 * MB);
        assert!(got[0].text.contains("4.0 MiB per step"), "{}", got[0].text);
        // Raised once: it keeps rising, nothing more is said.
        assert!(feed(
            &mut e,
            (17..=20).map(|s| mem(s, 8, 500 * MB + (s - 8) * 4 * MB))
        )
        .is_empty());
        // The leak stops: cleared once the window is flat.
        let got = feed(&mut e, (21..=30).map(|s| mem(s, 8, 560 * MB)));
        assert_eq!(got.len(), 1);
        assert!(!got[0].raised && got[0].hint == HintKind::Leak);
    }

    #[test]
    fn noise_and_batch_changes_are_no_leak() {
        let mut e = HintEngine::new();
        let noisy = [0, 3, 1, 2, 0, 3, 1, 2, 0, 3];
        assert!(feed(
            &mut e,
            noisy
                .iter()
                .enumerate()
                .map(|(i, n)| mem(i as u64 + 1, 8, 500 * MB + n * MB / 2))
        )
        .is_empty());
        // Growing the batch grows the peak, at a different shape each step: no leak.
        let got = feed(
            &mut e,
            (0..8).map(|i| mem(20 + i, 8 + i as usize, 500 * MB + i * 40 * MB)),
        );
        assert!(got.iter().all(|h| h.hint != HintKind::Leak), "{got:?}");
    }

    #[test]
    fn a_warm_up_whose_rises_shrink_is_no_leak() {
        let mut e = HintEngine::new();
        // +16, +8, +4, +2, +1, +0.5 MiB: a cache filling, then settled.
        let mut peak = 400 * MB;
        let got = feed(
            &mut e,
            (1..=8).map(|s| {
                peak += (32 * MB) >> s;
                mem(s, 8, peak)
            }),
        );
        assert!(got.iter().all(|h| h.hint != HintKind::Leak), "{got:?}");
    }

    fn shrink(from: usize, to: usize) -> Telemetry {
        Telemetry::Decision {
            step: 3,
            decision: Decision::Resize {
                from,
                to,
                reason: ResizeReason::Critical,
                usage: 0.95,
                predicted: None,
            },
        }
    }

    #[test]
    fn a_shrink_that_kept_the_peak_is_said_and_cleared_when_the_peak_falls() {
        let mut e = HintEngine::new();
        let got = feed(
            &mut e,
            [mem(1, 16, 900 * MB), shrink(16, 8), mem(2, 8, 895 * MB)],
        );
        let h = got.iter().find(|h| h.hint == HintKind::ShrinkIneffective);
        let h = h.expect("raised");
        assert!(h.raised && h.text.contains("16 → 8"), "{}", h.text);
        let got = feed(&mut e, [mem(3, 8, 600 * MB)]);
        assert!(got
            .iter()
            .any(|h| h.hint == HintKind::ShrinkIneffective && !h.raised));
    }

    #[test]
    fn a_shrink_that_worked_says_nothing() {
        let mut e = HintEngine::new();
        let got = feed(
            &mut e,
            [mem(1, 16, 900 * MB), shrink(16, 8), mem(2, 8, 600 * MB)],
        );
        assert!(got.iter().all(|h| h.hint != HintKind::ShrinkIneffective));
    }

    #[test]
    fn activations_dominating_name_the_micro_batch_bf16_would_allow() {
        let mut e = HintEngine::new();
        // 100 MiB fixed, 50 MiB per sample: at 16 samples activations are 800 of 900.
        let got = feed(&mut e, [mem(1, 4, 300 * MB), mem(2, 16, 900 * MB)]);
        let h = got
            .iter()
            .find(|h| h.hint == HintKind::Activations)
            .expect("raised");
        assert_eq!(h.figure_bytes, 800 * MB);
        // Target 90% of 4096 MiB = 3686.4 MiB; minus 100 fixed over 25 MiB per sample.
        assert!(
            h.text.contains("micro-batch ≈ 143 under the 90% target"),
            "{}",
            h.text
        );
        assert!(h.text.contains("instead of ≈ 71"), "{}", h.text);
        // A large fixed part (a bigger model at one sample) clears it.
        let got = feed(&mut e, [mem(3, 1, 150 * MB)]);
        assert!(got
            .iter()
            .any(|h| h.hint == HintKind::Activations && !h.raised));
    }

    #[test]
    fn optimizer_state_dominating_is_said_from_the_counted_parts() {
        let mut e = HintEngine::new();
        let parts = MemoryParts {
            parameters: 200 * MB,
            gradients: 200 * MB,
            optimizer: 400 * MB,
        };
        let got = feed(&mut e, [Telemetry::MemoryParts(parts), mem(1, 1, 900 * MB)]);
        let h = got
            .iter()
            .find(|h| h.hint == HintKind::OptimizerState)
            .expect("raised");
        assert!(h.text.contains("free about 200 MiB"), "{}", h.text);
        let got = feed(&mut e, [mem(2, 8, 2000 * MB)]);
        assert!(got
            .iter()
            .any(|h| h.hint == HintKind::OptimizerState && !h.raised));
    }

    #[test]
    fn other_processes_lowering_the_cpu_limit_are_said_with_what_they_took() {
        let mut e = HintEngine::new();
        let mut m = match mem(1, 4, 500 * MB) {
            Telemetry::StepMemory(m) => m,
            _ => unreachable!(),
        };
        m.limit_bytes = 3000 * MB;
        let got = feed(&mut e, [Telemetry::StepMemory(m.clone())]);
        let h = got
            .iter()
            .find(|h| h.hint == HintKind::OutsideAllocator)
            .expect("raised");
        assert_eq!(h.figure_bytes, 1096 * MB);
        m.limit_bytes = 3900 * MB;
        let got = feed(&mut e, [Telemetry::StepMemory(m)]);
        assert!(got
            .iter()
            .any(|h| h.hint == HintKind::OutsideAllocator && !h.raised));
    }

    fn cuda(allocated: u64, reserved: u64, split: u64, used: u64) -> Telemetry {
        Telemetry::Sample(SystemSample {
            gpu: Some(GpuStats {
                mem_used: used,
                mem_total: 80 << 30,
                ..Default::default()
            }),
            allocator: Some(AllocatorStats {
                allocated,
                reserved,
                inactive_split: split,
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn fragmentation_held_for_three_samples_names_expandable_segments() {
        let g = 1u64 << 30;
        let mut e = HintEngine::new();
        let frag = cuda(6 * g, 10 * g, 3 * g, 11 * g);
        assert!(feed(&mut e, [frag.clone(), frag.clone()]).is_empty());
        let got = feed(&mut e, [frag]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].figure_bytes, 4 * g);
        assert!(got[0].text.contains("expandable_segments:True"));
        let got = feed(&mut e, [cuda(9 * g, 10 * g, g / 2, 11 * g)]);
        assert!(!got[0].raised);
    }

    /// At 20 Hz three samples are a tenth of a second of one step's transient cache: the
    /// fragmentation must hold half a second before it is said.
    #[test]
    fn fragmentation_must_hold_half_a_second_at_any_rate() {
        let g = 1u64 << 30;
        let mut e = HintEngine::new();
        let frag = cuda(6 * g, 10 * g, 3 * g, 11 * g);
        // 0.45 s from the first to the tenth.
        assert!(feed_every(&mut e, vec![frag.clone(); 10], 0.05).is_empty());
        let got = feed_every(&mut e, vec![frag.clone(); 2], 0.05);
        assert_eq!(got.len(), 1, "0.55 s held at 20 Hz");
        // A sample without it starts the count again.
        feed_every(&mut e, [cuda(9 * g, 10 * g, g / 2, 11 * g)], 0.05);
        assert!(feed_every(&mut e, vec![frag; 10], 0.05).is_empty());
    }

    #[test]
    fn memory_outside_the_cuda_allocator_is_said_and_cleared() {
        let g = 1u64 << 30;
        let mut e = HintEngine::new();
        let got = feed(&mut e, [cuda(9 * g, 10 * g, 0, 30 * g)]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].figure_bytes, 20 * g);
        // A CUDA run's step peaks (limit never lowered) leave the NVML-based hint alone.
        assert!(feed(&mut e, [mem(1, 4, 10 * g)])
            .iter()
            .all(|h| h.hint != HintKind::OutsideAllocator));
        let got = feed(&mut e, [cuda(9 * g, 10 * g, 0, 11 * g)]);
        assert!(!got[0].raised);
    }

    #[test]
    fn hints_travel_on_the_bus_after_the_record_that_raised_them() {
        let (bus, rx) = crate::Bus::new(true);
        let bus = bus.with_hints();
        bus.send(mem(1, 4, 300 * MB));
        bus.send(mem(2, 16, 900 * MB));
        let log: Vec<_> = rx.log.unwrap().try_iter().map(|r| r.msg.kind()).collect();
        assert_eq!(log, ["step_memory", "step_memory", "hint"]);
        let ev: Vec<_> = rx.events.try_iter().map(|r| r.msg).collect();
        assert!(matches!(&ev[..], [Telemetry::Hint(h)] if h.hint == HintKind::Activations));
    }
}
