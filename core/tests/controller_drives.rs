//! The controller's behaviour, driven through its public API as the trainer drives it:
//! each test a situation seen in a run or the simulator, with what must hold. Every
//! controller these tests create is traced: the decisions must also be the ones recorded
//! in `traces/unit.txt` (see `support/trace.rs`).
#[path = "support/trace.rs"]
mod trace;

use headroom_core::policy::{
    ControllerConfig, Decision, Profile, ResizeReason, StepObservation, Thresholds, Upcoming,
    ALLOCATOR_NOISE, RSS_NOISE,
};
use trace::{test_trace, Traced};

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
    c: &mut Traced,
    sim: &mut Sim,
    seq: usize,
    steps: u64,
) -> Vec<(u64, usize, usize, ResizeReason)> {
    resizes_of(&drive_with(c, 1..=steps, |_| seq, |mb, s| sim.peak(mb, s)).0)
}

#[test]
fn reaches_the_feasible_size_from_far_below_in_three_adjustments_and_holds() {
    let _trace =
        test_trace("reaches_the_feasible_size_from_far_below_in_three_adjustments_and_holds");
    // Up to 256× below: ×4 while one size is known, then ×8, ×8.
    for (seq, start) in [(64usize, 1usize), (128, 1), (32, 2), (16, 4)] {
        let mut sim = Sim::new(0.0);
        let best = sim.largest(0.90, seq);
        assert!(best >= 50 * start, "far below: start {start}, best {best}");
        let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, start);
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
    let _trace = test_trace("an_exact_meter_is_not_held_to_the_resident_sets_scatter");
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
        let mut c = Traced::new(config, Thresholds::default(), LIMIT, 1);
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
    let _trace = test_trace("growth_far_under_target_is_never_held_as_within_noise");
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
    let mut c = Traced::new(config, Thresholds::default(), 24 * 1024 * MIB, 4);
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
    let _trace = test_trace("no_oscillation_at_steady_state_with_noisy_readings");
    let seq = 128;
    let mut sim = Sim::new(0.01);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 2);
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
    let _trace = test_trace("noisy_readings_settle_under_target");
    let seq = 128;
    let t = Thresholds::default();
    let mut sim = Sim::new(0.02);
    let mut c = Traced::new(cfg(seq), t, LIMIT, 1);
    drive(&mut c, &mut sim, seq, 30);
    assert!(c.margin() > 0.01, "noise widens the margin: {}", c.margin());
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
    let _trace = test_trace("varying_sequence_length_never_crosses_critical");
    let max_seq = 512;
    let t = Thresholds::default();
    let mut sim = Sim::new(0.005);
    let mut c = Traced::new(cfg(max_seq), t, LIMIT, 1);
    let mut rng = 7u64;
    let mut worst: f64 = 0.0;
    for s in 1..=300u64 {
        rng = next(rng);
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
    let _trace = test_trace("forecast_shrinks_before_a_longer_batch_arrives");
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(64), Thresholds::default(), LIMIT, 1);
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
    let mut p = Traced::new(cfg(64), Thresholds::default(), LIMIT, 1);
    drive(&mut p, &mut sim, 64, 10);
    p.pin(p.micro_batch());
    let ds = p.before_step(256);
    assert!(resizes(&ds).is_empty());
    assert!(matches!(ds[0], Decision::Warning { forecast: true, .. }));
}

fn next(x: u64) -> u64 {
    x.wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        >> 1
}

#[test]
fn oom_learns_a_ceiling_that_growth_respects_and_slowly_forgets() {
    let _trace = test_trace("oom_learns_a_ceiling_that_growth_respects_and_slowly_forgets");
    let seq = 64;
    // The device really fails above 60 sequences although the model would allow more
    // (fragmentation, another process): the ceiling must hold growth below it.
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(
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
    let _trace = test_trace("growth_after_ooms_plans_under_target_less_margin");
    let limit = 800 * MIB;
    let mut c = Traced::new(cfg(64), Thresholds::default(), limit, 256);
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
        predicted <= 0.9 - 0.02 + 1e-9,
        "grew to {mb}, predicted at {predicted}"
    );
}

/// The footprint creeps up at a fixed size (fragmentation): one reading above target
/// moves nothing, three in a row free the cache, three more shrink once, and then it
/// holds.
#[test]
fn sustained_drift_above_target_frees_the_cache_then_shrinks_once() {
    let _trace = test_trace("sustained_drift_above_target_frees_the_cache_then_shrinks_once");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 8);
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
    c: &mut Traced,
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
    let _trace = test_trace("over_target_stops_shrinking_when_usage_does_not_follow");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 8);
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
    let _trace = test_trace("critical_does_not_ratchet_down_when_usage_is_stuck");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 8);
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
    // Emergency halving while the memory is not the batch's would collapse a soft
    // budget to one sequence. It frees the cache and holds; an OOM is still recovered.
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
    let _trace = test_trace("a_length_ramp_stays_under_critical_when_attention_is_quadratic");
    let max_seq = 64usize;
    let t = Thresholds::default();
    // 700 MiB fixed, 100 KiB per token, 6 KiB per token per token of context.
    let peak = |mb: usize, seq: usize| {
        700 * MIB + (mb * seq) as u64 * (100 * 1024 + 6 * 1024 * seq as u64)
    };
    let ramp = |s: u64| (16 + s as usize / 2).min(max_seq);
    let mut c = Traced::new(cfg(max_seq), t, LIMIT, 1);
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
    let _trace = test_trace("an_emergency_sets_a_ceiling_so_the_run_does_not_grow_back_into_it");
    let seq = 64;
    let t = Thresholds::default();
    // Linear up to 100 sequences, then 10% more of the limit at once.
    let peak = |mb: usize, seq: usize| {
        let jump = if mb > 100 { LIMIT / 10 } else { 0 };
        700 * MIB + (mb * seq) as u64 * 400 * 1024 + jump
    };
    let mut c = Traced::new(cfg(seq), t, LIMIT, 8);
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
    let _trace = test_trace("repeated_oom_at_one_gives_up");
    let mut c = Traced::new(cfg(64), Thresholds::default(), LIMIT, 2);
    assert_eq!(c.on_oom(2, 64).retry_with, Some(1));
    assert_eq!(c.on_oom(1, 64).retry_with, Some(1));
    assert_eq!(c.on_oom(1, 64).retry_with, Some(1));
    assert_eq!(c.on_oom(1, 64).retry_with, None);
}

#[test]
fn critical_shrinks_and_emergency_frees_cache_and_shrinks_hard() {
    let _trace = test_trace("critical_shrinks_and_emergency_frees_cache_and_shrinks_hard");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 8);
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
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 8);
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
    let _trace = test_trace("pinned_only_warns_and_unpin_resumes_growth");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 4);
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
    let _trace = test_trace("invalid_thresholds_are_rejected_and_the_old_kept");
    let mut c = Traced::new(cfg(64), Profile::Conservative.thresholds(), LIMIT, 4);
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
    let _trace = test_trace("not_adaptive_never_resizes_but_warns");
    let seq = 64;
    let mut sim = Sim::new(0.0);
    let mut c = Traced::new(
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
/// Micro-batch 1 at 49% of an 800 MiB budget: a proportional fit (all memory scaling
/// with tokens) rounds to 1 and would never grow. The baseline measured before the
/// first step tells the fixed part.
#[test]
fn a_small_start_grows_when_the_fixed_part_is_large() {
    let _trace = test_trace("a_small_start_grows_when_the_fixed_part_is_large");
    let limit = 800 * MIB;
    let seq = 64;
    // 380 MiB fixed (350 of it present before step 1), 12 KiB per token.
    let peak = |mb: usize, _| 380 * MIB + (mb * seq) as u64 * 12 * 1024;
    let mut c = Traced::new(
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
    c: &mut Traced,
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
fn run_told_ahead(max_seq: usize, len: impl Fn(u64) -> usize) -> (Traced, Changes, f64) {
    let mut c = Traced::new(cfg(max_seq), Thresholds::default(), LIMIT, 1);
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
fn assert_feasible_at(c: &Traced, seq: usize) {
    let best = (1..4096)
        .take_while(|&mb| (attention_peak(mb, seq) as f64) < 0.9 * LIMIT as f64)
        .count();
    assert!(
        c.micro_batch() as f64 >= 0.9 * best as f64 && c.micro_batch() <= best,
        "{} vs {best}",
        c.micro_batch()
    );
}

/// Random lengths with the trainer's 16-step horizon. Planned for the horizon's own
/// longest, the size would grow when a long length left the horizon and shrink when the
/// next came in. Planned for the longest told so far, with the cost of a token fitted as
/// a line in the length, it settles and stays.
#[test]
fn random_lengths_settle_without_churn() {
    let _trace = test_trace("random_lengths_settle_without_churn");
    let max_seq = 256usize;
    let len = |s: u64| 32 + (next(s.wrapping_mul(0x9e37_79b9)) % (max_seq as u64 - 31)) as usize;
    let (c, changes, worst) = run_told_ahead(max_seq, len);
    assert!(worst < Thresholds::default().critical, "{worst}");
    // Learning the curve takes a few adjustments early on; none after.
    assert!(changes.len() <= 6, "{changes:?}");
    assert!(changes.iter().all(|c| c.0 <= 20), "settled: {changes:?}");
    let longest = (1..=216).map(len).max().unwrap();
    assert_feasible_at(&c, longest);
}

/// Random lengths whose longest (the configured 256) first comes at step 150. Planned
/// for the horizon's longest, the run would settle for the lengths up to 200 and shrink
/// when 256 came into view, 130 steps after it had settled. Once the lengths fall as well
/// as rise, any step may bring the longest the run feeds: the run settles for it and
/// does not move when it comes.
#[test]
fn random_lengths_settle_for_the_longest_the_run_feeds() {
    let _trace = test_trace("random_lengths_settle_for_the_longest_the_run_feeds");
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

/// A ramp 64 → 256 over 60 steps: a controller that only sees the current length holds
/// 16 with no word and then peaks at 95%. Told the longest length to come, the
/// controller grows for it, says why it holds, and the longest length never crosses
/// critical.
#[test]
fn told_the_lengths_to_come_it_holds_for_them_and_says_why() {
    let _trace = test_trace("told_the_lengths_to_come_it_holds_for_them_and_says_why");
    let limit = 1 << 30;
    let peak =
        |mb: usize, seq: usize| 300 * MIB + (mb * seq) as u64 * (40 * 1024 + 160 * seq as u64);
    let ramp =
        |s: u64| 64 + ((192.0 * (s.saturating_sub(1).min(60)) as f64 / 60.0).round() as usize);
    let mut c = Traced::new(
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
    let _trace =
        test_trace("a_shrink_that_lowered_usage_less_than_guessed_is_not_taken_as_held_memory");
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
        let mut c = Traced::new(cfg(64), Thresholds::default(), LIMIT, start);
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

/// A soft start far too large reads 285% on its first step and every step after it
/// reads the same high-water mark (270%: freed heap pages kept mapped). The first step's
/// shrink cannot be judged (that step lacks the optimizer state), so the next reading
/// shrinks once more, by half at most, and the forecast must not halve again on that
/// same reading before a step has judged it: a second halving would leave a seventh of
/// what fits.
#[test]
fn a_mark_held_from_the_first_step_is_not_halved_on_twice() {
    let _trace = test_trace("a_mark_held_from_the_first_step_is_not_halved_on_twice");
    let seq = 128;
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 400);
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

/// An 800 MiB hard cap, start 1, a fixed part of 49%, 148 fits under target: growth
/// from 8 follows the steepest line the noise allows, which over-predicts the landing
/// size as it should. Counted as the model's error, that over-prediction would keep 3%
/// of the limit free and leave the landing growth under the 10% least gain, holding the
/// run near 83%. A reading under that bound is not an error: with readings scattering by
/// 0.5% the margin stays near that, and the run lands within 5% of what fits by step 5.
#[test]
fn a_growth_along_the_noise_bound_that_lands_low_is_not_the_models_error() {
    let _trace =
        test_trace("a_growth_along_the_noise_bound_that_lands_low_is_not_the_models_error");
    let seq = 64;
    let fixed = 0.49;
    let per_seq = (0.888 - fixed) / 144.0;
    let truth = |mb: usize| fixed + mb as f64 * per_seq;
    let feasible = (1..1000).take_while(|&mb| truth(mb) < 0.9).count();
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 1);
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
    let _trace = test_trace("a_streak_over_target_within_the_sizes_own_scatter_is_not_drift");
    let seq = 64;
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 100);
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
    let _trace = test_trace("a_high_water_mark_with_random_lengths_does_not_halve_again_and_again");
    let lens = [216usize, 240, 250, 459, 343, 245, 212, 156, 300, 480];
    let mut c = Traced::new(cfg(512), Thresholds::default(), LIMIT, 3060);
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

/// A 2-layer, 64-wide GPT on random lengths 32–256 under a 600 MiB hard cap (effective
/// 128, start 16), as measured through the binary: 63.3% fixed and a token's cost
/// slightly less in a longer sequence (least squares over its 60 readings: 0.00196% of
/// the limit per token, 3e-9 less per token of length); 54 fits length 256 under target.
/// A fit across lengths that kept the quadratic-only line whenever a coefficient came
/// out negative would over-predict the longest lengths by 3.5% and under-predict the
/// middle ones by 2%: the margin would go to its 3% cap and the run settle at 43 (peaks
/// 67–85%). The fit keeps whichever of the two reduced lines the readings follow.
#[test]
fn random_lengths_over_a_line_in_tokens_settle_near_what_fits() {
    let _trace = test_trace("random_lengths_over_a_line_in_tokens_settle_near_what_fits");
    let share = |x: f64| (x * LIMIT as f64) as u64;
    let per_token = |seq: usize| 1.96e-5 - 3e-9 * seq as f64;
    let peak = |mb: usize, seq: usize| {
        // ±0.4% of the limit of scatter, as the resident set under the cap showed.
        let u = (next((mb * 7919 + seq) as u64) % 1000) as f64 / 1000.0 * 2.0 - 1.0;
        share(0.633 + (mb * seq) as f64 * per_token(seq) + 0.004 * u)
    };
    let len = |s: u64| 32 + (next(s.wrapping_mul(0x9e37_79b9)) % 225) as usize;
    let cfg = ControllerConfig {
        max_micro_batch: 128,
        max_seq_len: 256,
        ..Default::default()
    };
    let mut c = Traced::new(cfg, Thresholds::default(), LIMIT, 16);
    c.set_baseline(share(0.607));
    let mut worst: f64 = 0.0;
    for s in 1..=100u64 {
        let (_, p) = step_told_ahead(&mut c, s, 16, &len, &peak);
        worst = worst.max(p as f64 / LIMIT as f64);
    }
    let fits = ((0.9f64 - 0.633 - 0.004) / (256.0 * per_token(256))).floor() as usize;
    assert!(worst < Thresholds::default().critical, "{worst}");
    assert!(
        c.micro_batch() as f64 >= 0.9 * fits as f64 && c.micro_batch() <= fits,
        "settled at {} where {fits} fits length 256",
        c.micro_batch()
    );
}

/// A run under a hard cap the test sets per step: 78% of the limit held before the batch
/// and about 1.2% a sequence of 256 (py/bench/margin.py's CPU run under a 914 MiB cap:
/// 715 MiB held, 8 samples at 86.6%). Steps 1–120 run under the whole limit; from step
/// 121 the cap is `cap(step)` (a share of the limit, never told to the controller). A step
/// over the cap fails and is retried at the size the controller gives, as the trainer
/// does. Returns the controller, the size settled at by step 120, every OOM after it
/// (step, micro-batch), the sizes in force at each step after it and the highest usage a
/// step after it read.
fn capped_run(cap: impl Fn(u64) -> f64) -> (Traced, usize, Vec<(u64, usize)>, Vec<usize>, f64) {
    let seq = 256;
    let mut sim = Sim {
        fixed: LIMIT / 100 * 78,
        per_token: 200 * 1024,
        noise: 0.003,
        rng: 9,
    };
    let mut c = Traced::new(cfg(seq), Thresholds::default(), LIMIT, 1);
    c.set_baseline(LIMIT / 100 * 75);
    drive(&mut c, &mut sim, seq, 120);
    let settled = c.micro_batch();
    let (mut ooms, mut sizes, mut worst) = (Vec::new(), Vec::new(), 0.0f64);
    for s in 121..=200u64 {
        c.before_step(seq);
        let peak = loop {
            let mb = c.micro_batch();
            let peak = sim.peak(mb, seq);
            if peak as f64 <= cap(s) * LIMIT as f64 {
                break peak;
            }
            ooms.push((s, mb));
            assert!(ooms.len() < 20, "gave up: {ooms:?}");
            c.on_oom(mb, seq).retry_with.expect("retried");
        };
        let mb = c.micro_batch();
        sizes.push(mb);
        worst = worst.max(peak as f64 / LIMIT as f64);
        c.observe(obs(s, mb, seq, peak));
    }
    (c, settled, ooms, sizes, worst)
}

/// Measured under a CPU cap (docs/CONTROLLER.md "The margin"): after 120 clean steps at
/// 9 the cap was met by the address space the heap keeps, not by resident memory; 9 was
/// retried once, failed again, and the fixed part moved up by the gap the model had left
/// (14 points) put the run at micro-batch 1, where it stayed for the last 71 steps at
/// 82–83%, under target. Ten readings in a row at the smaller size that read the fit as
/// it was, not the memory the move assumed, undo the move: the run grows back near its
/// fit, under the ceiling the errors taught, without another error.
#[test]
fn a_settled_size_failing_twice_without_memory_growth_comes_back_near_the_fit() {
    let _trace =
        test_trace("a_settled_size_failing_twice_without_memory_growth_comes_back_near_the_fit");
    // The creeping heap meets the cap at step 121 only: 9 fails, 1 runs.
    let (_c, settled, ooms, sizes, worst) = capped_run(|s| if s == 121 { 0.85 } else { 1.0 });
    assert!(settled >= 8, "settled at {settled}");
    assert_eq!(
        ooms,
        [(121, settled), (121, settled)],
        "retried once as it is"
    );
    let back = *sizes.last().unwrap();
    assert!(
        back + 2 >= settled && back < settled,
        "back to {back} of {settled} (under the ceiling at {settled}): {sizes:?}"
    );
    // Back within 20 steps, and no reading after the errors at or over target.
    assert!(sizes[20..].iter().all(|&mb| mb == back), "{sizes:?}");
    assert!(worst < Thresholds::default().target, "{worst}");
}

/// The same run where the cap really fell, silently, from step 121 (to 86% of the limit:
/// up to 6 sequences fit under it, 7 and more do not). The readings at the smaller size cannot
/// tell this from the case above: the move is undone and the growth back fails once; that
/// error, before the size grown to settled, says the limit fell, and the controller plans
/// under what 8 would have peaked at from then on (micro-batch 1: 78% held leaves no room
/// under target of it). One error more than keeping the move, then none.
#[test]
fn a_limit_that_fell_silently_costs_one_error_more_then_holds() {
    let _trace = test_trace("a_limit_that_fell_silently_costs_one_error_more_then_holds");
    let (_c, settled, ooms, sizes, worst) = capped_run(|s| if s >= 121 { 0.86 } else { 1.0 });
    assert!(ooms.len() <= 3, "{ooms:?}");
    assert!(
        ooms.iter().all(|&(s, _)| s <= 140),
        "no error after step 140: {ooms:?}"
    );
    let last = *sizes.last().unwrap();
    assert!(last < settled, "{last} of {settled}: {sizes:?}");
    assert!(worst < 0.86, "{worst}");
}
