//! Snapshot tests of whole screens, rendered with ratatui's TestBackend from scripted
//! telemetry. A diff here is a visible change to what users see: review it.
use headroom_core::{
    AllocatorStats, BlockRun, EvalMetrics, GpuStats, HostStats, Level, Notice, RunConfig, RunInfo,
    RunStatus, Segment, SegmentMap, StepMetrics, SystemSample, Telemetry,
};
use headroom_ui::app::App;
use headroom_ui::keys::Action;
use headroom_ui::view::render;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn run_info(device: &str, device_name: &str) -> RunInfo {
    RunInfo {
        run_name: "default".into(),
        device: device.into(),
        device_name: device_name.into(),
        parameters: 830_464,
        start_step: 0,
        total_steps: 300,
        corpus: "tinyshakespeare.txt (bundled)".into(),
        train_bytes: 1_003_854,
        val_bytes: 111_540,
        config: RunConfig::default(),
    }
}

fn step(n: u64) -> Telemetry {
    Telemetry::Step(StepMetrics {
        step: n,
        total_steps: 300,
        loss: 5.5 - 3.0 * (1.0 - (-(n as f64) / 20.0).exp()),
        lr: 3e-3,
        grad_norm: 0.8,
        step_time_s: 0.095,
        tokens_per_s: 21_500.0,
        samples_per_s: 336.0,
        micro_batch: 16,
        accum_steps: 2,
        effective_batch: 32,
        seq_len: 64,
        tokens_seen: n * 2048,
    })
}

fn cpu_sample(i: u64) -> Telemetry {
    Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 97.0,
            mem_used: 6 << 30,
            mem_total: 24 << 30,
            process_rss: (400 << 20) + i * (2 << 20),
        },
        gpu: None,
        allocator: None,
    })
}

fn cuda_sample(i: u64) -> Telemetry {
    Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 12.0,
            mem_used: 20 << 30,
            mem_total: 128 << 30,
            process_rss: 3 << 30,
        },
        gpu: Some(GpuStats {
            index: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            mem_used: (60 << 30) + i * (100 << 20),
            mem_total: 80 << 30,
            util_percent: Some(98),
            temperature_c: Some(61),
            power_w: Some(612.5),
        }),
        allocator: Some(AllocatorStats {
            allocated: 52 << 30,
            allocated_peak: 58 << 30,
            reserved: 62 << 30,
            reserved_peak: 64 << 30,
            active: 52 << 30,
            active_peak: 58 << 30,
            inactive_split: 3 << 30,
            inactive_split_peak: 4 << 30,
            requested: 51 << 30,
            requested_peak: 57 << 30,
            num_alloc_retries: 2,
            num_ooms: 0,
            segments: 211,
        }),
    })
}

fn scripted(device: &str, name: &str, sample: fn(u64) -> Telemetry) -> App {
    let mut app = App::new("default", true);
    app.apply(&Telemetry::RunStarted(run_info(device, name)));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    for n in 1..=50 {
        app.set_elapsed(n as f64 * 0.1);
        app.apply(&step(n));
        if n % 5 == 0 {
            app.apply(&sample(n));
        }
        if n % 25 == 0 {
            app.apply(&Telemetry::Eval(EvalMetrics {
                step: n,
                val_loss: 2.9 - n as f64 / 100.0,
                train_loss: 2.8 - n as f64 / 100.0,
                tokens: 16_384,
            }));
        }
    }
    app
}

fn draw(app: &App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| render(f, app)).unwrap();
    terminal
}

#[test]
fn main_screen_cpu() {
    let mut app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    app.apply(&Telemetry::Notice(Notice::new(
        Level::Info,
        "nvml",
        "NVML unavailable (a libloading error occurred): no NVIDIA driver on this machine",
    )));
    insta::assert_snapshot!(draw(&app, 100, 30).backend());
}

#[test]
fn main_screen_cuda() {
    let app = scripted("cuda:0", "cuda:0", cuda_sample);
    let term = draw(&app, 120, 40);
    let text = format!("{}", term.backend());
    assert!(text.contains("NVIDIA H100 80GB HBM3"));
    assert!(text.contains("frag 4.8%"), "fragmentation = 3/62 GiB");
    insta::assert_snapshot!(text);
}

fn segment_map() -> Telemetry {
    let seg = |address: u64, gib_runs: &[(u64, bool)]| Segment {
        address,
        total_size: gib_runs.iter().map(|r| r.0 << 28).sum(),
        pool: "large".into(),
        runs: gib_runs
            .iter()
            .map(|&(quarters, allocated)| BlockRun {
                size: quarters << 28,
                allocated,
            })
            .collect(),
    };
    Telemetry::Segments(SegmentMap {
        segments: vec![
            seg(1, &[(16, true), (4, false), (8, true), (4, false)]),
            seg(2, &[(40, true)]),
            seg(3, &[(2, true), (6, false), (2, true), (6, false)]),
        ],
        omitted_segments: 0,
        omitted_bytes: 0,
    })
}

#[test]
fn cuda_tall_screen_with_segment_map() {
    let mut app = scripted("cuda:0", "cuda:0", cuda_sample);
    app.apply(&segment_map());
    insta::assert_snapshot!(draw(&app, 140, 44).backend());
}

#[test]
fn segment_bars_scale_blocks_to_width() {
    let seg = Segment {
        total_size: 100,
        runs: vec![
            BlockRun {
                size: 50,
                allocated: true,
            },
            BlockRun {
                size: 25,
                allocated: false,
            },
            BlockRun {
                size: 25,
                allocated: true,
            },
        ],
        ..Default::default()
    };
    let bar = headroom_ui::view::segment_bar(&seg, 8);
    let text: String = bar.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(text, "████░░██");
    assert_eq!(bar.len(), 3, "equal cells grouped");
}

#[test]
fn help_overlay() {
    let mut app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    app.handle(Action::ToggleHelp);
    insta::assert_snapshot!(draw(&app, 100, 30).backend());
}

#[test]
fn failed_run_shows_the_reason() {
    let mut app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    app.apply(&Telemetry::Failed {
        reason: "trainer panicked: index out of range".into(),
    });
    let text = format!("{}", draw(&app, 100, 30).backend());
    assert!(
        text.contains("failed: trainer panicked: index out of range"),
        "{text}"
    );
}

#[test]
fn small_terminal_gets_a_message_not_a_panic() {
    let app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    insta::assert_snapshot!(draw(&app, 60, 16).backend());
    for (w, h) in [(1, 1), (79, 24), (80, 23)] {
        let text = format!("{}", draw(&app, w, h).backend());
        if w >= 20 {
            assert!(text.contains("too small"), "{w}x{h}: {text}");
        }
    }
}

#[test]
fn empty_state_renders_before_any_telemetry() {
    let app = App::new("default", false);
    let text = format!("{}", draw(&app, 80, 24).backend());
    assert!(text.contains("waiting for the first sample"), "{text}");
    assert!(text.contains("starting"), "{text}");
}

#[test]
fn tall_cpu_screen_explains_the_missing_allocator() {
    let app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    let text = format!("{}", draw(&app, 120, 44).backend());
    assert!(
        text.contains("No allocator figures: this run is on the CPU"),
        "{text}"
    );
    assert!(text.contains("process RSS 500 MiB"), "{text}");
}
