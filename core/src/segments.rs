//! The CUDA caching allocator's segment map: each segment (one cudaMalloc) and the blocks
//! it is split into, allocated or free. This is what makes fragmentation visible.
use serde::{Deserialize, Serialize};

/// Segments kept per map: the largest ones, which hold most of the memory.
pub const MAX_SEGMENTS: usize = 64;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SegmentMap {
    pub segments: Vec<Segment>,
    /// Segments left out by [`MAX_SEGMENTS`], and the bytes they hold.
    pub omitted_segments: usize,
    pub omitted_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub address: u64,
    pub total_size: u64,
    /// `large` or `small` pool.
    pub pool: String,
    /// Runs of adjacent blocks in the same state, in address order.
    pub runs: Vec<BlockRun>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRun {
    pub size: u64,
    /// Handed to a tensor (or pending free); false for cached, free space.
    pub allocated: bool,
}

impl Segment {
    pub fn allocated_bytes(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.allocated)
            .map(|r| r.size)
            .sum()
    }

    /// Appends a block, merging it into the last run when the state matches.
    pub fn push_block(&mut self, size: u64, allocated: bool) {
        match self.runs.last_mut() {
            Some(last) if last.allocated == allocated => last.size += size,
            _ => self.runs.push(BlockRun { size, allocated }),
        }
    }
}

impl SegmentMap {
    /// Keeps the [`MAX_SEGMENTS`] largest segments (in address order), counting the rest.
    pub fn from_segments(mut segments: Vec<Segment>) -> SegmentMap {
        let mut omitted_segments = 0;
        let mut omitted_bytes = 0;
        if segments.len() > MAX_SEGMENTS {
            segments.sort_by_key(|s| std::cmp::Reverse(s.total_size));
            for s in segments.drain(MAX_SEGMENTS..) {
                omitted_segments += 1;
                omitted_bytes += s.total_size;
            }
        }
        segments.sort_by_key(|s| s.address);
        SegmentMap {
            segments,
            omitted_segments,
            omitted_bytes,
        }
    }

    pub fn reserved(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum::<u64>() + self.omitted_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_blocks_of_one_state_merge() {
        let mut s = Segment::default();
        s.push_block(10, true);
        s.push_block(5, true);
        s.push_block(7, false);
        s.push_block(1, true);
        assert_eq!(s.runs.len(), 3);
        assert_eq!(s.allocated_bytes(), 16);
    }

    #[test]
    fn keeps_the_largest_segments_and_counts_the_rest() {
        let segs: Vec<Segment> = (0..MAX_SEGMENTS as u64 + 3)
            .map(|i| Segment {
                address: 1000 - i,
                total_size: i + 1,
                ..Default::default()
            })
            .collect();
        let total: u64 = segs.iter().map(|s| s.total_size).sum();
        let map = SegmentMap::from_segments(segs);
        assert_eq!(map.segments.len(), MAX_SEGMENTS);
        assert_eq!(map.omitted_segments, 3);
        assert_eq!(map.omitted_bytes, 1 + 2 + 3, "the three smallest left out");
        assert_eq!(map.reserved(), total);
        assert!(map.segments.windows(2).all(|w| w[0].address < w[1].address));
    }
}
