//! The compressed log's encoder: records in, data frames of at most [`FRAME_RAW`] bytes of
//! JSONL each followed by its index frame (docs/LOG_SCHEMA.md). When to flush is the
//! caller's choice; a frame ends by itself when full, and at [`FrameWriter::end_frame`].
use std::io::{self, Write};

use serde_json::Value;
use zstd::zstd_safe;

use super::compact::compact_value;
use super::index::IndexEntry;
use crate::{Record, Telemetry};

/// The most JSONL a data frame holds. A frame is what `replay --end` decodes whole or
/// skips: 1 MiB is ~2,000 steps of a busy run, a few milliseconds to decode, and big
/// enough that starting a fresh frame costs zstd little ratio.
pub const FRAME_RAW: usize = 1 << 20;
/// zstd's level: 3 (its default) compresses a step in about 2 µs here; higher levels
/// gain a few percent for several times the cost (docs/BENCHMARKS.md, "The run log").
pub const LEVEL: i32 = 3;

/// One zstd context for the whole run, made when the log opens. A context per frame (1.3
/// MiB of workspace at level 3) would be malloc'ed mid-run, and under a hard cap
/// (RLIMIT_DATA, process-wide) that allocation fails when training holds the cap full; the
/// zstd crate panics on a context it cannot create. A context reused for frames of the
/// same parameters keeps its workspace: no allocation after the first frame.
struct Zstd {
    cctx: zstd_safe::CCtx<'static>,
    /// Compressed output, handed to the file after each call.
    out: Vec<u8>,
}

fn zstd_error(code: usize) -> io::Error {
    io::Error::other(format!("zstd: {}", zstd_safe::get_error_name(code)))
}

impl Zstd {
    /// `checksum`: each frame ends with a checksum of its content (4 bytes), so that a
    /// reader tells a damaged frame from one that only decodes to other bytes.
    fn new(checksum: bool) -> io::Result<Zstd> {
        let mut cctx = zstd_safe::CCtx::try_create().ok_or_else(|| {
            io::Error::new(io::ErrorKind::OutOfMemory, "no memory for a zstd context")
        })?;
        cctx.set_parameter(zstd_safe::CParameter::CompressionLevel(LEVEL))
            .map_err(zstd_error)?;
        cctx.set_parameter(zstd_safe::CParameter::ChecksumFlag(checksum))
            .map_err(zstd_error)?;
        Ok(Zstd {
            cctx,
            out: Vec::with_capacity(zstd_safe::CCtx::out_size()),
        })
    }

    /// Feeds `input` to the open frame (`Continue`), makes it readable (`Flush`) or ends the
    /// frame (`End`), writing what comes out to `file`.
    fn run(&mut self, input: &[u8], op: Op, file: &mut impl Write) -> io::Result<()> {
        use zstd_safe::zstd_sys::ZSTD_EndDirective as E;
        let directive = match op {
            Op::Continue => E::ZSTD_e_continue,
            Op::Flush => E::ZSTD_e_flush,
            Op::End => E::ZSTD_e_end,
        };
        let mut src = zstd_safe::InBuffer::around(input);
        loop {
            self.out.clear();
            let mut dst = zstd_safe::OutBuffer::around(&mut self.out);
            let left = self
                .cctx
                .compress_stream2(&mut dst, &mut src, directive)
                .map_err(zstd_error)?;
            file.write_all(&self.out)?;
            let taken = src.pos == input.len();
            if taken && (op == Op::Continue || left == 0) {
                return Ok(());
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Continue,
    Flush,
    End,
}

/// What the open data frame holds, for its index.
#[derive(Default)]
struct Frame {
    start: u64,
    raw: usize,
    records: u64,
    t_first: f64,
    t_last: f64,
    events: Vec<u8>,
    /// (kind, rank key, line): one per high-rate kind.
    digest: Vec<(&'static str, f64, String)>,
}

pub struct FrameWriter<W: Write> {
    file: W,
    /// Bytes handed to `file` so far: where frames start.
    written: u64,
    /// The data frames' context, and the index frames' (kept apart: small inputs would
    /// shrink a shared context's workspace, and the next data frame would grow it again).
    data: Zstd,
    index: Zstd,
    /// Whether a data frame is open.
    open: bool,
    frame: Frame,
    last_index: Option<u64>,
}

/// Counts the bytes written through it.
struct Counting<'a, W> {
    inner: &'a mut W,
    n: &'a mut u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        *self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write> FrameWriter<W> {
    /// Fails (out of memory) where the compressor's contexts cannot be made: at the log's
    /// start, before training holds any memory.
    pub fn new(file: W) -> io::Result<FrameWriter<W>> {
        Ok(FrameWriter {
            file,
            written: 0,
            data: Zstd::new(true)?,
            index: Zstd::new(false)?,
            open: false,
            frame: Frame::default(),
            last_index: None,
        })
    }

    /// Bytes written to the file so far (what zstd still holds is not counted: at most
    /// a block, until the next flush).
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    fn compress(&mut self, input: &[u8], op: Op) -> io::Result<()> {
        let mut file = Counting {
            inner: &mut self.file,
            n: &mut self.written,
        };
        self.data.run(input, op, &mut file)
    }

    pub fn write_record(&mut self, rec: &Record) -> io::Result<()> {
        let value = compact_value(rec);
        let mut line = value.to_string();
        if self.frame.raw > 0 && self.frame.raw + line.len() + 1 > FRAME_RAW {
            self.end_frame()?;
        }
        if !self.open {
            self.open = true;
            self.frame = Frame {
                start: self.written,
                t_first: rec.t,
                ..Frame::default()
            };
        }
        line.push('\n');
        self.compress(line.as_bytes(), Op::Continue)?;
        line.pop();
        let f = &mut self.frame;
        f.raw += line.len() + 1;
        f.records += 1;
        f.t_last = rec.t;
        if rec.msg.is_high_rate() {
            digest(&mut f.digest, &rec.msg, &value, line);
        } else {
            f.events.extend_from_slice(line.as_bytes());
            f.events.push(b'\n');
        }
        Ok(())
    }

    /// Makes everything written so far readable (zstd's flush: the frame stays open).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.open {
            self.compress(&[], Op::Flush)?;
        }
        self.file.flush()
    }

    /// Ends the open data frame, if any, and writes its index frame.
    pub fn end_frame(&mut self) -> io::Result<()> {
        if !self.open {
            return Ok(());
        }
        self.compress(&[], Op::End)?;
        self.open = false;
        let f = std::mem::take(&mut self.frame);
        let digest: String = f.digest.iter().map(|(_, _, l)| format!("{l}\n")).collect();
        let mut blob = |bytes: &[u8]| -> io::Result<Vec<u8>> {
            let mut out = Vec::new();
            self.index.run(bytes, Op::End, &mut out)?;
            Ok(out)
        };
        let entry = IndexEntry {
            data_offset: f.start,
            data_len: self.written - f.start,
            prev: self.last_index,
            records: f.records,
            t_first: f.t_first,
            t_last: f.t_last,
            events: blob(&f.events)?,
            digest: blob(digest.as_bytes())?,
        };
        self.last_index = Some(self.written);
        let frame = entry.encode();
        self.file.write_all(&frame)?;
        self.written += frame.len() as u64;
        self.file.flush()
    }

    /// Ends the last frame and hands the file back, flushed.
    pub fn finish(mut self) -> io::Result<W> {
        self.end_frame()?;
        self.file.flush()?;
        Ok(self.file)
    }
}

/// Keeps, per high-rate kind, the record `replay --end` shows for the frame: the highest
/// step peak and resident set (a summary must not hide the risk), else the latest.
/// Segment maps are left out: only the last one is ever drawn.
fn digest(kept: &mut Vec<(&'static str, f64, String)>, msg: &Telemetry, v: &Value, line: String) {
    let kind = msg.kind();
    let rank = match msg {
        Telemetry::Segments(_) => return,
        Telemetry::StepMemory(_) => v["peak_bytes"].as_f64().unwrap_or(0.0),
        Telemetry::Sample(_) => v["host"]["process_rss"].as_f64().unwrap_or(0.0),
        _ => f64::INFINITY,
    };
    match kept.iter_mut().find(|(k, _, _)| *k == kind) {
        Some(slot) if rank >= slot.1 => *slot = (kind, rank, line),
        Some(_) => {}
        None => kept.push((kind, rank, line)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logfile::compact_line;
    use crate::logfile::index::{frame_len_from_trailer, IndexEntry};
    use crate::{Level, Notice};

    fn records(n: usize) -> Vec<Record> {
        (0..n)
            .map(|i| {
                let msg = if i % 50 == 0 {
                    Telemetry::Notice(Notice::new(Level::Info, "test", format!("n{i}")))
                } else {
                    let mut s = crate::SystemSample::default();
                    // The highest resident set is frame-local step 37.
                    s.host.process_rss = 1000 + ((i % 100) as u64 * 37) % 100;
                    Telemetry::Sample(s)
                };
                Record::new(1e9 + i as f64, i as f64 * 0.1, msg)
            })
            .collect()
    }

    #[test]
    fn zstd_reads_the_records_and_the_indexes_walk_back_over_every_frame() {
        let recs = records(400);
        let mut w = FrameWriter::new(Vec::new()).unwrap();
        for (i, r) in recs.iter().enumerate() {
            w.write_record(r).unwrap();
            if i % 100 == 99 {
                w.end_frame().unwrap();
            }
        }
        let file = w.finish().unwrap();
        // zstd itself skips the index frames.
        let text = String::from_utf8(zstd::decode_all(&file[..]).unwrap()).unwrap();
        let expected: String = recs.iter().map(|r| compact_line(r) + "\n").collect();
        assert_eq!(text, expected);
        // From the end, back through `prev`: four frames, newest first.
        let mut at = file.len() as u64 - frame_len_from_trailer(&file).unwrap();
        let mut seen = Vec::new();
        loop {
            let e = IndexEntry::decode(&file[at as usize..]).unwrap();
            let data = &file[e.data_offset as usize..(e.data_offset + e.data_len) as usize];
            let lines = zstd::decode_all(data).unwrap();
            assert_eq!(
                lines.iter().filter(|&&b| b == b'\n').count() as u64,
                e.records
            );
            let events = String::from_utf8(zstd::decode_all(&e.events[..]).unwrap()).unwrap();
            let digest = String::from_utf8(zstd::decode_all(&e.digest[..]).unwrap()).unwrap();
            let kept = Record::from_line(digest.trim()).unwrap();
            match kept.msg {
                Telemetry::Sample(s) => assert_eq!(s.host.process_rss, 1099),
                other => panic!("the digest kept {other:?}"),
            }
            seen.push((e.records, events.lines().count(), e.t_first));
            match e.prev {
                Some(p) => at = p,
                None => break,
            }
        }
        assert_eq!(seen.len(), 4);
        assert!(seen.iter().all(|&(n, events, _)| n == 100 && events == 2));
        assert_eq!(seen.last().unwrap().2, 0.0, "the first frame starts at t 0");
    }

    #[test]
    fn a_frame_ends_by_itself_when_full_and_a_flush_makes_its_records_readable() {
        let mut w = FrameWriter::new(Vec::new()).unwrap();
        let big = Record::new(
            0.0,
            0.0,
            Telemetry::Notice(Notice::new(Level::Info, "t", "x".repeat(4000))),
        );
        for _ in 0..300 {
            w.write_record(&big).unwrap();
        }
        w.flush().unwrap();
        let n = w.bytes_written() as usize;
        let file = w.file.clone();
        assert_eq!(file.len(), n);
        // Two whole frames (each < 1 MiB of JSONL) before the open one.
        let mut d = zstd::stream::read::Decoder::new(&file[..]).unwrap();
        let mut text = Vec::new();
        let _ = std::io::Read::read_to_end(&mut d, &mut text);
        assert_eq!(text.iter().filter(|&&b| b == b'\n').count(), 300);
        assert!(
            frame_len_from_trailer(&file).is_none(),
            "the open frame ends the file"
        );
    }
}
