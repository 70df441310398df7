//! Headless mode: the same run, with one-line progress on stderr instead of a screen.
use std::io::Write;

use crossbeam_channel::{select, Receiver};
use headroom_core::policy::Decision;
use headroom_core::units::{fmt_bytes, fmt_duration, fmt_split};
use headroom_core::{EvalMemory, Level, Record, RunSummary, StepMetrics, Telemetry};

/// What the run ended with, as seen from the telemetry stream.
#[derive(Debug, Default)]
pub struct StreamEnd {
    pub summary: Option<RunSummary>,
    pub failure: Option<String>,
    /// The user asked twice to quit from the screen: exit without waiting for the step.
    pub force_quit: bool,
    /// The screen went away mid-run (hang-up, dead terminal) and why: the run goes on
    /// headless.
    pub screen_lost: Option<String>,
}

/// Turns telemetry into progress lines. Kept apart from the loop so it is testable.
#[derive(Default)]
pub struct Progress {
    every: u64,
    rss: Option<u64>,
    gpu_used: Option<(u64, u64)>,
}

impl Progress {
    pub fn new(every: u64) -> Progress {
        Progress {
            every: every.max(1),
            ..Default::default()
        }
    }

    /// The line to print for `msg`, if any.
    pub fn line(&mut self, msg: &Telemetry) -> Option<String> {
        match msg {
            Telemetry::RunStarted(info) => Some(format!(
                "headroom: run '{}' on {} ({}), {:.2}M parameters, steps {}..{}",
                info.run_name,
                info.device,
                info.device_name,
                info.parameters as f64 / 1e6,
                info.start_step + 1,
                info.total_steps
            )),
            Telemetry::Step(s) if s.step % self.every == 0 || s.step == s.total_steps => {
                Some(self.step_line(s))
            }
            Telemetry::Sample(sample) => {
                self.rss = Some(sample.host.process_rss);
                self.gpu_used = sample.gpu.as_ref().map(|g| (g.mem_used, g.mem_total));
                None
            }
            Telemetry::Eval(e) => Some(format!(
                "eval step {:>6}: val loss {:.4}  train loss {:.4}",
                e.step, e.val_loss, e.train_loss
            )),
            Telemetry::Notice(n) => {
                let tag = match n.level {
                    Level::Info => "note",
                    Level::Warn => "warning",
                    Level::Error => "error",
                };
                Some(format!("{tag} [{}]: {}", n.source, n.text))
            }
            Telemetry::CheckpointSaved { step, path } => {
                Some(format!("checkpoint at step {step}: {path}"))
            }
            Telemetry::Hint(h) if h.raised => Some(format!("hint [{}]: {}", h.hint.label(), h.text)),
            Telemetry::Hint(h) => Some(format!("hint cleared [{}]: {}", h.hint.label(), h.text)),
            Telemetry::Failed { reason } => Some(format!("run failed: {reason}")),
            Telemetry::Oom {
                step,
                micro_batch,
                seq_len,
                retry_with,
                ..
            } => Some(match retry_with {
                Some(n) => format!(
                    "out of memory in step {step} at micro-batch {micro_batch} x {seq_len} tokens; retrying with {n}"
                ),
                None => format!(
                    "out of memory in step {step} at micro-batch {micro_batch} x {seq_len} tokens; giving up"
                ),
            }),
            Telemetry::EvalOom {
                step,
                phase,
                size,
                seq_len,
                retry_with,
                ..
            } => {
                let then = match retry_with {
                    Some(n) => format!("retrying in chunks of {n}"),
                    None if *size <= 1 => "one sample does not fit: the evaluation fails".into(),
                    None => "not retried: the evaluation fails".into(),
                };
                Some(format!(
                    "out of memory in {phase} {} in chunks of {size} x {seq_len} tokens; {then}",
                    eval_when(*step)
                ))
            }
            Telemetry::EvalMemory(m) => Some(eval_memory_line(m)),
            Telemetry::Decision { step, decision } => match decision {
                Decision::Resize {
                    from,
                    to,
                    reason,
                    usage,
                    ..
                } => Some(format!(
                    "after step {step}: micro-batch {from} -> {to} ({reason:?} at {:.0}%)",
                    usage * 100.0
                )),
                Decision::Warning { text, .. } => Some(format!("warn [memory]: {text}")),
                Decision::Lever { .. } => Some(format!(
                    "note [lever]: {}",
                    headroom_ui::describe::decision_event(*step, decision).1
                )),
                _ => None,
            },
            Telemetry::ThresholdsChanged {
                thresholds, source, ..
            } if source != "config" => Some(format!("thresholds now {thresholds} ({source})")),
            _ => None,
        }
    }

    fn step_line(&self, s: &StepMetrics) -> String {
        let eta = (s.total_steps.saturating_sub(s.step)) as f64 * s.step_time_s;
        let mem = match (self.gpu_used, self.rss) {
            (Some((used, total)), _) => format!("gpu {}/{}", fmt_bytes(used), fmt_bytes(total)),
            (None, Some(rss)) => format!("rss {}", fmt_bytes(rss)),
            (None, None) => String::new(),
        };
        format!(
            "step {:>6}/{}  loss {:.4}  lr {}  {:.1} steps/s  {:.0} tok/s  batch {}  {}  eta {}",
            s.step,
            s.total_steps,
            s.loss,
            s.lr.map_or("-".into(), |lr| format!("{lr:.2e}")),
            1.0 / s.step_time_s.max(1e-9),
            s.tokens_per_s,
            fmt_split(s.micro_batch, s.effective_batch),
            mem,
            fmt_duration(eta)
        )
    }
}

/// The training step an evaluation follows, in words (0: before the first).
fn eval_when(step: u64) -> String {
    match step {
        0 => "before the first step".into(),
        n => format!("after step {n}"),
    }
}

/// An evaluation pass's memory, as the `eval` line says its loss.
fn eval_memory_line(m: &EvalMemory) -> String {
    let split = if m.size < m.asked {
        format!("in chunks of {}", m.size)
    } else {
        "whole".into()
    };
    // A driver that measured no chunk has no peak.
    let peak = match m.peak_bytes {
        0 => "peak not measured".into(),
        b => format!("peak {:.0}% ({})", m.usage * 100.0, fmt_bytes(b)),
    };
    format!(
        "{} step {:>6}: {} batches of {} {split}  {peak}  ooms {}  {:.1}s",
        m.phase, m.step, m.batches, m.asked, m.ooms, m.seconds
    )
}

/// Prints progress until the run finishes or fails (or the trainer goes away).
pub fn run(events: Receiver<Record>, metrics: Receiver<Record>, progress_every: u64) -> StreamEnd {
    let mut progress = Progress::new(progress_every);
    let mut end = StreamEnd::default();
    let stderr = std::io::stderr();
    loop {
        let msg = select! {
            recv(events) -> m => match m { Ok(m) => m.msg, Err(_) => break },
            recv(metrics) -> m => match m { Ok(m) => m.msg, Err(_) => continue },
        };
        if let Some(line) = progress.line(&msg) {
            let _ = writeln!(stderr.lock(), "{line}");
        }
        match msg {
            Telemetry::Finished(s) => {
                end.summary = Some(s);
                break;
            }
            Telemetry::Failed { reason } => {
                end.failure = Some(reason);
                break;
            }
            _ => {}
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::{HostStats, SystemSample};

    fn step(n: u64) -> Telemetry {
        Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 100,
            loss: 2.5,
            lr: Some(1e-3),
            grad_norm: Some(1.0),
            step_time_s: 0.5,
            tokens_per_s: 4096.0,
            samples_per_s: 64.0,
            micro_batch: 16,
            accum_steps: 2,
            effective_batch: 32,
            seq_len: 64,
            tokens_seen: n * 2048,
        })
    }

    #[test]
    fn memory_events_get_a_line_each() {
        use headroom_core::policy::ResizeReason;
        let mut p = Progress::new(10);
        let oom = p
            .line(&Telemetry::Oom {
                step: 7,
                micro_batch: 64,
                seq_len: 128,
                retry_with: Some(32),
                error: "CUDA out of memory".into(),
            })
            .unwrap();
        assert!(
            oom.contains("step 7") && oom.contains("retrying with 32"),
            "{oom}"
        );
        let resize = p
            .line(&Telemetry::Decision {
                step: 9,
                decision: Decision::Resize {
                    from: 32,
                    to: 48,
                    reason: ResizeReason::Grow,
                    usage: 0.61,
                    predicted: Some(0.88),
                },
            })
            .unwrap();
        assert!(
            resize.contains("32 -> 48") && resize.contains("61%"),
            "{resize}"
        );
        assert!(p
            .line(&Telemetry::Decision {
                step: 9,
                decision: Decision::EmptyCache { usage: 0.99 },
            })
            .is_none());
    }

    #[test]
    fn evaluation_gets_a_line_for_its_ooms_and_its_memory() {
        let mut p = Progress::new(10);
        let oom = |retry_with, size| Telemetry::EvalOom {
            step: 40,
            phase: "validation".into(),
            size,
            seq_len: 128,
            retry_with,
            error: "CUDA out of memory".into(),
        };
        assert_eq!(
            p.line(&oom(Some(32), 64)).unwrap(),
            "out of memory in validation after step 40 in chunks of 64 x 128 tokens; retrying in chunks of 32"
        );
        assert_eq!(
            p.line(&oom(None, 1)).unwrap(),
            "out of memory in validation after step 40 in chunks of 1 x 128 tokens; one sample does not fit: the evaluation fails"
        );
        let pass = EvalMemory {
            step: 40,
            phase: "validation".into(),
            batches: 12,
            samples: 760,
            asked: 64,
            size: 32,
            chunks: 25,
            seq_len: 128,
            peak_bytes: 2_254_857_830,
            limit_bytes: 3 << 30,
            usage: 0.7,
            ooms: 1,
            seconds: 2.31,
        };
        assert_eq!(
            p.line(&Telemetry::EvalMemory(pass.clone())).unwrap(),
            "validation step     40: 12 batches of 64 in chunks of 32  peak 70% (2.10 GiB)  ooms 1  2.3s"
        );
        let whole = EvalMemory {
            step: 0,
            size: 64,
            peak_bytes: 0,
            ooms: 0,
            ..pass
        };
        assert_eq!(
            p.line(&Telemetry::EvalMemory(whole)).unwrap(),
            "validation step      0: 12 batches of 64 whole  peak not measured  ooms 0  2.3s"
        );
    }

    #[test]
    fn prints_every_nth_step_and_the_last() {
        let mut p = Progress::new(10);
        assert!(p.line(&step(9)).is_none());
        let line = p.line(&step(10)).unwrap();
        assert!(line.contains("step     10/100"), "{line}");
        assert!(line.contains("batch 16 × 2 = 32"), "{line}");
        assert!(line.contains("eta 45s"), "{line}");
        assert!(p.line(&step(100)).is_some());
    }

    #[test]
    fn shows_latest_memory_figure() {
        let mut p = Progress::new(1);
        p.line(&Telemetry::Sample(SystemSample {
            host: HostStats {
                process_rss: 300 << 20,
                ..Default::default()
            },
            ..Default::default()
        }));
        assert!(p.line(&step(1)).unwrap().contains("rss 300 MiB"));
    }
}
