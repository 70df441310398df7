//! `headroom ls`: the runs of this user that serve a stream, asked for their status; dead
//! runs' sockets are removed, never listed.
use std::path::PathBuf;

use headroom_core::protocol::{JobRank, RunStatusLine};

use crate::client::{self, ConnectError};
use headroom_host::conn::Target;
use headroom_host::rundir;

/// One socket in the runtime directory, and what became of asking it.
pub enum Found {
    Live(PathBuf, RunStatusLine),
    /// The process exists but did not answer in time.
    NotAnswering(PathBuf, String),
}

/// Asks every socket; removes (and says so, through `said`) the stale ones.
pub fn scan(said: &mut dyn FnMut(String)) -> std::io::Result<Vec<Found>> {
    let dir = rundir::dir()?;
    let mut found = Vec::new();
    for sock in rundir::sockets(&dir)? {
        let pid = rundir::pid_of(&sock);
        let name = rundir::name_of(&sock).unwrap_or_default();
        match client::status(&Target::Unix(sock.clone()), None) {
            Ok(st) => found.push(Found::Live(sock, st)),
            Err(ConnectError::Refused(_)) => {
                rundir::remove_run(&sock);
                let pid = pid.map_or("?".into(), |p| p.to_string());
                said(format!(
                    "removed the stale socket of run {name} (pid {pid} is no longer serving): {}",
                    sock.display()
                ));
            }
            Err(e) if pid.is_some_and(|p| !rundir::pid_alive(p)) => {
                rundir::remove_run(&sock);
                said(format!(
                    "removed the socket of run {name}: its process is gone ({e})"
                ));
            }
            Err(e) => found.push(Found::NotAnswering(sock, e.to_string())),
        }
    }
    Ok(found)
}

/// Live runs as (name, pid, socket), for resolving `attach NAME`.
pub fn runs(found: &[Found]) -> Vec<(String, u32, PathBuf)> {
    found
        .iter()
        .filter_map(|f| match f {
            Found::Live(sock, st) => Some((
                rundir::name_of(sock).unwrap_or_else(|| st.run_name.clone()),
                st.pid,
                sock.clone(),
            )),
            Found::NotAnswering(..) => None,
        })
        .collect()
}

/// The job and rank of a found run, for grouping (`None`: a lone run).
fn job_of(f: &Found) -> Option<&JobRank> {
    match f {
        Found::Live(_, st) => st.job.as_ref(),
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

/// Per job: how many of its ranks serve, and which are missing (a rank that died, or
/// one on another machine, which this runtime directory cannot see).
fn job_lines(order: &[&Found]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let Some(job) = job_of(order[i]) else {
            i += 1;
            continue;
        };
        let ranks: Vec<&JobRank> = order[i..]
            .iter()
            .map_while(|f| job_of(f).filter(|j| j.id == job.id))
            .collect();
        i += ranks.len();
        let world = ranks.iter().map(|j| j.world_size).max().unwrap_or(0);
        let missing: Vec<String> = (0..world)
            .filter(|r| !ranks.iter().any(|j| j.rank == *r))
            .map(|r| r.to_string())
            .collect();
        let mut line = format!(
            "job {}: {} of {world} ranks serving here",
            job.id,
            ranks.len()
        );
        if !missing.is_empty() {
            line += &format!(
                " (not here: rank {}; another machine, or gone)",
                missing.join(", ")
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
}
