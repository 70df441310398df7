//! Where a run's sockets live: one private directory per user, one socket per run.
//!
//! `$HEADROOM_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/headroom`, else `headroom-<uid>` under
//! the temp dir. The directory must be this user's and closed to everyone else (0700): a
//! socket in a directory others can enter could be replaced by theirs. A run's socket is
//! `<name>-<pid>.sock` and, when it also listens on TCP, its token `<name>-<pid>.token`
//! (0600), so `headroom ls` can name every run from the directory alone.
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Socket paths are limited to 108 bytes (`sun_path`); names are cut to keep under it.
const SUN_PATH_MAX: usize = 107;

pub fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The directory, created 0700 if missing; refused (with why) when it is not private.
pub fn dir() -> io::Result<PathBuf> {
    let dir = location();
    let mut b = fs::DirBuilder::new();
    b.recursive(true).mode(0o700);
    b.create(&dir).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot create the runtime directory {}: {e}", dir.display()),
        )
    })?;
    check_private(&dir)?;
    Ok(dir)
}

fn location() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("HEADROOM_RUNTIME_DIR") {
        return d;
    }
    if let Some(d) = env("XDG_RUNTIME_DIR") {
        return d.join("headroom");
    }
    std::env::temp_dir().join(format!("headroom-{}", uid()))
}

/// Ours and closed to others: anything else could let another user swap a socket.
fn check_private(dir: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(dir)?;
    let why = if !meta.is_dir() {
        Some("it is not a directory".to_string())
    } else if meta.uid() != uid() {
        Some(format!(
            "it belongs to uid {}, not to you ({})",
            meta.uid(),
            uid()
        ))
    } else if meta.mode() & 0o077 != 0 {
        Some(format!(
            "others can enter it (mode {:o})",
            meta.mode() & 0o777
        ))
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the runtime directory {} is not private: {why}; fix with `chmod 700` (or \
                 point HEADROOM_RUNTIME_DIR at a directory of your own)",
                dir.display()
            ),
        )),
    }
}

/// A run name made safe for a file name: letters, digits, `-`, `_`, `.`.
fn file_stem(name: &str, pid: u32, dir: &Path) -> String {
    let mut clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let room = SUN_PATH_MAX.saturating_sub(dir.as_os_str().len() + format!("/-{pid}.token").len());
    // A torchrun rank's `.rankR` is kept whole when the name is cut (the job's id before it
    // is cut instead): `headroom ls` reads a dead rank's rank from its file name alone.
    let tail = rank_suffix(&clean).map_or(0, str::len);
    if clean.len() > room.max(1) && room > tail {
        let suffix = clean.split_off(clean.len() - tail);
        clean.truncate(room - tail);
        clean.push_str(&suffix);
    } else {
        clean.truncate(room.max(1));
    }
    format!("{clean}-{pid}")
}

/// `.rankR` at the end of a torchrun rank's name.
fn rank_suffix(name: &str) -> Option<&str> {
    let (_, last) = name.rsplit_once('.')?;
    let digits = last.strip_prefix("rank")?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| &name[name.len() - last.len() - 1..])
}

/// A run's socket and token paths in `dir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPaths {
    pub socket: PathBuf,
    pub token: PathBuf,
}

pub fn paths(dir: &Path, name: &str, pid: u32) -> RunPaths {
    let stem = file_stem(name, pid, dir);
    RunPaths {
        socket: dir.join(format!("{stem}.sock")),
        token: dir.join(format!("{stem}.token")),
    }
}

/// The pid a socket's name ends with.
pub fn pid_of(socket: &Path) -> Option<u32> {
    let stem = socket.file_stem()?.to_str()?;
    stem.rsplit_once('-')?.1.parse().ok()
}

/// The run name a socket's name starts with.
pub fn name_of(socket: &Path) -> Option<String> {
    let stem = socket.file_stem()?.to_str()?;
    Some(stem.rsplit_once('-')?.0.to_string())
}

/// Every socket in the directory, oldest name first.
pub fn sockets(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    out.sort();
    Ok(out)
}

/// Removes a dead run's socket and token.
pub fn remove_run(socket: &Path) {
    let _ = fs::remove_file(socket);
    let _ = fs::remove_file(socket.with_extension("token"));
}

/// A fresh random token (256 bits, hex), written 0600 to `path`.
pub fn write_token(path: &Path) -> io::Result<String> {
    let mut bytes = [0u8; 32];
    io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut bytes)?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let _ = fs::remove_file(path);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    io::Write::write_all(&mut f, format!("{token}\n").as_bytes())?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    Ok(token)
}

/// Reads a token file (whitespace trimmed); refuses one others can read.
pub fn read_token(path: &Path) -> io::Result<String> {
    let meta = fs::metadata(path)
        .map_err(|e| io::Error::new(e.kind(), format!("token file {}: {e}", path.display())))?;
    if meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "token file {} can be read by others (mode {:o}): `chmod 600` it",
                path.display(),
                meta.mode() & 0o777
            ),
        ));
    }
    let text = fs::read_to_string(path)?;
    let token = text.trim().to_string();
    if token.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("token file {} is empty", path.display()),
        ));
    }
    Ok(token)
}

/// Compares tokens in time that does not depend on where they differ.
pub fn same_token(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a process with this pid exists (it may be another user's).
pub fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the pid exists and may be signalled.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_made_safe_and_read_back() {
        let dir = Path::new("/run/user/1000/headroom");
        let p = paths(dir, "my run/../x", 4242);
        assert_eq!(p.socket, dir.join("my_run_.._x-4242.sock"));
        assert_eq!(pid_of(&p.socket), Some(4242));
        assert_eq!(name_of(&p.socket).as_deref(), Some("my_run_.._x"));
        let long = paths(dir, &"n".repeat(300), 1);
        assert!(long.token.as_os_str().len() <= SUN_PATH_MAX, "{long:?}");
    }

    #[test]
    fn a_cut_ranks_name_keeps_its_rank() {
        let dir = Path::new("/tmp/pytest-of-root/pytest-12/test_attach_shows_every_rank0/rt");
        let name = format!(
            "nanogpt-ddp.{}.rank13",
            "f25e1467-f8d7-4e6c-924e-d8214241b2c6"
        );
        let p = paths(dir, &name, 4242);
        assert!(p.token.as_os_str().len() <= SUN_PATH_MAX, "{p:?}");
        let stem = name_of(&p.socket).unwrap();
        assert!(stem.len() < name.len(), "cut: {stem}");
        assert!(
            stem.starts_with("nanogpt-ddp.f25e") && stem.ends_with(".rank13"),
            "{stem}"
        );
        assert_eq!(pid_of(&p.socket), Some(4242));
    }

    #[test]
    fn a_directory_others_can_enter_is_refused_with_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("rt");
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        let e = check_private(&d).unwrap_err().to_string();
        assert!(e.contains("mode 755") && e.contains("chmod 700"), "{e}");
        fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
        check_private(&d).unwrap();
    }

    #[test]
    fn tokens_are_private_and_compared_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("t.token");
        let t = write_token(&p).unwrap();
        assert_eq!(t.len(), 64);
        assert_eq!(read_token(&p).unwrap(), t);
        assert!(same_token(&t, &t.clone()));
        assert!(!same_token(&t, &t[..63]));
        fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_token(&p)
            .unwrap_err()
            .to_string()
            .contains("chmod 600"));
    }
}
