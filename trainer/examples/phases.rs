//! Where a step's time goes: the phases of `step::train_step` timed one by one on the CPU,
//! in this process's CPU time (a shared machine's load moves wall time far more).
//!
//!     cargo run --release -p headroom-trainer --example phases -- [threads] [layers] [embd] [batch] [seq] [steps]

use headroom_core::RunConfig;
use headroom_trainer::data::Dataset;
use headroom_trainer::model::Gpt;
use headroom_trainer::optim::{AdamW, AdamWConfig};
use tch::{Device, Kind, Tensor};

/// This process's CPU time (every thread), seconds.
fn cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let arg = |i: usize, d: usize| a.get(i).copied().unwrap_or(d);
    let (threads, layers, embd, batch, seq, steps) = (
        arg(0, 1),
        arg(1, 4),
        arg(2, 128),
        arg(3, 64),
        arg(4, 64),
        arg(5, 20),
    );
    tch::set_num_threads(threads as i32);
    let mut cfg = RunConfig::default();
    cfg.model.n_layer = layers;
    cfg.model.n_embd = embd;
    cfg.data.seq_len = seq;
    let data = Dataset::load(&cfg.data.corpus, cfg.data.val_fraction, seq).unwrap();
    let model = Gpt::new(&cfg.model, seq, Device::Cpu, 1).unwrap();
    let mut opt = AdamW::new(model.named_parameters(), AdamWConfig::from(&cfg.optim)).unwrap();
    let names = ["data", "fwd+bwd", "norm+clip", "adamw", "sync"];
    let mut tot = [0f64; 5];
    for step in 1..=steps as u64 {
        let mut t = cpu_s();
        let mut lap = |i: usize, t: &mut f64| {
            let now = cpu_s();
            if step > 1 {
                tot[i] += now - *t;
            }
            *t = now;
        };
        opt.zero_grad();
        let (x, y) = data
            .train_batch(1, step, 0, batch, seq, Device::Cpu)
            .unwrap();
        lap(0, &mut t);
        let loss = model.loss_backward(&x, &y, 1.0).unwrap();
        lap(1, &mut t);
        let grads = opt.grads();
        let norms: Vec<Tensor> = grads.iter().map(|g| g.norm()).collect();
        let norm = Tensor::stack(&norms, 0).norm();
        let coef = (norm.shallow_clone() + 1e-6).reciprocal().clamp_max(1.0);
        {
            let _g = tch::no_grad_guard();
            for mut g in grads {
                let _ = g.f_mul_(&coef).unwrap();
            }
        }
        lap(2, &mut t);
        opt.step(1e-3).unwrap();
        lap(3, &mut t);
        let _ = Vec::<f64>::try_from(&Tensor::stack(&[loss, norm], 0).to_kind(Kind::Double));
        lap(4, &mut t);
    }
    let all: f64 = tot.iter().sum();
    for (n, v) in names.iter().zip(tot) {
        println!(
            "{n:>10}: {:8.1} ms/step {:5.1}%",
            1e3 * v / (steps - 1) as f64,
            100.0 * v / all
        );
    }
    println!(
        "{:>10}: {:8.1} ms/step, {:.0} tok/s",
        "total",
        1e3 * all / (steps - 1) as f64,
        ((steps - 1) * batch * seq) as f64 / all
    );
}
