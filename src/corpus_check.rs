//! The corpus path, checked at start-up, before the log is opened and the trainer (its
//! libtorch threads, the device, the dashboard) starts: what is wrong with it is named in
//! one line with the fix. The trainer's loader only saw the OS's bare error ("Not a
//! directory (os error 20); check its permissions") for the path as a whole, and called a
//! dangling symbolic link a corpus that "does not exist". What is in a readable file
//! (text or not, empty, too small) stays the loader's to say: reading it is its job.
use std::io::ErrorKind;
use std::path::{Component, Path, PathBuf};

/// Checks that `path` leads to a readable file. `given`: how the user gave it, for the
/// fix (`--corpus`, `data.corpus in run.toml`); `resuming`: the run continues a
/// checkpoint, which trains on its own text only (the bundled one would be refused).
pub fn check(path: &Path, given: &str, resuming: bool) -> Result<(), String> {
    let shown = path.display();
    let fix = if resuming {
        "pass --corpus with the path where the checkpoint's text is now (a different text \
         also needs --allow-changed-corpus)"
            .to_string()
    } else {
        format!("fix {given} (or leave it empty for the bundled tinyshakespeare)")
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => return Err(unreachable(path, &e, &fix)),
    };
    if meta.is_dir() {
        return Err(directory(path, given));
    }
    if !meta.is_file() {
        // A FIFO or a device: opening one may wait for a writer; the loader does that.
        return Ok(());
    }
    match std::fs::File::open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::PermissionDenied => Err(format!(
            "cannot read corpus {shown}: permission denied (mode {:o}); make it readable \
             (chmod a+r) or {fix}",
            mode(&meta)
        )),
        Err(e) => Err(format!("cannot read corpus {shown}: {e}; {fix}")),
    }
}

/// Why `path` cannot be reached: the component that stops it, named.
fn unreachable(path: &Path, e: &std::io::Error, fix: &str) -> String {
    let shown = path.display();
    if let Ok(link) = std::fs::symlink_metadata(path) {
        if link.file_type().is_symlink() && e.kind() == ErrorKind::NotFound {
            let target = std::fs::read_link(path).unwrap_or_default();
            return format!(
                "corpus {shown} is a symbolic link to {}, which does not exist; point the link \
                 at the text file, or {fix}",
                target.display()
            );
        }
    }
    if e.raw_os_error() == Some(libc::ELOOP) {
        return format!("corpus {shown}: its symbolic links lead round in a loop; {fix}");
    }
    match first_blocking(path) {
        Some((at, Blocked::File)) => format!(
            "corpus {shown} cannot exist: {} is a file, not a directory; {fix}",
            at.display()
        ),
        Some((at, Blocked::Missing)) if at == path => {
            format!("corpus {shown} does not exist; {fix}")
        }
        Some((at, Blocked::Missing)) => format!(
            "corpus {shown} does not exist: there is no directory {}; {fix}",
            at.display()
        ),
        Some((at, Blocked::NoSearch)) => format!(
            "cannot reach corpus {shown}: no permission to enter the directory {}; give this \
             user access to it (chmod a+x) or {fix}",
            at.display()
        ),
        None => format!("cannot read corpus {shown}: {e}; {fix}"),
    }
}

enum Blocked {
    Missing,
    File,
    NoSearch,
}

/// The first leading part of `path` that is not a directory one can pass through.
fn first_blocking(path: &Path) -> Option<(PathBuf, Blocked)> {
    let mut at = PathBuf::new();
    let parts: Vec<Component> = path.components().collect();
    for (i, part) in parts.iter().enumerate() {
        at.push(part);
        let last = i + 1 == parts.len();
        match std::fs::metadata(&at) {
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                return Some((at.parent()?.to_path_buf(), Blocked::NoSearch))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                return Some((at.parent()?.to_path_buf(), Blocked::File))
            }
            Err(_) => return Some((at, Blocked::Missing)),
            Ok(m) if !m.is_dir() && !last => return Some((at, Blocked::File)),
            Ok(_) => {}
        }
    }
    None
}

/// A directory given as the corpus: what it holds, and how to make one file of it.
fn directory(path: &Path, given: &str) -> String {
    let shown = path.display();
    let head = format!("corpus {shown} is a directory; pass a text file to {given}");
    let entries = match std::fs::read_dir(path) {
        Ok(e) => e,
        Err(e) => return format!("{head} (the directory itself cannot be listed: {e})"),
    };
    let mut files: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    match files.len() {
        0 => format!("{head} (it holds no files)"),
        n => {
            let some = files.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
            let more = if n > 3 { ", …" } else { "" };
            format!(
                "{head}: one of its {n} file(s) ({some}{more}), or all of them joined into \
                 one (cat {shown}/* > corpus.txt)"
            )
        }
    }
}

fn mode(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    meta.permissions().mode() & 0o7777
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_way_a_path_fails_names_the_part_that_stops_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("notes.txt"), "text").unwrap();
        std::os::unix::fs::symlink(d.join("gone.txt"), d.join("link.txt")).unwrap();
        std::os::unix::fs::symlink(d.join("loop-b"), d.join("loop-a")).unwrap();
        std::os::unix::fs::symlink(d.join("loop-a"), d.join("loop-b")).unwrap();
        std::fs::create_dir(d.join("empty")).unwrap();
        let given = "data.corpus in run.toml";
        let err = |p: PathBuf| check(&p, given, false).unwrap_err();
        let e = err(d.join("notes.txt/train.txt"));
        assert!(e.contains("notes.txt is a file, not a directory"), "{e}");
        let e = err(d.join("missing/train.txt"));
        assert!(
            e.contains("there is no directory") && e.contains("missing"),
            "{e}"
        );
        let e = err(d.join("absent.txt"));
        assert!(
            e.contains("absent.txt does not exist; fix data.corpus in run.toml"),
            "{e}"
        );
        let e = err(d.join("link.txt"));
        assert!(
            e.contains("symbolic link to") && e.contains("gone.txt"),
            "{e}"
        );
        let e = err(d.join("loop-a"));
        assert!(e.contains("loop"), "{e}");
        let e = err(d.join("empty"));
        assert!(
            e.contains("is a directory; pass a text file to data.corpus"),
            "{e}"
        );
        assert!(e.contains("holds no files"), "{e}");
        assert!(check(&d.join("notes.txt"), given, false).is_ok());
        // A resume trains on its checkpoint's text only: the bundled one would be refused.
        let e = check(&d.join("absent.txt"), "--corpus", true).unwrap_err();
        assert!(
            e.contains("pass --corpus with the path where the checkpoint's text is now")
                && e.contains("--allow-changed-corpus")
                && !e.contains("bundled"),
            "{e}"
        );
    }
}
