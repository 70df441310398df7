//! `replay_feed` over real files: order, pacing controls, following a log being written,
//! and lines that are not records.
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use headroom_core::{Level, Notice, Record, StepMetrics, Telemetry};
use headroom_ui::{replay_feed, Control, Feed, Link, ReplayControl, ReplayOptions};

mod support;

use support::{next, text_of};

const WAIT: Duration = Duration::from_secs(5);

/// A fresh file under the temp dir, removed when dropped.
struct TempLog(PathBuf);

impl TempLog {
    fn new(lines: &[String]) -> TempLog {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "headroom-ui-replay-{}-{}.jsonl",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let log = TempLog(path);
        fs::write(&log.0, lines.concat()).unwrap();
        log
    }

    fn append(&self, text: &str) {
        let mut f = OpenOptions::new().append(true).open(&self.0).unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f.flush().unwrap();
    }
}

impl Drop for TempLog {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

fn notice(t: f64, text: &str) -> String {
    let msg = Telemetry::Notice(Notice::new(Level::Info, "test", text));
    Record::new(0.0, t, msg).to_line() + "\n"
}

fn step(t: f64, n: u64) -> String {
    let msg = Telemetry::Step(StepMetrics {
        total_steps: 10,
        loss: 1.0,
        lr: Some(1e-3),
        grad_norm: Some(1.0),
        step_time_s: 0.1,
        tokens_per_s: 1.0,
        samples_per_s: 1.0,
        accum_steps: 1,
        effective_batch: 4,
        seq_len: 8,
        tokens_seen: 0,
        ..support::step(n, 4)
    });
    Record::new(0.0, t, msg).to_line() + "\n"
}

fn control(feed: &Feed, c: ReplayControl) {
    let Control::Replay(h) = &feed.control else {
        panic!("a replay's feed steers the replay")
    };
    h.control.send(c).unwrap();
}

fn opts(speed: f64) -> ReplayOptions {
    ReplayOptions {
        speed,
        ..ReplayOptions::default()
    }
}

#[test]
fn records_arrive_in_order_paced_by_their_time() {
    let lines: Vec<String> = (0..5)
        .map(|i| notice(i as f64 * 0.4, &format!("n{i}")))
        .collect();
    let log = TempLog::new(&lines);
    let started = Instant::now();
    let feed = replay_feed(&log.0, opts(8.0)).unwrap();
    let got: Vec<String> = (0..6).filter_map(|_| next(&feed.events, WAIT)).collect();
    // 1.6 s of the run at 8×: 0.2 s.
    assert!(started.elapsed() >= Duration::from_millis(180), "not paced");
    assert_eq!(&got[..5], ["n0", "n1", "n2", "n3", "n4"]);
    assert_eq!(got[5], "the replay reached the end of the log");
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("<disconnected>"));
}

#[test]
fn jump_to_end_delivers_the_rest_at_once() {
    // Gaps of 100 s are shortened to 2 s each: without the jump, 4 s of waiting.
    let lines = [notice(0.0, "a"), notice(100.0, "b"), notice(200.0, "c")];
    let log = TempLog::new(&lines);
    let feed = replay_feed(&log.0, opts(1.0)).unwrap();
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("a"));
    assert_eq!(
        next(&feed.events, Duration::from_millis(300)),
        None,
        "b came early"
    );
    let asked = Instant::now();
    control(&feed, ReplayControl::JumpToEnd);
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("b"));
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("c"));
    // Without the jump, b would come 1.7 s after it was asked for and c 3.7 s: under
    // 1.5 s for both is the jump, with room for a busy machine's scheduling.
    assert!(
        asked.elapsed() < Duration::from_millis(1500),
        "{:?}",
        asked.elapsed()
    );
    let Control::Replay(h) = &feed.control else {
        unreachable!()
    };
    wait_until(|| h.snapshot().ended);
    assert_eq!(h.snapshot().position, 200.0);
}

#[test]
fn one_step_plays_up_to_the_next_step_record_then_pauses() {
    let lines = [
        notice(0.0, "a"),
        notice(50.0, "b"),
        step(60.0, 1),
        notice(70.0, "c"),
    ];
    let log = TempLog::new(&lines);
    let feed = replay_feed(&log.0, opts(1.0)).unwrap();
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("a"));
    control(&feed, ReplayControl::StepOne);
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("b"));
    assert!(feed.metrics.recv_timeout(WAIT).is_ok(), "the step record");
    let Control::Replay(h) = &feed.control else {
        unreachable!()
    };
    wait_until(|| h.snapshot().paused);
    assert_eq!(
        next(&feed.events, Duration::from_millis(2500)),
        None,
        "played on"
    );
    control(&feed, ReplayControl::TogglePause);
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("c"));
}

#[test]
fn following_picks_up_appended_lines_and_waits_for_half_written_ones() {
    let log = TempLog::new(&[notice(0.0, "first")]);
    let feed = replay_feed(
        &log.0,
        ReplayOptions {
            speed: 1024.0,
            follow: true,
            start_at_end: false,
        },
    )
    .unwrap();
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("first"));
    let line = notice(0.1, "second");
    let (head, tail) = line.split_at(line.len() / 2);
    log.append(head);
    assert_eq!(
        next(&feed.events, Duration::from_millis(400)),
        None,
        "half a line was taken"
    );
    log.append(tail);
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("second"));
    // No end notice while following: the log may grow again.
    assert_eq!(next(&feed.events, Duration::from_millis(300)), None);
}

#[test]
fn a_truncated_followed_log_starts_over() {
    let log = TempLog::new(&[notice(0.0, "old one"), notice(0.0, "old two")]);
    let feed = replay_feed(
        &log.0,
        ReplayOptions {
            speed: 1024.0,
            follow: true,
            start_at_end: false,
        },
    )
    .unwrap();
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("old one"));
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("old two"));
    fs::write(&log.0, notice(0.0, "new")).unwrap();
    let news = feed.link.recv_timeout(WAIT).expect("the restart is said");
    assert!(matches!(news, Link::Connected { .. }), "{news:?}");
    assert_eq!(next(&feed.events, WAIT).as_deref(), Some("new"));
}

#[test]
fn lines_that_are_not_records_are_skipped_and_counted() {
    let lines = [
        "garbage\n".to_string(),
        notice(0.0, "kept"),
        "{\"a\":1}\n".to_string(),
        // A newer producer's kind: skipped, not counted as bad.
        "{\"kind\":\"from_the_future\",\"t\":0.1}\n".to_string(),
        "\n".to_string(),
        // The last line, without its newline, still counts.
        notice(0.2, "last").trim_end().to_string(),
    ];
    let log = TempLog::new(&lines);
    let feed = replay_feed(&log.0, opts(1024.0)).unwrap();
    let got: Vec<String> = (0..3).filter_map(|_| next(&feed.events, WAIT)).collect();
    assert_eq!(got[..2], ["kept", "last"]);
    assert!(
        got[2].contains("end of the log") && got[2].contains("2 lines that were not records"),
        "{}",
        got[2]
    );
}

#[test]
fn a_missing_or_empty_log_is_an_error_naming_it() {
    let missing = std::env::temp_dir().join("headroom-ui-no-such-log.jsonl");
    let e = replay_feed(&missing, ReplayOptions::default())
        .err()
        .expect("missing file");
    assert!(
        e.to_string().contains("headroom-ui-no-such-log.jsonl"),
        "{e}"
    );
    let empty = TempLog::new(&[]);
    let e = replay_feed(&empty.0, ReplayOptions::default())
        .err()
        .expect("empty file");
    assert!(e.to_string().contains(&*empty.0.to_string_lossy()), "{e}");
    assert!(e.to_string().contains("empty"), "{e}");
}

#[test]
fn start_at_end_delivers_everything_first() {
    let lines = [notice(0.0, "a"), notice(500.0, "b"), notice(900.0, "c")];
    let log = TempLog::new(&lines);
    let feed = replay_feed(
        &log.0,
        ReplayOptions {
            start_at_end: true,
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let started = Instant::now();
    let got: Vec<String> = (0..3).filter_map(|_| next(&feed.events, WAIT)).collect();
    assert_eq!(got, ["a", "b", "c"]);
    assert!(started.elapsed() < Duration::from_secs(1));
}

fn wait_until(done: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The fixture log (written before notices had a `detail`) replays whole: its NVML
/// notice reads as it was written, with no detail, and no line is skipped as bad.
#[test]
fn an_old_log_with_notices_before_detail_replays_whole() {
    let log = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-run.jsonl");
    let feed = replay_feed(
        &log,
        ReplayOptions {
            start_at_end: true,
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let mut nvml = None;
    let mut last = String::new();
    while let Ok(r) = feed.events.recv_timeout(WAIT) {
        last = text_of(&r);
        match r.msg {
            Telemetry::Notice(n) if n.source == "nvml" => nvml = Some(n),
            _ => {}
        }
        if last.contains("end of the log") {
            break;
        }
    }
    let nvml = nvml.expect("the fixture's NVML notice");
    assert!(nvml.text.starts_with("NVML unavailable ("), "{}", nvml.text);
    assert_eq!(nvml.detail, None);
    assert!(last.contains("end of the log"), "{last}");
    assert!(!last.contains("not records"), "{last}");
}
