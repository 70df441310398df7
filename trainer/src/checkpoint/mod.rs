//! Checkpoints: one directory per saved step under a checkpoint root.
//!
//! ```text
//! <root>/step-000120/model.safetensors      parameters (VarStore)
//! <root>/step-000120/optimizer.safetensors  AdamW moments and step counter
//! <root>/step-000120/state.json             format version, step, seed, tokens, config,
//!                                           model fingerprint, tensor-file checksums
//! <root>/latest                             "step-000120"
//! <root>/.lock                              flock'd by the run writing here (its pid)
//! ```
//!
//! A save never leaves a half-written checkpoint where a resume would find it: everything
//! goes into `<root>/.tmp-step-NNNNNN`, is fsynced, and the directory is renamed into
//! place; only then is `latest` replaced (write `latest.tmp`, rename). A crash at any point
//! leaves the previous checkpoint reachable, plus at most a `.tmp-*` directory that loading
//! ignores and the next save removes.
//!
//! The root as a place (its lock, its siblings, its room, pruning) is `dir.rs`'s.
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use headroom_core::RunConfig;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::journal::ControllerJournal;
use crate::model::Gpt;
use crate::optim::AdamW;

mod dir;

pub use dir::{
    check_writable, claim, estimated_size, free_bytes, has_checkpoints, is_locked, latest_step_dir,
    next_free, parse_step_dir, prune_all_but, runs_named, size_on_disk, step_dir_name, DirLock,
    RunDir,
};

/// Bumped when the layout changes incompatibly; a build refuses newer checkpoints.
pub const FORMAT_VERSION: u32 = 1;
/// How many step directories a save leaves behind.
pub const KEEP: usize = 2;

const MODEL_FILE: &str = "model.safetensors";
const OPTIM_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const LATEST: &str = "latest";
const TMP_PREFIX: &str = ".tmp-";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamShape {
    pub name: String,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    pub seed: u64,
    pub tokens_seen: u64,
    pub config: RunConfig,
    /// Every parameter's name and shape.
    pub model: Vec<ParamShape>,
    /// The micro-batch the controller had settled on, so a resumed run starts there
    /// instead of relearning it (absent in checkpoints from before the controller).
    #[serde(default)]
    pub micro_batch: Option<usize>,
    /// A digest of each tensor file ([`digest_file`]), checked before the file is read:
    /// safetensors carries no checksum of its own, so a flipped or zeroed byte in a
    /// tensor would otherwise load as a silently wrong weight. Filled in by [`save`];
    /// absent in older checkpoints, which load unchecked.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checksums: BTreeMap<String, String>,
    /// Where the corpus was and what it held, so a resume from another directory finds
    /// it and a changed corpus is noticed (absent in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corpus: Option<CorpusRecord>,
    /// How the memory controller was built and every call that changed it, so a resume
    /// continues with the state the uninterrupted run's controller had (absent in older
    /// checkpoints, which resume with a fresh controller at `micro_batch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<ControllerJournal>,
}

/// The corpus a run trains on, as a checkpoint remembers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorpusRecord {
    /// Absolute path when the run started; empty for the bundled corpus.
    pub path: String,
    /// [`crate::digest::digest_bytes`] of its content.
    pub digest: String,
    pub bytes: u64,
}

impl CheckpointState {
    pub fn new(
        step: u64,
        tokens_seen: u64,
        config: &RunConfig,
        model: &Gpt,
        micro_batch: usize,
    ) -> Self {
        CheckpointState {
            format_version: FORMAT_VERSION,
            step,
            seed: config.run.seed,
            tokens_seen,
            config: config.clone(),
            model: fingerprint(model),
            micro_batch: Some(micro_batch),
            checksums: BTreeMap::new(),
            corpus: None,
            controller: None,
        }
    }

    pub fn with_corpus(mut self, corpus: Option<CorpusRecord>) -> Self {
        self.corpus = corpus;
        self
    }

    pub fn with_controller(mut self, journal: Option<ControllerJournal>) -> Self {
        self.controller = journal;
        self
    }
}

fn fingerprint(model: &Gpt) -> Vec<ParamShape> {
    model
        .fingerprint()
        .into_iter()
        .map(|(name, shape)| ParamShape { name, shape })
        .collect()
}

#[derive(Debug, Clone, PartialEq)]
pub enum CheckpointError {
    /// The checkpoint root cannot be created or written.
    NotWritable {
        root: PathBuf,
        reason: String,
    },
    /// Writing a checkpoint failed part-way (the previous one is intact).
    Write {
        path: PathBuf,
        reason: String,
    },
    Missing {
        path: PathBuf,
    },
    NotACheckpoint {
        path: PathBuf,
    },
    Incomplete {
        dir: PathBuf,
        file: String,
    },
    Corrupt {
        file: PathBuf,
        reason: String,
    },
    NewerFormat {
        dir: PathBuf,
        found: u64,
    },
    ModelMismatch {
        dir: PathBuf,
        detail: String,
    },
    /// Another run holds the directory's lock.
    InUse {
        root: PathBuf,
        holder: String,
    },
    /// A fresh run would replace another run's checkpoints.
    Occupied {
        root: PathBuf,
        latest: String,
    },
    /// Not enough free space for even one checkpoint.
    NoRoom {
        root: PathBuf,
        free: u64,
        needed: u64,
    },
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const OTHER: &str = "resume from another step-NNNNNN directory or start a fresh run";
        match self {
            CheckpointError::NotWritable { root, reason } => write!(
                f,
                "cannot write checkpoints to {}: {reason}; choose another --checkpoint-dir",
                root.display()
            ),
            CheckpointError::Write { path, reason } => write!(
                f,
                "writing checkpoint {} failed: {reason}; check free space and permissions of \
                 the --checkpoint-dir (the previous checkpoint is intact)",
                path.display()
            ),
            CheckpointError::Missing { path } => write!(
                f,
                "checkpoint {} does not exist; check the path given to --resume",
                path.display()
            ),
            CheckpointError::NotACheckpoint { path } => write!(
                f,
                "{} is not a headroom checkpoint (no {STATE_FILE}, no {LATEST} file, no \
                 step-NNNNNN directory); pass a checkpoint directory or one of its \
                 step-NNNNNN directories to --resume",
                path.display()
            ),
            CheckpointError::Incomplete { dir, file } => write!(
                f,
                "checkpoint {} is incomplete: {file} is missing; {OTHER}",
                dir.display()
            ),
            CheckpointError::Corrupt { file, reason } => write!(
                f,
                "checkpoint file {} is truncated or corrupt ({reason}); {OTHER}",
                file.display()
            ),
            CheckpointError::NewerFormat { dir, found } => write!(
                f,
                "checkpoint {} was written by a newer headroom (format {found}; this build \
                 reads format {FORMAT_VERSION}); upgrade headroom to resume it",
                dir.display()
            ),
            CheckpointError::InUse { root, holder } => write!(
                f,
                "checkpoint directory {} is in use by another headroom run ({holder}); wait \
                 for it to end, or give this run its own --checkpoint-dir",
                root.display()
            ),
            CheckpointError::Occupied { root, latest } => write!(
                f,
                "checkpoint directory {} already holds another run's checkpoints (latest: \
                 {latest}); continue that run with --resume {}, start this one elsewhere with \
                 --checkpoint-dir DIR (or another run.name), or pass --overwrite to delete them",
                root.display(),
                root.display()
            ),
            CheckpointError::NoRoom { root, free, needed } => write!(
                f,
                "checkpoint directory {} has {} free, and one checkpoint of this model needs \
                 about {}; free some space or choose another --checkpoint-dir",
                root.display(),
                headroom_core::units::fmt_bytes(*free),
                headroom_core::units::fmt_bytes(*needed)
            ),
            CheckpointError::ModelMismatch { dir, detail } => write!(
                f,
                "checkpoint {} is for a different model: {detail}; resume with the \
                 checkpoint's own model settings, or start a fresh run in another \
                 --checkpoint-dir",
                dir.display()
            ),
        }
    }
}

impl std::error::Error for CheckpointError {}

/// Writes a checkpoint of `model` and `opt` under `root` atomically, points `latest` at
/// it and prunes all but the [`KEEP`] newest. Returns the step directory.
pub fn save(
    root: &Path,
    model: &Gpt,
    opt: &AdamW,
    state: &CheckpointState,
) -> Result<PathBuf, CheckpointError> {
    let name = step_dir_name(state.step);
    let tmp = root.join(format!("{TMP_PREFIX}{name}"));
    let dir = root.join(&name);
    let werr = |path: &Path, e: &dyn fmt::Display| CheckpointError::Write {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };

    fs::create_dir_all(root).map_err(|e| werr(root, &e))?;
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| werr(&tmp, &e))?;
    }
    fs::create_dir(&tmp).map_err(|e| werr(&tmp, &e))?;

    let write_all = || -> Result<(), CheckpointError> {
        let model_path = tmp.join(MODEL_FILE);
        model
            .var_store()
            .save(&model_path)
            .map_err(|e| werr(&model_path, &e))?;
        let optim_path = tmp.join(OPTIM_FILE);
        Tensor::write_safetensors(&opt.state_tensors(), &optim_path)
            .map_err(|e| werr(&optim_path, &e))?;
        let mut state = state.clone();
        for (file, path) in [(MODEL_FILE, &model_path), (OPTIM_FILE, &optim_path)] {
            let sum = digest_file(path).map_err(|e| werr(path, &e))?;
            state.checksums.insert(file.into(), sum);
        }
        let state_path = tmp.join(STATE_FILE);
        let json = serde_json::to_vec_pretty(&state).map_err(|e| werr(&state_path, &e))?;
        fs::write(&state_path, json).map_err(|e| werr(&state_path, &e))?;
        for file in [&model_path, &optim_path, &state_path] {
            fsync(file).map_err(|e| werr(file, &e))?;
        }
        fsync(&tmp).map_err(|e| werr(&tmp, &e))
    };
    if let Err(e) = write_all() {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    // rename(2) cannot replace a non-empty directory. The target exists when a step is
    // saved twice (a resumed run passing a step it saved before): swap the two atomically,
    // so `latest` never names a missing directory, then drop the old one, now at `tmp`.
    if dir.exists() {
        exchange(&tmp, &dir).map_err(|e| werr(&dir, &e))?;
        let _ = fs::remove_dir_all(&tmp);
    } else {
        fs::rename(&tmp, &dir).map_err(|e| werr(&dir, &e))?;
    }

    let latest_tmp = root.join(format!("{LATEST}.tmp"));
    fs::write(&latest_tmp, format!("{name}\n")).map_err(|e| werr(&latest_tmp, &e))?;
    fsync(&latest_tmp).map_err(|e| werr(&latest_tmp, &e))?;
    fs::rename(&latest_tmp, root.join(LATEST)).map_err(|e| werr(&latest_tmp, &e))?;
    fsync(root).map_err(|e| werr(root, &e))?;

    prune(root, &name);
    Ok(dir)
}

/// Swaps two directories in one step (`renameat2(RENAME_EXCHANGE)`). Where the file
/// system cannot, falls back to delete-then-rename, whose gap a crash must hit exactly.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths, relative to the current directory.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            fs::remove_dir_all(b)?;
            fs::rename(a, b)
        }
        _ => Err(err),
    }
}

fn fsync(path: &Path) -> std::io::Result<()> {
    File::open(path)?.sync_all()
}

/// Deletes step directories beyond the [`KEEP`] newest and stale temp directories.
/// Failures are ignored: a leftover directory wastes disk, nothing more.
fn prune(root: &Path, current: &str) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    let mut steps = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir(&name) {
            steps.push((step, entry.path()));
        } else if name.starts_with(TMP_PREFIX) && entry.path().is_dir() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(KEEP);
    for (_, path) in steps.into_iter().take(excess) {
        if path.file_name().is_some_and(|n| n != current) {
            let _ = fs::remove_dir_all(path);
        }
    }
}

/// A checkpoint found on disk, its state read and checked; tensors not loaded yet.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: CheckpointState,
}

/// Finds the checkpoint at `path`: a step directory, or a root (through `latest`, or its
/// newest step directory when `latest` is gone), and reads its state.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let dir = locate(path)?;
    let state = read_state(&dir)?;
    Ok(Checkpoint { dir, state })
}

/// The checkpoint root a `--resume` path belongs to: the path itself, or the parent of a
/// step directory.
pub fn root_of(path: &Path) -> &Path {
    if path.join(STATE_FILE).exists() {
        path.parent().unwrap_or(path)
    } else {
        path
    }
}

fn locate(path: &Path) -> Result<PathBuf, CheckpointError> {
    if !path.exists() {
        return Err(CheckpointError::Missing {
            path: path.to_path_buf(),
        });
    }
    if path.join(STATE_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    if latest.exists() {
        let name = fs::read_to_string(&latest).map_err(|e| CheckpointError::Corrupt {
            file: latest.clone(),
            reason: e.to_string(),
        })?;
        let name = name.trim();
        if parse_step_dir(name).is_none() {
            return Err(CheckpointError::Corrupt {
                file: latest,
                reason: format!("'{name}' is not a step-NNNNNN name"),
            });
        }
        let dir = path.join(name);
        if !dir.is_dir() {
            return Err(CheckpointError::Incomplete {
                dir: path.to_path_buf(),
                file: name.to_string(),
            });
        }
        return Ok(dir);
    }
    // Only step directories were renamed into place completely; temp ones are skipped.
    let newest = fs::read_dir(path)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            parse_step_dir(&name).map(|s| (s, e.path()))
        })
        .filter(|(_, p)| p.is_dir())
        .max();
    match newest {
        Some((_, dir)) => Ok(dir),
        None if path.join(MODEL_FILE).exists() => Err(CheckpointError::Incomplete {
            dir: path.to_path_buf(),
            file: STATE_FILE.into(),
        }),
        None => Err(CheckpointError::NotACheckpoint {
            path: path.to_path_buf(),
        }),
    }
}

fn read_state(dir: &Path) -> Result<CheckpointState, CheckpointError> {
    let file = dir.join(STATE_FILE);
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: file.clone(),
        reason,
    };
    let bytes = match fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::Incomplete {
                dir: dir.to_path_buf(),
                file: STATE_FILE.into(),
            })
        }
        Err(e) => return Err(corrupt(e.to_string())),
    };
    // The version first: a newer format may not parse as this one, and "upgrade" is the
    // right advice then, not "corrupt".
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("invalid JSON: {e}")))?;
    let version = value
        .get("format_version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| corrupt("no format_version".into()))?;
    if version > u64::from(FORMAT_VERSION) {
        return Err(CheckpointError::NewerFormat {
            dir: dir.to_path_buf(),
            found: version,
        });
    }
    serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))
}

impl Checkpoint {
    /// Fails, naming the first differing parameter, unless `model` has exactly the
    /// parameters (names and shapes) this checkpoint was written for.
    pub fn verify_model(&self, model: &Gpt) -> Result<(), CheckpointError> {
        let mismatch = |detail: String| CheckpointError::ModelMismatch {
            dir: self.dir.clone(),
            detail,
        };
        let ours: HashMap<String, Vec<i64>> = model.fingerprint().into_iter().collect();
        let theirs: HashMap<&str, &Vec<i64>> = self
            .state
            .model
            .iter()
            .map(|p| (p.name.as_str(), &p.shape))
            .collect();
        let mut names: Vec<&String> = ours.keys().collect();
        names.sort();
        for name in names {
            match theirs.get(name.as_str()) {
                None => {
                    return Err(mismatch(format!(
                        "this model's parameter {name} is not in the checkpoint"
                    )))
                }
                Some(shape) if **shape != ours[name] => {
                    return Err(mismatch(format!(
                        "parameter {name} has shape {:?} in the checkpoint but {:?} here",
                        shape, ours[name]
                    )))
                }
                Some(_) => {}
            }
        }
        if let Some(extra) = self
            .state
            .model
            .iter()
            .find(|p| !ours.contains_key(&p.name))
        {
            return Err(mismatch(format!(
                "the checkpoint's parameter {} is not in this model",
                extra.name
            )));
        }
        Ok(())
    }

    /// Loads parameters and optimizer state into `model` and `opt` (after
    /// [`Checkpoint::verify_model`]). Every tensor is read and checked before any is copied.
    pub fn restore(&self, model: &Gpt, opt: &mut AdamW) -> Result<(), CheckpointError> {
        self.verify_model(model)?;
        let (params, model_sum) = self.read_tensors(MODEL_FILE)?;
        let model_file = self.dir.join(MODEL_FILE);
        let corrupt = |file: &Path, reason: String| CheckpointError::Corrupt {
            file: file.to_path_buf(),
            reason,
        };
        let mut pairs = Vec::new();
        for (name, param) in model.named_parameters() {
            let src = params
                .get(&name)
                .ok_or_else(|| corrupt(&model_file, format!("it lacks parameter {name}")))?;
            if src.size() != param.size() {
                return Err(corrupt(
                    &model_file,
                    format!(
                        "parameter {name} has shape {:?}, state.json says {:?}",
                        src.size(),
                        param.size()
                    ),
                ));
            }
            pairs.push((param, src));
        }
        // After the shapes: a file from another model is better named by its first
        // differing parameter than by its checksum.
        if let Some(reason) = model_sum {
            return Err(corrupt(&model_file, reason));
        }
        let (optim, optim_sum) = self.read_tensors(OPTIM_FILE)?;
        let optim_file = self.dir.join(OPTIM_FILE);
        if let Some(reason) = optim_sum {
            return Err(corrupt(&optim_file, reason));
        }
        let optim: Vec<(String, Tensor)> = optim.into_iter().collect();
        opt.load_state(&optim)
            .map_err(|e| corrupt(&optim_file, e.to_string()))?;
        let _guard = tch::no_grad_guard();
        for (mut param, src) in pairs {
            src.f_to_kind(param.kind())
                .and_then(|s| param.f_copy_(&s))
                .map_err(|e| corrupt(&model_file, e.to_string()))?;
        }
        Ok(())
    }

    /// The tensors of `file`, and why its checksum does not match (when it does not).
    fn read_tensors(
        &self,
        file: &str,
    ) -> Result<(HashMap<String, Tensor>, Option<String>), CheckpointError> {
        let path = self.dir.join(file);
        if !path.exists() {
            return Err(CheckpointError::Incomplete {
                dir: self.dir.clone(),
                file: file.into(),
            });
        }
        let corrupt = |reason: String| CheckpointError::Corrupt {
            file: path.clone(),
            reason,
        };
        let mut mismatch = None;
        if let Some(want) = self.state.checksums.get(file) {
            let found = digest_file(&path).map_err(|e| corrupt(e.to_string()))?;
            if found != *want {
                mismatch = Some(format!(
                    "its checksum is {found}, {STATE_FILE} recorded {want}"
                ));
            }
        }
        let tensors = Tensor::read_safetensors(&path).map_err(|e| corrupt(e.to_string()))?;
        Ok((tensors.into_iter().collect(), mismatch))
    }
}

pub use crate::digest::digest_file;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_sees_every_byte_and_the_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..(3 << 20) + 45).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let base = digest_file(&path).unwrap();
        assert!(base.starts_with("h64:") && base.len() == 20, "{base}");
        assert_eq!(digest_file(&path).unwrap(), base, "deterministic");
        for at in [0, 31, 32, 1 << 20, (1 << 20) + 7, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            std::fs::write(&path, &b).unwrap();
            assert_ne!(digest_file(&path).unwrap(), base, "byte {at}");
        }
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert_ne!(digest_file(&path).unwrap(), base, "truncated");
        let mut longer = bytes.clone();
        longer.push(0);
        std::fs::write(&path, &longer).unwrap();
        assert_ne!(digest_file(&path).unwrap(), base, "zero appended");
    }

    #[test]
    fn a_taken_default_directory_gives_the_next_free_number() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("default");
        assert_eq!(next_free(&root), root, "a fresh name is its own directory");
        let fake_checkpoint = |d: &Path, step: u64| {
            fs::create_dir_all(d.join(step_dir_name(step))).unwrap();
            fs::write(d.join(step_dir_name(step)).join(STATE_FILE), "{}").unwrap();
            fs::write(d.join(LATEST), step_dir_name(step)).unwrap();
        };
        fake_checkpoint(&root, 40);
        let second = tmp.path().join("default-2");
        assert_eq!(next_free(&root), second);
        // A live run's lock takes a directory before its first checkpoint.
        let (held, _) = claim(&second, false, false).unwrap();
        assert!(is_locked(&second));
        assert_eq!(next_free(&root), tmp.path().join("default-3"));
        drop(held);
        assert!(!is_locked(&second));
        assert_eq!(
            next_free(&root),
            second,
            "the empty directory went with its claim"
        );
        fake_checkpoint(&tmp.path().join("default-3"), 7);
        fake_checkpoint(&tmp.path().join("defaults"), 9);
        let runs = runs_named(tmp.path(), "default");
        let roots: Vec<_> = runs.iter().map(|r| r.root.clone()).collect();
        assert_eq!(
            roots.len(),
            2,
            "not 'defaults', not the empty default-2: {roots:?}"
        );
        assert!(roots.contains(&root) && roots.contains(&tmp.path().join("default-3")));
        assert!(runs[0].saved >= runs[1].saved, "newest first");
        let steps: Vec<_> = runs.iter().map(|r| (r.root.clone(), r.step)).collect();
        assert!(steps.contains(&(root.clone(), Some(40))), "{steps:?}");
    }

    #[test]
    fn step_dir_names_round_trip() {
        assert_eq!(step_dir_name(120), "step-000120");
        assert_eq!(parse_step_dir("step-000120"), Some(120));
        assert_eq!(parse_step_dir("step-1234567"), Some(1_234_567));
        assert_eq!(parse_step_dir(".tmp-step-000120"), None);
        assert_eq!(parse_step_dir("step-"), None);
        assert_eq!(parse_step_dir("step-12a"), None);
    }

    #[test]
    fn unwritable_root_names_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let err = check_writable(&file.join("ck")).unwrap_err().to_string();
        assert!(
            err.contains("--checkpoint-dir") && err.contains("file/ck"),
            "{err}"
        );
        check_writable(&dir.path().join("a/b")).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path().join("a/b")).unwrap().count(),
            0
        );
    }

    #[test]
    fn missing_and_foreign_directories() {
        let dir = tempfile::tempdir().unwrap();
        let err = load(&dir.path().join("nowhere")).unwrap_err().to_string();
        assert!(
            err.contains("does not exist") && err.contains("nowhere"),
            "{err}"
        );
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a headroom checkpoint"), "{err}");
    }
}
