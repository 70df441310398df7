//! `headroom._native`: the Rust half of the `headroom` Python package.
//!
//! A Python run gets the same parts as `headroom train`: the telemetry bus, the stream
//! server (`headroom attach`/`ls`), the JSONL log, the host/NVML sampler and the batch
//! controller. Everything torch-specific (tensors, the allocator, OOM exceptions) stays
//! in Python (`python/headroom/`); this crate never links libtorch.
mod allocator;
mod limit;
mod reporter;
mod run;

use pyo3::prelude::*;

/// The extension's own allocations fall back to pages a hard cap (`hard_limit=True`)
/// does not count: the cap refuses torch's allocations, never headroom's bookkeeping.
#[global_allocator]
static OWN_HEAP: headroom_host::own_heap::OwnHeap = headroom_host::own_heap::OwnHeap;

/// The process's peak resident set since the last reset, bytes (a CPU step's peak).
#[pyfunction]
fn peak_rss() -> PyResult<u64> {
    headroom_host::procmem::peak_rss_bytes().map_err(pyo3::exceptions::PyOSError::new_err)
}

/// Starts a new peak window for [`peak_rss`].
#[pyfunction]
fn reset_peak_rss() -> PyResult<()> {
    headroom_host::procmem::reset_peak_rss().map_err(pyo3::exceptions::PyOSError::new_err)
}

/// The resident set now, bytes.
#[pyfunction]
fn rss() -> Option<u64> {
    headroom_host::procmem::rss_bytes()
}

/// Returns glibc's free heap pages to the kernel (the CPU's "free the cache"); the bytes
/// it freed (None when /proc could not say). The sampler's heap figures report it too.
#[pyfunction]
fn trim_heap() -> Option<u64> {
    headroom_host::procmem::trim_heap()
}

/// The hard cap lifted by [`lift_cap`], put back by [`restore_cap`].
static LIFTED: std::sync::Mutex<Option<headroom_host::procmem::CapLifted>> =
    std::sync::Mutex::new(None);

/// Lifts the run's hard cap (`hard_limit=True`) until [`restore_cap`]: a give-up's
/// `on_checkpoint` saves the last completed step with what the cap held back. False when
/// no cap is in force.
#[pyfunction]
fn lift_cap() -> bool {
    let lifted = headroom_host::procmem::lift_cap();
    let any = lifted.is_some();
    *LIFTED.lock().unwrap_or_else(|p| p.into_inner()) = lifted;
    any
}

/// Puts the cap [`lift_cap`] lifted back as it was.
#[pyfunction]
fn restore_cap() {
    LIFTED.lock().unwrap_or_else(|p| p.into_inner()).take();
}

/// `"1.5GiB"` → bytes, with the CLI's own parser and error.
#[pyfunction]
fn parse_bytes(text: &str) -> PyResult<u64> {
    headroom_core::units::parse_bytes(text).map_err(pyo3::exceptions::PyValueError::new_err)
}

/// The `headroom` command of the Python package: the viewer (`ls`, `attach`, `replay`),
/// compiled into this extension so one `pip install` builds it with no libtorch and no
/// second binary to place. `argv` is `sys.argv`; returns the exit status.
#[pyfunction]
fn viewer_main(py: Python<'_>, argv: Vec<String>) -> u8 {
    // The viewer holds the terminal until it ends: Python threads may run meanwhile.
    py.detach(move || headroom_viewer::main_viewer(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<run::NativeRun>()?;
    m.add_function(wrap_pyfunction!(peak_rss, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_rss, m)?)?;
    m.add_function(wrap_pyfunction!(rss, m)?)?;
    m.add_function(wrap_pyfunction!(trim_heap, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(lift_cap, m)?)?;
    m.add_function(wrap_pyfunction!(restore_cap, m)?)?;
    m.add_function(wrap_pyfunction!(viewer_main, m)?)?;
    m.add("PROTOCOL", headroom_core::protocol::version_string())?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
