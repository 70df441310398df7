//! The caching allocator's own figures, through the C++ shim (shim/alloc_shim.cpp) over
//! `at::accelerator`. tch has none of this. On a CPU-only run every call answers
//! "no accelerator" instead of failing.
use std::ffi::{c_char, c_int, CStr};

use headroom_core::{AllocatorStats, SegmentMap};
use headroom_host::sampler::AllocatorSource;

#[repr(C)]
#[derive(Default)]
struct AllocStatsRaw {
    allocated_current: i64,
    allocated_peak: i64,
    reserved_current: i64,
    reserved_peak: i64,
    active_current: i64,
    active_peak: i64,
    inactive_split_current: i64,
    inactive_split_peak: i64,
    requested_current: i64,
    requested_peak: i64,
    num_alloc_retries: i64,
    num_ooms: i64,
    segment_count: i64,
}

extern "C" {
    fn hr_has_accelerator() -> c_int;
    fn hr_device_stats(
        device: c_int,
        out: *mut AllocStatsRaw,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn hr_reset_peak_stats(device: c_int, err: *mut c_char, len: usize) -> c_int;
    fn hr_empty_cache(err: *mut c_char, len: usize) -> c_int;
    fn hr_memory_info(
        device: c_int,
        free: *mut i64,
        total: *mut i64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
}

/// Runs a shim call that reports failure as -1 plus a message.
fn checked(call: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), String> {
    let mut buf = [0 as c_char; 512];
    // SAFETY: the shim writes at most len bytes, NUL-terminated, and catches every C++
    // exception before returning.
    if call(buf.as_mut_ptr(), buf.len()) == 0 {
        Ok(())
    } else {
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Err(msg.to_string_lossy().into_owned())
    }
}

/// libtorch's allocator on one CUDA device, for the sampler.
pub struct LibtorchAllocator(pub usize);

impl AllocatorSource for LibtorchAllocator {
    fn stats(&mut self) -> Option<Result<AllocatorStats, String>> {
        device_stats(self.0)
    }

    fn segments(&mut self) -> Option<Result<SegmentMap, String>> {
        let index = self.0;
        Some(crate::snapshot::pickled()?.and_then(|b| crate::snapshot::segment_map(&b, index)))
    }
}

/// True when libtorch sees an accelerator (CUDA on our machines).
pub fn has_accelerator() -> bool {
    // SAFETY: no arguments; exceptions are caught in the shim.
    unsafe { hr_has_accelerator() == 1 }
}

/// Statistics of the allocator of accelerator `device`; `None` without one.
pub fn device_stats(device: usize) -> Option<Result<AllocatorStats, String>> {
    if !has_accelerator() {
        return None;
    }
    let mut raw = AllocStatsRaw::default();
    let res = checked(|err, len| unsafe { hr_device_stats(device as c_int, &mut raw, err, len) });
    Some(res.map(|()| {
        let u = |v: i64| v.max(0) as u64;
        AllocatorStats {
            allocated: u(raw.allocated_current),
            allocated_peak: u(raw.allocated_peak),
            reserved: u(raw.reserved_current),
            reserved_peak: u(raw.reserved_peak),
            active: u(raw.active_current),
            active_peak: u(raw.active_peak),
            inactive_split: u(raw.inactive_split_current),
            inactive_split_peak: u(raw.inactive_split_peak),
            requested: u(raw.requested_current),
            requested_peak: u(raw.requested_peak),
            num_alloc_retries: u(raw.num_alloc_retries),
            num_ooms: u(raw.num_ooms),
            segments: u(raw.segment_count),
        }
    }))
}

/// Starts a new peak window (call at a step's start to read that step's peak after it).
pub fn reset_peak_stats(device: usize) -> Result<(), String> {
    if !has_accelerator() {
        return Err("no accelerator".into());
    }
    checked(|err, len| unsafe { hr_reset_peak_stats(device as c_int, err, len) })
}

/// Returns cached, unused blocks to the driver.
pub fn empty_cache() -> Result<(), String> {
    if !has_accelerator() {
        return Err("no accelerator".into());
    }
    checked(|err, len| unsafe { hr_empty_cache(err, len) })
}

/// (free, total) bytes of `device` as the driver reports them.
pub fn memory_info(device: usize) -> Result<(u64, u64), String> {
    if !has_accelerator() {
        return Err("no accelerator".into());
    }
    let (mut free, mut total) = (0i64, 0i64);
    checked(|err, len| unsafe {
        hr_memory_info(device as c_int, &mut free, &mut total, err, len)
    })?;
    Ok((free.max(0) as u64, total.max(0) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_build_reports_no_accelerator_without_failing() {
        // The test machines have no GPU; on one that has, the figures must be coherent.
        match device_stats(0) {
            None => {
                assert!(!tch::Cuda::is_available());
                assert!(empty_cache().is_err());
            }
            Some(stats) => {
                let s = stats.expect("allocator stats on a GPU machine");
                assert!(s.reserved >= s.allocated);
            }
        }
    }
}
