//! A damaged stretch of a compressed log (a disk error, bytes overwritten): what the
//! readers skip to go on at the next good frame, and how they find it
//! (docs/LOG_SCHEMA.md, "Damaged frames").
//!
//! - The index frame after a damaged data frame says where that frame started, how many
//!   records it held and their `t` range: the reader goes on after it and says what was
//!   lost.
//! - Without an index (it is damaged too, or the file has none yet) the reader looks for
//!   the next zstd frame's magic and goes on there if what it decodes to starts with a
//!   whole JSON line; the loss is then unknown.
//!
//! A file cut short at its end (a live file, a killed run) is no damage: its last frame is
//! only unfinished.
use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};

use super::index::{IndexEntry, SKIPPABLE_MAGIC};

/// The magic number that starts every zstd data frame.
pub const ZSTD_MAGIC: u32 = 0xFD2F_B528;
/// How far past a damaged frame's start its index frame is looked for: a data frame of at
/// most 1 MiB of JSONL (compressed, it cannot be much larger), then the index with its
/// events and digest.
const INDEX_SEARCH: u64 = 4 << 20;
/// How far a candidate frame is decoded to find its first whole line.
const CHECK_MAX: u64 = 4 << 20;
/// Bytes read at a time while searching.
const STEP: usize = 256 * 1024;

/// A stretch of a compressed file that could not be decoded: the reader skipped it.
#[derive(Debug, Clone, PartialEq)]
pub struct Damage {
    pub file: PathBuf,
    /// Where the damaged frame (or stretch) starts in the file.
    pub offset: u64,
    /// Where reading went on, when known when it was found (else at the next frame that
    /// decodes to whole lines).
    pub resumed: Option<u64>,
    /// What the frame's index says was lost; `None` when no index told.
    pub lost: Option<Lost>,
    /// Why the frame could not be read.
    pub error: String,
}

/// The records of a damaged data frame that were not read, from its index.
#[derive(Debug, Clone, PartialEq)]
pub struct Lost {
    pub records: u64,
    /// The frame's records in all.
    pub of: u64,
    pub t_first: f64,
    pub t_last: f64,
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: damaged data at byte {} ({}), skipped",
            self.file.display(),
            self.offset,
            self.error
        )?;
        if let Some(at) = self.resumed {
            write!(f, " to byte {at}")?;
        }
        match &self.lost {
            Some(l) if l.records == l.of => write!(
                f,
                ": its {} records lost (t {:.1}–{:.1} s)",
                l.of, l.t_first, l.t_last
            ),
            Some(l) => write!(
                f,
                ": {} of its {} records lost (t up to {:.1} s)",
                l.records, l.of, l.t_last
            ),
            None => write!(f, ": no index tells how many records were lost"),
        }
    }
}

/// The first index frame that starts after `from` and before `from + INDEX_SEARCH`, where
/// it starts, and it: one whose data frame ends where it starts (an index that reads
/// whole, at its place).
pub fn index_after(file: &File, from: u64, len: u64) -> Option<(u64, IndexEntry)> {
    let end = len.min(from.saturating_add(INDEX_SEARCH));
    let mut buf = vec![0u8; end.checked_sub(from)? as usize];
    file.read_exact_at(&mut buf, from).ok()?;
    let magic = SKIPPABLE_MAGIC.to_le_bytes();
    buf.windows(4)
        .enumerate()
        .skip(1)
        .filter(|(_, w)| *w == magic)
        .find_map(|(i, _)| {
            let at = from + i as u64;
            let entry =
                IndexEntry::decode(&buf[i..]).or_else(|| IndexEntry::read_from(file, at))?;
            (entry.data_offset.checked_add(entry.data_len) == Some(at)).then_some((at, entry))
        })
}

/// What follows a data frame that ends at `at`.
pub enum After {
    /// Its index frame.
    Index(IndexEntry),
    /// An index frame that does not read whole (its size, its trailer or where it says
    /// its data frame is is damaged): zstd would skip it by a size that may be wrong.
    Broken,
    /// Another frame, the file's end, or an index frame not all written yet.
    Other,
}

/// The frame at `at`, where a data frame ends, as its index.
pub fn after(file: &File, at: u64) -> After {
    let mut head = [0u8; 8];
    if file.read_exact_at(&mut head, at).is_err() || head[..4] != SKIPPABLE_MAGIC.to_le_bytes() {
        return After::Other;
    }
    let size = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as u64;
    let Ok(len) = file.metadata().map(|m| m.len()) else {
        return After::Other;
    };
    // Past the file's end: a writer's index frame on its way, unless a later index names
    // this one as its previous (its size grew by damage: zstd would wait for the rest).
    if at + 8 + size > len {
        return match index_after(file, at, len) {
            Some((_, e)) if e.prev == Some(at) => After::Broken,
            _ => After::Other,
        };
    }
    match IndexEntry::read_from(file, at) {
        Some(e) if e.data_offset.checked_add(e.data_len) == Some(at) => After::Index(e),
        _ => After::Broken,
    }
}

/// Whether the four bytes at `at` start a zstd frame (data or skippable).
pub fn starts_frame(file: &File, at: u64) -> bool {
    let mut magic = [0u8; 4];
    if file.read_exact_at(&mut magic, at).is_err() {
        return false;
    }
    let m = u32::from_le_bytes(magic);
    m == ZSTD_MAGIC || (0x184D_2A50..=0x184D_2A5F).contains(&m)
}

/// Where a search for the next good data frame stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resync {
    /// A frame starts here whose first line is whole JSON: read on from it.
    At(u64),
    /// Nothing found up to the file's end (for now): search again from here.
    Wait(u64),
}

/// The next data frame at or after `from` that decodes to a whole JSON line.
pub fn next_frame(file: &File, from: u64) -> io::Result<Resync> {
    let magic = ZSTD_MAGIC.to_le_bytes();
    let mut at = from;
    let mut buf = vec![0u8; STEP];
    loop {
        let n = read_some(file, &mut buf, at)?;
        if n < magic.len() {
            return Ok(Resync::Wait(at));
        }
        for (i, _) in buf[..n].windows(4).enumerate().filter(|(_, w)| *w == magic) {
            let candidate = at + i as u64;
            match check(file, candidate)? {
                Check::Whole => return Ok(Resync::At(candidate)),
                Check::Unfinished => return Ok(Resync::Wait(candidate)),
                Check::Not => {}
            }
        }
        // The last three bytes may start a magic that the next read completes.
        at += (n - (magic.len() - 1)) as u64;
    }
}

fn read_some(file: &File, buf: &mut [u8], at: u64) -> io::Result<usize> {
    loop {
        match file.read_at(buf, at) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

enum Check {
    /// Decodes to a whole line of JSON first.
    Whole,
    /// Decodes without error so far, but not yet to a whole line: the file ends first.
    Unfinished,
    /// Not a frame of this log.
    Not,
}

/// Decodes the frame at `at` up to its first newline.
fn check(file: &File, at: u64) -> io::Result<Check> {
    let mut decoder = Decoder::new()?;
    let mut input = vec![0u8; STEP];
    let mut out: Vec<u8> = Vec::with_capacity(STEP);
    let mut raw = at;
    while raw - at < CHECK_MAX {
        let n = read_some(file, &mut input, raw)?;
        if n == 0 {
            return Ok(Check::Unfinished);
        }
        raw += n as u64;
        let mut src = InBuffer::around(&input[..n]);
        while src.pos() < n {
            if out.len() == out.capacity() {
                out.reserve(STEP);
            }
            let pos = out.len();
            let mut dst = OutBuffer::around_pos(&mut out, pos);
            let Ok(hint) = decoder.run(&mut src, &mut dst) else {
                return Ok(Check::Not);
            };
            if let Some(nl) = out.iter().position(|&b| b == b'\n') {
                let line = &out[..nl];
                let json = line.first() == Some(&b'{')
                    && serde_json::from_slice::<serde::de::IgnoredAny>(line).is_ok();
                return Ok(if json { Check::Whole } else { Check::Not });
            }
            if hint == 0 || out.len() as u64 > CHECK_MAX {
                return Ok(Check::Not);
            }
        }
    }
    Ok(Check::Not)
}
