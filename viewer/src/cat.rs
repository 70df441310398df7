//! `headroom cat`: a run's log as plain JSONL on stdout, whatever its form on disk
//! (compressed, rotated into segments, cut short by a killed run), for `jq` and friends.
//!
//! A damaged stretch of a compressed log (docs/LOG_SCHEMA.md, "Damaged frames") does not
//! stop it: the records around it are printed, a line on stderr says what was skipped
//! where, and the exit status at the end is an error's (2), so that a script notices the
//! records it did not get.
use std::io::{self, BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use headroom_core::logfile::read::{ChainLines, Line};

use crate::cli::CatArgs;

pub fn cat(args: &CatArgs) -> Result<()> {
    let mut out = BufWriter::new(io::stdout().lock());
    let mut said = |text: &str| headroom_host::out::err(&format!("headroom cat: {text}"));
    let mut damaged = 0;
    for path in &args.log {
        match print_chain(path, &mut out, &mut said) {
            Ok(n) => damaged += n,
            // The reader went away (`| head`): what it wanted was printed.
            Err(e) if is_broken_pipe(&e) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    match out.flush() {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Ok(()),
        other => other?,
    }
    if damaged > 0 {
        bail!(
            "{damaged} damaged stretch{} skipped (said above): the records around {} were \
             printed, those in {} were lost",
            if damaged == 1 { "" } else { "es" },
            if damaged == 1 { "it" } else { "them" },
            if damaged == 1 { "it" } else { "them" },
        );
    }
    Ok(())
}

/// Prints the log at `path` (its chain) to `out`; each damaged stretch skipped is said
/// through `said`, in its place. How many were.
fn print_chain(path: &Path, out: &mut impl Write, said: &mut impl FnMut(&str)) -> Result<usize> {
    let named = || format!("reading log {}", path.display());
    let mut lines = ChainLines::open(path).with_context(named)?;
    let mut damaged = 0;
    loop {
        let line = lines.next_line().with_context(named)?;
        let damage = lines.take_damage();
        if !damage.is_empty() {
            // What came before the damage reaches the terminal before the word of it.
            out.flush()?;
        }
        for d in damage {
            said(&d.to_string());
            damaged += 1;
        }
        match line {
            Line::Whole(line) => writeln!(out, "{line}")?,
            Line::End => break,
        }
    }
    if let Some(rest) = lines.rest() {
        writeln!(out, "{rest}")?;
    }
    Ok(damaged)
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<io::Error>()
        .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_core::logfile::FrameWriter;
    use headroom_core::{Level, Notice, Record, Telemetry};

    fn rec(i: usize) -> Record {
        let msg = Telemetry::Notice(Notice::new(Level::Info, "test", format!("n{i}")));
        Record::new(0.0, i as f64, msg)
    }

    #[test]
    fn a_damaged_frame_is_said_once_and_the_rest_printed() {
        let dir = std::env::temp_dir().join(format!("headroom-cat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.jsonl.zst");
        let mut w = FrameWriter::new(Vec::new()).unwrap();
        let mut starts = vec![];
        for i in 0..50 {
            if i % 10 == 0 {
                starts.push(w.bytes_written());
            }
            w.write_record(&rec(i)).unwrap();
            if i % 10 == 9 {
                w.end_frame().unwrap();
            }
        }
        let mut bytes = w.finish().unwrap();
        // The third frame's content, past its header.
        for b in &mut bytes[starts[2] as usize + 12..starts[2] as usize + 20] {
            *b ^= 0x5A;
        }
        std::fs::write(&path, &bytes).unwrap();
        let (mut out, mut said) = (Vec::new(), Vec::new());
        let n = print_chain(&path, &mut out, &mut |s: &str| said.push(s.to_string())).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let printed: Vec<f64> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| Record::from_line(l).unwrap().t)
            .collect();
        let want: Vec<f64> = (0..20).chain(30..50).map(|i| i as f64).collect();
        assert_eq!(printed, want);
        assert_eq!(n, 1);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].contains(&format!("byte {}", starts[2])),
            "{}",
            said[0]
        );
        assert!(
            said[0].contains("its 10 records lost (t 20.0–29.0 s)"),
            "{}",
            said[0]
        );
    }
}
