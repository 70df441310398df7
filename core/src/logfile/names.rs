//! A log's file names: whether it is compressed, and the numbered segments rotation
//! leaves beside it (`run.jsonl.zst` → `run.1.jsonl.zst`, `run.2.jsonl.zst`, …; the live
//! file keeps the name given).
use std::path::{Path, PathBuf};

/// Endings kept whole when a segment number goes before them, longest first.
const SUFFIXES: [&str; 5] = [".jsonl.zst", ".json.zst", ".jsonl", ".zst", ".json"];

/// A log named `….zst` is written and read as zstd-framed JSONL.
pub fn is_compressed(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "zst")
}

/// The file name cut before its log ending: (`run`, `.jsonl.zst`). A name with another
/// ending keeps it (`run.log` → (`run`, `.log`)); one with none is all stem.
pub fn split_name(path: &Path) -> (String, String) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(s) = SUFFIXES
        .iter()
        .find(|s| name.len() > s.len() && name.ends_with(*s))
    {
        return (name[..name.len() - s.len()].to_string(), s.to_string());
    }
    match name.rfind('.').filter(|&i| i > 0) {
        Some(i) => (name[..i].to_string(), name[i..].to_string()),
        None => (name, String::new()),
    }
}

/// The `n`-th rotated segment of the log at `path`.
pub fn segment_path(path: &Path, n: u32) -> PathBuf {
    let (stem, suffix) = split_name(path);
    path.with_file_name(format!("{stem}.{n}{suffix}"))
}

/// The rotated segments of `path` that exist, oldest (lowest number) first.
pub fn segments(path: &Path) -> Vec<PathBuf> {
    let (stem, suffix) = split_name(path);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let prefix = format!("{stem}.");
    let mut found: Vec<(u32, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n: u32 = name
                .strip_prefix(&prefix)?
                .strip_suffix(suffix.as_str())?
                .parse()
                .ok()?;
            // Leading zeros or a sign would name another file than `segment_path`'s.
            (n > 0 && segment_path(path, n).file_name() == Some(e.file_name().as_os_str()))
                .then(|| (n, segment_path(path, n)))
        })
        .collect();
    found.sort_by_key(|(n, _)| *n);
    found.into_iter().map(|(_, p)| p).collect()
}

/// What a replay of `path` reads, in order: its segments, then the file itself when it
/// exists.
pub fn chain(path: &Path) -> Vec<PathBuf> {
    let mut all = segments(path);
    if path.exists() || all.is_empty() {
        all.push(path.to_path_buf());
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_numbered_before_the_log_ending_and_found_in_numeric_order() {
        let p = Path::new("/x/run.jsonl.zst");
        assert!(is_compressed(p) && !is_compressed(Path::new("run.jsonl")));
        assert_eq!(segment_path(p, 3), Path::new("/x/run.3.jsonl.zst"));
        assert_eq!(
            segment_path(Path::new("a.b.jsonl"), 1),
            Path::new("a.b.1.jsonl")
        );
        assert_eq!(segment_path(Path::new("log"), 2), Path::new("log.2"));
        assert_eq!(segment_path(Path::new("r.log"), 2), Path::new("r.2.log"));

        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("run.jsonl.zst");
        assert_eq!(
            chain(&live),
            vec![live.clone()],
            "nothing yet: the name itself"
        );
        for name in [
            "run.10.jsonl.zst",
            "run.2.jsonl.zst",
            "run.1.jsonl.zst",
            "run.02.jsonl.zst",
            "run.x.jsonl.zst",
            "run.3.jsonl",
            "other.1.jsonl.zst",
            "run.jsonl.zst",
        ] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let names: Vec<String> = chain(&live)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "run.1.jsonl.zst",
                "run.2.jsonl.zst",
                "run.10.jsonl.zst",
                "run.jsonl.zst"
            ]
        );
    }
}
