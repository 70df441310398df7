//! `headroom`: wires the trainer thread, the sampler, the log writer and the screen.
mod cli;
mod corpus_check;
mod headless;
mod line_keys;
mod plan_cmd;
mod preinit;
mod rundirs;
mod signals;

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use crossbeam_channel::{bounded, Sender};
use headroom_core::units::{fmt_bytes, fmt_duration, fmt_split};
use headroom_core::{Bus, Command, Level, Notice, RunSummary, Telemetry};
use headroom_host::session::{run_bus, Sinks};
use headroom_host::{logger, out, rundir, sampler, server};
use headroom_trainer::alloc_stats::LibtorchAllocator;
use headroom_trainer::runner::{self, TrainOptions};
use headroom_trainer::stop::StopSwitch;

use cli::{Cli, Commands, TrainArgs};
use headless::StreamEnd;

/// headroom's own allocations fall back to pages a hard cap does not count, so the cap
/// refuses training's allocations only (headroom_host::own_heap).
#[global_allocator]
static OWN_HEAP: headroom_host::own_heap::OwnHeap = headroom_host::own_heap::OwnHeap;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Commands::Train(args) => train(args).map(|code| -> ExitCode {
            // Everything is written: checkpoints fsynced, the summary out, the log's writer
            // joined (or given up as stuck). What `exit` would still do is run libtorch's
            // static destructors, 0.5-0.7 s on 2 loaded cores, after a stop's checkpoint.
            use std::io::Write;
            let _ = std::io::stdout().flush();
            signals::exit_mid_step(i32::from(code))
        }),
        Commands::Plan(args) => plan_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Commands::View(cmd) => headroom_viewer::run(cmd).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            out::err(&format!("headroom: error: {e:#}"));
            ExitCode::from(2)
        }
    }
}

/// How long a FIFO given as --log or --corpus is waited for (`HEADROOM_FIFO_WAIT_S`, for
/// tests), before the run refuses to start.
fn fifo_wait() -> Duration {
    std::env::var("HEADROOM_FIFO_WAIT_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map_or(Duration::from_secs(10), Duration::from_secs_f64)
}

/// Why the dashboard cannot be drawn here, when it cannot.
fn screen_unavailable(args: &TrainArgs) -> Option<&'static str> {
    if args.headless {
        return Some("");
    }
    if !std::io::stdout().is_terminal() {
        return Some("");
    }
    match std::env::var("TERM").as_deref() {
        Ok("dumb") => Some("TERM=dumb cannot draw the dashboard"),
        Ok("") | Err(_) => Some("TERM is not set, so the dashboard cannot be drawn"),
        Ok(_) => None,
    }
}

/// The run, and the exit code it ends with.
fn train(mut args: TrainArgs) -> Result<u8> {
    if let Some(r) = args.resume.take() {
        args.resume = Some(rundirs::resume_dir(&r)?);
    }
    let resumed = match &args.resume {
        Some(dir) => Some(runner::read_checkpoint_config(dir).map_err(|e| anyhow::anyhow!("{e}"))?),
        None => None,
    };
    let mut config = args.resolve(resumed)?;
    // Before anything names the run (its socket, its log's first records).
    let renamed = rundirs::pick_fresh(&mut config, &args);
    let inject_oom =
        cli::inject_oom_steps(&args, std::env::var("HEADROOM_INJECT_OOM").ok().as_deref())?;
    let inject_eval_oom =
        cli::inject_eval_oom_chunks(std::env::var("HEADROOM_INJECT_EVAL_OOM").ok().as_deref())?;
    let inject_panic =
        cli::inject_panic_step(std::env::var("HEADROOM_INJECT_PANIC").ok().as_deref())?;
    // Checked now, truncated only once the trainer is ready: a run that fails to start
    // leaves an existing log as it was.
    let corpus = std::path::PathBuf::from(&config.data.corpus);
    let mut inputs: Vec<(&str, &std::path::Path)> = Vec::new();
    if !config.data.corpus.is_empty() {
        // Before the log and the trainer: the path's problem named, with where it was given.
        let given = match (&args.corpus, &args.config, &args.resume) {
            (Some(_), _, _) => "--corpus".to_string(),
            (None, Some(c), _) => format!("data.corpus in {}", c.display()),
            (None, None, Some(_)) => {
                "--corpus (the path the checkpoint recorded; --corpus says where the same \
                 content lives now)"
                    .to_string()
            }
            (None, None, None) => "data.corpus".to_string(),
        };
        corpus_check::check(&corpus, &given, args.resume.is_some()).map_err(anyhow::Error::msg)?;
        inputs.push(("corpus", &corpus));
    }
    if let Some(c) = &args.config {
        inputs.push(("config", c));
    }
    let checkpoint_dir = config.checkpoint_dir();
    let log_file = args
        .log
        .as_deref()
        .map(|p| logger::open(p, &inputs, Some(&checkpoint_dir), fifo_wait()))
        .transpose()?
        .map(|l| l.with_rotation(args.log_rotate));

    // Checked before anything starts: a bad --listen is the user's to fix now.
    if let Some(l) = &args.listen {
        server::parse_listen(l).map_err(|e| anyhow::anyhow!(e))?;
    }
    let (bus, mut rx) = run_bus(log_file.is_some());
    let (cmd_tx, cmd_rx) = bounded::<Command>(64);
    if let Some(text) = &renamed {
        bus.send(Telemetry::Notice(Notice::new(
            Level::Warn,
            "checkpoint",
            text.clone(),
        )));
    }
    let no_screen = screen_unavailable(&args);
    let headless = no_screen.is_some();
    // A terminal without capabilities still has keys: `q` is read there in line mode.
    let line_keys = no_screen.is_some_and(|w| !w.is_empty());
    let stop = StopSwitch::new();

    let opts = TrainOptions {
        checkpoint_dir,
        resume: args.resume.clone(),
        overwrite: args.overwrite,
        allow_changed_corpus: args.allow_changed_corpus,
        fifo_wait: fifo_wait(),
        start_micro_batch: args.start_micro_batch(),
        config: config.clone(),
        inject_oom,
        inject_eval_oom,
        inject_panic,
        stop: stop.clone(),
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
    let serve = server::ServeOptions {
        run_name: config.run.name.clone(),
        listen: args.listen.clone(),
        producer: "headroom train".into(),
        job: None,
    };
    let sinks = Sinks::start(
        &bus,
        log_file,
        rx.log.take(),
        rx.serve.take(),
        cmd_tx.clone(),
        serve,
    );
    let mut sinks = sinks.with_sampler(sampler::Sampler::start(
        bus.clone(),
        trainer.cuda_index(),
        config.run.sample_hz,
        trainer
            .cuda_index()
            .map(|i| Box::new(LibtorchAllocator(i)) as Box<dyn sampler::AllocatorSource>),
    ));
    let flags = signals::Flags::default();
    let wiring = signals::Wiring {
        commands: cmd_tx.clone(),
        flags: flags.clone(),
        screen: !headless,
        checkpoints: trainer.checkpoint_dir().to_path_buf(),
        socket: sinks.server().map(|s| s.addresses().socket.clone()),
        stop: stop.clone(),
        bus: signals::share_bus(&bus),
        on_usr1: config.run.on_usr1,
        on_usr2: config.run.on_usr2,
    };
    let signal_bus = Arc::clone(&wiring.bus);
    signals::forward(wiring.clone())?;
    if let Some(why) = no_screen.filter(|w| !w.is_empty()) {
        let keys = if line_keys && line_keys::spawn(wiring) {
            "type q and Enter to stop (q twice: at once)"
        } else {
            "stop it with Ctrl-C or SIGTERM"
        };
        out::err(&format!(
            "headroom: {why}; running headless (progress lines here); {keys}. Set TERM (e.g. \
             TERM=xterm-256color) for the dashboard, or pass --headless to silence this"
        ));
    }

    let mut end = if headless {
        headless::run(
            rx.events.clone(),
            rx.metrics.clone(),
            config.run.progress_every,
        )
    } else {
        dashboard(
            &config.run.name,
            &rx,
            cmd_tx.clone(),
            &bus,
            &flags,
            args.close_on_finish,
        )
    };
    if end.force_quit {
        // The user asked twice: do not wait for the step in progress. Checkpoints are
        // written whole or not at all, so the last one on disk is intact.
        out::err(&signals::exit_text(
            "q",
            &stop,
            &flags,
            trainer.checkpoint_dir(),
        ));
        if let Some(s) = sinks.server() {
            s.abandon();
        }
        signals::exit_mid_step(130);
    }
    if let Some(why) = end.screen_lost.take() {
        // The screen is gone (a hang-up, a dead terminal): the run goes on, and ends,
        // headless; a hang-up also asked it to stop, like SIGTERM.
        out::err(&format!("headroom: {why}; continuing headless"));
        // Unless the screen had already seen the end: then nothing more will come (and the
        // sampler still holds the bus, so waiting for the stream to close would hang).
        if end.summary.is_none() && end.failure.is_none() {
            end = headless::run(
                rx.events.clone(),
                rx.metrics.clone(),
                config.run.progress_every,
            );
        }
    }

    sinks.stop_sampler();
    let joined = trainer.join();
    // From here a second stop cuts short only the log and the viewers, and says so.
    flags.ended.store(true, Ordering::SeqCst);
    let dropped = bus.dropped();
    let losses = bus.sink_losses();
    drop(bus);
    // The signal thread's hold on the bus goes too, or the log's queue would never close.
    signals::release_bus(&signal_bus);
    // The summary first: whatever the sinks do next, it is on stdout.
    let code = finish(end, joined, args.log.as_deref(), renamed.as_deref());
    // Attached viewers get the last records (the run's end), then the log is flushed.
    let log_error = sinks.close();
    if let Some(e) = &log_error {
        out::err(&format!("headroom: warning: {e}"));
    }
    if losses.log > 0 {
        out::err(&format!(
            "headroom: warning: {} log records were lost while the log's reader was not \
             reading (the log notes each gap where it happened)",
            losses.log
        ));
    }
    if losses.screen > 0 {
        out::err(&format!(
            "headroom: {} events did not reach the screen while it was not drawing",
            losses.screen
        ));
    }
    if dropped > 0 {
        // Said once at the end: the screen showed the count live; a log reader would
        // otherwise take the gaps between samples for a stalled sampler.
        out::err(&format!(
            "headroom: {dropped} high-rate samples were dropped on the way to the screen or \
             the log (a reader lagged); steps and events are never dropped"
        ));
    }
    Ok(code)
}

fn dashboard(
    name: &str,
    rx: &headroom_core::BusReceivers,
    commands: Sender<Command>,
    bus: &Bus,
    flags: &signals::Flags,
    close_on_finish: bool,
) -> StreamEnd {
    let opts = headroom_ui::DashboardOptions {
        close_on_finish,
        signalled: Arc::clone(&flags.stop),
        hangup: Arc::clone(&flags.hangup),
        suspend: Arc::clone(&flags.suspend),
        ..headroom_ui::DashboardOptions::from_env(name)
    };
    let feed = headroom_ui::Feed::in_process(
        rx.events.clone(),
        rx.metrics.clone(),
        commands.clone(),
        bus.dropped_counter(),
    );
    let exit = headroom_ui::run_dashboard(feed, opts);
    match exit {
        Ok(exit) => StreamEnd {
            summary: exit.summary,
            failure: exit.failure,
            force_quit: exit.force_quit,
            screen_lost: if exit.hangup {
                Some("the terminal hung up (SIGHUP): stopping after the step in progress".into())
            } else {
                exit.screen_lost
                    .map(|e| format!("the dashboard lost its terminal ({e})"))
            },
        },
        Err(e) => StreamEnd {
            screen_lost: Some(format!("the dashboard failed ({e})")),
            ..StreamEnd::default()
        },
    }
}

/// Prints the summary after the screen is gone and picks the exit code.
fn finish(
    end: StreamEnd,
    joined: Result<RunSummary, String>,
    log: Option<&Path>,
    renamed: Option<&str>,
) -> u8 {
    if let Some(text) = renamed {
        out::err(&format!("headroom: {text}"));
    }
    match (end.summary, joined) {
        (_, Err(reason)) => {
            let reason = end.failure.unwrap_or(reason);
            out::err(&format!("headroom: run failed: {reason}"));
            if let Some(log) = log {
                out::err(&format!("  log {}", log.display()));
            }
            1
        }
        (_, Ok(summary)) => {
            for line in summary_lines(&summary, log) {
                out::out(&line);
            }
            0
        }
    }
}

/// The exit summary: how the run ended, what it learned, what memory did, where it is.
fn summary_lines(s: &RunSummary, log: Option<&Path>) -> Vec<String> {
    let complete = s.steps_done >= s.total_steps;
    let how = if complete { "completed" } else { "stopped" };
    let mut lines = vec![format!(
        "headroom: run {how} at step {}/{} in {}",
        s.steps_done,
        s.total_steps,
        fmt_duration(s.elapsed_s)
    )];
    let mut learned = String::new();
    if let Some(l) = s.last_loss {
        learned += &format!("  train loss {l:.4}");
    }
    if let Some(l) = s.last_val_loss {
        learned += &format!("  val loss {l:.4}");
    }
    lines.push(format!("{learned}  tokens {}", s.tokens_seen));
    let m = &s.memory;
    let mut memory = String::from("  memory:");
    if let (Some(u), Some(p), Some(l)) = (m.peak_usage, m.peak_bytes, m.limit_bytes) {
        memory += &format!(
            " peak {:.1}% ({} of {})",
            u * 100.0,
            fmt_bytes(p),
            fmt_bytes(l)
        );
    } else {
        memory += " no step measured";
    }
    if m.final_micro_batch > 0 {
        memory += &format!(
            " · micro-batch {}",
            fmt_split(m.final_micro_batch, m.effective_batch)
        );
    }
    let plural = |n: u64, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    memory += &format!(
        " · {} · {} caught",
        plural(m.resizes, "resize"),
        plural(m.ooms, "out-of-memory error")
    );
    lines.push(memory);
    if let Some(c) = &s.checkpoint {
        if complete {
            lines.push(format!("  checkpoint {c}"));
        } else {
            let root = headroom_trainer::checkpoint::root_of(Path::new(c));
            lines.push(format!(
                "  checkpoint {c} (continue with: headroom train --resume {})",
                root.display()
            ));
        }
    }
    if let Some(log) = log {
        lines.push(format!("  log {}", log.display()));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::MemorySummary;

    fn summary(done: u64) -> RunSummary {
        RunSummary {
            steps_done: done,
            total_steps: 300,
            stopped_by_user: done < 300,
            last_loss: Some(1.5),
            last_val_loss: Some(1.6),
            tokens_seen: 1000,
            elapsed_s: 61.0,
            checkpoint: Some("runs/x/step-000300".into()),
            memory: MemorySummary {
                peak_usage: Some(0.879),
                peak_bytes: Some(900 << 20),
                limit_bytes: Some(1 << 30),
                final_micro_batch: 78,
                accum_steps: 4,
                effective_batch: 256,
                resizes: 3,
                ooms: 1,
            },
        }
    }

    #[test]
    fn the_summary_says_what_memory_did_and_offers_resume_only_when_unfinished() {
        let done = summary_lines(&summary(300), Some(Path::new("run.jsonl"))).join("\n");
        assert!(done.contains("completed at step 300/300"), "{done}");
        assert!(done.contains("peak 87.9% (900 MiB of 1.00 GiB)"), "{done}");
        assert!(done.contains("micro-batch 78 × 3 + 22 = 256"), "{done}");
        assert!(
            done.contains("3 resizes · 1 out-of-memory error caught"),
            "{done}"
        );
        assert!(done.contains("log run.jsonl"), "{done}");
        assert!(!done.contains("--resume"), "{done}");
        let stopped = summary_lines(&summary(120), None).join("\n");
        assert!(stopped.contains("stopped at step 120/300"), "{stopped}");
        assert!(stopped.contains("--resume runs/x"), "{stopped}");
    }
}
