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
use std::fs::{self, File};
use std::io::BufWriter;
use std::time::{Duration, Instant};

use crossbeam_channel::select;
use headroom_core::logfile::read::{ChainLines, Line};
use headroom_core::logfile::FrameWriter;
use headroom_core::Telemetry;
use headroom_ui::{replay_feed, ReplayOptions};

#[path = "../tests/support/mod.rs"]
#[allow(dead_code)]
mod support;

fn main() {
    let steps: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.replace(['_', ','], "").parse().ok())
        .unwrap_or(600_000);
    let dir = std::env::temp_dir().join(format!("headroom-log-end-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("a temp folder");
    let path = dir.join("run.jsonl.zst");

    // Writing, timed around the writer's calls alone.
    let file = File::create(&path).expect("the log");
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
    let size = fs::metadata(&path).expect("the log").len();
    println!("log_end: {steps} steps, {records} records -> {}", path.display());
    println!(
        "  size            {:.1} MiB, {:.1} bytes/step",
        size as f64 / (1 << 20) as f64,
        size as f64 / steps as f64
    );
    println!(
        "  write           {:.2} µs/step ({:.2} s in all)",
        writing.as_secs_f64() * 1e6 / steps as f64,
        writing.as_secs_f64()
    );

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
    loop {
        let rec = select! {
            recv(feed.events) -> r => r,
            recv(feed.metrics) -> r => r,
        };
        let Ok(rec) = rec else { break };
        first.get_or_insert_with(|| started.elapsed());
        delivered += 1;
        match &rec.msg {
            Telemetry::Step(s) => last_step = s.step,
            Telemetry::Notice(n) if n.text.contains("end of the log") => break,
            _ => {}
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
    assert_eq!(n, records);
    println!(
        "  decode all      {:.0} ms ({:.1} MiB of JSONL)",
        whole.as_secs_f64() * 1e3,
        lines.position() as f64 / (1 << 20) as f64
    );
    let _ = fs::remove_dir_all(&dir);
}
