//! `headroom cat`: a run's log as plain JSONL on stdout, whatever its form on disk
//! (compressed, rotated into segments, cut short by a killed run), for `jq` and friends.
use std::io::{self, BufWriter, Write};

use anyhow::{Context, Result};
use headroom_core::logfile::read::{ChainLines, Line};

use crate::cli::CatArgs;

pub fn cat(args: &CatArgs) -> Result<()> {
    let mut out = BufWriter::new(io::stdout().lock());
    for path in &args.log {
        match print_chain(path, &mut out) {
            // The reader went away (`| head`): what it wanted was printed.
            Err(e) if is_broken_pipe(&e) => return Ok(()),
            other => other?,
        }
    }
    match out.flush() {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn print_chain(path: &std::path::Path, out: &mut impl Write) -> Result<()> {
    let named = || format!("reading log {}", path.display());
    let mut lines = ChainLines::open(path).with_context(named)?;
    while let Line::Whole(line) = lines.next_line().with_context(named)? {
        writeln!(out, "{line}")?;
    }
    if let Some(rest) = lines.rest() {
        writeln!(out, "{rest}")?;
    }
    Ok(())
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.downcast_ref::<io::Error>()
        .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}
