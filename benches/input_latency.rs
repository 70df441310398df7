//! Input latency of the dashboard while the trainer is inside long steps.
//!
//!     ./dev cargo bench --bench input_latency
//!
//! Drives the real dashboard loop (`headroom_ui::drive`) with scripted key presses (`?`,
//! which toggles the help overlay and so forces a redraw) every 100 ms and times each
//! press to the next frame flushed. Two phases in one process: a baseline with no trainer,
//! then a real trainer running multi-second steps on every core.
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use crossterm::event::{Event, KeyCode, KeyEvent, KeyModifiers};
use headroom_core::{Bus, Command, Record, RunConfig};
use headroom_trainer::runner::{self, TrainOptions};
use headroom_ui::DashboardOptions;
use ratatui::backend::{Backend, ClearType, TestBackend, WindowSize};
use ratatui::buffer::Cell;
use ratatui::layout::{Position, Size};
use ratatui::Terminal;

/// A TestBackend that notes when each frame is flushed.
struct Recording {
    inner: TestBackend,
    flushes: Arc<Mutex<Vec<Instant>>>,
}

impl Backend for Recording {
    type Error = <TestBackend as Backend>::Error;
    fn draw<'a, I>(&mut self, content: I) -> Result<(), Self::Error>
    where
        I: Iterator<Item = (u16, u16, &'a Cell)>,
    {
        self.inner.draw(content)
    }
    fn hide_cursor(&mut self) -> Result<(), Self::Error> {
        self.inner.hide_cursor()
    }
    fn show_cursor(&mut self) -> Result<(), Self::Error> {
        self.inner.show_cursor()
    }
    fn get_cursor_position(&mut self) -> Result<Position, Self::Error> {
        self.inner.get_cursor_position()
    }
    fn set_cursor_position<P: Into<Position>>(&mut self, p: P) -> Result<(), Self::Error> {
        self.inner.set_cursor_position(p)
    }
    fn clear(&mut self) -> Result<(), Self::Error> {
        self.inner.clear()
    }
    fn clear_region(&mut self, t: ClearType) -> Result<(), Self::Error> {
        self.inner.clear_region(t)
    }
    fn size(&self) -> Result<Size, Self::Error> {
        self.inner.size()
    }
    fn window_size(&mut self) -> Result<WindowSize, Self::Error> {
        self.inner.window_size()
    }
    fn flush(&mut self) -> Result<(), Self::Error> {
        self.flushes.lock().unwrap().push(Instant::now());
        self.inner.flush()
    }
}

/// Runs the loop until `events` ends, pressing `?` `presses` times; returns latencies.
fn measure(
    events: Receiver<Record>,
    metrics: Receiver<Record>,
    commands: Sender<Command>,
    presses: usize,
    after: impl FnOnce() + Send + 'static,
) -> Vec<Duration> {
    let flushes = Arc::new(Mutex::new(Vec::new()));
    let (keys_tx, keys_rx) = bounded(16);
    let sent = Arc::new(Mutex::new(Vec::new()));
    let sent_log = Arc::clone(&sent);
    let presser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..presses {
            sent_log.lock().unwrap().push(Instant::now());
            let key = KeyEvent::new(KeyCode::Char('?'), KeyModifiers::NONE);
            keys_tx.send(Ok(Event::Key(key))).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
        after();
        keys_tx
    });
    let mut terminal = Terminal::new(Recording {
        inner: TestBackend::new(200, 60),
        flushes: Arc::clone(&flushes),
    })
    .unwrap();
    let opts = DashboardOptions::from_env("bench");
    let feed =
        headroom_ui::Feed::in_process(events, metrics, commands, Arc::new(AtomicU64::new(0)));
    headroom_ui::drive(&mut terminal, feed, &keys_rx, &opts).unwrap();
    drop(presser.join().unwrap());
    let flushes = flushes.lock().unwrap();
    let sent = sent.lock().unwrap();
    sent.iter()
        .filter_map(|s| flushes.iter().find(|f| *f >= s).map(|f| *f - *s))
        .collect()
}

fn report(name: &str, mut lat: Vec<Duration>) -> Duration {
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let median = lat[lat.len() / 2];
    println!(
        "{name:<44} n={:<3} median {:>6.2} ms  p95 {:>6.2} ms  max {:>6.2} ms",
        lat.len(),
        ms(median),
        ms(lat[lat.len() * 95 / 100]),
        ms(lat[lat.len() - 1])
    );
    median
}

fn main() {
    let presses = 40;

    // Baseline: the loop alone, nothing else running.
    let (tx, events) = bounded::<Record>(16);
    let (_mtx, metrics) = bounded::<Record>(16);
    let (cmd_tx, _cmd_rx) = bounded::<Command>(16);
    let base = report(
        "baseline (no trainer)",
        measure(events, metrics, cmd_tx, presses, move || drop(tx)),
    );

    // A real trainer in multi-second steps on every core.
    let dir = tempfile::tempdir().unwrap();
    let mut config = RunConfig::default();
    config.batch.micro_batch = 768;
    config.run.steps = 1000;
    config.run.eval_every = 0;
    config.run.checkpoint_every = 0;
    config.run.eval_batches = 1;
    let (bus, rx) = Bus::new(false);
    let (cmd_tx, cmd_rx) = bounded::<Command>(16);
    let opts = TrainOptions::new(config, dir.path().to_path_buf());
    let trainer = runner::spawn(opts, bus, cmd_rx).expect("trainer starts");
    let stop = cmd_tx.clone();
    let busy = measure(rx.events, rx.metrics, cmd_tx, presses, move || {
        let _ = stop.send(Command::Stop);
    });
    let summary = trainer.join().expect("trainer ends cleanly");
    let step_s = summary.elapsed_s / summary.steps_done.max(1) as f64;
    let busy_median = report(&format!("trainer busy ({:.1} s per step)", step_s), busy);
    println!(
        "busy / baseline median: {:.2}x (frame interval 50 ms)",
        busy_median.as_secs_f64() / base.as_secs_f64()
    );
}
