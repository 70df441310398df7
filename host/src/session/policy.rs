//! A run's memory policy as every driver sets it up: the controller its settings give and
//! the one a resume restores (built the same way, since a journal replays only into a
//! controller built as the one that wrote it), the budget's checks and what is said
//! about the limit.
use headroom_core::journal::{ControllerJournal, Journaled};
use headroom_core::policy::{ControllerConfig, Thresholds};
use headroom_core::units::fmt_bytes;
use headroom_core::{Level, Notice};

use crate::procmem;

/// The controller's settings: sizes between `min_micro_batch` and `max_micro_batch` (0:
/// the effective batch; never more), and the meter it reads (the device and whether a
/// hard cap is set decide its noise and whether glibc's heap fragments count).
pub fn controller_config(
    min_micro_batch: usize,
    max_micro_batch: usize,
    effective_batch: usize,
    adaptive: bool,
    max_seq_len: usize,
    cuda: bool,
    hard_limit: bool,
) -> ControllerConfig {
    let max = match max_micro_batch {
        0 => effective_batch,
        m => m.min(effective_batch),
    };
    procmem::with_meter(
        ControllerConfig {
            min_micro_batch: min_micro_batch.clamp(1, max.max(1)),
            max_micro_batch: max,
            adaptive,
            max_seq_len,
            ..ControllerConfig::default()
        },
        cuda,
        hard_limit,
    )
}

/// A controller restored from a checkpoint's journal, and what to say about it.
pub struct ResumedController {
    pub controller: Journaled,
    /// "controller state restored (…)", with the thresholds' fate when they changed.
    pub text: String,
    /// Thresholds given for the resume that the controller refused (the saved ones stay).
    pub refused: Option<Notice>,
}

/// Replays `journal` into a controller built from `cfg`: the micro-batch, the memory model
/// and every reading as the uninterrupted run had them. `thresholds` given for the resume
/// win over the saved ones.
pub fn resume_controller(
    cfg: ControllerConfig,
    journal: &ControllerJournal,
    thresholds: Thresholds,
) -> ResumedController {
    let mut controller = Journaled::replay(cfg, journal);
    let mut text = format!(
        "controller state restored ({} calls replayed): micro-batch {}, as the uninterrupted \
         run had it",
        journal.calls.len(),
        controller.micro_batch()
    );
    let mut refused = None;
    if thresholds != journal.thresholds {
        match controller.set_thresholds(thresholds) {
            Ok(()) => text += &format!("; thresholds {thresholds} in force"),
            Err(e) => {
                refused = Some(Notice::new(
                    Level::Warn,
                    "memory",
                    format!("thresholds {thresholds} refused ({e}); the saved ones stay"),
                ))
            }
        }
    }
    ResumedController {
        controller,
        text,
        refused,
    }
}

/// `memory_budget = "auto"` on a resume: the budget the run resolved at its start, not
/// one from this process's memory now (the uninterrupted run goes on measuring against
/// it), and the notice that says so.
pub fn resumed_auto_budget(journal: &ControllerJournal) -> (u64, Notice) {
    let text = format!(
        "memory budget auto: {}, as the run resumed from resolved it",
        fmt_bytes(journal.limit)
    );
    (journal.limit, Notice::new(Level::Info, "memory", text))
}

/// A budget at or below what the process holds before its first step: every step would
/// be an emergency, and the controller could only shrink to nothing. `option` names the
/// setting (`--memory-budget`, `memory_budget`); `holders`, what holds the memory.
pub fn budget_below_held(option: &str, budget: u64, held: u64, holders: &str) -> String {
    format!(
        "{option} {} is below what this process already holds ({}: {holders}); give a \
         budget well above that, e.g. {}",
        fmt_bytes(budget),
        fmt_bytes(held),
        fmt_bytes((held * 2).next_multiple_of(64 << 20))
    )
}

/// The limit usage is a share of, what it is (`what`: "the budget (…)", "device memory")
/// and the thresholds against it.
pub fn limit_notice(limit: u64, what: &str, thresholds: Thresholds) -> Notice {
    Notice::new(
        Level::Info,
        "memory",
        format!(
            "memory limit {} ({what}); thresholds {thresholds}",
            fmt_bytes(limit)
        ),
    )
}

/// A hard cap set at `budget` (RLIMIT_DATA `cap`).
/// On the CPU, when another malloc than glibc's serves the process (preloaded): said once
/// at the start, so that a user who preloaded it sees it took, and what it changes.
pub fn malloc_notice(cuda: bool) -> Option<Notice> {
    if cuda || procmem::glibc_malloc() {
        return None;
    }
    let preload = std::env::var("LD_PRELOAD").unwrap_or_default();
    let which = match preload.trim() {
        "" => "another allocator".to_string(),
        p => format!("LD_PRELOAD={p}"),
    };
    Some(Notice::new(
        Level::Info,
        "memory",
        format!(
            "malloc here is not glibc's ({which}): freed tensors' memory is not held \
             fragmented as glibc's heap holds it, so the controller fits the resident set as \
             it reads (no heap allowance)"
        ),
    ))
}

pub fn hard_limit_notice(budget: u64, cap: u64) -> Notice {
    Notice::new(
        Level::Info,
        "memory",
        format!(
            "hard limit: allocations past {} resident fail (RLIMIT_DATA {})",
            fmt_bytes(budget),
            fmt_bytes(cap)
        ),
    )
}

/// `memory_budget = "auto"` on the CPU: what this process holds now (`held`) plus room for
/// activations from what the host has `available`, and the notice that says so; `change`
/// says how the user's setting changes it.
pub fn resolved_auto_budget(held: u64, available: u64, change: &str) -> (u64, Notice) {
    let budget = headroom_core::config::auto_budget(held, available);
    let text = format!(
        "memory budget auto: {} (this process's {} plus {} for activations), so the \
         controller fits the micro-batch to it; {change}",
        fmt_bytes(budget),
        fmt_bytes(held),
        fmt_bytes(budget - held)
    );
    (budget, Notice::new(Level::Info, "memory", text))
}
