//! A step's peak memory and the limit it is a share of: what the controller observes.
//!
//! CUDA: the allocator's peak of allocated bytes since the step began, plus the memory
//! outside the allocator (device used − allocator reserved: the CUDA context, other
//! processes), over the device's total. Allocated, not reserved: the cache keeps reserved
//! high after a shrink, and a model fitted to it would never see a smaller batch use less.
//!
//! CPU: the process's peak resident set since the step began (`VmHWM`, reset by writing
//! `5` to /proc/self/clear_refs) over the budget (`--memory-budget`, else host memory).
use tch::Device;

use crate::alloc_stats;
use headroom_host::procmem::{self, host_total_bytes};

pub struct PeakMeter {
    device: Device,
    limit: u64,
    /// Whether /proc/self/clear_refs accepted a reset: without it VmHWM is the peak since
    /// the process began, which over-states every later step.
    resettable: bool,
}

impl PeakMeter {
    /// `budget`: the CPU budget in bytes, when one was given (ignored on CUDA).
    pub fn new(device: Device, budget: Option<u64>) -> Result<PeakMeter, String> {
        let limit = match device {
            Device::Cuda(n) => {
                alloc_stats::memory_info(n)
                    .map_err(|e| format!("cannot read cuda:{n} memory: {e}"))?
                    .1
            }
            _ => match budget {
                Some(b) => b,
                None => host_total_bytes()
                    .ok_or("cannot read MemTotal from /proc/meminfo; give --memory-budget SIZE")?,
            },
        };
        let mut meter = PeakMeter {
            device,
            limit,
            resettable: true,
        };
        meter.resettable = meter.reset().is_ok();
        Ok(meter)
    }

    /// The configured limit: the budget, host memory or the device's memory.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The limit as it stands now: on the CPU, never more than this process holds plus
    /// what the kernel could still give it, so memory other processes take lowers it
    /// (CUDA usage already counts other processes' memory, see [`PeakMeter::peak`]).
    pub fn current_limit(&self) -> u64 {
        match self.device {
            Device::Cuda(_) => self.limit,
            _ => procmem::current_cpu_limit(self.limit),
        }
    }

    /// False on a CPU run whose kernel refused the peak reset (figures then over-state).
    pub fn is_exact(&self) -> bool {
        self.resettable
    }

    /// Starts a new peak window.
    pub fn reset(&self) -> Result<(), String> {
        match self.device {
            Device::Cuda(n) => alloc_stats::reset_peak_stats(n),
            _ if !self.resettable => Ok(()),
            _ => procmem::reset_peak_rss(),
        }
    }

    /// The peak since the last [`PeakMeter::reset`], bytes.
    pub fn peak(&self) -> Result<u64, String> {
        match self.device {
            Device::Cuda(n) => {
                let stats = alloc_stats::device_stats(n)
                    .ok_or("no accelerator")?
                    .map_err(|e| format!("allocator stats: {e}"))?;
                let (free, total) = alloc_stats::memory_info(n)?;
                let outside = total.saturating_sub(free).saturating_sub(stats.reserved);
                Ok(stats.allocated_peak + outside)
            }
            _ => procmem::peak_rss_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn cpu_peak_sees_a_transient_allocation_and_resets() {
        let meter = PeakMeter::new(Device::Cpu, Some(1 << 30)).unwrap();
        assert_eq!(meter.limit(), 1 << 30);
        assert!(meter.is_exact(), "this kernel must accept clear_refs");
        meter.reset().unwrap();
        let before = meter.peak().unwrap();
        {
            // 256 MiB, touched so it is resident, then freed.
            let t = Tensor::ones([64 << 20], (Kind::Float, Device::Cpu));
            assert_eq!(t.int64_value(&[0]), 1);
        }
        let after = meter.peak().unwrap();
        assert!(
            after >= before + (200 << 20),
            "peak {after} vs {before} before the allocation"
        );
        meter.reset().unwrap();
        let again = meter.peak().unwrap();
        assert!(
            again + (200 << 20) <= after,
            "reset to {again} from {after}"
        );
    }

    /// Memory another process takes lowers the CPU limit the controller and the screen
    /// use: "23 GiB to the limit" while another job held 61% of the host misled.
    #[test]
    fn memory_held_by_another_process_lowers_the_cpu_limit() {
        let meter = PeakMeter::new(Device::Cpu, None).unwrap();
        let before = meter.current_limit();
        assert!(before <= meter.limit());
        let hog = 3u64 << 30;
        // What another process can really take: MemAvailable is the host's, and in a
        // container its cgroup's limit may be far less.
        let host = procmem::host_available_bytes().unwrap();
        let cgroup = cgroup_room();
        if host.min(cgroup.unwrap_or(u64::MAX)) < 2 * hog {
            eprintln!(
                "SKIPPED: not enough free memory to hold 3 GiB in another process \
                 (MemAvailable {} MiB, cgroup room {:?} MiB)",
                host >> 20,
                cgroup.map(|b| b >> 20)
            );
            return;
        }
        // Touched pages (a fill, not calloc), held until told to go.
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import sys; x = b'\\x01' * (3 << 30); print('held', flush=True); sys.stdin.read()",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "held");
        let during = meter.current_limit();
        drop(child.stdin.take());
        let _ = child.wait();
        // Half the hog: on a shared machine other processes free and take memory while
        // it is held (beside other builds the drop for 3 GiB held can be as small as
        // 2.03 GB).
        assert!(
            during + (3 << 29) <= before,
            "limit {before} before, {during} while another process held 3 GiB"
        );
    }

    /// What this process's memory cgroups still let it and its children take: the least
    /// of limit - usage over the cgroup and its ancestors (v2 `memory.max`, or v1
    /// `memory.limit_in_bytes`), or `None` when none sets a limit.
    fn cgroup_room() -> Option<u64> {
        let read = |p: &std::path::Path| std::fs::read_to_string(p).ok();
        let mut rooms = Vec::new();
        for line in read("/proc/self/cgroup".as_ref())?.lines() {
            let mut parts = line.splitn(3, ':');
            let (id, controllers, rel) = (parts.next()?, parts.next()?, parts.next()?);
            let (base, files) = if id == "0" && controllers.is_empty() {
                ("/sys/fs/cgroup", ["memory.max", "memory.current"])
            } else if controllers.split(',').any(|c| c == "memory") {
                (
                    "/sys/fs/cgroup/memory",
                    ["memory.limit_in_bytes", "memory.usage_in_bytes"],
                )
            } else {
                continue;
            };
            let base = std::path::Path::new(base);
            let mut dir = base.join(rel.trim_start_matches('/'));
            loop {
                let limit = read(&dir.join(files[0])).and_then(|t| t.trim().parse::<u64>().ok());
                let usage = read(&dir.join(files[1])).and_then(|t| t.trim().parse::<u64>().ok());
                // "max" (v2) does not parse; v1 says "no limit" with a number near 2^63.
                if let (Some(limit), Some(usage)) = (limit, usage) {
                    if limit < 1 << 60 {
                        rooms.push(limit.saturating_sub(usage));
                    }
                }
                if dir == base || !dir.pop() {
                    break;
                }
            }
        }
        rooms.into_iter().min()
    }
}
