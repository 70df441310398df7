//! A memory-curve simulator for the batch controller.
//!
//! The policy is pure, so it is driven here by synthetic step observations from generated
//! memory curves, the way the trainer drives it: `set_limit`, the forecast, the step (an
//! OOM when the true peak passes the limit on a hard budget, then `on_oom` and a retry),
//! `observe`, and `EmptyCache` applied to the curve's cache.
//!
//! Curves (a seeded sweep): fixed part 0–85% of the limit; per-token cost linear plus an
//! attention term quadratic in length (0–60% of the cost at the longest length; 0–3% for
//! random lengths with no attention term to speak of, a small model's); noise up
//! to ±2% (the controller told to expect 2%, as the trainer tells it of a resident set),
//! or up to ±0.2% with the controller told 0.5% (an exact meter: a CUDA allocator's
//! peak, which repeats to the byte); a first step lower than the rest (optimizer state allocated during it); a
//! baseline that under-states the fixed part (gradients, and for PyTorch-style loops the
//! optimizer state, come on top); peaks that do not fall when the batch shrinks (retained
//! heap pages, a CUDA-style cache), memory taken from outside mid-run, a limit that drops;
//! lengths fixed, ramped and random; starts at 1, feasible/8, feasible and 4× feasible;
//! feasible sizes from 1 to 1500 (tight to roomy budgets); hard and soft budgets.
//!
//! `HEADROOM_SIM_SILENT_DROP` makes the limit drops silent (the controller is not told the
//! new limit: the trainer tells it, so no recorded run is silent) and, set to a number of
//! steps, passing (a spike): the other side of what an OOM at a settled size can mean
//! (docs/CONTROLLER.md, "The margin"). `HEADROOM_SIM_RUNS=1` prints one line per new run
//! (its OOMs, steps at or over critical, final and feasible size, whether it met all five).
//!
//! `HEADROOM_SIM_CURVES` sets how many curves per family (default 40); from 40 up the new
//! controller must meet every property on a per-family share of curves (`Family::floor`),
//! and never decide below half (but after an OOM) nor set a ceiling under one sequence.
//! The table of pass rates, old controller against new:
//! `CARGO_TARGET_DIR=/work/target-core cargo test -p headroom-core --release --test policy_sim -- --nocapture`
#[path = "sim/old_controller.rs"]
mod old_controller;
#[path = "support/trace.rs"]
mod trace;

use headroom_core::policy::{
    ControllerConfig, Decision, OomOutcome, ResizeReason, StepObservation, Thresholds, Upcoming,
    ALLOCATOR_NOISE, RSS_NOISE,
};
use std::ops::Deref;

use headroom_core::units::splitmix64;
use old_controller::OldController;
use trace::Traced;

const LIMIT: u64 = 8 << 30;
const STEPS: u64 = 200;
/// Steps ahead the simulated trainer tells the controller the longest length of.
const HORIZON: u64 = 16;
const MIN_LEN_CHANGES_SLACK: usize = 0;
/// Steps at critical that make a run "held there" (rather than a step or two past it).
const HELD_CRITICAL: u32 = 10;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        splitmix64(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    FixedClean,
    FixedNoBaseline,
    FixedHeap,
    FixedCache,
    FixedOutside,
    FixedLimitDrop,
    Ramp,
    Random,
    RandomHeap,
    FixedExact,
    RandomLinear,
}

const FAMILIES: [Family; 11] = [
    Family::FixedClean,
    Family::FixedNoBaseline,
    Family::FixedHeap,
    Family::FixedCache,
    Family::FixedOutside,
    Family::FixedLimitDrop,
    Family::Ramp,
    Family::Random,
    Family::RandomHeap,
    Family::FixedExact,
    Family::RandomLinear,
];

impl Family {
    /// Least share of curves (percent) on which the new controller must meet all five
    /// properties: what it achieved at 40 and at 400 curves per family, less 3 points, so
    /// a regression fails the test while the seeded sweep stays as it is.
    fn floor(self) -> u32 {
        match self {
            Family::FixedClean => 84,
            Family::FixedNoBaseline => 75,
            Family::FixedHeap => 87,
            Family::FixedCache => 75,
            Family::FixedOutside => 69,
            Family::FixedLimitDrop => 77,
            Family::Ramp => 89,
            Family::Random => 86,
            Family::RandomHeap => 65,
            Family::FixedExact => 89,
            Family::RandomLinear => 89,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::FixedClean => "fixed length",
            Family::FixedNoBaseline => "fixed, no baseline",
            Family::FixedHeap => "fixed, retained heap (soft)",
            Family::FixedCache => "fixed, allocator cache",
            Family::FixedOutside => "fixed, outside process",
            Family::FixedLimitDrop => "fixed, limit drops",
            Family::Ramp => "ramped length",
            Family::Random => "random length",
            Family::RandomHeap => "random, retained heap (soft)",
            Family::FixedExact => "fixed, exact meter (GPU)",
            Family::RandomLinear => "random, no attention term",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Retain {
    None,
    /// RSS keeps this share of the highest peak so far (freed pages stay mapped).
    Heap(f64),
    /// Reserved memory stays at its high-water mark until `EmptyCache`.
    Cache,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Lens {
    Fixed,
    Ramp { lo: usize, steps: u64 },
    Random { lo: usize, seed: u64 },
}

/// Memory in fractions of `LIMIT`.
#[derive(Debug, Clone)]
struct Curve {
    family: Family,
    fixed: f64,
    /// Per-token cost: `a + b × seq`.
    a: f64,
    b: f64,
    noise: f64,
    /// The scatter the controller is told to expect (what the trainer knows of its meter).
    meter_noise: f64,
    /// Missing from the first successful step.
    opt: f64,
    baseline: Option<f64>,
    early_baseline: Option<f64>,
    retain: Retain,
    /// (from step, fraction of the limit another process takes; counted in the reading).
    outside: Option<(u64, f64)>,
    /// (from step, fraction the available memory drops by).
    limit_drop: Option<(u64, f64)>,
    /// The drop is not told to the controller, and lasts this many steps (`u64::MAX`: for
    /// good): `HEADROOM_SIM_SILENT_DROP`.
    silent_drop: Option<u64>,
    hard: bool,
    lens: Lens,
    lmax: usize,
    start: usize,
    max_micro: usize,
    seed: u64,
}

impl Curve {
    fn generate(family: Family, index: u64) -> Curve {
        let seed = splitmix64(0x11 ^ (index << 8) ^ family as u64);
        let mut r = Rng(seed);
        let fixed = r.range(0.0, 0.85);
        let lmax = [32usize, 64, 128, 256, 512][(r.next() % 5) as usize];
        // Feasible sizes log-uniform from 1 to 1500: tight to roomy budgets.
        let n = r.range(0.0, 1500f64.ln()).exp().floor().max(1.0);
        let per_seq = (0.9 - fixed) / (n + 0.5);
        let q = r.range(0.0, 0.6);
        // A small model's attention is a sliver of its memory (through the binary, a
        // 2-layer, 64-wide GPT on 32–256 random lengths reads a line in tokens).
        let q = if family == Family::RandomLinear {
            q / 20.0
        } else {
            q
        };
        let a = (1.0 - q) * per_seq / lmax as f64;
        let b = q * per_seq / (lmax * lmax) as f64;
        // A CUDA allocator's peak repeats to the byte; a process's resident set scatters.
        let (noise, meter_noise) = match (family, r.range(0.0, 0.02)) {
            (Family::FixedExact, n) => (n / 10.0, ALLOCATOR_NOISE),
            // Under a hard cap the trainer mmaps large tensors: the resident set follows
            // them and repeats to about half a percent.
            (Family::RandomLinear, n) => (n / 4.0, RSS_NOISE),
            (_, n) => (n, RSS_NOISE),
        };
        let grads = r.range(0.0, 0.3) * fixed;
        let opt = r.range(0.0, 0.5) * fixed;
        let pytorch = r.unit() < 0.5;
        let baseline = match family {
            Family::FixedNoBaseline => None,
            _ => Some(fixed - grads),
        };
        // A PyTorch-style loop creates the optimizer state during step 1: the baseline
        // before it misses that too (measured again before step 2).
        let early_baseline = baseline.map(|b| if pytorch { b - opt } else { b });
        let retain = match family {
            Family::FixedHeap | Family::RandomHeap => Retain::Heap(r.range(0.9, 1.0)),
            Family::FixedCache => Retain::Cache,
            _ => Retain::None,
        };
        let event_at = 60 + r.next() % 60;
        let outside = (family == Family::FixedOutside)
            .then(|| (event_at, r.range(0.03, 0.3 * fixed.max(0.2))));
        let limit_drop = (family == Family::FixedLimitDrop)
            .then(|| (event_at, r.range(0.03, 0.3 * fixed.max(0.2))));
        let silent_drop = std::env::var("HEADROOM_SIM_SILENT_DROP")
            .ok()
            .map(|v| v.parse().unwrap_or(u64::MAX));
        let hard = match family {
            Family::FixedHeap | Family::RandomHeap => false,
            Family::FixedCache | Family::FixedExact => true,
            _ => r.unit() < 0.5,
        };
        let lens = match family {
            Family::Ramp => Lens::Ramp {
                lo: lmax / 4,
                steps: 30 + r.next() % 90,
            },
            Family::Random | Family::RandomHeap | Family::RandomLinear => Lens::Random {
                lo: lmax / 8,
                seed: r.next(),
            },
            _ => Lens::Fixed,
        };
        let mut c = Curve {
            family,
            fixed,
            a,
            b,
            noise,
            meter_noise,
            opt,
            baseline,
            early_baseline,
            retain,
            outside,
            limit_drop,
            silent_drop,
            hard,
            lens,
            lmax,
            start: 1,
            max_micro: 1,
            seed,
        };
        let f = c.feasible(0.0, 1.0);
        c.start = match index % 4 {
            0 => 1,
            1 => (f / 8).max(1),
            2 => f,
            _ => 4 * f,
        };
        c.max_micro = (8 * f).max(256);
        c
    }

    fn len_at(&self, step: u64) -> usize {
        match self.lens {
            Lens::Fixed => self.lmax,
            // As the trainer's schedule: linear from `lo` to the longest.
            Lens::Ramp { lo, steps } => {
                let done = step.saturating_sub(1).min(steps) as f64 / steps as f64;
                lo + ((self.lmax - lo) as f64 * done).round() as usize
            }
            Lens::Random { lo, seed } => {
                lo + (splitmix64(seed ^ step) % (self.lmax - lo + 1) as u64) as usize
            }
        }
    }

    /// The batch's own steady peak (fixed part included).
    fn own(&self, mb: usize, seq: usize) -> f64 {
        self.fixed + (mb * seq) as f64 * (self.a + self.b * seq as f64)
    }

    fn outside_at(&self, step: u64) -> f64 {
        match self.outside {
            Some((from, x)) if step >= from => x,
            _ => 0.0,
        }
    }

    fn limit_at(&self, step: u64) -> f64 {
        let lasts = self.silent_drop.unwrap_or(u64::MAX);
        match self.limit_drop {
            Some((from, x)) if step >= from && step - from < lasts => 1.0 - x,
            _ => 1.0,
        }
    }

    /// The limit the controller is told at `step`.
    fn told_limit_at(&self, step: u64) -> f64 {
        match self.silent_drop {
            Some(_) => 1.0,
            None => self.limit_at(step),
        }
    }

    fn event_step(&self) -> Option<u64> {
        self.outside.or(self.limit_drop).map(|e| e.0)
    }

    /// Largest micro-batch whose steady peak at the longest length (plus memory taken
    /// from outside) stays under target of a limit of `limit` (what a probe would find).
    fn feasible(&self, outside: f64, limit: f64) -> usize {
        let goal = 0.9 * limit - outside - self.fixed;
        let per_seq = self.lmax as f64 * (self.a + self.b * self.lmax as f64);
        ((goal / per_seq).floor() as usize).max(1)
    }

    fn feasible_at(&self, step: u64) -> usize {
        self.feasible(self.outside_at(step), self.limit_at(step))
    }
}

/// What the simulated trainer needs of a controller, old or new.
trait Policy {
    fn start(cfg: ControllerConfig, limit: u64, micro: usize) -> Self;
    fn set_baseline(&mut self, bytes: u64);
    fn set_limit(&mut self, bytes: u64);
    fn before(&mut self, seq: usize, up: Upcoming) -> Vec<Decision>;
    fn observe(&mut self, obs: StepObservation) -> Vec<Decision>;
    fn on_oom(&mut self, mb: usize, seq: usize) -> OomOutcome;
    fn micro_batch(&self) -> usize;
    fn ceiling_tokens(&self) -> Option<u64>;
    /// The run's decision trace (see `support/trace.rs`), for the controller of today.
    fn trace(&self) -> Option<trace::TraceHash> {
        None
    }
}

/// Today's controller, every call traced.
impl Policy for Traced {
    fn start(cfg: ControllerConfig, limit: u64, micro: usize) -> Self {
        Traced::new(cfg, Thresholds::default(), limit, micro)
    }
    fn set_baseline(&mut self, bytes: u64) {
        Traced::set_baseline(self, bytes)
    }
    fn set_limit(&mut self, bytes: u64) {
        Traced::set_limit(self, bytes)
    }
    fn before(&mut self, seq: usize, up: Upcoming) -> Vec<Decision> {
        self.before_step_ahead(seq, up)
    }
    fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        Traced::observe(self, obs)
    }
    fn on_oom(&mut self, mb: usize, seq: usize) -> OomOutcome {
        Traced::on_oom(self, mb, seq)
    }
    fn micro_batch(&self) -> usize {
        self.deref().micro_batch()
    }
    fn ceiling_tokens(&self) -> Option<u64> {
        self.deref().ceiling_tokens()
    }
    fn trace(&self) -> Option<trace::TraceHash> {
        Some(Traced::trace(self))
    }
}

impl Policy for OldController {
    fn start(cfg: ControllerConfig, limit: u64, micro: usize) -> Self {
        OldController::new(cfg, Thresholds::default(), limit, micro)
    }
    fn set_baseline(&mut self, _: u64) {}
    fn set_limit(&mut self, _: u64) {}
    fn before(&mut self, seq: usize, _: Upcoming) -> Vec<Decision> {
        self.before_step(seq)
    }
    fn observe(&mut self, obs: StepObservation) -> Vec<Decision> {
        OldController::observe(self, obs)
    }
    fn on_oom(&mut self, mb: usize, seq: usize) -> OomOutcome {
        OldController::on_oom(self, mb, seq)
    }
    fn micro_batch(&self) -> usize {
        OldController::micro_batch(self)
    }
    fn ceiling_tokens(&self) -> Option<u64> {
        OldController::ceiling_tokens(self)
    }
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    converged: bool,
    critical_ok: bool,
    half_ok: bool,
    steady: bool,
    ceiling_ok: bool,
    gave_up: bool,
    /// OOMs, retries included.
    ooms: u32,
    /// The micro-batch at the end, and the feasible size then.
    final_mb: usize,
    feasible: usize,
    /// Steps at or above critical that a smaller micro-batch would have avoided.
    criticals: u32,
    why: Vec<String>,
    trace: Option<trace::TraceHash>,
}

impl Outcome {
    fn all(&self) -> bool {
        self.converged && self.critical_ok && self.half_ok && self.steady && self.ceiling_ok
    }
}

/// The band a settled size must be in: at most feasible, and within 10% of it (or, when
/// 10% of feasible is less memory than the noise, within 3.5% of the limit of target).
fn in_band(c: &Curve, mb: usize, step: u64) -> bool {
    let f = c.feasible_at(step);
    let usage = (c.own(mb, c.lmax) + c.outside_at(step)) / c.limit_at(step);
    mb <= f && (mb as f64 >= 0.9 * f as f64 || usage >= 0.9 - 0.035)
}

/// What a run over a retained heap is held to when no reading after its first step
/// followed the batch (each one was the first step's high-water mark): at most feasible.
/// Within 10% of feasible is not achievable there by any policy
/// (`a_heap_held_from_the_first_step_hides_sizes_more_than_ten_percent_apart`).
fn in_band_blind(c: &Curve, mb: usize, step: u64, followed: bool) -> bool {
    in_band(c, mb, step)
        || (matches!(c.retain, Retain::Heap(_)) && !followed && mb <= c.feasible_at(step))
}

fn run<P: Policy>(c: &Curve) -> Outcome {
    let cfg = ControllerConfig {
        max_micro_batch: c.max_micro,
        max_seq_len: c.lmax,
        reading_noise: c.meter_noise,
        heap_fragments: matches!(c.retain, Retain::Heap(_)),
        ..ControllerConfig::default()
    };
    let mut p = P::start(cfg, LIMIT, c.start);
    if let Some(b) = c.early_baseline {
        p.set_baseline((b * LIMIT as f64) as u64);
    }
    let mut r = Rng(c.seed ^ 0xabc);
    let mut o = Outcome::default();
    let mut first_done = false;
    let mut high_water: f64 = 0.0;
    let mut followed = false;
    let mut cache: f64 = 0.0;
    let mut criticals = 0u32;
    // (step, from, to, reason, triggering usage)
    let mut resizes: Vec<(u64, usize, usize, ResizeReason, f64)> = Vec::new();
    let mut ceiling_ok = true;
    let mut length_changes = 0usize;
    let mut mb_at_event = None;
    let event = c.event_step();
    let record = |ds: &[Decision], step: u64, cache: &mut f64, resizes: &mut Vec<_>| {
        for d in ds {
            match d {
                Decision::Resize {
                    from,
                    to,
                    reason,
                    usage,
                    ..
                } => resizes.push((step, *from, *to, *reason, *usage)),
                Decision::EmptyCache { .. } => *cache = 0.0,
                _ => {}
            }
        }
    };
    'steps: for step in 1..=STEPS {
        let seq = c.len_at(step);
        if step > 1 && seq != c.len_at(step - 1) {
            length_changes += 1;
        }
        let (mut up_len, mut up_step) = (seq, step);
        for s in step + 1..=step + HORIZON {
            if c.len_at(s) > up_len {
                (up_len, up_step) = (c.len_at(s), s);
            }
        }
        let limit = c.limit_at(step);
        p.set_limit((c.told_limit_at(step) * LIMIT as f64) as u64);
        if Some(step) == event {
            mb_at_event = Some(p.micro_batch());
        }
        let ds = p.before(
            seq,
            Upcoming {
                seq_len: up_len,
                step: up_step,
            },
        );
        record(&ds, step, &mut cache, &mut resizes);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let mb = p.micro_batch();
            let jitter = 1.0 + c.noise * (2.0 * r.unit() - 1.0);
            let own = (c.own(mb, seq) - if first_done { 0.0 } else { c.opt }) * jitter;
            let total = own + c.outside_at(step);
            // A step no micro-batch could have kept under critical (memory taken from
            // outside left no room even for one sequence, or the step already ran one
            // sequence and read critical on its noise) is the curve's, not the controller's.
            let avoidable = c.own(1, seq) + c.outside_at(step) < 0.95 * limit && mb > 1;
            if total >= 0.95 * limit && avoidable {
                criticals += 1;
            }
            if c.hard && total > limit {
                o.ooms += 1;
                let out = p.on_oom(mb, seq);
                record(&out.decisions, step, &mut cache, &mut resizes);
                match out.retry_with {
                    Some(_) if attempts < 20 => continue,
                    _ => {
                        o.gave_up = true;
                        o.why.push(format!("gave up at step {step}"));
                        break 'steps;
                    }
                }
            }
            high_water = high_water.max(own);
            cache = cache.max(own);
            let measured = match c.retain {
                Retain::None => total,
                Retain::Heap(keep) => total.max(keep * high_water),
                Retain::Cache => total.max(cache),
            };
            // A reading after the first that is the batch's own, not the heap's mark.
            followed |= first_done && measured <= total;
            if !first_done {
                if let Some(b) = c.baseline {
                    p.set_baseline((b * LIMIT as f64) as u64);
                }
            }
            first_done = true;
            let ds = p.observe(StepObservation {
                step,
                micro_batch: mb,
                seq_len: seq,
                peak_bytes: (measured.max(0.0) * LIMIT as f64) as u64,
            });
            if tracing() && !std::any::type_name::<P>().contains("Old") {
                println!(
                    "step {step:3} mb {mb:5} seq {seq:4} usage {measured:.4} (own {own:.4}) \
                     feasible {}: {ds:?}",
                    c.feasible_at(step)
                );
            }
            record(&ds, step, &mut cache, &mut resizes);
            if let Some(ct) = p.ceiling_tokens() {
                if ct <= seq as u64 {
                    ceiling_ok = false;
                }
            }
            break;
        }
    }
    let final_mb = p.micro_batch();
    (o.final_mb, o.feasible) = (final_mb, c.feasible_at(STEPS));
    o.trace = p.trace();
    o.ceiling_ok = ceiling_ok;
    if !ceiling_ok {
        o.why.push("ceiling below one sequence".into());
    }
    // Critical: once, plus once for a jump in the curve.
    let allowed = 1 + u32::from(event.is_some());
    o.criticals = criticals;
    o.critical_ok = criticals <= allowed;
    if !o.critical_ok {
        o.why
            .push(format!("[critical] {criticals} steps at/above critical"));
    }
    // Half: no decision below half the micro-batch except after an OOM (or a reading past
    // the whole limit on a soft budget, the same event without the error).
    let bad_half: Vec<_> = resizes
        .iter()
        .filter(|r| r.2 * 2 < r.1 && r.3 != ResizeReason::Oom && r.4 < 1.0)
        .collect();
    o.half_ok = bad_half.is_empty();
    if !o.half_ok {
        o.why.push(format!("[half] below half: {bad_half:?}"));
    }
    // Convergence.
    let adjustments = |from: u64, to: u64| {
        resizes
            .iter()
            .filter(|r| r.0 >= from && r.0 < to && r.3 != ResizeReason::Pinned)
            .count()
    };
    // (adjustments allowed, [(steps, size, step the size is judged at)]) per stretch of the
    // run: before and after a jump in the curve, or the whole run.
    let (allowed, judged): (usize, Vec<(u64, u64, usize, u64)>) = match (c.family, event) {
        (_, Some(e)) => (
            3,
            vec![
                (1, e, mb_at_event.unwrap_or(final_mb), e - 1),
                (e, STEPS + 1, final_mb, STEPS),
            ],
        ),
        (Family::Ramp, _) => (
            length_changes + MIN_LEN_CHANGES_SLACK,
            vec![(1, STEPS + 1, final_mb, STEPS)],
        ),
        (Family::Random | Family::RandomHeap | Family::RandomLinear, _) => {
            (6, vec![(1, STEPS + 1, final_mb, STEPS)])
        }
        _ => (3, vec![(1, STEPS + 1, final_mb, STEPS)]),
    };
    let mut count_ok = true;
    let mut band_ok = true;
    for &(from, to, mb, at) in &judged {
        count_ok &= adjustments(from, to) <= allowed;
        band_ok &= in_band_blind(c, mb, at, followed);
    }
    o.converged = count_ok && band_ok && !o.gave_up;
    if !o.converged {
        o.why.push(format!(
            "{}{}final {final_mb} vs feasible {} in {} adjustments (allowed {allowed}): {:?}",
            if band_ok { "" } else { "[band] " },
            if count_ok { "" } else { "[count] " },
            c.feasible_at(STEPS),
            resizes.len(),
            resizes.iter().take(12).collect::<Vec<_>>()
        ));
    }
    // Steady: once 20 steps pass without a resize, no resize reverses the one before it
    // (outside the steps right after a jump in the curve).
    let mut last_change = 0u64;
    let mut settled = false;
    let mut prev_dir: Option<bool> = None;
    let mut reversals = Vec::new();
    let mut i = 0;
    for step in 1..=STEPS {
        let near_event = event.is_some_and(|e| step >= e && step < e + 20);
        while i < resizes.len() && resizes[i].0 == step {
            let rz = resizes[i];
            let up = rz.2 > rz.1;
            if settled && !near_event && rz.3 != ResizeReason::Oom && prev_dir == Some(!up) {
                reversals.push(rz);
            }
            prev_dir = Some(up);
            last_change = step;
            i += 1;
        }
        if step >= last_change + 20 {
            settled = true;
        }
    }
    o.steady = reversals.is_empty();
    if !o.steady {
        o.why
            .push(format!("[oscillates] after settling: {reversals:?}"));
    }
    o
}

/// `HEADROOM_SIM_CURVE_TRACE=17` runs only curve 17 of each family (with
/// `HEADROOM_SIM_ONLY`, of one) and prints every step of the new controller.
fn trace_index() -> Option<u64> {
    std::env::var("HEADROOM_SIM_CURVE_TRACE")
        .ok()
        .and_then(|v| v.parse().ok())
}

fn tracing() -> bool {
    trace_index().is_some()
}

fn curves_per_family() -> u64 {
    std::env::var("HEADROOM_SIM_CURVES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

#[derive(Default, Clone, Copy)]
struct Tally {
    n: u32,
    conv: u32,
    crit: u32,
    half: u32,
    steady: u32,
    ceiling: u32,
    all: u32,
    /// Runs held at or above critical for 10 steps or more.
    held_critical: u32,
}

impl Tally {
    fn add(&mut self, o: &Outcome) {
        self.n += 1;
        self.conv += u32::from(o.converged);
        self.crit += u32::from(o.critical_ok);
        self.half += u32::from(o.half_ok);
        self.steady += u32::from(o.steady);
        self.ceiling += u32::from(o.ceiling_ok);
        self.all += u32::from(o.all());
        self.held_critical += u32::from(o.criticals >= HELD_CRITICAL);
    }
    fn pct(&self, x: u32) -> String {
        format!("{:.0}%", 100.0 * x as f64 / self.n.max(1) as f64)
    }
}

#[test]
fn simulated_curves_old_against_new() {
    let per = curves_per_family();
    // `HEADROOM_SIM_ONLY=random` runs the families whose name contains it;
    // `HEADROOM_SIM_SHOW=200` prints that many failures (default 40).
    let only = std::env::var("HEADROOM_SIM_ONLY").unwrap_or_default();
    let show: usize = std::env::var("HEADROOM_SIM_SHOW")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    let (mut old_total, mut new_total) = (Tally::default(), Tally::default());
    let mut floors = Vec::new();
    for fam in FAMILIES
        .into_iter()
        .filter(|f| f.name().contains(only.as_str()))
    {
        let (mut old, mut new) = (Tally::default(), Tally::default());
        for i in 0..per {
            if trace_index().is_some_and(|t| t != i) {
                continue;
            }
            let c = Curve::generate(fam, i);
            let o = run::<OldController>(&c);
            old.add(&o);
            old_total.add(&o);
            let n = run::<Traced>(&c);
            if std::env::var("HEADROOM_SIM_RUNS").is_ok() {
                println!(
                    "RUN {} #{i} ooms {} critical {} final {} feasible {} all {}",
                    fam.name(),
                    n.ooms,
                    n.criticals,
                    n.final_mb,
                    n.feasible,
                    n.all()
                );
            }
            new.add(&n);
            new_total.add(&n);
            if !n.all() {
                failures.push(format!(
                    "{} #{i} (fixed {:.2}, lmax {}, start {}, feasible {}, noise {:.3}, hard {}, baseline {:?}): {}",
                    fam.name(),
                    c.fixed,
                    c.lmax,
                    c.start,
                    c.feasible(0.0, 1.0),
                    c.noise,
                    c.hard,
                    c.baseline.map(|b| (b * 100.0).round() / 100.0),
                    n.why.join("; ")
                ));
            }
        }
        rows.push((fam.name(), old, new));
        floors.push((fam, new));
    }
    rows.push(("all families", old_total, new_total));
    println!(
        "\n{} curves ({per} per family), {STEPS} steps each; pass rate old → new\n",
        old_total.n
    );
    println!("| family | within 10% of feasible | critical at most once | never below half | no oscillation | ceiling ≥ 1 sequence | all |");
    println!("|---|---|---|---|---|---|---|");
    for (name, o, n) in &rows {
        println!(
            "| {name} | {} → {} | {} → {} | {} → {} | {} → {} | {} → {} | {} → {} |",
            o.pct(o.conv),
            n.pct(n.conv),
            o.pct(o.crit),
            n.pct(n.crit),
            o.pct(o.half),
            n.pct(n.half),
            o.pct(o.steady),
            n.pct(n.steady),
            o.pct(o.ceiling),
            n.pct(n.ceiling),
            o.pct(o.all),
            n.pct(n.all)
        );
    }
    println!(
        "\nruns held at or above critical for {HELD_CRITICAL}+ steps, old → new: {}",
        rows.iter()
            .map(|(name, o, n)| format!("{name} {} → {}", o.held_critical, n.held_critical))
            .collect::<Vec<_>>()
            .join("; ")
    );
    for f in failures.iter().take(show) {
        println!("FAIL {f}");
    }
    println!("{} of {} new runs failed", failures.len(), new_total.n);
    // Fewer curves than the default make the rates too coarse to hold to a floor.
    if per < 40 {
        println!("fewer than 40 curves per family: floors not checked");
        return;
    }
    let mut short = Vec::new();
    for (fam, t) in &floors {
        let pct = 100 * t.all / t.n.max(1);
        if pct < fam.floor() {
            short.push(format!("{}: {pct}% < {}%", fam.name(), fam.floor()));
        }
        // Memory that follows the batch: no run held at critical. (Over a retained heap
        // the readings stop following after the first step, and a run can sit at critical
        // with every reading the same; those families are reported, not held to zero.)
        if !matches!(fam, Family::FixedHeap | Family::RandomHeap) && t.held_critical > 0 {
            short.push(format!(
                "{}: {} runs held at critical for {HELD_CRITICAL}+ steps",
                fam.name(),
                t.held_critical
            ));
        }
        // Absolute: no decision below half but an OOM's, no ceiling below one sequence.
        if t.half < t.n || t.ceiling < t.n {
            short.push(format!(
                "{}: below half in {} runs, ceiling under a sequence in {}",
                fam.name(),
                t.n - t.half,
                t.n - t.ceiling
            ));
        }
    }
    assert!(short.is_empty(), "pass rates under their floors: {short:?}");
    if floors.len() == FAMILIES.len() {
        // The properties fail on the old controller: it meets all five on far fewer curves.
        assert!(
            old_total.all * 100 / old_total.n < 40
                && new_total.all >= old_total.all + old_total.n / 4,
            "old {} and new {} of {}",
            old_total.all,
            new_total.all,
            new_total.n
        );
    }
}

// ---------------------------------------------------------------------------------------
// The trainer's horizon: before each step the trainer tells the controller the longest
// length among its next 16 steps and the first step that brings it. On a ramp, a
// controller that plans for each length as it comes into view shrinks again and again,
// shrinks too far near the end of the ramp and grows back while lengths still rise,
// right after saying it holds; these runs hold it to one way down.

/// Steps ahead the real trainer looks (trainer/src/runner/mod.rs `LENGTH_HORIZON`).
const TRAINER_HORIZON: u64 = 16;

/// A memory curve like the real run's, in fractions of the limit.
#[derive(Debug, Clone, Copy)]
struct TrainerCurve {
    fixed: f64,
    /// Per-token cost `a + b × seq`.
    a: f64,
    b: f64,
    /// Readings scatter by up to ± this share.
    noise: f64,
    /// Missing from the first step (state allocated during it).
    first_low: f64,
    /// The baseline given before the first step.
    baseline: f64,
    start: usize,
    max_micro: usize,
    seed: u64,
}

impl TrainerCurve {
    /// Fixed part `fixed`, `feasible` sequences of `lmax` under target, attention a share
    /// `q` of a token's cost at `lmax`.
    fn new(fixed: f64, feasible: f64, q: f64, lmax: usize, seed: u64) -> TrainerCurve {
        let per_seq = (0.9 - fixed) / (feasible + 0.5);
        TrainerCurve {
            fixed,
            a: (1.0 - q) * per_seq / lmax as f64,
            b: q * per_seq / (lmax * lmax) as f64,
            noise: 0.01,
            first_low: 0.05,
            baseline: fixed - 0.04,
            start: 16,
            max_micro: 256,
            seed,
        }
    }
    fn own(&self, mb: usize, seq: usize) -> f64 {
        self.fixed + (mb * seq) as f64 * (self.a + self.b * seq as f64)
    }
}

#[derive(Debug, Clone, Copy)]
enum Schedule {
    /// Linear from `lo` to `hi` over `steps`, as the trainer's `lengths = "ramp"`.
    Ramp { lo: usize, hi: usize, steps: u64 },
    /// Uniform in `lo..=hi`, as `lengths = "random"`.
    Random { lo: usize, hi: usize, seed: u64 },
}

impl Schedule {
    fn len_at(self, step: u64) -> usize {
        match self {
            Schedule::Ramp { lo, hi, steps } => {
                let done = step.saturating_sub(1).min(steps.max(1)) as f64 / steps.max(1) as f64;
                lo + ((hi - lo) as f64 * done).round() as usize
            }
            Schedule::Random { lo, hi, seed } => {
                lo + (splitmix64(splitmix64(seed ^ 0x5eed) ^ step) % (hi - lo + 1) as u64) as usize
            }
        }
    }
    fn hi(self) -> usize {
        match self {
            Schedule::Ramp { hi, .. } | Schedule::Random { hi, .. } => hi,
        }
    }
}

/// One step as the trainer ran it.
#[derive(Debug, Clone)]
struct TrainerStep {
    step: u64,
    micro_batch: usize,
    seq_len: usize,
    /// The longest length in view: this step's or the horizon's.
    in_view: usize,
    usage: f64,
    /// True usage (no noise) of the micro-batch at `in_view`.
    usage_in_view: f64,
    margin: f64,
    /// (from, to) of each resize, before the step and after it.
    resizes: Vec<(usize, usize)>,
    held: Vec<String>,
}

/// Drives the controller exactly as trainer/src/runner/steps.rs does: `before_step_ahead` with
/// the longest length of the next 16 steps, the step, `set_limit`, `observe`.
fn run_trainer(c: &TrainerCurve, sched: Schedule, steps: u64) -> Vec<TrainerStep> {
    run_trainer_traced(c, sched, steps).0
}

/// As [`run_trainer`], with the run's decision trace.
fn run_trainer_traced(
    c: &TrainerCurve,
    sched: Schedule,
    steps: u64,
) -> (Vec<TrainerStep>, trace::TraceHash) {
    const LIMIT_1G: u64 = 1 << 30;
    let cfg = ControllerConfig {
        max_micro_batch: c.max_micro,
        max_seq_len: sched.hi(),
        ..ControllerConfig::default()
    };
    let mut ctl = Traced::new(cfg, Thresholds::default(), LIMIT_1G, c.start);
    ctl.set_baseline((c.baseline * LIMIT_1G as f64) as u64);
    let mut r = Rng(c.seed);
    let mut out = Vec::new();
    for s in 1..=steps {
        let seq = sched.len_at(s);
        let last = (s + TRAINER_HORIZON).min(steps);
        let up = (s + 1..=last).map(|k| (sched.len_at(k), k)).fold(
            Upcoming {
                seq_len: 0,
                step: s,
            },
            |best, (len, k)| {
                if len > best.seq_len {
                    Upcoming {
                        seq_len: len,
                        step: k,
                    }
                } else {
                    best
                }
            },
        );
        let mut ds = ctl.before_step_ahead(seq, up);
        let mb = ctl.micro_batch();
        let jitter = 1.0 + c.noise * (2.0 * r.unit() - 1.0);
        let low = if s == 1 { c.first_low } else { 0.0 };
        let usage = (c.own(mb, seq) - low) * jitter;
        let in_view = seq.max(up.seq_len);
        let margin = ctl.margin();
        ctl.set_limit(LIMIT_1G);
        ds.extend(ctl.observe(StepObservation {
            step: s,
            micro_batch: mb,
            seq_len: seq,
            peak_bytes: (usage * LIMIT_1G as f64) as u64,
        }));
        let mut st = TrainerStep {
            step: s,
            micro_batch: mb,
            seq_len: seq,
            in_view,
            usage,
            usage_in_view: c.own(mb, in_view),
            margin,
            resizes: Vec::new(),
            held: Vec::new(),
        };
        for d in ds {
            match d {
                Decision::Resize { from, to, .. } => st.resizes.push((from, to)),
                Decision::Warning { text, .. } if text.starts_with("holding at") => {
                    st.held.push(text)
                }
                _ => {}
            }
        }
        out.push(st);
    }
    (out, ctl.trace())
}

fn print_trace(trace: &[TrainerStep]) {
    for t in trace {
        println!(
            "step {:3} mb {:4} seq {:4} view {:4} usage {:.3} at-view {:.3} margin {:.3} {:?} {:?}",
            t.step,
            t.micro_batch,
            t.seq_len,
            t.in_view,
            t.usage,
            t.usage_in_view,
            t.margin,
            t.resizes,
            t.held
        );
    }
}

/// What a run through the trainer's horizon did wrong, if anything.
fn trainer_faults(c: &TrainerCurve, sched: Schedule, trace: &[TrainerStep]) -> Vec<String> {
    let t = Thresholds::default();
    let mut faults = Vec::new();
    // The length each size is planned for: the longest in view so far (the controller
    // never plans shorter than a length it was told of), and the longest the run feeds
    // once a step ran shorter than one before it (lengths that fall may bring it any
    // step).
    let mut planned = 0usize;
    let mut longest = 0usize;
    let mut plans = Vec::new();
    for st in trace {
        planned = planned.max(st.in_view);
        if st.seq_len < longest {
            planned = planned.max(sched.hi());
        }
        longest = longest.max(st.seq_len);
        plans.push(planned);
    }
    // Never at or over critical.
    for st in trace {
        if st.usage >= t.critical {
            faults.push(format!(
                "[critical] step {} at {:.3} ({} × {})",
                st.step, st.usage, st.micro_batch, st.seq_len
            ));
        }
    }
    // At most one resize per planned length that forced one: a longer length came into
    // view and the size in force would run it over target (within the model's error).
    let mut forced = 0usize;
    let mut in_force = c.start;
    let mut shrinks = Vec::new();
    for (i, st) in trace.iter().enumerate() {
        let before = if i == 0 { 0 } else { plans[i - 1] };
        if plans[i] > before && c.own(in_force, plans[i]) > t.target - 0.03 {
            forced += 1;
        }
        shrinks.extend(st.resizes.iter().filter(|r| r.1 < r.0).map(|_| st.step));
        in_force = st.resizes.last().map_or(st.micro_batch, |r| r.1);
    }
    if shrinks.len() > forced {
        faults.push(format!(
            "[count] {} shrinks (at steps {shrinks:?}) for {forced} planned lengths that forced one",
            shrinks.len()
        ));
    }
    // No growth after a shrink while longer lengths are still to come into view.
    let last_plan = *plans.last().unwrap_or(&0);
    let mut shrunk_at = None;
    for (i, st) in trace.iter().enumerate() {
        for &(from, to) in &st.resizes {
            if to < from {
                shrunk_at.get_or_insert(st.step);
            } else if let Some(s) = shrunk_at {
                // Unless the size grown from really had plain room at the planned length
                // (the model was wrong: its extrapolation was a bound, or one reading
                // moved it).
                let wrong = c.own(from, plans[i]) < t.target - st.margin - 0.05;
                if plans[i] < last_plan && !wrong {
                    faults.push(format!(
                        "[regrow] {from} → {to} at step {} after a shrink at step {s}, planned \
                         length {} still rising to {last_plan}",
                        st.step, plans[i]
                    ));
                }
            }
        }
    }
    // A size said to hold does not grow at that step or the next.
    for (i, st) in trace.iter().enumerate() {
        if st.held.is_empty() {
            continue;
        }
        for later in &trace[i..(i + 2).min(trace.len())] {
            if later.resizes.iter().any(|r| r.1 > r.0) {
                faults.push(format!(
                    "[hold] said at step {} ({:?}), grew at step {}: {:?}",
                    st.step, st.held, later.step, later.resizes
                ));
            }
        }
    }
    // The planned length is run near target less the margin once the readings can tell
    // what a token costs in a longer sequence (six readings, after the first, spanning 10%
    // in length) and the size has followed the fit for a step.
    let (mut lo, mut hi) = (usize::MAX, 0);
    let mut learnt = trace.len();
    for (i, st) in trace.iter().enumerate().skip(1) {
        lo = lo.min(st.seq_len);
        hi = hi.max(st.seq_len);
        if i >= 6 && hi * 10 >= lo * 11 {
            learnt = i;
            break;
        }
    }
    for (i, st) in trace.iter().enumerate().skip((learnt + 2).max(5)) {
        let u = c.own(st.micro_batch, plans[i]);
        let capped = st.micro_batch >= c.max_micro || st.micro_batch <= 1;
        if !capped && u < t.target - st.margin - 0.08 {
            faults.push(format!(
                "[under] step {}: {} × {} planned at {:.3}",
                st.step, st.micro_batch, plans[i], u
            ));
            break;
        }
    }
    faults
}

/// A sweep of curves like the real run's: fixed part 25–55% of the limit (the real one
/// ~40%), attention 0–60% of a token's cost at the longest length, ±0–1% noise, the first
/// step low, starts at 1, 16 and 64, feasible sizes at the longest length from 8 to 200.
fn trainer_curves(n: u64) -> Vec<TrainerCurve> {
    (0..n)
        .map(|i| {
            let mut r = Rng(splitmix64(0x7a1 ^ i));
            let fixed = r.range(0.25, 0.55);
            let feasible = r.range(8f64.ln(), 200f64.ln()).exp();
            let q = r.range(0.0, 0.6);
            let mut c = TrainerCurve::new(fixed, feasible, q, 256, r.next());
            c.noise = r.range(0.0, 0.01);
            c.first_low = r.range(0.0, 0.1) * fixed;
            c.baseline = fixed * r.range(0.85, 1.0);
            c.start = [1, 16, 64][(i % 3) as usize];
            c
        })
        .collect()
}

/// The sweep's curves, each with its schedule: a start that runs the first horizon under
/// target (a larger one is the user's to fix: nothing is measured before it fails, and the
/// simulator's families cover it).
fn trainer_sweep_curves(sched: impl Fn(u64) -> Schedule, n: u64) -> Vec<(TrainerCurve, Schedule)> {
    trainer_curves(n)
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let sc = sched(i as u64);
            let first_view = (1..=1 + TRAINER_HORIZON)
                .map(|k| sc.len_at(k))
                .max()
                .unwrap_or(1);
            while c.start > 1 && c.own(c.start, first_view) >= 0.85 {
                c.start -= 1;
            }
            (c, sc)
        })
        .collect()
}

fn trainer_sweep(sched: impl Fn(u64) -> Schedule, steps: u64, n: u64) -> Vec<String> {
    let mut failed = Vec::new();
    for (i, (c, sc)) in trainer_sweep_curves(sched, n).into_iter().enumerate() {
        let c = &c;
        let trace = run_trainer(c, sc, steps);
        if std::env::var("HEADROOM_SIM_TRACE").ok() == Some(i.to_string()) {
            print_trace(&trace);
        }
        let faults = trainer_faults(c, sc, &trace);
        if !faults.is_empty() {
            failed.push(format!(
                "curve {i} (fixed {:.2}, a {:.2e}, b {:.2e}, noise {:.3}, start {}): {}",
                c.fixed,
                c.a,
                c.b,
                c.noise,
                c.start,
                faults.join("; ")
            ));
        }
    }
    failed
}

/// Curves failing each property, out of `n`, and the failures; printed with
/// `--nocapture`.
fn trainer_tally(name: &str, failed: &[String], n: u64) -> [usize; 5] {
    let kinds = ["[critical]", "[count]", "[regrow]", "[hold]", "[under]"];
    let mut tally = [0usize; 5];
    for f in failed {
        for (k, kind) in kinds.iter().enumerate() {
            tally[k] += usize::from(f.contains(kind));
        }
    }
    println!(
        "{name}: {} of {n} curves meet every property; failing: critical {}, count {}, \
         regrow {}, hold {}, under {}",
        n as usize - failed.len(),
        tally[0],
        tally[1],
        tally[2],
        tally[3],
        tally[4]
    );
    for f in failed.iter().take(12) {
        println!("  {f}");
    }
    tally
}

/// The real run's curve and schedule (see the test below).
fn real_run() -> (TrainerCurve, Schedule) {
    let c = TrainerCurve::new(0.40, 54.0, 0.3, 256, 7);
    let sched = Schedule::Ramp {
        lo: 64,
        hi: 256,
        steps: 60,
    };
    (c, sched)
}

/// Ramps of every steepness.
fn sweep_ramp(i: u64) -> Schedule {
    Schedule::Ramp {
        lo: [32, 64, 128][(i % 3) as usize],
        hi: 256,
        steps: [30, 60, 120][(i / 3 % 3) as usize],
    }
}

/// Random lengths from three shortest lengths.
fn sweep_random(i: u64) -> Schedule {
    Schedule::Random {
        lo: [32, 64, 128][(i % 3) as usize],
        hi: 256,
        seed: i,
    }
}

/// A real run's case (a tiny GPT on CPU, soft 1 GiB): 64 → 256 over 60 steps, start 16,
/// fixed 40%, ±1%, through the trainer's 16-step horizon. Planned for each length as it
/// came into view it would shrink 17 times in 46 steps. Expected: three growths while it
/// learns the curve (the third when the readings span enough lengths to fit a token's
/// cost in a longer sequence), then one way down, each size planned for the longest
/// length in view, to the feasible size.
#[test]
fn trainer_horizon_ramp_like_the_real_run_moves_one_way() {
    let (c, sched) = real_run();
    let trace = run_trainer(&c, sched, 100);
    if std::env::var("HEADROOM_SIM_TRACE").is_ok() {
        print_trace(&trace);
    }
    let faults = trainer_faults(&c, sched, &trace);
    assert!(faults.is_empty(), "{faults:#?}");
    let resizes: Vec<(u64, usize, usize)> = trace
        .iter()
        .flat_map(|t| t.resizes.iter().map(move |r| (t.step, r.0, r.1)))
        .collect();
    assert!(resizes.len() <= 13, "{resizes:?}");
    // Growth only while it learns; from the first shrink on, only down.
    let first_shrink = resizes.iter().position(|r| r.2 < r.1).unwrap();
    assert!(
        resizes[..first_shrink].iter().all(|r| r.0 <= 10),
        "{resizes:?}"
    );
    assert!(
        resizes[first_shrink..].iter().all(|r| r.2 < r.1),
        "{resizes:?}"
    );
    let holds: usize = trace.iter().map(|t| t.held.len()).sum();
    assert!(holds <= resizes.len() + 1, "{holds} hold lines");
    let last = trace.last().unwrap();
    assert!(
        last.micro_batch as f64 >= 0.9 * 54.0 && last.micro_batch <= 54,
        "{}",
        last.micro_batch
    );
}

/// Ramps of every steepness through the trainer's horizon, on curves like the real one.
#[test]
fn trainer_horizon_ramps_hold_their_plan() {
    let n = 120;
    let failed = trainer_sweep(sweep_ramp, 150, n);
    let [critical, count, regrow, hold, _under] = trainer_tally("ramps", &failed, n);
    // What it achieved (77 of 120 meet all; failing critical 0, count 3, regrow 1, hold
    // 0, under 41: the young fit's bound under-uses the planned length), with a little
    // room: a regression fails, the seeded sweep stays as it is.
    assert!(failed.len() <= 44, "{} of {n} failed", failed.len());
    assert_eq!(critical, 0);
    assert!(regrow <= 2 && count <= 7 && hold == 0, "{failed:#?}");
}

/// Random lengths through the trainer's horizon, on curves like the real one.
#[test]
fn trainer_horizon_random_lengths_hold_their_plan() {
    let n = 120;
    let failed = trainer_sweep(sweep_random, 150, n);
    let [critical, count, regrow, hold, _under] = trainer_tally("random lengths", &failed, n);
    // Achieved: 89 of 120; failing critical 1, count 30, regrow 0, hold 0, under 3. Each
    // count failure is one shrink within the first ten steps (a young fit's growth for the
    // longest the run feeds, corrected once). Planned for the horizon's longest instead,
    // 96 met them all but 6 regrew late and 2 reached critical: a size settled for the
    // lengths in view was shrunk when a longer one came, long after the run settled.
    assert!(failed.len() <= 33, "{} of {n} failed", failed.len());
    assert!(
        critical <= 1 && regrow <= 1 && count <= 32 && hold == 0,
        "{failed:#?}"
    );
}

// ---------------------------------------------------------------------------------------
// Decision traces: the controller's behaviour kept to the byte across changes that are
// not meant to change it. Every simulated curve of every family (`HEADROOM_SIM_CURVES`
// per family, 400 recorded) and every run of the trainer-horizon sweeps, traced call by
// call, must hash to what is recorded in `traces/sim.txt` (see `support/trace.rs`).

/// Trainer-horizon sweep runs per schedule kind (as the sweep tests above).
const SWEEP_RUNS: u64 = 120;

#[test]
fn decision_traces_are_the_recorded_ones() {
    let per = curves_per_family();
    let mut runs: Vec<(String, String)> = Vec::new();
    let mut keep = |key: String, t: trace::TraceHash| {
        t.dump(&key);
        runs.push((key, t.hex()));
    };
    for fam in FAMILIES {
        for i in 0..per {
            let o = run::<Traced>(&Curve::generate(fam, i));
            keep(format!("{} #{i}", fam.name()), o.trace.expect("traced"));
        }
    }
    let (c, sched) = real_run();
    keep(
        "trainer real ramp".into(),
        run_trainer_traced(&c, sched, 100).1,
    );
    for (name, sched) in [
        ("ramps", sweep_ramp as fn(u64) -> Schedule),
        ("random", sweep_random),
    ] {
        for (i, (c, sc)) in trainer_sweep_curves(sched, SWEEP_RUNS)
            .into_iter()
            .enumerate()
        {
            keep(
                format!("trainer {name} #{i}"),
                run_trainer_traced(&c, sc, 150).1,
            );
        }
    }
    let bad = trace::compare("sim.txt", &runs);
    assert!(
        bad.is_empty(),
        "{} of {} runs decided otherwise than recorded (trace one with \
         HEADROOM_SIM_ONLY=<family> HEADROOM_SIM_CURVE_TRACE=<n>): {:#?}",
        bad.len(),
        runs.len(),
        &bad[..bad.len().min(20)]
    );
}

/// Over a retained heap, two curves whose readings are identical at every
/// step need sizes more than 10% apart, so no policy lands within 10% of feasible on
/// both. Both start at 400 on a soft budget, over a 45% baseline, and read 180% at their
/// first step; the heap keeps 95% of that peak mapped, and no smaller batch reads above
/// it. One has a fixed part of 60% (100 fits under target), the other 50% (123 fits).
/// The controller, told the same baseline and fed the same readings, decides the same at
/// every step (one trace for both); whatever size it ends at, the bands [90, 100] and
/// [111, 123] (or within 3.5% of target) have no size in common. Growing past the first
/// step's peak to tell them apart would take usage past the limit again. The property
/// for such a run is "at most feasible" (`in_band_blind`).
#[test]
fn a_heap_held_from_the_first_step_hides_sizes_more_than_ten_percent_apart() {
    let pair = [(0.60, 100.0), (0.50, 123.0)].map(|(fixed, fits)| {
        let mut c = Curve::generate(Family::FixedHeap, 0);
        let lmax = 64;
        // 400 sequences read 180% on both.
        let per_seq = (1.8 - fixed) / 400.0;
        c.fixed = fixed;
        c.a = per_seq / lmax as f64;
        c.b = 0.0;
        c.noise = 0.0;
        c.opt = 0.0;
        c.baseline = Some(0.45);
        c.early_baseline = Some(0.45);
        c.retain = Retain::Heap(0.95);
        c.hard = false;
        c.lens = Lens::Fixed;
        c.lmax = lmax;
        c.start = 400;
        c.max_micro = 3200;
        assert_eq!(c.feasible(0.0, 1.0), fits as usize);
        c
    });
    let [a, b] = pair.map(|c| {
        let o = run::<Traced>(&c);
        let hash = o.trace.clone().expect("traced").hex();
        (c, o, hash)
    });
    assert_eq!(a.2, b.2, "the same readings, the same decisions");
    let both = (1..=3200).filter(|&mb| in_band(&a.0, mb, STEPS) && in_band(&b.0, mb, STEPS));
    assert_eq!(both.count(), 0, "a size within 10% of feasible on both");
    // What is achievable, and met: at most feasible on both.
    assert!(
        a.1.converged && b.1.converged,
        "{:?} {:?}",
        a.1.why,
        b.1.why
    );
}
