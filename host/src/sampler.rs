//! The sampler thread: host, NVML, allocator (or, on the CPU, heap) figures at a fixed
//! rate, off the trainer's hot path. Every source that is missing becomes one notice, then silence.
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
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
    stop: Sender<()>,
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
        let (stop, stopped) = bounded::<()>(1);
        let period = Duration::from_secs_f64(1.0 / hz);
        // To say so if the thread cannot start (the closure, and its bus, are gone then).
        let told = bus.clone();
        let thread = std::thread::Builder::new()
            .name("sampler".into())
            .spawn(move || {
                let mut sources = Sources::open(&bus, cuda, allocator);
                loop {
                    bus.send(Telemetry::Sample(sources.read(&bus)));
                    if let Some(map) = sources.segments(&bus) {
                        bus.send(Telemetry::Segments(map));
                    }
                    // recv_timeout doubles as an interruptible sleep: stop is prompt.
                    match stopped.recv_timeout(period) {
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                        _ => break,
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
        let _ = self.stop.try_send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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
