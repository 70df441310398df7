//! The CUDA caching allocator as `torch.cuda` reports it, read by the sampler's thread.
//!
//! The Python object (`headroom._torch.CudaAllocator`) answers `stats()` with the figures
//! of `torch.cuda.memory_stats()` and `segments()` with `torch.cuda.memory_snapshot()`
//! flattened to tuples; this side turns them into the records the built-in trainer sends.
//! Each read takes the GIL for a moment (the interpreter hands it over within its switch
//! interval), a few times a second.
use headroom_core::{AllocatorStats, Segment, SegmentMap};
use headroom_host::sampler::AllocatorSource;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub struct PyAllocator {
    source: Py<PyAny>,
}

impl PyAllocator {
    pub fn new(source: Py<PyAny>) -> PyAllocator {
        PyAllocator { source }
    }
}

fn text(e: PyErr) -> String {
    e.to_string()
}

impl AllocatorSource for PyAllocator {
    fn stats(&mut self) -> Option<Result<AllocatorStats, String>> {
        Python::attach(|py| {
            let got = match self.source.call_method0(py, "stats") {
                Ok(v) => v,
                Err(e) => return Some(Err(text(e))),
            };
            if got.is_none(py) {
                return None;
            }
            let read = || -> PyResult<AllocatorStats> {
                let d = got.bind(py).cast::<PyDict>()?;
                let get = |k: &str| -> PyResult<u64> {
                    Ok(match d.get_item(k)? {
                        Some(v) => v.extract::<u64>().unwrap_or(0),
                        None => 0,
                    })
                };
                Ok(AllocatorStats {
                    allocated: get("allocated")?,
                    allocated_peak: get("allocated_peak")?,
                    reserved: get("reserved")?,
                    reserved_peak: get("reserved_peak")?,
                    active: get("active")?,
                    active_peak: get("active_peak")?,
                    inactive_split: get("inactive_split")?,
                    inactive_split_peak: get("inactive_split_peak")?,
                    requested: get("requested")?,
                    requested_peak: get("requested_peak")?,
                    num_alloc_retries: get("num_alloc_retries")?,
                    num_ooms: get("num_ooms")?,
                    segments: get("segments")?,
                })
            };
            Some(read().map_err(text))
        })
    }

    fn segments(&mut self) -> Option<Result<SegmentMap, String>> {
        Python::attach(|py| {
            let got = match self.source.call_method0(py, "segments") {
                Ok(v) => v,
                Err(e) => return Some(Err(text(e))),
            };
            if got.is_none(py) {
                return None;
            }
            type Raw = Vec<(u64, u64, String, Vec<(u64, bool)>)>;
            let raw: Raw = match got.extract(py) {
                Ok(r) => r,
                Err(e) => return Some(Err(text(e))),
            };
            let segments = raw
                .into_iter()
                .map(|(address, total_size, pool, blocks)| {
                    let mut s = Segment {
                        address,
                        total_size,
                        pool,
                        runs: Vec::new(),
                    };
                    for (size, allocated) in blocks {
                        s.push_block(size, allocated);
                    }
                    s
                })
                .collect();
            Some(Ok(SegmentMap::from_segments(segments)))
        })
    }
}
