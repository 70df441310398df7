//! Batch-size strategies under a real memory cap: headroom's controller against the two
//! usual ways of finding a batch size, on two models and one budget, CPU, with real
//! out-of-memory errors (RLIMIT_DATA, the trainer's `--hard-limit`).
//!
//!     ./dev cargo bench --bench controller                  # 40 optimizer steps per run
//!     ./dev cargo bench --bench controller -- 60            # steps per run
//!     ./dev cargo bench --bench controller -- ramp repeat=3 # one scenario, 3 runs each
//!     ./dev cargo bench --bench controller -- verbose       # each child's attempt trace
//!
//! Strategies (the effective batch is fixed at 256 sequences for all three; each picks
//! only the micro-batch, and accumulates 256 / micro-batch of them per optimizer step):
//!
//! - `headroom`: the real trainer runner (`runner::spawn`) with its memory controller,
//!   starting from the default micro-batch 32; it catches OOMs inside the step and
//!   retries the same samples smaller.
//! - `lightning`: Lightning's `BatchSizeFinder` in `binsearch` mode: trials of 3 steps at
//!   1, 2, 4, ... until one runs out of memory, then bisection between the last success
//!   and the failure; then train at the size found. An OOM while training is a crash:
//!   the run is restarted (credited with resuming at the failed step, as if it had a
//!   checkpoint of every step) and the finder runs again at that step's lengths. Trials
//!   run with lr 0 and the optimizer state is restored after the search, as Lightning
//!   restores its checkpoint, so trials do not train.
//! - `accelerate`: `find_executable_batch_size`: start at 256; every OOM (also one
//!   during training, long after a size was found) restarts with `int(size * 0.9)`.
//!   Credited with resuming at the failed step (real accelerate re-runs the function).
//!
//! Scenarios: `fixed` (every step 64 tokens) and `ramp` (16 → 64 tokens over the first
//! half of the run): a size found on short sequences runs out of memory later; `wide` and
//! `wide-ramp` are the same with a second model (2 layers × 384 instead of 4 × 128);
//! `start1` (headroom starts at micro-batch 1) and `soft` (a 600 MiB budget without a cap,
//! headroom starting at 256).
//!
//! Each (strategy, scenario) runs in a child process (this executable, re-executed with
//! `HEADROOM_BENCH_CONTROLLER=strategy:scenario:steps`), because the cap is process-wide;
//! the child prints one `RESULT {json}` line on stdout and a line per step attempt on
//! stderr. A child that dies without its result line (a Rust allocation failing under
//! the cap aborts the process) is reported as such, with the attempts it got through.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::Instant;

use headroom_core::config::Lengths;
use headroom_core::{Bus, RunConfig, RunStatus, Telemetry};
use headroom_host::procmem::status_kib;
use headroom_trainer::data::Dataset;
use headroom_trainer::model::Gpt;
use headroom_trainer::oom;
use headroom_trainer::optim::{AdamW, AdamWConfig};
use headroom_trainer::peak::PeakMeter;
use headroom_trainer::runner::{self, TrainOptions};
use headroom_trainer::schedule::Schedule;
use headroom_trainer::step::{train_step, StepPlan};
use serde_json::{json, Value};
use tch::Device;

const CHILD_ENV: &str = "HEADROOM_BENCH_CONTROLLER";
const BUDGET: &str = "800MiB";
const EFFECTIVE: usize = 256;
const SEQ_LEN: usize = 64;
const MIN_SEQ_LEN: usize = 16;
/// headroom's starting micro-batch (configs/default.toml's).
const HEADROOM_START: usize = 32;
/// Lightning's `steps_per_trial` default.
const STEPS_PER_TRIAL: usize = 3;
const STRATEGIES: [&str; 3] = ["headroom", "lightning", "accelerate"];
/// `wide*`: the second model, 2 layers × 384 wide (3.6M parameters) instead of the
/// default 4 × 128 (0.83M): fewer, wider layers, so more memory per token.
/// `start1`: fixed lengths, headroom starting at micro-batch 1 (a large fixed part and
/// one measured size). `soft`: a soft 600 MiB budget (no cap, so no strategy ever sees an
/// OOM) with headroom starting at the whole effective batch, 256, far above what fits;
/// the finders, which only react to OOMs, run unbounded there, and their usage column
/// shows how far past the budget.
const SCENARIOS: [&str; 6] = ["fixed", "ramp", "wide", "wide-ramp", "start1", "soft"];
const SOFT_BUDGET: &str = "600MiB";

fn config(scenario: &str, steps: u64) -> RunConfig {
    let mut c = RunConfig::default();
    c.run.name = "bench-controller".into();
    c.run.steps = steps;
    c.run.device = "cpu".into();
    c.run.eval_every = 0;
    c.run.checkpoint_every = 0;
    c.run.eval_batches = 1;
    c.data.seq_len = SEQ_LEN;
    if scenario.starts_with("wide") {
        c.model.n_layer = 2;
        c.model.n_embd = 384;
        c.model.n_head = 6;
    }
    if scenario.ends_with("ramp") {
        c.data.lengths = Lengths::Ramp;
        c.data.min_seq_len = MIN_SEQ_LEN;
        c.data.ramp_steps = (steps / 2).max(1);
    }
    c.batch.micro_batch = match scenario {
        "start1" => 1,
        "soft" => EFFECTIVE,
        _ => HEADROOM_START,
    };
    c.batch.effective_batch = EFFECTIVE;
    c.memory.memory_budget = BUDGET.into();
    c.memory.hard_limit = true;
    if scenario == "soft" {
        c.memory.memory_budget = SOFT_BUDGET.into();
        c.memory.hard_limit = false;
    }
    c.validate().expect("the bench config is valid");
    c
}

/// One forward/backward/update attempt: a trial (finder), or a training step.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    trial: bool,
    /// 1-based optimizer step it belongs to.
    step: u64,
    micro: usize,
    seq: usize,
    ok: bool,
    /// peak / budget, successful attempts only.
    usage: f64,
}

/// What a child measured.
#[derive(Default)]
struct Outcome {
    attempts: Vec<Attempt>,
    /// OOMs that ended the run's process in real life (Lightning after the search,
    /// accelerate every one).
    crashes: u64,
    final_loss: Option<f64>,
    wall_s: f64,
    /// The run ended early with this reason.
    failed: Option<String>,
}

/// One line per attempt on stderr, with the process's resident set and data segment
/// (what RLIMIT_DATA counts) right after it, MiB.
fn progress(a: &Attempt) {
    let mib = |key| status_kib(key).map_or(0, |k| k / 1024);
    eprintln!(
        "attempt step={} micro={} seq={} trial={} ok={} usage={:.3} rss={} data={}",
        a.step,
        a.micro,
        a.seq,
        a.trial,
        a.ok,
        a.usage,
        mib("VmRSS:"),
        mib("VmData:")
    );
}

// ---------------------------------------------------------------------------------------
// headroom: the real runner.

fn run_headroom(cfg: RunConfig) -> Outcome {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (bus, rx) = Bus::new(true);
    // Only the log (lossless for steps and step memory) is read; the trainer's sends to
    // the other two see a closed channel and return at once.
    drop(rx.events);
    drop(rx.metrics);
    let log = rx.log.expect("a bus with a log");
    let (_cmd_tx, cmd_rx) = crossbeam_channel::bounded(8);
    let opts = TrainOptions::new(cfg, dir.path().join("ck"));
    let mut out = Outcome {
        attempts: Vec::with_capacity(256),
        ..Outcome::default()
    };
    let handle = match runner::spawn(opts, bus, cmd_rx) {
        Ok(h) => h,
        Err(e) => {
            out.failed = Some(format!("did not start: {e}"));
            return out;
        }
    };
    let (mut t_start, mut t_last) = (None, 0.0);
    for line in log.iter() {
        match line.msg {
            Telemetry::Status {
                status: RunStatus::Running,
            } if t_start.is_none() => t_start = Some(line.t),
            Telemetry::StepMemory(m) => {
                let a = Attempt {
                    trial: false,
                    step: m.step,
                    micro: m.micro_batch,
                    seq: m.seq_len,
                    ok: true,
                    usage: m.usage,
                };
                progress(&a);
                out.attempts.push(a);
            }
            Telemetry::Step(m) => {
                out.final_loss = Some(m.loss);
                t_last = line.t;
            }
            Telemetry::Oom {
                step,
                micro_batch,
                seq_len,
                error,
                ..
            } => {
                let a = Attempt {
                    trial: false,
                    step,
                    micro: micro_batch,
                    seq: seq_len,
                    ok: false,
                    usage: 0.0,
                };
                progress(&a);
                eprintln!("  oom: {error}");
                out.attempts.push(a);
            }
            Telemetry::Decision { step, decision } => {
                eprintln!("decision after step {step}: {decision:?}")
            }
            Telemetry::Failed { reason } => out.failed = Some(reason),
            _ => {}
        }
    }
    if let Err(e) = handle.join() {
        out.failed.get_or_insert(e);
        out.crashes += 1;
    }
    out.wall_s = t_last - t_start.unwrap_or(0.0);
    out
}

// ---------------------------------------------------------------------------------------
// The baselines: the runner's pieces, driven by the strategy under test.

struct Loop {
    cfg: RunConfig,
    data: Dataset,
    model: Gpt,
    opt: AdamW,
    meter: PeakMeter,
    schedule: Schedule,
    out: Outcome,
}

enum Attempted {
    Done(f64),
    Oom,
}

impl Loop {
    fn new(cfg: RunConfig) -> Loop {
        let data = Dataset::load(&cfg.data.corpus, cfg.data.val_fraction, cfg.data.seq_len)
            .expect("the corpus");
        let model =
            Gpt::new(&cfg.model, cfg.data.seq_len, Device::Cpu, cfg.run.seed).expect("the model");
        let opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim))
            .expect("the optimizer");
        let budget = cfg.memory.budget_bytes().unwrap().expect("a budget");
        let meter = PeakMeter::new(Device::Cpu, Some(budget)).expect("a peak meter");
        // After the model and the optimizer, as the runner does.
        if cfg.memory.hard_limit {
            oom::set_hard_limit(budget).expect("the hard limit");
        }
        Loop {
            schedule: Schedule::new(&cfg.optim, cfg.run.steps),
            cfg,
            data,
            model,
            opt,
            meter,
            out: Outcome {
                attempts: Vec::with_capacity(1024),
                ..Outcome::default()
            },
        }
    }

    fn seq_at(&self, step: u64) -> usize {
        self.cfg.data.seq_len_at(self.cfg.run.seed, step)
    }

    /// One step of `effective` sequences in micro-batches of `micro`; an OOM (error or
    /// panic) drops the attempt, zeroes the gradients and frees the cache.
    fn attempt(
        &mut self,
        trial: bool,
        step: u64,
        micro: usize,
        effective: usize,
        lr: f64,
    ) -> Attempted {
        let seq = self.seq_at(step);
        let plan = StepPlan {
            seed: self.cfg.run.seed,
            step,
            effective_batch: effective,
            micro_batch: micro,
            seq_len: seq,
            lr,
            grad_clip: self.cfg.optim.grad_clip,
            inject_oom: false,
        };
        let _ = self.meter.reset();
        let (model, opt, data) = (&self.model, &mut self.opt, &self.data);
        let result = catch_unwind(AssertUnwindSafe(|| train_step(model, opt, data, &plan)));
        let error = match result {
            Ok(Ok(step_out)) => {
                let usage = self.meter.peak().unwrap_or(0) as f64 / self.meter.limit() as f64;
                let a = Attempt {
                    trial,
                    step,
                    micro,
                    seq,
                    ok: true,
                    usage,
                };
                progress(&a);
                self.out.attempts.push(a);
                return Attempted::Done(step_out.loss);
            }
            Ok(Err(e)) => e.to_string(),
            Err(p) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        };
        if !oom::is_capped_oom_message(&error) {
            panic!("step {step} at micro-batch {micro} failed, not out of memory: {error}");
        }
        self.opt.zero_grad();
        let _ = oom::free_cached(Device::Cpu);
        let a = Attempt {
            trial,
            step,
            micro,
            seq,
            ok: false,
            usage: 0.0,
        };
        progress(&a);
        eprintln!("  oom: {}", error.lines().next().unwrap_or_default());
        self.out.attempts.push(a);
        Attempted::Oom
    }

    /// A training step at `micro`: its loss, or `None` after an OOM.
    fn train(&mut self, step: u64, micro: usize) -> Option<f64> {
        let lr = self.schedule.lr_at(step);
        match self.attempt(false, step, micro, EFFECTIVE, lr) {
            Attempted::Done(loss) => {
                self.out.final_loss = Some(loss);
                Some(loss)
            }
            Attempted::Oom => None,
        }
    }

    /// Lightning's trial: `STEPS_PER_TRIAL` steps of one batch of `micro` sequences.
    fn trial(&mut self, step: u64, micro: usize) -> bool {
        (0..STEPS_PER_TRIAL).all(|_| {
            matches!(
                self.attempt(true, step, micro, micro, 0.0),
                Attempted::Done(_)
            )
        })
    }

    /// Lightning `BatchSizeFinder(mode="binsearch")` on step `step`'s sequences, from 1,
    /// capped at the effective batch (a micro-batch never exceeds it).
    fn lightning_find(&mut self, step: u64) -> Option<usize> {
        let saved: Vec<_> = self
            .opt
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();
        let (mut low, mut high) = (0, None);
        let mut size = 1;
        while high.is_none() {
            if self.trial(step, size) {
                low = size;
                if size == EFFECTIVE {
                    break;
                }
                size = (size * 2).min(EFFECTIVE);
            } else {
                high = Some(size);
            }
        }
        if let Some(mut high) = high {
            while high - low > 1 {
                let mid = (low + high) / 2;
                if self.trial(step, mid) {
                    low = mid;
                } else {
                    high = mid;
                }
            }
        }
        self.opt
            .load_state(&saved)
            .expect("restoring the optimizer state");
        (low > 0).then_some(low)
    }

    fn lightning(&mut self) {
        let steps = self.cfg.run.steps;
        let t0 = Instant::now();
        let mut micro = self.lightning_find(1);
        let mut step = 1;
        while step <= steps {
            let Some(mb) = micro else {
                self.out.failed = Some(format!("no size fits at step {step}"));
                break;
            };
            if self.train(step, mb).is_some() {
                step += 1;
            } else {
                // The fit crashes; the user restarts it and the finder runs again.
                self.out.crashes += 1;
                micro = self.lightning_find(step);
            }
        }
        self.out.wall_s = t0.elapsed().as_secs_f64();
    }

    fn accelerate(&mut self) {
        let steps = self.cfg.run.steps;
        let t0 = Instant::now();
        let mut micro = EFFECTIVE;
        let mut step = 1;
        while step <= steps {
            if self.train(step, micro).is_some() {
                step += 1;
            } else {
                self.out.crashes += 1;
                micro = (micro as f64 * 0.9) as usize;
                if micro == 0 {
                    self.out.failed = Some(format!("reached batch size 0 at step {step}"));
                    break;
                }
            }
        }
        self.out.wall_s = t0.elapsed().as_secs_f64();
    }
}

fn run_baseline(strategy: &'static str, cfg: RunConfig) -> Outcome {
    oom::quiet_oom_panics();
    // Named "trainer" so that the quiet hook also silences OOM panics here.
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || {
            let mut l = Loop::new(cfg);
            match strategy {
                "lightning" => l.lightning(),
                _ => l.accelerate(),
            }
            l.out
        })
        .expect("the trainer thread")
        .join()
        .unwrap_or_else(|_| Outcome {
            failed: Some("the trainer thread panicked".into()),
            ..Outcome::default()
        })
}

// ---------------------------------------------------------------------------------------
// Reduction to the reported figures (the same for every strategy).

fn summarize(o: &Outcome) -> Value {
    let a = &o.attempts;
    let train_ok: Vec<&Attempt> = a.iter().filter(|x| x.ok && !x.trial).collect();
    let last = train_ok.last();
    let final_micro = last.map(|x| x.micro);
    // The final stretch: the longest tail of successful training steps at the final size.
    let tail = a
        .iter()
        .rev()
        .take_while(|x| x.ok && !x.trial && Some(x.micro) == final_micro)
        .count();
    let first_of_tail = (tail > 0).then(|| a[a.len() - tail]);
    let mut path: Vec<String> = Vec::new();
    let mut prev: Option<(usize, bool)> = None;
    for x in a {
        if prev != Some((x.micro, x.ok)) {
            path.push(format!("{}{}", x.micro, if x.ok { "" } else { "!" }));
            prev = Some((x.micro, x.ok));
        }
    }
    json!({
        "steps_done": train_ok.len(),
        "attempts": a.len(),
        "trial_steps": a.iter().filter(|x| x.trial).count(),
        "converged_at_step": first_of_tail.map(|x| x.step),
        "attempts_to_converge": first_of_tail.map(|_| a.len() - tail + 1),
        "ooms": a.iter().filter(|x| !x.ok).count(),
        "crashes": o.crashes,
        "final_micro": final_micro,
        "final_seq": last.map(|x| x.seq),
        "final_usage": last.map(|x| x.usage),
        "max_usage": train_ok.iter().map(|x| x.usage).fold(0.0, f64::max),
        "samples_trained": train_ok.len() * EFFECTIVE,
        "wall_s": o.wall_s,
        "final_loss": o.final_loss,
        "failed": o.failed,
        "path": path.join(" "),
    })
}

fn child(spec: &str) {
    let mut parts = spec.split(':');
    let (strategy, scenario, steps) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().and_then(|s| s.parse().ok()).unwrap_or(40),
    );
    let strategy = STRATEGIES
        .into_iter()
        .find(|s| *s == strategy)
        .unwrap_or_else(|| panic!("unknown strategy in {CHILD_ENV}={spec}"));
    let cfg = config(scenario, steps);
    let outcome = match strategy {
        "headroom" => run_headroom(cfg),
        s => run_baseline(s, cfg),
    };
    let mut result = summarize(&outcome);
    result["strategy"] = json!(strategy);
    result["scenario"] = json!(scenario);
    println!("RESULT {result}");
}

// ---------------------------------------------------------------------------------------
// Parent: one child per (scenario, strategy), then the table.

/// What the parent was asked for.
struct Args {
    steps: u64,
    scenarios: Vec<&'static str>,
    repeats: usize,
    /// Echo each child's per-attempt trace.
    verbose: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        steps: 40,
        scenarios: SCENARIOS.to_vec(),
        repeats: 1,
        verbose: false,
    };
    let mut only = Vec::new();
    for arg in std::env::args().skip(1) {
        if let Ok(n) = arg.parse() {
            a.steps = n;
        } else if let Some(n) = arg.strip_prefix("repeat=").and_then(|n| n.parse().ok()) {
            a.repeats = n;
        } else if arg == "verbose" {
            a.verbose = true;
        } else if let Some(s) = SCENARIOS.into_iter().find(|s| *s == arg) {
            only.push(s);
        }
        // Anything else (cargo's `--bench`) is not ours.
    }
    if !only.is_empty() {
        a.scenarios = only;
    }
    a
}

fn run_child(strategy: &str, scenario: &str, args: &Args) -> Value {
    let exe = std::env::current_exe().expect("the bench executable");
    let t0 = Instant::now();
    let mut cmd = Command::new(exe);
    cmd.env(CHILD_ENV, format!("{strategy}:{scenario}:{}", args.steps));
    let out = cmd.output().expect("the child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if args.verbose {
        eprintln!("---- {scenario} / {strategy}\n{stderr}");
    }
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .and_then(|j| serde_json::from_str::<Value>(j).ok());
    eprintln!(
        "  {scenario:<5} {strategy:<10} {:>6.1} s  {}",
        t0.elapsed().as_secs_f64(),
        out.status
    );
    match result {
        Some(v) => v,
        None => {
            // Died without its result: count what it reported on the way.
            let seen: Vec<&str> = stderr
                .lines()
                .filter(|l| l.starts_with("attempt "))
                .collect();
            let steps_done = seen
                .iter()
                .filter(|l| l.contains("trial=false ok=true"))
                .count();
            let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
            eprintln!(
                "  child died without a result ({}); last stderr lines:\n    {}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n    ")
            );
            json!({
                "strategy": strategy,
                "scenario": scenario,
                "died": format!("process died ({}) after {} attempts", out.status, seen.len()),
                "steps_done": steps_done,
                "samples_trained": steps_done * EFFECTIVE,
                "attempts": seen.len(),
            })
        }
    }
}

fn cell(v: &Value, key: &str) -> String {
    match &v[key] {
        Value::Null => "—".into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn row(v: &Value, steps: u64) -> String {
    let converge = match (&v["converged_at_step"], &v["attempts_to_converge"]) {
        (Value::Number(s), Value::Number(a)) => format!("step {s} ({a})"),
        _ => "never".into(),
    };
    let usage = |key: &str| {
        v[key]
            .as_f64()
            .map_or("—".into(), |u| format!("{:.1}%", u * 100.0))
    };
    let done = v["steps_done"].as_u64().unwrap_or(0);
    let ended = if let Some(d) = v["died"].as_str() {
        format!("{done}/{steps}: {d}")
    } else if v["failed"].is_string() {
        format!("{done}/{steps}: gave up")
    } else {
        format!("{done}/{steps}")
    };
    let loss = v["final_loss"]
        .as_f64()
        .map_or("—".into(), |l| format!("{l:.3}"));
    let wall = v["wall_s"]
        .as_f64()
        .map_or("—".into(), |w| format!("{w:.1}"));
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        cell(v, "scenario"),
        cell(v, "strategy"),
        ended,
        converge,
        cell(v, "ooms"),
        cell(v, "crashes"),
        cell(v, "final_micro"),
        usage("final_usage"),
        usage("max_usage"),
        cell(v, "samples_trained"),
        wall,
        loss,
    )
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let args = parse_args();
    let steps = args.steps;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "batch-size strategies: default model (0.83M params; `wide`: 3.6M), CPU ({cores} cores), budget \
         {BUDGET} as a hard cap (RLIMIT_DATA; `soft`: {SOFT_BUDGET} without a cap), effective \
         batch {EFFECTIVE}, {steps} \
         optimizer steps; fixed = {SEQ_LEN} tokens, ramp = {MIN_SEQ_LEN} → {SEQ_LEN} over \
         {} steps; glibc serves allocations of 64 KiB and up by mmap under the cap (as \
         `--hard-limit` does)",
        (steps / 2).max(1)
    );
    let mut results = Vec::new();
    for scenario in &args.scenarios {
        for _ in 0..args.repeats {
            for strategy in STRATEGIES {
                results.push(run_child(strategy, scenario, &args));
            }
        }
    }
    println!();
    println!(
        "| scenario | strategy | steps done | converged at (attempts) | OOMs \
         | crashes / restarts | final micro-batch | final step peak / budget \
         | max step peak / budget | samples trained | wall s | final loss |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for v in &results {
        println!("{}", row(v, steps));
    }
    println!();
    println!("micro-batch per attempt (consecutive repeats folded; ! = out of memory):");
    for v in &results {
        println!(
            "- {} / {}: {}{}",
            cell(v, "scenario"),
            cell(v, "strategy"),
            cell(v, "path"),
            v["failed"].as_str().map_or(String::new(), |f| format!(
                " (ended: {})",
                f.split(';').next().unwrap_or_default()
            ))
        );
    }
}
