//! `headroom ls`: the runs of this user that serve a stream, asked for their status; dead
//! runs' sockets are removed, never listed as live. A torchrun job's rank that died is
//! said as such: its socket stays while other ranks of its job serve (so every `ls`
//! meanwhile says which rank died), and goes with the last of them.
use std::path::PathBuf;

use headroom_core::protocol::{JobRank, RunStatusLine};

use crate::client::{self, ConnectError};
use crate::conn::Target;
use crate::rundir;

/// One socket in the runtime directory, and what became of asking it.
pub enum Found {
    Live(PathBuf, RunStatusLine),
    /// The process exists but did not answer in time.
    NotAnswering(PathBuf, String),
    /// A rank of a job whose process is gone (its socket was stale), as its socket's name
    /// says: `NAME.JOB.rankR`.
    Died {
        socket: PathBuf,
        job: JobRank,
    },
}

/// A live run, for resolving `attach NAME`.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveRun {
    pub name: String,
    pub pid: u32,
    pub socket: PathBuf,
    pub job: Option<JobRank>,
}

/// The job and rank a torchrun rank's run name carries (`NAME.JOB.rankR`); the world size
/// is not in the name (0).
pub fn job_of_name(name: &str) -> Option<JobRank> {
    let (rest, rank) = name.rsplit_once('.')?;
    let rank = rank.strip_prefix("rank")?.parse().ok()?;
    let (_, id) = rest.rsplit_once('.')?;
    (!id.is_empty()).then(|| JobRank {
        id: id.to_string(),
        rank,
        local_rank: rank,
        world_size: 0,
    })
}

/// Asks every socket; removes (and says so, through `said`) the stale ones, but keeps a
/// dead rank's while another rank of its job serves (see the module's note).
pub fn scan(said: &mut dyn FnMut(String)) -> std::io::Result<Vec<Found>> {
    let dir = rundir::dir()?;
    let mut found = Vec::new();
    let mut stale: Vec<(PathBuf, String)> = Vec::new();
    for sock in rundir::sockets(&dir)? {
        let pid = rundir::pid_of(&sock);
        match client::status(&Target::Unix(sock.clone()), None) {
            Ok(st) => found.push(Found::Live(sock, st)),
            Err(ConnectError::Refused(_)) => {
                let pid = pid.map_or("?".into(), |p| p.to_string());
                stale.push((sock, format!("pid {pid} is no longer serving")));
            }
            Err(e) if pid.is_some_and(|p| !rundir::pid_alive(p)) => {
                stale.push((sock, format!("its process is gone ({e})")));
            }
            Err(e) => found.push(Found::NotAnswering(sock, e.to_string())),
        }
    }
    for (sock, why) in stale {
        let name = rundir::name_of(&sock).unwrap_or_default();
        let job = job_of_name(&name);
        let siblings_serve = job.as_ref().is_some_and(|j| {
            found
                .iter()
                .any(|f| matches!(f, Found::Live(_, st) if st.job.as_ref().is_some_and(|l| l.id == j.id)))
        });
        if !siblings_serve {
            rundir::remove_run(&sock);
            said(format!(
                "removed the stale socket of run {name} ({why}): {}",
                sock.display()
            ));
        }
        if let Some(job) = job {
            found.push(Found::Died { socket: sock, job });
        }
    }
    Ok(found)
}

/// Live runs, for resolving `attach NAME`.
pub fn runs(found: &[Found]) -> Vec<LiveRun> {
    found
        .iter()
        .filter_map(|f| match f {
            Found::Live(sock, st) => Some(LiveRun {
                // The run's own name: a socket's file name is cut to fit the path limit
                // (a torchrun job's long id under a long runtime directory).
                name: st.run_name.clone(),
                pid: st.pid,
                socket: sock.clone(),
                job: st.job.clone(),
            }),
            Found::NotAnswering(..) | Found::Died { .. } => None,
        })
        .collect()
}

/// The job and rank of a found run, for grouping (`None`: a lone run).
fn job_of(f: &Found) -> Option<&JobRank> {
    match f {
        Found::Live(_, st) => st.job.as_ref(),
        Found::Died { job, .. } => Some(job),
        Found::NotAnswering(..) => None,
    }
}

/// The table `headroom ls` prints: lone runs first, then each job's ranks together in
/// rank order, each job followed by a line saying how many of its ranks serve.
pub fn table(found: &[Found]) -> Vec<String> {
    let mut order: Vec<&Found> = found.iter().collect();
    // Stable: lone runs keep their order; ranks gather by job, then by rank.
    order.sort_by(|a, b| {
        let key = |f: &Found| job_of(f).map(|j| (j.id.clone(), j.rank));
        key(a).cmp(&key(b))
    });
    let mut rows = vec![[
        "NAME".to_string(),
        "PID".into(),
        "JOB".into(),
        "DEVICE".into(),
        "STEP".into(),
        "STATUS".into(),
        "MEMORY".into(),
        "MICRO".into(),
        "VIEWERS".into(),
        "ADDRESS".into(),
    ]];
    for f in &order {
        rows.push(match f {
            Found::Live(sock, st) => {
                let mut address = sock.display().to_string();
                if let Some(tcp) = &st.tcp {
                    address += &format!(" tcp {tcp}");
                }
                [
                    st.run_name.clone(),
                    st.pid.to_string(),
                    st.job.as_ref().map_or("-".into(), |j| {
                        format!("{} rank {}/{}", j.id, j.rank, j.world_size)
                    }),
                    st.device.clone(),
                    format!("{}/{}", st.step, st.total_steps),
                    st.status.clone(),
                    st.usage
                        .map_or("-".into(), |u| format!("{:.1}%", u * 100.0)),
                    st.micro_batch.map_or("-".into(), |m| m.to_string()),
                    st.viewers.to_string(),
                    address,
                ]
            }
            Found::Died { socket, job } => [
                rundir::name_of(socket).unwrap_or_default(),
                rundir::pid_of(socket).map_or("?".into(), |p| p.to_string()),
                format!("{} rank {}", job.id, job.rank),
                "-".into(),
                "-".into(),
                "died".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                format!("{} (stale: its process is gone)", socket.display()),
            ],
            Found::NotAnswering(sock, why) => [
                rundir::name_of(sock).unwrap_or_default(),
                rundir::pid_of(sock).map_or("?".into(), |p| p.to_string()),
                "?".into(),
                "?".into(),
                "?".into(),
                "not answering".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                format!("{} ({why})", sock.display()),
            ],
        });
    }
    let last = rows[0].len() - 1;
    let widths: Vec<usize> = (0..=last)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut lines: Vec<String> = rows
        .iter()
        .map(|r| {
            r.iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| {
                    if i == last {
                        c.clone()
                    } else {
                        format!("{c:<w$}")
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        })
        .collect();
    lines.extend(job_lines(&order));
    lines
}

/// Per job: how many of its ranks serve, which died (their process is gone) or failed
/// (they serve, and say their run failed), and which are missing (on another machine,
/// which this runtime directory cannot see, or gone before this `ls` could see them).
fn job_lines(order: &[&Found]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let Some(job) = job_of(order[i]) else {
            i += 1;
            continue;
        };
        let members: Vec<&Found> = order[i..]
            .iter()
            .take_while(|f| job_of(f).is_some_and(|j| j.id == job.id))
            .copied()
            .collect();
        i += members.len();
        let rank_list = |pick: &dyn Fn(&Found) -> bool| -> Vec<u32> {
            members
                .iter()
                .filter(|f| pick(f))
                .filter_map(|f| job_of(f).map(|j| j.rank))
                .collect()
        };
        let serving = rank_list(&|f| matches!(f, Found::Live(..)));
        let died = rank_list(&|f| matches!(f, Found::Died { .. }));
        let failed = rank_list(&|f| matches!(f, Found::Live(_, st) if st.status == "failed"));
        let world = members
            .iter()
            .filter_map(|f| job_of(f).map(|j| j.world_size))
            .max()
            .unwrap_or(0);
        let missing: Vec<u32> = (0..world)
            .filter(|r| !serving.contains(r) && !died.contains(r))
            .collect();
        let of_world = if world > 0 {
            format!(" of {world}")
        } else {
            String::new()
        };
        let mut line = format!(
            "job {}: {}{of_world} ranks serving here",
            job.id,
            serving.len()
        );
        let list = |ranks: &[u32]| {
            ranks
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !died.is_empty() {
            line += &format!("; rank {} died (its process is gone)", list(&died));
        }
        if !failed.is_empty() {
            line += &format!("; rank {} failed", list(&failed));
        }
        if !missing.is_empty() {
            line += &format!(
                " (not here: rank {}; another machine, or gone)",
                list(&missing)
            );
        }
        out.push(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(name: &str, pid: u32, job: Option<(&str, u32, u32)>) -> Found {
        Found::Live(
            PathBuf::from(format!("/run/{name}-{pid}.sock")),
            RunStatusLine {
                run_name: name.into(),
                pid,
                status: "running".into(),
                job: job.map(|(id, rank, world)| JobRank {
                    id: id.into(),
                    rank,
                    local_rank: rank,
                    world_size: world,
                }),
                ..RunStatusLine::default()
            },
        )
    }

    #[test]
    fn ranks_of_a_job_are_listed_together_in_rank_order_and_missing_ones_said() {
        let found = vec![
            live("train.j1.rank2", 12, Some(("j1", 2, 4))),
            live("solo", 10, None),
            live("train.j2.rank0", 20, Some(("j2", 0, 1))),
            live("train.j1.rank0", 11, Some(("j1", 0, 4))),
        ];
        let lines = table(&found);
        let names: Vec<&str> = lines[1..5]
            .iter()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(
            names,
            ["solo", "train.j1.rank0", "train.j1.rank2", "train.j2.rank0"]
        );
        assert!(lines[2].contains("j1 rank 0/4"), "{}", lines[2]);
        assert_eq!(
            lines[5],
            "job j1: 2 of 4 ranks serving here (not here: rank 1, 3; another machine, or gone)"
        );
        assert_eq!(lines[6], "job j2: 1 of 1 ranks serving here");
        assert_eq!(lines.len(), 7);
    }

    #[test]
    fn a_rank_that_died_or_failed_is_said_as_such() {
        let mut failed = live("ddp.j1.rank2", 13, Some(("j1", 2, 4)));
        if let Found::Live(_, st) = &mut failed {
            st.status = "failed".into();
        }
        let found = vec![
            live("ddp.j1.rank0", 11, Some(("j1", 0, 4))),
            Found::Died {
                socket: PathBuf::from("/run/ddp.j1.rank1-12.sock"),
                job: job_of_name("ddp.j1.rank1").unwrap(),
            },
            failed,
        ];
        let lines = table(&found);
        assert!(lines[2].starts_with("ddp.j1.rank1 "), "{}", lines[2]);
        assert!(lines[2].contains("died"), "{}", lines[2]);
        assert_eq!(
            lines.last().unwrap(),
            "job j1: 2 of 4 ranks serving here; rank 1 died (its process is gone); rank 2 \
             failed (not here: rank 3; another machine, or gone)"
        );
    }

    #[test]
    fn a_ranks_name_says_its_job_and_rank() {
        let j = job_of_name("my.model.4f2a.rank3").unwrap();
        assert_eq!((j.id.as_str(), j.rank), ("4f2a", 3));
        assert!(job_of_name("tiny").is_none());
        assert!(job_of_name("rank0").is_none());
        assert!(job_of_name("a.rank").is_none());
    }
}
