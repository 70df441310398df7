//! `replay_feed` over compressed (`.zst`) and rotated logs: a chain replays like one
//! plain log, a followed live file is read across a rotation, `--end` starts from the
//! index's summary, and a file killed mid-frame replays what was flushed.
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crossbeam_channel::{select, Receiver};
use headroom_core::logfile::{compact_line, segment_path, FrameWriter};
use headroom_core::units::fmt_count;
use headroom_core::{Level, Notice, Record, Telemetry};
use headroom_ui::app::App;
use headroom_ui::{replay_feed, Feed, ReplayOptions};

mod support;

use support::{next, text_of};

const WAIT: Duration = Duration::from_secs(10);

/// A fresh folder under the temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "headroom-ui-zst-replay-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn records(steps: u64) -> Vec<Record> {
    let mut all = Vec::new();
    support::synthetic::run(steps, |r| all.push(r.clone()));
    all
}

/// The records as a plain log: the compressed log's own lines (single precision), so
/// both hold the same figures.
fn write_plain(path: &Path, recs: &[Record]) {
    let text: String = recs.iter().map(|r| compact_line(r) + "\n").collect();
    fs::write(path, text).unwrap();
}

/// `recs` through a frame writer into `path`, a frame every `per_frame` records.
fn write_zst(path: &Path, recs: &[Record], per_frame: usize) {
    let mut w = FrameWriter::new(File::create(path).unwrap()).unwrap();
    for (i, r) in recs.iter().enumerate() {
        w.write_record(r).unwrap();
        if (i + 1).is_multiple_of(per_frame) {
            w.end_frame().unwrap();
        }
    }
    w.finish().unwrap();
}

/// Everything a replay that ends delivers, merged by time (events first at one time)
/// so that two replays of the same records apply them in the same order.
fn drain(feed: &Feed) -> Vec<Record> {
    let (mut events, mut metrics) = (Vec::new(), Vec::new());
    let (mut ev_open, mut me_open) = (true, true);
    let closed = crossbeam_channel::never();
    while ev_open || me_open {
        let ev: &Receiver<Record> = if ev_open { &feed.events } else { &closed };
        let me: &Receiver<Record> = if me_open { &feed.metrics } else { &closed };
        select! {
            recv(ev) -> r => match r {
                Ok(r) => events.push(r),
                Err(_) => ev_open = false,
            },
            recv(me) -> r => match r {
                Ok(r) => metrics.push(r),
                Err(_) => me_open = false,
            },
            default(WAIT) => panic!("the replay did not end"),
        }
    }
    let mut all = Vec::with_capacity(events.len() + metrics.len());
    let mut m = metrics.into_iter().peekable();
    for e in events {
        while let Some(r) = m.next_if(|r| r.t < e.t) {
            all.push(r);
        }
        all.push(e);
    }
    all.extend(m);
    all
}

fn app_of(recs: &[Record]) -> App {
    let mut app = App::new("run", false);
    let mut t = 0.0;
    for r in recs {
        // The replay's own notices come at its clock, which runs on with the wall clock:
        // drawn at the run's time instead, so that two replays compare.
        match &r.msg {
            Telemetry::Notice(n) if n.source == "replay" => {
                app.apply_record(&Record { t, ..r.clone() });
                continue;
            }
            _ => app.apply_record(r),
        }
        t = r.t.max(t);
    }
    app.set_elapsed(t);
    app
}

/// The screen's first three rows: the run's name, status and progress.
fn header(app: &App) -> String {
    support::screen(app, 120, 40)
        .lines()
        .take(3)
        .collect::<Vec<_>>()
        .join("\n")
}

fn notice_texts(recs: &[Record]) -> Vec<String> {
    recs.iter()
        .filter_map(|r| match &r.msg {
            Telemetry::Notice(n) => Some(n.text.clone()),
            _ => None,
        })
        .collect()
}

fn fast() -> ReplayOptions {
    ReplayOptions {
        speed: 1024.0,
        ..ReplayOptions::default()
    }
}

fn at_end() -> ReplayOptions {
    ReplayOptions {
        start_at_end: true,
        ..ReplayOptions::default()
    }
}

#[test]
fn a_rotated_compressed_chain_replays_to_the_screen_of_one_plain_log() {
    let dir = TempDir::new();
    let recs = records(600);
    let plain = dir.0.join("plain.jsonl");
    write_plain(&plain, &recs);
    // Three segments and the live file, frames of 150 records.
    let live = dir.0.join("run.jsonl.zst");
    let q = recs.len() / 4;
    let parts = [
        &recs[..q],
        &recs[q..2 * q],
        &recs[2 * q..3 * q],
        &recs[3 * q..],
    ];
    for (n, part) in parts.into_iter().enumerate() {
        let path = match n {
            3 => live.clone(),
            n => segment_path(&live, n as u32 + 1),
        };
        write_zst(&path, part, 150);
    }
    let from_plain = drain(&replay_feed(&plain, fast()).unwrap());
    let from_chain = drain(&replay_feed(&live, fast()).unwrap());
    assert_eq!(
        from_chain.len(),
        recs.len() + 1,
        "every record, and the end"
    );
    assert_eq!(
        notice_texts(&from_chain).last().map(String::as_str),
        Some("the replay reached the end of the log")
    );
    let (a, b) = (app_of(&from_plain), app_of(&from_chain));
    assert_eq!(a.last_step.as_ref().map(|s| s.step), Some(600));
    assert_eq!(support::screen(&b, 120, 40), support::screen(&a, 120, 40));
}

fn note(i: usize) -> Record {
    let msg = Telemetry::Notice(Notice::new(Level::Info, "test", format!("n{i}")));
    Record::new(0.0, i as f64 / 10.0, msg)
}

#[test]
fn a_followed_live_zst_log_is_read_across_a_rotation_each_record_once() {
    let dir = TempDir::new();
    let live = dir.0.join("run.jsonl.zst");
    let mut w = FrameWriter::new(File::create(&live).unwrap()).unwrap();
    let write = |w: &mut FrameWriter<File>, range: std::ops::Range<usize>| {
        for i in range {
            w.write_record(&note(i)).unwrap();
        }
        w.flush().unwrap();
    };
    write(&mut w, 0..5);
    let feed = replay_feed(
        &live,
        ReplayOptions {
            follow: true,
            ..fast()
        },
    )
    .unwrap();
    let mut got = Vec::new();
    let expect = |upto: usize, got: &mut Vec<String>| {
        while got.len() < upto {
            match next(&feed.events, WAIT) {
                Some(t) => got.push(t),
                None => panic!("only {got:?} of {upto}"),
            }
        }
    };
    expect(5, &mut got);
    // Written and flushed later, in the open frame.
    write(&mut w, 5..10);
    expect(10, &mut got);
    // More to the old file, then the rotation at once: the follower reads the old file
    // to its end before the new one.
    write(&mut w, 10..14);
    w.finish().unwrap();
    fs::rename(&live, segment_path(&live, 1)).unwrap();
    let mut w = FrameWriter::new(File::create(&live).unwrap()).unwrap();
    write(&mut w, 14..20);
    expect(20, &mut got);
    write(&mut w, 20..23);
    expect(23, &mut got);
    let want: Vec<String> = (0..23).map(|i| format!("n{i}")).collect();
    assert_eq!(got, want);
    // Nothing twice, no end while following.
    assert_eq!(next(&feed.events, Duration::from_millis(400)), None);
}

#[test]
fn end_on_a_compressed_log_summarises_earlier_frames_and_ends_like_the_full_replay() {
    let dir = TempDir::new();
    let recs = records(12_000);
    let plain = dir.0.join("plain.jsonl");
    write_plain(&plain, &recs);
    let live = dir.0.join("run.jsonl.zst");
    let per_frame = 500;
    write_zst(&live, &recs, per_frame);
    let full = drain(&replay_feed(&plain, at_end()).unwrap());
    let end = drain(&replay_feed(&live, at_end()).unwrap());
    assert!(
        end.len() < full.len() - 10_000,
        "{} of {}: nothing was summarised",
        end.len(),
        full.len()
    );
    // The events of every frame: every decision, evaluation and checkpoint.
    let rare = |recs: &[Record]| -> Vec<String> {
        recs.iter()
            .filter(|r| !r.msg.is_high_rate())
            .filter(|r| !matches!(&r.msg, Telemetry::Notice(n) if n.source == "replay"))
            .map(compact_line)
            .collect()
    };
    assert_eq!(rare(&end), rare(&full));
    // The digests: one step per summarised frame, then every step of the last frames.
    let steps: Vec<u64> = end
        .iter()
        .filter_map(|r| match &r.msg {
            Telemetry::Step(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "out of order");
    // Frames decoded whole: the last ones, back until they hold 20,000 records.
    let sizes: Vec<usize> = recs.chunks(per_frame).map(<[Record]>::len).collect();
    let (mut held, mut whole) = (0, 0);
    while held < 20_000 {
        held += sizes[sizes.len() - 1 - whole];
        whole += 1;
    }
    let digests = steps.windows(2).position(|w| w[1] == w[0] + 1).unwrap() + 1;
    assert_eq!(digests, sizes.len() - whole);
    assert!(steps[digests..].windows(2).all(|w| w[1] == w[0] + 1));
    assert_eq!(steps.last(), Some(&12_000));
    // Said once, with the steps summarised.
    let said: Vec<String> = notice_texts(&end)
        .into_iter()
        .filter(|t| t.starts_with("jumped to the end"))
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    let first_whole = steps[digests];
    assert!(
        said[0].contains(&format!(
            "jumped to the end: {} steps before step {} are shown one point per frame",
            fmt_count(first_whole - 1),
            fmt_count(first_whole)
        )),
        "{} (first whole {first_whole}, after {:?})",
        said[0],
        &steps[digests.saturating_sub(3)..digests + 3]
    );
    // The final state: header, last loss, status, decisions, evaluation.
    let (a, b) = (app_of(&full), app_of(&end));
    assert_eq!(b.last_step, a.last_step);
    assert_eq!(b.status_text(), a.status_text());
    assert_eq!(b.progress_line(), a.progress_line());
    assert_eq!(b.policy.last_decision, a.policy.last_decision);
    assert_eq!(b.last_eval, a.last_eval);
    assert_eq!(header(&b), header(&a));
}

#[test]
fn a_zst_log_cut_mid_frame_replays_what_was_flushed_and_ends_as_usual() {
    let dir = TempDir::new();
    let live = dir.0.join("run.jsonl.zst");
    let mut w = FrameWriter::new(File::create(&live).unwrap()).unwrap();
    for i in 0..40 {
        w.write_record(&note(i)).unwrap();
    }
    w.flush().unwrap();
    let flushed = fs::metadata(&live).unwrap().len();
    for i in 40..80 {
        w.write_record(&note(i)).unwrap();
    }
    w.flush().unwrap();
    let after = fs::metadata(&live).unwrap().len();
    drop(w);
    // kill -9 in the middle of writing the second flush's bytes.
    let f = fs::OpenOptions::new().write(true).open(&live).unwrap();
    f.set_len(flushed + (after - flushed) / 2).unwrap();
    let got: Vec<String> = drain(&replay_feed(&live, fast()).unwrap())
        .iter()
        .map(text_of)
        .collect();
    let mut want: Vec<String> = (0..40).map(|i| format!("n{i}")).collect();
    want.push("the replay reached the end of the log".into());
    assert_eq!(got, want);
}

/// What a replay that goes on (a job's, which serves rank switches after its end)
/// delivers until it has been quiet a while, merged as [`drain`] merges.
fn drain_quiet(feed: &Feed) -> Vec<Record> {
    let (mut events, mut metrics) = (Vec::new(), Vec::new());
    loop {
        select! {
            recv(feed.events) -> r => events.push(r.expect("the replay goes on")),
            recv(feed.metrics) -> r => metrics.push(r.expect("the replay goes on")),
            default(Duration::from_millis(500)) => break,
        }
    }
    let mut all = Vec::with_capacity(events.len() + metrics.len());
    let mut m = metrics.into_iter().peekable();
    for e in events {
        while let Some(r) = m.next_if(|r| r.t < e.t) {
            all.push(r);
        }
        all.push(e);
    }
    all.extend(m);
    all
}

/// A rank's run: the synthetic run named as torchrun's rank `rank`, its losses its own.
fn rank_records(rank: u32, steps: u64) -> Vec<Record> {
    let mut recs = records(steps);
    for r in &mut recs {
        match &mut r.msg {
            Telemetry::RunStarted(info) => info.run_name = format!("ddp.j1.rank{rank}"),
            Telemetry::Step(s) => s.loss += rank as f64,
            _ => {}
        }
    }
    recs
}

#[test]
fn end_on_a_jobs_compressed_logs_switches_ranks_to_the_same_end_state() {
    let dir = TempDir::new();
    let steps = 7_000;
    let logs: Vec<PathBuf> = (0..2)
        .map(|rank| dir.0.join(format!("rank{rank}.jsonl.zst")))
        .collect();
    write_zst(&logs[0], &rank_records(0, steps), 500);
    // Rank 1's log is live: its last frame open (flushed), read on from its index.
    let mut w = FrameWriter::new(File::create(&logs[1]).unwrap()).unwrap();
    let recs = rank_records(1, steps);
    let open_from = recs.len() - 300;
    for (i, r) in recs.iter().enumerate() {
        w.write_record(r).unwrap();
        if (i + 1).is_multiple_of(500) || i + 1 == open_from {
            w.end_frame().unwrap();
        }
    }
    w.flush().unwrap();
    let alone = drain(&replay_feed(&logs[1], at_end()).unwrap());
    let feed = headroom_ui::replay_job_feed(&logs, at_end()).unwrap();
    let first = drain_quiet(&feed);
    assert!(
        notice_texts(&first)
            .iter()
            .any(|t| t.starts_with("jumped to the end")),
        "rank 0's end is a summary"
    );
    feed.select_rank.as_ref().unwrap().send(1).unwrap();
    let news = feed.link.recv_timeout(WAIT).expect("the switch is said");
    assert!(
        matches!(news, headroom_ui::Link::Connected { .. }),
        "{news:?}"
    );
    let switched = drain_quiet(&feed);
    // Rank 1's panels: what its own `--end` replay delivers (its end notice aside).
    let words = |recs: &[Record]| -> Vec<String> {
        recs.iter()
            .filter(
                |r| !matches!(&r.msg, Telemetry::Notice(n) if n.text.contains("end of the log")),
            )
            .map(compact_line)
            .collect()
    };
    assert_eq!(words(&switched), words(&alone));
    let b = app_of(&switched);
    assert_eq!(
        b.last_step.as_ref().map(|s| (s.step, s.loss)),
        app_of(&alone).last_step.as_ref().map(|s| (s.step, s.loss))
    );
}

/// The data frames of a compressed file, from its index frames: (offset, length, records).
fn data_frames(path: &Path) -> Vec<(u64, u64, u64)> {
    use headroom_core::logfile::index::{frame_len_from_trailer, IndexEntry};
    let bytes = fs::read(path).unwrap();
    let mut at = bytes.len() - frame_len_from_trailer(&bytes).unwrap() as usize;
    let mut frames = vec![];
    loop {
        let e = IndexEntry::decode(&bytes[at..]).unwrap();
        frames.push((e.data_offset, e.data_len, e.records));
        match e.prev {
            Some(p) => at = p as usize,
            None => break,
        }
    }
    frames.reverse();
    frames
}

/// Overwrites 16 bytes in the middle of a data frame, as a disk error would.
fn spoil(path: &Path, (offset, len, _): (u64, u64, u64)) {
    let mut bytes = fs::read(path).unwrap();
    let mid = (offset + len / 2) as usize;
    for b in &mut bytes[mid..mid + 16] {
        *b ^= 0xA5;
    }
    fs::write(path, bytes).unwrap();
}

#[test]
fn a_damaged_frame_is_said_in_the_event_log_and_the_replay_goes_on_to_the_end() {
    let dir = TempDir::new();
    let recs = records(600);
    let live = dir.0.join("run.jsonl.zst");
    write_zst(&live, &recs, 100);
    let frames = data_frames(&live);
    assert!(frames.len() >= 8, "{} frames", frames.len());
    let k = frames.len() / 2;
    spoil(&live, frames[k]);
    // The same log without the damaged frame's records, plain.
    let before: u64 = frames[..k].iter().map(|f| f.2).sum();
    let (from, to) = (before as usize, (before + frames[k].2) as usize);
    let kept: Vec<Record> = [&recs[..from], &recs[to..]].concat();
    let plain = dir.0.join("plain.jsonl");
    write_plain(&plain, &kept);

    let got = drain(&replay_feed(&live, fast()).unwrap());
    let said = notice_texts(&got);
    let damaged: Vec<&String> = said.iter().filter(|t| t.contains("damaged")).collect();
    assert_eq!(damaged.len(), 2, "{said:?}");
    let at = format!("damaged data at byte {}", frames[k].0);
    assert!(damaged[0].contains(&at), "{}", damaged[0]);
    assert!(
        damaged[0].contains("its 100 records lost"),
        "{}",
        damaged[0]
    );
    assert_eq!(
        said.last().map(String::as_str),
        Some(
            "the replay reached the end of the log; 1 damaged stretch of the log skipped \
             (said where met)"
        )
    );
    // Every other record, in the log's order.
    let records: Vec<&Record> = got
        .iter()
        .filter(|r| !matches!(&r.msg, Telemetry::Notice(n) if n.source == "replay"))
        .collect();
    assert_eq!(records.len(), kept.len());
    let (a, b) = (
        app_of(&drain(&replay_feed(&plain, fast()).unwrap())),
        app_of(&got),
    );
    assert_eq!(b.last_step.as_ref().map(|s| s.step), Some(600));
    assert_eq!(header(&b), header(&a));
    let screen = support::screen(&b, 120, 40);
    assert!(screen.contains("damaged data at byte"), "{screen}");
}
