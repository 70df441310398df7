//! A run log's chain (`NAME.1…`, `NAME.2…`, then `NAME` itself) read as one stream of
//! whole lines, each file plain JSONL or zstd-framed by its name (docs/LOG_SCHEMA.md,
//! "Compressed and rotated logs").
//!
//! - A compressed file is decoded as a stream: its end (a file still being written, or
//!   one killed in the middle of a frame) is only the end *for now*: what was flushed is
//!   given, and the rest of the frame is decoded when it arrives. Skippable (index)
//!   frames are skipped by zstd itself.
//! - A frame's lines are handed out once its end is checked (zstd's checksum, and the
//!   record count of the index after it); only a file's unfinished last frame is given
//!   as it comes. A damaged frame is skipped to the next good one and said
//!   ([`ChainLines::take_damage`]; [`super::damage`]), instead of ending the log.
//! - A half-written line waits for its newline ([`ChainLines::rest`] takes it when the
//!   log will not grow).
//! - Rotation: when the live file at the path is renamed to the next numbered segment,
//!   the reader finishes the file it holds open (the writer closed it before the rename)
//!   and goes on with the new file at the path: no line is lost or read twice.
//! - Offsets ([`ChainLines::position`]) count decoded bytes from the chain's start (or
//!   from the [`Origin`] the reader started at), so reading again "up to N" is decoding
//!   again from the same origin.
//!
//! Files are read with positional reads: a reader's [`Origin`] holds a handle of its own
//! that another reader can start from without moving anyone's offset.
use std::collections::VecDeque;
use std::fs::{self, File, Metadata};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};

use super::damage::{after, index_after, next_frame, starts_frame, After, Resync};
pub use super::damage::{Damage, Lost};
use super::names::{is_compressed, segments};

/// Bytes read from a file at a time.
const CHUNK: usize = 256 * 1024;

/// A line of the log, or its end for now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A whole line, without its newline.
    Whole(String),
    /// The end of the chain for now; a half-written line waits.
    End,
}

/// Which file a part is, and whether it can still grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A numbered segment: closed by the writer, it never grows.
    Segment,
    /// The file at the log's own name: it grows, and may be rotated away.
    Live,
}

/// Where a reader starts: the chain's first file, or a frame boundary inside one file (the
/// end of an index frame, where `replay --end` goes on live).
#[derive(Debug, Clone)]
pub struct Origin {
    file: Arc<File>,
    name: PathBuf,
    role: Role,
    id: (u64, u64),
    raw: u64,
}

impl Origin {
    /// The live file of a log, open as `file`, read from `raw` on (a frame boundary).
    pub fn live(file: File, path: &Path, raw: u64) -> io::Result<Origin> {
        let meta = file.metadata().map_err(|e| named(path, e))?;
        Ok(Origin {
            file: Arc::new(file),
            name: path.to_path_buf(),
            role: Role::Live,
            id: id_of(&meta),
            raw,
        })
    }
}

/// One open file of the chain.
struct Part {
    file: Arc<File>,
    /// The name it was opened under, or the segment it was renamed to.
    name: PathBuf,
    role: Role,
    /// Device and inode: how a rotated live file is recognised under its new name.
    id: (u64, u64),
    /// Bytes of the file read so far.
    raw: u64,
    decoder: Option<Zstd>,
}

/// A zstd stream's decoder and the input it has not taken yet.
struct Zstd {
    decoder: Decoder<'static>,
    input: Vec<u8>,
    taken: usize,
    /// The last decode step filled its output: more may come without input.
    full: bool,
    /// Where the frame being decoded started.
    frame_start: u64,
    /// Newlines given to the reader's buffer so far: lines handed out, or to be.
    lines: u64,
    /// The last frame boundaries passed, and `lines` at each: how many lines of a damaged
    /// frame were read before the damage.
    boundaries: VecDeque<(u64, u64)>,
    /// Past damage, looking for the next good frame from here.
    resync: Option<u64>,
    /// What the frame being decoded decoded to, not yet given: a frame that ends is
    /// checked before its lines are handed out.
    frame: Vec<u8>,
}

/// Frame boundaries remembered: a data frame's start is at most a few frames back (its
/// own start, a frame end that damage faked).
const BOUNDARIES: usize = 8;

impl Zstd {
    /// A decoder reading from `raw`, a frame boundary.
    fn at(raw: u64) -> io::Result<Zstd> {
        Ok(Zstd {
            decoder: Decoder::new()?,
            input: Vec::new(),
            taken: 0,
            full: false,
            frame_start: raw,
            lines: 0,
            boundaries: VecDeque::from([(raw, 0)]),
            resync: None,
            frame: Vec::new(),
        })
    }

    /// Hands what the frame decoded to so far to `out`.
    fn release(&mut self, out: &mut Vec<u8>) {
        self.lines += self.frame.iter().filter(|&&b| b == b'\n').count() as u64;
        out.extend_from_slice(&self.frame);
        self.frame.clear();
    }

    /// Where the input taken so far ends in the file, read up to `raw`.
    fn consumed(&self, raw: u64) -> u64 {
        raw - (self.input.len() - self.taken) as u64
    }

    fn boundary(&mut self, at: u64) {
        self.frame_start = at;
        if self.boundaries.len() == BOUNDARIES {
            self.boundaries.pop_front();
        }
        self.boundaries.push_back((at, self.lines));
    }

    /// Decodes afresh from `at`, a frame's start.
    fn restart(&mut self, at: u64) -> io::Result<()> {
        self.decoder.reinit()?;
        self.input.clear();
        self.taken = 0;
        self.full = false;
        self.resync = None;
        self.frame.clear();
        self.boundary(at);
        Ok(())
    }
}

fn id_of(m: &Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl Part {
    /// The file `name` read from `raw` on (a frame boundary of a compressed file).
    fn open(name: &Path, role: Role, raw: u64) -> io::Result<Part> {
        let file = File::open(name).map_err(|e| named(name, e))?;
        let meta = file.metadata().map_err(|e| named(name, e))?;
        Part::at(Arc::new(file), name.to_path_buf(), role, id_of(&meta), raw)
    }

    /// A part read from `raw` on, which must be a frame boundary of a compressed file.
    fn at(
        file: Arc<File>,
        name: PathBuf,
        role: Role,
        id: (u64, u64),
        raw: u64,
    ) -> io::Result<Part> {
        let decoder = match is_compressed(&name) {
            true => Some(Zstd::at(raw)?),
            false => None,
        };
        Ok(Part {
            file,
            name,
            role,
            id,
            raw,
            decoder,
        })
    }

    fn origin(&self) -> Origin {
        Origin {
            file: Arc::clone(&self.file),
            name: self.name.clone(),
            role: self.role,
            id: self.id,
            raw: self.raw,
        }
    }

    /// Appends what the file has past what was read to `out`; 0 when nothing (for now).
    /// A damaged stretch of a compressed file is skipped, and said in `damage`.
    fn fill(&mut self, out: &mut Vec<u8>, damage: &mut Vec<Damage>) -> io::Result<usize> {
        if self.decoder.is_none() {
            let start = out.len();
            out.resize(start + CHUNK, 0);
            let read = self.file.read_at(&mut out[start..], self.raw);
            let n = *read.as_ref().unwrap_or(&0);
            out.truncate(start + n);
            read.map_err(|e| named(&self.name, e))?;
            self.raw += n as u64;
            return Ok(n);
        }
        let before = out.len();
        // Decoding stops at each frame's end: go on while input is taken or output made.
        let mut idle = 0;
        while idle < 2 {
            let z = self.decoder.as_mut().expect("a compressed part");
            if let Some(from) = z.resync {
                match next_frame(&self.file, from).map_err(|e| named(&self.name, e))? {
                    Resync::At(at) => {
                        z.restart(at)?;
                        self.raw = at;
                    }
                    Resync::Wait(from) => {
                        z.resync = Some(from);
                        break;
                    }
                }
            }
            if z.taken == z.input.len() && !z.full {
                z.input.resize(CHUNK, 0);
                let n = self.file.read_at(&mut z.input, self.raw);
                let n = n.map_err(|e| named(&self.name, e))?;
                z.input.truncate(n);
                z.taken = 0;
                self.raw += n as u64;
                if n == 0 {
                    // The file ends inside a frame (for now): what it decoded to so far is
                    // given unchecked, as it comes.
                    z.release(out);
                    break;
                }
            }
            z.frame.reserve(CHUNK);
            let at = z.frame.len();
            let mut dst = OutBuffer::around_pos(&mut z.frame, at);
            let mut src = InBuffer::around(&z.input[z.taken..]);
            let ran = z.decoder.run(&mut src, &mut dst);
            let (made, took) = (dst.pos() - at, src.pos());
            match ran {
                Ok(hint) => {
                    z.taken += took;
                    z.full = z.frame.len() == z.frame.capacity();
                    if hint == 0 {
                        let end = z.consumed(self.raw);
                        self.frame_ended(end, out, damage)?;
                    }
                }
                Err(e) => {
                    self.damaged(e, out, damage)?;
                    idle = 0;
                    continue;
                }
            }
            if out.len() > before {
                break;
            }
            idle = if made == 0 && took == 0 { idle + 1 } else { 0 };
        }
        Ok(out.len() - before)
    }

    /// A frame decoded to its end at `end`: given, unless the index after it says it held
    /// another number of records (damage that zstd did not see, in a frame without a
    /// checksum).
    fn frame_ended(
        &mut self,
        end: u64,
        out: &mut Vec<u8>,
        damage: &mut Vec<Damage>,
    ) -> io::Result<()> {
        let z = self.decoder.as_mut().expect("a compressed part");
        let next = match z.frame.is_empty() {
            true => After::Other,
            false => after(&self.file, end),
        };
        let given = z.boundaries.back().map_or(0, |(_, lines)| z.lines - lines);
        let lines = given + z.frame.iter().filter(|&&b| b == b'\n').count() as u64;
        match next {
            After::Index(ref e) if e.records != lines => {
                damage.push(Damage {
                    file: self.name.clone(),
                    offset: e.data_offset,
                    resumed: Some(end),
                    lost: Some(Lost {
                        records: e.records.saturating_sub(given),
                        of: e.records,
                        t_first: e.t_first,
                        t_last: e.t_last,
                    }),
                    error: format!(
                        "it decodes to {lines} lines where its index says {}",
                        e.records
                    ),
                });
                z.frame.clear();
                drop_half_line(out);
            }
            _ => z.release(out),
        }
        z.boundary(end);
        match next {
            After::Broken => self.past_broken_index(end, damage),
            _ => Ok(()),
        }
    }

    /// The index frame at `at`, after a data frame read whole, does not read: zstd is not
    /// trusted to skip it by its size. Reading goes on at the data frame the next index
    /// names (said only where more than this index lies between); with no index after it,
    /// zstd skips it.
    fn past_broken_index(&mut self, at: u64, damage: &mut Vec<Damage>) -> io::Result<()> {
        let z = self.decoder.as_mut().expect("a compressed part");
        let len = self.file.metadata().map_or(at, |m| m.len());
        // With no index after it, zstd skips it by its size, as any skippable frame.
        if let Some((_, e)) = index_after(&self.file, at, len) {
            if e.prev != Some(at) {
                damage.push(Damage {
                    file: self.name.clone(),
                    offset: at,
                    resumed: Some(e.data_offset),
                    lost: None,
                    error: "an index frame that does not read".into(),
                });
            }
            z.restart(e.data_offset)?;
            self.raw = e.data_offset;
        }
        Ok(())
    }

    /// The frame being decoded does not decode (`e`): the half line it left in `out` is
    /// dropped, what was lost said in `damage`, and reading goes on at the next good frame.
    /// A file whose first bytes are no zstd frame and that has no index is no compressed
    /// log: an error.
    fn damaged(
        &mut self,
        e: io::Error,
        out: &mut Vec<u8>,
        damage: &mut Vec<Damage>,
    ) -> io::Result<()> {
        let z = self.decoder.as_mut().expect("a compressed part");
        let start = z.frame_start;
        let len = self
            .file
            .metadata()
            .map_err(|e| named(&self.name, e))?
            .len();
        let index = index_after(&self.file, start, len);
        if start == 0 && index.is_none() && !starts_frame(&self.file, 0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: not a zstd-framed log near byte {} ({e}): read it with zstdcat to \
                     see how far it is sound",
                    self.name.display(),
                    z.consumed(self.raw)
                ),
            ));
        }
        z.frame.clear();
        drop_half_line(out);
        let said = |offset, resumed, lost| Damage {
            file: self.name.clone(),
            offset,
            resumed,
            lost,
            error: e.to_string(),
        };
        match index {
            // The damaged frame's own index: it says what was lost.
            Some((at, entry)) if entry.data_offset <= start => {
                let read = z
                    .boundaries
                    .iter()
                    .find(|(b, _)| *b == entry.data_offset)
                    .map_or(0, |(_, lines)| z.lines - lines);
                let lost = Lost {
                    records: entry.records.saturating_sub(read),
                    of: entry.records,
                    t_first: entry.t_first,
                    t_last: entry.t_last,
                };
                damage.push(said(entry.data_offset, Some(at), Some(lost)));
                z.restart(at)?;
                self.raw = at;
            }
            // The next frame's index: what lies between is lost, unless it is only the
            // index frame before it (every data frame before was read whole).
            Some((_, entry)) => {
                let whole = entry
                    .prev
                    .is_some_and(|p| p <= start && z.boundaries.iter().any(|(b, _)| *b == p));
                if !whole {
                    damage.push(said(start, Some(entry.data_offset), None));
                }
                z.restart(entry.data_offset)?;
                self.raw = entry.data_offset;
            }
            None => {
                damage.push(said(start, None, None));
                z.restart(start)?;
                z.resync = Some(start + 1);
                self.raw = start + 1;
            }
        }
        Ok(())
    }
}

/// Frames hold whole lines: a half line at the end of `out` is a damaged frame's.
fn drop_half_line(out: &mut Vec<u8>) {
    out.truncate(out.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1));
}

/// Whole lines of a log's chain.
pub struct ChainLines {
    /// The log's own name: the live file.
    path: PathBuf,
    part: Part,
    /// Decoded bytes not yet handed out as lines.
    buf: Vec<u8>,
    /// Where the next line starts in `buf`.
    at: usize,
    /// Decoded bytes handed out as lines since the origin.
    position: u64,
    /// Reads one file of the chain, not what follows it.
    one_file: bool,
    /// Damage skipped and not yet taken by [`ChainLines::take_damage`].
    damage: Vec<Damage>,
}

impl ChainLines {
    /// Reads the chain of the log at `path` from its first segment (the path itself when
    /// it has none). A missing log is an error naming it.
    pub fn open(path: &Path) -> io::Result<ChainLines> {
        let part = open_after(path, None)?;
        Ok(ChainLines::with(path, part))
    }

    /// Reads on from `origin` (positions count from it), following the chain of `path`.
    pub fn resume(path: &Path, origin: &Origin) -> io::Result<ChainLines> {
        let part = Part::at(
            Arc::clone(&origin.file),
            origin.name.clone(),
            origin.role,
            origin.id,
            origin.raw,
        )?;
        Ok(ChainLines::with(path, part))
    }

    fn with(path: &Path, part: Part) -> ChainLines {
        ChainLines {
            path: path.to_path_buf(),
            part,
            buf: Vec::new(),
            at: 0,
            position: 0,
            one_file: false,
            damage: Vec::new(),
        }
    }

    /// The lines of the one file `name` (plain or compressed by its name), read from
    /// `raw`, which must be a frame boundary of a compressed file.
    pub fn file(name: &Path, raw: u64) -> io::Result<ChainLines> {
        let part = Part::open(name, Role::Segment, raw)?;
        let mut lines = ChainLines::with(name, part);
        lines.one_file = true;
        Ok(lines)
    }

    /// Decoded bytes before the next line: what has been handed out.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Where a reader starting afresh here would begin: valid only at a frame boundary of
    /// the file being read, which is where [`crate::logfile`]'s end finder leaves it.
    pub fn origin(&self) -> Origin {
        self.part.origin()
    }

    /// The file being read now.
    pub fn current(&self) -> &Path {
        &self.part.name
    }

    /// The next whole line, or [`Line::End`] when the chain has nothing more for now.
    pub fn next_line(&mut self) -> io::Result<Line> {
        loop {
            if let Some(nl) = self.buf[self.at..].iter().position(|&b| b == b'\n') {
                let line = &self.buf[self.at..self.at + nl];
                let text = String::from_utf8_lossy(line).into_owned();
                self.at += nl + 1;
                self.position += nl as u64 + 1;
                return Ok(Line::Whole(text));
            }
            // Only a half line is left: keep it, read more behind it.
            self.buf.drain(..self.at);
            self.at = 0;
            if self.part.fill(&mut self.buf, &mut self.damage)? > 0 {
                continue;
            }
            if !self.next_file()? {
                return Ok(Line::End);
            }
        }
    }

    /// The damaged stretches of compressed files skipped since the last call, in the order
    /// met: each lies between the lines handed out before it was found and those after
    /// (a caller that asks after every line says it in its place).
    pub fn take_damage(&mut self) -> Vec<Damage> {
        std::mem::take(&mut self.damage)
    }

    /// What is left of a log that will not grow: a last line without its newline.
    pub fn rest(&mut self) -> Option<String> {
        let left = &self.buf[self.at..];
        if left.is_empty() {
            return None;
        }
        let text = String::from_utf8_lossy(left).into_owned();
        self.position += left.len() as u64;
        self.buf.clear();
        self.at = 0;
        Some(text)
    }

    /// Moves on when the file read is finished: a segment at its end, or a live file that
    /// was rotated into one (read to its end first). False: the end for now.
    fn next_file(&mut self) -> io::Result<bool> {
        if self.part.role == Role::Live {
            let Some(segment) = self.rotated_to() else {
                return Ok(false);
            };
            // Renamed after the writer closed it: what it holds past our read is read
            // through the handle we have before the new file.
            self.part.role = Role::Segment;
            self.part.name = segment;
            return Ok(true);
        }
        if self.one_file {
            return Ok(false);
        }
        let part = match open_after(&self.path, Some(&self.part.name)) {
            Ok(part) => part,
            // Between the writer's rename and its new file: there in a moment.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        // A line the writer never ended (a plain log cut short) is a line of its own.
        if self.at < self.buf.len() {
            self.buf.push(b'\n');
        }
        self.part = part;
        Ok(true)
    }

    /// The segment the live file held open was renamed to, if it was.
    fn rotated_to(&self) -> Option<PathBuf> {
        if let Ok(m) = fs::metadata(&self.path) {
            if id_of(&m) == self.part.id {
                return None;
            }
        }
        segments(&self.path)
            .into_iter()
            .rev()
            .find(|s| fs::metadata(s).is_ok_and(|m| id_of(&m) == self.part.id))
    }

    /// The live file is shorter than what was read from it: truncated, or replaced by a
    /// shorter file that is no rotation. A reader then starts over.
    pub fn truncated(&self) -> bool {
        if self.part.role != Role::Live {
            return false;
        }
        let Ok(m) = fs::metadata(&self.path) else {
            return false;
        };
        if id_of(&m) != self.part.id && self.rotated_to().is_some() {
            return false;
        }
        m.len() < self.part.raw
    }
}

/// Opens the chain's file after `after` (the first when `None`): the next numbered
/// segment, else the live file.
fn open_after(path: &Path, after: Option<&Path>) -> io::Result<Part> {
    let next = |segs: &[PathBuf]| -> Option<PathBuf> {
        match after {
            None => segs.first().cloned(),
            Some(a) => segs.iter().skip_while(|s| *s != a).nth(1).cloned(),
        }
    };
    // Bounded: each retry means the writer rotated again in the meantime.
    for _ in 0..16 {
        if let Some(segment) = next(&segments(path)) {
            return Part::open(&segment, Role::Segment, 0);
        }
        let mut part = Part::open(path, Role::Live, 0)?;
        // A rotation between the listing and the open: the file opened may already be
        // the one after a segment not read yet.
        match next(&segments(path)) {
            None => return Ok(part),
            Some(segment) => {
                if fs::metadata(&segment).is_ok_and(|m| id_of(&m) == part.id) {
                    part.role = Role::Segment;
                    part.name = segment;
                    return Ok(part);
                }
            }
        }
    }
    Err(io::Error::other(format!(
        "{}: the log rotated faster than it could be opened; try again",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logfile::names::segment_path;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Dir(PathBuf);
    impl Dir {
        fn new() -> Dir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let d = std::env::temp_dir().join(format!(
                "headroom-core-read-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            fs::create_dir_all(&d).unwrap();
            Dir(d)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A data frame of `text`, with its checksum as the log's writer makes it.
    fn frame(text: &str) -> Vec<u8> {
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        enc.include_checksum(true).unwrap();
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap()
    }

    fn all(lines: &mut ChainLines) -> Vec<String> {
        let mut got = Vec::new();
        while let Line::Whole(l) = lines.next_line().unwrap() {
            got.push(l);
        }
        got
    }

    #[test]
    fn a_chain_of_plain_and_compressed_files_reads_as_one() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        fs::write(
            segment_path(&live, 1),
            [frame("a\nb\n"), frame("c\n")].concat(),
        )
        .unwrap();
        // A skippable frame between data frames is no line.
        let mut skip = 0x184D2A5Eu32.to_le_bytes().to_vec();
        skip.extend(4u32.to_le_bytes());
        skip.extend(b"HRIX");
        fs::write(
            segment_path(&live, 2),
            [frame("d\n"), skip, frame("e\n")].concat(),
        )
        .unwrap();
        fs::write(&live, frame("f\n")).unwrap();
        let mut lines = ChainLines::open(&live).unwrap();
        assert_eq!(all(&mut lines), ["a", "b", "c", "d", "e", "f"]);
        assert_eq!(lines.position(), 12);
    }

    #[test]
    fn a_frame_cut_short_gives_what_was_flushed_and_the_rest_later() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        enc.write_all(b"one\ntw").unwrap();
        enc.flush().unwrap();
        let cut = enc.get_ref().len();
        enc.write_all(b"o\nthree\n").unwrap();
        let whole = enc.finish().unwrap();
        fs::write(&live, &whole[..cut]).unwrap();
        let mut lines = ChainLines::open(&live).unwrap();
        assert_eq!(all(&mut lines), ["one"]);
        fs::OpenOptions::new()
            .append(true)
            .open(&live)
            .unwrap()
            .write_all(&whole[cut..])
            .unwrap();
        assert_eq!(all(&mut lines), ["two", "three"]);
    }

    #[test]
    fn a_rotated_live_file_is_finished_then_the_new_one_read() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl");
        fs::write(&live, "a\n").unwrap();
        let mut lines = ChainLines::open(&live).unwrap();
        assert_eq!(all(&mut lines), ["a"]);
        let mut f = fs::OpenOptions::new().append(true).open(&live).unwrap();
        f.write_all(b"b\n").unwrap();
        drop(f);
        fs::rename(&live, segment_path(&live, 1)).unwrap();
        fs::write(&live, "c\n").unwrap();
        assert!(!lines.truncated());
        assert_eq!(all(&mut lines), ["b", "c"]);
        assert!(!lines.truncated());
        fs::write(&live, "").unwrap();
        assert!(lines.truncated());
    }

    #[test]
    fn garbage_is_an_error_naming_the_file() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        fs::write(&live, b"this is not zstd at all\n").unwrap();
        let e = ChainLines::open(&live).unwrap().next_line().unwrap_err();
        assert!(e.to_string().contains("run.jsonl.zst"), "{e}");
    }

    /// Record `i` of a test log: a notice every 50, a sample otherwise.
    fn rec(i: usize) -> crate::Record {
        use crate::{Level, Notice, Record, SystemSample, Telemetry};
        let msg = if i.is_multiple_of(50) {
            Telemetry::Notice(Notice::new(Level::Info, "test", format!("n{i}")))
        } else {
            let mut s = SystemSample::default();
            s.host.process_rss = i as u64 * 7919;
            Telemetry::Sample(s)
        };
        Record::new(0.0, i as f64 * 0.1, msg)
    }

    fn line(i: usize) -> String {
        crate::logfile::compact_line(&rec(i))
    }

    /// A compressed log of records `0..n`, a frame every 100, and each frame's index.
    fn framed(n: usize) -> (Vec<u8>, Vec<crate::logfile::IndexEntry>) {
        use crate::logfile::index::{frame_len_from_trailer, IndexEntry};
        let mut w = crate::logfile::FrameWriter::new(Vec::new()).unwrap();
        for i in 0..n {
            w.write_record(&rec(i)).unwrap();
            if (i + 1).is_multiple_of(100) {
                w.end_frame().unwrap();
            }
        }
        let bytes = w.finish().unwrap();
        let mut at = bytes.len() - frame_len_from_trailer(&bytes).unwrap() as usize;
        let mut entries = vec![];
        loop {
            let e = IndexEntry::decode(&bytes[at..]).unwrap();
            let prev = e.prev;
            entries.push(e);
            match prev {
                Some(p) => at = p as usize,
                None => break,
            }
        }
        entries.reverse();
        (bytes, entries)
    }

    /// `bytes` with 16 bytes overwritten in the middle of the data frame `e` indexes,
    /// as the log `run.jsonl.zst` in `d`.
    fn spoilt(d: &Dir, bytes: &mut [u8], e: &crate::logfile::IndexEntry) -> PathBuf {
        let mid = (e.data_offset + e.data_len / 2) as usize;
        for b in &mut bytes[mid..mid + 16] {
            *b ^= 0xA5;
        }
        let live = d.0.join("run.jsonl.zst");
        fs::write(&live, &*bytes).unwrap();
        live
    }

    /// Every line and every damage of a log, each damage at its place (`!` and its offset).
    fn read_marked(path: &Path) -> (Vec<String>, Vec<Damage>) {
        let mut lines = ChainLines::open(path).unwrap();
        let (mut got, mut damage) = (vec![], vec![]);
        loop {
            let next = lines.next_line().unwrap();
            for d in lines.take_damage() {
                got.push(format!("!{}", d.offset));
                damage.push(d);
            }
            match next {
                Line::Whole(l) => got.push(l),
                Line::End => break,
            }
        }
        (got, damage)
    }

    #[test]
    fn a_damaged_middle_frame_is_skipped_and_said_once() {
        let (d, (mut bytes, frames)) = (Dir::new(), framed(1000));
        let live = spoilt(&d, &mut bytes, &frames[4]);
        let (got, damage) = read_marked(&live);
        let at = frames[4].data_offset;
        let mut want: Vec<String> = (0..400).map(line).collect();
        want.push(format!("!{at}"));
        want.extend((500..1000).map(line));
        assert_eq!(got, want);
        assert_eq!(damage.len(), 1);
        let lost = damage[0].lost.clone().unwrap();
        assert_eq!((lost.records, lost.of), (100, 100));
        assert_eq!((lost.t_first, lost.t_last), (rec(400).t, rec(499).t));
        let said = damage[0].to_string();
        assert!(said.contains("run.jsonl.zst"), "{said}");
        assert!(said.contains(&format!("byte {at}")), "{said}");
        assert!(said.contains("its 100 records lost"), "{said}");
        assert!(said.contains("t 40.0–49.9"), "{said}");
    }

    #[test]
    fn a_damaged_frame_header_is_skipped_the_same_way() {
        let (d, (mut bytes, frames)) = (Dir::new(), framed(600));
        let at = frames[3].data_offset as usize;
        for b in &mut bytes[at + 4..at + 8] {
            *b ^= 0xA5;
        }
        let live = d.0.join("run.jsonl.zst");
        fs::write(&live, &bytes).unwrap();
        let (got, damage) = read_marked(&live);
        let mut want: Vec<String> = (0..300).map(line).collect();
        want.push(format!("!{at}"));
        want.extend((400..600).map(line));
        assert_eq!(got, want);
        assert_eq!(damage[0].lost.as_ref().map(|l| l.records), Some(100));
    }

    #[test]
    fn a_damaged_last_frame_is_skipped_and_the_end_is_still_the_end() {
        let (d, (mut bytes, frames)) = (Dir::new(), framed(500));
        let live = spoilt(&d, &mut bytes, &frames[4]);
        let (got, damage) = read_marked(&live);
        let mut want: Vec<String> = (0..400).map(line).collect();
        want.push(format!("!{}", frames[4].data_offset));
        assert_eq!(got, want);
        assert_eq!(damage.len(), 1);
        // A frame cut short after it is unfinished, not damaged.
        let mut w = crate::logfile::FrameWriter::new(Vec::new()).unwrap();
        w.write_record(&rec(500)).unwrap();
        w.flush().unwrap();
        let open = w.bytes_written() as usize;
        let tail = w.finish().unwrap();
        bytes.extend(&tail[..open - 3]);
        fs::write(&live, &bytes).unwrap();
        let (got, damage) = read_marked(&live);
        assert_eq!(got.len(), 401);
        assert_eq!(damage.len(), 1);
    }

    #[test]
    fn a_damaged_index_frame_loses_nothing_and_says_nothing() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        let (mut bytes, frames) = framed(1000);
        // The third frame's index: its magic, so zstd cannot skip it.
        let index = (frames[2].data_offset + frames[2].data_len) as usize;
        bytes[index] ^= 0xFF;
        // The fifth's: its size, so zstd skips too little.
        let index = (frames[4].data_offset + frames[4].data_len) as usize;
        bytes[index + 4] ^= 0x08;
        // The seventh's: its size grown past the next frames, which zstd would skip.
        let index = (frames[6].data_offset + frames[6].data_len) as usize;
        bytes[index + 5] ^= 0x10;
        fs::write(&live, &bytes).unwrap();
        let (got, damage) = read_marked(&live);
        assert_eq!(got, (0..1000).map(line).collect::<Vec<_>>());
        assert!(damage.is_empty(), "{damage:?}");
    }

    #[test]
    fn without_an_index_the_next_frame_is_found_by_its_magic() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        let text = |from: usize| -> String { (from..from + 100).map(|i| line(i) + "\n").collect() };
        let frames: Vec<Vec<u8>> = (0..5).map(|k| frame(&text(k * 100))).collect();
        let at: usize = frames[..2].iter().map(Vec::len).sum();
        let mut bytes = frames.concat();
        let mid = at + frames[2].len() / 2;
        for b in &mut bytes[mid..mid + 16] {
            *b ^= 0xA5;
        }
        // A stray magic in the damaged stretch is no frame.
        bytes[mid..mid + 4].copy_from_slice(&0xFD2FB528u32.to_le_bytes());
        fs::write(&live, &bytes).unwrap();
        let (got, damage) = read_marked(&live);
        let mut want: Vec<String> = (0..200).map(line).collect();
        want.push(format!("!{at}"));
        want.extend((300..500).map(line));
        assert_eq!(got, want);
        assert_eq!(damage.len(), 1);
        assert_eq!(damage[0].lost, None);
        assert!(damage[0].to_string().contains("no index"), "{}", damage[0]);
    }

    #[test]
    fn damage_in_a_followed_file_is_skipped_when_the_next_frame_comes() {
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        let text = |from: usize| -> String { (from..from + 100).map(|i| line(i) + "\n").collect() };
        let mut bytes = [frame(&text(0)), frame(&text(100))].concat();
        let first = frame(&text(0)).len();
        let mid = first + (bytes.len() - first) / 2;
        for b in &mut bytes[mid..mid + 16] {
            *b ^= 0xA5;
        }
        fs::write(&live, &bytes).unwrap();
        let mut lines = ChainLines::open(&live).unwrap();
        let got = all(&mut lines);
        assert_eq!(got[..100], (0..100).map(line).collect::<Vec<_>>()[..]);
        let damage = lines.take_damage();
        assert_eq!(damage.len(), 1);
        assert_eq!(damage[0].offset, first as u64);
        fs::OpenOptions::new()
            .append(true)
            .open(&live)
            .unwrap()
            .write_all(&frame(&text(200)))
            .unwrap();
        assert_eq!(all(&mut lines), (200..300).map(line).collect::<Vec<_>>());
        assert!(lines.take_damage().is_empty(), "said once");
    }

    #[test]
    fn a_frame_without_checksum_that_disagrees_with_its_index_is_dropped() {
        use crate::logfile::IndexEntry;
        let d = Dir::new();
        let live = d.0.join("run.jsonl.zst");
        // An older writer's log: data frames without a checksum.
        let (mut bytes, mut prev) = (Vec::new(), None);
        let mut offsets = vec![];
        for k in 0..8 {
            let text: String = (k * 100..k * 100 + 100).map(|i| line(i) + "\n").collect();
            let data = zstd::encode_all(text.as_bytes(), 3).unwrap();
            let entry = IndexEntry {
                data_offset: bytes.len() as u64,
                data_len: data.len() as u64,
                prev,
                // The third frame's index disagrees with it.
                records: if k == 2 { 101 } else { 100 },
                t_first: rec(k * 100).t,
                t_last: rec(k * 100 + 99).t,
                events: zstd::encode_all(&b""[..], 3).unwrap(),
                digest: zstd::encode_all(&b""[..], 3).unwrap(),
            };
            offsets.push(bytes.len() as u64);
            bytes.extend(&data);
            prev = Some(bytes.len() as u64);
            bytes.extend(entry.encode());
        }
        fs::write(&live, &bytes).unwrap();
        let (got, damage) = read_marked(&live);
        let mut want: Vec<String> = (0..200).map(line).collect();
        want.push(format!("!{}", offsets[2]));
        want.extend((300..800).map(line));
        assert_eq!(got, want);
        assert_eq!(damage[0].lost.as_ref().map(|l| l.records), Some(101));
        assert!(damage[0].error.contains("index says 101"), "{}", damage[0]);
    }
}
