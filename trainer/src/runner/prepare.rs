//! Everything checked and built before the first step: the corpus, the device, the model
//! and its optimizer, a resumed checkpoint (its state, its corpus, its room on disk) and
//! the memory policy (the limit, the meter, the controller).
use std::path::Path;

use headroom_core::journal::{Call, ControllerJournal, Journaled};
use headroom_core::units::fmt_bytes;
use headroom_core::{Bus, Level, Notice, RunConfig, Telemetry};
use headroom_host::procmem;
use headroom_host::session::{
    budget_below_held, controller_config, hard_limit_notice, limit_notice, malloc_notice,
    resolved_auto_budget, resume_controller, resumed_auto_budget, Driver, Session,
};
use tch::{Device, TchError};

use super::{first_line, TrainError, TrainOptions, Trainer};
use crate::checkpoint::{self, CheckpointError, CorpusRecord};
use crate::data::Dataset;
use crate::device;
use crate::heap_watch::HeapWatch;
use crate::model::Gpt;
use crate::oom;
use crate::optim::{AdamW, AdamWConfig};
use crate::peak::PeakMeter;
use crate::schedule::Schedule;

impl Trainer {
    pub(super) fn prepare(opts: TrainOptions, bus: &Bus) -> Result<Trainer, TrainError> {
        let cfg = opts.config;
        cfg.validate()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let data = Dataset::load_waiting(
            &cfg.data.corpus,
            cfg.data.val_fraction,
            cfg.data.seq_len,
            opts.fifo_wait,
        )?;
        let choice = cfg
            .device()
            .map_err(|e| TrainError::Config(e.to_string()))?;
        let device = device::resolve(choice, bus)?;
        if cfg.run.threads > 0 {
            tch::set_num_threads(cfg.run.threads as i32);
        }
        if let Device::Cuda(_) = device {
            crate::compute::set_tf32(cfg.model.tf32).map_err(|e| {
                TrainError::Torch(format!(
                    "setting model.tf32 failed: {}",
                    first_line(&e.to_string())
                ))
            })?;
        }
        check_model_fits(&cfg, device)?;
        let resumed = opts.resume.as_deref().map(checkpoint::load).transpose()?;
        if let Some(ck) = &resumed {
            check_state_consistent(ck)?;
        }
        let corpus = corpus_record(&cfg, &data);
        if let Some(ck) = &resumed {
            check_same_corpus(ck, &corpus, opts.allow_changed_corpus, bus)?;
        }

        // libtorch's own errors carry a C++ backtrace: the first line is the message.
        let torch = |what: &str, e: TchError| {
            TrainError::Torch(format!("{what} failed: {}", first_line(&e.to_string())))
        };
        let model = Gpt::new(&cfg.model, cfg.data.seq_len, device, cfg.run.seed)
            .map_err(|e| torch("building the model", e))?;
        let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim))
            .map_err(|e| torch("allocating the optimizer state", e))?;

        let mut notices = Vec::new();
        let (start_step, tokens_seen, saved) = match &resumed {
            None => (0, 0, None),
            Some(ck) => {
                if ck.state.step >= cfg.run.steps {
                    return Err(TrainError::Config(format!(
                        "checkpoint {} is at step {}, and the run is {} steps long; raise \
                         --steps above {} to train further",
                        ck.dir.display(),
                        ck.state.step,
                        cfg.run.steps,
                        ck.state.step
                    )));
                }
                ck.restore(&model, &mut opt)?;
                if ck.state.checksums.is_empty() {
                    notices.push(Notice::new(
                        Level::Warn,
                        "checkpoint",
                        format!(
                            "{} has no checksums in its state.json (written by an older \
                             headroom, or edited): its tensors were loaded unchecked",
                            ck.dir.display()
                        ),
                    ));
                }
                if let Some(n) = schedule_change(&cfg, &ck.state.config, ck.state.step) {
                    notices.push(n);
                }
                notices.extend(lever_changes(&cfg, &ck.state.config, ck.state.step));
                if ck.state.seed != cfg.run.seed {
                    bus.send(Telemetry::Notice(Notice::new(
                        Level::Warn,
                        "checkpoint",
                        format!(
                            "resuming with seed {} but the checkpoint was trained with seed {}; \
                             batches differ from the original run's",
                            cfg.run.seed, ck.state.seed
                        ),
                    )));
                }
                (
                    ck.state.step,
                    ck.state.tokens_seen,
                    Some((ck.state.step, ck.dir.clone())),
                )
            }
        };
        // After the checkpoint loaded: claiming the directory creates it, and a resume
        // that fails must not leave an empty one behind.
        let adopt = opts
            .resume
            .as_deref()
            .is_some_and(|r| same_dir(checkpoint::root_of(r), &opts.checkpoint_dir));
        let (lock, removed) = checkpoint::claim(&opts.checkpoint_dir, adopt, opts.overwrite)?;
        if !removed.is_empty() {
            notices.push(Notice::new(
                Level::Warn,
                "checkpoint",
                format!(
                    "--overwrite: deleted the previous run's checkpoints in {} ({})",
                    opts.checkpoint_dir.display(),
                    removed.join(", ")
                ),
            ));
        }
        notices.extend(check_room(
            &opts.checkpoint_dir,
            &model.fingerprint(),
            resumed.as_ref(),
            adopt,
        )?);

        // Resuming starts at the micro-batch the run had settled on, unless the user asked
        // for another one (--batch-size) this time.
        let start_micro = opts
            .start_micro_batch
            .or_else(|| resumed.as_ref().and_then(|ck| ck.state.micro_batch))
            .unwrap_or(cfg.batch.micro_batch);
        // A resume at the saved micro-batch continues the controller the run had (its
        // journal replayed); one at another (--batch-size) starts a fresh one there.
        let journal = match opts.start_micro_batch {
            None => resumed.as_ref().and_then(|ck| ck.state.controller.as_ref()),
            Some(_) => None,
        };
        let (controller, meter, mut startup_notices) =
            Self::memory_policy(&cfg, device, start_micro, journal)?;
        // The tokens of the last step before the checkpoint, as an uninterrupted run
        // would remember them (see `follow_smaller_step`).
        let last_tokens = journal
            .and_then(|j| {
                j.calls.iter().rev().find_map(|c| match c {
                    Call::Observe(_, mb, seq, _) => Some(mb * seq),
                    _ => None,
                })
            })
            .unwrap_or(0);
        startup_notices.extend(notices);
        let threads = match tch::get_num_threads() {
            1 => "1 intra-op thread".to_string(),
            n => format!("{n} intra-op threads"),
        };
        startup_notices.push(Notice::new(
            Level::Info,
            "torch",
            match cfg.run.threads {
                0 => format!(
                    "libtorch uses {threads} (its default); on a busy machine \
                     --threads 1 can be faster"
                ),
                _ => format!("libtorch uses {threads} (run.threads)"),
            },
        ));
        let val_offsets = data.val_offsets(cfg.run.eval_batches * cfg.batch.micro_batch);
        let mut session = Session::new(
            bus.clone(),
            Driver::BUILT_IN,
            controller.thresholds(),
            cfg.batch.effective(),
            cfg.run.steps,
        );
        session.set_controller(controller);
        session.set_levers(
            Some(cfg.model.precision),
            Some(cfg.model.checkpoint),
            cfg.memory.auto_checkpoint,
        );
        session.resume_at(
            start_step,
            tokens_seen,
            saved.as_ref().map(|s| s.1.display().to_string()),
        );
        Ok(Trainer {
            schedule: Schedule::new(&cfg.optim, cfg.run.steps),
            session,
            meter,
            inject_oom: opts.inject_oom.iter().copied().collect(),
            inject_eval_oom: opts.inject_eval_oom.iter().copied().collect(),
            eval_chunks_tried: 0,
            inject_panic: opts.inject_panic,
            hard_limit: cfg.memory.hard_limit,
            startup_notices,
            effective_batch: cfg.batch.effective(),
            checkpoint_dir: opts.checkpoint_dir,
            _lock: lock,
            corpus,
            cfg,
            data,
            model,
            opt,
            device,
            val_offsets,
            start_step,
            saved,
            last_eval_step: None,
            losses_since_eval: (0.0, 0),
            last_tokens,
            heap: HeapWatch::default(),
            stop: opts.stop,
            pending: Default::default(),
            plan: None,
        })
    }

    /// The controller and the meter it reads. Called once the model and optimizer exist,
    /// so a hard cap's baseline includes them.
    /// Its notices are sent once the run has started, after `RunStarted`.
    /// `journal`: a resumed run's controller journal, replayed instead of a fresh start.
    fn memory_policy(
        cfg: &RunConfig,
        device: Device,
        start_micro: usize,
        journal: Option<&ControllerJournal>,
    ) -> Result<(Journaled, PeakMeter, Vec<Notice>), TrainError> {
        let mut notices = Vec::new();
        let mem = &cfg.memory;
        let config = |e: headroom_core::ConfigError| TrainError::Config(e.to_string());
        let thresholds = mem.thresholds().map_err(config)?;
        let mut budget = mem.budget_bytes().map_err(config)?;
        if let (true, Device::Cpu, Some(j)) = (mem.is_auto_budget(), device, journal) {
            let (limit, notice) = resumed_auto_budget(j);
            budget = Some(limit);
            notices.push(notice);
        } else if mem.is_auto_budget() && device == Device::Cpu {
            let held = procmem::rss_bytes();
            let available = procmem::host_available_bytes();
            if let (Some(held), Some(available)) = (held, available) {
                let (b, notice) = resolved_auto_budget(
                    held,
                    available,
                    "set memory.memory_budget = \"\" (all host memory) or --memory-budget SIZE \
                     to change it",
                );
                budget = Some(b);
                notices.push(notice);
            }
        }
        if mem.hard_limit && device != Device::Cpu {
            return Err(TrainError::Config(
                "--hard-limit caps host memory and applies to CPU runs only; drop it or use \
                 --device cpu"
                    .into(),
            ));
        }
        if budget.is_some() && device != Device::Cpu && !mem.is_auto_budget() {
            notices.push(Notice::new(
                Level::Warn,
                "memory",
                "--memory-budget applies to CPU runs; a CUDA run is measured against the \
                 device's memory",
            ));
        }
        if let (Some(b), Some(held)) = (budget, procmem::rss_bytes()) {
            // Under a budget the process already exceeds, every step is an emergency and
            // the controller can only shrink to nothing.
            if device == Device::Cpu && b <= held {
                return Err(TrainError::Config(budget_below_held(
                    "--memory-budget",
                    b,
                    held,
                    "libtorch, the data, the model and its optimizer state",
                )));
            }
        }
        let meter = PeakMeter::new(device, budget).map_err(TrainError::Config)?;
        if !meter.is_exact() {
            notices.push(Notice::new(
                Level::Warn,
                "memory",
                "the kernel refused to reset the peak RSS (/proc/self/clear_refs); step peaks \
                 are the process's peak so far and over-state later steps",
            ));
        }
        let what = match (device, budget) {
            (Device::Cpu, Some(_)) => "the budget (--memory-budget)",
            (Device::Cpu, None) => "host memory (no --memory-budget)",
            _ => "device memory",
        };
        notices.push(limit_notice(meter.limit(), what, thresholds));
        notices.extend(malloc_notice(device != Device::Cpu));
        if mem.hard_limit {
            let budget = budget.expect("validate() requires a budget with hard_limit");
            oom::start_thread_pools();
            let cap = oom::set_hard_limit(budget).map_err(TrainError::Config)?;
            notices.push(hard_limit_notice(budget, cap));
        }
        if mem.oom_snapshot && matches!(device, Device::Cpu) {
            notices.push(Notice::new(
                Level::Info,
                "memory",
                "oom_snapshot: off on the CPU: the snapshot is the CUDA caching allocator's \
                 (the pickle PyTorch's memory_viz reads), and the CPU has none"
                    .to_string(),
            ));
        }
        let ccfg = controller_config(
            mem.min_micro_batch,
            mem.max_micro_batch,
            cfg.batch.effective(),
            mem.adaptive,
            cfg.data.seq_len,
            matches!(device, Device::Cuda(_)),
            mem.hard_limit,
        );
        if let Some(j) = journal {
            // Its baseline and every reading since are in the journal; thresholds the
            // config changes for the resume win over the saved ones.
            let resumed = resume_controller(ccfg, j, thresholds);
            notices.push(Notice::new(Level::Info, "memory", resumed.text));
            notices.extend(resumed.refused);
            return Ok((resumed.controller, meter, notices));
        }
        let mut controller = Journaled::new(ccfg, thresholds, meter.limit(), start_micro);
        // The model and the optimizer state exist: what the process holds now is the fixed
        // part every batch sits on, which one measured size alone cannot tell apart from
        // the per-sequence cost (a run starting at 1 never grew without it).
        match meter.reset().and_then(|()| meter.peak()) {
            Ok(held) => controller.set_baseline(held),
            Err(e) => notices.push(Notice::new(Level::Warn, "memory", e)),
        }
        Ok((controller, meter, notices))
    }
}

/// Whether two paths name the same directory (links and `..` resolved); a path that does
/// not exist is compared as written.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// What checkpoints record of the corpus: its absolute path and its content's digest.
fn corpus_record(cfg: &RunConfig, data: &Dataset) -> CorpusRecord {
    let path = match cfg.data.corpus.as_str() {
        "" => String::new(),
        p => std::path::absolute(p)
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_else(|_| p.to_string()),
    };
    CorpusRecord {
        path,
        digest: data.digest(),
        bytes: data.len() as u64,
    }
}

/// A resume trains on the content the checkpoint was trained on, wherever it lives now;
/// changed content is refused unless the user says so (then said on screen).
fn check_same_corpus(
    ck: &checkpoint::Checkpoint,
    now: &CorpusRecord,
    allow_changed: bool,
    bus: &Bus,
) -> Result<(), TrainError> {
    let Some(then) = &ck.state.corpus else {
        return Ok(());
    };
    if then.digest == now.digest {
        return Ok(());
    }
    let name = |p: &str| {
        if p.is_empty() {
            "the bundled corpus".to_string()
        } else {
            p.to_string()
        }
    };
    let what = format!(
        "the corpus changed since checkpoint {}: it was {} ({} bytes, {}), it is now {} ({} \
         bytes, {})",
        ck.dir.display(),
        name(&then.path),
        then.bytes,
        then.digest,
        name(&now.path),
        now.bytes,
        now.digest
    );
    if !allow_changed {
        return Err(TrainError::Config(format!(
            "{what}; point --corpus at the original content, or pass --allow-changed-corpus \
             to go on training on the new one"
        )));
    }
    bus.send(Telemetry::Notice(Notice::new(
        Level::Warn,
        "data",
        format!("{what}; training on the new content (--allow-changed-corpus)"),
    )));
    Ok(())
}

/// A resume with another `--steps` reshapes the learning-rate schedule: say how.
fn schedule_change(now: &RunConfig, then: &RunConfig, step: u64) -> Option<Notice> {
    if now.run.steps == then.run.steps {
        return None;
    }
    let next = step + 1;
    let old = Schedule::new(&then.optim, then.run.steps).lr_at(next);
    let new = Schedule::new(&now.optim, now.run.steps).lr_at(next);
    let change = format!(
        "the run is now {} steps long (it was {}): the learning-rate schedule's decay is \
         stretched to match",
        now.run.steps, then.run.steps
    );
    // Said as a warning only when the next step's rate differs (shown to 4 digits): in
    // warmup it does not, and "9.000e-4 instead of 9.000e-4" alarmed for nothing.
    if format!("{new:.3e}") == format!("{old:.3e}") {
        return Some(Notice::new(
            Level::Info,
            "optim",
            format!("{change}; step {next}'s lr is unchanged ({new:.3e}), later ones differ"),
        ));
    }
    Some(Notice::new(
        Level::Warn,
        "optim",
        format!("{change}, so step {next} trains at lr {new:.3e} instead of {old:.3e}"),
    ))
}

/// A resume with another precision or checkpointing says so: the checkpoint holds float32
/// weights and moments either way, so it loads, but the steps after it are computed
/// differently from those before it.
fn lever_changes(now: &RunConfig, then: &RunConfig, step: u64) -> Vec<Notice> {
    let (a, b) = (&then.model, &now.model);
    let mut out = Vec::new();
    if a.precision != b.precision {
        out.push(Notice::new(
            Level::Warn,
            "model",
            format!(
                "resuming in {} a run trained in {} up to step {step}: the checkpoint's \
                 float32 weights and moments load as they are, and the steps from {} on \
                 compute in {}",
                b.precision,
                a.precision,
                step + 1,
                b.precision
            ),
        ));
    }
    if a.checkpoint != b.checkpoint {
        out.push(Notice::new(
            Level::Info,
            "model",
            format!(
                "activation checkpointing is {} (it was {} up to step {step}): memory per \
                 sequence changes, what is learned does not",
                b.checkpoint, a.checkpoint
            ),
        ));
    }
    out
}

/// Refuses a model that cannot train in the memory there is, before building it: a huge
/// config would otherwise allocate until the machine swaps, or die in libtorch.
fn check_model_fits(cfg: &RunConfig, device: Device) -> Result<(), TrainError> {
    let params = Gpt::parameters_for(&cfg.model, cfg.data.seq_len);
    // Weights, gradients and AdamW's two moments, all float32: the least a step needs.
    let needed = params.saturating_mul(16);
    let (room, what) = match device {
        Device::Cuda(n) => match crate::alloc_stats::memory_info(n) {
            Ok((_, total)) => (total, format!("cuda:{n}'s memory")),
            Err(_) => return Ok(()),
        },
        _ => match cfg.memory.budget_bytes().ok().flatten() {
            Some(b) => (b, "the budget (--memory-budget)".to_string()),
            None => match procmem::host_available_bytes() {
                Some(a) => (a, "the host memory available".to_string()),
                None => return Ok(()),
            },
        },
    };
    if needed > u128::from(room) {
        let m = &cfg.model;
        return Err(TrainError::Config(format!(
            "the model is too large: n_layer {} × n_embd {} gives {} parameters, whose \
             weights, gradients and optimizer state need at least {}, more than {what} ({}); \
             lower model.n_layer or model.n_embd",
            m.n_layer,
            m.n_embd,
            fmt_count(params),
            fmt_bytes(u64::try_from(needed).unwrap_or(u64::MAX)),
            fmt_bytes(room)
        )));
    }
    Ok(())
}

fn fmt_count(n: u128) -> String {
    match n {
        0..1_000_000 => n.to_string(),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

/// Free space for checkpoints: refused when not even one fits, said when fewer than a
/// save needs with the ones it keeps (a save writes the new one before pruning). A checkpoint
/// takes what the one resumed from takes, else [`checkpoint::estimated_size`]. A resume
/// into its own directory makes room as a failed save does: older checkpoints go first,
/// the one resumed from (the newest good one) never.
fn check_room(
    root: &Path,
    shapes: &[(String, Vec<i64>)],
    resumed: Option<&checkpoint::Checkpoint>,
    adopt: bool,
) -> Result<Vec<Notice>, TrainError> {
    let Some(mut free) = checkpoint::free_bytes(root) else {
        return Ok(Vec::new());
    };
    let one = match resumed {
        Some(ck) => checkpoint::size_on_disk(&ck.dir).max(1),
        None => checkpoint::estimated_size(shapes),
    };
    let mut notices = Vec::new();
    if let (true, true, Some(ck)) = (free < one, adopt, resumed) {
        let removed = checkpoint::prune_all_but(root, Some(&ck.dir));
        if !removed.is_empty() {
            let before = free;
            free = checkpoint::free_bytes(root).unwrap_or(free);
            notices.push(Notice::new(
                Level::Warn,
                "checkpoint",
                format!(
                    "{} had {} free and a checkpoint of this run takes {}: deleted older \
                     checkpoints ({}) to make room; {} is kept",
                    root.display(),
                    fmt_bytes(before),
                    fmt_bytes(one),
                    removed.join(", "),
                    ck.dir.display()
                ),
            ));
        }
    }
    if free < one {
        return Err(CheckpointError::NoRoom {
            root: root.to_path_buf(),
            free,
            needed: one,
        }
        .into());
    }
    let want = one * (checkpoint::KEEP as u64 + 1);
    if free < want {
        notices.push(Notice::new(
            Level::Warn,
            "checkpoint",
            format!(
                "{} has {} free; a checkpoint takes about {} and a save needs room for {} of \
                 them: when the disk fills, older checkpoints are deleted first and the newest \
                 is always kept",
                root.display(),
                fmt_bytes(free),
                fmt_bytes(one),
                checkpoint::KEEP + 1
            ),
        ));
    }
    Ok(notices)
}

/// A state.json whose step disagrees with its directory's name or with the tokens it says
/// were seen was edited, or copied from elsewhere: refused, since a resume from it would
/// continue at the wrong step (another learning rate, other batches) without a word.
fn check_state_consistent(ck: &checkpoint::Checkpoint) -> Result<(), TrainError> {
    let st = &ck.state;
    let named = ck
        .dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(checkpoint::parse_step_dir);
    let cfg = &st.config;
    let effective = cfg.batch.effective() as u64;
    let tokens_at = |steps: u64| -> u64 {
        (1..=steps)
            .map(|s| effective * cfg.data.seq_len_at(cfg.run.seed, s) as u64)
            .sum()
    };
    let mut wrong = Vec::new();
    if let Some(n) = named.filter(|n| *n != st.step) {
        wrong.push(format!("its directory is {}", checkpoint::step_dir_name(n)));
    }
    let expected = tokens_at(st.step);
    if st.tokens_seen != expected {
        wrong.push(format!(
            "tokens_seen is {} where {} steps of {} sequences make {expected}",
            st.tokens_seen, st.step, effective
        ));
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(TrainError::Checkpoint(CheckpointError::Corrupt {
        file: ck.dir.join("state.json"),
        reason: format!(
            "it says step {}, but {} (edited, or copied from another step)",
            st.step,
            wrong.join(", and ")
        ),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lengthened(from: u64, to: u64, step: u64) -> Notice {
        let mut then = RunConfig::default();
        then.run.steps = from;
        let mut now = then.clone();
        now.run.steps = to;
        schedule_change(&now, &then, step).expect("the length changed")
    }

    #[test]
    fn a_longer_run_in_warmup_is_said_without_alarm() {
        // The default warms up over 20 steps: step 6's rate does not depend on the length.
        let n = lengthened(300, 500, 5);
        assert_eq!(n.level, Level::Info, "{}", n.text);
        assert!(
            n.text.contains("step 6's lr is unchanged") && !n.text.contains("instead of"),
            "{}",
            n.text
        );
        // After warmup it does: a warning with both rates.
        let n = lengthened(300, 500, 200);
        assert_eq!(n.level, Level::Warn, "{}", n.text);
        assert!(n.text.contains("instead of"), "{}", n.text);
        let mut same = RunConfig::default();
        same.run.steps = 300;
        assert!(schedule_change(&same, &same.clone(), 5).is_none());
    }
}
