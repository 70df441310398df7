//! A run log's chain (`NAME.1…`, `NAME.2…`, then `NAME` itself) read as one stream of
//! whole lines, each file plain JSONL or zstd-framed by its name (docs/LOG_SCHEMA.md,
//! "Compressed and rotated logs").
//!
//! - A compressed file is decoded as a stream: its end (a file still being written, or
//!   one killed in the middle of a frame) is only the end *for now*: what was flushed is
//!   given, and the rest of the frame is decoded when it arrives. Skippable (index)
//!   frames are skipped by zstd itself.
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
use std::fs::{self, File, Metadata};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};

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
}

fn id_of(m: &Metadata) -> (u64, u64) {
    (m.dev(), m.ino())
}

fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl Part {
    fn open(name: &Path, role: Role) -> io::Result<Part> {
        let file = File::open(name).map_err(|e| named(name, e))?;
        let meta = file.metadata().map_err(|e| named(name, e))?;
        Part::at(Arc::new(file), name.to_path_buf(), role, id_of(&meta), 0)
    }

    /// A part read from `raw` on, which must be a frame boundary of a compressed file.
    fn at(
        file: Arc<File>,
        name: PathBuf,
        role: Role,
        id: (u64, u64),
        raw: u64,
    ) -> io::Result<Part> {
        let decoder = if is_compressed(&name) {
            Some(Zstd {
                decoder: Decoder::new()?,
                input: Vec::new(),
                taken: 0,
                full: false,
            })
        } else {
            None
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
    fn fill(&mut self, out: &mut Vec<u8>) -> io::Result<usize> {
        let Some(z) = self.decoder.as_mut() else {
            let start = out.len();
            out.resize(start + CHUNK, 0);
            let read = self.file.read_at(&mut out[start..], self.raw);
            let n = *read.as_ref().unwrap_or(&0);
            out.truncate(start + n);
            read.map_err(|e| named(&self.name, e))?;
            self.raw += n as u64;
            return Ok(n);
        };
        let before = out.len();
        // Decoding stops at each frame's end: go on while input is taken or output made.
        let mut idle = 0;
        while idle < 2 {
            if z.taken == z.input.len() && !z.full {
                z.input.resize(CHUNK, 0);
                let n = self.file.read_at(&mut z.input, self.raw);
                let n = n.map_err(|e| named(&self.name, e))?;
                z.input.truncate(n);
                z.taken = 0;
                self.raw += n as u64;
                if n == 0 {
                    break;
                }
            }
            out.reserve(CHUNK);
            let at = out.len();
            let mut dst = OutBuffer::around_pos(out, at);
            let mut src = InBuffer::around(&z.input[z.taken..]);
            z.decoder.run(&mut src, &mut dst).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: not a zstd-framed log near byte {} ({e}): read it with zstdcat \
                         to see how far it is sound",
                        self.name.display(),
                        self.raw - (z.input.len() - z.taken) as u64
                    ),
                )
            })?;
            let (made, took) = (dst.pos() - at, src.pos());
            z.taken += took;
            z.full = out.len() == out.capacity();
            if out.len() > before && !z.full {
                break;
            }
            idle = if made == 0 && took == 0 { idle + 1 } else { 0 };
        }
        Ok(out.len() - before)
    }
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
        }
    }

    /// The lines of the one file `name` (plain or compressed by its name), read from
    /// `raw`, which must be a frame boundary of a compressed file.
    pub fn file(name: &Path, raw: u64) -> io::Result<ChainLines> {
        let mut part = Part::open(name, Role::Segment)?;
        part.raw = raw;
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
            if self.part.fill(&mut self.buf)? > 0 {
                continue;
            }
            if !self.next_file()? {
                return Ok(Line::End);
            }
        }
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
            return Part::open(&segment, Role::Segment);
        }
        let mut part = Part::open(path, Role::Live)?;
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

    fn frame(text: &str) -> Vec<u8> {
        zstd::encode_all(text.as_bytes(), 3).unwrap()
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
}
