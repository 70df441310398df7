//! One frame's render time at 200×60 with every history full, against the frame budget.
//!
//!     cargo bench -p headroom-ui --bench render
//!
//! Prints per-frame time (median, p99, max) for the full dashboard and, as a baseline in
//! the same process, for an empty frame; and the share of the 50 ms frame interval used.
use std::time::{Duration, Instant};

use headroom_core::policy::{Decision, ResizeReason};
use headroom_core::{
    AllocatorStats, BlockRun, EvalMemory, EvalMetrics, GpuStats, HostStats, Level, Notice, Segment,
    SegmentMap, StepMemory, StepMetrics, SystemSample, Telemetry,
};
use headroom_ui::app::App;
use headroom_ui::view::render;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn full_app() -> App {
    let mut app = App::new("bench", true);
    for n in 1..=200_000u64 {
        app.set_elapsed(n as f64 * 0.05);
        app.apply(&Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 1_000_000,
            loss: 2.0 + (n as f64).sin().abs(),
            lr: Some(1e-3),
            grad_norm: Some(1.0),
            step_time_s: 0.05,
            tokens_per_s: 1e6,
            samples_per_s: 1e3,
            micro_batch: 32,
            accum_steps: 2,
            effective_batch: 64,
            seq_len: 1024,
            tokens_seen: n * 65_536,
        }));
        app.apply(&Telemetry::Sample(SystemSample {
            host: HostStats {
                cpu_percent: 50.0,
                mem_used: 40 << 30,
                mem_total: 128 << 30,
                mem_available: 0,
                process_rss: 6 << 30,
            },
            gpu: Some(GpuStats {
                name: "NVIDIA H100".into(),
                mem_used: (60 << 30) + (n % 1000) * (10 << 20),
                mem_total: 80 << 30,
                ..Default::default()
            }),
            allocator: Some(AllocatorStats {
                allocated: 50 << 30,
                reserved: 62 << 30,
                inactive_split: 3 << 30,
                ..Default::default()
            }),
            heap: None,
        }));
        let limit = 80u64 << 30;
        let peak = (60u64 << 30) + (n % 1000) * (10 << 20);
        app.apply(&Telemetry::StepMemory(StepMemory {
            step: n,
            micro_batch: 32,
            seq_len: 1024,
            peak_bytes: peak,
            predicted_bytes: Some(peak + (200 << 20)),
            limit_bytes: limit,
            configured_limit_bytes: limit,
            usage: peak as f64 / limit as f64,
        }));
        if n % 1000 == 0 {
            // Event marks on the memory chart and entries in the log.
            app.apply(&Telemetry::Decision {
                step: n,
                decision: Decision::Resize {
                    from: 32,
                    to: 40,
                    reason: ResizeReason::Grow,
                    usage: 0.8,
                    predicted: Some(0.88),
                },
            });
        }
        if n % 100 == 0 {
            // Each validation pass with its memory, every tenth with an OOM retried:
            // the training panel's eval line and the chart's eval marks.
            let ooms = u64::from(n % 1000 == 0);
            if ooms > 0 {
                app.apply(&Telemetry::EvalOom {
                    step: n,
                    phase: "validation".into(),
                    size: 64,
                    seq_len: 1024,
                    retry_with: Some(32),
                    error: "CUDA out of memory".into(),
                });
            }
            app.apply(&Telemetry::EvalMemory(EvalMemory {
                step: n,
                phase: "validation".into(),
                batches: 16,
                samples: 1024,
                asked: 64,
                size: 32,
                chunks: 32 + ooms,
                seq_len: 1024,
                peak_bytes: 50 << 30,
                limit_bytes: 80 << 30,
                usage: 0.625,
                ooms,
                seconds: 4.2,
            }));
            app.apply(&Telemetry::Eval(EvalMetrics {
                step: n,
                val_loss: 2.1,
                train_loss: 2.0,
                tokens: 1 << 20,
            }));
            app.apply(&Telemetry::Notice(Notice::new(
                Level::Info,
                "bench",
                "event",
            )));
        }
    }
    // A fragmented allocator: 64 segments, each a run of alternating blocks.
    let segments = (0..64u64)
        .map(|i| Segment {
            address: i << 32,
            total_size: 512 << 20,
            pool: "large".into(),
            runs: (0..16)
                .map(|j| BlockRun {
                    size: 32 << 20,
                    allocated: (i + j) % 3 != 0,
                })
                .collect(),
        })
        .collect();
    app.apply(&Telemetry::Segments(SegmentMap {
        segments,
        omitted_segments: 100,
        omitted_bytes: 20 << 30,
    }));
    app
}

fn time_frames(app: &App, frames: usize) -> Vec<Duration> {
    let mut terminal = Terminal::new(TestBackend::new(200, 60)).expect("test backend");
    let mut times = Vec::with_capacity(frames);
    for _ in 0..frames {
        let t = Instant::now();
        terminal.draw(|f| render(f, app)).expect("draw");
        times.push(t.elapsed());
    }
    times.sort();
    times
}

fn report(name: &str, times: &[Duration]) -> Duration {
    let median = times[times.len() / 2];
    let p99 = times[times.len() * 99 / 100];
    println!(
        "{name:<28} median {:>8.1} µs   p99 {:>8.1} µs   max {:>8.1} µs",
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        times[times.len() - 1].as_secs_f64() * 1e6
    );
    median
}

fn main() {
    let frames = 500;
    let built = Instant::now();
    let app = full_app();
    println!(
        "state: 200k steps, step memories and samples, 200 decisions, a 64-segment map folded in {:.2} s; loss history {} points, memory {} points, {} events",
        built.elapsed().as_secs_f64(),
        app.loss.points().len(),
        app.memory.points().len(),
        app.events.len()
    );
    let empty = report(
        "empty app (baseline)",
        &time_frames(&App::new("e", true), frames),
    );
    let full = report("full histories, 200x60", &time_frames(&app, frames));
    println!(
        "full / empty: {:.2}x; full frame uses {:.2}% of the 50 ms frame interval",
        full.as_secs_f64() / empty.as_secs_f64(),
        100.0 * full.as_secs_f64() / 0.050
    );
}
