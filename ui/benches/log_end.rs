//! A long run's compressed log: its size, what writing it costs per step, and how soon
//! `headroom replay --end` has delivered its end state.
//!
//!     cargo bench -p headroom-ui --bench log_end -- 6000000
//!
//! The argument is the run's steps (default 600,000; 6,000,000 is a week at 10 steps a
//! second). The records are a training loop's (tests/support/synthetic.rs): per step a
//! `step`, a `step_memory` and a `plan_check`, a `sample` every 0.25 s, now and then a
//! `decision`, an `eval` every 1000 steps, a `checkpoint_saved` every 5000. They are
//! written through `FrameWriter` with the log writer's flushes (at every record that is
//! not high-rate, and once a second of the run's time). Prints the file's size and bytes
//! per step, the write cost per step (the writer's calls only, not building the records),
//! the time from opening the log to the end state delivered by `replay_feed` with
//! `start_at_end`, and, as the baseline in the same process, the time to decode the whole
//! log (what `--end` cost before: every line, not even parsed).
//!
//! With `HEADROOM_LOG_END_DIR=DIR` the log is written to (and left in) `DIR`, and a log
//! of the same steps already there is measured again without writing it anew.
use std::fs::{self, File};
use std::io::BufWriter;
use std::path::Path;
use std::time::{Duration, Instant};

use crossbeam_channel::select;
use headroom_core::logfile::read::{ChainLines, Line};
use headroom_core::logfile::FrameWriter;
use headroom_core::Telemetry;
use headroom_ui::{replay_feed, ReplayOptions};

#[path = "../tests/support/mod.rs"]
mod support;

fn main() {
    let steps: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.replace(['_', ','], "").parse().ok())
        .unwrap_or(600_000);
    let kept = std::env::var_os("HEADROOM_LOG_END_DIR").map(std::path::PathBuf::from);
    let dir = kept.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("headroom-log-end-{}", std::process::id()))
    });
    fs::create_dir_all(&dir).expect("a temp folder");
    let path = dir.join(format!("run-{steps}.jsonl.zst"));
    if kept.is_some() && path.exists() {
        println!(
            "log_end: {steps} steps, the log written before -> {}",
            path.display()
        );
    } else {
        write(&path, steps);
    }
    let size = fs::metadata(&path).expect("the log").len();
    println!(
        "  size            {:.1} MiB, {:.1} bytes/step",
        size as f64 / (1 << 20) as f64,
        size as f64 / steps as f64
    );

    // Its first part alone: finding the frames and decoding the summary and last frames.
    let started = Instant::now();
    let end = headroom_core::logfile::end::open_at_end(&path).expect("the end");
    println!(
        "  index walk      {:.0} ms ({} lines, {} records summarised)",
        started.elapsed().as_secs_f64() * 1e3,
        end.lines.len(),
        end.summarized
    );
    drop(end);

    // `--end`: from opening the log to the end notice, every record before it taken.
    let started = Instant::now();
    let feed = replay_feed(
        &path,
        ReplayOptions {
            start_at_end: true,
            ..ReplayOptions::default()
        },
    )
    .expect("replay");
    let opened = started.elapsed();
    let (mut delivered, mut last_step) = (0u64, 0u64);
    let mut first = None;
    // A replay that is not followed closes both queues after its end notice: the two
    // queues have no order between them, so the end state is in when both are closed.
    let never = crossbeam_channel::never();
    let (mut ev_open, mut me_open) = (true, true);
    while ev_open || me_open {
        let ev = if ev_open { &feed.events } else { &never };
        let me = if me_open { &feed.metrics } else { &never };
        let rec = select! {
            recv(ev) -> r => r.inspect_err(|_| ev_open = false),
            recv(me) -> r => r.inspect_err(|_| me_open = false),
        };
        let Ok(rec) = rec else { continue };
        first.get_or_insert_with(|| started.elapsed());
        delivered += 1;
        if let Telemetry::Step(s) = &rec.msg {
            last_step = s.step;
        }
    }
    let end = started.elapsed();
    assert_eq!(last_step, steps, "the end state's last step");
    println!(
        "  --end           {:.0} ms to the end state ({delivered} records; replay_feed \
         returned in {:.0} ms, first record at {:.0} ms)",
        end.as_secs_f64() * 1e3,
        opened.as_secs_f64() * 1e3,
        first.unwrap_or_default().as_secs_f64() * 1e3
    );
    drop(feed);

    // The baseline: decoding every line of the log.
    let started = Instant::now();
    let mut lines = ChainLines::open(&path).expect("the log");
    let mut n = 0u64;
    while let Ok(Line::Whole(_)) = lines.next_line() {
        n += 1;
    }
    let whole = started.elapsed();
    assert!(n > steps * 3, "{n} lines");
    println!(
        "  decode all      {:.0} ms ({:.1} MiB of JSONL)",
        whole.as_secs_f64() * 1e3,
        lines.position() as f64 / (1 << 20) as f64
    );
    if kept.is_none() {
        let _ = fs::remove_dir_all(&dir);
    }
}

/// Writes the synthetic run of `steps` steps to `path`, timing the writer.
fn write(path: &Path, steps: u64) {
    // Writing, timed around the writer's calls alone.
    let file = File::create(path).expect("the log");
    let mut w = FrameWriter::new(BufWriter::with_capacity(64 << 10, file)).expect("a writer");
    let mut writing = Duration::ZERO;
    let (mut records, mut last_flush) = (0u64, 0.0f64);
    support::synthetic::run(steps, |rec| {
        let at = Instant::now();
        w.write_record(rec).expect("write");
        if !rec.msg.is_high_rate() || rec.t - last_flush >= 1.0 {
            w.flush().expect("flush");
            last_flush = rec.t;
        }
        writing += at.elapsed();
        records += 1;
    });
    let at = Instant::now();
    w.finish().expect("finish");
    writing += at.elapsed();
    println!(
        "log_end: {steps} steps, {records} records -> {}",
        path.display()
    );
    println!(
        "  write           {:.2} µs/step ({:.2} s in all)",
        writing.as_secs_f64() * 1e6 / steps as f64,
        writing.as_secs_f64()
    );
    plain_baseline(path, steps.min(PLAIN_STEPS));
}

/// The plain JSONL log's size and write cost for the same records: what the log cost
/// before it was compressed (`Record::to_line` and a buffered write, as the log writer's
/// plain sink does), on the first steps only (a week of it would be 5 GB).
const PLAIN_STEPS: u64 = 200_000;

fn plain_baseline(beside: &Path, steps: u64) {
    use std::io::Write;
    let path = beside.with_extension("plain.jsonl");
    let mut out = BufWriter::with_capacity(64 << 10, File::create(&path).expect("the log"));
    let mut writing = Duration::ZERO;
    support::synthetic::run(steps, |rec| {
        let at = Instant::now();
        writeln!(out, "{}", rec.to_line()).expect("write");
        if !rec.msg.is_high_rate() {
            out.flush().expect("flush");
        }
        writing += at.elapsed();
    });
    out.flush().expect("flush");
    let size = fs::metadata(&path).expect("the log").len();
    let _ = fs::remove_file(&path);
    println!(
        "  plain JSONL     {:.1} bytes/step, {:.2} µs/step (the first {steps} steps)",
        size as f64 / steps as f64,
        writing.as_secs_f64() * 1e6 / steps as f64
    );
}
