//! A long run's log as a training loop writes it, at 10 steps a second: per step a
//! `step`, a `step_memory` and a `plan_check`; a `sample` every 0.25 s; a `decision` now
//! and then; an `eval` every 1000 steps and a `checkpoint_saved` every 5000. Shared by the
//! compressed-log tests and the `log_end` bench.
use headroom_core::policy::{Decision, ResizeReason};
use headroom_core::{
    EvalMetrics, GpuStats, HostStats, PlanCheck, Record, RunStatus, StepMemory, SystemSample,
    Telemetry,
};

use super::{run_info, step};

const GIB: u64 = 1 << 30;

/// The micro-batch at step `n`: the controller moves it now and then.
fn micro_batch(n: u64) -> usize {
    if (n / 997).is_multiple_of(2) {
        16
    } else {
        8
    }
}

/// Calls `f` with every record of a run of `steps` steps, in the log's order.
pub fn run(steps: u64, mut f: impl FnMut(&Record)) {
    let rec = |t: f64, msg: Telemetry| Record::new(1.7e9 + t, t, msg);
    let mut info = run_info("cuda:0", "NVIDIA H100 80GB HBM3");
    info.total_steps = steps;
    f(&rec(0.0, Telemetry::RunStarted(info)));
    f(&rec(
        0.0,
        Telemetry::Status {
            status: RunStatus::Running,
        },
    ));
    let mut quarter = 1u64;
    for n in 1..=steps {
        let t = n as f64 / 10.0;
        while quarter as f64 / 4.0 <= t {
            f(&rec(quarter as f64 / 4.0, sample(quarter)));
            quarter += 1;
        }
        let mb = micro_batch(n);
        let peak = 40 * GIB + (n * 7919 % 1000) * (GIB / 100);
        f(&rec(
            t,
            Telemetry::StepMemory(StepMemory {
                step: n,
                micro_batch: mb,
                seq_len: 2048,
                peak_bytes: peak,
                predicted_bytes: Some(peak - GIB / 4),
                limit_bytes: 80 * GIB,
                configured_limit_bytes: 80 * GIB,
                usage: peak as f64 / (80 * GIB) as f64,
            }),
        ));
        let mut s = step(n, mb);
        s.total_steps = steps;
        s.loss = s_loss(n);
        f(&rec(t, Telemetry::Step(s)));
        f(&rec(
            t,
            Telemetry::PlanCheck(PlanCheck {
                step: n,
                micro_batch: mb,
                planned_bytes: peak - GIB / 8,
                peak_bytes: peak,
            }),
        ));
        if n.is_multiple_of(997) {
            let decision = Decision::Resize {
                from: micro_batch(n),
                to: micro_batch(n + 1),
                reason: ResizeReason::Forecast,
                usage: 0.91,
                predicted: Some(0.8),
            };
            f(&rec(t, Telemetry::Decision { step: n, decision }));
        }
        if n.is_multiple_of(1000) {
            let eval = EvalMetrics {
                step: n,
                val_loss: 1.6 + 3.0 / (1.0 + n as f64 / 500.0),
                train_loss: s_loss(n),
                tokens: 1 << 20,
            };
            f(&rec(t, Telemetry::Eval(eval)));
        }
        if n.is_multiple_of(5000) {
            let path = format!("checkpoints/step-{n}.safetensors");
            f(&rec(t, Telemetry::CheckpointSaved { step: n, path }));
        }
    }
}

fn s_loss(n: u64) -> f64 {
    1.5 + 3.0 / (1.0 + n as f64 / 500.0)
}

fn sample(quarter: u64) -> Telemetry {
    Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 12.5 + (quarter % 40) as f32,
            mem_used: 200 * GIB + quarter % 1000 * (1 << 20),
            mem_total: 2048 * GIB,
            mem_available: 1800 * GIB,
            process_rss: 9 * GIB + quarter % 977 * (1 << 20),
        },
        gpu: Some(GpuStats {
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            mem_used: 70 * GIB + quarter % 997 * (1 << 20),
            mem_total: 80 * GIB,
            util_percent: Some(90 + (quarter % 10) as u32),
            temperature_c: Some(61),
            power_w: Some(612.5),
        }),
        allocator: None,
        heap: None,
    })
}
