//! A run stopped the way clusters, supervisors and terminals stop runs. Every
//! signal whose default would end the process saves; a stop in a long step is said at
//! once and takes effect at the next micro-batch; the exit never waits on a stuck log;
//! `q` works where the dashboard cannot be drawn; start-up and resume checks name the real
//! problem. Each case runs the real binary with real signals (docs/RELIABILITY.md,
//! "Signals", lists which test holds which signal).
mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::pty::Pty;
use common::{bin, fixture, of_kind, read_log, stderr, train_tiny};

/// A child killed with the test that spawned it (a failing assertion must not leave a
/// 100000-step run behind).
struct Run(Child);

impl Drop for Run {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A headless tiny run that goes on until stopped, logging to `dir/run.jsonl`, stderr to
/// `dir/stderr.txt`, stdout to `dir/stdout.txt`.
fn long_run(dir: &Path, config: &Path, extra: &[&str]) -> Run {
    Run(bin()
        .current_dir(dir)
        .args(["train", "--headless", "--config"])
        .arg(config)
        .args([
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ])
        .args(extra)
        .stdout(std::fs::File::create(dir.join("stdout.txt")).unwrap())
        .stderr(std::fs::File::create(dir.join("stderr.txt")).unwrap())
        .spawn()
        .unwrap())
}

fn text_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
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
        assert!(
            start.elapsed() < timeout,
            "the run did not exit within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn steps_logged(dir: &Path) -> usize {
    text_of(&dir.join("run.jsonl"))
        .matches("\"kind\":\"step\"")
        .count()
}

/// The step `ck/latest` names.
fn latest_step(ck: &Path) -> u64 {
    std::fs::read_to_string(ck.join("latest"))
        .unwrap()
        .trim()
        .trim_start_matches("step-")
        .parse()
        .unwrap()
}

/// SIGUSR1 (SLURM's `--signal=USR1@T` warning) and SIGXCPU (a CPU-time limit) killed runs
/// with no checkpoint (exit 138 and 152); SIGUSR2, SIGPWR, SIGVTALRM and SIGPROF did the
/// same. Each now stops the run with a checkpoint of its last step, exit 0, and says so.
#[test]
fn every_signal_that_would_end_the_run_stops_it_with_a_checkpoint() {
    let signals = [
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGPWR, "SIGPWR"),
        (libc::SIGVTALRM, "SIGVTALRM"),
        (libc::SIGPROF, "SIGPROF"),
    ];
    for (sig, name) in signals {
        let dir = tempfile::tempdir().unwrap();
        let mut run = long_run(dir.path(), &fixture("tiny.toml"), &["--threads", "1"]);
        wait_for("steps", Duration::from_secs(60), || {
            steps_logged(dir.path()) >= 3
        });
        signal(&run.0, sig);
        if sig == libc::SIGXCPU {
            // The kernel repeats SIGXCPU every second past the soft limit: a repeat is
            // the same warning, not a second request (which would exit 130 at once).
            std::thread::sleep(Duration::from_millis(20));
            signal(&run.0, sig);
        }
        let status = wait_exit(&mut run.0, Duration::from_secs(60));
        let err = text_of(&dir.path().join("stderr.txt"));
        assert_eq!(status.code(), Some(0), "{name}: {err}");
        assert!(
            err.contains(&format!("{name}: stopping")),
            "{name} is said: {err}"
        );
        let records = read_log(&dir.path().join("run.jsonl"));
        let finished = of_kind(&records, "finished");
        assert_eq!(finished[0]["stopped_by_user"], true, "{name}");
        let steps = finished[0]["steps_done"].as_u64().unwrap();
        assert_eq!(
            latest_step(&dir.path().join("ck")),
            steps,
            "{name}: the checkpoint is of the last step"
        );
        let out = text_of(&dir.path().join("stdout.txt"));
        assert!(out.contains("run stopped at step"), "{name}: {out}");
    }
}

/// `run.on_usr1 = "checkpoint"` (here the flag): SIGUSR1 saves at the step's end and the
/// run goes on. SIGXFSZ (a write past `ulimit -f`) is said and does not end the run.
#[test]
fn usr1_set_to_checkpoint_saves_and_goes_on_and_xfsz_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = long_run(
        dir.path(),
        &fixture("tiny.toml"),
        &["--threads", "1", "--on-usr1", "checkpoint"],
    );
    let log = dir.path().join("run.jsonl");
    wait_for("steps", Duration::from_secs(60), || {
        steps_logged(dir.path()) >= 3
    });
    signal(&run.0, libc::SIGUSR1);
    wait_for("the checkpoint", Duration::from_secs(30), || {
        text_of(&log).contains("\"kind\":\"checkpoint_saved\"")
    });
    let saved_at = steps_logged(dir.path());
    signal(&run.0, libc::SIGXFSZ);
    wait_for("more steps", Duration::from_secs(30), || {
        steps_logged(dir.path()) >= saved_at + 5
    });
    assert!(run.0.try_wait().unwrap().is_none(), "the run went on");
    signal(&run.0, libc::SIGTERM);
    let status = wait_exit(&mut run.0, Duration::from_secs(60));
    let err = text_of(&dir.path().join("stderr.txt"));
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(
        err.contains("SIGUSR1: a checkpoint") && err.contains("training goes on"),
        "{err}"
    );
    assert!(
        err.contains("SIGXFSZ") && err.contains("file-size limit"),
        "{err}"
    );
    let records = read_log(&log);
    let saved = of_kind(&records, "checkpoint_saved");
    assert_eq!(saved.len(), 2, "one for SIGUSR1, one for the stop");
}

/// `--batch-size 1 --effective-batch 65536`, SIGTERM in the step: a stop that waited for
/// the end of a step that long would leave the run silent and stepping. The stop is said
/// at once, the step is given up at the next micro-batch (partial gradients dropped), the
/// run exits within seconds with the checkpoint of the last completed step, and a resume
/// redoes the step to exactly the parameters of a run never interrupted.
#[test]
fn a_stop_in_a_long_step_gives_it_up_at_the_next_micro_batch_and_the_resume_matches() {
    let dir = tempfile::tempdir().unwrap();
    // A fixed micro-batch (no resizing), so every run splits its steps alike.
    let config = common::tiny_fixed(dir.path());
    let train = |args: &[&str]| {
        let out = bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--threads", "1"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    };
    // The step must be long on this machine, whatever its speed: measured as it will
    // run (one sequence per micro-batch), sized for about 30 s in whole micro-batches of
    // 4096, within the largest batch a config takes.
    let rate = common::tiny_sequences_per_second(dir.path(), 1, 1024);
    let effective = ((rate * 30.0 / 4096.0).ceil() as u64).clamp(2, 16) * 4096;
    let effective = effective.to_string();
    let effective = effective.as_str();
    let c = config.to_str().unwrap();
    eprintln!("{rate:.0} micro-batches/s here: a step of {effective}");
    // Uninterrupted: two such steps, in micro-batches of 4096.
    train(&[
        "--config",
        c,
        "--steps",
        "2",
        "--batch-size",
        "4096",
        "--effective-batch",
        effective,
        "--checkpoint-every",
        "1",
        "--checkpoint-dir",
        "full",
        "--log",
        "full.jsonl",
    ]);
    // The interrupted run continues from step 1, one sequence per micro-batch: a step of
    // about 30 s.
    std::fs::create_dir(dir.path().join("ck")).unwrap();
    let copy = std::process::Command::new("cp")
        .args(["-r", "full/step-000001", "ck/"])
        .current_dir(dir.path())
        .status();
    assert!(copy.unwrap().success());
    std::fs::write(dir.path().join("ck/latest"), "step-000001\n").unwrap();
    let mut run = Run(bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--threads", "1", "--resume", "ck"])
        .args(["--steps", "2", "--batch-size", "1", "--log", "run.jsonl"])
        .stdout(std::fs::File::create(dir.path().join("stdout.txt")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr.txt")).unwrap())
        .spawn()
        .unwrap());
    let err_path = dir.path().join("stderr.txt");
    wait_for("the run to start", Duration::from_secs(60), || {
        text_of(&dir.path().join("run.jsonl")).contains("\"status\":\"running\"")
    });
    std::thread::sleep(Duration::from_secs(2));
    signal(&run.0, libc::SIGTERM);
    let asked = Instant::now();
    wait_for("the acknowledgement", Duration::from_secs(10), || {
        text_of(&err_path).contains("SIGTERM: stopping")
    });
    let said_in = asked.elapsed();
    let status = wait_exit(&mut run.0, Duration::from_secs(30));
    let took = asked.elapsed();
    let err = text_of(&err_path);
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(
        err.contains("step 2, in progress, is abandoned at its next micro-batch")
            && err.contains("checkpoint will be of step 1"),
        "{err}"
    );
    // How long the whole step would have taken, from the share of it done when given up.
    let records = read_log(&dir.path().join("run.jsonl"));
    let abandoned = of_kind(&records, "notice")
        .into_iter()
        .find(|n| n["text"].as_str().unwrap().contains("abandoned after"))
        .unwrap_or_else(|| panic!("no abandon notice: {err}"))["text"]
        .as_str()
        .unwrap()
        .to_string();
    let (done, secs) = parse_abandon(&abandoned);
    let whole = effective.parse::<f64>().unwrap();
    let whole_step = secs * whole / done.max(1) as f64;
    eprintln!(
        "said {said_in:?} after SIGTERM, exited after {took:?}; the step would have taken \
         about {whole_step:.0} s ({abandoned})"
    );
    // The precondition: the step is long against the exit (a machine so fast that the
    // largest batch takes seconds still has it three times as long as the exit took).
    assert!(
        whole_step >= 3.0 * took.as_secs_f64(),
        "the step is long enough to matter: {abandoned}, exit {took:?}"
    );
    assert!(took < Duration::from_secs(5), "exit {took:?} after SIGTERM");
    assert!(
        of_kind(&records, "step").is_empty(),
        "step 2 never completed"
    );
    assert_eq!(latest_step(&dir.path().join("ck")), 1);
    assert!(text_of(&dir.path().join("stdout.txt")).contains("run stopped at step 1/2"));

    // The resume redoes step 2 (in the uninterrupted run's micro-batches) and lands on
    // the same parameters, to the bit.
    train(&["--resume", "ck", "--steps", "2", "--batch-size", "4096"]);
    let checksums = |p: &str| {
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(p)).unwrap()).unwrap();
        (state["checksums"].clone(), state["tokens_seen"].clone())
    };
    assert_eq!(
        checksums("ck/step-000002/state.json"),
        checksums("full/step-000002/state.json"),
        "the resumed step 2 equals the uninterrupted one"
    );
}

/// GNU `timeout`, a supervisor that signals a process group, and `kill -TERM PID` then
/// `kill -TERM -PGID` deliver one SIGTERM twice within microseconds. It is one request:
/// the run stops with its summary and a checkpoint of its last completed step (with no
/// periodic checkpoints, the final save is all the work kept), exit 0.
#[test]
fn a_sigterm_delivered_twice_at_once_is_one_request() {
    for how in ["timeout", "process group"] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let config = fixture("tiny.toml");
        let mut cmd = if how == "timeout" {
            // timeout forwards a signal it receives as it sends its own at expiry: to the
            // child, then to the whole group.
            let mut c = std::process::Command::new("timeout");
            c.args(["-s", "TERM", "600", env!("CARGO_BIN_EXE_headroom")]);
            c
        } else {
            let mut c = bin();
            std::os::unix::process::CommandExt::process_group(&mut c, 0);
            c
        };
        cmd.current_dir(d)
            .args(["train", "--headless", "--config"])
            .arg(&config)
            .args(["--steps", "100000", "--checkpoint-dir", "ck"])
            .args(["--log", "run.jsonl"])
            .stdout(std::fs::File::create(d.join("stdout.txt")).unwrap())
            .stderr(std::fs::File::create(d.join("stderr.txt")).unwrap());
        let mut run = Run(cmd.spawn().unwrap());
        wait_for("steps", Duration::from_secs(60), || steps_logged(d) >= 3);
        if how == "timeout" {
            signal(&run.0, libc::SIGTERM);
        } else {
            let pid = run.0.id() as i32;
            // SAFETY: kill(2) on our own child and on the group it leads.
            unsafe {
                assert_eq!(libc::kill(pid, libc::SIGTERM), 0);
                assert_eq!(libc::kill(-pid, libc::SIGTERM), 0);
            }
        }
        let status = wait_exit(&mut run.0, Duration::from_secs(60));
        let err = text_of(&d.join("stderr.txt"));
        assert_eq!(status.code(), Some(0), "{how}: {err}");
        assert!(!err.contains("asked twice"), "{how}: {err}");
        let out = text_of(&d.join("stdout.txt"));
        assert!(
            out.contains("run stopped at step"),
            "{how}: no summary: {out}"
        );
        let records = read_log(&d.join("run.jsonl"));
        let finished = of_kind(&records, "finished");
        assert_eq!(finished.len(), 1, "{how}: {err}");
        let steps = finished[0]["steps_done"].as_u64().unwrap();
        assert!(steps >= 3, "{how}");
        assert_eq!(
            latest_step(&d.join("ck")),
            steps,
            "{how}: the last step is kept"
        );
    }
}

/// "step 2 abandoned after K of N micro-batches (S s in)" → (K, S).
fn parse_abandon(text: &str) -> (u64, f64) {
    let after = text.split("abandoned after ").nth(1).unwrap();
    let done = after.split(' ').next().unwrap().parse().unwrap();
    let secs = after
        .split('(')
        .nth(1)
        .unwrap()
        .split('s')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (done, secs)
}

/// A `--log` FIFO whose reader stopped reading held the exit 5-10 s after the checkpoint
/// was written, and no summary reached stdout. Now the summary comes first and a stuck
/// log is given up after a quarter of a second without progress: the exit comes at most
/// a second later than the same run's with a log file, measured here on this machine.
#[test]
fn a_stuck_log_reader_delays_the_exit_by_a_fraction_of_a_second() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    // The run, stopped by SIGTERM once `ready` holds; returns the time from the
    // checkpoint's line to the exit, the summary (stdout) and stderr.
    let stop_and_time = |log: &str, ready: &dyn Fn() -> bool| {
        let err = dir.path().join(format!("{log}.stderr.txt"));
        let mut child = Run(bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--threads", "1", "--config"])
            .arg(fixture("tiny.toml"))
            .args([
                "--steps",
                "100000",
                "--checkpoint-dir",
                &format!("{log}.ck"),
            ])
            .args(["--log", log])
            .env("HEADROOM_LOG_QUEUE", "256")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap());
        wait_for("the run to be ready", Duration::from_secs(120), || {
            ready() || text_of(&err).contains("stopped reading")
        });
        signal(&child.0, libc::SIGTERM);
        wait_for("the checkpoint", Duration::from_secs(30), || {
            text_of(&err).contains("checkpoint at step")
        });
        let saved = Instant::now();
        let status = wait_exit(&mut child.0, Duration::from_secs(30));
        let after_save = saved.elapsed();
        let mut out = String::new();
        use std::io::Read;
        child
            .0
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let text = text_of(&err);
        assert!(status.success(), "{status:?}\n{text}");
        (after_save, out, text)
    };
    // The baseline: the same run with a log file, stopped after a few steps.
    let file = dir.path().join("run.jsonl");
    let (baseline, out, _) = stop_and_time("run.jsonl", &|| {
        text_of(&file).matches("\"kind\":\"step\"").count() >= 3
    });
    assert!(out.contains("run stopped at step"), "the summary: {out}");

    let fifo = dir.path().join("log.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let _reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    // Stopped once it said the log stalled.
    let (after_save, out, text) = stop_and_time("log.fifo", &|| false);
    eprintln!("exit {after_save:?} after the checkpoint was said ({baseline:?} with a log file)");
    assert!(text.contains("stopped reading"), "{text}");
    assert!(out.contains("run stopped at step"), "the summary: {out}");
    assert!(
        after_save < baseline + Duration::from_secs(1),
        "{after_save:?}, {baseline:?} with a log file: {text}"
    );
}

/// `TERM=dumb`: `q` did nothing (the run went on headless). Now lines are read from the
/// terminal in its line mode: `q` and Enter stop the run with a checkpoint.
#[test]
fn term_dumb_q_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = bin();
    cmd.current_dir(dir.path())
        .env("TERM", "dumb")
        .args(["train", "--threads", "1", "--config"])
        .arg(fixture("tiny.toml"))
        .args([
            "--steps",
            "100000",
            "--checkpoint-dir",
            "ck",
            "--log",
            "run.jsonl",
        ]);
    let mut pty = Pty::spawn(cmd, 100, 30);
    assert!(
        pty.wait_for("type q and Enter to stop", Duration::from_secs(60)),
        "{}",
        pty.output()
    );
    wait_for("steps", Duration::from_secs(60), || {
        steps_logged(dir.path()) >= 3
    });
    pty.send(b"q\r");
    let status = pty
        .wait_exit(Duration::from_secs(30))
        .expect("q ended the run");
    let out = pty.output();
    assert!(status.success(), "{out}");
    assert!(out.contains("q: stopping"), "{out}");
    let records = read_log(&dir.path().join("run.jsonl"));
    let finished = of_kind(&records, "finished");
    let steps = finished[0]["steps_done"].as_u64().unwrap();
    assert_eq!(latest_step(&dir.path().join("ck")), steps);
}

/// Started from a deleted working directory, the only message was oneMKL's "Cannot load
/// libtorch_cpu.so", which sends the user to reinstall libtorch.
#[test]
fn a_deleted_working_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("gone");
    std::fs::create_dir(&gone).unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("cd \"$1\" && rmdir \"$1\" && exec \"$2\" train --headless --steps 2")
        .arg("sh")
        .arg(&gone)
        .arg(env!("CARGO_BIN_EXE_headroom"))
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("current directory was deleted"), "{err}");
    assert!(!err.contains("libtorch"), "{err}");
}

/// A state.json whose step disagrees with its directory's name, or with the tokens it
/// says were seen, was resumed without a word.
#[test]
fn a_state_json_that_disagrees_with_itself_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = train_tiny(dir.path(), &["--checkpoint-dir", "ck", "--steps", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let path = dir.path().join("ck/step-000002/state.json");
    let original = std::fs::read(&path).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut state: serde_json::Value = serde_json::from_slice(&original).unwrap();
        f(&mut state);
        std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    };
    let resume = || {
        bin()
            .current_dir(dir.path())
            .args(["train", "--headless", "--resume", "ck", "--steps", "5"])
            .output()
            .unwrap()
    };
    edit(&|s| s["step"] = 3.into());
    let out = resume();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("says step 3") && err.contains("its directory is step-000002"),
        "{err}"
    );
    edit(&|s| s["tokens_seen"] = 999.into());
    let out = resume();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("tokens_seen is 999"), "{err}");
    std::fs::write(&path, &original).unwrap();
    let out = resume();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// The machine lets this test mount a tmpfs (root in CI); elsewhere it says it was skipped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid path and a zeroed statvfs for the call to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail * st.f_frsize
}

/// A resume on a nearly full disk asked for twice the checkpoint's size (514 KiB for one
/// of 264 KiB) and refused. Now a checkpoint takes what the one resumed from takes, and a
/// resume without room deletes older checkpoints (never the one it resumes) as a failed
/// save does.
#[test]
fn a_resume_on_a_nearly_full_disk_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("disk");
    std::fs::create_dir(&mnt).unwrap();
    let Some(_tmpfs) = Tmpfs::mount(&mnt, "2m") else {
        return;
    };
    let out = train_tiny(
        dir.path(),
        &[
            "--checkpoint-dir",
            "disk/ck",
            "--steps",
            "3",
            "--checkpoint-every",
            "1",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let one: u64 = std::fs::read_dir(mnt.join("ck/step-000003"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    // Something else fills the disk to leave half a checkpoint free.
    let fill = free_bytes(&mnt).saturating_sub(one / 2) / 4096;
    let dd = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=4096", &format!("count={fill}")])
        .arg(format!("of={}", mnt.join("filler").display()))
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(dd.success());
    assert!(free_bytes(&mnt) < one, "the disk is nearly full");
    let out = bin()
        .current_dir(dir.path())
        .args(["train", "--headless", "--resume", "disk/ck", "--steps", "4"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("deleted older checkpoints (step-000002)") && err.contains("step-000003"),
        "{err}"
    );
    assert_eq!(latest_step(&mnt.join("ck")), 4);
}
