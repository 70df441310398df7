//! The allocator's live snapshot (the data behind PyTorch's memory_viz) turned into a
//! [`SegmentMap`]. The pickled bytes come from `torch::cuda::_memory_snapshot_pickled`,
//! resolved at run time by the shim so CPU-only libtorch builds still link.
use std::ffi::{c_char, c_int, CStr};
use std::io::Write;
use std::path::{Path, PathBuf};

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

/// Writes an out-of-memory snapshot of step `step` into `dir` as memory_viz's pickle,
/// whole or not at all (a temporary file renamed into place): a half-written file would
/// not load, and it is what explains the run's failure.
pub fn write_oom(dir: &Path, step: u64, pickled: &[u8]) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("oom-step{step:06}.pickle"));
    let tmp = dir.join(format!(".oom-step{step:06}.pickle.tmp"));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(pickled)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(path)
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
    fn an_oom_snapshot_is_written_whole_under_the_steps_name() {
        let dir = tempfile::tempdir().unwrap();
        let into = dir.path().join("runs").join("x");
        let path = write_oom(&into, 7, b"\x80\x04pickled").unwrap();
        assert_eq!(path, into.join("oom-step000007.pickle"));
        assert_eq!(std::fs::read(&path).unwrap(), b"\x80\x04pickled");
        let names: Vec<_> = std::fs::read_dir(&into)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        // A directory that cannot be written is an error, not a partial file.
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, "").unwrap();
        assert!(write_oom(&blocked, 1, b"x").is_err());
    }

    #[test]
    fn no_accelerator_means_no_snapshot() {
        if !tch::Cuda::is_available() {
            assert!(pickled().is_none());
        }
    }
}
