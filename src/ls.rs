//! `headroom ls`: the runs of this user that serve a stream, asked for their status; dead
//! runs' sockets are removed, never listed.
use std::path::PathBuf;

use headroom_core::protocol::RunStatusLine;

use crate::client::{self, ConnectError};
use crate::conn::Target;
use crate::rundir;

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

/// The table `headroom ls` prints.
pub fn table(found: &[Found]) -> Vec<String> {
    let mut rows = vec![[
        "NAME".to_string(),
        "PID".into(),
        "DEVICE".into(),
        "STEP".into(),
        "STATUS".into(),
        "MEMORY".into(),
        "MICRO".into(),
        "VIEWERS".into(),
        "ADDRESS".into(),
    ]];
    for f in found {
        rows.push(match f {
            Found::Live(sock, st) => {
                let mut address = sock.display().to_string();
                if let Some(tcp) = &st.tcp {
                    address += &format!(" tcp {tcp}");
                }
                [
                    st.run_name.clone(),
                    st.pid.to_string(),
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
                "not answering".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                format!("{} ({why})", sock.display()),
            ],
        });
    }
    let widths: Vec<usize> = (0..9)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            r.iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| {
                    if i == 8 {
                        c.clone()
                    } else {
                        format!("{c:<w$}")
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
        })
        .collect()
}
