//! What the telemetry sampler costs: CPU time of the `sampler` thread of a real
//! `headroom train --headless` run, per second of wall time, at several rates.
//!
//!     ./dev cargo bench --bench telemetry                     # CPU run, default model
//!     ./dev cargo bench --bench telemetry -- configs/gpu.toml # its device (NVML, allocator)
//!     ./dev cargo bench --bench telemetry -- 10               # seconds measured per rate
//!
//! The thread's CPU time comes from the kernel's scheduler statistics
//! (`/proc/PID/task/TID/schedstat`, nanoseconds), read from outside the process, so the
//! measurement adds nothing to what it measures. The trainer runs meanwhile, as it does
//! for a user: the sampler's figures include whatever contention that brings.
//!
//! On a machine without a toolchain, run the built bench binary with `HEADROOM_BIN`
//! pointing at the `headroom` binary (the compiled-in path is the build machine's).
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use headroom_core::RunConfig;

/// Rates to measure, Hz; 20 is `run.sample_hz`'s default, 100 the most it accepts (the
/// sampler slows itself where its reads pass `sampler::READ_BUDGET`: a rate's share then
/// stays near that budget, and its µs a sample are of the rate asked, not the one read).
const RATES: [f64; 6] = [4.0, 10.0, 20.0, 50.0, 64.0, 100.0];

fn headroom_bin() -> PathBuf {
    std::env::var_os("HEADROOM_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_headroom").into())
        .into()
}

/// CPU nanoseconds of the thread named `name` in process `pid`.
fn thread_cpu_ns(pid: u32, name: &str) -> Option<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
            return stat.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

fn start(cfg: &RunConfig, dir: &Path, hz: f64) -> Child {
    let mut cfg = cfg.clone();
    cfg.run.sample_hz = hz;
    let path = dir.join(format!("telemetry-{hz}.toml"));
    std::fs::write(&path, cfg.to_toml()).unwrap();
    Command::new(headroom_bin())
        .current_dir(dir)
        .args(["train", "--headless", "--config"])
        .arg(&path)
        .arg("--checkpoint-dir")
        .arg(dir.join(format!("ck-{hz}")))
        // A repeated rate replaces its earlier run's checkpoints.
        .arg("--overwrite")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting headroom")
}

/// Share of one core the sampler used over `window`, after a second of warm-up.
fn measure(cfg: &RunConfig, dir: &Path, hz: f64, window: Duration) -> f64 {
    let mut child = start(cfg, dir, hz);
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(120);
    // The sampler starts once the model is built; wait for it and let it settle.
    while thread_cpu_ns(pid, "sampler").is_none() {
        assert!(Instant::now() < deadline, "no sampler thread in headroom");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let (c0, t0) = (thread_cpu_ns(pid, "sampler").unwrap(), Instant::now());
    std::thread::sleep(window);
    let (c1, t1) = (thread_cpu_ns(pid, "sampler").unwrap(), Instant::now());
    // SIGTERM: a graceful stop, as a user's would be.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = child.wait();
    (c1 - c0) as f64 / (t1 - t0).as_nanos() as f64
}

fn main() {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let path = raw.iter().find(|a| a.ends_with(".toml"));
    let secs = raw.iter().find_map(|a| a.parse::<u64>().ok()).unwrap_or(8);
    let mut cfg = match path {
        Some(p) => RunConfig::load(Path::new(p)).unwrap_or_else(|e| panic!("{e}")),
        None => RunConfig::default(),
    };
    cfg.run.steps = 1_000_000;
    cfg.run.eval_every = 0;
    cfg.run.checkpoint_every = 0;
    let dir = tempfile::tempdir().unwrap();
    println!(
        "sampler thread CPU per wall second, {} model on {}, {secs} s per rate",
        path.map_or("default", |p| p.as_str()),
        cfg.run.device
    );
    println!("| rate (Hz) | sampler CPU (% of one core) | per sample (µs) |");
    println!("|---|---|---|");
    let mut best_under_1pct = None;
    for hz in RATES {
        let share = measure(&cfg, dir.path(), hz, Duration::from_secs(secs));
        println!("| {hz} | {:.3}% | {:.0} |", share * 100.0, share / hz * 1e6);
        if share < 0.01 {
            best_under_1pct = Some(hz);
        }
    }
    match best_under_1pct {
        Some(hz) if hz == RATES[RATES.len() - 1] => {
            println!(
                "under 1% of a core at every rate up to {hz} Hz (the most run.sample_hz accepts)"
            )
        }
        Some(hz) => println!("highest measured rate under 1% of a core: {hz} Hz"),
        None => println!("no measured rate stays under 1% of a core"),
    }
}
