//! Snapshot tests of whole screens, rendered with ratatui's TestBackend from scripted
//! telemetry. A diff here is a visible change to what users see: review it.
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use headroom_core::policy::{Decision, Profile, ResizeReason, Thresholds};
use headroom_core::{
    AllocatorStats, BlockRun, Command, EvalMemory, EvalMetrics, GpuStats, HeapStats, HostStats,
    Level, Notice, RunInfo, RunStatus, RunSummary, Segment, SegmentMap, StepMemory, StepMetrics,
    SystemSample, Telemetry,
};
use headroom_ui::app::App;
use headroom_ui::keys::{action_for, Action};
use headroom_ui::mode::ReplayView;
use headroom_ui::{Link, Mode};

mod support;
use support::{draw, run_info, step};

fn cpu_sample(i: u64) -> Telemetry {
    Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 97.0,
            mem_used: 6 << 30,
            mem_total: 24 << 30,
            mem_available: 0,
            process_rss: (400 << 20) + i * (2 << 20),
        },
        gpu: None,
        allocator: None,
        // A trim every 20 steps, each returning 48 MiB.
        heap: Some(HeapStats {
            rss_anon: (380 << 20) + i * (2 << 20),
            in_use: (300 << 20) + i * (1 << 20),
            free_kept: 60 << 20,
            trims: i / 20,
            last_trim_freed: (i >= 20).then_some(48 << 20),
        }),
    })
}

/// [`cpu_sample`] as a log from before the heap figures holds it.
fn old_cpu_sample(i: u64) -> Telemetry {
    match cpu_sample(i) {
        Telemetry::Sample(s) => Telemetry::Sample(SystemSample { heap: None, ..s }),
        _ => unreachable!(),
    }
}

fn cuda_sample(i: u64) -> Telemetry {
    Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 12.0,
            mem_used: 20 << 30,
            mem_total: 128 << 30,
            mem_available: 0,
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
        heap: None,
    })
}

fn decision(step: u64, decision: Decision) -> Telemetry {
    Telemetry::Decision { step, decision }
}

/// One step's peak at `usage` of `limit`, with the model's prediction from step 3 on.
fn step_memory(n: u64, micro_batch: usize, limit: u64, usage: f64, predicted: f64) -> Telemetry {
    let bytes = |u: f64| (u * limit as f64) as u64;
    Telemetry::StepMemory(StepMemory {
        step: n,
        micro_batch,
        seq_len: 64,
        peak_bytes: bytes(usage),
        predicted_bytes: (n >= 3).then(|| bytes(predicted)),
        limit_bytes: limit,
        configured_limit_bytes: limit,
        usage,
    })
}

/// What the controller does in a scripted run, after which step.
#[derive(Clone, Copy, PartialEq)]
enum Story {
    /// Telemetry of a trainer without a memory controller: no thresholds, no decisions.
    Plain,
    /// CPU under a 768 MiB budget: grows 4 → 16 after step 5, runs out of memory in step
    /// 30 and retries at 8, the user picks the conservative profile and pins the batch.
    CpuOom,
    /// H100: grows 4 → 16 after step 5; after step 45 the next batch is forecast above
    /// warning and the controller shrinks to 12 before it runs.
    CudaForecast,
}

fn micro_batch_at(story: Story, n: u64) -> usize {
    match (story, n) {
        (Story::Plain, _) => 16,
        (_, 1..=5) => 4,
        (Story::CpuOom, 30..) => 8,
        _ => 16,
    }
}

/// Peak usage of step `n` and what the model predicted for it.
fn usage_at(story: Story, n: u64) -> (f64, f64) {
    let wobble = ((n * 7) % 5) as f64 * 0.004;
    match (story, micro_batch_at(story, n)) {
        (_, 4) => (0.30 + wobble, 0.31),
        (Story::CpuOom, 8) => (0.55 + wobble, 0.56),
        // Drifting up over the run: the forecast at step 45 crosses warning.
        _ => (0.78 + n as f64 * 0.002 + wobble, 0.79 + n as f64 * 0.002),
    }
}

fn policy_events(story: Story, n: u64) -> Vec<Telemetry> {
    let resize = |from, to, reason, usage, predicted| Decision::Resize {
        from,
        to,
        reason,
        usage,
        predicted,
    };
    match (story, n) {
        (Story::Plain, _) => vec![],
        (_, 5) => vec![decision(
            5,
            resize(4, 16, ResizeReason::Grow, 0.31, Some(0.80)),
        )],
        (Story::CpuOom, 29) => vec![
            Telemetry::Oom {
                step: 30,
                micro_batch: 16,
                seq_len: 64,
                retry_with: Some(8),
                error: "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory".into(),
            },
            // Taken during step 30, so numbered 30 like the error.
            decision(30, Decision::EmptyCache { usage: 1.0 }),
            decision(
                30,
                Decision::CeilingLearned {
                    micro_batch: 16,
                    tokens: 1024,
                    usage: 1.0,
                },
            ),
            decision(30, resize(16, 8, ResizeReason::Oom, 1.0, Some(0.56))),
        ],
        (Story::CpuOom, 36) => vec![
            Telemetry::ThresholdsChanged {
                thresholds: Profile::Conservative.thresholds(),
                profile: Some(Profile::Conservative),
                source: "command".into(),
            },
            Telemetry::CommandApplied {
                command: Command::SetProfile {
                    profile: Profile::Conservative,
                },
                applied: "profile conservative: thresholds 0.85,0.88,0.92,0.95".into(),
            },
        ],
        (Story::CpuOom, 42) => vec![Telemetry::CommandApplied {
            command: Command::PinMicroBatch { micro_batch: 8 },
            applied: "micro-batch pinned at 8, 4 accumulation steps".into(),
        }],
        // Forecast before step 46 runs: numbered 46, the step it is about.
        (Story::CudaForecast, 45) => vec![
            decision(
                46,
                Decision::Warning {
                    usage: 0.93,
                    forecast: true,
                    text: "the next batch (16 × 64 tokens) is forecast at 93% of the limit, above warning 92%".into(),
                },
            ),
            decision(
                46,
                resize(16, 12, ResizeReason::Forecast, 0.93, Some(0.86)),
            ),
        ],
        _ => vec![],
    }
}

fn scripted(device: &str, name: &str, sample: fn(u64) -> Telemetry) -> App {
    scripted_story(device, name, sample, Story::Plain)
}

fn scripted_story(device: &str, name: &str, sample: fn(u64) -> Telemetry, story: Story) -> App {
    let mut app = App::new("default", true);
    app.apply(&Telemetry::RunStarted(run_info(device, name)));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    if story != Story::Plain {
        app.apply(&Telemetry::ThresholdsChanged {
            thresholds: Thresholds::default(),
            profile: Some(Profile::Balanced),
            source: "config".into(),
        });
    }
    let limit: u64 = match story {
        Story::CudaForecast => 80 << 30,
        _ => 768 << 20,
    };
    // The CUDA story ends right after its forecast, while the next step is still ahead.
    let last = if story == Story::CudaForecast { 45 } else { 50 };
    for n in 1..=last {
        app.set_elapsed(n as f64 * 0.1);
        let mb = micro_batch_at(story, n);
        if story != Story::Plain {
            let (usage, predicted) = usage_at(story, n);
            app.apply(&step_memory(n, mb, limit, usage, predicted));
        }
        app.apply(&Telemetry::Step(step(n, mb)));
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
        for msg in policy_events(story, n) {
            app.apply(&msg);
        }
    }
    app
}

/// A key as the live loop handles it: mapped in the app's current context.
fn press(app: &mut App, code: KeyCode) {
    let key = KeyEvent::new(code, KeyModifiers::NONE);
    if let Some(action) = action_for(key, app.key_context()) {
        app.handle(action);
    }
}

fn cpu_oom_run() -> App {
    let mut app = scripted_story("cpu", "AMD EPYC 7B13", cpu_sample, Story::CpuOom);
    // As the sampler says it on a machine without an NVIDIA driver.
    app.apply(&Telemetry::Notice(
        Notice::new(Level::Info, "nvml", "no NVIDIA driver: device figures off").with_detail(
            "NVML unavailable (a libloading error occurred: libnvidia-ml.so.1: cannot open \
             shared object file: No such file or directory)",
        ),
    ));
    app
}

fn cuda_forecast_run() -> App {
    scripted_story("cuda:0", "cuda:0", cuda_sample, Story::CudaForecast)
}

#[test]
fn main_screen_cpu() {
    let app = cpu_oom_run();
    let text = format!("{}", draw(&app, 100, 30).backend());
    for needed in [
        "micro 8 × accum 4 = 32 · pinned",
        "OOMs caught 1 · ceiling 1024 tokens",
        "thresholds 0.85,0.88,0.92,0.95 (conservative) in force, from command",
        "memory · limit 768 MiB",
        "[nvml] no NVIDIA driver: device figures off",
    ] {
        assert!(text.contains(needed), "{needed:?} missing:\n{text}");
    }
    // The loader's error is the log's, not the screen's.
    assert!(!text.contains("libloading"), "{text}");
    // Scrolled past on screen, kept in the log.
    assert!(
        app.events
            .iter()
            .any(|e| e.text
                == "step 30: out of memory at micro-batch 16 × 64 tokens, retrying with 8")
    );
    insta::assert_snapshot!(text);
}

#[test]
fn main_screen_cpu_at_the_minimum_size() {
    insta::assert_snapshot!(draw(&cpu_oom_run(), 80, 24).backend());
}

#[test]
fn main_screen_cuda() {
    let app = cuda_forecast_run();
    let term = draw(&app, 120, 40);
    let text = format!("{}", term.backend());
    assert!(text.contains("NVIDIA H100 80GB HBM3"));
    assert!(text.contains("frag 4.8%"), "fragmentation = 3/62 GiB");
    assert!(
        text.contains("forecast 93% > warning 92%: micro-batch → 12, 86%"),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn threshold_editor_open() {
    let mut app = cpu_oom_run();
    press(&mut app, KeyCode::Char('t'));
    // Warning 0.88 → 0.90.
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Up);
    press(&mut app, KeyCode::Char('+'));
    insta::assert_snapshot!(draw(&app, 80, 24).backend());
}

#[test]
fn threshold_editor_shows_a_local_refusal() {
    let mut app = cpu_oom_run();
    press(&mut app, KeyCode::Char('t'));
    // Target 0.85 → 0.88, equal to warning: refused before anything is sent.
    for _ in 0..3 {
        press(&mut app, KeyCode::Char('k'));
    }
    press(&mut app, KeyCode::Enter);
    let text = format!("{}", draw(&app, 80, 24).backend());
    assert!(
        text.contains("refused: threshold warning = 0.88 must be greater"),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn a_trainer_refusal_is_shown_in_the_editor() {
    let mut app = cpu_oom_run();
    press(&mut app, KeyCode::Char('t'));
    press(&mut app, KeyCode::Char('k'));
    press(&mut app, KeyCode::Enter);
    let sent = app.editor.as_ref().map(|e| e.draft).unwrap();
    let waiting = format!("{}", draw(&app, 80, 24).backend());
    assert!(waiting.contains("waiting for the trainer"), "{waiting}");
    app.apply(&Telemetry::CommandApplied {
        command: Command::SetThresholds { thresholds: sent },
        applied: "refused: the trainer says no; 0.85,0.88,0.92,0.95 stay in force".into(),
    });
    let text = format!("{}", draw(&app, 80, 24).backend());
    assert!(text.contains("refused: the trainer says no"), "{text}");
    assert!(!text.contains("waiting for the trainer"), "{text}");
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
    let mut app = cuda_forecast_run();
    app.apply(&segment_map());
    insta::assert_snapshot!(draw(&app, 140, 44).backend());
}

/// The CUDA run, then a validation pass after step 45 whose chunks of 64 ran out of
/// memory once and went on in chunks of 32, in the session's order.
fn cuda_run_with_an_eval_oom() -> App {
    let mut app = cuda_forecast_run();
    let limit: u64 = 80 << 30;
    app.set_elapsed(4.6);
    app.apply(&Telemetry::EvalOom {
        step: 45,
        phase: "validation".into(),
        size: 64,
        seq_len: 64,
        retry_with: Some(32),
        error: "CUDA out of memory. Tried to allocate 12.00 GiB".into(),
    });
    app.apply(&decision(
        45,
        Decision::EvalSize {
            from: 64,
            to: 32,
            reason: ResizeReason::Oom,
            usage: 1.0,
        },
    ));
    app.set_elapsed(4.8);
    app.apply(&Telemetry::EvalMemory(EvalMemory {
        step: 45,
        phase: "validation".into(),
        batches: 12,
        samples: 768,
        asked: 64,
        size: 32,
        chunks: 25,
        seq_len: 64,
        peak_bytes: (0.71 * limit as f64) as u64,
        limit_bytes: limit,
        usage: 0.71,
        ooms: 1,
        seconds: 2.31,
    }));
    app.apply(&Telemetry::Eval(EvalMetrics {
        step: 45,
        val_loss: 2.45,
        train_loss: 2.4,
        tokens: 16_384,
    }));
    app
}

#[test]
fn evaluation_is_its_own_phase() {
    let app = cuda_run_with_an_eval_oom();
    let text = format!("{}", draw(&app, 120, 40).backend());
    for needed in [
        // The pass on the training panel, under the validation loss it scored.
        "validation @ 45: 64 in chunks of 32 · 71% · 1 OOM",
        // Its OOM in the log, said once, and the pass's end in full.
        "validation ran out of memory in chunks of 64 at step 45; retrying in chunks of 32",
        "validation at step 45: 12 batches of 64 in chunks of 32 · peak 71% (56.8 GiB) · 1 OOM · 2.3 s",
        // Marked apart from training's OOMs, and named while in view.
        "E eval OOM",
    ] {
        assert!(text.contains(needed), "{needed:?} missing:\n{text}");
    }
    assert!(!text.contains("evaluation chunks 64 → 32"), "{text}");
    // Training's last decision is not hidden by evaluation's.
    assert!(text.contains("step 46: 16 → 12 (forecast)"), "{text}");
    // At the smallest size the pass's line is the shortest of its wordings.
    let small = format!("{}", draw(&app, 80, 24).backend());
    assert!(small.contains("eval chunks of 32 · 71% · 1 OOM"), "{small}");
    insta::assert_snapshot!(text);
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
    let mut app = cpu_oom_run();
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

/// On the CPU the space of the CUDA allocator panel shows the heap: the
/// resident set against live allocations, what is held apart (what a soft budget counts),
/// what the last trim freed and when.
#[test]
fn tall_cpu_screen_shows_the_heap() {
    let app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    let text = screen_text(&app, 120, 44);
    assert!(!text.contains("No allocator figures"), "{text}");
    for needed in [
        "CPU heap (glibc malloc)",
        // Sample 50: anonymous 480 MiB, live 350 MiB.
        "live 350 MiB of 480 MiB anonymous resident (72.9%)",
        "resident (RSS) 500 MiB · anonymous 480 MiB",
        "held apart 130 MiB = 27.1% of anonymous",
        "freed, kept by malloc 60.0 MiB (a trim returns its pages)",
        // The count rose at step 40's sample: the screen dates the trim.
        "last trim after step 40 freed 48.0 MiB · 2 trims",
        "most held apart 130 MiB (after step 50)",
        "a soft budget counts what is held apart as use",
    ] {
        assert!(text.contains(needed), "{needed:?} missing:\n{text}");
    }
    insta::assert_snapshot!(text);
}

/// A log from before the heap figures: the resident set, and the rest said absent, not 0.
#[test]
fn tall_cpu_screen_of_an_old_log_says_the_heap_figures_are_absent() {
    let app = scripted("cpu", "AMD EPYC 7B13", old_cpu_sample);
    let text = screen_text(&app, 120, 44);
    assert!(text.contains("resident (RSS) 500 MiB"), "{text}");
    assert!(text.contains("heap figures absent"), "{text}");
    assert!(!text.contains("held apart"), "{text}");
    assert!(!text.contains("No allocator figures"), "{text}");
}

/// At 80x24 there is no heap panel: the memory panel carries its essentials.
#[test]
fn the_minimum_cpu_screen_keeps_the_heap_essentials() {
    let app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    let text = screen_text(&app, 100, 30);
    assert!(text.contains("held apart 130 MiB"), "{text}");
}

fn screen_text(app: &App, w: u16, h: u16) -> String {
    let term = draw(app, w, h);
    let buf = term.backend().buffer();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
                + "\n"
        })
        .collect()
}

/// `163 × 4 = 512` is false: the last micro-batch is 23. The panel writes the split the
/// trainer runs.
#[test]
fn an_uneven_batch_split_is_written_as_it_runs() {
    let mut app = scripted("cpu", "AMD EPYC 7B13", cpu_sample);
    for (micro, accum, effective, want) in [
        (163, 4, 512, "micro 163 × 3 + 23 = 512"),
        (14, 19, 256, "micro 14 × 18 + 4 = 256"),
    ] {
        let mut s = step(51, micro);
        (s.accum_steps, s.effective_batch) = (accum, effective);
        app.apply(&Telemetry::Step(s));
        for (w, h) in [(80, 24), (100, 30)] {
            let text = screen_text(&app, w, h);
            assert!(text.contains(want), "{want:?} missing at {w}x{h}:\n{text}");
            assert!(!text.contains(&format!("× accum {accum}")), "{text}");
        }
    }
}

/// The run is running, under the balanced profile's thresholds.
fn running_under_balanced(app: &mut App) {
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    app.apply(&Telemetry::ThresholdsChanged {
        thresholds: Thresholds::default(),
        profile: Some(Profile::Balanced),
        source: "config".into(),
    });
}

/// Another process holds most of the host: the trainer lowered the limit to what is
/// available, the panel says so, and the room "to the limit" is never more than what the
/// host can still hand out.
#[test]
fn a_lowered_limit_is_said_and_the_room_left_is_what_is_available() {
    let mut app = App::new("default", true);
    app.apply(&Telemetry::RunStarted(run_info("cpu", "AMD EPYC 7B13")));
    running_under_balanced(&mut app);
    let gib = 1u64 << 30;
    app.apply(&Telemetry::Step(step(1, 8)));
    app.apply(&Telemetry::StepMemory(StepMemory {
        step: 1,
        micro_batch: 8,
        seq_len: 64,
        peak_bytes: 4 * gib,
        predicted_bytes: None,
        limit_bytes: 9 * gib,
        configured_limit_bytes: 23 * gib,
        usage: 4.0 / 9.0,
    }));
    // Since the step, the other job took more: 2 GiB are left beyond our 4 GiB.
    app.apply(&Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 50.0,
            mem_used: 22 * gib,
            mem_total: 24 * gib,
            mem_available: 2 * gib,
            process_rss: 4 * gib,
        },
        gpu: None,
        allocator: None,
        heap: None,
    }));
    // The run's own word for the configured one.
    app.apply(&Telemetry::Notice(Notice::new(
        Level::Info,
        "memory",
        "memory limit 23.0 GiB (host memory (no --memory-budget)); thresholds 0.90,0.92,0.95,0.97",
    )));
    for (w, h) in [(80, 24), (100, 30)] {
        let text = screen_text(&app, w, h);
        for needed in [
            "limit 23.0 GiB · 9.00 GiB",
            "available",
            "others hold 14.0 GiB",
        ] {
            assert!(text.contains(needed), "{needed:?} at {w}x{h}:\n{text}");
        }
        // "limit" names one size on this screen, the one the event names.
        assert_eq!(limits_named(&text), ["23.0 GiB"], "{w}x{h}:\n{text}");
        assert!(text.contains("2.00 GiB to"), "{w}x{h}:\n{text}");
        assert!(!text.contains("5.00 GiB to"), "{w}x{h}:\n{text}");
    }
    let text = screen_text(&app, 100, 30);
    assert!(text.contains("usage is of 9.00 GiB"), "{text}");
    insta::assert_snapshot!(text);
}

/// The sizes the screen calls a limit ("limit 23.0 GiB"), each once.
fn limits_named(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (i, _) in text.match_indices("limit ") {
        let size: String = text[i + 6..]
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        if size.starts_with(|c: char| c.is_ascii_digit()) && !out.contains(&size) {
            out.push(size);
        }
    }
    out
}

/// Before the first step, "free" is what the kernel says is available, not host total
/// minus our own resident set.
#[test]
fn free_memory_before_the_first_step_counts_other_processes() {
    let mut app = App::new("default", true);
    app.apply(&Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 50.0,
            mem_used: 15 << 30,
            mem_total: 24 << 30,
            mem_available: 9 << 30,
            process_rss: 1 << 30,
        },
        gpu: None,
        allocator: None,
        heap: None,
    }));
    let text = screen_text(&app, 100, 30);
    assert!(text.contains("headroom 9.00 GiB free"), "{text}");
}

/// The event log panel cuts long entries; `e` shows every entry whole, wrapped, and
/// Esc closes it again.
#[test]
fn the_event_list_shows_long_entries_in_full() {
    let mut app = cpu_oom_run();
    let long = "usage stayed at 96% although the micro-batch shrank from 32 to 16 (it was \
                97%): the memory is held apart from the batch (allocator cache, \
                fragmentation or another process); holding at 16 and freeing the cache";
    app.apply(&decision(
        58,
        Decision::Warning {
            usage: 0.96,
            forecast: false,
            text: format!("step 58: {long}"),
        },
    ));
    let panel = screen_text(&app, 100, 30);
    assert!(panel.contains("step 58: usage stayed"), "{panel}");
    assert!(!panel.contains("step 58: step 58"), "{panel}");
    assert!(
        !panel.contains("freeing the cache"),
        "cut in the panel:\n{panel}"
    );
    assert!(panel.contains("e: read in full"), "{panel}");
    press(&mut app, KeyCode::Char('e'));
    let full = screen_text(&app, 100, 30);
    // Every word, in order, across the wrapped rows.
    let words: Vec<&str> = full.split_whitespace().filter(|w| *w != "│").collect();
    let whole = format!("step 58: {long}");
    let wanted: Vec<&str> = whole.split_whitespace().collect();
    let at = words
        .windows(wanted.len())
        .position(|w| w == wanted.as_slice());
    assert!(at.is_some(), "not whole:\n{full}");
    insta::assert_snapshot!(full);
    press(&mut app, KeyCode::Esc);
    assert!(!app.show_events);
    assert_eq!(screen_text(&app, 100, 30), panel);
}

/// The footer offers the keys that do something now, named for what they do now.
#[test]
fn the_footer_follows_the_runs_state() {
    let footer = |app: &App| -> String {
        let text = screen_text(app, 120, 30);
        text.lines().nth(29).unwrap_or_default().to_string()
    };
    let mut app = cpu_oom_run();
    let running = footer(&app);
    for needed in [" q  stop", " p  pause", " c  checkpoint", " b  unpin"] {
        assert!(running.contains(needed), "{needed:?} missing: {running}");
    }
    app.apply(&Telemetry::Status {
        status: RunStatus::Paused,
    });
    let paused = footer(&app);
    assert!(
        paused.contains(" p  resume") && !paused.contains("pause"),
        "{paused}"
    );
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    press(&mut app, KeyCode::Char('q'));
    let stopping = footer(&app);
    assert!(stopping.contains(" q  quit now"), "{stopping}");
    for gone in [" p ", " c ", " t ", " b ", " f ", " P "] {
        assert!(
            !stopping.contains(gone),
            "{gone:?} offered while stopping: {stopping}"
        );
    }
    app.apply(&Telemetry::Finished(RunSummary {
        steps_done: 50,
        total_steps: 300,
        stopped_by_user: true,
        last_loss: None,
        last_val_loss: None,
        tokens_seen: 0,
        elapsed_s: 5.0,
        checkpoint: None,
        memory: Default::default(),
    }));
    let over = footer(&app);
    assert!(
        over.contains(" q  close") && over.contains(" ?  help"),
        "{over}"
    );
    for gone in [" p ", " c ", " t ", " b ", "stop"] {
        assert!(
            !over.contains(gone),
            "{gone:?} offered after the run: {over}"
        );
    }
    let header = screen_text(&app, 120, 30);
    assert!(!header.contains("samples/s"), "{header}");
}

/// The micro-batch's size over time sits beside the chart's ↑↓ marks: 4, then 16, then 8
/// after the OOM.
#[test]
fn the_micro_batch_history_shows_its_levels() {
    let app = cpu_oom_run();
    let text = screen_text(&app, 100, 30);
    let line = text
        .lines()
        .find(|l| l.contains("size "))
        .unwrap_or_else(|| panic!("no size line:\n{text}"));
    for level in ['▂', '█', '▄'] {
        assert!(line.contains(level), "{level} missing: {line}");
    }
    assert!(line.contains(" 8 (max 16)"), "{line}");
}

/// A run as an attached viewer sees it: the same picture, `q` detaching and `S` stopping.
fn attached_run() -> App {
    let mut app = cpu_oom_run();
    app.mode = Mode::Attached {
        address: "/run/user/1000/headroom/tiny-4242.sock".into(),
    };
    app
}

/// The header says whose screen this is and where it is attached; the footer offers
/// detach and stop.
#[test]
fn attached_footer() {
    let app = attached_run();
    let text = screen_text(&app, 100, 30);
    assert!(
        text.lines()
            .next()
            .unwrap()
            .contains("attached to /run/user/1000/headroom/tiny-4242.sock"),
        "{text}"
    );
    let footer = text.lines().nth(29).unwrap();
    assert!(
        footer.contains(" q  detach") && footer.contains(" S  stop run"),
        "{footer}"
    );
    assert!(!footer.contains(" q  stop"), "{footer}");
    insta::assert_snapshot!(draw(&app, 100, 30).backend());
}

/// `S` asks before anything is sent; the question takes the footer.
#[test]
fn attached_stop_asks_first() {
    let mut app = attached_run();
    press(&mut app, KeyCode::Char('S'));
    let footer = screen_text(&app, 100, 30)
        .lines()
        .nth(29)
        .unwrap()
        .to_string();
    assert!(footer.contains("stop the run? y stops it"), "{footer}");
    assert!(footer.contains("finish the step, checkpoint"), "{footer}");
}

/// A run that said it saves no checkpoint (a Python run without `on_checkpoint`) is not
/// promised one when `S` asks.
#[test]
fn the_stop_question_promises_no_checkpoint_a_run_will_not_take() {
    let mut app = attached_run();
    if let Some(info) = app.info.as_mut() {
        info.checkpoints = Some(false);
    }
    press(&mut app, KeyCode::Char('S'));
    let footer = screen_text(&app, 160, 30)
        .lines()
        .nth(29)
        .unwrap()
        .to_string();
    assert!(
        footer.contains("no checkpoint: the run has no on_checkpoint")
            && !footer.contains("finish the step, checkpoint"),
        "{footer}"
    );
}

/// A lost connection says so in place of the keys, over the last picture.
#[test]
fn lost_banner() {
    let mut app = attached_run();
    app.apply_link(&Link::Lost {
        reason: "the run's socket closed".into(),
    });
    app.apply_link(&Link::Retrying {
        attempt: 2,
        in_s: 2.0,
    });
    let text = screen_text(&app, 100, 30);
    let footer = text.lines().nth(29).unwrap();
    assert!(
        footer.contains("connection lost: the run's socket closed · retrying in 2 s"),
        "{footer}"
    );
    // The last picture stays.
    assert!(text.contains("micro 8 × accum 4 = 32 · pinned"), "{text}");
    insta::assert_snapshot!(draw(&app, 100, 30).backend());
}

/// A replay: read-only, its own controls, speed, position and state in the footer.
#[test]
fn replay_footer() {
    let mut app = cpu_oom_run();
    app.mode = Mode::Replay {
        source: "runs/tiny.jsonl".into(),
    };
    app.set_replay(Some(ReplayView {
        position: 5.0,
        total: 65.0,
        speed: 4.0,
        paused: true,
        ended: false,
        following: false,
    }));
    let text = screen_text(&app, 100, 30);
    let footer = text.lines().nth(29).unwrap();
    for needed in [
        " q  close",
        " Space  play",
        " n  step",
        "paused · 4× · 5s / 1m05s",
    ] {
        assert!(footer.contains(needed), "{needed:?} missing: {footer}");
    }
    for gone in [" c ", " t ", " b ", " P "] {
        assert!(
            !footer.contains(gone),
            "{gone:?} offered in a replay: {footer}"
        );
    }
    assert!(text
        .lines()
        .next()
        .unwrap()
        .contains("replay of runs/tiny.jsonl"));
    insta::assert_snapshot!(draw(&app, 100, 30).backend());
}

/// A watch-only Python run (`headroom.Run(...)` with no model, no total and no tokens:
/// `run.report(loss)` on images) far below its thresholds: 2–4% of a 23.5 GiB limit.
fn watch_only_run() -> App {
    let mut app = App::new("cnn_watch", true);
    app.apply(&Telemetry::RunStarted(RunInfo {
        run_name: "cnn_watch".into(),
        parameters: 0,
        total_steps: 0,
        corpus: String::new(),
        train_bytes: 0,
        val_bytes: 0,
        config: None,
        ..run_info("cpu", "AMD EPYC 7B13")
    }));
    running_under_balanced(&mut app);
    let limit = 47u64 << 29; // 23.5 GiB
    for (i, n) in (64_981..=65_000u64).enumerate() {
        app.set_elapsed(i as f64);
        app.apply(&Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 0,
            loss: 0.9 - i as f64 * 0.01,
            lr: None,
            grad_norm: None,
            step_time_s: 0.125,
            tokens_per_s: 512.0,
            samples_per_s: 512.0,
            micro_batch: 64,
            accum_steps: 1,
            effective_batch: 64,
            seq_len: 1,
            tokens_seen: n * 64,
        }));
        // 2% rising to 4%.
        let usage = 0.02 + 0.02 * i as f64 / 19.0;
        app.apply(&Telemetry::StepMemory(StepMemory {
            step: n,
            micro_batch: 64,
            seq_len: 1,
            peak_bytes: (usage * limit as f64) as u64,
            predicted_bytes: None,
            limit_bytes: limit,
            configured_limit_bytes: limit,
            usage,
        }));
    }
    app
}

/// At 2–4% of the limit against a 90% target, the chart is scaled to what is used (0 to
/// 5%), the thresholds named above it: not a flat line on the floor of 0–100%.
#[test]
fn a_run_far_below_its_thresholds_is_charted_at_its_own_scale() {
    let app = watch_only_run();
    for (w, h) in [(80, 24), (100, 30)] {
        let text = screen_text(&app, w, h);
        let chart: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.contains("memory vs limit"))
            .skip(1)
            .take_while(|l| !l.contains('└'))
            .collect();
        assert!(
            chart.iter().any(|l| l.contains("    5%┤")),
            "{w}x{h}:\n{text}"
        );
        assert!(
            !chart.iter().any(|l| l.contains("100%")),
            "{w}x{h}:\n{text}"
        );
        assert!(chart.iter().any(|l| l.contains("↑ t")), "{w}x{h}:\n{text}");
        // The line climbs over rows of its own (braille dots in the plot's half).
        let rows_with_line = chart
            .iter()
            .filter(|l| {
                l.chars()
                    .take(w as usize / 2)
                    .any(|c| ('\u{2801}'..='\u{28ff}').contains(&c))
            })
            .count();
        assert!(rows_with_line >= 2, "a flat line at {w}x{h}:\n{text}");
    }
    insta::assert_snapshot!(screen_text(&app, 100, 30));
}

/// Data without tokens (seq_len 1: a sample is the unit) is counted in samples: no
/// "tok/s" that only repeats samples/s, no "tokens seen", no "seq 1".
#[test]
fn data_without_tokens_is_counted_in_samples() {
    let app = watch_only_run();
    for (w, h) in [(80, 24), (100, 30)] {
        let text = screen_text(&app, w, h);
        assert!(text.contains("512.0 samples/s"), "{w}x{h}:\n{text}");
        for gone in ["tok/s", "tokens seen", "seq 1"] {
            assert!(!text.contains(gone), "{gone:?} at {w}x{h}:\n{text}");
        }
    }
    let text = screen_text(&app, 100, 30);
    assert!(text.contains("samples seen 4,160,000"), "{text}");
}

/// A run that gave no total and no model: the header says what it knows.
#[test]
fn a_header_without_a_total_or_a_model_says_what_it_knows() {
    let app = watch_only_run();
    for (w, h) in [(80, 24), (100, 30)] {
        let header: String = screen_text(&app, w, h).lines().take(3).collect();
        assert!(header.contains("step 65,000 "), "{header}");
        for gone in ["/0", "(0%)", "ETA 0s", "0.00M"] {
            assert!(!header.contains(gone), "{gone:?} at {w}x{h}: {header}");
        }
    }
    let header: String = screen_text(&app, 100, 30).lines().take(3).collect();
    assert!(header.contains("model not given"), "{header}");
    let started = &app.events.back().expect("events").text;
    assert_eq!(
        started,
        "run 'cnn_watch' started on cpu (model not given, from step 1, no total given)"
    );
    let mut app = app;
    app.apply(&Telemetry::Finished(RunSummary {
        steps_done: 65_000,
        total_steps: 0,
        stopped_by_user: true,
        last_loss: Some(0.71),
        last_val_loss: None,
        tokens_seen: 65_000 * 64,
        elapsed_s: 19.0,
        checkpoint: None,
        memory: Default::default(),
    }));
    assert_eq!(app.events[0].text, "run stopped at step 65000");
    let header: String = screen_text(&app, 100, 30).lines().take(3).collect();
    assert!(
        header.contains("step 65,000 ") && !header.contains("/0"),
        "{header}"
    );
}
