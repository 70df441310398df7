//! Through the real binary: `headroom ls` and `headroom attach` on a torchrun
//! job's ranks. Each rank is a process of its own serving the real stream server with the
//! job identity a rank under torchrun gives it (`NAME.JOB.rankR`); a rank dies by SIGKILL,
//! as one does when torchrun's agent or the kernel kills it. The job's training itself and
//! the rows rank 0 gathers are the Python package's (py/tests/test_torchrun.py).
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::bin;
use headroom_core::protocol::JobRank;
use headroom_core::{Bus, Command as RunCommand, RunInfo, RunStatus, Telemetry};
use headroom_host::server::{serve_run, ServeOptions};

const JOB: &str = "j7x";
/// A job id long enough that its ranks' socket names are cut inside it (torchrun's own ids
/// are 36-character uuids; under a deep runtime directory they are cut too).
const LONG_JOB: &str = "j7x-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef-long";

/// The body of one rank's process (started by [`Rank::start`], not run by itself): serves
/// a run named as torchrun's rank `HEADROOM_TEST_RANK` of job `HEADROOM_TEST_JOB` until it is
/// killed.
#[test]
#[ignore = "a rank's process, started by the other tests of this file"]
fn rank_process() {
    let Some(rank) = std::env::var("HEADROOM_TEST_RANK")
        .ok()
        .and_then(|r| r.parse::<u32>().ok())
    else {
        return;
    };
    let world = std::env::var("HEADROOM_TEST_WORLD")
        .unwrap()
        .parse()
        .unwrap();
    let job = std::env::var("HEADROOM_TEST_JOB").unwrap();
    let name = format!("ddp.{job}.rank{rank}");
    let (bus, mut rx) = Bus::with_sinks(false, true);
    let (commands, _held) = crossbeam_channel::bounded::<RunCommand>(64);
    let opts = ServeOptions {
        run_name: name.clone(),
        listen: None,
        producer: "job_ranks test".into(),
        job: Some(JobRank {
            id: job,
            rank,
            local_rank: rank,
            world_size: world,
        }),
    };
    let _server = serve_run(&opts, rx.serve.take().unwrap(), commands, &bus).unwrap();
    bus.send(Telemetry::RunStarted(RunInfo {
        run_name: name,
        device: "cpu".into(),
        device_name: "cpu".into(),
        parameters: 1,
        start_step: 0,
        total_steps: 10,
        corpus: String::new(),
        train_bytes: 0,
        val_bytes: 0,
        config: None,
        checkpoints: None,
        levers: None,
    }));
    bus.send(Telemetry::Status {
        status: RunStatus::Running,
    });
    std::thread::sleep(Duration::from_secs(300));
}

/// A rank's process; killed when dropped.
struct Rank {
    child: Child,
}

impl Rank {
    fn start(runtime: &Path, job: &str, rank: u32, world: u32) -> Rank {
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "rank_process", "--nocapture"])
            .env("HEADROOM_RUNTIME_DIR", runtime)
            .env("HEADROOM_TEST_RANK", rank.to_string())
            .env("HEADROOM_TEST_JOB", job)
            .env("HEADROOM_TEST_WORLD", world.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Rank { child }
    }

    /// SIGKILL: the process cannot remove its socket.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn headroom(runtime: &Path, args: &[&str]) -> Output {
    bin()
        .env("HEADROOM_RUNTIME_DIR", runtime)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The socket of rank `rank`, once it serves (its file name may be cut inside the job's
/// id; its `.rankR` stays).
fn socket_of(runtime: &Path, rank: u32) -> PathBuf {
    let tail = format!(".rank{rank}-");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = std::fs::read_dir(runtime).ok().and_then(|d| {
            d.flatten().map(|e| e.path()).find(|p| {
                let n = p.file_name().unwrap().to_string_lossy();
                n.starts_with("ddp.j7x") && n.contains(&tail) && n.ends_with(".sock")
            })
        });
        if let Some(p) = found {
            return p;
        }
        assert!(Instant::now() < deadline, "rank {rank} never served");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn job_line(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.starts_with("job j7x"))
        .unwrap_or_else(|| panic!("no line for the job:\n{stdout}"))
}

#[test]
fn ls_says_which_rank_died_while_the_job_lives_and_cleans_up_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("rt");
    let mut ranks: Vec<Rank> = (0..3)
        .map(|r| Rank::start(&runtime, LONG_JOB, r, 3))
        .collect();
    let sockets: Vec<PathBuf> = (0..3).map(|r| socket_of(&runtime, r)).collect();
    let stem = sockets[1]
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(!stem.contains(LONG_JOB), "the id is cut in {stem}");
    let (stdout, _) = text(&headroom(&runtime, &["ls"]));
    assert_eq!(
        job_line(&stdout),
        format!("job {LONG_JOB}: 3 of 3 ranks serving here")
    );

    ranks[1].kill();
    for _ in 0..2 {
        // Every `ls` while the job lives says so: the dead rank's socket is kept, and its
        // cut name is matched to the job by what is left of the id.
        let (stdout, stderr) = text(&headroom(&runtime, &["ls"]));
        assert_eq!(
            job_line(&stdout),
            format!("job {LONG_JOB}: 2 of 3 ranks serving here; rank 1 died (its process is gone)"),
            "{stderr}"
        );
        let row = stdout
            .lines()
            .find(|l| l.contains(".rank1 "))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(row.contains("died"), "{row}");
        assert!(sockets[1].exists());
    }

    ranks[0].kill();
    ranks[2].kill();
    let (stdout, stderr) = text(&headroom(&runtime, &["ls"]));
    // Nothing serves to say the whole id: the line names what the file names kept of it.
    let line = job_line(&stdout);
    assert!(
        line.ends_with(": 0 ranks serving here; rank 0, 1, 2 died (its process is gone)"),
        "{line}"
    );
    assert_eq!(
        stderr.matches("removed the stale socket").count(),
        3,
        "{stderr}"
    );
    assert!(
        sockets.iter().all(|s| !s.exists()),
        "the last rank takes the job's sockets"
    );
    let (stdout, stderr) = text(&headroom(&runtime, &["ls"]));
    assert!(
        stdout.is_empty() && stderr.contains("no runs are running"),
        "{stderr}"
    );
}

#[test]
fn attach_resolves_a_job_to_its_rank_0_or_the_rank_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("rt");
    let _ranks: Vec<Rank> = [0, 2]
        .iter()
        .map(|&r| Rank::start(&runtime, JOB, r, 3))
        .collect();
    socket_of(&runtime, 0);
    socket_of(&runtime, 2);
    // Resolved and greeted, then refused for want of a terminal: the name named a run.
    for args in [
        &["attach", "ddp"][..],
        &["attach", JOB][..],
        &["attach", "ddp", "--rank", "2"][..],
        &["attach", "ddp.j7x.rank0", "--rank", "2"][..],
    ] {
        let (_, stderr) = text(&headroom(&runtime, args));
        assert!(
            stderr.contains("attach draws the dashboard: run it in a terminal"),
            "{args:?}: {stderr}"
        );
    }
    for (args, says) in [
        (
            &["attach", "ddp", "--rank", "1"][..],
            "rank 1 of job j7x does not serve on this machine (ranks here: 0, 2)",
        ),
        (
            &["attach", "ddp", "--rank", "3"][..],
            "job j7x has 3 ranks (0-2): there is no rank 3",
        ),
        (&["attach", "--rank", "1"][..], "--rank needs a job"),
        (
            &["attach", "nope"][..],
            "no running run or job is named nope",
        ),
    ] {
        let out = headroom(&runtime, args);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
