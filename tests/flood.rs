//! The flood and soak: a micro model steps as fast as it can with the sampler at its
//! highest rate, the dashboard on a real pseudo-terminal and the JSONL log on, while the
//! test watches from outside: the process's resident memory, the log as it grows, and how
//! long the screen takes to answer a key. The run must keep a high step rate, its memory
//! must level off (every channel and history is bounded), the screen must answer within a
//! second, the log must hold every step exactly once (samples may be dropped, and the
//! dropped ones are counted), and `q` must stop it and give the terminal back. Halfway,
//! the terminal stops taking output for a few seconds (as behind a stalled ssh link): the
//! trainer must not slow down, and the screen must show how many samples it lost.
//!
//! `flood_short` runs in the normal suite (about half a minute, some 20 000 steps: more
//! than an hour of the default config). `soak` is the same harness for minutes, about
//! 900 steps a second: `./dev cargo test --release --test flood -- --ignored --nocapture`,
//! with `HEADROOM_SOAK_SECS` (default 600) setting how long it floods.
mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::bin;
use common::pty::Pty;

/// As small and as fast a run as the config accepts, with the sampler at its maximum
/// rate (100 Hz, `RunConfig::validate`) and a progress record every step.
const MICRO_CONFIG: &str = r#"
[run]
name = "flood"
steps = 1000000000
device = "cpu"
checkpoint_every = 0
eval_every = 0
eval_batches = 1
progress_every = 1
sample_hz = 100.0

[data]
seq_len = 8

[model]
n_layer = 1
n_head = 1
n_embd = 8

[batch]
micro_batch = 1
effective_batch = 1
"#;

const SAMPLE_HZ: f64 = 100.0;
/// What the log keeps of them: the highest of each slot (host/src/log_thinning.rs).
const LOGGED_HZ: f64 = 1.0 / headroom_host::log_thinning::LOG_SAMPLE_EVERY;
const COLS: u16 = 120;
/// Tall enough for the allocator/host detail panels, so every panel is drawn.
const ROWS: u16 = 40;
/// The help overlay's title (ui/src/view.rs `render_help`): on screen only while it is open.
const HELP_TITLE: &str = "help — Esc or ? to close";
/// The footer's drop counter (ui/src/view.rs `render_footer`), drawn once a sample is lost.
const DROPPED: &str = "dropped samples ";

/// Resident memory may grow from the end of the first third to the end by at most this.
/// Everything that scales with the run is bounded: the bus channels (core/src/bus.rs:
/// 8192 log lines, 1024 events, 512 metrics, slots of 528 bytes, so about 5 MiB when all
/// three fill up at once behind a lagging reader), the dashboard's histories (512 points)
/// and event log (500 entries), the controller's windows (64 observations). This is three
/// times that, for allocator slack; measured growth is well under 1 MiB. A leak of 100
/// bytes a step crosses it in a soak of five minutes (about 900 steps a second), and a
/// leak of about 1 KiB a step in the short run.
const RSS_GROWTH_BOUND: u64 = 16 << 20;
/// A flood, not a trickle: the dashboard and its telemetry may cost the trainer at most
/// this share of the pace it keeps headless on this machine (measured first, in the test:
/// the micro model steps hundreds of times a second on one core of a fast machine, tens on
/// a loaded one).
const MIN_SHARE_OF_HEADLESS: f64 = 0.25;
/// The screen answers a key within this, typically (the median of the presses)...
const MEDIAN_KEY_LATENCY: Duration = Duration::from_millis(250);
/// ...and within this at worst (a press may meet the machine busy elsewhere).
const MAX_KEY_LATENCY: Duration = Duration::from_secs(3);
/// How long a key waits for the screen before it counts as unanswered.
const KEY_TIMEOUT: Duration = Duration::from_secs(10);
/// The log gains a step at least this often while flooding (trainer and writer alive).
const MAX_STALL: Duration = Duration::from_secs(5);
/// How long the terminal stops taking output halfway through: long enough that the
/// high-rate messages sent meanwhile (two per step, plus 100 samples a second) overflow
/// the dashboard's 512-message channel (the samples alone nearly fill it).
const STALL: Duration = Duration::from_secs(5);
/// After the terminal resumes, the screen shows the drop count within this.
const DROPS_SHOWN: Duration = Duration::from_secs(5);

#[test]
fn flood_short() {
    flood(Duration::from_secs(24));
}

#[test]
#[ignore = "minutes long: run with --ignored (HEADROOM_SOAK_SECS, default 600)"]
fn soak() {
    let secs = std::env::var("HEADROOM_SOAK_SECS")
        .ok()
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .expect("HEADROOM_SOAK_SECS: seconds")
        })
        .unwrap_or(600);
    flood(Duration::from_secs(secs));
}

/// One reading of the process and the log, once a second.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// Seconds since the flood started (the first logged step).
    t: f64,
    rss: u64,
    threads: u64,
    log_bytes: u64,
    steps: u64,
}

fn flood(duration: Duration) {
    const STARTUP: Duration = Duration::from_secs(120);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("flood.toml");
    std::fs::write(&config, MICRO_CONFIG).unwrap();
    let headless = headless_steps_per_s(dir.path(), &config);
    let min_steps_per_s = MIN_SHARE_OF_HEADLESS * headless;
    let log_path = dir.path().join("run.jsonl");
    let mut cmd = bin();
    // One intra-op thread: libtorch's pool spins on a busy machine (a micro model then
    // steps 10-30 times a second on two loaded cores against about 1000 with one thread),
    // and this test is about the telemetry path under a flood, not libtorch's threading.
    cmd.env("OMP_NUM_THREADS", "1");
    cmd.current_dir(dir.path())
        .arg("train")
        .arg("--config")
        .arg(&config)
        .args(["--checkpoint-dir", "ck", "--log", "run.jsonl"]);
    let mut pty = Pty::spawn(cmd, COLS, ROWS);
    let pid = pty.child.id();
    // A failed assertion must not leave a flood writing a megabyte a second behind it.
    let mut guard = KillOnDrop(Some(pid));
    let mut screen = Screen::new(COLS as usize, ROWS as usize);
    let mut log = LogFollower::default();

    // Started: the dashboard holds the alternate screen and the log has a step.
    let begun = Instant::now();
    while !(screen.alt && log.steps > 0) {
        assert!(
            begun.elapsed() < STARTUP,
            "no dashboard or no step after {STARTUP:?} (alt screen {}, steps {}); output: {}",
            screen.alt,
            log.steps,
            screen.tail()
        );
        if let Some(status) = pty.child.try_wait().unwrap() {
            guard.0 = None;
            pump(&pty, &mut screen);
            panic!("headroom exited at start: {status:?}; {}", screen.tail());
        }
        pump(&pty, &mut screen);
        log.poll(&log_path);
        std::thread::sleep(Duration::from_millis(20));
    }

    let start = Instant::now();
    let steps_at_start = log.steps;
    let mut readings: Vec<Reading> = Vec::new();
    let mut open_latency: Vec<Duration> = Vec::new();
    let mut close_latency: Vec<Duration> = Vec::new();
    let mut unanswered: Vec<String> = Vec::new();
    let mut dropped_seen: Option<u64> = None;
    let mut dropped_before_stall: Option<u64> = None;
    let (mut next_reading, mut next_key) = (Duration::ZERO, Duration::from_secs(1));
    // Halfway: the terminal stops taking output for STALL (when, steps logged by then, the
    // stop); then the steps logged meanwhile, when it resumed, and the first drop count
    // the screen showed after it with how long that took.
    let mut stopped: Option<(Instant, u64, StoppedOutput)> = None;
    let mut stall_steps: Option<u64> = None;
    let mut resumed: Option<Instant> = None;
    let mut drops_shown: Option<(u64, Duration)> = None;
    while start.elapsed() < duration {
        if let Some(status) = pty.child.try_wait().unwrap() {
            guard.0 = None;
            pump(&pty, &mut screen);
            panic!(
                "headroom exited while flooding, {:.1}s in: {status:?}; {}",
                start.elapsed().as_secs_f64(),
                screen.tail()
            );
        }
        pump(&pty, &mut screen);
        if start.elapsed() >= next_reading {
            next_reading += Duration::from_secs(1);
            log.poll(&log_path);
            let (rss, threads) = proc_status(pid);
            readings.push(Reading {
                t: start.elapsed().as_secs_f64(),
                rss,
                threads,
                log_bytes: log.bytes,
                steps: log.steps,
            });
            if let Some(n) = screen.dropped() {
                dropped_seen = Some(n);
                if stall_steps.is_none() && stopped.is_none() {
                    dropped_before_stall = Some(n);
                }
            }
        }
        if stall_steps.is_none() && stopped.is_none() && start.elapsed() >= duration / 2 {
            log.poll(&log_path);
            stopped = Some((Instant::now(), log.steps, StoppedOutput::new(pid)));
        }
        if let Some((since, before, _)) = &stopped {
            if since.elapsed() >= STALL {
                log.poll(&log_path);
                stall_steps = Some(log.steps - before);
                stopped = None;
                resumed = Some(Instant::now());
            }
        }
        if let (Some(at), None) = (resumed, drops_shown) {
            if let Some(n) = screen.dropped().filter(|&n| n > 0) {
                drops_shown = Some((n, at.elapsed()));
            }
        }
        if stopped.is_none() && start.elapsed() >= next_key {
            next_key = start.elapsed() + Duration::from_secs(2);
            let t = start.elapsed().as_secs_f64();
            assert!(!screen.contains(HELP_TITLE), "help open before `?`");
            match press_until(&mut pty, &mut screen, b"?", |s| s.contains(HELP_TITLE)) {
                Some(d) => open_latency.push(d),
                None => unanswered.push(format!("`?` (open) at {t:.1}s")),
            }
            match press_until(&mut pty, &mut screen, b"?", |s| !s.contains(HELP_TITLE)) {
                Some(d) => close_latency.push(d),
                None => unanswered.push(format!("`?` (close) at {t:.1}s")),
            }
            // A stuck overlay would make every later press fail the same way: say it once.
            if !unanswered.is_empty() {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let flood_s = start.elapsed().as_secs_f64();
    log.poll(&log_path);
    let steps_flooded = log.steps - steps_at_start;
    let dropped_on_screen = screen.dropped().or(dropped_seen);

    // Stop: `q` finishes the step, checkpoints, restores the terminal and exits 0.
    pty.send(b"q");
    let stopping = Instant::now();
    let status = loop {
        pump(&pty, &mut screen);
        if let Some(status) = pty.child.try_wait().unwrap() {
            guard.0 = None;
            break status;
        }
        if stopping.elapsed() > STARTUP {
            let _ = pty.child.kill();
            panic!("headroom did not exit after q; {}", screen.tail());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stop_s = stopping.elapsed().as_secs_f64();
    // The reader thread may still hold the last bytes (the summary).
    let drained = Instant::now();
    while !screen.tail().contains("run stopped at step") && drained.elapsed().as_secs() < 5 {
        std::thread::sleep(Duration::from_millis(50));
        pump(&pty, &mut screen);
    }
    log.poll(&log_path);
    let tail = screen.tail();
    assert!(status.success(), "exit {status:?}; output: {tail}");
    assert!(!screen.alt, "still on the alternate screen; output: {tail}");
    assert!(screen.cursor_visible, "cursor left hidden; output: {tail}");
    assert_eq!(
        pty.line_discipline(),
        (true, true),
        "terminal restored to cooked mode with echo"
    );

    // Numbers.
    let steps_per_s = steps_flooded as f64 / flood_s;
    let third = readings
        .iter()
        .find(|r| r.t >= flood_s / 3.0)
        .or(readings.last())
        .copied()
        .expect("readings through the run");
    let end = *readings.last().unwrap();
    let late_rss = readings
        .iter()
        .filter(|r| r.t >= 2.0 * flood_s / 3.0)
        .map(|r| r.rss)
        .max()
        .unwrap_or(end.rss);
    let growth = late_rss.saturating_sub(third.rss);
    let steps_after_third = end.steps - third.steps;
    let longest_stall = readings
        .windows(2)
        .fold((0.0f64, readings[0]), |(worst, since), w| {
            if w[1].steps > since.steps {
                (worst.max(w[1].t - since.t), w[1])
            } else {
                (worst.max(w[1].t - since.t), since)
            }
        })
        .0;
    let (open_p50, open_max) = percentiles(&open_latency);
    let (close_p50, close_max) = percentiles(&close_latency);
    let finished = log.finished.clone().expect("a finished record");
    let run_t = finished["t"].as_f64().unwrap();
    let expected_samples = SAMPLE_HZ.min(LOGGED_HZ) * run_t;
    let dropped_at_exit = dropped_in_summary(&tail);
    eprintln!(
        "flood summary: {flood_s:.1}s flooding, {steps_flooded} steps ({steps_per_s:.0} steps/s; \
         {} in all, {} after the first third); RSS start {} / third {} / end {} / max late \
         {} MiB, growth {:+.2} MiB ({:.1} B/step), threads {} -> {}; log {:.1} MiB \
         ({:.0} B/step), longest gap between logged steps {longest_stall:.1}s; samples logged {} of {:.0} at \
         {LOGGED_HZ} a second of {SAMPLE_HZ} Hz ({:.1}%); help key->screen open p50 {} / max {} ms, close p50 {} / max \
         {} ms over {} presses; headless {headless:.0} steps/s; terminal stopped {STALL:?} at {:.0}s: {} steps logged \
         meanwhile, drops shown {} after {} ms; dropped before the stop: {}, on screen \
         at the end: {}, at exit: {}; stop took {stop_s:.1}s; records {:?}",
        log.last_step,
        steps_after_third,
        mib(readings[0].rss),
        mib(third.rss),
        mib(end.rss),
        mib(late_rss),
        growth as f64 / (1 << 20) as f64,
        growth as f64 / steps_after_third.max(1) as f64,
        third.threads,
        end.threads,
        log.bytes as f64 / (1 << 20) as f64,
        log.bytes as f64 / log.last_step.max(1) as f64,
        log.samples,
        expected_samples,
        100.0 * log.samples as f64 / expected_samples,
        open_p50.as_millis(),
        open_max.as_millis(),
        close_p50.as_millis(),
        close_max.as_millis(),
        open_latency.len(),
        duration.as_secs_f64() / 2.0,
        stall_steps.map_or("?".into(), |n| n.to_string()),
        drops_shown.map_or("none".into(), |d| d.0.to_string()),
        drops_shown.map_or("-".into(), |d| d.1.as_millis().to_string()),
        dropped_before_stall.map_or("none".into(), |n| n.to_string()),
        dropped_on_screen.map_or("none".into(), |n| n.to_string()),
        dropped_at_exit.map_or("none".into(), |n| n.to_string()),
        log.kinds,
    );
    // About 40 lines, whatever the length of the run.
    let every = readings.len().div_ceil(40).max(1);
    let last = readings.len() - 1;
    for r in (0..last).step_by(every).chain([last]).map(|i| &readings[i]) {
        eprintln!(
            "  t {:6.1}s  rss {:7.2} MiB  threads {:3}  steps {:8}  log {:9.2} MiB",
            r.t,
            r.rss as f64 / (1 << 20) as f64,
            r.threads,
            r.steps,
            r.log_bytes as f64 / (1 << 20) as f64
        );
    }

    // The screen answered every key, and fast.
    assert!(unanswered.is_empty(), "keys not answered: {unanswered:?}");
    assert!(
        open_latency.len() >= (duration.as_secs() / 3).max(1) as usize,
        "only {} help presses in {flood_s:.0}s",
        open_latency.len()
    );
    assert!(
        open_p50 < MEDIAN_KEY_LATENCY && close_p50 < MEDIAN_KEY_LATENCY,
        "key to screen: open median {open_p50:?}, close median {close_p50:?} \
         (bound {MEDIAN_KEY_LATENCY:?})"
    );
    assert!(
        open_max < MAX_KEY_LATENCY && close_max < MAX_KEY_LATENCY,
        "key to screen: open max {open_max:?}, close max {close_max:?} (bound {MAX_KEY_LATENCY:?})"
    );

    // A flood, that never stalled.
    assert!(
        steps_per_s >= min_steps_per_s,
        "{steps_per_s:.1} steps/s is no flood (at least {min_steps_per_s:.1}: \
         {MIN_SHARE_OF_HEADLESS} of the {headless:.1} headless)"
    );
    assert!(
        longest_stall < MAX_STALL.as_secs_f64(),
        "no step logged for {longest_stall:.1}s"
    );

    // A terminal that stops reading stalls the screen, never the trainer; the screen
    // counts the high-rate messages it lost meanwhile and shows the count once it can.
    let stall_steps = stall_steps.expect("the terminal was stopped halfway");
    assert!(
        stall_steps as f64 >= min_steps_per_s * STALL.as_secs_f64(),
        "{stall_steps} steps logged while the terminal was stopped for {STALL:?}"
    );
    let (shown, shown_after) = drops_shown.unwrap_or_else(|| {
        panic!(
            "no `{DROPPED}N` on screen after the terminal was stopped for {STALL:?}, \
             for the rest of the flood (bound {DROPS_SHOWN:?})"
        )
    });
    assert!(
        shown_after < DROPS_SHOWN,
        "the drop count took {shown_after:?} to show after the terminal resumed"
    );
    let exit_n = dropped_at_exit.expect("the drop count said at exit");
    assert!(
        exit_n >= shown,
        "exit says {exit_n} dropped, the screen showed {shown}"
    );

    // Memory levels off while the step count keeps growing.
    assert!(
        steps_after_third as f64 >= min_steps_per_s * flood_s / 3.0,
        "only {steps_after_third} steps after the first third"
    );
    assert!(
        growth < RSS_GROWTH_BOUND,
        "RSS grew {:.1} MiB after the first third ({} -> {} MiB over {steps_after_third} \
         steps; bound {} MiB)",
        growth as f64 / (1 << 20) as f64,
        mib(third.rss),
        mib(late_rss),
        RSS_GROWTH_BOUND >> 20
    );

    // The log is lossless for steps, whole, and carries samples.
    assert_eq!(
        log.bad_lines, 0,
        "unparsable log lines, first: {:?}",
        log.first_bad
    );
    assert!(log.partial.is_empty(), "the log ends mid-line");
    assert!(
        log.gaps.is_empty(),
        "steps missing or repeated in the log (expected, got): {:?}",
        log.gaps
    );
    assert_eq!(
        finished["steps_done"].as_u64(),
        Some(log.last_step),
        "finished: {finished}"
    );
    assert_eq!(log.steps, log.last_step, "steps 1..={}", log.last_step);
    assert_eq!(finished["stopped_by_user"], true);
    assert!(
        tail.contains(&format!("run stopped at step {}/", log.last_step)),
        "summary: {tail}"
    );
    assert!(log.samples > 0, "no sample records");
    // The sampler may fall behind 100 Hz on a loaded machine (or slow itself where its
    // reads cost too much) and the log's queue may drop readings, but the log keeps only
    // 4 a second of them: half of those missing over the whole run is a stalled sampler.
    assert!(
        log.samples as f64 >= 0.5 * expected_samples,
        "{} samples logged, {expected_samples:.0} expected at {LOGGED_HZ} a second",
        log.samples
    );
    // The count only grows: the screen's last one is at most the exit's.
    if let Some(screen_n) = dropped_on_screen {
        assert!(screen_n <= exit_n, "screen {screen_n} > exit {exit_n}");
    }
}

/// The child's terminal stops taking output, as behind a stalled ssh connection:
/// `tcflow(TCOOFF)` on its pty, so its writes block until this is dropped (`TCOON`).
struct StoppedOutput(File);

impl StoppedOutput {
    fn new(pid: u32) -> StoppedOutput {
        let path = std::fs::read_link(format!("/proc/{pid}/fd/1")).expect("the child's tty");
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        // SAFETY: tcflow on an open tty fd.
        let rc = unsafe { libc::tcflow(tty.as_raw_fd(), libc::TCOOFF) };
        assert_eq!(rc, 0, "tcflow(TCOOFF) on {}", path.display());
        StoppedOutput(tty)
    }
}

impl Drop for StoppedOutput {
    fn drop(&mut self) {
        // SAFETY: as above.
        let rc = unsafe { libc::tcflow(self.0.as_raw_fd(), libc::TCOON) };
        assert_eq!(rc, 0, "tcflow(TCOON)");
    }
}

/// Kills the child unless it was reaped (so its pid is still ours).
struct KillOnDrop(Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // SAFETY: kill has no memory effects; the pid is our unreaped child's.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1 << 20) as f64)
}

/// The micro model's steps per second headless (no dashboard) on this machine, the same
/// config, log and sampler, one thread: past its first tenth, from the step records' clock.
fn headless_steps_per_s(dir: &Path, config: &Path) -> f64 {
    let out = bin()
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .args(["train", "--headless", "--config"])
        .arg(config)
        .args(["--steps", "1000", "--log", "headless.jsonl"])
        .output()
        .expect("running headroom");
    assert!(out.status.success(), "{}", common::stderr(&out));
    let log = common::read_log(&dir.join("headless.jsonl"));
    let steps = common::of_kind(&log, "step");
    let (a, b) = (steps[steps.len() / 10], steps[steps.len() - 1]);
    let n = b["step"].as_u64().unwrap() - a["step"].as_u64().unwrap();
    n as f64 / (b["t"].as_f64().unwrap() - a["t"].as_f64().unwrap())
}

/// (median, max); zero when empty.
fn percentiles(xs: &[Duration]) -> (Duration, Duration) {
    let mut xs = xs.to_vec();
    xs.sort();
    (
        xs.get(xs.len() / 2).copied().unwrap_or_default(),
        xs.last().copied().unwrap_or_default(),
    )
}

/// The count in `headroom: N high-rate samples were dropped ...` (src/main.rs), if said.
fn dropped_in_summary(out: &str) -> Option<u64> {
    let at = out.find(" high-rate samples were dropped")?;
    out[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
}

/// (VmRSS in bytes, Threads) of a live process.
fn proc_status(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:") * 1024, field("Threads:"))
}

fn pump(pty: &Pty, screen: &mut Screen) {
    let bytes = pty.take_output();
    screen.feed(&bytes);
}

/// Sends `key` once everything before it is on the screen, then the time until `done`
/// holds for the screen; `None` after [`KEY_TIMEOUT`].
fn press_until(
    pty: &mut Pty,
    screen: &mut Screen,
    key: &[u8],
    done: impl Fn(&Screen) -> bool,
) -> Option<Duration> {
    pump(pty, screen);
    let sent = Instant::now();
    pty.send(key);
    while sent.elapsed() < KEY_TIMEOUT {
        pump(pty, screen);
        if done(screen) {
            return Some(sent.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Follows the JSONL log as it grows: counts records by kind, checks that the step
/// records run 1, 2, 3, ... without a gap or a repeat, and keeps nothing else.
#[derive(Default)]
struct LogFollower {
    file: Option<File>,
    /// An incomplete last line (the writer is mid-line).
    partial: Vec<u8>,
    bytes: u64,
    steps: u64,
    last_step: u64,
    samples: u64,
    kinds: BTreeMap<String, u64>,
    /// (expected, got) for the first few out-of-order steps.
    gaps: Vec<(u64, u64)>,
    bad_lines: u64,
    first_bad: Option<String>,
    finished: Option<serde_json::Value>,
}

impl LogFollower {
    fn poll(&mut self, path: &Path) {
        if self.file.is_none() {
            self.file = File::open(path).ok();
        }
        let Some(file) = self.file.as_mut() else {
            return;
        };
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).expect("reading the log");
        self.bytes += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return;
        };
        let rest = self.partial.split_off(end + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        for line in complete.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            self.line(line);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let value: serde_json::Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(_) => {
                self.bad_lines += 1;
                self.first_bad
                    .get_or_insert_with(|| String::from_utf8_lossy(line).into_owned());
                return;
            }
        };
        let kind = value["kind"].as_str().unwrap_or("?").to_string();
        match kind.as_str() {
            "step" => {
                let step = value["step"].as_u64().unwrap_or(0);
                if step != self.last_step + 1 && self.gaps.len() < 10 {
                    self.gaps.push((self.last_step + 1, step));
                }
                self.last_step = step;
                self.steps += 1;
            }
            "sample" => self.samples += 1,
            "finished" => self.finished = Some(value),
            _ => {}
        }
        *self.kinds.entry(kind).or_default() += 1;
    }
}

/// Just enough of a terminal to read the dashboard back: cursor moves, clears, the
/// alternate screen and the cursor's visibility, and printable characters one column
/// each (ratatui moves the cursor after a wide one). ratatui writes only the cells that
/// changed, so the byte stream alone does not hold the screen's text; this does.
struct Screen {
    cols: usize,
    rows: usize,
    cells: Vec<char>,
    row: usize,
    col: usize,
    alt: bool,
    cursor_visible: bool,
    /// Bytes of an escape sequence or a character cut by the read.
    pending: Vec<u8>,
    /// The last bytes as written, for messages and the summary after the screen closes.
    raw_tail: Vec<u8>,
}

const RAW_TAIL: usize = 64 << 10;

impl Screen {
    fn new(cols: usize, rows: usize) -> Screen {
        Screen {
            cols,
            rows,
            cells: vec![' '; cols * rows],
            row: 0,
            col: 0,
            alt: false,
            cursor_visible: true,
            pending: Vec::new(),
            raw_tail: Vec::new(),
        }
    }

    fn feed(&mut self, data: &[u8]) {
        self.raw_tail.extend_from_slice(data);
        if self.raw_tail.len() > 2 * RAW_TAIL {
            let cut = self.raw_tail.len() - RAW_TAIL;
            self.raw_tail.drain(..cut);
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(data);
        let mut i = 0;
        while i < buf.len() {
            match self.token(&buf[i..]) {
                Some(n) => i += n,
                None => break,
            }
        }
        self.pending = buf.split_off(i);
    }

    /// Consumes the token at the start of `b` and says how long it was; `None` when it
    /// is cut off (the rest comes with the next read).
    fn token(&mut self, b: &[u8]) -> Option<usize> {
        match b[0] {
            0x1b => match *b.get(1)? {
                b'[' => {
                    let len = 2 + b[2..].iter().position(|c| (0x40..=0x7e).contains(c))?;
                    self.csi(&b[2..len], b[len]);
                    Some(len + 1)
                }
                b']' => {
                    // Operating-system command: ends with BEL or ESC '\'.
                    let end = b[2..].iter().position(|&c| c == 0x07 || c == 0x1b)? + 2;
                    if b[end] == 0x07 {
                        Some(end + 1)
                    } else {
                        b.get(end + 1)?;
                        Some(end + 2)
                    }
                }
                b'(' | b')' => b.get(2).map(|_| 3),
                _ => Some(2),
            },
            b'\r' => {
                self.col = 0;
                Some(1)
            }
            b'\n' => {
                self.row = (self.row + 1).min(self.rows - 1);
                Some(1)
            }
            0x08 => {
                self.col = self.col.saturating_sub(1);
                Some(1)
            }
            c if c < 0x20 || c == 0x7f => Some(1),
            c => {
                let len = match c {
                    0xc0..=0xdf => 2,
                    0xe0..=0xef => 3,
                    0xf0..=0xf7 => 4,
                    _ => 1,
                };
                let bytes = b.get(..len)?;
                let ch = std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.chars().next())
                    .unwrap_or('\u{fffd}');
                if self.row < self.rows && self.col < self.cols {
                    self.cells[self.row * self.cols + self.col] = ch;
                }
                self.col += 1;
                Some(len)
            }
        }
    }

    fn csi(&mut self, params: &[u8], fin: u8) {
        let text = String::from_utf8_lossy(params);
        let private = text.starts_with('?');
        let nums: Vec<usize> = text
            .trim_start_matches('?')
            .split(';')
            .map(|p| p.parse().unwrap_or(0))
            .collect();
        let n = |i: usize| nums.get(i).copied().filter(|&v| v > 0).unwrap_or(1);
        match fin {
            b'H' | b'f' => {
                self.row = (n(0) - 1).min(self.rows - 1);
                self.col = (n(1) - 1).min(self.cols - 1);
            }
            b'A' => self.row = self.row.saturating_sub(n(0)),
            b'B' => self.row = (self.row + n(0)).min(self.rows - 1),
            b'C' => self.col = (self.col + n(0)).min(self.cols - 1),
            b'D' => self.col = self.col.saturating_sub(n(0)),
            b'G' => self.col = (n(0) - 1).min(self.cols - 1),
            b'J' => {
                let from = match nums[0] {
                    0 => self.row * self.cols + self.col.min(self.cols),
                    _ => 0,
                };
                self.cells[from..].fill(' ');
            }
            b'K' => {
                let line = self.row * self.cols;
                let from = if nums[0] == 0 {
                    line + self.col.min(self.cols)
                } else {
                    line
                };
                self.cells[from..line + self.cols].fill(' ');
            }
            b'h' | b'l' if private => {
                let on = fin == b'h';
                for &mode in &nums {
                    match mode {
                        1049 | 1047 | 47 => {
                            self.alt = on;
                            self.cells.fill(' ');
                        }
                        25 => self.cursor_visible = on,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }

    fn contains(&self, needle: &str) -> bool {
        (0..self.rows).any(|r| self.row_text(r).contains(needle))
    }

    fn row_text(&self, r: usize) -> String {
        self.cells[r * self.cols..(r + 1) * self.cols]
            .iter()
            .collect()
    }

    /// The footer's `dropped samples N`, when shown.
    fn dropped(&self) -> Option<u64> {
        (0..self.rows).rev().find_map(|r| {
            let row = self.row_text(r);
            let at = row.find(DROPPED)? + DROPPED.len();
            let digits: String = row[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    }

    fn tail(&self) -> String {
        let from = self.raw_tail.len().saturating_sub(4000);
        String::from_utf8_lossy(&self.raw_tail[from..]).into_owned()
    }
}

/// The screen model reads back what ratatui's diffs write: text split by cursor moves and
/// colours, cut mid-sequence and mid-character by the reads, cleared by the alternate
/// screen's exit.
#[test]
fn screen_model_reads_diffed_output() {
    let mut s = Screen::new(40, 5);
    let stream = "\x1b[?1049h\x1b[?25l\x1b[5;20Hdropped\x1b[5;28Hsamples\x1b[38;5;8m 7\x1b[0m\
                  \x1b[2;3H\u{250c} help \u{2014} Esc or ? to close \u{2510}";
    for chunk in stream.as_bytes().chunks(3) {
        s.feed(chunk);
    }
    assert!(s.alt && !s.cursor_visible);
    assert!(s.contains(HELP_TITLE), "{:?}", s.row_text(1));
    assert_eq!(s.dropped(), Some(7));
    s.feed(b"\x1b[5;37H2");
    assert_eq!(s.dropped(), Some(72));
    s.feed(b"\x1b[?1049l\x1b[?25hheadroom: 3 high-rate samples were dropped on the way");
    assert!(!s.alt && s.cursor_visible && !s.contains(HELP_TITLE));
    assert_eq!(dropped_in_summary(&s.tail()), Some(3));
}
