//! Rules every frame keeps, checked on the rendered buffer: NO_COLOR means no colour at
//! all, small counters show up, tiny terminals get a message. (Whole-screen snapshots are
//! in screens.rs.)
use headroom_core::{
    AllocatorStats, GpuStats, HostStats, Level, Notice, RunStatus, StepMetrics, SystemSample,
    Telemetry,
};
use headroom_ui::app::App;
use headroom_ui::keys::Action;
use headroom_ui::view::render;
use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::style::Color;
use ratatui::Terminal;

fn draw(app: &App, w: u16, h: u16) -> Buffer {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).expect("test backend");
    terminal.draw(|f| render(f, app)).expect("draw");
    terminal.backend().buffer().clone()
}

fn text(buf: &Buffer) -> String {
    buf.content().iter().map(|c| c.symbol()).collect()
}

/// A run with every panel populated, warnings and errors included, so every styled
/// element is on screen.
fn busy_app(color: bool) -> App {
    let mut app = App::new("t", color);
    app.apply(&Telemetry::Status {
        status: RunStatus::Running,
    });
    for n in 1..=20 {
        app.set_elapsed(n as f64);
        app.apply(&Telemetry::Step(StepMetrics {
            step: n,
            total_steps: 100,
            loss: 3.0 - n as f64 * 0.05,
            lr: 1e-3,
            grad_norm: 1.0,
            step_time_s: 0.1,
            tokens_per_s: 1000.0,
            samples_per_s: 10.0,
            micro_batch: 8,
            accum_steps: 4,
            effective_batch: 32,
            seq_len: 128,
            tokens_seen: n * 4096,
        }));
        app.apply(&Telemetry::Sample(SystemSample {
            host: HostStats {
                cpu_percent: 50.0,
                mem_used: 8 << 30,
                mem_total: 16 << 30,
                process_rss: 2 << 30,
            },
            // 96% full: the gauge takes its alarm colour.
            gpu: Some(GpuStats {
                name: "GPU".into(),
                mem_used: (768 << 20) * 10,
                mem_total: 8 << 30,
                ..Default::default()
            }),
            allocator: Some(AllocatorStats {
                reserved: 6 << 30,
                allocated: 5 << 30,
                num_ooms: 1,
                ..Default::default()
            }),
        }));
    }
    app.apply(&Telemetry::Notice(Notice::new(Level::Warn, "x", "warned")));
    app.apply(&Telemetry::Notice(Notice::new(
        Level::Error,
        "x",
        "errored",
    )));
    app.set_dropped(3);
    app
}

fn coloured_cells(buf: &Buffer) -> usize {
    buf.content()
        .iter()
        .filter(|c| c.fg != Color::Reset || c.bg != Color::Reset)
        .count()
}

#[test]
fn no_color_means_not_one_coloured_cell() {
    for (w, h) in [(100, 30), (140, 44)] {
        let mut app = busy_app(false);
        assert_eq!(coloured_cells(&draw(&app, w, h)), 0, "main screen {w}x{h}");
        app.handle(Action::ToggleHelp);
        assert_eq!(coloured_cells(&draw(&app, w, h)), 0, "help {w}x{h}");
    }
    // The same screen with colour on does use colour: the check above can fail.
    assert!(coloured_cells(&draw(&busy_app(true), 100, 30)) > 0);
}

#[test]
fn dropped_samples_are_counted_in_the_footer_only_when_there_are_some() {
    let mut app = busy_app(true);
    assert!(text(&draw(&app, 100, 30)).contains("dropped samples 3"));
    app.set_dropped(0);
    assert!(!text(&draw(&app, 100, 30)).contains("dropped"));
}

#[test]
fn small_terminals_get_a_message_at_any_size() {
    let app = busy_app(true);
    for (w, h) in [(40, 10), (79, 24), (80, 23), (25, 3)] {
        let screen = text(&draw(&app, w, h));
        assert!(screen.contains("too small"), "{w}x{h}: {screen}");
        assert!(screen.contains(&format!("{w}x{h}")), "{w}x{h}: {screen}");
    }
    for (w, h) in [(1, 1), (1, 40), (200, 1), (0, 0)] {
        draw(&app, w, h); // must not panic
    }
    assert!(!text(&draw(&app, 80, 24)).contains("too small"));
}

fn footer(buf: &Buffer) -> String {
    let area = buf.area;
    (0..area.width)
        .map(|x| buf[(x, area.height - 1)].symbol().to_string())
        .collect()
}

#[test]
fn the_footer_keeps_quit_pause_checkpoint_and_help_at_the_minimum_width() {
    let mut app = busy_app(true);
    for dropped in [0, 123_456] {
        app.set_dropped(dropped);
        let line = footer(&draw(&app, 80, 24));
        for needed in [" q  stop", " p  pause", " c  checkpoint", " ?  help"] {
            assert!(line.contains(needed), "{needed:?} missing: {line:?}");
        }
        assert_eq!(
            line.contains("dropped samples 123456"),
            dropped > 0,
            "{line:?}"
        );
    }
    // With room, nothing is left out.
    assert!(footer(&draw(&app, 120, 30)).contains(" w  window"));
}

#[test]
fn the_memory_panel_keeps_its_detail_lines_at_the_minimum_size() {
    let cuda = text(&draw(&busy_app(true), 80, 24));
    for needed in ["headroom", "frag", "OOMs 1"] {
        assert!(cuda.contains(needed), "{needed:?} missing at 80x24");
    }
    let mut cpu = App::new("t", true);
    cpu.apply(&Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 5.0,
            mem_used: 1 << 30,
            mem_total: 16 << 30,
            process_rss: 300 << 20,
        },
        gpu: None,
        allocator: None,
    }));
    let cpu = text(&draw(&cpu, 80, 24));
    for needed in [
        "process RSS 300 MiB",
        "host 1.00 GiB / 16.0 GiB",
        "CUDA-only",
    ] {
        assert!(cpu.contains(needed), "{needed:?} missing at 80x24");
    }
}
