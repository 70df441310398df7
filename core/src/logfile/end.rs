//! A compressed log's end without decoding all of it (`replay --end`): each file's index
//! frames are found from its end and walked back through `prev`; every earlier data
//! frame is summarised by its index's `events` and `digest`, the last frames are decoded
//! whole, and a reader goes on from the end (the open frame of a live file, then what
//! is written after).
//!
//! Correctness first: a file whose index cannot be found or read (a plain log, a corrupt
//! frame, an open frame longer than the search window) is read whole instead.
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use zstd::bulk::Decompressor;

use super::damage::{Damage, Lost};
use super::index::{frame_len_from_trailer, IndexEntry, TAG};
use super::names::{chain, is_compressed};
use super::read::{ChainLines, Line, Origin};

/// How far back from a file's end its last index frame is looked for: past an open data
/// frame of at most 1 MiB of JSONL, whose compressed size cannot be much larger.
pub const WINDOW: u64 = 2 << 20;
/// Records decoded whole at the end, at least: the charts' recent stretch at full detail.
pub const KEEP_RECORDS: u64 = 20_000;
/// The most an index's `events` or `digest` frame decodes to: a data frame's JSONL
/// (at most 1 MiB) and then some.
const SUMMARY_MAX: usize = 4 << 20;

/// What `replay --end` delivers at once, and where it goes on.
pub struct End {
    /// In the log's order: the earlier frames' events and digests (time order within each
    /// frame), then from [`End::whole_from`] on every record of the last frames.
    pub lines: Vec<String>,
    pub whole_from: usize,
    /// Records of the frames shown only by their events and digest.
    pub summarized: u64,
    /// The rest of the live file (its open frame) and what comes after it.
    pub rest: ChainLines,
    /// Where `rest` started: a reader from here reads what `rest` reads.
    pub origin: Origin,
    /// Damaged frames skipped, each with the index in `lines` where its records would
    /// have been.
    pub damage: Vec<(usize, Damage)>,
}

/// A data frame of a file, as its index frame describes it.
struct Framed {
    entry: IndexEntry,
    /// Its events and digest, in time order.
    summary: Vec<String>,
}

/// What one file of the chain contributes.
enum Piece {
    /// Indexed frames, oldest first.
    Indexed {
        file: File,
        name: PathBuf,
        frames: Vec<Framed>,
    },
    /// A file read whole (no usable index).
    Whole(PathBuf),
}

/// The end of the log at `path` (its chain): see the module's description. Fails only
/// where reading the whole log would fail too (a missing file).
pub fn open_at_end(path: &Path) -> io::Result<End> {
    open_at_end_keeping(path, KEEP_RECORDS)
}

/// [`open_at_end`] with `keep` records at least decoded whole.
pub fn open_at_end_keeping(path: &Path, keep: u64) -> io::Result<End> {
    let names = chain(path);
    let (live_name, earlier) = names.split_last().expect("a chain has its path");
    let mut pieces = Vec::with_capacity(names.len());
    for name in earlier {
        pieces.push(piece(name, None)?.0);
    }
    let live = File::open(live_name).map_err(|e| named(live_name, e))?;
    let (last, open_from) = piece(live_name, Some(live.try_clone()?))?;
    pieces.push(last);
    let origin = Origin::live(live, live_name, open_from)?;
    let rest = ChainLines::resume(path, &origin)?;

    // Frames decoded whole: the last ones, back until they hold `keep` records.
    let mut whole_frames = 0usize;
    let mut held = 0u64;
    'count: for p in pieces.iter().rev() {
        match p {
            Piece::Whole(_) => break 'count,
            Piece::Indexed { frames, .. } => {
                for f in frames.iter().rev() {
                    if held >= keep {
                        break 'count;
                    }
                    held += f.entry.records;
                    whole_frames += 1;
                }
            }
        }
    }
    let total_frames: usize = pieces
        .iter()
        .map(|p| match p {
            Piece::Indexed { frames, .. } => frames.len(),
            Piece::Whole(_) => 0,
        })
        .sum();
    let first_whole = total_frames - whole_frames;

    let mut lines = Vec::new();
    let mut whole_from = 0;
    let mut summarized = 0;
    let mut damage = Vec::new();
    let mut n = 0usize;
    for p in pieces {
        match p {
            Piece::Whole(name) => {
                let mut reader = ChainLines::file(&name, 0)?;
                loop {
                    let line = reader.next_line()?;
                    damage.extend(reader.take_damage().into_iter().map(|d| (lines.len(), d)));
                    match line {
                        Line::Whole(line) => lines.push(line),
                        Line::End => break,
                    }
                }
                lines.extend(reader.rest());
                whole_from = lines.len();
            }
            Piece::Indexed { file, name, frames } => {
                for f in frames {
                    if n < first_whole {
                        summarized += f.entry.records;
                        lines.extend(f.summary);
                        whole_from = lines.len();
                    } else {
                        match data_lines(&file, &name, &f.entry)? {
                            Ok(whole) => lines.extend(whole),
                            Err(d) => damage.push((lines.len(), d)),
                        }
                    }
                    n += 1;
                }
            }
        }
    }
    Ok(End {
        lines,
        whole_from,
        summarized,
        rest,
        origin,
        damage,
    })
}

/// The `t` of a compressed log's last record, from its last file's last index and what
/// follows it; `None` when neither says (an empty file, no index, no whole line).
pub fn last_time(path: &Path) -> Option<f64> {
    let names = chain(path);
    let name = names
        .iter()
        .rev()
        .find(|n| n.metadata().is_ok_and(|m| m.len() > 0))?;
    let file = File::open(name).ok()?;
    let len = file.metadata().ok()?.len();
    let (last, open_from) = last_index(&file, len)?;
    let indexed = last.map(|(_, e)| e.t_last);
    let mut open = None;
    if open_from < len {
        let mut reader = ChainLines::file(name, open_from).ok()?;
        while let Ok(Line::Whole(line)) = reader.next_line() {
            open = Some(t_of(&line)).filter(|t| *t > 0.0).or(open);
        }
    }
    open.or(indexed)
}

fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// A file's contribution, and for the live one where its open frame starts (what is not
/// indexed: the whole file when it is read whole).
fn piece(name: &Path, live: Option<File>) -> io::Result<(Piece, u64)> {
    let is_live = live.is_some();
    let file = match live {
        Some(f) => f,
        None => File::open(name).map_err(|e| named(name, e))?,
    };
    let len = file.metadata().map_err(|e| named(name, e))?.len();
    let found = is_compressed(name)
        .then(|| indexes(&file, len))
        .flatten()
        // A closed segment ends with its last index: anything after it is read whole.
        .filter(|(_, open_from)| is_live || *open_from == len);
    match found {
        Some((frames, open_from)) => Ok((
            Piece::Indexed {
                file,
                name: name.to_path_buf(),
                frames,
            },
            open_from,
        )),
        // The live file read whole is read by the reader that goes on from it.
        None if is_live => Ok((
            Piece::Indexed {
                file,
                name: name.to_path_buf(),
                frames: vec![],
            },
            0,
        )),
        None => Ok((Piece::Whole(name.to_path_buf()), 0)),
    }
}

/// The index frames of a compressed file of `len` bytes, oldest first, and where what
/// follows the last one starts; `None` when they cannot be found or do not hold together.
fn indexes(file: &File, len: u64) -> Option<(Vec<Framed>, u64)> {
    // One decoder for every small frame: a fresh context per frame would cost more than
    // the decoding (thousands of frames in a week's log).
    let mut unpack = Decompressor::new().ok()?;
    let (last, open_from) = last_index(file, len)?;
    let Some((mut at, mut entry)) = last else {
        return Some((vec![], open_from));
    };
    let mut frames = vec![];
    loop {
        let prev = entry.prev;
        let summary = summary(&entry, &mut unpack).ok()?;
        frames.push(Framed { entry, summary });
        let Some(p) = prev else { break };
        // Offsets only go back: a damaged `prev` cannot loop.
        if p >= at {
            return None;
        }
        let e = IndexEntry::read_from(file, p)?;
        at = p;
        entry = e;
        if entry.data_offset + entry.data_len != at {
            return None;
        }
    }
    frames.reverse();
    // The first frame starts the file: frames before it would be lost.
    (frames[0].entry.data_offset == 0).then_some((frames, open_from))
}

/// The last index frame (where it starts, and it) and the offset after it; no frame but
/// a file short enough to be all open frame: (`None`, 0).
#[allow(clippy::type_complexity)]
fn last_index(file: &File, len: u64) -> Option<(Option<(u64, IndexEntry)>, u64)> {
    let from = len.saturating_sub(WINDOW);
    let mut tail = vec![0u8; (len - from) as usize];
    file.read_exact_at(&mut tail, from).ok()?;
    // A file that ended cleanly ends with its index; a live one with an open frame after
    // it, searched back through for the last frame that reads as an index.
    let mut end = tail.len();
    while end >= TAG.len() {
        let Some(hit) = tail[..end].windows(TAG.len()).rposition(|w| w == TAG) else {
            break;
        };
        let stop = hit + TAG.len();
        if let Some(flen) = frame_len_from_trailer(&tail[..stop]) {
            let stop_at = from + stop as u64;
            if let Some(start) = stop_at.checked_sub(flen) {
                let entry = match start.checked_sub(from) {
                    Some(i) => IndexEntry::decode(&tail[i as usize..stop]),
                    None => IndexEntry::read_from(file, start),
                };
                if let Some(e) = entry.filter(|e| e.data_offset + e.data_len == start) {
                    return Some((Some((start, e)), stop_at));
                }
            }
        }
        end = hit + TAG.len() - 1;
    }
    (from == 0).then_some((None, 0))
}

/// The `t` of a line, without reading the rest of it into a record.
fn t_of(line: &str) -> f64 {
    #[derive(Deserialize)]
    struct T {
        #[serde(default)]
        t: f64,
    }
    serde_json::from_str::<T>(line).map_or(0.0, |v| v.t)
}

/// A frame's events and digest, in time order.
fn summary(e: &IndexEntry, unpack: &mut Decompressor<'static>) -> io::Result<Vec<String>> {
    let events = lines_of(&unpack.decompress(&e.events, SUMMARY_MAX)?);
    let mut digest = lines_of(&unpack.decompress(&e.digest, SUMMARY_MAX)?);
    // One record per kind, in the order kinds came: sorted, merged with the events.
    let mut digest: Vec<(f64, String)> = digest.drain(..).map(|l| (t_of(&l), l)).collect();
    digest.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = Vec::with_capacity(events.len() + digest.len());
    let mut d = digest.into_iter().peekable();
    for ev in events {
        let t = t_of(&ev);
        while let Some((_, l)) = d.next_if(|(dt, _)| *dt < t) {
            out.push(l);
        }
        out.push(ev);
    }
    out.extend(d.map(|(_, l)| l));
    Ok(out)
}

/// Every record of a data frame, or why none is (a damaged frame: skipped whole, as the
/// reader of the whole log skips it).
fn data_lines(file: &File, name: &Path, e: &IndexEntry) -> io::Result<Result<Vec<String>, Damage>> {
    let mut frame = vec![0u8; e.data_len as usize];
    file.read_exact_at(&mut frame, e.data_offset)
        .map_err(|err| named(name, err))?;
    let error = match zstd::stream::decode_all(&frame[..]) {
        Ok(text) => {
            let lines = text.iter().filter(|&&b| b == b'\n').count() as u64;
            if lines == e.records {
                return Ok(Ok(lines_of(&text)));
            }
            format!(
                "it decodes to {lines} lines where its index says {}",
                e.records
            )
        }
        Err(err) => err.to_string(),
    };
    Ok(Err(Damage {
        file: name.to_path_buf(),
        offset: e.data_offset,
        resumed: Some(e.data_offset + e.data_len),
        lost: Some(Lost {
            records: e.records,
            of: e.records,
            t_first: e.t_first,
            t_last: e.t_last,
        }),
        error,
    }))
}

fn lines_of(text: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(text)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logfile::{compact_line, segment_path, FrameWriter};
    use crate::{Level, Notice, Record, SystemSample, Telemetry};

    /// Record `i`: a notice every 50, a sample otherwise.
    fn rec(i: usize) -> Record {
        let msg = if i.is_multiple_of(50) {
            Telemetry::Notice(Notice::new(Level::Info, "test", format!("n{i}")))
        } else {
            let mut s = SystemSample::default();
            s.host.process_rss = i as u64;
            Telemetry::Sample(s)
        };
        Record::new(0.0, i as f64 * 0.1, msg)
    }

    /// Records `from..to` through a writer, a frame every 100; the writer is handed back
    /// still open.
    fn write(w: &mut FrameWriter<File>, from: usize, to: usize) {
        for i in from..to {
            w.write_record(&rec(i)).unwrap();
            if (i + 1).is_multiple_of(100) {
                w.end_frame().unwrap();
            }
        }
        w.flush().unwrap();
    }

    fn rest_of(end: &mut End) -> Vec<String> {
        let mut got = vec![];
        while let Line::Whole(l) = end.rest.next_line().unwrap() {
            got.push(l);
        }
        got
    }

    #[test]
    fn the_last_frames_are_whole_and_the_earlier_ones_summarised() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl.zst");
        let mut w = FrameWriter::new(File::create(&path).unwrap()).unwrap();
        write(&mut w, 0, 1000);
        w.finish().unwrap();
        let mut end = open_at_end_keeping(&path, 250).unwrap();
        assert_eq!(end.summarized, 700);
        let whole: Vec<String> = (700..1000).map(|i| compact_line(&rec(i))).collect();
        assert_eq!(end.lines[end.whole_from..], whole[..]);
        // Each earlier frame: its two notices, then its highest resident set (its last).
        let head = &end.lines[..end.whole_from];
        assert_eq!(head.len(), 21);
        assert_eq!(head[0], compact_line(&rec(0)));
        assert_eq!(head[1], compact_line(&rec(50)));
        assert_eq!(head[2], compact_line(&rec(99)));
        assert_eq!(head[3], compact_line(&rec(100)));
        assert!(rest_of(&mut end).is_empty());
    }

    #[test]
    fn a_live_files_open_frame_and_later_records_come_through_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl.zst");
        // A closed segment before the live file.
        let mut w = FrameWriter::new(File::create(segment_path(&path, 1)).unwrap()).unwrap();
        write(&mut w, 0, 300);
        w.finish().unwrap();
        let mut w = FrameWriter::new(File::create(&path).unwrap()).unwrap();
        write(&mut w, 300, 650);
        let mut end = open_at_end_keeping(&path, 150).unwrap();
        assert_eq!(end.summarized, 400);
        let whole: Vec<String> = (400..600).map(|i| compact_line(&rec(i))).collect();
        assert_eq!(end.lines[end.whole_from..], whole[..]);
        let open: Vec<String> = (600..650).map(|i| compact_line(&rec(i))).collect();
        assert_eq!(rest_of(&mut end), open);
        write(&mut w, 650, 720);
        let later: Vec<String> = (650..720).map(|i| compact_line(&rec(i))).collect();
        assert_eq!(rest_of(&mut end), later);
    }

    /// A closed log of records `0..500`, a frame every 100, and its bytes.
    fn log_of_500() -> (tempfile::TempDir, PathBuf, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.jsonl.zst");
        let mut w = FrameWriter::new(File::create(&path).unwrap()).unwrap();
        write(&mut w, 0, 500);
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        (dir, path, bytes)
    }

    #[test]
    fn a_damaged_index_reads_the_file_whole() {
        let (_dir, path, mut bytes) = log_of_500();
        // The third index frame's `prev`: the walk back no longer holds together.
        let third = bytes
            .windows(4)
            .enumerate()
            .filter(|(_, w)| *w == 0x184D2A5Eu32.to_le_bytes())
            .nth(2)
            .unwrap()
            .0;
        bytes[third + 8 + 16] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let mut end = open_at_end_keeping(&path, 150).unwrap();
        assert!(end.lines.is_empty());
        assert_eq!(end.summarized, 0);
        let all: Vec<String> = (0..500).map(|i| compact_line(&rec(i))).collect();
        assert_eq!(rest_of(&mut end), all);
    }

    #[test]
    fn a_damaged_frame_at_the_end_is_skipped_and_said() {
        let (_dir, path, mut bytes) = log_of_500();
        let (frames, _) = indexes(&File::open(&path).unwrap(), bytes.len() as u64).unwrap();
        let fourth = &frames[3].entry;
        let mid = (fourth.data_offset + fourth.data_len / 2) as usize;
        for b in &mut bytes[mid..mid + 16] {
            *b ^= 0xA5;
        }
        std::fs::write(&path, &bytes).unwrap();
        let mut end = open_at_end_keeping(&path, 250).unwrap();
        assert_eq!(end.summarized, 200);
        let whole: Vec<String> = (200..300)
            .chain(400..500)
            .map(|i| compact_line(&rec(i)))
            .collect();
        assert_eq!(end.lines[end.whole_from..], whole[..]);
        assert_eq!(end.damage.len(), 1);
        let (at, d) = &end.damage[0];
        assert_eq!((*at, d.offset), (end.whole_from + 100, fourth.data_offset));
        assert_eq!(d.lost.as_ref().map(|l| l.records), Some(100));
        assert!(rest_of(&mut end).is_empty());
    }
}
