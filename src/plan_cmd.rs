//! `headroom plan`: where one step's memory goes for the built-in model, before any run,
//! and the largest micro-batch each precision × checkpointing choice fits under target.
//! The shapes split the memory by kind; a probe (two short forward/backward passes,
//! `headroom_trainer::plan_probe`) measures its scale.
use anyhow::{anyhow, Result};
use headroom_core::plan::{Lever, Plan, LEVERS};
use headroom_core::units::fmt_bytes;
use headroom_core::RunConfig;
use headroom_trainer::plan_probe;

use crate::cli::PlanArgs;

/// Measures and prints the plan.
pub fn run(args: PlanArgs) -> Result<()> {
    let cfg = args.resolve()?;
    let (plan, label) = plan_probe::measure(&cfg).map_err(|e| anyhow!(e))?;
    print!(
        "{}",
        render(&plan, &label, lever_of(&cfg), cfg.batch.micro_batch)
    );
    Ok(())
}

fn lever_of(cfg: &RunConfig) -> Lever {
    plan_probe::lever(cfg)
}

/// The table `headroom plan` prints.
pub fn render(plan: &Plan, device: &str, configured: Lever, micro_batch: usize) -> String {
    let s = &plan.shape;
    let p = &plan.probe;
    let t = s.seq_len;
    let mut out = format!(
        "headroom plan on {device}: one step of {} layers × {} wide, {} heads, {t} tokens \
         per sequence\n",
        s.n_layer, s.n_embd, s.n_head
    );
    let row = |out: &mut String, k: &str, v: String| out.push_str(&format!("  {k:<31} {v}\n"));
    out.push_str("fixed (every step):\n");
    row(&mut out, "parameters", fmt_bytes(p.parameters));
    row(&mut out, "gradients", fmt_bytes(p.gradients));
    row(&mut out, "AdamW moments", fmt_bytes(p.optimizer));
    row(
        &mut out,
        "workspace / allocator / process",
        format!(
            "{}{}",
            if plan.overhead < 0 { "-" } else { "" },
            fmt_bytes(plan.overhead.unsigned_abs())
        ),
    );
    row(
        &mut out,
        "AdamW update's transient",
        format!(
            "{} ({}): a step's peak is never below {}",
            fmt_bytes(plan.update_bytes()),
            if p.update > 0 {
                "measured"
            } else {
                "3 × parameters"
            },
            fmt_bytes(plan.update_peak())
        ),
    );
    let probed = p.lever;
    let per = plan.per_token(probed);
    out.push_str(&format!(
        "activations per token ({probed}; measured {:.2}× the shapes' count):\n",
        plan.calibration
    ));
    for (kind, b) in per.kinds() {
        row(&mut out, kind, fmt_bytes(b.round() as u64));
    }
    row(
        &mut out,
        "per sequence",
        format!(
            "{} at {t} tokens, {} at {}",
            fmt_bytes(plan.per_sequence(probed, t) as u64),
            fmt_bytes(plan.per_sequence(probed, 2 * t) as u64),
            2 * t
        ),
    );
    out.push_str(&format!(
        "  attention grows linearly with length here (flash kernels keep a log-sum-exp per \
         head); a math kernel would add {} per sequence at {t} tokens, {} at {}\n",
        fmt_bytes(s.math_attention_scores(t) as u64),
        fmt_bytes(s.math_attention_scores(2 * t) as u64),
        2 * t
    ));
    out.push_str(&format!(
        "measured (forward and backward of {} tokens per sequence): {} at micro-batch {}, \
         {} at {} (predicted {}, {})\n",
        p.seq_len,
        fmt_bytes(p.peaks[0]),
        p.sizes[0],
        fmt_bytes(p.peaks[1]),
        p.sizes[1],
        fmt_bytes(plan.predict(probed, p.sizes[0], p.seq_len)),
        fmt_bytes(plan.predict(probed, p.sizes[1], p.seq_len)),
    ));
    out.push_str(&format!(
        "under target {:.0}% of {} ({}):\n",
        plan.target * 100.0,
        fmt_bytes(plan.budget),
        fmt_bytes((plan.target * plan.budget as f64) as u64)
    ));
    out.push_str(&format!(
        "  {:<22} {:>11} {:>14} {:>16} {:>15}\n",
        "precision · checkpoint",
        "fixed",
        "per sequence",
        format!("peak at mb {micro_batch}"),
        "largest mb"
    ));
    for lever in LEVERS {
        let mark = if lever == configured { "*" } else { " " };
        let name = format!("{} · {}", lever.precision, lever.checkpoint);
        let largest = plan
            .largest_micro_batch(lever, t)
            .map_or("none fits".to_string(), |n| n.to_string());
        out.push_str(&format!(
            "{mark} {name:<22} {:>11} {:>14} {:>16} {:>15}\n",
            fmt_bytes(plan.fixed(lever)),
            fmt_bytes(plan.per_sequence(lever, t) as u64),
            fmt_bytes(plan.predict(lever, micro_batch, t)),
            largest
        ));
    }
    out.push_str(
        "  * the configured choice (probed); the other rows scale the probe by the shapes\n",
    );
    out
}
