//! Out-of-memory: recognising one, provoking one on purpose, and what to do about
//! memory around one (free the cache, cap the process).
//!
//! libtorch reports an OOM as an ordinary error whose text names it: the CUDA caching
//! allocator's "CUDA out of memory", the CPU allocator's "DefaultCPUAllocator: not enough
//! memory" / "can't allocate memory". An infallible tch call panics with the same text,
//! so both arrive here as a message.
use tch::{Device, Kind, TchError, Tensor};

use headroom_host::procmem;

use crate::alloc_stats;

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
            procmem::trim_heap();
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
        _ => procmem::rss_bytes(),
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

/// See [`procmem::set_hard_limit`]; re-exported where the trainer's memory lives.
pub use procmem::{set_hard_limit, HARD_LIMIT_ROOM};

/// Starts libtorch's CPU thread pools now. Their threads are made at the first parallel
/// op, and each thread's stack is a private mapping that a hard cap counts: started under
/// the cap, a pool sized by the machine's cores takes the budget's room (8 MiB a thread)
/// or fails to start at all ("Thread creation failed"). Called before the cap is set.
pub fn start_thread_pools() {
    let run = || -> Result<(), TchError> {
        // An elementwise op over a few of at::parallel_for's grains (32768 elements)
        // starts the OpenMP team, which the BLAS shares; half a MiB, freed at once.
        let v = Tensor::f_ones([1 << 17], (Kind::Float, Device::Cpu))?;
        let _ = v.f_mul_scalar(2.0)?;
        Ok(())
    };
    let _ = run();
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
