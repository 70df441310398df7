//! The sampler thread: host, NVML, allocator (or, on the CPU, heap) figures at the rate
//! asked, or slower where its reads cost more than [`READ_BUDGET`], off the trainer's hot
//! path. Every source that is missing becomes one notice, then silence.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use headroom_core::{
    AllocatorStats, Bus, GpuStats, HeapStats, HostStats, Level, Notice, SegmentMap, SystemSample,
    Telemetry,
};
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::Nvml;
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

/// A snapshot walks every block under the allocator's lock: modest rate, not every tick.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(2);

/// The host's figures (CPU load, host memory) and the heap's come from several /proc
/// files, 40–50 µs each on a VM: read at most this often. The process's resident set, the
/// figure a spike shows in, is read every sample (one statm read), so the chart keeps
/// the rate asked for (docs/BENCHMARKS.md, "Telemetry cost").
const HOST_EVERY: Duration = Duration::from_millis(250);

/// A GPU's utilisation, temperature and power (three NVML calls, and the name once) change
/// slowly and no OOM hides in them: read at most this often; its memory every sample.
const GPU_SLOW_EVERY: Duration = HOST_EVERY;

/// The share of one core a sample's reads may take (the sampler thread's own CPU time,
/// the segment map's snapshots apart): past it the rate falls until it fits. A reading
/// costs what the machine makes it cost (/proc on a VM, NVML on a busy driver, the GIL
/// for a Python run's allocator), so the rate asked is a ceiling, not a promise; the
/// other half of 1% is the sample's trip (bus, log, viewers).
pub const READ_BUDGET: f64 = 0.005;

/// How long the sampler measures its reads before it judges their rate.
const PACE_WINDOW: Duration = Duration::from_secs(2);

/// Which accelerator the run uses; `None` for a CPU run (then GPU figures would describe
/// a device the run does not touch, so none are read).
pub type CudaIndex = Option<usize>;

/// The CUDA caching allocator of whatever trains: libtorch through the built-in trainer's
/// shim, or `torch.cuda` through Python. Read on the sampler's thread.
pub trait AllocatorSource: Send {
    /// The allocator's statistics; `None` when there is no accelerator.
    fn stats(&mut self) -> Option<Result<AllocatorStats, String>>;
    /// The segment map; `None` when there is no accelerator.
    fn segments(&mut self) -> Option<Result<SegmentMap, String>>;
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    /// `allocator` is read only when `cuda` names a device.
    pub fn start(
        bus: Bus,
        cuda: CudaIndex,
        hz: f64,
        allocator: Option<Box<dyn AllocatorSource>>,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let period = Duration::from_secs_f64(1.0 / hz);
        // To say so if the thread cannot start (the closure, and its bus, are gone then).
        let told = bus.clone();
        let thread = std::thread::Builder::new()
            .name("sampler".into())
            .spawn(move || {
                let mut sources = Sources::open(&bus, cuda, allocator);
                let mut pace = Pace::new(period);
                // The thread's CPU time at the end of the last sample: each sample's cost
                // is all of it since (reads, sends, the wait's own wake-up), one clock
                // read a sample; the segment map's snapshot is timed apart and left out.
                let mut last = thread_cpu();
                while !stopped.load(Ordering::Acquire) {
                    bus.send(Telemetry::Sample(sources.read(&bus)));
                    let mut apart = Duration::ZERO;
                    if sources.segments_due() {
                        let before = thread_cpu();
                        if let Some(map) = sources.segments(&bus) {
                            bus.send(Telemetry::Segments(map));
                        }
                        apart = since(before);
                    }
                    let now = thread_cpu();
                    if let (Some(now), Some(last)) = (now, last) {
                        let cost = now.saturating_sub(last).saturating_sub(apart);
                        if let Some(slowed) = pace.record(cost, Instant::now()) {
                            bus.send(Telemetry::Notice(slowed));
                        }
                    }
                    last = now;
                    // Parked, not waiting on a channel: a channel's receive spins and
                    // yields before it sleeps, which cost more than a cheap reading.
                    let until = Instant::now() + pace.period;
                    while !stopped.load(Ordering::Acquire) {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::park_timeout(left);
                    }
                }
            });
        // A hard cap with no room left for a thread's stack refuses it: the run goes on
        // without live figures (each step still reports its own peak), and says so.
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                told.send(Telemetry::Notice(Notice::new(
                    Level::Warn,
                    "sampler",
                    format!(
                        "the sampler's thread could not start ({e}): no live host or device \
                         figures this run; each step still records its own peak"
                    ),
                )));
                None
            }
        };
        Sampler { stop, thread }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// The CPU time this thread has used; `None` where the clock is missing (then the rate
/// asked is kept).
fn thread_cpu() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which lives on this stack frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// The CPU time this thread has used since `before` (zero where the clock is missing).
fn since(before: Option<Duration>) -> Duration {
    thread_cpu()
        .zip(before)
        .map_or(Duration::ZERO, |(now, b)| now.saturating_sub(b))
}

/// The sampler's period: the one asked, or longer while a sample's reads would take more
/// than [`READ_BUDGET`] of a core at it. Judged every [`PACE_WINDOW`] from the CPU time
/// the reads took, so a slow phase (a loaded driver) slows it and its end lets it back.
struct Pace {
    asked: Duration,
    period: Duration,
    window: Option<(Instant, Duration, u32)>,
    /// Said once: the first time the rate fell below the one asked.
    told: bool,
}

impl Pace {
    fn new(asked: Duration) -> Pace {
        Pace {
            asked,
            period: asked,
            window: None,
            told: false,
        }
    }

    /// One sample's reads took `cost` of this thread's CPU; a notice when the rate first
    /// falls below the one asked.
    fn record(&mut self, cost: Duration, now: Instant) -> Option<Notice> {
        // The first reading opens the sources' files and NVML's handles: not a sample's cost.
        let Some((since, spent, n)) = self.window.as_mut() else {
            self.window = Some((now, Duration::ZERO, 0));
            return None;
        };
        *spent += cost;
        *n += 1;
        if now.duration_since(*since) < PACE_WINDOW {
            return None;
        }
        let per_sample = *spent / *n;
        self.window = Some((now, Duration::ZERO, 0));
        let was = self.period;
        self.period = paced(self.asked, per_sample);
        if self.period <= self.asked || self.period == was || self.told {
            return None;
        }
        self.told = true;
        let hz = |p: Duration| 1.0 / p.as_secs_f64();
        Some(Notice::new(
            Level::Info,
            "sampler",
            format!(
                "live figures at {:.1} Hz instead of the {:.0} asked: a sample's reads take \
                 {} µs of CPU here, kept under {}% of a core (each step still records its \
                 own peak)",
                hz(self.period),
                hz(self.asked),
                per_sample.as_micros(),
                READ_BUDGET * 100.0
            ),
        ))
    }
}

/// The shortest period at which reads costing `per_sample` stay within [`READ_BUDGET`],
/// never shorter than the one asked.
fn paced(asked: Duration, per_sample: Duration) -> Duration {
    asked.max(per_sample.div_f64(READ_BUDGET))
}

struct Sources {
    sys: Option<System>,
    pid: Option<Pid>,
    nvml: Option<Nvml>,
    cuda: CudaIndex,
    alloc: Option<Box<dyn AllocatorSource>>,
    gpu_failed: bool,
    /// NVML reads that answered; `fail_gpu_after` of them, then NVML "loses the GPU"
    /// (`HEADROOM_INJECT_NVML_FAILURE=N`: the test of a driver failing mid-run).
    gpu_reads: u64,
    fail_gpu_after: Option<u64>,
    allocator_failed: bool,
    last_snapshot: Option<Instant>,
    snapshot_failed: bool,
    /// The last full host and heap figures, and when they were read.
    host_read: Option<(Instant, HostStats, Option<HeapStats>)>,
    /// The GPU's slow figures (see [`GPU_SLOW_EVERY`]), and when they were read.
    gpu_slow: Option<(Instant, GpuStats)>,
}

impl Sources {
    fn open(bus: &Bus, cuda: CudaIndex, alloc: Option<Box<dyn AllocatorSource>>) -> Sources {
        let sys = match System::new() {
            Ok(s) => Some(s),
            Err(e) => {
                notice(
                    bus,
                    Level::Warn,
                    "host",
                    format!("host figures unavailable: {e}"),
                );
                None
            }
        };
        let nvml = match Nvml::init() {
            Ok(n) => Some(n),
            Err(e) => {
                bus.send(Telemetry::Notice(nvml_unavailable(
                    cuda.is_some(),
                    &e.to_string(),
                )));
                None
            }
        };
        Sources {
            sys,
            pid: sysinfo::get_current_pid().ok(),
            nvml,
            cuda,
            alloc,
            gpu_failed: false,
            gpu_reads: 0,
            fail_gpu_after: std::env::var("HEADROOM_INJECT_NVML_FAILURE")
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            allocator_failed: false,
            last_snapshot: None,
            snapshot_failed: false,
            host_read: None,
            gpu_slow: None,
        }
    }

    fn read(&mut self, bus: &Bus) -> SystemSample {
        let (host, heap) = self.host_and_heap();
        SystemSample {
            host,
            gpu: self.gpu(bus),
            allocator: self.allocator(bus),
            heap,
        }
    }

    /// The host's figures and (on the CPU, where glibc's malloc under libtorch is the
    /// allocator) the heap's: read in full every [`HOST_EVERY`]; between, the last ones
    /// with the resident set read now.
    fn host_and_heap(&mut self) -> (HostStats, Option<HeapStats>) {
        match &self.host_read {
            Some((at, host, heap)) if at.elapsed() < HOST_EVERY => {
                let mut host = host.clone();
                if let Some(rss) = crate::procmem::rss_bytes() {
                    host.process_rss = rss;
                }
                (host, heap.clone())
            }
            _ => {
                let host = self.host();
                let heap = match self.cuda {
                    None => crate::procmem::heap_stats(),
                    Some(_) => None,
                };
                self.host_read = Some((Instant::now(), host.clone(), heap.clone()));
                (host, heap)
            }
        }
    }

    fn host(&mut self) -> HostStats {
        let Some(sys) = self.sys.as_mut() else {
            return HostStats::default();
        };
        sys.refresh_cpu_usage();
        sys.refresh_memory();
        let mut rss = 0;
        if let Some(pid) = self.pid {
            sys.refresh_processes_specifics(
                ProcessesToUpdate::Some(&[pid]),
                false,
                ProcessRefreshKind::nothing().with_memory(),
            );
            rss = sys.process(pid).map(|p| p.memory()).unwrap_or(0);
        }
        HostStats {
            cpu_percent: sys.global_cpu_usage(),
            mem_used: sys.used_memory(),
            mem_total: sys.total_memory(),
            mem_available: sys.available_memory(),
            process_rss: rss,
        }
    }

    fn gpu(&mut self, bus: &Bus) -> Option<GpuStats> {
        let (nvml, index) = (self.nvml.as_ref()?, self.cuda? as u32);
        if self.gpu_failed {
            return None;
        }
        let slow = self
            .gpu_slow
            .as_ref()
            .filter(|(at, _)| at.elapsed() < GPU_SLOW_EVERY)
            .map(|(_, g)| g.clone());
        let fresh = slow.is_none();
        let read = || -> Result<GpuStats, nvml_wrapper::error::NvmlError> {
            let dev = nvml.device_by_index(index)?;
            let mem = dev.memory_info()?;
            let mut g = match slow {
                Some(g) => g,
                None => GpuStats {
                    index,
                    name: dev.name().unwrap_or_else(|_| format!("cuda:{index}")),
                    mem_used: 0,
                    mem_total: 0,
                    util_percent: dev.utilization_rates().ok().map(|u| u.gpu),
                    temperature_c: dev.temperature(TemperatureSensor::Gpu).ok(),
                    power_w: dev.power_usage().ok().map(|mw| mw as f64 / 1000.0),
                },
            };
            g.mem_used = mem.used;
            g.mem_total = mem.total;
            Ok(g)
        };

        let injected = self.fail_gpu_after.is_some_and(|n| self.gpu_reads >= n);
        let result = if injected {
            Err(nvml_wrapper::error::NvmlError::GpuLost)
        } else {
            read()
        };
        self.gpu_reads += 1;
        match result {
            Ok(g) => {
                if fresh {
                    self.gpu_slow = Some((Instant::now(), g.clone()));
                }
                Some(g)
            }
            Err(e) => {
                self.gpu_failed = true;
                notice(
                    bus,
                    Level::Warn,
                    "nvml",
                    format!("NVML stopped answering for GPU {index} ({e}); GPU figures hidden, training continues"),
                );
                None
            }
        }
    }

    fn allocator(&mut self, bus: &Bus) -> Option<AllocatorStats> {
        self.cuda?;
        if self.allocator_failed {
            return None;
        }
        match self.alloc.as_mut()?.stats()? {
            Ok(s) => Some(s),
            Err(e) => {
                self.allocator_failed = true;
                notice(
                    bus,
                    Level::Warn,
                    "allocator",
                    format!("allocator statistics unavailable: {e}"),
                );
                None
            }
        }
    }
}

impl Sources {
    /// Whether [`Sources::segments`] would read the segment map now.
    fn segments_due(&self) -> bool {
        self.cuda.is_some()
            && self.alloc.is_some()
            && !self.snapshot_failed
            && self
                .last_snapshot
                .is_none_or(|t| t.elapsed() >= SNAPSHOT_EVERY)
    }

    /// The segment map, when one is due (CUDA runs only).
    fn segments(&mut self, bus: &Bus) -> Option<SegmentMap> {
        self.cuda?;
        if self.snapshot_failed
            || self
                .last_snapshot
                .is_some_and(|t| t.elapsed() < SNAPSHOT_EVERY)
        {
            return None;
        }
        self.last_snapshot = Some(Instant::now());
        match self.alloc.as_mut()?.segments()? {
            Ok(map) => Some(map),
            Err(e) => {
                self.snapshot_failed = true;
                notice(
                    bus,
                    Level::Warn,
                    "allocator",
                    format!("segment map unavailable: {e}"),
                );
                None
            }
        }
    }
}

/// NVML would not start. On a CPU run that is the normal case of a machine without an
/// NVIDIA driver: one short line on screen, the loader's error in the log only. A CUDA run
/// without NVML is missing figures it should have, so the reason is on screen too.
fn nvml_unavailable(cuda: bool, error: &str) -> Notice {
    let detail = format!("NVML unavailable ({error})");
    let text = if cuda {
        format!("{detail}: GPU memory, utilisation and power are not shown")
    } else {
        "no NVIDIA driver: device figures off".to_string()
    };
    Notice::new(Level::Info, "nvml", text).with_detail(detail)
}

fn notice(bus: &Bus, level: Level, source: &str, text: String) {
    bus.send(Telemetry::Notice(Notice::new(level, source, text)));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without an NVIDIA driver (this one, unless the test finds NVML), a
    /// CPU run's screen gets one short line and the log gets the loader's error.
    #[test]
    fn a_cpu_run_without_nvml_says_one_short_line_and_logs_why() {
        let (bus, rx) = Bus::new(true);
        let sources = Sources::open(&bus, None, None);
        let Some(n) = rx.events.try_iter().find_map(|r| match r.msg {
            Telemetry::Notice(n) if n.source == "nvml" => Some(n),
            _ => None,
        }) else {
            assert!(sources.nvml.is_some(), "no NVML and no notice");
            return;
        };
        assert_eq!(n.text, "no NVIDIA driver: device figures off");
        let detail = n.detail.expect("the error is kept for the log");
        assert!(detail.starts_with("NVML unavailable ("), "{detail}");
        let logged = rx
            .log
            .expect("a log sink")
            .try_iter()
            .find_map(|r| match r.msg {
                Telemetry::Notice(n) if n.source == "nvml" => Some(n),
                _ => None,
            });
        assert_eq!(logged.and_then(|n| n.detail), Some(detail));
    }

    /// Reads that would take more than the budget at the rate asked slow the sampler
    /// (said once), cheap ones let it back to the rate asked; the first reading (the
    /// sources opening) is not counted.
    #[test]
    fn costly_reads_slow_the_sampler_until_they_fit_and_cheap_ones_let_it_back() {
        let asked = Duration::from_millis(50);
        let mut pace = Pace::new(asked);
        let mut at = Instant::now();
        // Opening cost a second of CPU: ignored.
        assert!(pace.record(Duration::from_secs(1), at).is_none());
        let mut run = |pace: &mut Pace, cost: Duration, seconds: u64| -> Vec<Notice> {
            let until = at + Duration::from_secs(seconds);
            let mut told = Vec::new();
            while at < until {
                told.extend(pace.record(cost, at));
                at += pace.period;
            }
            told
        };
        // 40 µs reads at 20 Hz are 0.08% of a core.
        assert!(run(&mut pace, Duration::from_micros(40), 5).is_empty());
        assert_eq!(pace.period, asked);
        // 1 ms reads (a loaded driver): 20 Hz would be 2% of a core; 5 Hz is the budget.
        let told = run(&mut pace, Duration::from_millis(1), 5);
        assert_eq!(pace.period, Duration::from_millis(200));
        assert_eq!(told.len(), 1, "{told:?}");
        // (The window that saw the change mixes both costs: a rate between is said.)
        assert!(
            told[0].text.contains("Hz instead of the 20 asked"),
            "{}",
            told[0].text
        );
        // Cheap again: back to the rate asked, without another notice.
        assert!(run(&mut pace, Duration::from_micros(40), 5).is_empty());
        assert_eq!(pace.period, asked);
        // Slowed a second time: said once was enough.
        assert!(run(&mut pace, Duration::from_millis(2), 5).is_empty());
        assert_eq!(pace.period, Duration::from_millis(400));
    }

    #[test]
    fn the_pace_never_goes_faster_than_asked() {
        let asked = Duration::from_millis(250);
        assert_eq!(paced(asked, Duration::ZERO), asked);
        assert_eq!(paced(asked, Duration::from_micros(1000)), asked);
        assert_eq!(
            paced(asked, Duration::from_micros(2000)),
            Duration::from_millis(400)
        );
    }

    /// The clock the pace is judged by counts this thread's CPU, not the time it waits.
    #[test]
    fn the_thread_clock_counts_work_not_sleep() {
        let a = thread_cpu().expect("CLOCK_THREAD_CPUTIME_ID on Linux");
        std::thread::sleep(Duration::from_millis(30));
        let b = thread_cpu().unwrap();
        assert!(
            b - a < Duration::from_millis(5),
            "slept, yet {:?} of CPU",
            b - a
        );
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let c = thread_cpu().unwrap();
        assert!(
            c - b >= Duration::from_millis(10),
            "spun 30 ms, {:?} of CPU",
            c - b
        );
    }

    #[test]
    fn a_cuda_run_without_nvml_says_why_on_screen() {
        let n = nvml_unavailable(true, "libnvidia-ml.so.1: cannot open shared object file");
        assert!(
            n.text.contains("cannot open shared object file"),
            "{}",
            n.text
        );
        assert!(n
            .text
            .ends_with("GPU memory, utilisation and power are not shown"));
        assert!(n.detail.is_some());
    }
}
