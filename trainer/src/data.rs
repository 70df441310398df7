//! The corpus as bytes: loading with clear errors, the train/validation split, and batch
//! sampling that is a pure function of (seed, step, sample index).
//!
//! Purity is what makes two things cheap: a step's effective batch is the same set of
//! sequences however it is cut into micro-batches (so the memory controller may change
//! the micro-batch between steps without changing the run), and a resume needs only the
//! step number, no sampler state.
use std::borrow::Cow;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tch::{Device, TchError, Tensor};

/// Byte-level tokens.
pub const VOCAB_SIZE: i64 = 256;

static BUNDLED: &[u8] = include_bytes!("../../assets/tinyshakespeare.txt");

/// Name the bundled corpus goes by in telemetry and errors.
pub const BUNDLED_NAME: &str = "tinyshakespeare (bundled)";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataError {
    Missing {
        path: PathBuf,
    },
    Unreadable {
        path: PathBuf,
        reason: String,
    },
    Empty {
        path: PathBuf,
    },
    Directory {
        path: PathBuf,
    },
    Binary {
        path: PathBuf,
        why: String,
    },
    TooSmall {
        name: String,
        bytes: usize,
        split: &'static str,
        split_bytes: usize,
        needed: usize,
        seq_len: usize,
    },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::Missing { path } => write!(
                f,
                "corpus {} does not exist; check the path given to --corpus (or leave it \
                 empty for the bundled tinyshakespeare)",
                path.display()
            ),
            DataError::Unreadable { path, reason } => write!(
                f,
                "cannot read corpus {}: {reason}; check its permissions or pass another --corpus",
                path.display()
            ),
            DataError::Empty { path } => write!(
                f,
                "corpus {} is empty; pass a text file with content to --corpus",
                path.display()
            ),
            DataError::Directory { path } => write!(
                f,
                "corpus {} is a directory; pass a text file to --corpus",
                path.display()
            ),
            DataError::Binary { path, why } => write!(
                f,
                "corpus {} looks binary ({why}); headroom trains on text: pass a UTF-8 text \
                 file to --corpus",
                path.display()
            ),
            DataError::TooSmall {
                name,
                bytes,
                split,
                split_bytes,
                needed,
                seq_len,
            } => write!(
                f,
                "corpus {name} is too small: its {bytes} bytes leave {split_bytes} bytes for \
                 the {split} split, but one sequence of data.seq_len = {seq_len} needs at \
                 least {needed}; use a larger corpus, a smaller data.seq_len or another \
                 data.val_fraction"
            ),
        }
    }
}

impl std::error::Error for DataError {}

/// The corpus, split into a training head and a validation tail.
pub struct Dataset {
    bytes: Cow<'static, [u8]>,
    /// `bytes[..split]` trains, `bytes[split..]` validates.
    split: usize,
    seq_len: usize,
    name: String,
}

impl Dataset {
    /// Loads `corpus` (empty: the bundled tinyshakespeare) and checks it can feed
    /// sequences of `seq_len` bytes in both splits.
    pub fn load(corpus: &str, val_fraction: f64, seq_len: usize) -> Result<Dataset, DataError> {
        Dataset::load_waiting(corpus, val_fraction, seq_len, FIFO_WAIT)
    }

    /// [`Dataset::load`], waiting up to `fifo_wait` for the writer of a FIFO corpus.
    pub fn load_waiting(
        corpus: &str,
        val_fraction: f64,
        seq_len: usize,
        fifo_wait: Duration,
    ) -> Result<Dataset, DataError> {
        let (bytes, name) = if corpus.is_empty() {
            (Cow::Borrowed(BUNDLED), BUNDLED_NAME.to_string())
        } else {
            let path = PathBuf::from(corpus);
            (Cow::Owned(read_text(&path, fifo_wait)?), corpus.to_string())
        };
        Dataset::from_bytes(bytes, name, val_fraction, seq_len)
    }

    /// The corpus's digest ([`crate::digest::digest_bytes`]): a resume checks it still
    /// trains on the same content, wherever the file lives now.
    pub fn digest(&self) -> String {
        crate::digest::digest_bytes(&self.bytes)
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn from_bytes(
        bytes: Cow<'static, [u8]>,
        name: String,
        val_fraction: f64,
        seq_len: usize,
    ) -> Result<Dataset, DataError> {
        let n = bytes.len();
        let val = ((n as f64) * val_fraction).floor() as usize;
        let split = n - val.min(n);
        // A window is seq_len inputs plus the one-byte-shifted targets; one more byte than
        // that guarantees at least two distinct windows, so sampling has a choice.
        let needed = seq_len + 2;
        for (which, len) in [("training", split), ("validation", n - split)] {
            if len < needed {
                return Err(DataError::TooSmall {
                    name,
                    bytes: n,
                    split: which,
                    split_bytes: len,
                    needed,
                    seq_len,
                });
            }
        }
        Ok(Dataset {
            bytes,
            split,
            seq_len,
            name,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn train_bytes(&self) -> usize {
        self.split
    }

    pub fn val_bytes(&self) -> usize {
        self.bytes.len() - self.split
    }

    fn train(&self) -> &[u8] {
        &self.bytes[..self.split]
    }

    fn val(&self) -> &[u8] {
        &self.bytes[self.split..]
    }

    /// Start (in the training split) of sample `index` of optimizer step `step`.
    pub fn train_offset(&self, seed: u64, step: u64, index: usize) -> usize {
        let h = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ index as u64);
        // Modulo bias is ~span/2^64: irrelevant for corpora that fit in memory.
        let span = (self.split - self.seq_len) as u64;
        (h % span) as usize
    }

    /// Inputs and targets (`[len, seq]` int64 on `device`) for samples
    /// `first..first + len` of step `step`'s effective batch; `seq` is at most the
    /// dataset's `seq_len` (a shorter one is the start of the same window).
    pub fn train_batch(
        &self,
        seed: u64,
        step: u64,
        first: usize,
        len: usize,
        seq: usize,
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        let offsets: Vec<usize> = (first..first + len)
            .map(|i| self.train_offset(seed, step, i))
            .collect();
        self.windows(self.train(), &offsets, seq, device)
    }

    /// Starts (in the validation split) of `count` windows spread evenly over it: a fixed
    /// set, so successive evaluations are comparable.
    pub fn val_offsets(&self, count: usize) -> Vec<usize> {
        // Last valid start: the window needs seq_len + 1 bytes.
        let last = self.val_bytes() - self.seq_len - 1;
        match count {
            0 => Vec::new(),
            1 => vec![0],
            _ => (0..count).map(|j| j * last / (count - 1)).collect(),
        }
    }

    /// Inputs and targets for the validation windows starting at `offsets`.
    pub fn val_batch(
        &self,
        offsets: &[usize],
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        self.windows(self.val(), offsets, self.seq_len, device)
    }

    fn windows(
        &self,
        split: &[u8],
        offsets: &[usize],
        seq: usize,
        device: Device,
    ) -> Result<(Tensor, Tensor), TchError> {
        if seq == 0 || seq > self.seq_len {
            return Err(TchError::Shape(format!(
                "sequence length {seq} is outside 1..={}",
                self.seq_len
            )));
        }
        let w = seq + 1;
        let mut flat = Vec::with_capacity(offsets.len() * w);
        for &o in offsets {
            let window = split.get(o..o + w).ok_or_else(|| {
                TchError::Shape(format!(
                    "window at {o} runs past the end of a {}-byte split",
                    split.len()
                ))
            })?;
            flat.extend(window.iter().map(|&b| i64::from(b)));
        }
        let rows = offsets.len() as i64;
        let all = Tensor::f_from_slice(&flat)?
            .f_view([rows, w as i64])?
            .f_to_device(device)?;
        let t = seq as i64;
        let x = all.f_narrow(1, 0, t)?;
        let y = all.f_narrow(1, 1, t)?;
        Ok((x, y))
    }
}

/// How long a FIFO corpus may go without a writer before the run refuses to start.
pub const FIFO_WAIT: Duration = Duration::from_secs(10);

fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// Opening a FIFO for reading blocks until a writer opens it, silently. Open it without
/// blocking, wait (bounded) until it has something to say (data, or a writer that wrote
/// and left), then read it blocking like any file.
fn open_fifo(path: &Path, wait: Duration) -> Result<std::fs::File, DataError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let unreadable = |reason: String| DataError::Unreadable {
        path: path.to_path_buf(),
        reason,
    };
    let probe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| unreadable(e.to_string()))?;
    let mut fds = libc::pollfd {
        fd: probe.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let poll = |fds: &mut libc::pollfd, wait: Duration| {
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(fds, 1, ms) }
    };
    let mut ready = poll(&mut fds, Duration::ZERO);
    if ready == 0 {
        // A start that waits silently looks like a hang.
        headroom_host::out::err(&format!(
            "headroom: waiting up to {:.0} s for a writer of the FIFO {} (the corpus)",
            wait.as_secs_f64(),
            path.display()
        ));
        ready = poll(&mut fds, wait);
    }
    if ready <= 0 {
        return Err(unreadable(format!(
            "it is a FIFO and nothing wrote to it within {:.0} s; start its writer first, or \
             pass a regular file",
            wait.as_secs_f64()
        )));
    }
    let fd = probe.as_raw_fd();
    // SAFETY: fcntl on the descriptor `probe` owns.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(unreadable(std::io::Error::last_os_error().to_string()));
    }
    Ok(probe)
}

/// Reads the corpus, checking it is text as the bytes arrive: a device or pipe that never
/// ends (`/dev/zero`, `/dev/urandom`) is refused at its first bad byte instead of being
/// read until memory runs out.
fn read_text(path: &Path, fifo_wait: Duration) -> Result<Vec<u8>, DataError> {
    if path.is_dir() {
        return Err(DataError::Directory {
            path: path.to_path_buf(),
        });
    }

    let unreadable = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => DataError::Missing {
            path: path.to_path_buf(),
        },
        _ => DataError::Unreadable {
            path: path.to_path_buf(),
            reason: e.to_string(),
        },
    };
    let mut file = if is_fifo(path) {
        open_fifo(path, fifo_wait)?
    } else {
        std::fs::File::open(path).map_err(unreadable)?
    };
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 1 << 20];
    // bytes[..checked] is known text; the rest is at most an unfinished UTF-8 sequence.
    let mut checked = 0;
    loop {
        let n = match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(unreadable(e)),
        };
        bytes.extend_from_slice(&chunk[..n]);
        checked = check_text(path, &bytes, checked)?;
    }
    if bytes.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    if checked < bytes.len() {
        return Err(not_utf8(path, checked));
    }
    Ok(bytes)
}

/// Checks `bytes[from..]` for NUL bytes and invalid UTF-8; returns how far the text is
/// whole (short of the end when a multi-byte character is cut by the read).
fn check_text(path: &Path, bytes: &[u8], from: usize) -> Result<usize, DataError> {
    let new = &bytes[from..];
    if let Some(at) = new.iter().position(|&b| b == 0) {
        return Err(DataError::Binary {
            path: path.to_path_buf(),
            why: format!("a NUL byte at offset {}", from + at),
        });
    }
    match std::str::from_utf8(new) {
        Ok(_) => Ok(bytes.len()),
        Err(e) if e.error_len().is_none() => Ok(from + e.valid_up_to()),
        Err(e) => Err(not_utf8(path, from + e.valid_up_to())),
    }
}

fn not_utf8(path: &Path, at: usize) -> DataError {
    DataError::Binary {
        path: path.to_path_buf(),
        why: format!("not valid UTF-8 at byte {at}"),
    }
}

pub use headroom_core::units::splitmix64;

#[cfg(test)]
mod tests {
    use super::*;

    fn text(n: usize) -> Cow<'static, [u8]> {
        Cow::Owned((0..n).map(|i| b'a' + (i % 26) as u8).collect())
    }

    #[test]
    fn split_keeps_the_tail_for_validation() {
        let d = Dataset::from_bytes(text(1000), "t".into(), 0.1, 16).unwrap();
        assert_eq!((d.train_bytes(), d.val_bytes()), (900, 100));
    }

    #[test]
    fn sampling_is_a_pure_function_of_seed_step_and_index() {
        let d = Dataset::load("", 0.1, 64).unwrap();
        let a: Vec<usize> = (0..32).map(|i| d.train_offset(7, 3, i)).collect();
        let b: Vec<usize> = (0..32).map(|i| d.train_offset(7, 3, i)).collect();
        assert_eq!(a, b);
        let next: Vec<usize> = (0..32).map(|i| d.train_offset(7, 4, i)).collect();
        assert_ne!(a, next, "different steps draw different windows");
        let other_seed: Vec<usize> = (0..32).map(|i| d.train_offset(8, 3, i)).collect();
        assert_ne!(a, other_seed);
        assert!(a.iter().all(|&o| o + 65 <= d.train_bytes()));

        // A micro-batch is a slice of the step's batch, whatever its size.
        let (x, _) = d.train_batch(7, 3, 0, 8, 64, Device::Cpu).unwrap();
        let (x2, _) = d.train_batch(7, 3, 5, 3, 64, Device::Cpu).unwrap();
        assert!(x.narrow(0, 5, 3).equal(&x2));
        // A shorter sequence is the start of the same window.
        let (short, _) = d.train_batch(7, 3, 0, 8, 20, Device::Cpu).unwrap();
        assert!(x.narrow(1, 0, 20).equal(&short));
        assert!(d.train_batch(7, 3, 0, 8, 65, Device::Cpu).is_err());
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let d = Dataset::from_bytes(text(1000), "t".into(), 0.1, 16).unwrap();
        let (x, y) = d.train_batch(1, 1, 0, 4, 16, Device::Cpu).unwrap();
        assert_eq!(x.size(), [4, 16]);
        assert!(x.narrow(1, 1, 15).equal(&y.narrow(1, 0, 15)));
    }

    #[test]
    fn validation_windows_cover_the_split_evenly() {
        let d = Dataset::from_bytes(text(1000), "t".into(), 0.1, 16).unwrap();
        let offs = d.val_offsets(5);
        assert_eq!(offs.len(), 5);
        assert_eq!(offs[0], 0);
        assert_eq!(*offs.last().unwrap(), 100 - 17);
        assert!(offs.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(d.val_offsets(1), vec![0]);
    }

    #[test]
    fn too_small_names_the_split_and_the_fix() {
        let err = Dataset::from_bytes(text(100), "small.txt".into(), 0.1, 16)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("too small") && err.contains("validation"),
            "{err}"
        );
        assert!(err.contains("data.seq_len"), "{err}");
    }

    #[test]
    fn text_is_checked_across_reads() {
        let dir = tempfile::tempdir().unwrap();
        // 3-byte characters straddle the 1 MiB read boundaries: still text.
        let text = "\u{2603}".repeat(800_000);
        let path = dir.path().join("snow.txt");
        std::fs::write(&path, &text).unwrap();
        assert_eq!(read_text(&path, FIFO_WAIT).unwrap().len(), text.len());
        // The file ends inside a character.
        std::fs::write(&path, &text.as_bytes()[..text.len() - 1]).unwrap();
        let err = read_text(&path, FIFO_WAIT).unwrap_err().to_string();
        assert!(err.contains("not valid UTF-8 at byte 2399997"), "{err}");
        // A NUL past the first read is found where it is.
        let mut bytes = text.into_bytes();
        bytes[(1 << 20) + 5] = 0;
        std::fs::write(&path, &bytes).unwrap();
        let err = read_text(&path, FIFO_WAIT).unwrap_err().to_string();
        assert!(err.contains("a NUL byte at offset 1048581"), "{err}");
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.txt");
        let err = Dataset::load(missing.to_str().unwrap(), 0.1, 16)
            .err()
            .unwrap();
        assert!(matches!(err, DataError::Missing { .. }));
        let bin = dir.path().join("b.bin");
        std::fs::write(&bin, [0xffu8, 0xfe, 0x41].repeat(100)).unwrap();
        let err = Dataset::load(bin.to_str().unwrap(), 0.1, 16)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("looks binary") && err.contains("UTF-8"),
            "{err}"
        );
    }

    #[test]
    fn a_fifo_corpus_without_a_writer_is_an_error_after_the_wait_and_with_one_it_reads() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("corpus.fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t0 = std::time::Instant::now();
        let err = read_text(&fifo, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(err.contains("FIFO") && err.contains("writer"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, "to be or not to be\n".repeat(100)))
        };
        let text = read_text(&fifo, Duration::from_secs(5)).unwrap();
        writer.join().unwrap().unwrap();
        assert_eq!(text.len(), 1900);
    }
}
