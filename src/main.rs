//! `headroom`: wires the trainer thread, the sampler, the log writer and the screen.
mod cli;
mod headless;
mod logger;
mod sampler;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use crossbeam_channel::{bounded, Sender};
use headroom_core::units::fmt_duration;
use headroom_core::{Bus, Command, RunSummary};
use headroom_trainer::runner::{self, TrainOptions};

use cli::{Cli, Commands, TrainArgs};
use headless::StreamEnd;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Train(args) => train(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("headroom: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn train(args: TrainArgs) -> Result<ExitCode> {
    let resumed = match &args.resume {
        Some(dir) => Some(runner::read_checkpoint_config(dir).map_err(|e| anyhow::anyhow!("{e}"))?),
        None => None,
    };
    let config = args.resolve(resumed)?;
    let inject_oom =
        cli::inject_oom_steps(&args, std::env::var("HEADROOM_INJECT_OOM").ok().as_deref())?;
    let inject_panic =
        cli::inject_panic_step(std::env::var("HEADROOM_INJECT_PANIC").ok().as_deref())?;
    // Checked now, truncated only once the trainer is ready: a run that fails to start
    // leaves an existing log as it was.
    let corpus = std::path::PathBuf::from(&config.data.corpus);
    let mut inputs: Vec<(&str, &std::path::Path)> = Vec::new();
    if !config.data.corpus.is_empty() {
        inputs.push(("corpus", &corpus));
    }
    if let Some(c) = &args.config {
        inputs.push(("config", c));
    }
    let log_file = args
        .log
        .as_deref()
        .map(|p| logger::open(p, &inputs))
        .transpose()?;

    let (bus, rx) = Bus::new(log_file.is_some());
    let (cmd_tx, cmd_rx) = bounded::<Command>(64);
    let headless = args.headless || !std::io::stdout().is_terminal();

    let opts = TrainOptions {
        checkpoint_dir: config.checkpoint_dir(),
        resume: args.resume.clone(),
        config: config.clone(),
        inject_oom,
        inject_panic,
    };
    if !headless {
        // Before the trainer's own hook (installed by spawn), which then sees panics
        // first: a recovered OOM panic stays quiet instead of reaching this one.
        headroom_ui::install_panic_hook();
    }
    let trainer = match runner::spawn(opts, bus.clone(), cmd_rx) {
        Ok(t) => t,
        Err(e) => {
            if let Some(log) = log_file {
                log.abandon();
            }
            anyhow::bail!("{e}");
        }
    };
    // What the trainer sent while preparing waits in the log channel.
    let log_writer = match (log_file, rx.log) {
        (Some(log), Some(lines)) => Some(logger::LogWriter::start(log, lines, bus.ui_only())),
        _ => None,
    };
    let sampler = sampler::Sampler::start(bus.clone(), trainer.cuda_index(), config.run.sample_hz);
    let signalled = Arc::new(AtomicBool::new(false));
    forward_signals(cmd_tx.clone(), Arc::clone(&signalled))?;

    let end = if headless {
        headless::run(rx.events, rx.metrics, config.run.progress_every)
    } else {
        dashboard(
            &config.run.name,
            rx.events,
            rx.metrics,
            cmd_tx,
            &bus,
            signalled,
        )?
    };

    drop(sampler);
    let joined = trainer.join();
    let dropped = bus.dropped();
    drop(bus);
    let log_error = log_writer.and_then(|w| w.finish());
    if let Some(e) = &log_error {
        eprintln!("headroom: warning: {e}");
    }
    if dropped > 0 {
        // Said once at the end: the screen showed the count live; a log reader would
        // otherwise take the gaps between samples for a stalled sampler.
        eprintln!(
            "headroom: {dropped} high-rate samples were dropped on the way to the screen or \
             the log (a reader lagged); steps and events are never dropped"
        );
    }
    finish(end, joined)
}

fn dashboard(
    name: &str,
    events: crossbeam_channel::Receiver<headroom_core::Telemetry>,
    metrics: crossbeam_channel::Receiver<headroom_core::Telemetry>,
    commands: Sender<Command>,
    bus: &Bus,
    signalled: Arc<AtomicBool>,
) -> Result<StreamEnd> {
    let opts = headroom_ui::DashboardOptions {
        signalled,
        ..headroom_ui::DashboardOptions::from_env(name)
    };
    let exit = headroom_ui::run_dashboard(events, metrics, commands, bus.dropped_counter(), opts)
        .context("the dashboard failed")?;
    if exit.force_quit {
        eprintln!("headroom: quit without waiting for the trainer");
    }
    Ok(StreamEnd {
        summary: exit.summary,
        failure: exit.failure,
    })
}

/// SIGINT and SIGTERM stop the run gracefully (checkpoint, then exit 0) instead of killing
/// it mid-step; `signalled` tells a dashboard that outlived its trainer to close.
fn forward_signals(commands: Sender<Command>, signalled: Arc<AtomicBool>) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for _ in signals.forever() {
                signalled.store(true, Ordering::SeqCst);
                let _ = commands.try_send(Command::Stop);
            }
        })
        .context("spawning the signal thread")?;
    Ok(())
}

/// Prints the summary after the screen is gone and picks the exit code.
fn finish(end: StreamEnd, joined: Result<RunSummary, String>) -> Result<ExitCode> {
    match (end.summary, joined) {
        (_, Err(reason)) => {
            let reason = end.failure.unwrap_or(reason);
            eprintln!("headroom: run failed: {reason}");
            Ok(ExitCode::from(1))
        }
        (_, Ok(summary)) => {
            print_summary(&summary);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print_summary(s: &RunSummary) {
    let how = if s.stopped_by_user {
        "stopped"
    } else {
        "completed"
    };
    println!(
        "headroom: run {how} at step {}/{} in {}",
        s.steps_done,
        s.total_steps,
        fmt_duration(s.elapsed_s)
    );
    if let Some(l) = s.last_loss {
        print!("  train loss {l:.4}");
    }
    if let Some(l) = s.last_val_loss {
        print!("  val loss {l:.4}");
    }
    println!("  tokens {}", s.tokens_seen);
    if let Some(c) = &s.checkpoint {
        println!("  checkpoint {c} (continue with --resume)");
    }
}
