//! Out-of-memory: recognising one, provoking one on purpose, and what to do about
//! memory around one (free the cache, cap the process).
//!
//! libtorch reports an OOM as an ordinary error whose text names it: the CUDA caching
//! allocator's "CUDA out of memory", the CPU allocator's "DefaultCPUAllocator: not enough
//! memory" / "can't allocate memory". An infallible tch call panics with the same text,
//! so both arrive here as a message.
use tch::{Device, Kind, TchError, Tensor};

use crate::alloc_stats;
use crate::peak;

/// True when libtorch's message says an allocation failed.
pub fn is_oom_message(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    [
        "out of memory",
        "not enough memory",
        "can't allocate memory",
        "outofmemoryerror",
    ]
    .iter()
    .any(|m| t.contains(m))
}

/// oneDNN (the CPU kernels) reports a failed allocation of its own as "could not create
/// a primitive", which names no memory. Under `--hard-limit` that is what it means; without
/// one it may be anything, so only a capped run treats it as out of memory.
pub fn is_capped_oom_message(text: &str) -> bool {
    is_oom_message(text) || text.contains("could not create a primitive")
}

/// Raises a real out-of-memory error on `device`: asks libtorch's allocator for more
/// bytes than any machine has, so the error is the allocator's own, reported through the
/// same path as one that strikes by nature (and counted in its OOM statistics on CUDA).
pub fn provoke(device: Device) -> TchError {
    // 2^52 bytes: beyond x86-64's 47-bit user address space and any GPU.
    match Tensor::f_empty([1i64 << 52], (Kind::Uint8, device)) {
        Err(e) => e,
        Ok(_) => {
            TchError::Torch("out of memory (injected: the oversized allocation succeeded)".into())
        }
    }
}

/// Silences the panic message of an out-of-memory panic on the trainer thread.
///
/// tch's `f_*_scalar` calls panic instead of returning the error when the op fails (the
/// temporary `Scalar`'s `Drop` finds libtorch's error first), so an OOM there arrives as a
/// panic, which the runner catches and reports as an `oom` record. The default hook would
/// print a scary message for a recovered event, and under `--hard-limit` it may need memory
/// there is none of (a backtrace takes ~1 MiB), which aborts the process. This check reads
/// the payload in place and allocates nothing. Other panics go to the previous hook.
pub fn quiet_oom_panics() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let text = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            let on_trainer = std::thread::current().name() == Some("trainer");
            if !(on_trainer && is_oom_text_exact(text)) {
                previous(info);
            }
        }));
    });
}

/// [`is_capped_oom_message`] without allocating: libtorch's messages have a fixed case.
fn is_oom_text_exact(text: &str) -> bool {
    [
        "out of memory",
        "not enough memory",
        "can't allocate memory",
        "could not create a primitive",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// Returns memory held for reuse: the CUDA allocator's cached blocks (`emptyCache`), or on
/// the CPU glibc's free heap pages (`malloc_trim`), which otherwise keep the resident set
/// (and a hard cap's count) at the old peak after a shrink.
pub fn free_cached(device: Device) -> Result<(), String> {
    match device {
        Device::Cuda(_) => alloc_stats::empty_cache(),
        _ => {
            // SAFETY: malloc_trim only walks glibc's own heap; any argument is valid.
            unsafe { libc::malloc_trim(0) };
            Ok(())
        }
    }
}

/// What [`free_cached`] can shrink, for reporting it: `(name, amount)`, the allocator's
/// reserved bytes on CUDA, the resident set on the CPU.
pub fn held(device: Device) -> (&'static str, String) {
    let bytes = match device {
        Device::Cuda(n) => alloc_stats::device_stats(n)
            .and_then(Result::ok)
            .map(|s| s.reserved),
        _ => peak::status_kib("VmRSS:").map(|k| k * 1024),
    };
    let name = if device.is_cuda() {
        "reserved"
    } else {
        "resident"
    };
    (
        name,
        bytes.map_or("?".into(), headroom_core::units::fmt_bytes),
    )
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
    // SAFETY: mallopt only sets a glibc tunable; called before training allocates.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } != 1 {
        return Err("cannot set glibc's mmap threshold for --hard-limit".into());
    }
    let rss = peak::status_kib("VmRSS:").ok_or("cannot read VmRSS from /proc/self/status")? * 1024;
    let data =
        peak::status_kib("VmData:").ok_or("cannot read VmData from /proc/self/status")? * 1024;
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
    let lim = libc::rlimit {
        rlim_cur: cap,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: a plain syscall on a fully initialised struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &lim) } != 0 {
        return Err(format!(
            "cannot set RLIMIT_DATA for --hard-limit: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provoked_oom_is_the_allocators_own_and_recognised() {
        let e = provoke(Device::Cpu);
        let text = e.to_string();
        assert!(is_oom_message(&text), "{text}");
        assert!(text.contains("DefaultCPUAllocator"), "{text}");
        // Nothing was held: the next allocation works.
        assert_eq!(Tensor::ones([4], (Kind::Float, Device::Cpu)).size(), [4]);
    }

    #[test]
    fn other_errors_are_not_oom() {
        assert!(is_oom_message(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ));
        assert!(is_oom_message(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
        ));
        assert!(!is_oom_message("shape mismatch: [2, 3] vs [3, 2]"));
        assert!(!is_oom_message("index out of range"));
        let dnnl = "Internal torch error: could not create a primitive";
        assert!(!is_oom_message(dnnl) && is_capped_oom_message(dnnl));
        assert!(free_cached(Device::Cpu).is_ok());
    }
}
