//! One run session for every driver: a command's answer, a profile's name and the
//! command channel's answers are written once, in host/src/session/, not again in the
//! built-in trainer (trainer/src) or the Python extension (py/src). Read from the
//! sources, since a second copy compiles and passes every behaviour test until the two
//! drift apart.
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every non-test Rust source under the crates that run a session: files of tests and
/// `#[cfg(test)]` modules left out.
fn sources() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for dir in ["core/src", "host/src", "trainer/src", "py/src"] {
        walk(&root().join(dir), &mut out);
    }
    assert!(out.len() > 20, "found only {} sources", out.len());
    out
}

fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            let text = fs::read_to_string(&path).unwrap();
            let code = match text.find("#[cfg(test)]") {
                Some(i) => text[..i].to_string(),
                None => text,
            };
            out.push((path, code));
        }
    }
}

fn files_saying(sources: &[(PathBuf, String)], what: &str) -> Vec<String> {
    sources
        .iter()
        .filter(|(_, code)| code.contains(what))
        .map(|(p, _)| p.strip_prefix(root()).unwrap_or(p).display().to_string())
        .collect()
}

#[test]
fn every_command_answer_is_written_once_in_the_session() {
    let sources = sources();
    for answer in [
        "the controller resizes again",
        "already paused",
        "micro-batch pinned at",
        "already running",
        "{old} stay in force",
        "paused after step",
        "resumed at step",
        "stopping after step",
        "is set by its script",
        "precision is already",
        "activation checkpointing is already",
        "has no micro-batch",
    ] {
        assert_eq!(
            files_saying(&sources, answer),
            ["host/src/session/commands.rs"],
            "{answer:?}"
        );
    }
}

#[test]
fn a_profile_is_worked_out_in_one_place() {
    let sources = sources();
    // The one list of presets (`Profile::of`), which the session's `thresholds_changed`
    // asks for every driver.
    assert_eq!(
        files_saying(&sources, "Profile::Conservative,\n"),
        ["core/src/policy/thresholds.rs"]
    );
}

#[test]
fn drivers_hand_the_session_what_happened_instead_of_saying_it_themselves() {
    let sources = sources();
    for record in [
        "Telemetry::CommandApplied",
        "Telemetry::Step(",
        "Telemetry::StepMemory",
        "Telemetry::Oom",
        "Telemetry::Decision",
        "Telemetry::Finished",
        "Telemetry::RunStarted",
        "Telemetry::ThresholdsChanged",
    ] {
        let saying: Vec<_> = files_saying(&sources, record)
            .into_iter()
            .filter(|f| f.starts_with("trainer/") || f.starts_with("py/"))
            .collect();
        assert!(saying.is_empty(), "{record} said by a driver: {saying:?}");
    }
}
