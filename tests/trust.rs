//! The "losing work" and "crashes and hangs" cases, through the real binary: real
//! signals, a real FIFO, a real tmpfs where the machine lets the test mount one, two real
//! runs racing for one checkpoint directory.
mod common;

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{bin, fixture, of_kind, read_log, stderr, train_tiny};

/// `headroom train --headless ARGS...` in `dir` (a resume takes its config from the
/// checkpoint, so no --config).
fn resume(dir: &Path, args: &[&str]) -> std::process::Output {
    bin()
        .current_dir(dir)
        .args(["train", "--headless"])
        .args(args)
        .output()
        .unwrap()
}

/// The tiny fixture with a checkpoint every `every` steps, written into `dir` (a config
/// key rather than the --checkpoint-every flag, so these tests also run against builds
/// from before the flag, which is how they were checked to fail there).
fn tiny_checkpointing_every(dir: &Path, every: u64) -> std::path::PathBuf {
    let text = std::fs::read_to_string(fixture("tiny.toml")).unwrap();
    assert!(text.contains("checkpoint_every = 0"));
    let path = dir.join(format!("tiny-every-{every}.toml"));
    let text = text.replace(
        "checkpoint_every = 0",
        &format!("checkpoint_every = {every}"),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A child killed with the test that spawned it: a failing assertion must not leave a
/// 100000-step run behind (two did, for 20 minutes, before this).
struct Run(Child);

impl std::ops::Deref for Run {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Run {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A headless tiny run that goes on until stopped, checkpointing every `every` steps and
/// logging to `log` (a path in `dir`).
fn long_run(dir: &Path, log: &str, every: u64, extra: &[&str]) -> Run {
    long_run_env(dir, log, every, extra, &[])
}

/// [`long_run`] with extra environment.
fn long_run_env(dir: &Path, log: &str, every: u64, extra: &[&str], env: &[(&str, &str)]) -> Run {
    Run(bin()
        .current_dir(dir)
        .args(["train", "--headless", "--config"])
        .arg(tiny_checkpointing_every(dir, every))
        .args(["--steps", "100000", "--checkpoint-dir", "ck", "--log", log])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.txt")).unwrap())
        .spawn()
        .unwrap())
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn count_in(path: &Path, needle: &str) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .matches(needle)
        .count()
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("the run did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `cmd` with stderr captured, killed if it has not exited within `timeout`: a hang
/// (the old behaviour of some of these cases) fails the test instead of holding the suite.
fn output_within(cmd: &mut std::process::Command, timeout: Duration) -> std::process::Output {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_exit(&mut child, timeout);
    child.wait_with_output().unwrap()
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// A `--log` FIFO whose reader never reads froze training within seconds, and SIGTERM
/// was then ignored. Now the stalled log loses records (counted, said) while training goes
/// on, and a stop ends the run with its checkpoint.
#[test]
fn a_log_reader_that_never_reads_neither_stalls_training_nor_blocks_a_stop() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("log.fifo");
    mkfifo(&fifo);
    // The reader: opens the FIFO and never reads.
    let _reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    // The pipe holds 64 KiB, a few hundred records, and the log's queue (256 here, 8192 by
    // default: on a loaded 2-core machine filling that took over 5 minutes) more.
    let mut child = long_run_env(
        dir.path(),
        "log.fifo",
        0,
        &[],
        &[("HEADROOM_LOG_QUEUE", "256")],
    );
    let err = dir.path().join("stderr.txt");
    wait_for("steps past the stall", Duration::from_secs(300), || {
        count_in(&err, "step ") >= 4 && count_in(&err, "stopped reading") >= 1
    });
    let steps_at_stall = count_in(&err, "step ");
    wait_for("training to go on", Duration::from_secs(60), || {
        count_in(&err, "step ") >= steps_at_stall + 4
    });
    signal(&child, libc::SIGTERM);
    let status = wait_exit(&mut child, Duration::from_secs(60));
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(status.success(), "{status:?}\n{text}");
    assert!(text.contains("log records were lost"), "{text}");
    assert!(
        dir.path().join("ck/latest").exists(),
        "the stop wrote a checkpoint: {text}"
    );
}

/// A FIFO with nobody on the other end is waited for, said, and refused after the wait.
#[test]
fn fifos_without_a_peer_fail_fast_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("log.fifo"));
    mkfifo(&dir.path().join("corpus.fifo"));
    for (args, needles) in [
        (
            &["--log", "log.fifo"][..],
            &[
                "--log",
                "no reader",
                "start its reader",
                "waiting up to 1 s for a reader",
            ][..],
        ),
        (
            &["--corpus", "corpus.fifo"][..],
            &[
                "corpus.fifo",
                "FIFO",
                "start its writer",
                "waiting up to 1 s for a writer",
            ][..],
        ),
    ] {
        let start = Instant::now();
        let out = output_within(
            bin()
                .current_dir(dir.path())
                .env("HEADROOM_FIFO_WAIT_S", "1")
                .args(["train", "--headless", "--config"])
                .arg(fixture("tiny.toml"))
                .args(args),
            Duration::from_secs(30),
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {n:?} missing in {err}");
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{args:?} hung");
    }
}

/// A run owns its checkpoint directory: a second writer is refused while the first runs,
/// a fresh run over finished checkpoints is refused, and --overwrite replaces them.
#[test]
fn a_checkpoint_directory_belongs_to_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = long_run(dir.path(), "a.jsonl", 2, &[]);
    wait_for(
        "the first run's checkpoint",
        Duration::from_secs(60),
        || dir.path().join("ck/latest").exists(),
    );
    let second = train_tiny(dir.path(), &["--checkpoint-dir", "ck", "--steps", "3"]);
    let err = stderr(&second);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(
        err.contains("in use by another headroom run") && err.contains(&first.id().to_string()),
        "{err}"
    );
    signal(&first, libc::SIGTERM);
    assert!(wait_exit(&mut first, Duration::from_secs(60)).success());
    let latest = std::fs::read_to_string(dir.path().join("ck/latest")).unwrap();

    let again = train_tiny(dir.path(), &["--checkpoint-dir", "ck", "--steps", "3"]);
    let err = stderr(&again);
    assert_eq!(again.status.code(), Some(2), "{err}");
    assert!(
        err.contains("already holds another run's checkpoints")
            && err.contains("--resume")
            && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ck/latest")).unwrap(),
        latest,
        "the refused run touched nothing"
    );
    let replaced = train_tiny(
        dir.path(),
        &["--checkpoint-dir", "ck", "--steps", "3", "--overwrite"],
    );
    assert!(replaced.status.success(), "{}", stderr(&replaced));
    let names: Vec<String> = std::fs::read_dir(dir.path().join("ck"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(names, ["step-000003"], "only the new run's checkpoint");
}

#[test]
fn a_log_inside_the_checkpoint_directory_is_refused_before_anything_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let ok = train_tiny(dir.path(), &["--checkpoint-dir", "ck", "--steps", "2"]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let state = std::fs::read(dir.path().join("ck/step-000002/state.json")).unwrap();
    for log in ["ck/latest", "ck/step-000002/state.json", "ck/new.jsonl"] {
        let out = resume(
            dir.path(),
            &["--resume", "ck", "--steps", "4", "--log", log],
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{log}: {err}");
        assert!(err.contains("inside the checkpoint directory"), "{err}");
    }
    assert_eq!(
        std::fs::read(dir.path().join("ck/step-000002/state.json")).unwrap(),
        state
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ck/latest")).unwrap(),
        "step-000002\n"
    );
}

/// SIGHUP (a dropped ssh link) and SIGQUIT stop like SIGTERM: checkpoint, exit 0.
#[test]
fn sighup_and_sigquit_stop_with_a_checkpoint() {
    for sig in [libc::SIGHUP, libc::SIGQUIT] {
        let dir = tempfile::tempdir().unwrap();
        let mut child = long_run(dir.path(), "run.jsonl", 0, &[]);
        let log = dir.path().join("run.jsonl");
        wait_for("steps", Duration::from_secs(60), || {
            count_in(&log, "\"kind\":\"step\"") >= 3
        });
        signal(&child, sig);
        let status = wait_exit(&mut child, Duration::from_secs(60));
        assert!(status.success(), "signal {sig}: {status:?}");
        let records = read_log(&log);
        let finished = of_kind(&records, "finished");
        assert_eq!(finished[0]["stopped_by_user"], true, "signal {sig}");
        let steps = finished[0]["steps_done"].as_u64().unwrap();
        let saved = of_kind(&records, "checkpoint_saved");
        assert_eq!(saved.last().unwrap()["step"].as_u64(), Some(steps));
    }
}

/// Asked twice, the run ends at once (exit 130) instead of finishing a long step, and the
/// checkpoint it leaves resumes. The second SIGTERM comes later than the window in which a
/// repeat is the same request (a signal sent to the process and to its group).
#[test]
fn a_second_sigterm_ends_the_run_at_once_and_the_last_checkpoint_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // Micro-batches of about 6 s on this machine (one per step), measured, up to 16384
    // sequences (1.5 GiB): the stop waits for the one in progress, and the second request,
    // later than the same-request window, must find it still running.
    let rate = common::tiny_sequences_per_second(dir.path(), 256, 256);
    let batch = ((rate * 6.0 / 256.0).ceil() as usize).clamp(1, 64) * 256;
    let batch = batch.to_string();
    let mut child = long_run(
        dir.path(),
        "run.jsonl",
        1,
        &["--batch-size", &batch, "--threads", "1"],
    );
    wait_for("a checkpoint", Duration::from_secs(120), || {
        dir.path().join("ck/latest").exists()
    });
    signal(&child, libc::SIGTERM);
    wait_for(
        "the stop's acknowledgement",
        Duration::from_secs(10),
        || count_in(&dir.path().join("stderr.txt"), "SIGTERM: stopping") > 0,
    );
    std::thread::sleep(Duration::from_millis(1200));
    let asked = Instant::now();
    signal(&child, libc::SIGTERM);
    let status = wait_exit(&mut child, Duration::from_secs(30));
    let err = std::fs::read_to_string(dir.path().join("stderr.txt")).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        err.contains("asked twice") && err.contains("is intact"),
        "{err}"
    );
    let step: u64 = std::fs::read_to_string(dir.path().join("ck/latest"))
        .unwrap()
        .trim()
        .trim_start_matches("step-")
        .parse()
        .unwrap();
    let out = resume(
        dir.path(),
        &[
            "--resume",
            "ck",
            "--steps",
            &(step + 1).to_string(),
            "--batch-size",
            "8",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `headroom train … | true`: stdout closed under it must not panic the run.
#[test]
fn a_closed_stdout_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--config"])
        .arg(fixture("tiny.toml"))
        .args(["--steps", "3", "--checkpoint-dir", "ck"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_model_too_large_for_memory_is_refused_before_it_is_built() {
    let dir = tempfile::tempdir().unwrap();
    for (layers, embd) in [("1000", "16384"), ("4096", "8192")] {
        let config = dir.path().join("huge.toml");
        std::fs::write(
            &config,
            format!("[model]\nn_layer = {layers}\nn_head = 4\nn_embd = {embd}\n"),
        )
        .unwrap();
        let start = Instant::now();
        // Building it would allocate until the machine gives out: a bounded wait.
        let out = output_within(
            bin()
                .current_dir(dir.path())
                .args(["train", "--headless", "--device", "cpu", "--config"])
                .arg(&config),
            Duration::from_secs(30),
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("too large") && err.contains("n_layer") && err.contains("parameters"),
            "{err}"
        );
        assert_eq!(
            err.trim().lines().count(),
            1,
            "one line, no backtrace: {err}"
        );
        assert!(start.elapsed() < Duration::from_secs(20));
    }
}

/// A corpus given by a relative path resumes from another directory, follows its content
/// to a new path, and refuses changed content unless told.
#[test]
fn resume_finds_the_corpus_from_anywhere_and_refuses_changed_content() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let text = "Now is the winter of our discontent made glorious summer.\n".repeat(200);
    std::fs::write(run.join("c.txt"), &text).unwrap();
    let out = train_tiny(
        &run,
        &[
            "--corpus",
            "c.txt",
            "--steps",
            "2",
            "--checkpoint-dir",
            "ck",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // From the parent directory: the relative path would miss, the recorded one finds it.
    let out = resume(dir.path(), &["--resume", "run/ck", "--steps", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // The same content elsewhere: --corpus says where, the digest agrees.
    std::fs::rename(run.join("c.txt"), dir.path().join("moved.txt")).unwrap();
    let out = resume(
        dir.path(),
        &[
            "--resume",
            "run/ck",
            "--steps",
            "4",
            "--corpus",
            "moved.txt",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // Changed content: refused, then accepted when the user says so.
    std::fs::write(
        dir.path().join("moved.txt"),
        text.replace("winter", "summer"),
    )
    .unwrap();
    let args = [
        "--resume",
        "run/ck",
        "--steps",
        "5",
        "--corpus",
        "moved.txt",
    ];
    let out = resume(dir.path(), &args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the corpus changed") && err.contains("--allow-changed-corpus"),
        "{err}"
    );
    let mut allowed = args.to_vec();
    allowed.push("--allow-changed-corpus");
    let out = resume(dir.path(), &allowed);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("training on the new content"), "{err}");
}

/// `--batch-size` on a resume moves where the controller starts, not what is learned: the
/// effective batch and the validation set stay; a new `--steps` is said.
#[test]
fn batch_size_on_resume_keeps_the_effective_batch_and_the_validation_set() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(
        dir.path(),
        &["--steps", "2", "--checkpoint-dir", "ck", "--log", "a.jsonl"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = resume(
        dir.path(),
        &[
            "--resume",
            "ck",
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--log",
            "b.jsonl",
        ],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("now 4 steps long (it was 2)"), "{err}");
    let (a, b) = (
        read_log(&dir.path().join("a.jsonl")),
        read_log(&dir.path().join("b.jsonl")),
    );
    let effective = |log: &[serde_json::Value]| -> Vec<u64> {
        of_kind(log, "step")
            .iter()
            .map(|s| s["effective_batch"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(effective(&a), [8, 8]);
    assert_eq!(
        effective(&b),
        [8, 8],
        "the effective batch survived the resume"
    );
    assert_eq!(of_kind(&b, "step")[0]["micro_batch"], 4, "the start moved");
    let eval_tokens =
        |log: &[serde_json::Value]| of_kind(log, "eval").last().unwrap()["tokens"].clone();
    assert_eq!(eval_tokens(&a), eval_tokens(&b), "the same validation set");
}

/// The machine lets this test mount a tmpfs (root in CI); elsewhere it says it was skipped.
fn small_tmpfs(dir: &Path, size: &str) -> Option<TmpfsGuard> {
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "SKIPPED: cannot mount a tmpfs here (needs root); the full-disk case is untested"
        );
        return None;
    }
    Some(TmpfsGuard(dir.to_path_buf()))
}

struct TmpfsGuard(std::path::PathBuf);

impl Drop for TmpfsGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A disk too small for one checkpoint is refused at start with the numbers; a disk that
/// fills mid-run keeps the last good checkpoint and says exactly which.
#[test]
fn a_full_disk_never_costs_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("disk");
    std::fs::create_dir(&mnt).unwrap();
    let Some(_tmpfs) = small_tmpfs(&mnt, "64k") else {
        return;
    };
    let out = train_tiny(dir.path(), &["--checkpoint-dir", "disk/ck", "--steps", "2"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("free") && err.contains("one checkpoint"),
        "{err}"
    );
    drop(_tmpfs);

    let Some(_tmpfs) = small_tmpfs(&mnt, "4m") else {
        return;
    };
    let child = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--config"])
        .arg(tiny_checkpointing_every(dir.path(), 3))
        .args(["--steps", "400", "--checkpoint-dir", "disk/ck"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("a first checkpoint", Duration::from_secs(60), || {
        mnt.join("ck/latest").exists()
    });
    // Something else fills the disk.
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=4k"])
        .arg(format!("of={}", mnt.join("filler").display()))
        .stderr(Stdio::null())
        .status();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("could not be written"), "{err}");
    assert!(err.contains("Kept: the checkpoint of step"), "{err}");
    let latest = std::fs::read_to_string(mnt.join("ck/latest")).unwrap();
    assert!(
        err.contains(latest.trim()),
        "the message names the kept checkpoint {latest}: {err}"
    );
    std::fs::remove_file(mnt.join("filler")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    let out = resume(
        dir.path(),
        &["--resume", "disk/ck", "--steps", &(step + 1).to_string()],
    );
    assert!(
        out.status.success(),
        "the kept checkpoint resumes: {}",
        stderr(&out)
    );
}

/// A state.json whose checksums were removed loads (older checkpoints have none) but says
/// its tensors went unchecked.
#[test]
fn a_checkpoint_without_checksums_resumes_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(dir.path(), &["--checkpoint-dir", "ck", "--steps", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let state_path = dir.path().join("ck/step-000002/state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    assert!(state.as_object_mut().unwrap().remove("checksums").is_some());
    std::fs::write(&state_path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    let out = resume(dir.path(), &["--resume", "ck", "--steps", "3"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("has no checksums") && err.contains("unchecked"),
        "{err}"
    );
}
