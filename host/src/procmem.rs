//! This process's memory as the kernel counts it: the resident set, its peak since a
//! reset, what the host could still give, and a hard cap. Linux `/proc` and glibc only,
//! no libtorch: the built-in trainer and a Python run measure a CPU step the same way.
use std::fs;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use headroom_core::HeapStats;

/// A `kB` line of /proc/self/status (`VmHWM:`, `VmRSS:`, `VmData:`).
pub fn status_kib(key: &str) -> Option<u64> {
    read_proc("/proc/self/status", |text| kib_line(text, key))
}

/// The resident set now, bytes: /proc/self/statm's second field (the kernel's count
/// behind VmRSS, one short line instead of the fifty /proc/self/status formats; a step's
/// report reads it).
pub fn rss_bytes() -> Option<u64> {
    let pages: u64 = read_proc("/proc/self/statm", |text| {
        text.split_whitespace().nth(1)?.parse().ok()
    })?;
    Some(pages * page_size())
}

/// The procfs files read on every step or sample, through descriptors kept open: procfs
/// formats a file afresh for each read at offset 0, and opening and closing it cost more
/// than the read on a VM (/proc/self/statm: 37 µs against 4.5 for a `pread`).
const KEPT: [&str; 4] = [
    "/proc/self/statm",
    "/proc/self/status",
    "/proc/meminfo",
    "/proc/self/clear_refs",
];

/// The descriptor of `path` (one of [`KEPT`]), opened by this process: a descriptor names
/// the process that opened it, so a forked child opens its own.
fn kept(path: &'static str) -> Option<std::sync::Arc<fs::File>> {
    type Open = Option<(u32, Vec<Option<std::sync::Arc<fs::File>>>)>;
    static OPEN: Mutex<Open> = Mutex::new(None);
    let at = KEPT.iter().position(|p| *p == path)?;
    let pid = std::process::id();
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if open.as_ref().is_none_or(|(p, _)| *p != pid) {
        *open = Some((pid, vec![None; KEPT.len()]));
    }
    let files = &mut open.as_mut().expect("set above").1;
    if files[at].is_none() {
        let writable = path.ends_with("clear_refs");
        let f = fs::OpenOptions::new()
            .read(!writable)
            .write(writable)
            .open(path)
            .ok()?;
        files[at] = Some(std::sync::Arc::new(f));
    }
    files[at].clone()
}

/// `parse` of the whole of `path` (one of [`KEPT`]) as it is now.
fn read_proc<T>(path: &'static str, parse: impl FnOnce(&str) -> Option<T>) -> Option<T> {
    use std::os::unix::fs::FileExt;
    // /proc/self/status is about 1.5 KiB; on the stack, so a read under a hard cap
    // allocates nothing.
    let mut buf = [0u8; 8192];
    let file = kept(path)?;
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(_) => return None,
        }
    }
    parse(std::str::from_utf8(&buf[..n]).ok()?)
}

fn page_size() -> u64 {
    static PAGE: OnceLock<u64> = OnceLock::new();
    // SAFETY: sysconf only reads a constant of the system.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    })
}

/// MemAvailable at most [`AVAILABLE_FRESH`] old: /proc/meminfo is formatted for each read
/// (tens of µs), and a step that ends every millisecond need not read it each time; what
/// other processes take moves slower than that.
fn recent_host_available_bytes() -> Option<u64> {
    static LAST: Mutex<Option<(Instant, u64)>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, bytes)) = *last {
        if at.elapsed() < AVAILABLE_FRESH {
            return Some(bytes);
        }
    }
    let bytes = host_available_bytes()?;
    *last = Some((Instant::now(), bytes));
    Some(bytes)
}

/// How old a MemAvailable reading [`current_cpu_limit`] may use.
const AVAILABLE_FRESH: Duration = Duration::from_millis(100);

/// Memory the kernel could still hand out without swapping (MemAvailable), bytes.
pub fn host_available_bytes() -> Option<u64> {
    read_proc("/proc/meminfo", |text| kib_line(text, "MemAvailable:")).map(|k| k * 1024)
}

/// Total host memory, bytes.
pub fn host_total_bytes() -> Option<u64> {
    kib_line(&fs::read_to_string("/proc/meminfo").ok()?, "MemTotal:").map(|k| k * 1024)
}

fn kib_line(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Starts a new peak window: VmHWM becomes the resident set now (writing `5` to
/// /proc/self/clear_refs). Without it VmHWM is the peak since the process began.
pub fn reset_peak_rss() -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let file = kept("/proc/self/clear_refs")
        .ok_or("cannot open /proc/self/clear_refs to reset the peak RSS")?;
    file.write_at(b"5", 0)
        .map(|_| ())
        .map_err(|e| format!("cannot reset the peak RSS via /proc/self/clear_refs: {e}"))
}

/// The peak resident set since the last [`reset_peak_rss`], bytes.
pub fn peak_rss_bytes() -> Result<u64, String> {
    status_kib("VmHWM:")
        .map(|k| k * 1024)
        .ok_or_else(|| "cannot read VmHWM from /proc/self/status".into())
}

/// A CPU limit as it stands now: never more than this process holds plus what the kernel
/// could still give it, so memory other processes take lowers it.
pub fn current_cpu_limit(configured: u64) -> u64 {
    match (rss_bytes(), recent_host_available_bytes()) {
        (Some(rss), Some(avail)) => configured.min(rss + avail),
        _ => configured,
    }
}

/// Heap trims made so far, and the bytes the last one freed (`u64::MAX`: none yet).
/// Process-wide, as the heap is: the trainer (or a Python loop) trims, the sampler reads.
static TRIMS: AtomicU64 = AtomicU64::new(0);
static LAST_TRIM_FREED: AtomicU64 = AtomicU64::new(u64::MAX);

/// Returns glibc's free heap pages to the kernel (`malloc_trim`): they otherwise keep the
/// resident set (and a hard cap's count) at the old peak after a smaller step. Returns
/// what it freed (the resident set before minus after), which the heap figures report.
pub fn trim_heap() -> Option<u64> {
    let before = rss_bytes();
    // SAFETY: malloc_trim only walks glibc's own heap; any argument is valid.
    unsafe { libc::malloc_trim(0) };
    // Another thread may allocate meanwhile: a trim that "freed" less than nothing freed 0.
    let freed = before.zip(rss_bytes()).map(|(b, a)| b.saturating_sub(a));
    TRIMS.fetch_add(1, Ordering::Relaxed);
    if let Some(f) = freed {
        LAST_TRIM_FREED.store(f, Ordering::Relaxed);
    }
    freed
}

/// The largest heap in use (`in_use`) any [`heap_stats`] call saw since the last
/// [`take_heap_in_use_peak`]; 0: none. The sampler reads the heap a few times a second, so
/// this is what a step's tensors held at most, seen from outside the step.
static IN_USE_PEAK: AtomicU64 = AtomicU64::new(0);

/// The largest heap in use seen since the last call (`None`: no reading since), and
/// starts over.
pub fn take_heap_in_use_peak() -> Option<u64> {
    match IN_USE_PEAK.swap(0, Ordering::Relaxed) {
        0 => None,
        v => Some(v),
    }
}

/// The heap as glibc and the kernel count it; `None` when malloc is not glibc's (another
/// allocator preloaded: `mallinfo2` then reports nothing) or /proc cannot be read.
pub fn heap_stats() -> Option<HeapStats> {
    let rss_anon = status_kib("RssAnon:")? * 1024;
    // SAFETY: mallinfo2 only reads glibc's arenas (under their locks) into a plain struct.
    let m = unsafe { libc::mallinfo2() };
    let in_use = (m.uordblks + m.hblkhd) as u64;
    if in_use == 0 && m.arena == 0 {
        return None;
    }
    IN_USE_PEAK.fetch_max(in_use, Ordering::Relaxed);
    Some(HeapStats {
        rss_anon,
        in_use,
        free_kept: m.fordblks as u64,
        trims: TRIMS.load(Ordering::Relaxed),
        last_trim_freed: match LAST_TRIM_FREED.load(Ordering::Relaxed) {
            u64::MAX => None,
            f => Some(f),
        },
    })
}

/// Whether this process's malloc is glibc's. Another allocator preloaded (jemalloc,
/// mimalloc, tcmalloc: `LD_PRELOAD`) serves every allocation, libtorch's included, and
/// leaves glibc's arenas empty, so `mallinfo2` reports nothing; its heap does not keep
/// freed tensors' memory fragmented the way glibc's does (docs/BENCHMARKS.md, "Another
/// malloc").
pub fn glibc_malloc() -> bool {
    // SAFETY: mallinfo2 only reads glibc's arenas (under their locks) into a plain struct.
    let m = unsafe { libc::mallinfo2() };
    // The process has allocated by now (its arguments, its runtime): an empty arena means
    // those allocations went elsewhere.
    m.arena > 0 || m.hblkhd > 0
}

/// Whether glibc's mmap threshold is set for this process (by the user through
/// `GLIBC_TUNABLES`, or by a hard cap, [`set_hard_limit`]): then the resident set follows
/// live tensors, and freed ones leave no fragments in the heap.
pub fn mmap_threshold_set(hard_limit: bool) -> bool {
    hard_limit || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc.mmap_threshold"))
}

/// `cfg` with what the controller must know of the run's memory meter, said once for
/// `headroom train` and a Python run alike: the CUDA meter is the allocator's peak, which
/// repeats to the byte at one size, the CPU meter the resident set, which scatters; and on
/// the CPU glibc's heap keeps freed tensors' memory fragmented unless tensors are mmapped
/// or another malloc serves them.
pub fn with_meter(
    cfg: headroom_core::policy::ControllerConfig,
    cuda: bool,
    hard_limit: bool,
) -> headroom_core::policy::ControllerConfig {
    use headroom_core::policy::{ALLOCATOR_NOISE, RSS_NOISE};
    headroom_core::policy::ControllerConfig {
        reading_noise: if cuda { ALLOCATOR_NOISE } else { RSS_NOISE },
        heap_fragments: !cuda && !mmap_threshold_set(hard_limit) && glibc_malloc(),
        ..cfg
    }
}

/// Under a hard cap, allocations from this size up are mmapped (see [`set_hard_limit`]).
const MMAP_THRESHOLD: i32 = 64 << 10;

/// The least a hard-capped budget must leave above the resident set at the start.
/// Measured: with 6 MiB the sampler's own small allocations failed and the process
/// aborted; with 10 MiB and more, every failure was libtorch's and was recovered.
pub const HARD_LIMIT_ROOM: u64 = 32 << 20;

/// Caps the process's data segment so that an allocation taking the resident set past
/// `budget` bytes fails (RLIMIT_DATA counts address space, RSS counts touched pages: the
/// cap is the data size now plus the budget left above the resident set now). Returns
/// the cap. Process-wide: a Rust allocation past it would abort, which is why this is
/// opt-in and the controller keeps usage under target, below the cap.
pub fn set_hard_limit(budget: u64) -> Result<u64, String> {
    // RLIMIT_DATA counts the heap's size, and glibc keeps freed tensor memory in the heap
    // (malloc_trim returns pages, not address space): after one step near the cap, every
    // later allocation failed, micro-batch 1 included, while the resident set was half the
    // budget.
    // Served by mmap, a freed tensor leaves the data segment at once. Not for every CPU
    // run: each large tensor then comes from fresh pages, and the default model trained
    // 1.6-1.8x slower (benches/overhead.rs; docs/BENCHMARKS.md).
    // Where headroom's own allocations go when the cap refuses them (own_heap.rs).
    crate::own_heap::reserve();
    // SAFETY: mallopt only sets a glibc tunable; called before training allocates.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } != 1 {
        return Err("cannot set glibc's mmap threshold for --hard-limit".into());
    }
    let rss = rss_bytes().ok_or("cannot read the resident set from /proc/self/statm")?;
    let data = status_kib("VmData:").ok_or("cannot read VmData from /proc/self/status")? * 1024;
    if budget < rss + HARD_LIMIT_ROOM {
        return Err(format!(
            "--memory-budget {} leaves less than {} above what the process already holds \
             ({} resident before training); the cap is process-wide, and a budget this tight \
             makes any allocation fail, not just training's; raise --memory-budget",
            headroom_core::units::fmt_bytes(budget),
            headroom_core::units::fmt_bytes(HARD_LIMIT_ROOM),
            headroom_core::units::fmt_bytes(rss)
        ));
    }
    let cap = data + (budget - rss);
    // The hard limit stays as it is: raising it takes privilege (a finite one set by the
    // user's shell or a scheduler would make the call fail), and the cap may not pass it.
    let mut lim = data_limit().unwrap_or(libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    });
    BEFORE_CAP.store(lim.rlim_cur, Ordering::SeqCst);
    lim.rlim_cur = cap.min(lim.rlim_max);
    if !set_data_limit(&lim) {
        return Err(format!(
            "cannot set RLIMIT_DATA for --hard-limit: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(lim.rlim_cur)
}

/// RLIMIT_DATA's soft limit before [`set_hard_limit`] (`RLIM_INFINITY`: unlimited), or 0
/// when no cap was set.
static BEFORE_CAP: AtomicU64 = AtomicU64::new(0);

/// RLIMIT_DATA now.
fn data_limit() -> Option<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a plain struct.
    (unsafe { libc::getrlimit(libc::RLIMIT_DATA, &mut lim) } == 0).then_some(lim)
}

/// Sets RLIMIT_DATA; false when the kernel refused.
fn set_data_limit(lim: &libc::rlimit) -> bool {
    // SAFETY: a plain syscall on a fully initialised struct.
    unsafe { libc::setrlimit(libc::RLIMIT_DATA, lim) == 0 }
}

/// The hard cap lifted for as long as this lives, then put back as it was: for a Python
/// run's give-up, whose checkpoint is the user's `on_checkpoint` (Python objects and
/// torch's copies, which the cap counts, unlike headroom's own allocations). The cap
/// exists to make training's allocations fail where the controller can recover; once a
/// run gives up, saving its last completed step is all that is left.
pub struct CapLifted {
    cap: libc::rlimit,
}

/// Lifts the cap [`set_hard_limit`] set, if any (None: there is no cap to lift).
pub fn lift_cap() -> Option<CapLifted> {
    let before = BEFORE_CAP.load(Ordering::SeqCst);
    if before == 0 {
        return None;
    }
    let cap = data_limit()?;
    let lifted = libc::rlimit {
        rlim_cur: before.min(cap.rlim_max),
        rlim_max: cap.rlim_max,
    };
    set_data_limit(&lifted).then_some(CapLifted { cap })
}

impl Drop for CapLifted {
    fn drop(&mut self) {
        set_data_limit(&self.cap);
    }
}

/// The environment variable that fills the cap at a run's give-up ([`fill_cap_if_asked`]).
pub const FILL_CAP_AT_GIVE_UP: &str = "HEADROOM_INJECT_FULL_CAP";

/// Fault injection for the tests of the hard cap: lowers RLIMIT_DATA to what the data
/// segment holds now, so that from here on every allocation that needs new memory from
/// the kernel fails, headroom's own included, as when training holds the cap full.
/// Does nothing unless [`FILL_CAP_AT_GIVE_UP`] is set and a cap is in force.
pub fn fill_cap_if_asked() {
    if std::env::var_os(FILL_CAP_AT_GIVE_UP).is_none() {
        return;
    }
    let (Some(mut lim), Some(data)) = (data_limit(), status_kib("VmData:")) else {
        return;
    };
    if lim.rlim_cur != libc::RLIM_INFINITY {
        lim.rlim_cur = lim.rlim_cur.min(data * 1024);
        set_data_limit(&lim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_lines() {
        let text = "Name:\tx\nVmHWM:\t  1234 kB\nVmRSS:\t 99 kB\n";
        assert_eq!(kib_line(text, "VmHWM:"), Some(1234));
        assert_eq!(kib_line(text, "VmData:"), None);
        assert!(host_total_bytes().unwrap() > 1 << 28);
    }

    /// The process's memory is shared by the tests running beside each other: the ones
    /// that measure it take turns.
    static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The heap figures see a live allocation as in use, and a trim says what it freed.
    #[test]
    fn heap_figures_follow_live_allocations_and_trims() {
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        let before = heap_stats().expect("glibc malloc on this machine");
        assert!(before.rss_anon > 0 && before.in_use > 0);
        // 64 MiB, touched: in use while it lives.
        let v = vec![1u8; 64 << 20];
        let during = heap_stats().unwrap();
        assert!(std::hint::black_box(&v)[v.len() - 1] == 1);
        assert!(
            during.in_use >= before.in_use + (60 << 20),
            "in use {} vs {} before",
            during.in_use,
            before.in_use
        );
        drop(v);
        // Many small blocks in the main heap, freed: pages a trim can return.
        let blocks: Vec<Vec<u8>> = (0..4096).map(|_| vec![1u8; 16 << 10]).collect();
        drop(blocks);
        let freed = trim_heap();
        let after = heap_stats().unwrap();
        assert_eq!(after.trims, during.trims + 1);
        assert_eq!(after.last_trim_freed, freed);
        assert!(freed.is_some());
    }

    /// The descriptor kept open reads the resident set as it is now, each time, and
    /// agrees with the kernel's VmRSS.
    #[test]
    fn the_resident_set_read_through_a_kept_descriptor_is_fresh() {
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        let before = rss_bytes().unwrap();
        let v = vec![1u8; 128 << 20];
        assert_eq!(std::hint::black_box(&v)[v.len() - 1], 1);
        let during = rss_bytes().unwrap();
        let status = status_kib("VmRSS:").unwrap() << 10;
        drop(v);
        let after = rss_bytes().unwrap();
        assert!(during >= before + (120 << 20), "{during} vs {before}");
        assert!(
            during.abs_diff(status) < 8 << 20,
            "statm {during}, status {status}"
        );
        assert!(
            after + (120 << 20) <= during,
            "{after} after freeing, {during} during"
        );
    }

    #[test]
    fn the_peak_sees_a_transient_allocation_and_resets() {
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        reset_peak_rss().unwrap();
        let before = peak_rss_bytes().unwrap();
        {
            // 256 MiB, touched so it is resident, then freed (mmapped: it leaves at once).
            let v = vec![1u8; 256 << 20];
            assert_eq!(std::hint::black_box(&v)[v.len() - 1], 1);
        }
        let after = peak_rss_bytes().unwrap();
        assert!(after >= before + (200 << 20), "peak {after} vs {before}");
        reset_peak_rss().unwrap();
        let again = peak_rss_bytes().unwrap();
        assert!(
            again + (200 << 20) <= after,
            "reset to {again} from {after}"
        );
    }
}
