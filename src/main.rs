//! `headroom`: wires the trainer thread, the sampler, the log writer and the screen.
mod cli;
mod headless;
mod logger;
mod sampler;

use std::io::IsTerminal;
use std::process::ExitCode;

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
    let log_file = args.log.as_deref().map(logger::open).transpose()?;

    let (bus, rx) = Bus::new(log_file.is_some());
    let log_writer = match (log_file, rx.log) {
        (Some(out), Some(lines)) => Some(logger::LogWriter::start(
            out,
            args.log.clone().unwrap_or_default(),
            lines,
            bus.ui_only(),
        )),
        _ => None,
    };
    let (cmd_tx, cmd_rx) = bounded::<Command>(64);
    let headless = args.headless || !std::io::stdout().is_terminal();

    let inject_oom =
        cli::inject_oom_steps(&args, std::env::var("HEADROOM_INJECT_OOM").ok().as_deref())?;
    let opts = TrainOptions {
        checkpoint_dir: config.checkpoint_dir(),
        resume: args.resume.clone(),
        config: config.clone(),
        inject_oom,
    };
    if !headless {
        // Before the trainer's own hook (installed by spawn), which then sees panics
        // first: a recovered OOM panic stays quiet instead of reaching this one.
        headroom_ui::install_panic_hook();
    }
    let trainer = runner::spawn(opts, bus.clone(), cmd_rx).map_err(|e| anyhow::anyhow!("{e}"))?;
    let sampler = sampler::Sampler::start(bus.clone(), trainer.cuda_index(), config.run.sample_hz);
    forward_signals(cmd_tx.clone())?;

    let end = if headless {
        headless::run(rx.events, rx.metrics, config.run.progress_every)
    } else {
        dashboard(&config.run.name, rx.events, rx.metrics, cmd_tx, &bus)?
    };

    drop(sampler);
    let joined = trainer.join();
    drop(bus);
    let log_error = log_writer.and_then(|w| w.finish());
    if let Some(e) = &log_error {
        eprintln!("headroom: warning: {e}");
    }
    finish(end, joined)
}

fn dashboard(
    name: &str,
    events: crossbeam_channel::Receiver<headroom_core::Telemetry>,
    metrics: crossbeam_channel::Receiver<headroom_core::Telemetry>,
    commands: Sender<Command>,
    bus: &Bus,
) -> Result<StreamEnd> {
    let opts = headroom_ui::DashboardOptions::from_env(name);
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
/// it mid-step.
fn forward_signals(commands: Sender<Command>) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for _ in signals.forever() {
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
