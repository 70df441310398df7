//! The commands that watch a run from outside it: `ls`, `attach`, `replay`.
use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;

use anyhow::{bail, Result};
use headroom_core::protocol::Want;
use headroom_ui::{DashboardOptions, Mode};

use crate::cli::{AttachArgs, ReplayArgs};
use crate::client::{self, Resolved};
use crate::ls;
use crate::Program;
use headroom_host::conn::Target;
use headroom_host::{out, rundir};

pub fn ls(program: Program) -> Result<()> {
    let found = ls::scan(&mut |s| out::err(&format!("headroom: {s}")))?;
    if found.is_empty() {
        for line in none_listed(program, &rundir::dir()?) {
            out::err(&format!("headroom: {line}"));
        }
        return Ok(());
    }
    for line in ls::table(&found) {
        out::out(&line);
    }
    Ok(())
}

/// How a run of `program`'s user comes to be: the full binary trains, the pip viewer's
/// user starts a run from Python.
fn how_a_run_starts(program: Program) -> &'static str {
    match program {
        Program::Full => "`headroom train`, or a Python script that makes a headroom.Run(...)",
        Program::Viewer => {
            "a Python script that makes a headroom.Run(...) (this `headroom` is the viewer: \
             it watches runs, it does not train)"
        }
    }
}

/// What `ls` says with no run: where it looked, how a run comes to be listed, and where
/// one it cannot see may be.
fn none_listed(program: Program, dir: &Path) -> Vec<String> {
    vec![
        format!(
            "no runs are running: none serves a socket in {}",
            dir.display()
        ),
        format!(
            "a run is listed here while it trains, from its start to its end: {}",
            how_a_run_starts(program)
        ),
        "one started under another HEADROOM_RUNTIME_DIR or XDG_RUNTIME_DIR (another login, a \
         container) serves there; one on another machine: headroom attach HOST:PORT; a \
         finished run's log: headroom replay LOG"
            .into(),
    ]
}

/// What `attach` says with no run to attach to.
fn none_to_attach(program: Program, dir: &Path) -> String {
    let start = match program {
        Program::Full => "start one with `headroom train` (or from Python: headroom.Run(...))",
        Program::Viewer => "start one from Python (headroom.Run(...)), then attach",
    };
    format!(
        "no runs are running (none serves a socket in {}): {start}; a remote run: headroom \
         attach HOST:PORT --token-file FILE, or forward its socket with ssh -L",
        dir.display()
    )
}

/// The token for a TCP target: the flag's file, else HEADROOM_TOKEN.
fn token(args: &AttachArgs) -> Result<Option<String>> {
    if let Some(f) = &args.token_file {
        return Ok(Some(rundir::read_token(f)?));
    }
    Ok(std::env::var("HEADROOM_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

/// Which run to attach to: the argument, or the only live run, or the user's choice.
fn choose(args: &AttachArgs, program: Program) -> Result<Resolved> {
    let mut notes = Vec::new();
    let found = ls::scan(&mut |s| notes.push(s))?;
    for n in notes {
        out::err(&format!("headroom: {n}"));
    }
    let runs = ls::runs(&found);
    if let Some(arg) = &args.target {
        return client::target_of(arg, &runs, args.rank).map_err(|e| anyhow::anyhow!(e));
    }
    if args.rank.is_some() {
        bail!("--rank needs a job: name it (headroom attach JOB --rank R; see `headroom ls`)");
    }
    let pick = |i: usize| Resolved {
        target: Target::Unix(runs[i].socket.clone()),
        job: runs[i].job.clone(),
    };
    match runs.len() {
        0 => bail!(none_to_attach(program, &rundir::dir()?)),
        1 => Ok(pick(0)),
        _ => {
            let table = ls::table(&found);
            if !std::io::stdin().is_terminal() {
                bail!(
                    "{} runs are running; name one: headroom attach NAME\n{}",
                    runs.len(),
                    table.join("\n")
                );
            }
            for line in &table {
                out::err(&format!("   {line}"));
            }
            // Numbered by name, apart from the table: its rows are grouped by job and
            // include runs that cannot be attached.
            for (i, run) in runs.iter().enumerate() {
                out::err(&format!("{:>2} {} (pid {})", i + 1, run.name, run.pid));
            }
            eprint!("attach to which run (1-{})? ", runs.len());
            let _ = std::io::stderr().flush();
            let mut answer = String::new();
            std::io::stdin().lock().read_line(&mut answer)?;
            match answer.trim().parse::<usize>() {
                Ok(n) if (1..=runs.len()).contains(&n) => Ok(pick(n - 1)),
                _ => bail!(
                    "no run chosen (answer with a number from 1 to {})",
                    runs.len()
                ),
            }
        }
    }
}

pub fn attach(args: AttachArgs, program: Program) -> Result<()> {
    let Resolved { target, job } = choose(&args, program)?;
    let token = token(&args)?;
    if matches!(target, Target::Tcp(_)) && token.is_none() {
        bail!(
            "{target} needs the run's token: pass --token-file FILE (the run wrote it 0600 \
             beside its socket, see the run's \"serving on\" notice) or set HEADROOM_TOKEN"
        );
    }
    let session = client::handshake(&target, token.as_deref(), Want::Stream)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let name = session.hello.run_name.clone();
    if !std::io::stdout().is_terminal() {
        bail!("attach draws the dashboard: run it in a terminal");
    }
    let feed = crate::attach::feed(session, target.clone(), token, job);
    let opts = DashboardOptions {
        mode: Mode::Attached {
            address: target.to_string(),
        },
        ..DashboardOptions::from_env(&name)
    };
    let exit = headroom_ui::run_dashboard(feed, opts)?;
    if exit.detached {
        out::err(&format!(
            "headroom: detached from {name}; it goes on (headroom attach {name} to come back)"
        ));
    }
    Ok(())
}

pub fn replay(args: ReplayArgs) -> Result<()> {
    if !(args.speed.is_finite() && args.speed > 0.0) {
        bail!(
            "--speed {}: give a positive number, e.g. 1, 10 or 0.5",
            args.speed
        );
    }
    if !std::io::stdout().is_terminal() {
        bail!("replay draws the dashboard: run it in a terminal");
    }
    let feed = headroom_ui::replay::replay_job_feed(
        &args.log,
        headroom_ui::replay::ReplayOptions {
            speed: args.speed,
            follow: args.follow,
            start_at_end: args.end,
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let first = &args.log[0];
    let name = first
        .file_stem()
        .map_or("replay".into(), |s| s.to_string_lossy().to_string());
    let source = match args.log.len() {
        1 => first.display().to_string(),
        n => format!("{n} ranks' logs"),
    };
    let opts = DashboardOptions {
        mode: Mode::Replay { source },
        ..DashboardOptions::from_env(&name)
    };
    headroom_ui::run_dashboard(feed, opts)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pip viewer cannot train: its advice is Python's, never `headroom train`; the
    /// full binary's may name both.
    #[test]
    fn the_advice_with_no_run_fits_the_program() {
        let dir = Path::new("/run/user/1000/headroom");
        let viewer = none_to_attach(Program::Viewer, dir);
        assert!(viewer.contains("headroom.Run("), "{viewer}");
        assert!(!viewer.contains("`headroom train`"), "{viewer}");
        let full = none_to_attach(Program::Full, dir);
        assert!(full.contains("start one with `headroom train`"), "{full}");
        for said in [&viewer, &full] {
            assert!(said.contains("no runs are running"), "{said}");
            assert!(said.contains("/run/user/1000/headroom"), "{said}");
        }
        let ls = none_listed(Program::Viewer, dir).join("\n");
        assert!(ls.contains("headroom.Run("), "{ls}");
        assert!(!ls.contains("`headroom train`"), "{ls}");
    }

    /// Through the real scan of an empty runtime directory: the pip viewer's `attach`
    /// says where it looked and advises Python, not `headroom train`.
    #[test]
    fn the_pip_viewers_attach_with_no_run_advises_python() {
        let dir = std::env::temp_dir().join(format!("headroom-viewer-none-{}", std::process::id()));
        // The only test here that reads the runtime directory.
        std::env::set_var("HEADROOM_RUNTIME_DIR", &dir);
        let args = AttachArgs {
            target: None,
            rank: None,
            token_file: None,
        };
        let said = crate::run_as(crate::ViewCommand::Attach(args), Program::Viewer)
            .expect_err("no run to attach to")
            .to_string();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(said.contains("no runs are running"), "{said}");
        assert!(said.contains(&*dir.to_string_lossy()), "{said}");
        assert!(said.contains("headroom.Run("), "{said}");
        assert!(!said.contains("`headroom train`"), "{said}");
    }

    /// `ls` with none says where it looked and how a run comes to be listed.
    #[test]
    fn ls_with_no_run_says_where_it_looked_and_how_a_run_appears() {
        let lines = none_listed(Program::Full, Path::new("/tmp/rt"));
        let said = lines.join("\n");
        for needed in [
            "no runs are running",
            "/tmp/rt",
            "while it trains",
            "`headroom train`",
            "HEADROOM_RUNTIME_DIR",
            "headroom replay LOG",
        ] {
            assert!(said.contains(needed), "{needed:?}: {said}");
        }
    }
}
