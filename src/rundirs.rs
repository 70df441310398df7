//! Which run directory a `headroom train` uses: a fresh run with no `--checkpoint-dir`
//! takes the next free `runs/NAME-N` when `runs/NAME` holds another run, and `--resume
//! NAME` finds a run's directory by its name.
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use headroom_core::RunConfig;
use headroom_trainer::checkpoint::{self, RunDir};

use crate::cli::TrainArgs;

/// Where runs live when no `--checkpoint-dir` says otherwise (`RunConfig::checkpoint_dir`).
const RUNS: &str = "runs";

/// For a fresh run over an occupied default directory: renames the run to the next free
/// `NAME-N` (its directory `runs/NAME-N`, its name in `headroom ls`) and returns what to
/// say. An explicit directory (flag or config key), a resume or `--overwrite` keep theirs.
pub fn pick_fresh(cfg: &mut RunConfig, args: &TrainArgs) -> Option<String> {
    if args.checkpoint_dir.is_some()
        || args.resume.is_some()
        || args.overwrite
        || !cfg.run.checkpoint_dir.is_empty()
    {
        return None;
    }
    let default = cfg.checkpoint_dir();
    let chosen = checkpoint::next_free(&default);
    if chosen == default {
        return None;
    }
    let old = std::mem::replace(
        &mut cfg.run.name,
        chosen.file_name()?.to_string_lossy().into_owned(),
    );
    Some(format!(
        "{} holds another run, so this one is {} in {} (continue the other with --resume \
         {old}; --overwrite replaces it)",
        default.display(),
        cfg.run.name,
        chosen.display()
    ))
}

/// The directory `--resume ARG` means: ARG itself when it exists (a checkpoint directory
/// or a step directory), else the run named ARG under runs/ — its most recently saved
/// directory (`NAME` or `NAME-N`), or, on a terminal with several, the one chosen.
pub fn resume_dir(arg: &Path) -> Result<PathBuf> {
    let name = arg.to_string_lossy();
    if arg.exists() || name.contains('/') {
        return Ok(arg.to_path_buf());
    }
    let runs = checkpoint::runs_named(Path::new(RUNS), &name);
    match runs.len() {
        0 => bail!(
            "--resume {name}: no such directory, and no run named {name} under {RUNS}/; give a \
             checkpoint directory or a run's name (ls {RUNS}/)"
        ),
        1 => Ok(runs[0].root.clone()),
        _ if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() => {
            choose(&name, &runs)
        }
        _ => Ok(runs[0].root.clone()),
    }
}

fn describe(r: &RunDir) -> String {
    let step = r.step.map_or("?".into(), |s| s.to_string());
    let ago = r.saved.elapsed().map_or("?".into(), |d| {
        headroom_core::units::fmt_duration(d.as_secs_f64())
    });
    format!("{}  step {step}, saved {ago} ago", r.root.display())
}

fn choose(name: &str, runs: &[RunDir]) -> Result<PathBuf> {
    eprintln!("headroom: {} runs are named {name}:", runs.len());
    for (i, r) in runs.iter().enumerate() {
        eprintln!("{:>3}  {}", i + 1, describe(r));
    }
    eprint!("resume which (1-{}, Enter: 1)? ", runs.len());
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    match answer.trim() {
        "" => Ok(runs[0].root.clone()),
        a => match a.parse::<usize>() {
            Ok(n) if (1..=runs.len()).contains(&n) => Ok(runs[n - 1].root.clone()),
            _ => bail!(
                "no run chosen (answer with a number from 1 to {})",
                runs.len()
            ),
        },
    }
}
