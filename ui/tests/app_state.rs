//! How `App` folds telemetry: the figures panels read, and the event log's wording and
//! order. (Key handling and paging are unit-tested in app.rs.)
use headroom_core::{
    Command, EvalMetrics, Level, RunConfig, RunInfo, RunStatus, RunSummary, StepMetrics, Telemetry,
};
use headroom_ui::app::{App, Reaction};
use headroom_ui::keys::Action;

fn step(n: u64, micro: usize, accum: usize) -> Telemetry {
    Telemetry::Step(StepMetrics {
        step: n,
        total_steps: 100,
        loss: 2.0,
        lr: 1e-3,
        grad_norm: 1.0,
        step_time_s: 0.5,
        tokens_per_s: 1.0,
        samples_per_s: 1.0,
        micro_batch: micro,
        accum_steps: accum,
        effective_batch: micro * accum,
        seq_len: 64,
        tokens_seen: n * 64,
    })
}

#[test]
fn run_started_names_the_run_and_resumes_from_its_start_step() {
    let mut app = App::new("label", false);
    app.apply(&Telemetry::RunStarted(RunInfo {
        run_name: "from-trainer".into(),
        device: "cpu".into(),
        device_name: "Some CPU".into(),
        parameters: 2_500_000,
        start_step: 40,
        total_steps: 100,
        corpus: "c".into(),
        train_bytes: 1,
        val_bytes: 1,
        config: RunConfig::default(),
    }));
    assert_eq!(app.run_name, "from-trainer");
    assert_eq!(app.step(), 40, "a resumed run starts at its checkpoint");
    assert_eq!(app.total_steps(), 100);
    assert_eq!(app.progress_line(), "step 40/100 (40%)  ETA --");
    assert!(app.events[0].text.contains("steps 41..100"));
}

#[test]
fn steps_drive_progress_eta_and_the_loss_history() {
    let mut app = App::new("t", false);
    for n in 1..=10 {
        app.apply(&step(n, 16, 2));
    }
    // 90 steps left at 0.5 s a step.
    assert_eq!(app.eta(), Some(45.0));
    assert_eq!(app.progress_line(), "step 10/100 (10%)  ETA 45s");
    assert_eq!(app.loss.points().len(), 10);
    let last = app.last_step.as_ref().unwrap();
    assert_eq!(
        (last.micro_batch, last.accum_steps, last.effective_batch),
        (16, 2, 32)
    );
    assert!(app.events.is_empty(), "steps are charted, not logged");
}

#[test]
fn evals_add_val_points_and_a_log_line() {
    let mut app = App::new("t", false);
    app.apply(&Telemetry::Eval(EvalMetrics {
        step: 25,
        val_loss: 1.75,
        train_loss: 1.5,
        tokens: 10,
    }));
    assert_eq!(app.val_loss.last(), Some((25.0, 1.75)));
    assert_eq!(
        app.events[0].text,
        "eval at step 25: val 1.7500, train 1.5000"
    );
}

#[test]
fn log_entries_carry_the_time_they_arrived_newest_first() {
    let mut app = App::new("t", false);
    app.set_elapsed(1.0);
    app.apply(&Telemetry::CheckpointSaved {
        step: 7,
        path: "runs/x/step7".into(),
    });
    app.set_elapsed(2.0);
    app.apply(&Telemetry::CommandApplied {
        command: Command::Pause,
        applied: "paused at step 8".into(),
    });
    let got: Vec<(f64, &str)> = app.events.iter().map(|e| (e.t, e.text.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (2.0, "paused at step 8"),
            (1.0, "checkpoint at step 7: runs/x/step7")
        ]
    );
}

#[test]
fn finished_ends_the_run_and_quit_then_just_leaves() {
    let mut app = App::new("t", false);
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    app.apply(&Telemetry::Finished(RunSummary {
        steps_done: 60,
        total_steps: 100,
        stopped_by_user: true,
        last_loss: None,
        last_val_loss: None,
        tokens_seen: 0,
        elapsed_s: 1.0,
        checkpoint: None,
    }));
    assert!(app.is_over());
    assert_eq!(app.status_text(), "finished");
    assert_eq!(app.events[0].text, "run stopped at step 60/100");
    assert_eq!(app.events[0].level, Level::Info);
    // Nothing left to stop or pause.
    assert_eq!(app.handle(Action::TogglePause), Reaction::Nothing);
    assert_eq!(app.handle(Action::Quit), Reaction::Exit);
}

#[test]
fn the_trainers_stopping_status_replaces_the_local_request() {
    let mut app = App::new("t", false);
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    assert_eq!(app.handle(Action::Quit), Reaction::Send(Command::Stop));
    assert_eq!(app.status_text(), "stop requested");
    app.apply(&Telemetry::Status {
        status: RunStatus::Stopping,
    });
    assert_eq!(app.status_text(), "stopping");
    // Pausing a stopping run means nothing.
    assert_eq!(app.handle(Action::TogglePause), Reaction::Nothing);
}

#[test]
fn help_opens_and_closes_with_question_mark_or_esc() {
    let mut app = App::new("t", false);
    app.handle(Action::ToggleHelp);
    assert!(app.show_help);
    app.handle(Action::Back);
    assert!(!app.show_help);
    app.handle(Action::ToggleHelp);
    app.handle(Action::ToggleHelp);
    assert!(!app.show_help);
    // Esc with nothing open does not quit.
    assert_eq!(app.handle(Action::Back), Reaction::Nothing);
    assert!(!app.stop_requested);
}
