//! The index frame written after each data frame of a compressed log: where the data
//! frame is, the previous index, and the frame's rare records (`events`) and one record
//! per high-rate kind (`digest`), each a zstd frame of JSONL. A zstd *skippable* frame, so
//! `zstdcat` passes over it; the layout is docs/LOG_SCHEMA.md's table.
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The skippable-frame magic of headroom's index frames (zstd reserves 0x184D2A50..5F).
pub const SKIPPABLE_MAGIC: u32 = 0x184D_2A5E;
/// The last four bytes of every index frame: a reader at a file's end finds it there.
pub const TAG: &[u8; 4] = b"HRIX";
/// Payload bytes before `events`.
const HEAD: usize = 56;
/// Payload bytes after `digest`: its length again, then [`TAG`].
const TRAILER: usize = 8;

#[derive(Debug, Clone, PartialEq)]
pub struct IndexEntry {
    /// Where the data frame this entry indexes starts in the file.
    pub data_offset: u64,
    /// The data frame's compressed length.
    pub data_len: u64,
    /// Where the previous index frame starts; `None` for the file's first.
    pub prev: Option<u64>,
    /// Lines (records) in the data frame.
    pub records: u64,
    pub t_first: f64,
    pub t_last: f64,
    /// One zstd frame: the data frame's records that are not high-rate, in order.
    pub events: Vec<u8>,
    /// One zstd frame: a record per high-rate kind of the data frame (see the schema).
    pub digest: Vec<u8>,
}

impl IndexEntry {
    /// The whole skippable frame: magic, size, payload.
    pub fn encode(&self) -> Vec<u8> {
        let payload = HEAD + self.events.len() + self.digest.len() + TRAILER;
        let mut out = Vec::with_capacity(8 + payload);
        out.extend_from_slice(&SKIPPABLE_MAGIC.to_le_bytes());
        out.extend_from_slice(&(payload as u32).to_le_bytes());
        out.extend_from_slice(&self.data_offset.to_le_bytes());
        out.extend_from_slice(&self.data_len.to_le_bytes());
        out.extend_from_slice(&self.prev.unwrap_or(u64::MAX).to_le_bytes());
        out.extend_from_slice(&self.records.to_le_bytes());
        out.extend_from_slice(&self.t_first.to_le_bytes());
        out.extend_from_slice(&self.t_last.to_le_bytes());
        out.extend_from_slice(&(self.events.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.digest.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.events);
        out.extend_from_slice(&self.digest);
        out.extend_from_slice(&(payload as u32).to_le_bytes());
        out.extend_from_slice(TAG);
        out
    }

    /// Reads an index frame from its first byte (the magic); `None` when `frame` is not
    /// one (another frame, cut short, lengths that disagree): a reader then falls back
    /// to decoding the data itself.
    pub fn decode(frame: &[u8]) -> Option<IndexEntry> {
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(frame.get(at..at + 4)?.try_into().ok()?))
        };
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(frame.get(at..at + 8)?.try_into().ok()?))
        };
        if u32_at(0)? != SKIPPABLE_MAGIC {
            return None;
        }
        let payload = u32_at(4)? as usize;
        let p = 8;
        let events_len = u32_at(p + 48)? as usize;
        let digest_len = u32_at(p + 52)? as usize;
        if payload != HEAD + events_len + digest_len + TRAILER
            || frame.len() < 8 + payload
            || u32_at(8 + payload - TRAILER)? as usize != payload
            || &frame[8 + payload - 4..8 + payload] != TAG
        {
            return None;
        }
        let events_at = p + HEAD;
        let digest_at = events_at + events_len;
        Some(IndexEntry {
            data_offset: u64_at(p)?,
            data_len: u64_at(p + 8)?,
            prev: Some(u64_at(p + 16)?).filter(|&o| o != u64::MAX),
            records: u64_at(p + 24)?,
            t_first: f64::from_bits(u64_at(p + 32)?),
            t_last: f64::from_bits(u64_at(p + 40)?),
            events: frame[events_at..digest_at].to_vec(),
            digest: frame[digest_at..digest_at + digest_len].to_vec(),
        })
    }

    /// The index frame starting at `at` in `file`; `None` where there is none.
    pub fn read_from(file: &File, at: u64) -> Option<IndexEntry> {
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, at).ok()?;
        if u32::from_le_bytes(head[..4].try_into().ok()?) != SKIPPABLE_MAGIC {
            return None;
        }
        let size = u32::from_le_bytes(head[4..8].try_into().ok()?) as usize;
        let mut frame = vec![0u8; 8 + size];
        file.read_exact_at(&mut frame, at).ok()?;
        IndexEntry::decode(&frame)
    }

    /// The whole frame's length in bytes (magic and size included).
    pub fn frame_len(&self) -> u64 {
        (8 + HEAD + self.events.len() + self.digest.len() + TRAILER) as u64
    }
}

/// Where an index frame ending at the end of `tail` starts, counted back from that end,
/// if `tail`'s last 8 bytes are an index frame's trailer: the payload's length, then
/// [`TAG`]. The frame itself is then checked by [`IndexEntry::decode`].
pub fn frame_len_from_trailer(tail: &[u8]) -> Option<u64> {
    let n = tail.len();
    if n < TRAILER || &tail[n - 4..] != TAG {
        return None;
    }
    let payload = u32::from_le_bytes(tail[n - 8..n - 4].try_into().ok()?) as u64;
    Some(8 + payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_and_a_damaged_one_does_not() {
        let e = IndexEntry {
            data_offset: 12,
            data_len: 3456,
            prev: None,
            records: 99,
            t_first: 1.5,
            t_last: 2.25,
            events: vec![1, 2, 3],
            digest: vec![4, 5],
        };
        let frame = e.encode();
        assert_eq!(frame.len() as u64, e.frame_len());
        assert_eq!(IndexEntry::decode(&frame), Some(e.clone()));
        assert_eq!(frame_len_from_trailer(&frame), Some(frame.len() as u64));
        let linked = IndexEntry {
            prev: Some(7),
            ..e.clone()
        };
        assert_eq!(IndexEntry::decode(&linked.encode()).unwrap().prev, Some(7));
        assert_eq!(
            IndexEntry::decode(&frame[..frame.len() - 1]),
            None,
            "cut short"
        );
        let mut bad = frame.clone();
        bad[0] ^= 1;
        assert_eq!(IndexEntry::decode(&bad), None, "not the magic");
        let mut bad = frame.clone();
        let n = bad.len();
        bad[n - 8] ^= 1;
        assert_eq!(IndexEntry::decode(&bad), None, "lengths disagree");
    }
}
