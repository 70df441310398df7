//! The built-in AdamW against `torch.optim.AdamW` itself: the numbers torch 2.11 produced
//! for two parameters over 12 steps (fixtures/adamw_torch.py wrote them), replayed here
//! with the same gradients and learning rates. Training fidelity: the trainer's update
//! may differ from PyTorch's by float32 rounding, not by formula.
use std::path::Path;

use headroom_trainer::optim::{AdamW, AdamWConfig};
use serde_json::Value;
use tch::{Kind, Tensor};

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn set_grad(p: &Tensor, values: &[f32]) {
    if !p.grad().defined() {
        p.sum(Kind::Float).backward();
    }
    let _guard = tch::no_grad_guard();
    p.grad()
        .copy_(&Tensor::from_slice(values).view(p.size().as_slice()));
}

#[test]
fn adamw_equals_torch_within_a_millionth() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adamw_torch.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let w = Tensor::from_slice(&floats(&fx["init"]["w"]))
        .view([3, 4])
        .set_requires_grad(true);
    let b = Tensor::from_slice(&floats(&fx["init"]["b"])).set_requires_grad(true);
    let mut opt = AdamW::new(
        vec![
            ("w".into(), w.shallow_clone()),
            ("b".into(), b.shallow_clone()),
        ],
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        },
    )
    .unwrap();
    let steps = fx["steps"].as_array().unwrap();
    for s in steps {
        set_grad(&w, &floats(&s["grad_w"]));
        set_grad(&b, &floats(&s["grad_b"]));
        opt.step(s["lr"].as_f64().unwrap()).unwrap();
    }
    assert_eq!(opt.steps_taken(), steps.len() as u64);

    let mut ours: Vec<(String, Tensor)> = opt.state_tensors();
    ours.push(("w".into(), w.shallow_clone()));
    ours.push(("b".into(), b.shallow_clone()));
    let mut worst = 0f64;
    for key in ["w", "b", "m.w", "v.w", "m.b", "v.b"] {
        let want = floats(&fx["final"][key]);
        let got = ours
            .iter()
            .find(|(n, _)| n == key)
            .unwrap()
            .1
            .flatten(0, -1);
        let got = Vec::<f32>::try_from(&got).unwrap();
        assert_eq!(got.len(), want.len(), "{key}");
        for (i, (g, t)) in got.iter().zip(&want).enumerate() {
            let rel = (f64::from(*g) - f64::from(*t)).abs() / f64::from(t.abs()).max(1e-12);
            worst = worst.max(rel);
            assert!(
                rel <= 1e-6,
                "{key}[{i}]: ours {g:e}, torch.optim.AdamW {t:e} (relative {rel:e})"
            );
        }
    }
    println!("largest relative difference from torch.optim.AdamW: {worst:e}");
}
