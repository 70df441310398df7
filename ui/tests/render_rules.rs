//! Rules every frame keeps, checked on the rendered buffer: NO_COLOR means no colour at
//! all, small counters show up, tiny terminals get a message. (Whole-screen snapshots are
//! in screens.rs.)
use headroom_core::policy::{Decision, Profile, ResizeReason, Thresholds};
use headroom_core::{
    AllocatorStats, GpuStats, HostStats, Level, Notice, RunStatus, StepMemory, StepMetrics,
    SystemSample, Telemetry,
};
use headroom_ui::app::App;
use headroom_ui::keys::{bindings, Action, BINDINGS};
use headroom_ui::Mode;
use ratatui::buffer::Buffer;
use ratatui::style::Color;

mod support;
use support::cells;

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
            lr: Some(1e-3),
            grad_norm: Some(1.0),
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
                mem_available: 0,
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
            heap: None,
        }));
    }
    policy_telemetry(&mut app);
    app.apply(&Telemetry::Notice(Notice::new(Level::Warn, "x", "warned")));
    app.apply(&Telemetry::Notice(Notice::new(
        Level::Error,
        "x",
        "errored",
    )));
    app.set_dropped(3);
    app
}

/// Thresholds, step peaks above critical, a resize, a warning and an OOM: every styled
/// element of the memory panels.
fn policy_telemetry(app: &mut App) {
    app.apply(&Telemetry::ThresholdsChanged {
        thresholds: Thresholds::default(),
        profile: Some(Profile::Balanced),
        source: "config".into(),
    });
    let limit: u64 = 8 << 30;
    for n in 1..=20 {
        app.set_elapsed(20.0 + n as f64);
        let usage = 0.90 + n as f64 * 0.003;
        app.apply(&Telemetry::StepMemory(StepMemory {
            step: n,
            micro_batch: 8,
            seq_len: 128,
            peak_bytes: (usage * limit as f64) as u64,
            predicted_bytes: Some((0.93 * limit as f64) as u64),
            limit_bytes: limit,
            configured_limit_bytes: limit,
            usage,
        }));
    }
    for decision in [
        Decision::Warning {
            usage: 0.93,
            forecast: false,
            text: "step 19 peaked at 93% of the limit, above warning 92%; growth stops".into(),
        },
        Decision::EmptyCache { usage: 0.98 },
        Decision::Resize {
            from: 8,
            to: 6,
            reason: ResizeReason::Critical,
            usage: 0.96,
            predicted: Some(0.88),
        },
    ] {
        app.apply(&Telemetry::Decision { step: 20, decision });
    }
    app.apply(&Telemetry::Oom {
        step: 21,
        micro_batch: 6,
        seq_len: 128,
        retry_with: Some(3),
        error: "CUDA out of memory".into(),
    });
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
        assert_eq!(coloured_cells(&cells(&app, w, h)), 0, "main screen {w}x{h}");
        app.handle(Action::ToggleHelp);
        assert_eq!(coloured_cells(&cells(&app, w, h)), 0, "help {w}x{h}");
        app.handle(Action::ToggleHelp);
        // The editor with a refusal, the boldest thing it shows.
        app.handle(Action::EditThresholds);
        app.handle(Action::AdjustThreshold(5));
        app.handle(Action::ApplyThresholds);
        let screen = cells(&app, w, h);
        assert!(text(&screen).contains("refused"), "{w}x{h}");
        assert_eq!(coloured_cells(&screen), 0, "editor {w}x{h}");
    }
    // The same screens with colour on do use colour: the checks above can fail.
    let mut app = busy_app(true);
    assert!(coloured_cells(&cells(&app, 100, 30)) > 0);
    app.handle(Action::EditThresholds);
    assert!(coloured_cells(&cells(&app, 100, 30)) > 0);
}

#[test]
fn dropped_samples_are_counted_in_the_footer_only_when_there_are_some() {
    let mut app = busy_app(true);
    assert!(text(&cells(&app, 100, 30)).contains("dropped samples 3"));
    app.set_dropped(0);
    assert!(!text(&cells(&app, 100, 30)).contains("dropped"));
}

#[test]
fn small_terminals_get_a_message_at_any_size() {
    let app = busy_app(true);
    for (w, h) in [(40, 10), (79, 24), (80, 23), (25, 3)] {
        let screen = text(&cells(&app, w, h));
        assert!(screen.contains("too small"), "{w}x{h}: {screen}");
        assert!(screen.contains(&format!("{w}x{h}")), "{w}x{h}: {screen}");
    }
    for (w, h) in [(1, 1), (1, 40), (200, 1), (0, 0)] {
        cells(&app, w, h); // must not panic
    }
    assert!(!text(&cells(&app, 80, 24)).contains("too small"));
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
        let line = footer(&cells(&app, 80, 24));
        for needed in [" q  stop", " p  pause", " c  checkpoint", " ?  help"] {
            assert!(line.contains(needed), "{needed:?} missing: {line:?}");
        }
        // The threshold editor and the pin key stay while there is room for them.
        if dropped == 0 {
            for needed in [" t  thresholds", " b  pin"] {
                assert!(line.contains(needed), "{needed:?} missing: {line:?}");
            }
        }
        assert_eq!(
            line.contains("dropped samples 123456"),
            dropped > 0,
            "{line:?}"
        );
    }
    // With room, nothing is left out.
    app.set_dropped(0);
    let wide = footer(&cells(&app, 170, 30));
    for needed in [" w  window", " P  profile", " +/-  batch", " f  free cache"] {
        assert!(wide.contains(needed), "{needed:?} missing: {wide:?}");
    }
}

#[test]
fn the_memory_panel_keeps_its_detail_lines_at_the_minimum_size() {
    let cuda = text(&cells(&busy_app(true), 80, 24));
    for needed in [
        // Gauge, threshold marks, OOM risk, headroom, allocator.
        "GPU peak",
        "twce",
        "next step predicted 88% at micro-batch 6",
        "over target",
        "frag",
        // Training panel: the controller's last decision and the OOMs it caught.
        "step 20: 8 → 6 (critical)",
        "OOMs caught 1",
    ] {
        assert!(cuda.contains(needed), "{needed:?} missing at 80x24: {cuda}");
    }
    let mut cpu = App::new("t", true);
    cpu.apply(&Telemetry::Sample(SystemSample {
        host: HostStats {
            cpu_percent: 5.0,
            mem_used: 1 << 30,
            mem_total: 16 << 30,
            mem_available: 0,
            process_rss: 300 << 20,
        },
        gpu: None,
        allocator: None,
        heap: None,
    }));
    cpu.apply(&Telemetry::ThresholdsChanged {
        thresholds: Thresholds::default(),
        profile: Some(Profile::Balanced),
        source: "config".into(),
    });
    let cpu = text(&cells(&cpu, 80, 24));
    // Before the first step's peak the gauge is against host memory, not the budget
    // the thresholds are fractions of: named, not marked.
    assert!(!cpu.contains("twce"), "{cpu}");
    for needed in [
        "thresholds 0.90,0.92,0.95,0.97 (balanced)",
        "process RSS 300 MiB",
        "host 1.00 GiB / 16.0 GiB",
    ] {
        assert!(cpu.contains(needed), "{needed:?} missing at 80x24");
    }
}

/// The README's key table names every key of the help (`+/-` as `+` `-`, `^Z` as
/// `Ctrl-Z`), so the two cannot drift apart.
#[test]
fn the_readmes_key_table_names_every_binding() {
    let readme = include_str!("../../README.md");
    let table: Vec<&str> = readme
        .split("## Keys")
        .nth(1)
        .expect("README has a Keys section")
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect();
    for (key, _, _) in BINDINGS {
        let parts: Vec<String> = match *key {
            k if k.starts_with('^') => vec![format!("Ctrl-{}", &k[1..])],
            k if k.contains(['/', ' ']) => k.split(['/', ' ']).map(String::from).collect(),
            k if k.chars().all(|c| "←→↑↓".contains(c)) => {
                k.chars().map(String::from).collect()
            }
            k => vec![k.to_string()],
        };
        for part in parts {
            let cell = format!("`{part}`");
            assert!(
                table.iter().any(|c| c.contains(&cell)),
                "README's key table lacks {cell} ({key}): {table:#?}"
            );
        }
    }
}

/// In every mode the help fits 80×24 whole: every binding of the mode and the last note
/// (an attached viewer's table is two keys longer than the run's own).
#[test]
fn the_help_keeps_its_last_line_at_the_minimum_size_in_every_mode() {
    for (mode, last) in [
        (Mode::InProcess, "commands apply between steps"),
        (
            Mode::Attached {
                address: "/run/user/1000/headroom/t-1.sock".into(),
            },
            "commands apply between steps",
        ),
        (
            Mode::Replay {
                source: "run.jsonl".into(),
            },
            "a replay is read-only",
        ),
    ] {
        let mut app = busy_app(true).with_mode(mode.clone());
        app.handle(Action::ToggleHelp);
        let screen = cells(&app, 80, 24);
        let rows: Vec<String> = (0..24)
            .map(|y| {
                (0..80)
                    .map(|x| screen[(x, y)].symbol().to_string())
                    .collect()
            })
            .collect();
        for (key, _, what) in bindings(&mode) {
            let line = format!("{key:>5}  {what}");
            assert!(
                rows.iter().any(|r| r.contains(&line)),
                "{mode:?}: {line:?} not on one row: {rows:#?}"
            );
        }
        assert!(
            rows.iter().any(|r| r.contains(last)),
            "{mode:?}: {last:?} cut: {rows:#?}"
        );
    }
}

/// Target, warning and critical are all ruled; on short charts target and warning (2%
/// apart) share a row and its label names both.
#[test]
fn the_memory_chart_shows_rules_peaks_predictions_and_marks() {
    let app = busy_app(true);
    for (w, h, rules) in [
        (80, 24, &["tw 90%", "c  95%"][..]),
        (120, 40, &["tw 90%", "c  95%"][..]),
        (200, 60, &["t  90%", "w  92%", "c  95%"][..]),
    ] {
        let screen = text(&cells(&app, w, h));
        for needed in ["memory vs limit", "╌", "•", "!"].iter().chain(rules) {
            assert!(
                screen.contains(needed),
                "{needed:?} missing at {w}x{h}: {screen}"
            );
        }
    }
}

/// Cells whose symbols, read left to right on one row, spell `needle`.
fn find(buf: &Buffer, needle: &str) -> Option<Vec<(u16, u16)>> {
    let area = buf.area;
    for y in 0..area.height {
        let row: Vec<(u16, String)> = (0..area.width)
            .map(|x| (x, buf[(x, y)].symbol().to_string()))
            .collect();
        let line: String = row.iter().map(|c| c.1.as_str()).collect();
        if let Some(byte) = line.find(needle) {
            let start = line[..byte].chars().count();
            let n = needle.chars().count();
            return Some((start..start + n).map(|i| (row[i].0, y)).collect());
        }
    }
    None
}

/// The gauge's label is written over the bar: every one of its cells must contrast with
/// the colour under it, whatever the bar's alarm colour (here red: 96% used).
#[test]
fn the_gauge_label_reads_over_the_bar() {
    let app = busy_app(true);
    let buf = cells(&app, 100, 30);
    let cells = find(&buf, "GPU peak 7.68 GiB / 8.00 GiB (96.0%)").expect("gauge label");
    let mut over_bar = 0;
    for (x, y) in cells {
        let cell = &buf[(x, y)];
        assert_ne!(cell.fg, cell.bg, "label cell at {x} on its own colour");
        if cell.bg != Color::Reset {
            over_bar += 1;
            assert_ne!(
                cell.fg,
                Color::Reset,
                "default text on the bar's colour at {x}"
            );
        }
    }
    assert!(over_bar > 10, "the bar runs under the label");
}

/// Danger looks dangerous: the OOM and the critical shrink in the event log are drawn in
/// the error colour, not the warning one.
#[test]
fn ooms_and_critical_shrinks_are_drawn_in_the_error_colour() {
    let mut app = busy_app(true);
    // Only policy entries in the log, newest first.
    app.events.retain(|e| e.text.starts_with("step "));
    let buf = cells(&app, 120, 40);
    for needle in ["step 21: out of memory", "step 20: shrink 8 → 6"] {
        let cells = find(&buf, needle).unwrap_or_else(|| panic!("{needle} not on screen"));
        for (x, y) in cells {
            assert_eq!(buf[(x, y)].fg, Color::Red, "{needle} at {x},{y}");
        }
    }
}
