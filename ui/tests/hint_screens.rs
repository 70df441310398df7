//! The live hints on screen: a small panel above the event log and a line in the log,
//! from hints the real rules (headroom_core::HintEngine) raised over a scripted run.
use headroom_core::{HintEngine, HintKind, RunStatus, StepMemory, StepMetrics, Telemetry};
use headroom_ui::app::App;

mod support;
use support::{draw, run_info};

const MIB: u64 = 1 << 20;

/// A CPU run under a 2 GiB budget that grows its micro-batch 4 → 16 (activations come
/// to dominate), then leaks 6 MiB a step at 16; every record also goes through the rules,
/// whose hints the screen gets as the run's bus would send them.
fn leaking_run() -> App {
    let mut app = App::new("default", true);
    let mut rules = HintEngine::new();
    // The run's clock: a record every tenth of a second.
    let mut t = 0.0;
    let mut apply = |app: &mut App, msg: Telemetry| {
        t += 0.1;
        for h in rules.observe(&msg, t) {
            app.apply(&Telemetry::Hint(h));
        }
        app.apply(&msg);
    };
    apply(
        &mut app,
        Telemetry::RunStarted(run_info("cpu", "AMD EPYC 7B13")),
    );
    apply(
        &mut app,
        Telemetry::Status {
            status: RunStatus::Running,
        },
    );
    let limit = 2048 * MIB;
    for n in 1..=30u64 {
        app.set_elapsed(n as f64 * 0.1);
        let mb = if n <= 5 { 4 } else { 16 };
        let leaked = n.saturating_sub(20) * 6 * MIB;
        let peak = 200 * MIB + mb as u64 * 60 * MIB + leaked;
        apply(
            &mut app,
            Telemetry::StepMemory(StepMemory {
                step: n,
                micro_batch: mb,
                seq_len: 64,
                peak_bytes: peak,
                predicted_bytes: None,
                limit_bytes: limit,
                configured_limit_bytes: limit,
                usage: peak as f64 / limit as f64,
            }),
        );
        apply(
            &mut app,
            Telemetry::Step(StepMetrics {
                step: n,
                total_steps: 300,
                loss: 3.0,
                lr: Some(3e-3),
                grad_norm: Some(0.8),
                step_time_s: 0.095,
                tokens_per_s: 21_500.0,
                samples_per_s: 336.0,
                micro_batch: mb,
                accum_steps: 32 / mb,
                effective_batch: 32,
                seq_len: 64,
                tokens_seen: n * 2048,
            }),
        );
    }
    app
}

#[test]
fn raised_hints_are_kept_and_logged_and_a_clear_removes_them() {
    let mut app = leaking_run();
    let up: Vec<HintKind> = app.hints.keys().copied().collect();
    assert_eq!(up, [HintKind::Activations, HintKind::Leak]);
    assert!(app.events[0]
        .text
        .starts_with("hint: leak: the step's peak rises 6.0 MiB"));
    let mut cleared = app.hints[&HintKind::Leak].clone();
    cleared.raised = false;
    cleared.text = "the step's peak no longer rises".into();
    app.apply(&Telemetry::Hint(cleared));
    assert!(!app.hints.contains_key(&HintKind::Leak));
    assert!(app.events[0].text.starts_with("hint cleared: leak"));
}

#[test]
fn hints_panel_above_the_event_log() {
    insta::assert_snapshot!(draw(&leaking_run(), 120, 40).backend());
}

#[test]
fn hints_line_at_the_minimum_size() {
    insta::assert_snapshot!(draw(&leaking_run(), 80, 26).backend());
}
