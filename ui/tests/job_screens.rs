//! A torchrun job on screen: the rows rank 0 gathers for every rank, drawn with
//! ratatui's TestBackend, and the selection of a rank driven by keys. A diff here is a
//! visible change to what users see: review it.
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use headroom_core::{
    HostStats, JobRanks, RankRow, RunInfo, RunStatus, StepMemory, StepMetrics, SystemSample,
    Telemetry,
};
use headroom_ui::app::{App, Reaction};
use headroom_ui::keys::action_for;
use headroom_ui::{Link, Mode};

mod support;
use support::{run_info, screen};

const GIB: u64 = 1 << 30;

/// Rank `rank` of a job at step 40: ranks differ in memory (rank 1's budget is the
/// tightest) and pace (the last rank is the slowest).
fn rank_row(rank: u32, world: u32) -> RankRow {
    let limit = if rank == 1 { 3 * GIB } else { 6 * GIB };
    let micro = if rank == 1 { 6 } else { 16 };
    let usage = if rank == 1 {
        0.874
    } else {
        0.71 + rank as f64 * 0.01
    };
    RankRow {
        rank,
        host: format!("node-{}", rank / 2),
        step: 40,
        micro_batch: micro,
        peak_bytes: (usage * limit as f64) as u64,
        limit_bytes: limit,
        usage,
        ooms: u64::from(rank == 1),
        step_time_s: 0.410 + if rank == world - 1 { 0.05 } else { 0.0 } + rank as f64 * 0.002,
        loss: Some(2.40 + rank as f64 * 0.02),
        status: RunStatus::Running,
        commands_applied: 2,
    }
}

fn job_rows(world: u32) -> JobRanks {
    JobRanks {
        job: "4f2a9c".into(),
        step: 40,
        world_size: world,
        uniform_micro_batch: false,
        agree_us: 142.0,
        ranks: (0..world).map(|r| rank_row(r, world)).collect(),
    }
}

/// Rank `rank`'s own stream at step 40, then rank 0's rows.
fn attached_job(rank: u32, rows: JobRanks) -> App {
    let name = format!("ddp.4f2a9c.rank{rank}");
    let mut app = App::new(&name, false).with_mode(Mode::Attached {
        address: format!("/run/user/1000/headroom/{name}-4242.sock"),
    });
    app.apply(&Telemetry::RunStarted(RunInfo {
        run_name: name.clone(),
        parameters: 10_770_000,
        total_steps: 500,
        corpus: String::new(),
        train_bytes: 0,
        val_bytes: 0,
        config: None,
        ..run_info("cpu", "cpu")
    }));
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    let own = rows.ranks[rank as usize].clone();
    for n in 1..=40 {
        app.set_elapsed(n as f64 * 0.4);
        app.apply(&Telemetry::StepMemory(StepMemory {
            step: n,
            micro_batch: own.micro_batch,
            seq_len: 256,
            peak_bytes: own.peak_bytes,
            predicted_bytes: None,
            limit_bytes: own.limit_bytes,
            configured_limit_bytes: own.limit_bytes,
            usage: own.usage,
        }));
        app.apply(&Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 500,
            loss: 4.0 - n as f64 * 0.04,
            lr: Some(6e-4),
            grad_norm: None,
            step_time_s: own.step_time_s,
            tokens_per_s: 20_000.0,
            samples_per_s: 78.0,
            micro_batch: own.micro_batch,
            accum_steps: 32usize.div_ceil(own.micro_batch),
            effective_batch: 32,
            seq_len: 256,
            tokens_seen: n * 8192,
        }));
        if n % 5 == 0 {
            app.apply(&Telemetry::Sample(SystemSample {
                host: HostStats {
                    cpu_percent: 180.0,
                    mem_used: 20 * GIB,
                    mem_total: 64 * GIB,
                    mem_available: 40 * GIB,
                    process_rss: own.peak_bytes,
                },
                gpu: None,
                allocator: None,
                heap: None,
            }));
        }
    }
    app.apply(&Telemetry::JobRanks(rows));
    app
}

fn press(app: &mut App, code: KeyCode) -> Reaction {
    let key = KeyEvent::new(code, KeyModifiers::NONE);
    match action_for(key, app.key_context()) {
        Some(action) => app.handle(action),
        None => Reaction::Nothing,
    }
}

/// The screen line that holds rank `rank`'s row.
fn row_line(text: &str, rank: u32) -> String {
    text.lines()
        .find(|l| {
            let t = l
                .trim_start_matches('"')
                .trim_start_matches('│')
                .trim_start();
            let t = t.strip_prefix("▶ ").unwrap_or(t).trim_start();
            t.starts_with(&format!("{rank} "))
        })
        .unwrap_or_else(|| panic!("no row for rank {rank}:\n{text}"))
        .to_string()
}

#[test]
fn two_ranks() {
    let app = attached_job(0, job_rows(2));
    let text = screen(&app, 100, 30);
    assert!(
        text.contains("job 4f2a9c · 2 ranks · step 40 · micro-batch per rank · mean loss 2.4100"),
        "{text}"
    );
    let r0 = row_line(&text, 0);
    let r1 = row_line(&text, 1);
    assert!(r0.contains("▶"), "rank 0's panels are shown: {r0}");
    assert!(
        r1.contains("tightest memory") && r1.contains("87.4%"),
        "{r1}"
    );
    assert!(r1.contains("slowest"), "{r1}");
    assert!(text.contains("panels show rank 0"), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn four_ranks() {
    let mut rows = job_rows(4);
    // A pause reached ranks 0-2; rank 3 has not confirmed it yet.
    for r in &mut rows.ranks[..3] {
        r.commands_applied = 3;
        r.status = RunStatus::Paused;
    }
    rows.uniform_micro_batch = false;
    let app = attached_job(0, rows);
    let text = screen(&app, 120, 34);
    assert!(row_line(&text, 3).contains("2/3"), "{text}");
    assert!(row_line(&text, 3).contains("slowest"), "{text}");
    assert!(row_line(&text, 1).contains("tightest memory"), "{text}");
    for r in 0..4 {
        assert!(
            row_line(&text, r).contains(&format!("node-{}", r / 2)),
            "{text}"
        );
    }
    insta::assert_snapshot!(text);
}

#[test]
fn a_failed_rank_and_one_left_behind() {
    let mut rows = job_rows(4);
    rows.step = 57;
    for r in &mut rows.ranks {
        r.step = 57;
    }
    rows.ranks[2].status = RunStatus::Failed;
    rows.ranks[2].step = 55;
    rows.ranks[3].step = 53;
    let app = attached_job(0, rows);
    let text = screen(&app, 100, 30);
    assert!(row_line(&text, 2).contains("failed"), "{text}");
    assert!(row_line(&text, 3).contains("4 steps behind"), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn a_narrow_terminal_keeps_the_ranks_and_drops_the_charts() {
    let app = attached_job(0, job_rows(4));
    let text = screen(&app, 80, 24);
    for r in 0..4 {
        let line = row_line(&text, r);
        assert!(line.contains("running"), "{line}");
    }
    let header = text.lines().find(|l| l.contains("rank step")).unwrap();
    assert!(
        !header.contains("host"),
        "the host column goes first:\n{text}"
    );
    assert!(
        !text.contains("loss (train, val)"),
        "charts dropped:\n{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn more_ranks_than_rows_keep_the_selected_and_the_marked_ones() {
    let mut app = attached_job(0, job_rows(16));
    press(&mut app, KeyCode::Char('9'));
    let text = screen(&app, 100, 30);
    for r in [0, 1, 9, 15] {
        row_line(&text, r);
    }
    assert!(text.contains("more ranks ("), "{text}");
}

#[test]
fn selecting_a_rank_asks_the_client_and_says_where_the_panels_stand() {
    let mut app = attached_job(0, job_rows(4));
    assert_eq!(press(&mut app, KeyCode::Char(']')), Reaction::SelectRank(1));
    assert_eq!(app.job.as_ref().unwrap().selected, 1);
    let text = screen(&app, 100, 30);
    assert!(row_line(&text, 1).contains("▶"), "{text}");
    assert!(
        text.contains("rank 1 selected · switching the panels to it"),
        "{text}"
    );
    assert_eq!(press(&mut app, KeyCode::Char('[')), Reaction::SelectRank(0));
    assert_eq!(
        press(&mut app, KeyCode::Char('[')),
        Reaction::SelectRank(3),
        "wraps"
    );
    assert_eq!(press(&mut app, KeyCode::Char('2')), Reaction::SelectRank(2));
    assert_eq!(press(&mut app, KeyCode::Char('7')), Reaction::Nothing);
    assert!(
        app.events[0].text.contains("no rank 7: the job has 4"),
        "{:?}",
        app.events[0]
    );
    // The client could not reach rank 2's stream: said on the panel, the row stays marked.
    app.apply_link(&Link::RankUnreachable {
        rank: 2,
        reason: "no socket of rank 2 on this machine (it runs on node-1)".into(),
    });
    let text = screen(&app, 120, 34);
    assert!(
        text.contains("rank 2 selected: no socket of rank 2 on this machine (it runs on node-1) · panels show rank 0"),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn switching_the_panels_keeps_the_rows_and_moves_to_the_selected_rank() {
    let mut app = attached_job(0, job_rows(2));
    press(&mut app, KeyCode::Char('1'));
    // The client connected to rank 1: its catch-up starts the run's state afresh.
    app.apply_link(&Link::Connected {
        run_id: "ddp.4f2a9c.rank1-4243-1".into(),
    });
    assert!(app.job.is_some(), "rank 0's rows outlive the switch");
    let switched = attached_job(1, job_rows(2));
    app.apply(&Telemetry::RunStarted(switched.info.clone().unwrap()));
    assert_eq!(app.panels_rank(), Some(1));
    let text = screen(&app, 100, 30);
    assert!(text.contains("panels show rank 1"), "{text}");
    assert!(
        text.contains("attached to the job · rank 1's panels"),
        "the header names the rank shown, not the socket first attached:\n{text}"
    );
    assert!(row_line(&text, 1).contains("▶"), "{text}");
}

#[test]
fn a_lone_run_has_no_job_panel_and_rank_keys_do_nothing() {
    let mut app = attached_job(0, job_rows(2));
    app.job = None;
    let text = screen(&app, 100, 30);
    assert!(!text.contains("ranks"), "{text}");
    assert!(!text.contains("[ ]"), "no rank key offered:\n{text}");
    assert_eq!(press(&mut app, KeyCode::Char(']')), Reaction::Nothing);
    assert_eq!(press(&mut app, KeyCode::Char('1')), Reaction::Nothing);
}

#[test]
fn a_replay_of_one_rank_says_it_cannot_show_another() {
    let mut app = attached_job(0, job_rows(2)).with_mode(Mode::Replay {
        source: "rank0.jsonl".into(),
    });
    assert_eq!(press(&mut app, KeyCode::Char(']')), Reaction::Nothing);
    let job = app.job.as_ref().unwrap();
    assert_eq!(job.selected, 1);
    let (rank, why) = job.unreachable.clone().unwrap();
    assert_eq!(rank, 1);
    assert!(why.contains("rank 0's log only"), "{why}");
}

#[test]
fn a_replay_of_every_ranks_log_moves_the_panels_like_an_attach() {
    let mut app = attached_job(0, job_rows(2)).with_mode(Mode::Replay {
        source: "2 ranks' logs".into(),
    });
    app.replay_has_ranks = true;
    assert_eq!(press(&mut app, KeyCode::Char(']')), Reaction::SelectRank(1));
    let job = app.job.as_ref().unwrap();
    assert_eq!(job.selected, 1);
    assert!(job.unreachable.is_none(), "{:?}", job.unreachable);
}
