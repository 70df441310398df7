//! The viewer's side of the stream protocol: the handshake, `headroom ls`'s status query,
//! and what an attach argument names (a run, a job, a job's rank). The dashboard's feed
//! over the connection is [`crate::attach`]'s.
use std::io::{self, BufReader};
use std::path::Path;
use std::time::Duration;

use headroom_core::protocol::{
    check_version, version_string, ClientHello, ClientLine, JobRank, RunStatusLine, ServerControl,
    ServerHello, ServerLine, Want, MAX_SERVER_LINE,
};

use crate::conn::{read_line_limited, send_line, Conn, Target};
use crate::ls::LiveRun;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a connection could not be made, for the one line the user is shown.
#[derive(Debug)]
pub enum ConnectError {
    /// Nothing listens there (a stale socket, a wrong port).
    Refused(String),
    /// Something answered, but not as a headroom run would, or refused us with a reason.
    Refusal(String),
    Other(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Refused(s) | ConnectError::Refusal(s) | ConnectError::Other(s) => {
                f.write_str(s)
            }
        }
    }
}

/// An open, greeted connection.
pub struct Session {
    pub hello: ServerHello,
    pub conn: Conn,
    pub reader: BufReader<Conn>,
}

/// Connects and greets: our hello, then the server's (or its one error line).
pub fn handshake(
    target: &Target,
    token: Option<&str>,
    want: Want,
) -> Result<Session, ConnectError> {
    let mut conn = Conn::connect(target, CONNECT_TIMEOUT).map_err(|e| match e.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => {
            ConnectError::Refused(format!("nothing answers at {target} ({e})"))
        }
        _ => ConnectError::Other(format!("cannot connect to {target}: {e}")),
    })?;
    let hello = ClientLine::Hello(ClientHello {
        protocol: version_string(),
        client: "headroom".into(),
        client_version: env!("CARGO_PKG_VERSION").into(),
        want,
        token: token.map(str::to_string),
    });
    let io_err = |e: io::Error| ConnectError::Other(format!("{target}: {e}"));
    send_line(&mut conn, &hello.to_line()).map_err(io_err)?;
    conn.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(io_err)?;
    let mut reader = BufReader::new(conn.try_clone().map_err(io_err)?);
    let first = read_line_limited(&mut reader, MAX_SERVER_LINE)
        .map_err(|e| ConnectError::Other(format!("{target} did not answer: {e}")))?
        .ok_or_else(|| ConnectError::Refusal(format!("{target} closed the connection")))?;
    match ServerLine::parse(&first) {
        Ok(ServerLine::Control(ServerControl::Hello(hello))) => {
            check_version(&hello.protocol).map_err(ConnectError::Refusal)?;
            conn.set_read_timeout(None).map_err(io_err)?;
            Ok(Session {
                hello,
                conn,
                reader,
            })
        }
        Ok(ServerLine::Control(ServerControl::Error { message, .. })) => Err(
            ConnectError::Refusal(format!("{target} refused the connection: {message}")),
        ),
        _ => Err(ConnectError::Refusal(format!(
            "{target} is not a headroom run (it answered something else)"
        ))),
    }
}

/// A run's one-line status (what `headroom ls` shows).
pub fn status(target: &Target, token: Option<&str>) -> Result<RunStatusLine, ConnectError> {
    let mut s = handshake(target, token, Want::Status)?;
    s.conn
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| ConnectError::Other(e.to_string()))?;
    match read_line_limited(&mut s.reader, MAX_SERVER_LINE) {
        Ok(Some(line)) => match ServerLine::parse(&line) {
            Ok(ServerLine::Control(ServerControl::RunStatus(st))) => Ok(st),
            _ => Err(ConnectError::Refusal(format!(
                "{target} answered the status query with something else"
            ))),
        },
        _ => Err(ConnectError::Other(format!(
            "{target} did not say its status"
        ))),
    }
}

/// What an attach argument named: where to connect, and the job and rank it is when it
/// is a torchrun rank on this machine.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub target: Target,
    pub job: Option<JobRank>,
}

impl Resolved {
    fn of(run: &LiveRun) -> Resolved {
        Resolved {
            target: Target::Unix(run.socket.clone()),
            job: run.job.clone(),
        }
    }
}

/// An attach argument: a socket path, `HOST:PORT`, a run's name (or `name-pid`, or a pid)
/// among the local runs, or a torchrun job: its id, or the name its ranks share before
/// `.JOB.rankR`, which means its rank 0 (or `rank`).
pub fn target_of(arg: &str, runs: &[LiveRun], rank: Option<u32>) -> Result<Resolved, String> {
    let p = Path::new(arg);
    if arg.contains('/') || arg.ends_with(".sock") {
        let run = runs.iter().find(|r| r.socket == p);
        return match (run, rank) {
            (Some(run), Some(r)) => rank_of_job(run, runs, r),
            (Some(run), None) => Ok(Resolved::of(run)),
            (None, Some(_)) => Err(format!(
                "--rank needs a job: {arg} is not a socket of a job's rank here (see `headroom ls`)"
            )),
            (None, None) => Ok(Resolved {
                target: Target::Unix(p.to_path_buf()),
                job: None,
            }),
        };
    }
    let matches: Vec<&LiveRun> = runs
        .iter()
        .filter(|r| {
            r.name == arg || format!("{}-{}", r.name, r.pid) == arg || r.pid.to_string() == arg
        })
        .collect();
    match matches.as_slice() {
        [one] => {
            return match rank {
                Some(r) => rank_of_job(one, runs, r),
                None => Ok(Resolved::of(one)),
            }
        }
        [] => {}
        many => {
            return Err(format!(
                "{} runs are named {arg}: give one as NAME-PID ({})",
                many.len(),
                many.iter()
                    .map(|r| format!("{}-{}", r.name, r.pid))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }
    }
    // A job, by its id or by the name its ranks share.
    let mut jobs: Vec<&str> = runs
        .iter()
        .filter_map(|r| {
            let j = r.job.as_ref()?;
            let by_base = r.name == format!("{arg}.{}.rank{}", j.id, j.rank);
            (j.id == arg || by_base).then_some(j.id.as_str())
        })
        .collect();
    jobs.sort_unstable();
    jobs.dedup();
    match jobs.as_slice() {
        [id] => return rank_in(id, runs, rank.unwrap_or(0)),
        [] => {}
        many => {
            return Err(format!(
                "{} jobs run as {arg}: give one by its id ({})",
                many.len(),
                many.join(", ")
            ))
        }
    }
    if arg
        .rsplit_once(':')
        .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
    {
        if rank.is_some() {
            return Err(format!(
                "--rank picks among this machine's ranks; a remote rank is attached by its own \
                 HOST:PORT (attaching rank 0's, {arg}, shows every rank's row)"
            ));
        }
        return Ok(Resolved {
            target: Target::Tcp(arg.to_string()),
            job: None,
        });
    }
    Err(format!(
        "no running run or job is named {arg} (see `headroom ls`); give a run's name, a job's \
         id or name, its socket's path or HOST:PORT"
    ))
}

/// Rank `rank` of the job `run` belongs to.
fn rank_of_job(run: &LiveRun, runs: &[LiveRun], rank: u32) -> Result<Resolved, String> {
    match &run.job {
        Some(j) => rank_in(&j.id, runs, rank),
        None => Err(format!(
            "--rank needs a job: {} is a lone run, not a rank of a torchrun job",
            run.name
        )),
    }
}

/// Rank `rank` of job `id` among this machine's runs, or why it is not here.
pub fn rank_in(id: &str, runs: &[LiveRun], rank: u32) -> Result<Resolved, String> {
    let ranks: Vec<&LiveRun> = runs
        .iter()
        .filter(|r| r.job.as_ref().is_some_and(|j| j.id == id))
        .collect();
    if let Some(run) = ranks
        .iter()
        .find(|r| r.job.as_ref().is_some_and(|j| j.rank == rank))
    {
        return Ok(Resolved::of(run));
    }
    let world = ranks
        .iter()
        .filter_map(|r| r.job.as_ref().map(|j| j.world_size))
        .max()
        .unwrap_or(0);
    let here: Vec<String> = ranks
        .iter()
        .filter_map(|r| r.job.as_ref().map(|j| j.rank.to_string()))
        .collect();
    if world > 0 && rank >= world {
        return Err(format!(
            "job {id} has {world} ranks (0-{}): there is no rank {rank}",
            world - 1
        ));
    }
    Err(format!(
        "rank {rank} of job {id} does not serve on this machine (ranks here: {}); a rank on \
         another machine is attached by its HOST:PORT and token (rank 0's shows every rank's \
         row), see `headroom ls` there",
        here.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn rank(base: &str, job: &str, r: u32, pid: u32) -> LiveRun {
        LiveRun {
            name: format!("{base}.{job}.rank{r}"),
            pid,
            socket: PathBuf::from(format!("/rt/{base}.{job}.rank{r}-{pid}.sock")),
            job: Some(JobRank {
                id: job.into(),
                rank: r,
                local_rank: r,
                world_size: 2,
            }),
        }
    }

    #[test]
    fn a_shared_name_of_two_jobs_asks_for_the_id_and_a_rank_name_is_that_rank() {
        let runs = vec![
            rank("ddp", "a1", 1, 11),
            rank("ddp", "a1", 0, 10),
            rank("ddp", "b2", 0, 20),
        ];
        let err = target_of("ddp", &runs, None).unwrap_err();
        assert!(
            err.contains("2 jobs run as ddp") && err.contains("a1, b2"),
            "{err}"
        );
        let r = target_of("a1", &runs, None).unwrap();
        assert_eq!(
            r.target,
            Target::Unix(runs[1].socket.clone()),
            "rank 0 first"
        );
        let r = target_of("ddp.a1.rank1", &runs, None).unwrap();
        assert_eq!(r.job.map(|j| j.rank), Some(1));
        let err = target_of("host:7000", &runs, Some(1)).unwrap_err();
        assert!(err.contains("its own HOST:PORT"), "{err}");
    }
}
