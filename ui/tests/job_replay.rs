//! `replay_job_feed` over a torchrun job's logs, one per rank: rank 0's rows reach the
//! screen with the shown rank's records only, and selecting a rank starts a fresh picture
//! from that rank's log, caught up to where the replay stands.
use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use headroom_core::{
    JobRanks, Level, Notice, RankRow, Record, RunInfo, RunStatus, StepMetrics, Telemetry,
};
use headroom_ui::{replay_job_feed, Feed, Link, ReplayOptions};

mod support;
use support::run_info;

const WAIT: Duration = Duration::from_secs(5);

/// Logs under a fresh temp folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "headroom-ui-job-replay-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn log(&self, name: &str, records: &[Record]) -> PathBuf {
        let path = self.0.join(name);
        let text: String = records.iter().map(|r| r.to_line() + "\n").collect();
        fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn started(run_name: &str) -> Record {
    let msg = Telemetry::RunStarted(RunInfo {
        run_name: run_name.into(),
        parameters: 1000,
        total_steps: 3,
        corpus: String::new(),
        train_bytes: 0,
        val_bytes: 0,
        config: None,
        ..run_info("cpu", "cpu")
    });
    Record::new(0.0, 0.0, msg)
}

fn step(t: f64, n: u64, micro_batch: usize) -> Record {
    let msg = Telemetry::Step(StepMetrics {
        total_steps: 3,
        loss: 1.0,
        lr: None,
        grad_norm: None,
        step_time_s: 0.1,
        tokens_per_s: 1.0,
        samples_per_s: 1.0,
        accum_steps: 1,
        seq_len: 8,
        tokens_seen: 0,
        ..support::step(n, micro_batch)
    });
    Record::new(0.0, t, msg)
}

fn rows(t: f64, n: u64) -> Record {
    let row = |rank: u32, micro_batch: usize| RankRow {
        rank,
        step: n,
        micro_batch,
        status: RunStatus::Running,
        ..RankRow::default()
    };
    let msg = Telemetry::JobRanks(JobRanks {
        job: "j1".into(),
        step: n,
        world_size: 2,
        uniform_micro_batch: false,
        agree_us: 50.0,
        ranks: vec![row(0, 8), row(1, 3)],
    });
    Record::new(0.0, t, msg)
}

fn said(t: f64, text: &str) -> Record {
    Record::new(
        0.0,
        t,
        Telemetry::Notice(Notice::new(Level::Info, "test", text)),
    )
}

/// What reached the screen, as short words (`started:NAME`, `step:MB`, `rows:N`, a
/// notice's text): the lifecycle queue's and the metrics queue's, each in its order (the
/// two queues have no order between them). It waits (up to WAIT) until `want` events and
/// metrics came, however slow the machine is to send them, then a short while for any
/// more than that, which the caller's comparison then shows.
fn drain(feed: &Feed, want: (usize, usize)) -> (Vec<String>, Vec<String>) {
    const EXTRAS: Duration = Duration::from_millis(300);
    let (mut events, mut metrics) = (Vec::new(), Vec::new());
    let start = Instant::now();
    let mut complete: Option<Instant> = None;
    loop {
        if complete.is_none() && events.len() >= want.0 && metrics.len() >= want.1 {
            complete = Some(Instant::now());
        }
        let deadline = match complete {
            Some(at) => at + EXTRAS,
            None => start + WAIT,
        };
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return (events, metrics);
        };
        let (r, high) = crossbeam_channel::select! {
            recv(feed.events) -> r => (r, false),
            recv(feed.metrics) -> r => (r, true),
            default(left) => return (events, metrics),
        };
        let Ok(r) = r else {
            return (events, metrics);
        };
        let word = match &r.msg {
            Telemetry::RunStarted(i) => format!("started:{}", i.run_name),
            Telemetry::Step(s) => format!("step:{}", s.micro_batch),
            Telemetry::JobRanks(j) => format!("rows:{}", j.step),
            Telemetry::Notice(n) => n.text.clone(),
            other => other.kind().to_string(),
        };
        if high { &mut metrics } else { &mut events }.push(word);
    }
}

fn link(rx: &Receiver<Link>) -> Link {
    match rx.recv_timeout(WAIT) {
        Ok(l) => l,
        Err(RecvTimeoutError::Timeout) => panic!("no link news"),
        Err(RecvTimeoutError::Disconnected) => panic!("the replay ended"),
    }
}

fn job_logs(dir: &TempDir) -> Vec<PathBuf> {
    let rank0 = dir.log(
        "rank0.jsonl",
        &[
            started("ddp.j1.rank0"),
            step(1.0, 1, 8),
            rows(1.0, 1),
            step(2.0, 2, 8),
            rows(2.0, 2),
            said(3.0, "rank 0 done"),
        ],
    );
    let rank1 = dir.log(
        "rank1.jsonl",
        &[
            started("ddp.j1.rank1"),
            step(1.1, 1, 3),
            step(2.1, 2, 3),
            said(3.1, "rank 1 done"),
        ],
    );
    // Given in any order: rank 0's log is found by its run's name.
    vec![rank1, rank0]
}

#[test]
fn a_jobs_logs_show_rank_0s_rows_and_the_selected_ranks_panels() {
    let dir = TempDir::new();
    let feed = replay_job_feed(
        &job_logs(&dir),
        ReplayOptions {
            start_at_end: true,
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let (events, metrics) = drain(&feed, (3, 4));
    assert_eq!(
        events,
        [
            "started:ddp.j1.rank0",
            "rank 0 done",
            "the replay reached the end of the log"
        ]
    );
    assert_eq!(metrics, ["step:8", "rows:1", "step:8", "rows:2"]);

    // The end of the logs is not the end of the replay: rank 1's panels can still be shown.
    let select = feed
        .select_rank
        .as_ref()
        .expect("a job's replay switches ranks");
    select.send(1).unwrap();
    match link(&feed.link) {
        Link::Connected { run_id } => assert!(run_id.contains("rank 1's log"), "{run_id}"),
        other => panic!("{other:?}"),
    }
    let (events, metrics) = drain(&feed, (2, 2));
    assert_eq!(events, ["started:ddp.j1.rank1", "rank 1 done"]);
    assert_eq!(
        metrics,
        ["step:3", "step:3"],
        "rank 1's whole log, and no second copy of the rows"
    );

    select.send(0).unwrap();
    assert!(matches!(link(&feed.link), Link::Connected { .. }));
    let (events, metrics) = drain(&feed, (2, 2));
    assert_eq!(events, ["started:ddp.j1.rank0", "rank 0 done"]);
    assert_eq!(
        metrics,
        ["step:8", "step:8"],
        "rank 0's rows are kept by the screen, not sent twice"
    );

    select.send(5).unwrap();
    match link(&feed.link) {
        Link::RankUnreachable { rank, reason } => {
            assert_eq!(rank, 5);
            assert!(reason.contains("no log of rank 5"), "{reason}");
            assert!(reason.contains("rank 0, 1"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_switch_mid_replay_catches_up_to_where_the_replay_stands() {
    let dir = TempDir::new();
    let rank0 = dir.log(
        "a.jsonl",
        &[
            started("ddp.j1.rank0"),
            step(0.1, 1, 8),
            said(0.2, "rank 0 early"),
            said(500.0, "rank 0 late"),
        ],
    );
    let rank1 = dir.log(
        "b.jsonl",
        &[
            started("ddp.j1.rank1"),
            step(0.1, 1, 3),
            said(0.2, "rank 1 early"),
            said(500.0, "rank 1 late"),
        ],
    );
    let feed = replay_job_feed(&[rank0, rank1], ReplayOptions::default()).unwrap();
    // Played at the run's pace: the late records are 2 s (a shortened gap) away.
    let (events, metrics) = drain(&feed, (2, 1));
    assert_eq!(events, ["started:ddp.j1.rank0", "rank 0 early"]);
    assert_eq!(metrics, ["step:8"]);
    feed.select_rank.as_ref().unwrap().send(1).unwrap();
    assert!(matches!(link(&feed.link), Link::Connected { .. }));
    let (events, metrics) = drain(&feed, (2, 1));
    assert_eq!(
        events,
        ["started:ddp.j1.rank1", "rank 1 early"],
        "caught up, and nothing of what is not yet due"
    );
    assert_eq!(metrics, ["step:3"]);
    let late = feed.events.recv_timeout(WAIT).unwrap();
    match late.msg {
        Telemetry::Notice(n) => assert_eq!(n.text, "rank 1 late"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn logs_that_are_not_one_jobs_ranks_are_refused_with_what_to_give() {
    let dir = TempDir::new();
    let lone = dir.log("lone.jsonl", &[started("train"), step(1.0, 1, 8)]);
    let rank0 = dir.log("r0.jsonl", &[started("ddp.j1.rank0")]);
    let again = dir.log("r0b.jsonl", &[started("ddp.j1.rank0")]);

    let e = replay_job_feed(&[rank0.clone(), lone], ReplayOptions::default())
        .err()
        .expect("a log that is no rank's");
    let text = e.to_string();
    assert!(
        text.contains("lone.jsonl") && text.contains("'train'"),
        "{text}"
    );
    assert!(text.contains("replay this log alone"), "{text}");

    let e = replay_job_feed(&[rank0, again], ReplayOptions::default())
        .err()
        .expect("two logs of one rank");
    assert!(e.to_string().contains("both rank 0's"), "{e}");

    // One log alone is a plain replay, whatever its run's name: no rank switching.
    let one = dir.log("one.jsonl", &[started("train")]);
    let feed = replay_job_feed(&[one], ReplayOptions::default()).unwrap();
    assert!(feed.select_rank.is_none());
}
