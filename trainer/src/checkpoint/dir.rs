//! The checkpoint root as a place: claimed by one run at a time (its lock), found among
//! its siblings, measured for room, and pruned to the newest checkpoints.
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::{locate, CheckpointError, LATEST, STATE_FILE, TMP_PREFIX};

/// Creates `root` if needed and proves a file can be written there, so a bad
/// --checkpoint-dir fails before training instead of at the first save.
pub fn check_writable(root: &Path) -> Result<(), CheckpointError> {
    let err = |e: std::io::Error| CheckpointError::NotWritable {
        root: root.to_path_buf(),
        reason: e.to_string(),
    };
    if root.exists() && !root.is_dir() {
        return Err(CheckpointError::NotWritable {
            root: root.to_path_buf(),
            reason: "it is a file, not a directory".into(),
        });
    }
    fs::create_dir_all(root).map_err(err)?;
    let probe = root.join(format!(".write-probe-{}", std::process::id()));
    File::create(&probe)
        .and_then(|mut f| f.write_all(b"ok"))
        .map_err(err)?;
    fs::remove_file(&probe).map_err(err)?;
    Ok(())
}

const LOCK_FILE: &str = ".lock";

/// A checkpoint directory held by this run: an exclusive `flock` on `<root>/.lock`, kept
/// for the run's life and released by the kernel however the process ends. A directory
/// this claim created and that holds nothing but the lock when the claim is dropped
/// (the run failed before its first save) is removed again.
pub struct DirLock {
    _file: File,
    root: PathBuf,
    created: bool,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        if !self.created {
            return;
        }
        let only_lock = fs::read_dir(&self.root).is_ok_and(|entries| {
            entries
                .flatten()
                .all(|e| e.file_name() == std::ffi::OsStr::new(LOCK_FILE))
        });
        if only_lock {
            let _ = fs::remove_file(self.root.join(LOCK_FILE));
            let _ = fs::remove_dir(&self.root);
        }
    }
}

/// Takes `root` for this run. `adopt`: the run continues the checkpoints already there
/// (a resume from this directory); otherwise checkpoints there belong to another run and
/// are refused, or with `overwrite` deleted (their names are returned, to be said).
pub fn claim(
    root: &Path,
    adopt: bool,
    overwrite: bool,
) -> Result<(DirLock, Vec<String>), CheckpointError> {
    let created = !root.exists();
    check_writable(root)?;
    let not_writable = |e: std::io::Error| CheckpointError::NotWritable {
        root: root.to_path_buf(),
        reason: e.to_string(),
    };
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(root.join(LOCK_FILE))
        .map_err(not_writable)?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on the descriptor `file` owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "its lock is held".to_string(),
            pid => format!("pid {pid}"),
        };
        return Err(CheckpointError::InUse {
            root: root.to_path_buf(),
            holder,
        });
    }
    let _ = file.set_len(0);
    let _ = write!(file, "{}", std::process::id());
    let lock = DirLock {
        _file: file,
        root: root.to_path_buf(),
        created,
    };
    let mut removed = Vec::new();
    if !adopt && has_checkpoints(root) {
        if !overwrite {
            let latest = latest_step_dir(root)
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "unreadable".into());
            return Err(CheckpointError::Occupied {
                root: root.to_path_buf(),
                latest,
            });
        }
        for entry in fs::read_dir(root).map_err(not_writable)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if parse_step_dir(&name).is_some() || name.starts_with(TMP_PREFIX) {
                fs::remove_dir_all(&path).map_err(not_writable)?;
                removed.push(name);
            } else if name == LATEST || name == format!("{LATEST}.tmp") {
                fs::remove_file(&path).map_err(not_writable)?;
            }
        }
        removed.sort();
    }
    Ok((lock, removed))
}

/// Whether a live run holds `root`'s lock (a probe that takes and drops a shared lock).
pub fn is_locked(root: &Path) -> bool {
    let Ok(file) = File::open(root.join(LOCK_FILE)) else {
        return false;
    };
    use std::os::fd::AsRawFd;
    // SAFETY: flock on the descriptor `file` owns; closing it releases the probe's lock.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) != 0 }
}

/// Where a run with no `--checkpoint-dir` goes: its default `root` when that holds no
/// other run, else the first free `root-2`, `root-3`, … (as Lightning's `version_N`), so
/// the README's command works every time and no run's checkpoints are touched. A
/// directory is taken when it holds checkpoints or a live run's lock.
pub fn next_free(root: &Path) -> PathBuf {
    let taken = |d: &Path| has_checkpoints(d) || is_locked(d);
    if !taken(root) {
        return root.to_path_buf();
    }
    let base = root.as_os_str().to_string_lossy().into_owned();
    (2u32..)
        .map(|n| PathBuf::from(format!("{base}-{n}")))
        .find(|d| !taken(d))
        .expect("some numbered directory is free")
}

/// A run directory under `parent` belonging to run `name`: `name` itself or `name-N`,
/// holding checkpoints; with the step it reached and when it was last saved.
#[derive(Debug, Clone, PartialEq)]
pub struct RunDir {
    pub root: PathBuf,
    pub step: Option<u64>,
    pub saved: std::time::SystemTime,
}

/// Every run directory of `name` under `parent` (see [`next_free`]), the most recently
/// saved first: what `--resume NAME` chooses from.
pub fn runs_named(parent: &Path, name: &str) -> Vec<RunDir> {
    let mut found: Vec<RunDir> = fs::read_dir(parent)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n == name
                || n.strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix('-'))
                    .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .filter(|root| root.is_dir() && has_checkpoints(root))
        .map(|root| {
            let latest = latest_step_dir(&root);
            let saved = latest
                .as_ref()
                .and_then(|d| fs::metadata(d.join(STATE_FILE)).ok())
                .and_then(|m| m.modified().ok())
                .unwrap_or(std::time::UNIX_EPOCH);
            let step = latest
                .as_ref()
                .and_then(|d| d.file_name())
                .and_then(|n| parse_step_dir(&n.to_string_lossy()));
            RunDir { root, step, saved }
        })
        .collect();
    found.sort_by(|a, b| b.saved.cmp(&a.saved).then_with(|| b.root.cmp(&a.root)));
    found
}

/// Whether `root` holds a checkpoint (a step directory or a `latest` file).
pub fn has_checkpoints(root: &Path) -> bool {
    root.join(LATEST).exists()
        || fs::read_dir(root).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| parse_step_dir(&e.file_name().to_string_lossy()).is_some())
        })
}

/// The step directory a resume from `root` would use, when there is one.
pub fn latest_step_dir(root: &Path) -> Option<PathBuf> {
    locate(root)
        .ok()
        .filter(|d| d.join(STATE_FILE).exists() && d != root)
}

/// Bytes free for an unprivileged writer on the file system holding `root`.
pub fn free_bytes(root: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(root.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid path and a zeroed statvfs for the call to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// About what one checkpoint of a model whose float32 parameters have these names and
/// shapes takes: the parameters and AdamW's two moments with their safetensors headers
/// (one JSON entry per tensor), and state.json (its fingerprint lists every tensor).
/// Within a few percent, above rather than below; where a checkpoint of the run exists,
/// [`size_on_disk`] is the exact figure.
pub fn estimated_size(shapes: &[(String, Vec<i64>)]) -> u64 {
    // `"NAME":{"dtype":"F32","shape":[…],"data_offsets":[…,…]},` and state.json's
    // pretty-printed `{ "name": "NAME", "shape": [ … ] }`: a dimension or an offset is at
    // most 12 characters written out.
    let header = |name: &str, dims: usize| (name.len() + 48 + 12 * (dims + 2)) as u64;
    let pretty = |name: &str, dims: usize| (name.len() + 64 + 16 * dims) as u64;
    let tensors: u64 = shapes
        .iter()
        .map(|(name, shape)| {
            let bytes = 4 * shape.iter().product::<i64>().max(0) as u64;
            3 * bytes
                + header(name, shape.len())
                + 2 * header(name, shape.len())
                + 4
                + pretty(name, shape.len())
        })
        .sum();
    // The two files' length prefixes, the optimizer's step, and state.json's other
    // fields (config, corpus record, controller journal): a few KiB.
    tensors + 2 * 8 + 64 + (8 << 10)
}

/// Bytes the files of one step directory take (what the next save of the same model
/// will write, to within the length of state.json).
pub fn size_on_disk(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Deletes every step directory but `keep` (and temporaries): room for a save that failed
/// for want of space, at the cost of older checkpoints, never of the newest one.
pub fn prune_all_but(root: &Path, keep: Option<&Path>) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = fs::read_dir(root) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let stale = parse_step_dir(&name).is_some() || name.starts_with(TMP_PREFIX);
        let kept = keep.is_some_and(|k| k.file_name() == path.file_name());
        if stale && !kept && fs::remove_dir_all(&path).is_ok() {
            removed.push(name);
        }
    }
    removed.sort();
    removed
}

/// The directory name of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The step a `step-NNNNNN` directory name holds.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    name.strip_prefix("step-")
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse().ok())
}
