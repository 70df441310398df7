//! The allocator's live snapshot (the data behind PyTorch's memory_viz) turned into a
//! [`SegmentMap`]. The pickled bytes come from `torch::cuda::_memory_snapshot_pickled`,
//! resolved at run time by the shim so CPU-only libtorch builds still link.
use std::ffi::{c_char, c_int, CStr};

use headroom_core::{Segment, SegmentMap};

use crate::pickle::{self, Value};

extern "C" {
    fn hr_memory_snapshot(out: *mut *mut u8, len: *mut usize, err: *mut c_char, n: usize) -> c_int;
    fn hr_free(p: *mut u8);
}

/// The pickled snapshot of every CUDA device's allocator; `None` without an accelerator.
pub fn pickled() -> Option<Result<Vec<u8>, String>> {
    if !crate::alloc_stats::has_accelerator() {
        return None;
    }
    let mut ptr: *mut u8 = std::ptr::null_mut();
    let mut len = 0usize;
    let mut err = [0 as c_char; 512];
    // SAFETY: on success the shim hands over a malloc'd buffer of `len` bytes, which is
    // copied and then freed with the shim's own free; on failure err holds a C string.
    let rc = unsafe { hr_memory_snapshot(&mut ptr, &mut len, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) };
        return Some(Err(msg.to_string_lossy().into_owned()));
    }
    let bytes = unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec();
    unsafe { hr_free(ptr) };
    Some(Ok(bytes))
}

/// Segments of `device` from a pickled snapshot.
pub fn segment_map(pickled: &[u8], device: usize) -> Result<SegmentMap, String> {
    let root = pickle::parse(pickled)?;
    let segments = root
        .get("segments")
        .and_then(Value::as_list)
        .ok_or("allocator snapshot has no 'segments' list")?;
    let mut out = Vec::new();
    for seg in segments {
        let on_device = seg.get("device").and_then(Value::as_u64).unwrap_or(0) as usize;
        if on_device != device {
            continue;
        }
        let mut s = Segment {
            address: seg.get("address").and_then(Value::as_u64).unwrap_or(0),
            total_size: seg.get("total_size").and_then(Value::as_u64).unwrap_or(0),
            pool: seg
                .get("segment_type")
                .and_then(Value::as_str)
                .unwrap_or("large")
                .to_string(),
            runs: Vec::new(),
        };
        for block in seg.get("blocks").and_then(Value::as_list).unwrap_or(&[]) {
            let size = block.get("size").and_then(Value::as_u64).unwrap_or(0);
            // active_allocated and active_pending_free are both held by tensors (or
            // streams); only "inactive" is cached space the allocator could reuse.
            let state = block.get("state").and_then(Value::as_str).unwrap_or("");
            s.push_block(size, state != "inactive");
        }
        out.push(s);
    }
    Ok(SegmentMap::from_segments(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_accelerator_means_no_snapshot() {
        if !tch::Cuda::is_available() {
            assert!(pickled().is_none());
        }
    }
}
