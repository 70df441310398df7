//! What attached viewers cost a run, and how fast an attached screen is full.
//!
//!     ./dev cargo bench --bench viewers              # 4 rounds of 0 vs 3 viewers, 300 steps
//!     ./dev cargo bench --bench viewers -- 6 400     # rounds, steps
//!     ./dev cargo bench --bench viewers -- 2 100 throughput   # without the attach part
//!
//! 1. Throughput: `headroom train --headless` on the default config, alternately with no
//!    viewer and with three viewers attached from the first step to the last (each reads
//!    and parses every line, as `headroom attach` does). Steps per second come from the
//!    run log's own clock (`t` of step 2 to the last step), so start-up and the final
//!    checkpoint are outside the measurement. Reported: the median of each side and
//!    their ratio; and, free of that noise, the CPU time of the stream server's threads
//!    (hub, listeners, a writer and a reader per viewer) against the whole run's, from the
//!    kernel's per-thread scheduler statistics.
//! 2. Attach to first full frame: a run with a full catch-up (512 steps, 1200 samples,
//!    500 events: what ten minutes of a default run leave, reached here in under a minute
//!    with `sample_hz = 40` on the tiny model), then ten attaches, each timed from
//!    `connect` to the first frame rendered (200×60, every panel) from the caught-up
//!    state: the handshake, the catch-up's transfer and parsing, applying it to the
//!    dashboard's state and drawing it.
//!
//! On a machine without a toolchain, run the built bench binary with `HEADROOM_BIN`
//! pointing at the `headroom` binary (the compiled-in path is the build machine's).
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use headroom_core::protocol::{ServerControl, ServerLine};
use headroom_core::RunConfig;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn headroom_bin() -> PathBuf {
    std::env::var_os("HEADROOM_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_headroom").into())
        .into()
}

fn start(config: &Path, dir: &Path, tag: &str, steps: u64) -> Child {
    Command::new(headroom_bin())
        .current_dir(dir)
        .env("HEADROOM_RUNTIME_DIR", dir.join("rt"))
        .args(["train", "--headless", "--overwrite", "--config"])
        .arg(config)
        .args(["--steps", &steps.to_string(), "--checkpoint-dir"])
        .arg(dir.join(format!("ck-{tag}")))
        .arg("--log")
        .arg(dir.join(format!("{tag}.jsonl")))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting headroom")
}

fn socket_of(dir: &Path, pid: u32) -> PathBuf {
    let want = format!("-{pid}.sock");
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        for e in std::fs::read_dir(dir.join("rt"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if e.path().to_string_lossy().ends_with(&want) {
                return e.path();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no socket for pid {pid}");
}

fn hello() -> String {
    "{\"kind\":\"hello\",\"protocol\":\"1.0\",\"client\":\"bench\"}\n".into()
}

/// A viewer that reads and parses every line until the run ends; returns lines read.
fn viewer(socket: PathBuf) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut s = UnixStream::connect(&socket).expect("connect");
        s.write_all(hello().as_bytes()).unwrap();
        let mut n = 0;
        for line in BufReader::new(s).lines() {
            let Ok(line) = line else { break };
            let _ = ServerLine::parse(&line);
            n += 1;
        }
        n
    })
}

/// Steps per second of a finished run, from its log's clock (step 2 to the last step).
fn steps_per_s(log: &Path) -> f64 {
    let mut first = None;
    let mut last = (0u64, 0.0f64);
    for line in std::fs::read_to_string(log).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["kind"] == "step" {
            let (step, t) = (v["step"].as_u64().unwrap(), v["t"].as_f64().unwrap());
            if step == 2 {
                first = Some(t);
            }
            last = (step, t);
        }
    }
    let t0 = first.expect("step 2 logged");
    (last.0 - 2) as f64 / (last.1 - t0)
}

/// CPU nanoseconds per thread of process `pid` (keyed `name/tid`), from the scheduler's
/// statistics, read from outside so the measurement adds nothing to the run.
fn thread_cpu(pid: u32) -> std::collections::HashMap<String, u64> {
    let mut out = std::collections::HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let ns: u64 = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let tid = dir.file_name().unwrap().to_string_lossy().to_string();
        out.insert(format!("{}/{tid}", comm.trim()), ns);
    }
    out
}

/// Polls a run's threads until it exits; returns (the stream server's threads, all
/// threads) in CPU seconds, each thread at the last value seen (threads that exit early
/// keep what they used).
fn watch_cpu(pid: u32, child: &mut Child) -> (f64, f64) {
    let mut last = std::collections::HashMap::new();
    while child.try_wait().unwrap().is_none() {
        last.extend(thread_cpu(pid));
        std::thread::sleep(Duration::from_millis(200));
    }
    let serve = |name: &str| name.starts_with("serve-") || name.starts_with("viewer-");
    let (mut s, mut all) = (0u64, 0u64);
    for (k, v) in &last {
        all += v;
        if serve(k) {
            s += v;
        }
    }
    (s as f64 / 1e9, all as f64 / 1e9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn throughput(dir: &Path, rounds: usize, steps: u64) {
    let mut cfg = RunConfig::default();
    cfg.run.eval_every = 0;
    cfg.run.checkpoint_every = 0;
    let config = dir.join("bench.toml");
    std::fs::write(&config, cfg.to_toml()).unwrap();
    let (mut alone, mut watched) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for viewers in [0usize, 3] {
            let tag = format!("r{round}-v{viewers}");
            let mut child = start(&config, dir, &tag, steps);
            let readers: Vec<_> = if viewers > 0 {
                let sock = socket_of(dir, child.id());
                (0..viewers).map(|_| viewer(sock.clone())).collect()
            } else {
                Vec::new()
            };
            let (serve_s, all_s) = watch_cpu(child.id(), &mut child);
            assert!(child.wait().unwrap().success(), "run {tag} failed");
            println!(
                "round {round}: {viewers} viewers: the stream server's threads used {serve_s:.3} \
                 CPU s of the run's {all_s:.1} ({:.3}%)",
                100.0 * serve_s / all_s
            );
            let lines: Vec<u64> = readers.into_iter().map(|r| r.join().unwrap()).collect();
            let rate = steps_per_s(&dir.join(format!("{tag}.jsonl")));
            println!("round {round}: {viewers} viewers {rate:.3} steps/s (lines read {lines:?})");
            if viewers == 0 {
                alone.push(rate);
            } else {
                watched.push(rate);
            }
        }
    }
    let (a, w) = (median(alone), median(watched));
    println!(
        "throughput: 0 viewers {a:.3} steps/s, 3 viewers {w:.3} steps/s, ratio {:.4} ({:+.2}%)",
        w / a,
        (w / a - 1.0) * 100.0
    );
}

/// Connect, catch up, build the dashboard state and draw it; the time that takes.
fn attach_once(socket: &Path, terminal: &mut Terminal<TestBackend>) -> (Duration, usize) {
    let started = Instant::now();
    let mut s = UnixStream::connect(socket).expect("connect");
    s.write_all(hello().as_bytes()).unwrap();
    let mut reader = BufReader::new(s);
    let mut app = headroom_ui::App::new("bench", true);
    let mut n = 0;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("the stream ended before caught_up");
        }
        match ServerLine::parse(line.trim_end()) {
            Ok(ServerLine::Record(r)) => {
                app.apply_record(&r);
                n += 1;
            }
            Ok(ServerLine::Control(ServerControl::CaughtUp { .. })) => break,
            _ => {}
        }
    }
    terminal
        .draw(|f| headroom_ui::view::render(f, &app))
        .unwrap();
    (started.elapsed(), n)
}

fn attach_latency(dir: &Path) {
    let mut cfg = RunConfig::default();
    cfg.model.n_layer = 1;
    cfg.model.n_head = 2;
    cfg.model.n_embd = 32;
    cfg.data.seq_len = 32;
    cfg.batch.micro_batch = 8;
    cfg.batch.effective_batch = 8;
    cfg.run.eval_every = 50;
    cfg.run.checkpoint_every = 0;
    cfg.run.sample_hz = 40.0;
    let config = dir.join("latency.toml");
    std::fs::write(&config, cfg.to_toml()).unwrap();
    let mut child = start(&config, dir, "latency", 10_000_000);
    let sock = socket_of(dir, child.id());
    // Until the catch-up is full: 1200 samples at 40 Hz, and 512 steps long before.
    std::thread::sleep(Duration::from_secs(40));
    let mut terminal = Terminal::new(TestBackend::new(200, 60)).unwrap();
    let mut times = Vec::new();
    let mut records = 0;
    for _ in 0..10 {
        let (t, n) = attach_once(&sock, &mut terminal);
        times.push(t.as_secs_f64() * 1000.0);
        records = n;
    }
    let _ = child.kill();
    let _ = child.wait();
    let max = times.iter().cloned().fold(0.0, f64::max);
    println!(
        "attach to first full frame ({records} catch-up records, 200×60): median {:.1} ms, \
         max {max:.1} ms over 10 attaches",
        median(times)
    );
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let rounds = args.first().and_then(|a| a.parse().ok()).unwrap_or(4);
    let steps = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let dir = tempfile::tempdir().unwrap();
    if !std::env::args().any(|a| a == "throughput") {
        attach_latency(dir.path());
    }
    throughput(dir.path(), rounds, steps);
}
