use headroom_core::journal::Journaled;
use headroom_core::policy::{ControllerConfig, Decision, Profile, ResizeReason, Thresholds};
use headroom_core::{Bus, BusReceivers, Checkpointing, Command, Precision, RunStatus, Telemetry};

use super::*;

fn session(driver: Driver, adaptive: bool) -> (Session, BusReceivers) {
    let (bus, rx) = Bus::new(false);
    let mut s = Session::new(bus, driver, Thresholds::default(), 32, 100);
    if adaptive {
        let cfg = ControllerConfig {
            min_micro_batch: 1,
            max_micro_batch: 32,
            max_seq_len: 64,
            ..ControllerConfig::default()
        };
        s.set_controller(Journaled::new(cfg, Thresholds::default(), 1 << 30, 8));
    }
    if !driver.script {
        s.set_levers(Some(Precision::Fp32), Some(Checkpointing::None), false);
    }
    (s, rx)
}

/// Everything the session said, in order.
fn said(rx: &BusReceivers) -> Vec<Telemetry> {
    let mut out: Vec<_> = rx.events.try_iter().map(|r| r.msg).collect();
    out.extend(rx.metrics.try_iter().map(|r| r.msg));
    out
}

fn answers(rx: &BusReceivers) -> Vec<String> {
    said(rx)
        .into_iter()
        .filter_map(|m| match m {
            Telemetry::CommandApplied { applied, .. } => Some(applied),
            _ => None,
        })
        .collect()
}

#[test]
fn pause_and_resume_are_answered_once_each_with_the_step() {
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    s.resume_at(7, 0, None);
    for cmd in [
        Command::Pause,
        Command::Pause,
        Command::Resume,
        Command::Resume,
    ] {
        assert_eq!(s.handle(cmd), Handled::Answered);
    }
    assert_eq!(
        answers(&rx),
        [
            "paused after step 7",
            "already paused after step 7",
            "resumed at step 8",
            "already running"
        ]
    );
    assert!(!s.paused());
}

#[test]
fn a_stop_asked_twice_is_one_status_change_and_ends_a_pause() {
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    s.handle(Command::Pause);
    s.handle(Command::Stop);
    s.handle(Command::Stop);
    assert!(s.stop_requested() && !s.paused());
    let stopping = said(&rx)
        .iter()
        .filter(|m| {
            matches!(
                m,
                Telemetry::Status {
                    status: RunStatus::Stopping
                }
            )
        })
        .count();
    assert_eq!(stopping, 1);
    assert!(s.summary(false).stopped_by_user);
}

#[test]
fn a_scripts_stop_says_how_the_loop_learns_it_and_what_is_saved() {
    let (mut s, rx) = session(Driver::script(false), true);
    s.handle(Command::Stop);
    let text = &answers(&rx)[0];
    assert!(text.contains("run.should_stop"), "{text}");
    assert!(text.contains("no checkpoint will be taken"), "{text}");
    let (mut s, rx) = session(Driver::script(true), false);
    s.resume_at(4, 0, None);
    s.signal_stop("SIGTERM");
    let notice = said(&rx)
        .into_iter()
        .find_map(|m| match m {
            Telemetry::Notice(n) => Some(n.text),
            _ => None,
        })
        .unwrap();
    assert!(
        notice.starts_with("SIGTERM: stopping; the checkpoint will be taken at the end"),
        "{notice}"
    );
}

#[test]
fn lever_commands_go_to_a_driver_that_can_switch_and_are_refused_by_one_that_cannot() {
    let cmd = Command::SetPrecision {
        precision: Precision::Bf16,
    };
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    assert_eq!(s.handle(cmd.clone()), Handled::Driver(cmd.clone()));
    assert!(answers(&rx).is_empty());
    // A switch to what is in force is answered without the driver.
    s.switched_precision(Precision::Fp32, Precision::Bf16, "command");
    assert_eq!(s.handle(cmd.clone()), Handled::Answered);
    assert_eq!(answers(&rx), ["precision is already bf16"]);
    let (mut s, rx) = session(Driver::script(true), true);
    assert_eq!(s.handle(cmd), Handled::Answered);
    let ck = Command::SetCheckpointing {
        checkpoint: Checkpointing::Blocks,
    };
    assert_eq!(s.handle(ck), Handled::Answered);
    let a = answers(&rx);
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|t| t.starts_with("refused:")), "{a:?}");
    // What only a driver can do is handed back whatever it is.
    assert_eq!(
        s.handle(Command::Checkpoint),
        Handled::Driver(Command::Checkpoint)
    );
    assert_eq!(
        s.handle(Command::FreeCache),
        Handled::Driver(Command::FreeCache)
    );
}

#[test]
fn a_half_precision_that_is_not_the_runs_is_refused_and_its_own_goes_to_the_driver() {
    let fp16 = Command::SetPrecision {
        precision: Precision::Fp16,
    };
    // The built-in trainer's half is bf16: it has no loss scaler for fp16.
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    assert_eq!(s.handle(fp16.clone()), Handled::Answered);
    let [answer] = &answers(&rx)[..] else {
        panic!("one answer")
    };
    assert!(
        answer.starts_with("refused: this run switches between fp32 and bf16, not fp16"),
        "{answer}"
    );
    // A run that scales its loss names fp16 as its half: fp16 goes to it, bf16 does not.
    let (mut s, rx) = session(Driver::script(true), true);
    s.set_levers(Some(Precision::Fp32), None, true);
    s.set_half_precision(Precision::Fp16);
    assert_eq!(s.handle(fp16.clone()), Handled::Driver(fp16));
    let bf16 = Command::SetPrecision {
        precision: Precision::Bf16,
    };
    assert_eq!(s.handle(bf16), Handled::Answered);
    assert!(answers(&rx)[0].contains("between fp32 and fp16, not bf16"));
    s.run_started(RunInfo {
        run_name: "r".into(),
        device: "cpu".into(),
        device_name: "cpu".into(),
        parameters: 1,
        start_step: 0,
        total_steps: 10,
        corpus: String::new(),
        train_bytes: 0,
        val_bytes: 0,
        config: None,
        checkpoints: None,
        levers: None,
    });
    let levers = said(&rx).into_iter().find_map(|m| match m {
        Telemetry::RunStarted(info) => info.levers,
        _ => None,
    });
    assert_eq!(levers.and_then(|l| l.half), Some(Precision::Fp16));
}

#[test]
fn thresholds_carry_their_profile_given_by_name_or_by_value_and_a_bad_set_is_refused() {
    let profile_said = |rx: &BusReceivers| {
        said(rx)
            .into_iter()
            .filter_map(|m| match m {
                Telemetry::ThresholdsChanged { profile, .. } => Some(profile),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    for adaptive in [false, true] {
        let (mut s, rx) = session(Driver::script(false), adaptive);
        s.thresholds_changed("config", None);
        s.handle(Command::SetProfile {
            profile: Profile::Conservative,
        });
        s.handle(Command::SetThresholds {
            thresholds: Profile::Aggressive.thresholds(),
        });
        let custom = Thresholds::new(0.8, 0.85, 0.9, 0.95).unwrap();
        s.handle(Command::SetThresholds { thresholds: custom });
        assert_eq!(
            profile_said(&rx),
            [
                Some(Profile::Balanced),
                Some(Profile::Conservative),
                Some(Profile::Aggressive),
                None
            ],
            "adaptive {adaptive}"
        );
        let mut bad = custom;
        bad.target = 0.99;
        s.handle(Command::SetThresholds { thresholds: bad });
        let last = answers(&rx).pop().unwrap();
        assert!(
            last.starts_with("refused:") && last.ends_with("0.80,0.85,0.90,0.95 stay in force"),
            "{last}"
        );
        assert_eq!(s.thresholds(), custom);
    }
}

#[test]
fn pinning_is_refused_without_a_controller_and_clamped_with_one() {
    let (mut s, rx) = session(Driver::script(false), false);
    s.handle(Command::PinMicroBatch { micro_batch: 4 });
    s.handle(Command::Unpin);
    assert!(answers(&rx).iter().all(|a| a.starts_with("refused:")));
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    s.handle(Command::PinMicroBatch { micro_batch: 64 });
    s.handle(Command::Unpin);
    assert_eq!(
        answers(&rx),
        [
            "micro-batch pinned at 32 (64 is outside the allowed range), 1 accumulation steps",
            "micro-batch unpinned; the controller resizes again"
        ]
    );
    assert_eq!(s.micro_batch(), Some(32));
}

#[test]
fn a_lever_switch_is_measured_at_the_next_step_against_the_last() {
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    let m = |step, peak| Measured {
        step,
        peak_bytes: peak,
        micro_batch: 8,
        seq_len: 64,
    };
    assert!(!s.measured(m(3, 300 << 20)));
    s.resume_at(3, 0, None);
    assert_eq!(
        s.switched_precision(Precision::Fp32, Precision::Bf16, "command"),
        "precision fp32 → bf16 from step 4"
    );
    s.switched_checkpointing(Checkpointing::None, Checkpointing::Blocks, "command");
    assert!(s.measured(m(4, 200 << 20)));
    let lever = said(&rx)
        .into_iter()
        .find_map(|m| match m {
            Telemetry::Decision {
                step,
                decision:
                    Decision::Lever {
                        change,
                        freed_bytes,
                        ..
                    },
            } => Some((step, change, freed_bytes)),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        lever,
        (
            4,
            "precision fp32 → bf16, activation checkpointing none → blocks".to_string(),
            Some(100 << 20)
        )
    );
}

#[test]
fn a_step_peak_is_kept_for_the_summary_and_a_watch_only_run_has_no_controller_to_ask() {
    let (mut s, _rx) = session(Driver::script(false), false);
    let peak = StepPeak {
        step: 1,
        micro_batch: 4,
        seq_len: 64,
        peak_bytes: 600,
        predicted_bytes: None,
        limit_bytes: 1000,
        configured_limit_bytes: 1000,
    };
    s.step_memory(peak);
    s.step_memory(StepPeak {
        peak_bytes: 500,
        ..peak
    });
    assert_eq!(s.observe(peak), None);
    assert_eq!(s.oom(1, 4, 64, "out of memory"), None);
    assert_eq!(s.last_memory(), (1000, 0.5));
    let summary = s.summary(false);
    assert_eq!(summary.memory.peak_bytes, Some(600));
    assert_eq!(summary.memory.final_micro_batch, 0);
}

#[test]
fn an_oom_is_counted_said_and_answered_with_a_smaller_retry() {
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    let after = s.oom(1, 8, 64, "CUDA out of memory\nmore").unwrap();
    assert!(after.retry_with.is_some_and(|n| n < 8), "{after:?}");
    assert_eq!(s.ooms(), 1);
    let error = said(&rx)
        .into_iter()
        .find_map(|m| match m {
            Telemetry::Oom { error, .. } => Some(error),
            _ => None,
        })
        .unwrap();
    assert_eq!(error, "CUDA out of memory");
}

#[test]
fn out_of_sizes_a_checkpointing_lever_is_the_last_resort_once() {
    let (mut s, rx) = session(Driver::script(true), true);
    let give_up = |s: &mut Session| loop {
        let after = s.oom(1, 1, 64, "out of memory").unwrap();
        if after.retry_with.is_none() || after.switch_checkpointing {
            break after;
        }
    };
    // Without the lever: the controller's give-up stands.
    assert_eq!(give_up(&mut s).retry_with, None);
    let (mut s, _rx2) = session(Driver::script(true), true);
    s.set_levers(None, Some(Checkpointing::None), true);
    let after = give_up(&mut s);
    assert_eq!(
        (after.retry_with, after.switch_checkpointing),
        (Some(1), true)
    );
    s.switched_checkpointing(Checkpointing::None, Checkpointing::Blocks, "controller");
    // With it on, nothing is left: the next give-up is final.
    assert_eq!(give_up(&mut s).retry_with, None);
    drop(rx);
}

/// Evaluation as its own phase: each batch's chunk size from the controller, a chunk's
/// out-of-memory error answered with a smaller size for its samples and said (an
/// `eval_oom` record, an `eval_size` decision), the size kept for the next batch and the
/// next pass, one `eval_memory` record per pass; training's micro-batch untouched.
#[test]
fn an_evaluation_pass_splits_after_an_oom_keeps_the_size_and_says_so() {
    const GIB: u64 = 1 << 30;
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    s.resume_at(10, 0, None);
    let micro = s.micro_batch();
    s.eval_begin("validation");
    assert!(s.evaluating());
    // As asked until something bounds it.
    assert_eq!(s.eval_size(8, 64), 8);
    s.eval_chunk(8, 64, 100 << 20, GIB);
    assert_eq!(s.eval_size(8, 64), 8);
    assert_eq!(s.eval_oom(8, 64, "CUDA out of memory\nmore"), Some(4));
    s.eval_chunk(4, 64, 60 << 20, GIB);
    s.eval_chunk(4, 64, 70 << 20, GIB);
    let first = s.eval_end().unwrap();
    assert!(!s.evaluating());
    assert_eq!(
        (
            first.step,
            first.phase.as_str(),
            first.batches,
            first.samples
        ),
        (10, "validation", 2, 16)
    );
    assert_eq!((first.asked, first.size, first.seq_len), (8, 4, 64));
    assert_eq!(
        (first.chunks, first.ooms),
        (4, 1),
        "the failed chunk counts"
    );
    assert_eq!((first.peak_bytes, first.limit_bytes), (100 << 20, GIB));
    assert!(
        (first.usage - 100.0 / 1024.0).abs() < 1e-12,
        "{}",
        first.usage
    );
    // The next pass starts at the size learned (no second decision), and a smaller last
    // batch under the ceiling runs whole.
    s.eval_begin("validation");
    assert_eq!(s.eval_size(8, 64), 4);
    s.eval_chunk(4, 64, 65 << 20, GIB);
    s.eval_chunk(4, 64, 65 << 20, GIB);
    assert_eq!(s.eval_size(3, 64), 3);
    s.eval_chunk(3, 64, 55 << 20, GIB);
    let next = s.eval_end().unwrap();
    assert_eq!(
        (next.asked, next.size, next.chunks, next.ooms, next.samples),
        (8, 3, 3, 0, 11)
    );
    // One sample that does not fit: no retry; the driver fails the evaluation.
    s.eval_begin("test");
    assert_eq!(s.eval_size(1, 4096), 1);
    assert_eq!(s.eval_oom(1, 4096, "out of memory"), None);
    assert_eq!(s.eval_end().unwrap().ooms, 1);
    // A pass that ran no batch says nothing.
    s.eval_begin("predict");
    assert_eq!(s.eval_end(), None);
    assert_eq!(
        s.micro_batch(),
        micro,
        "training's micro-batch is not evaluation's"
    );

    let said = said(&rx);
    let ooms: Vec<_> = said
        .iter()
        .filter_map(|m| match m {
            Telemetry::EvalOom {
                step,
                phase,
                size,
                seq_len,
                retry_with,
                error,
            } => Some((
                *step,
                phase.as_str(),
                *size,
                *seq_len,
                *retry_with,
                error.as_str(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        ooms,
        [
            (10, "validation", 8, 64, Some(4), "CUDA out of memory"),
            (10, "test", 1, 4096, None, "out of memory"),
        ]
    );
    let decisions: Vec<_> = said
        .iter()
        .filter_map(|m| match m {
            Telemetry::Decision {
                step,
                decision:
                    Decision::EvalSize {
                        from, to, reason, ..
                    },
            } => Some((*step, *from, *to, *reason)),
            _ => None,
        })
        .collect();
    assert_eq!(
        decisions,
        [(10, 8, 4, ResizeReason::Oom), (10, 1, 1, ResizeReason::Oom)]
    );
    let passes = said
        .iter()
        .filter(|m| matches!(m, Telemetry::EvalMemory(_)))
        .count();
    assert_eq!(passes, 3);
    assert!(
        !said.iter().any(|m| matches!(m, Telemetry::Oom { .. })),
        "not a step's OOM"
    );
    assert_eq!(s.ooms(), 0, "the run's OOM count is its steps'");
}

/// Without a controller (a watch-only script): as asked, halved after an OOM, no decision.
#[test]
fn a_watch_only_evaluation_runs_as_asked_and_halves_after_an_oom() {
    let (mut s, rx) = session(Driver::script(false), false);
    assert_eq!(s.eval_size(6, 1), 6);
    assert!(s.evaluating(), "a size asked for opens a pass");
    assert_eq!(s.eval_oom(6, 1, "out of memory"), Some(3));
    assert_eq!(s.eval_oom(1, 1, "out of memory"), None);
    let pass = s.eval_end().unwrap();
    assert_eq!((pass.phase.as_str(), pass.size, pass.ooms), ("eval", 3, 2));
    assert!(!said(&rx)
        .iter()
        .any(|m| matches!(m, Telemetry::Decision { .. })));
}

fn splits(rx: &BusReceivers) -> Vec<PlanSplit> {
    said(rx)
        .into_iter()
        .filter_map(|m| match m {
            Telemetry::PlanSplit(p) => Some(p),
            _ => None,
        })
        .collect()
}

/// Two sizes of `fixed` + `per_token` × tokens, observed by an adaptive session (the
/// controller does not fit a run's first step).
fn two_sizes(s: &mut Session, fixed: u64, per_token: u64) {
    for (step, mb) in [(1, 4), (2, 4), (3, 8)] {
        s.observe(StepPeak {
            step,
            micro_batch: mb,
            seq_len: 64,
            peak_bytes: fixed + per_token * (mb as u64 * 64),
            predicted_bytes: None,
            limit_bytes: 1 << 30,
            configured_limit_bytes: 1 << 30,
        });
    }
}

#[test]
fn without_a_plan_the_memory_panels_split_comes_from_the_measured_steps() {
    let parts = MemoryParts {
        parameters: 10 << 20,
        gradients: 10 << 20,
        optimizer: 20 << 20,
    };
    let (mut s, rx) = session(Driver::script(false), true);
    s.memory_parts(parts);
    assert!(splits(&rx).is_empty(), "no fit yet");
    two_sizes(&mut s, 100 << 20, 4096);
    let got = splits(&rx);
    assert_eq!(got.len(), 1, "once");
    assert_eq!(got[0].model_bytes, 40 << 20);
    assert_eq!(got[0].overhead_bytes, 60 << 20);
    assert!(
        (got[0].activations_per_token - 4096.0).abs() < 1.0,
        "{got:?}"
    );
    // A lever switch: the split of the new state, once refitted.
    s.switched_checkpointing(Checkpointing::None, Checkpointing::Blocks, "command");
    two_sizes(&mut s, 100 << 20, 4096);
    assert_eq!(splits(&rx).len(), 1);

    // A driver's plan stands: no measured split over it.
    let (mut s, rx) = session(Driver::BUILT_IN, true);
    s.plan_split(PlanSplit {
        model_bytes: 1,
        overhead_bytes: 2,
        activations_per_token: 3.0,
    });
    s.memory_parts(parts);
    two_sizes(&mut s, 100 << 20, 4096);
    assert_eq!(splits(&rx).len(), 1);
}
