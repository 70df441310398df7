//! `h64:` and 16 hex digits: a fast non-cryptographic digest of bytes and their length,
//! for checkpoint files and the corpus. It catches corruption and changed content, not
//! tampering: any single changed 8-byte word always changes it (every step is a bijection
//! of the state), other damage almost surely.
use std::fs::File;
use std::io::Read;
use std::path::Path;

const K: u64 = 0x9E37_79B9_7F4A_7C15;
const BLOCK: usize = 32;

fn mix(h: u64, w: u64) -> u64 {
    (h.rotate_left(29) ^ w).wrapping_mul(K)
}

/// A digest fed in pieces; the result does not depend on how the bytes were cut.
pub struct Digest {
    // Four independent lanes keep the multiplier busy.
    lanes: [u64; 4],
    len: u64,
    pending: Vec<u8>,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            lanes: [K, K ^ 1, K ^ 2, K ^ 3],
            len: 0,
            pending: Vec::with_capacity(BLOCK),
        }
    }
}

impl Digest {
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if !self.pending.is_empty() {
            let take = (BLOCK - self.pending.len()).min(data.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.pending.len() < BLOCK {
                return;
            }
            let block = std::mem::take(&mut self.pending);
            self.block(&block);
        }
        let whole = data.len() - data.len() % BLOCK;
        for block in data[..whole].chunks_exact(BLOCK) {
            self.block(block);
        }
        self.pending.extend_from_slice(&data[whole..]);
    }

    fn block(&mut self, block: &[u8]) {
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().unwrap());
            *lane = mix(*lane, w);
        }
    }

    pub fn finish(self) -> String {
        let mut h = self.lanes.iter().fold(self.len, |h, &l| mix(h, l));
        for &b in &self.pending {
            h = mix(h, u64::from(b));
        }
        h = mix(h, self.len);
        format!("h64:{:016x}", h ^ (h >> 32))
    }
}

pub fn digest_bytes(bytes: &[u8]) -> String {
    let mut d = Digest::default();
    d.update(bytes);
    d.finish()
}

pub fn digest_file(path: &Path) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut d = Digest::default();
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(d.finish()),
            Ok(n) => d.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_do_not_matter_and_every_byte_does() {
        let bytes: Vec<u8> = (0..(1 << 16) + 45).map(|i| (i * 31 % 251) as u8).collect();
        let whole = digest_bytes(&bytes);
        for cut in [1, 7, 31, 32, 33, 1000] {
            let mut d = Digest::default();
            for piece in bytes.chunks(cut) {
                d.update(piece);
            }
            assert_eq!(d.finish(), whole, "pieces of {cut}");
        }
        let mut changed = bytes.clone();
        changed[12345] ^= 1;
        assert_ne!(digest_bytes(&changed), whole);
        assert_ne!(digest_bytes(&bytes[..bytes.len() - 1]), whole);
    }

    /// Checkpoints written before this module carry digests of the old one-shot code:
    /// this value is what that code gave, so they still verify.
    #[test]
    fn digests_match_the_checkpoints_already_written() {
        let bytes: Vec<u8> = (0..(3 << 20) + 45).map(|i| (i * 31 % 251) as u8).collect();
        assert_eq!(digest_bytes(&bytes), OLD_DIGEST);
    }
    const OLD_DIGEST: &str = "h64:20718943c91ffa5a";
}
