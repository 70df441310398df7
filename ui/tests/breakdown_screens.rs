//! The memory panel's stacked bar (fixed, batch, cache, outside) on a CPU run whose start
//! probe sent its plan, at a tall size and at the minimum one.
use headroom_core::{
    HeapStats, HostStats, PlanSplit, RunStatus, StepMemory, StepMetrics, SystemSample, Telemetry,
};
use headroom_ui::app::App;

mod support;
use support::{draw, run_info};

const MIB: u64 = 1 << 20;

fn planned_run() -> App {
    let mut app = App::new("default", true);
    app.apply(&Telemetry::RunStarted(run_info("cpu", "AMD EPYC 7B13")));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    app.apply(&Telemetry::PlanSplit(PlanSplit {
        model_bytes: 13 * MIB,
        overhead_bytes: 360 * MIB,
        activations_per_token: 56_000.0,
    }));
    app.set_elapsed(1.0);
    app.apply(&Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 180.0,
            mem_used: 9000 * MIB,
            mem_total: 16000 * MIB,
            mem_available: 7000 * MIB,
            process_rss: 470 * MIB,
        },
        heap: Some(HeapStats {
            rss_anon: 400 * MIB,
            in_use: 370 * MIB,
            free_kept: 40 * MIB,
            trims: 1,
            last_trim_freed: Some(12 * MIB),
        }),
        ..Default::default()
    }));
    let limit = 700 * MIB;
    let peak = 480 * MIB;
    app.apply(&Telemetry::StepMemory(StepMemory {
        step: 5,
        micro_batch: 16,
        seq_len: 64,
        peak_bytes: peak,
        predicted_bytes: Some(470 * MIB),
        limit_bytes: limit,
        configured_limit_bytes: limit,
        usage: peak as f64 / limit as f64,
    }));
    app.apply(&Telemetry::Step(StepMetrics {
        step: 5,
        total_steps: 300,
        loss: 3.0,
        lr: Some(3e-3),
        grad_norm: Some(0.8),
        step_time_s: 0.4,
        tokens_per_s: 20_000.0,
        samples_per_s: 320.0,
        micro_batch: 16,
        accum_steps: 8,
        effective_batch: 128,
        seq_len: 64,
        tokens_seen: 5 * 8192,
    }));
    app
}

#[test]
fn stacked_bar_in_the_memory_panel() {
    let t = draw(&planned_run(), 120, 40);
    let screen = format!("{}", t.backend());
    assert!(screen.contains("█fixed 13.0MiB ▓batch 54.7MiB"), "{screen}");
    insta::assert_snapshot!(t.backend());
}

#[test]
fn stacked_bar_at_the_minimum_size() {
    insta::assert_snapshot!(draw(&planned_run(), 80, 24).backend());
}
