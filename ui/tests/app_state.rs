//! How `App` folds telemetry: the figures panels read, and the event log's wording and
//! order. (Key handling and paging are unit-tested in app.rs.)
use headroom_core::policy::{Decision, Profile, ResizeReason, Thresholds};
use headroom_core::{
    Command, EvalMemory, EvalMetrics, Level, RunConfig, RunInfo, RunStatus, RunSummary, StepMemory,
    StepMetrics, Telemetry,
};
use headroom_ui::app::{App, Reaction};
use headroom_ui::keys::Action;
use headroom_ui::policy::MarkKind;

mod support;
use support::run_info;

fn step(n: u64, micro: usize, accum: usize) -> Telemetry {
    Telemetry::Step(StepMetrics {
        total_steps: 100,
        loss: 2.0,
        lr: Some(1e-3),
        grad_norm: Some(1.0),
        step_time_s: 0.5,
        tokens_per_s: 1.0,
        samples_per_s: 1.0,
        accum_steps: accum,
        effective_batch: micro * accum,
        tokens_seen: n * 64,
        ..support::step(n, micro)
    })
}

#[test]
fn run_started_names_the_run_and_resumes_from_its_start_step() {
    let mut app = App::new("label", false);
    app.apply(&Telemetry::RunStarted(RunInfo {
        run_name: "from-trainer".into(),
        parameters: 2_500_000,
        start_step: 40,
        total_steps: 100,
        corpus: "c".into(),
        train_bytes: 1,
        val_bytes: 1,
        ..run_info("cpu", "Some CPU")
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
        memory: Default::default(),
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

/// What the trainer sends around an out-of-memory error, in its order. Every decision
/// taken during the failed step is numbered with that step.
fn oom_sequence(step: u64) -> Vec<Telemetry> {
    let d = |decision| Telemetry::Decision { step, decision };
    vec![
        Telemetry::Oom {
            step,
            micro_batch: 32,
            seq_len: 128,
            retry_with: Some(16),
            error: "CUDA out of memory. Tried to allocate 2.00 GiB".into(),
        },
        d(Decision::EmptyCache { usage: 1.0 }),
        d(Decision::CeilingLearned {
            micro_batch: 32,
            tokens: 4096,
            usage: 1.0,
        }),
        d(Decision::Resize {
            from: 32,
            to: 16,
            reason: ResizeReason::Oom,
            usage: 1.0,
            predicted: Some(0.62),
        }),
    ]
}

#[test]
fn an_oom_is_logged_counted_marked_and_explained() {
    let mut app = App::new("t", false);
    app.apply(&step(40, 32, 1));
    app.set_elapsed(12.0);
    for msg in oom_sequence(41) {
        app.apply(&msg);
    }
    let log: Vec<&str> = app.events.iter().rev().map(|e| e.text.as_str()).collect();
    assert_eq!(
        log,
        vec![
            "step 41: out of memory at micro-batch 32 × 128 tokens, retrying with 16",
            "step 41: cached memory freed after out of memory",
            "step 41: ceiling learned: under 4096 tokens (micro-batch 32 ran out)",
            "step 41: shrink 32 → 16 after out of memory (predicted 62%)",
        ]
    );
    // Danger in the error colour: the OOM and the shrink it forced.
    assert_eq!(app.events[3].level, Level::Error, "the OOM itself");
    assert_eq!(app.events[0].level, Level::Error, "the shrink it forced");
    let p = &app.policy;
    assert_eq!(p.ooms, 1);
    assert_eq!(p.ceiling_tokens, Some(4096));
    assert_eq!(p.micro_batch(), Some(16));
    let kinds: Vec<MarkKind> = p.marks.iter().map(|m| m.kind).collect();
    assert_eq!(
        kinds,
        vec![MarkKind::Oom, MarkKind::CacheFreed, MarkKind::Shrank]
    );
    assert!(p.marks.iter().all(|m| m.t == 12.0));
    assert!(matches!(
        p.last_decision,
        Some((
            41,
            Decision::Resize {
                reason: ResizeReason::Oom,
                ..
            }
        ))
    ));
    for msg in oom_sequence(50) {
        app.apply(&msg);
    }
    assert_eq!(app.policy.ooms, 2);
}

/// What the session sends around an evaluation chunk that ran out of memory, in its
/// order: the error, the controller's new chunk size (numbered with the training step the
/// evaluation follows).
fn eval_oom_sequence(step: u64, size: usize, retry_with: Option<usize>) -> Vec<Telemetry> {
    vec![
        Telemetry::EvalOom {
            step,
            phase: "validation".into(),
            size,
            seq_len: 128,
            retry_with,
            error: "CUDA out of memory. Tried to allocate 1.00 GiB".into(),
        },
        Telemetry::Decision {
            step,
            decision: Decision::EvalSize {
                from: size,
                to: retry_with.unwrap_or(size),
                reason: ResizeReason::Oom,
                usage: 1.0,
            },
        },
    ]
}

fn eval_pass(step: u64, ooms: u64) -> EvalMemory {
    let limit = 3u64 << 30;
    EvalMemory {
        step,
        phase: "validation".into(),
        batches: 12,
        samples: 768,
        asked: 64,
        size: 32,
        chunks: 24 + ooms,
        seq_len: 128,
        peak_bytes: (0.71 * limit as f64) as u64,
        limit_bytes: limit,
        usage: 0.71,
        ooms,
        seconds: 2.31,
    }
}

/// Evaluation is its own phase: its OOM is a warning of its own (training's count, micro-
/// batch and pin untouched), marked apart on the chart and said once; the pass's end
/// says what it ran at and stays on the panel; one sample that does not fit is an error.
#[test]
fn an_eval_oom_is_its_own_phase_logged_once_and_marked_apart() {
    let mut app = App::new("t", false);
    app.apply(&step(40, 32, 1));
    app.set_elapsed(12.0);
    for msg in eval_oom_sequence(40, 64, Some(32)) {
        app.apply(&msg);
    }
    app.set_elapsed(14.5);
    app.apply(&Telemetry::EvalMemory(eval_pass(40, 1)));
    let log: Vec<(Level, &str)> = app
        .events
        .iter()
        .rev()
        .map(|e| (e.level, e.text.as_str()))
        .collect();
    assert_eq!(
        log,
        vec![
            (
                Level::Warn,
                "validation ran out of memory in chunks of 64 at step 40; retrying in chunks of 32"
            ),
            (
                Level::Info,
                "validation at step 40: 12 batches of 64 in chunks of 32 · peak 71% (2.13 GiB) · 1 OOM · 2.3 s"
            ),
        ]
    );
    let p = &app.policy;
    assert_eq!(p.ooms, 0, "training's OOMs only");
    assert_eq!(
        p.micro_batch(),
        Some(32),
        "training's micro-batch untouched"
    );
    let marks: Vec<(f64, MarkKind, Level)> =
        p.marks.iter().map(|m| (m.t, m.kind, m.level)).collect();
    assert_eq!(marks, vec![(12.0, MarkKind::EvalOom, Level::Warn)]);
    assert_eq!(
        p.last_decision, None,
        "training's last decision stays training's"
    );
    assert_eq!(app.eval.last, Some(eval_pass(40, 1)));
    assert_eq!(app.eval.failed, None);

    // Not even one sample fits: the evaluation fails, and the panel says so.
    app.set_elapsed(20.0);
    for msg in eval_oom_sequence(50, 1, None) {
        app.apply(&msg);
    }
    assert_eq!(
        app.events.len(),
        3,
        "the decision repeats the OOM: one entry"
    );
    assert_eq!(
        (app.events[0].level, app.events[0].text.as_str()),
        (
            Level::Error,
            "validation ran out of memory at step 50; one sample does not fit: the evaluation fails"
        )
    );
    assert_eq!(app.policy.marks.back().map(|m| m.level), Some(Level::Error));
    assert_eq!(app.eval.failed.as_ref().map(|f| f.step), Some(50));
}

#[test]
fn step_memory_feeds_the_gauge_and_both_usage_histories() {
    let mut app = App::new("t", false);
    let limit = 4u64 << 30;
    for n in 1..=5u64 {
        app.set_elapsed(n as f64);
        app.apply(&Telemetry::StepMemory(StepMemory {
            step: n,
            micro_batch: 8,
            seq_len: 64,
            peak_bytes: limit / 2,
            // No prediction until the model has two sizes.
            predicted_bytes: (n > 2).then_some(limit / 4),
            limit_bytes: limit,
            configured_limit_bytes: limit,
            usage: 0.5,
        }));
    }
    let p = &app.policy;
    assert_eq!(p.limit_bytes(), Some(limit));
    assert_eq!(p.peak_usage.points().len(), 5);
    assert_eq!(
        p.predicted_usage.points(),
        vec![(3.0, 0.25), (4.0, 0.25), (5.0, 0.25)]
    );
    assert_eq!(p.last_memory.as_ref().map(|m| m.step), Some(5));
    assert!(app.events.is_empty(), "step peaks are charted, not logged");
}

#[test]
fn thresholds_in_force_are_the_confirmed_ones_with_their_source() {
    let mut app = App::new("t", false);
    assert_eq!(app.policy.thresholds, None);
    app.apply(&Telemetry::ThresholdsChanged {
        thresholds: Thresholds::default(),
        profile: Some(Profile::Balanced),
        source: "config".into(),
    });
    assert_eq!(
        app.events[0].text,
        "thresholds 0.90,0.92,0.95,0.97 (balanced) in force, from config"
    );
    // A command the trainer refused changes nothing but the log.
    app.apply(&Telemetry::CommandApplied {
        command: Command::SetProfile {
            profile: Profile::Aggressive,
        },
        applied: "refused: not now; 0.90,0.92,0.95,0.97 stay in force".into(),
    });
    assert_eq!(app.policy.thresholds, Some(Thresholds::default()));
    assert_eq!(app.policy.profile, Some(Profile::Balanced));
    assert_eq!(app.events[0].level, Level::Warn);
    assert!(app.policy.marks.is_empty());
}

fn texts(app: &App) -> Vec<&str> {
    app.events.iter().map(|e| e.text.as_str()).collect()
}

/// A command the trainer confirms right after reporting its effect is one happening: one
/// line, not a `status: paused` beside a `paused after step 8`.
#[test]
fn a_command_and_its_effect_make_one_line() {
    use headroom_core::policy::Decision;
    let mut app = App::new("t", false);
    app.set_elapsed(1.0);
    app.apply(&Telemetry::Status {
        status: RunStatus::Paused,
    });
    app.apply(&Telemetry::CommandApplied {
        command: Command::Pause,
        applied: "paused after step 8".into(),
    });
    assert_eq!(texts(&app), vec!["paused after step 8"]);

    app.set_elapsed(2.0);
    app.apply(&Telemetry::ThresholdsChanged {
        thresholds: Profile::Conservative.thresholds(),
        profile: Some(Profile::Conservative),
        source: "command".into(),
    });
    app.apply(&Telemetry::CommandApplied {
        command: Command::SetProfile {
            profile: Profile::Conservative,
        },
        applied: "profile conservative: thresholds 0.85,0.88,0.92,0.95".into(),
    });
    assert_eq!(
        texts(&app)[0],
        "thresholds 0.85,0.88,0.92,0.95 (conservative) in force, from command"
    );
    assert_eq!(app.events.len(), 2);

    app.set_elapsed(3.0);
    app.apply(&Telemetry::Decision {
        step: 9,
        decision: Decision::Resize {
            from: 16,
            to: 8,
            reason: ResizeReason::Pinned,
            usage: 0.5,
            predicted: Some(0.4),
        },
    });
    app.apply(&Telemetry::CommandApplied {
        command: Command::PinMicroBatch { micro_batch: 8 },
        applied: "micro-batch pinned at 8, 4 accumulation steps".into(),
    });
    assert_eq!(
        texts(&app)[0],
        "step 9: micro-batch pinned at 8, 4 accumulation steps (was 16, predicted 40%)"
    );
    assert_eq!(app.events.len(), 3);

    app.set_elapsed(4.0);
    app.apply(&Telemetry::Decision {
        step: 9,
        decision: Decision::EmptyCache { usage: 0.5 },
    });
    app.apply(&Telemetry::CommandApplied {
        command: Command::FreeCache,
        applied: "cached memory freed: RSS 1.20 GiB → 800 MiB".into(),
    });
    assert_eq!(
        texts(&app)[0],
        "step 9: cached memory freed: RSS 1.20 GiB → 800 MiB"
    );
    assert_eq!(app.events.len(), 4);

    // A confirmation in a later frame, or a second one, is its own line.
    app.set_elapsed(5.0);
    app.apply(&Telemetry::CommandApplied {
        command: Command::FreeCache,
        applied: "cached memory freed: RSS 800 MiB → 800 MiB".into(),
    });
    assert_eq!(app.events.len(), 5);
}

/// The controller's warning names its step; the log line says it once.
#[test]
fn a_warning_naming_its_step_is_logged_with_one_prefix() {
    use headroom_core::policy::Decision;
    let mut app = App::new("t", false);
    app.apply(&Telemetry::Decision {
        step: 58,
        decision: Decision::Warning {
            usage: 0.96,
            forecast: false,
            text: "step 58: usage stayed at 96%".into(),
        },
    });
    assert_eq!(texts(&app), vec!["step 58: usage stayed at 96%"]);
}

/// A stopping run takes no more commands: its keys do nothing (and the footer does not
/// offer them), but a second q still quits.
#[test]
fn a_stopping_run_takes_no_commands() {
    let mut app = App::new("t", false);
    app.apply(&step(3, 8, 1));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    assert_eq!(app.handle(Action::Quit), Reaction::Send(Command::Stop));
    for action in [
        Action::Checkpoint,
        Action::TogglePause,
        Action::FreeCache,
        Action::TogglePin,
        Action::DoubleBatch,
        Action::CycleProfile,
        Action::EditThresholds,
    ] {
        assert_eq!(app.handle(action), Reaction::Nothing, "{action:?}");
    }
    assert!(app.editor.is_none());
    assert_eq!(app.handle(Action::Quit), Reaction::Exit);
}

/// One numbering: an OOM in step 6 and the decisions it forced all read "step 6", in the
/// log and on the training panel's headline.
#[test]
fn an_oom_and_its_decisions_share_the_steps_number() {
    let mut app = App::new("t", false);
    for msg in oom_sequence(6) {
        app.apply(&msg);
    }
    assert!(
        texts(&app).iter().all(|t| t.starts_with("step 6: ")),
        "{:?}",
        texts(&app)
    );
    let (step, d) = app.policy.last_decision.clone().unwrap();
    assert_eq!(
        headroom_ui::describe::decision_headline(step, &d),
        "step 6: 32 → 16 (oom)"
    );
}

/// While paused there is no pace: the ETA is not extrapolated from the last step.
#[test]
fn a_paused_run_has_no_eta() {
    let mut app = App::new("t", false);
    app.apply(&step(10, 16, 2));
    assert_eq!(app.progress_line(), "step 10/100 (10%)  ETA 45s");
    app.apply(&Telemetry::Status {
        status: RunStatus::Paused,
    });
    assert_eq!(app.progress_line(), "step 10/100 (10%)  ETA --");
}

mod feed_time_and_modes {
    use headroom_core::{HostStats, Record, RunStatus, SystemSample, Telemetry};
    use headroom_ui::app::{App, Focus, Reaction, Window};
    use headroom_ui::keys::Action;
    use headroom_ui::mode::LinkView;
    use headroom_ui::{Link, Mode};

    fn sample(rss: u64) -> Telemetry {
        Telemetry::Sample(SystemSample {
            host: HostStats {
                process_rss: rss,
                mem_total: 1 << 30,
                ..Default::default()
            },
            ..Default::default()
        })
    }

    /// A catch-up arrives in one burst; its points still land where the run lived them,
    /// not all at the moment they arrived.
    #[test]
    fn a_burst_of_records_spreads_over_the_chart_by_their_own_time() {
        let mut app = App::new("t", false);
        for i in 0..=100u64 {
            app.apply_record(&Record::new(0.0, i as f64, sample(1000 + i)));
        }
        let xs: Vec<f64> = app.memory.points().iter().map(|p| p.0).collect();
        assert_eq!(xs.first(), Some(&0.0));
        assert_eq!(xs.last(), Some(&100.0));
        assert!(
            xs.len() > 50 && xs.windows(2).all(|w| w[0] < w[1]),
            "{xs:?}"
        );
        assert_eq!(app.run_t, Some(100.0));
        // The header's clock is the loop's to set, never read here.
        assert_eq!(app.elapsed, 0.0);
    }

    #[test]
    fn log_entries_carry_the_runs_time() {
        let mut app = App::new("t", false);
        app.apply_record(&Record::new(
            0.0,
            42.0,
            Telemetry::Status {
                status: RunStatus::Running,
            },
        ));
        assert_eq!(app.events[0].t, 42.0);
    }

    fn attached() -> App {
        App::new("t", false).with_mode(Mode::Attached {
            address: "sock".into(),
        })
    }

    #[test]
    fn attached_q_detaches_and_sends_nothing() {
        let mut app = attached();
        app.apply(&Telemetry::Status {
            status: RunStatus::Running,
        });
        assert_eq!(app.handle(Action::Quit), Reaction::Detach);
        assert!(!app.stop_requested);
    }

    #[test]
    fn attached_stop_asks_and_only_yes_sends_it() {
        let mut app = attached();
        app.apply(&Telemetry::Status {
            status: RunStatus::Running,
        });
        assert_eq!(app.handle(Action::StopRun), Reaction::Nothing);
        assert!(app.confirm_stop);
        assert_eq!(app.handle(Action::Confirm(false)), Reaction::Nothing);
        assert!(!app.confirm_stop && !app.stop_requested);
        app.handle(Action::StopRun);
        assert_eq!(
            app.handle(Action::Confirm(true)),
            Reaction::Send(headroom_core::Command::Stop)
        );
        assert!(app.stop_requested);
        // Still a viewer: q leaves, it does not quit the run a second time.
        assert_eq!(app.handle(Action::Quit), Reaction::Detach);
    }

    #[test]
    fn a_reconnect_starts_the_run_afresh_but_keeps_the_users_view() {
        let mut app = attached();
        app.handle(Action::CycleWindow);
        app.handle(Action::FocusNext);
        let (window, focus) = (app.window, app.focus);
        assert_ne!((window, focus), (Window::FiveMinutes, Focus::Events));
        app.apply_record(&Record::new(0.0, 7.0, sample(5)));
        app.apply_link(&Link::Lost {
            reason: "gone".into(),
        });
        assert!(!app.takes_commands(), "no commands into a lost link");
        assert!(matches!(app.link, LinkView::Lost { .. }));
        assert!(app.sample.is_some(), "the last picture stays while lost");
        app.apply_link(&Link::Connected {
            run_id: "r-2".into(),
        });
        assert!(app.link.is_up());
        assert!(app.sample.is_none() && app.memory.is_empty() && app.run_t.is_none());
        assert_eq!((app.window, app.focus), (window, focus));
        assert!(app.mode.is_attached());
    }

    #[test]
    fn a_replay_sends_no_commands_and_says_so_once() {
        let mut app = App::new("t", false).with_mode(Mode::Replay {
            source: "log".into(),
        });
        app.apply(&Telemetry::Status {
            status: RunStatus::Running,
        });
        for action in [Action::Checkpoint, Action::FreeCache, Action::TogglePause] {
            assert_eq!(app.handle(action), Reaction::Nothing);
        }
        let said = app
            .events
            .iter()
            .filter(|e| e.text.contains("commands are disabled in a replay"))
            .count();
        assert_eq!(said, 1);
        assert!(app.editor.is_none());
        assert_eq!(app.handle(Action::EditThresholds), Reaction::Nothing);
        assert!(app.editor.is_none());
    }
}

/// `m` and `a` flip the built-in trainer's levers from what the run reported: the run's
/// config at the start, then each confirmed switch. A run that reports neither a config
/// nor levers (a Python run that keeps its own) has none here: the keys say so and send
/// nothing.
#[test]
fn lever_keys_flip_from_the_confirmed_settings() {
    use headroom_core::{Checkpointing, Precision};
    let started = |config: Option<RunConfig>| {
        let mut app = App::new("t", false);
        app.apply(&Telemetry::RunStarted(RunInfo {
            run_name: "r".into(),
            parameters: 1,
            total_steps: 100,
            corpus: "c".into(),
            train_bytes: 1,
            val_bytes: 1,
            config,
            ..run_info("cpu", "cpu")
        }));
        app.apply(&Telemetry::Status {
            status: RunStatus::Running,
        });
        app
    };
    let mut app = started(Some(RunConfig::default()));
    let bf16 = Command::SetPrecision {
        precision: Precision::Bf16,
    };
    assert_eq!(
        app.handle(Action::TogglePrecision),
        Reaction::Send(bf16.clone())
    );
    let blocks = Command::SetCheckpointing {
        checkpoint: Checkpointing::Blocks,
    };
    assert_eq!(
        app.handle(Action::ToggleCheckpointing),
        Reaction::Send(blocks.clone())
    );
    // Unconfirmed, nothing changed: the same command again.
    assert_eq!(
        app.handle(Action::TogglePrecision),
        Reaction::Send(bf16.clone())
    );
    app.apply(&Telemetry::CommandApplied {
        command: bf16,
        applied: "precision fp32 → bf16 from step 4".into(),
    });
    app.apply(&Telemetry::CommandApplied {
        command: blocks,
        applied: "activation checkpointing none → blocks from step 4".into(),
    });
    assert_eq!(
        app.handle(Action::TogglePrecision),
        Reaction::Send(Command::SetPrecision {
            precision: Precision::Fp32
        })
    );
    assert_eq!(
        app.handle(Action::ToggleCheckpointing),
        Reaction::Send(Command::SetCheckpointing {
            checkpoint: Checkpointing::None
        })
    );
    assert!(app
        .events
        .iter()
        .any(|e| e.text == "precision fp32 → bf16 from step 4"));

    let mut python = started(None);
    assert_eq!(python.handle(Action::TogglePrecision), Reaction::Nothing);
    assert!(
        python.events[0].text.contains("its script's"),
        "{:?}",
        python.events[0]
    );
}

#[test]
fn a_python_run_that_hands_over_a_lever_gets_its_key_and_keeps_the_other() {
    use headroom_core::{Checkpointing, RunLevers};
    let mut app = App::new("py", false);
    app.apply(&Telemetry::RunStarted(RunInfo {
        levers: Some(RunLevers {
            precision: None,
            checkpointing: Some(Checkpointing::None),
            half: None,
        }),
        ..run_info("cpu", "cpu")
    }));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    let blocks = Command::SetCheckpointing {
        checkpoint: Checkpointing::Blocks,
    };
    assert_eq!(
        app.handle(Action::ToggleCheckpointing),
        Reaction::Send(blocks.clone())
    );
    app.apply(&Telemetry::CommandApplied {
        command: blocks,
        applied: "activation checkpointing none → blocks from step 4".into(),
    });
    // Confirmed: the key now turns it off.
    assert_eq!(
        app.handle(Action::ToggleCheckpointing),
        Reaction::Send(Command::SetCheckpointing {
            checkpoint: Checkpointing::None
        })
    );
    assert_eq!(app.handle(Action::TogglePrecision), Reaction::Nothing);
    assert!(
        app.events
            .iter()
            .any(|e| e.text.contains("precision is its script's") && e.text.contains("precision=")),
        "{:?}",
        app.events
    );
}

#[test]
fn m_goes_to_the_runs_own_half_precision_and_back() {
    use headroom_core::{Precision, RunLevers};
    let mut app = App::new("py", false);
    app.apply(&Telemetry::RunStarted(RunInfo {
        levers: Some(RunLevers {
            precision: Some(Precision::Fp32),
            checkpointing: None,
            half: Some(Precision::Fp16),
        }),
        ..run_info("cpu", "cpu")
    }));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    let fp16 = Command::SetPrecision {
        precision: Precision::Fp16,
    };
    assert_eq!(
        app.handle(Action::TogglePrecision),
        Reaction::Send(fp16.clone())
    );
    app.apply(&Telemetry::CommandApplied {
        command: fp16,
        applied: "precision fp32 → fp16 from step 4".into(),
    });
    assert_eq!(
        app.handle(Action::TogglePrecision),
        Reaction::Send(Command::SetPrecision {
            precision: Precision::Fp32
        })
    );
}
