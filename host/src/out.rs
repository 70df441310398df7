//! Printing that never panics: `println!` panics when stdout is closed (`headroom train |
//! true`) or the terminal is gone (after SIGHUP), and a print must never cost a run.
use std::io::Write;

/// A line on stdout; lost quietly when nobody can read it.
pub fn out(line: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// A line on stderr; lost quietly when nobody can read it.
pub fn err(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
