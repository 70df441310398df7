//! The limit a Python run's usage is a share of: its budget (given, or "auto" from what
//! the process holds), host memory or the device's; a hard cap set here, last, since it
//! is the whole process's.
use headroom_core::config::MemorySection;
use headroom_core::Notice;
use headroom_host::procmem;
use headroom_host::session::{
    budget_below_held, hard_limit_notice, limit_notice, malloc_notice, resolved_auto_budget,
};

/// The limit a run's usage is a share of, and what to say about it.
pub fn resolve_limit(
    mem: &MemorySection,
    cuda: bool,
    device_total: Option<u64>,
) -> Result<(u64, Vec<Notice>), String> {
    let mut notices = Vec::new();
    let budget = match mem.budget_bytes().map_err(|e| e.to_string())? {
        Some(b) => Some(b),
        None if mem.is_auto_budget() && !cuda => {
            let held = procmem::rss_bytes().ok_or("cannot read VmRSS from /proc/self/status")?;
            let available = procmem::host_available_bytes().unwrap_or(0);
            let (b, notice) = resolved_auto_budget(
                held,
                available,
                "give headroom.Run(memory_budget=None) (all host memory) or a size to change it",
            );
            notices.push(notice);
            Some(b)
        }
        None => None,
    };
    if mem.hard_limit && cuda {
        return Err(
            "hard_limit caps host memory and applies to CPU runs only; on CUDA a \
                    memory_budget already caps the caching allocator (a real CUDA OOM past it)"
                .into(),
        );
    }
    if mem.hard_limit && budget.is_none() {
        return Err(
            "hard_limit needs a memory_budget to cap at, e.g. memory_budget=\"2GiB\"".into(),
        );
    }
    let limit = if cuda {
        let total = device_total.ok_or("the device's memory is unknown")?;
        budget.map_or(total, |b| b.min(total))
    } else {
        let held = procmem::rss_bytes().unwrap_or(0);
        if let Some(b) = budget.filter(|b| *b <= held) {
            return Err(budget_below_held(
                "memory_budget",
                b,
                held,
                "Python, torch, the model and its optimizer state",
            ));
        }
        match budget {
            Some(b) => b,
            None => procmem::host_total_bytes().ok_or("cannot read MemTotal from /proc/meminfo")?,
        }
    };
    let what = match (cuda, budget) {
        (false, Some(_)) => "the budget (memory_budget)",
        (false, None) => "host memory (no memory_budget)",
        (true, Some(_)) => "the budget (the caching allocator's per-process fraction)",
        (true, None) => "device memory",
    };
    let thresholds = mem.thresholds().map_err(|e| e.to_string())?;
    notices.push(limit_notice(limit, what, thresholds));
    notices.extend(malloc_notice(cuda));
    if mem.hard_limit {
        let b = budget.expect("checked above");
        let cap = procmem::set_hard_limit(b)
            .map_err(|e| e.replace("--memory-budget", "memory_budget"))?;
        notices.push(hard_limit_notice(b, cap));
    }
    Ok((limit, notices))
}
