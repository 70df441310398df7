//! What the UI's test files share: drawing a screen, the run the screens start, and a
//! step's report. Each test file uses a part of it.
#![allow(dead_code)]

pub mod synthetic;

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use headroom_core::{Record, RunConfig, RunInfo, StepMetrics, Telemetry};
use headroom_ui::app::App;
use headroom_ui::view::render;
use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::Terminal;

/// The app drawn once on a `w`×`h` test terminal.
pub fn draw(app: &App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).expect("test backend");
    terminal.draw(|f| render(f, app)).expect("draw");
    terminal
}

/// The drawn screen as text, a line per row.
pub fn screen(app: &App, w: u16, h: u16) -> String {
    format!("{}", draw(app, w, h).backend())
}

/// The drawn cells, styles included.
pub fn cells(app: &App, w: u16, h: u16) -> Buffer {
    draw(app, w, h).backend().buffer().clone()
}

/// The bundled default run: the built-in model on tinyshakespeare, 300 steps.
pub fn run_info(device: &str, device_name: &str) -> RunInfo {
    RunInfo {
        run_name: "default".into(),
        device: device.into(),
        device_name: device_name.into(),
        parameters: 830_464,
        start_step: 0,
        total_steps: 300,
        corpus: "tinyshakespeare.txt (bundled)".into(),
        train_bytes: 1_003_854,
        val_bytes: 111_540,
        config: Some(RunConfig::default()),
        checkpoints: Some(true),
        levers: None,
    }
}

/// Step `n` of the default run at `micro_batch`, the effective batch 32 throughout: the
/// controller trades micro-batch for accumulation.
pub fn step(n: u64, micro_batch: usize) -> StepMetrics {
    StepMetrics {
        step: n,
        total_steps: 300,
        loss: 5.5 - 3.0 * (1.0 - (-(n as f64) / 20.0).exp()),
        lr: Some(3e-3),
        grad_norm: Some(0.8),
        step_time_s: 0.095,
        tokens_per_s: 21_500.0,
        samples_per_s: 336.0,
        micro_batch,
        accum_steps: 32 / micro_batch,
        effective_batch: 32,
        seq_len: 64,
        tokens_seen: n * 2048,
    }
}

/// What a record says, for comparing a replay's order: a notice's text, else its kind.
pub fn text_of(r: &Record) -> String {
    match &r.msg {
        Telemetry::Notice(n) => n.text.clone(),
        other => other.kind().to_string(),
    }
}

/// The next record on `rx` within `within`, as [`text_of`] says it; `None` when none
/// came, `<disconnected>` when the replay ended.
pub fn next(rx: &Receiver<Record>, within: Duration) -> Option<String> {
    match rx.recv_timeout(within) {
        Ok(r) => Some(text_of(&r)),
        Err(RecvTimeoutError::Timeout) => None,
        Err(RecvTimeoutError::Disconnected) => Some("<disconnected>".into()),
    }
}
