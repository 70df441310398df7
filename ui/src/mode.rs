//! How this screen stands to the run it shows: inside the run's own process, attached to
//! it over a socket, or replaying its log. Kept apart from the run's state so that a
//! reconnect can start the run's state afresh while these stay.
use headroom_core::units::fmt_duration;

use crate::feed::ReplayState;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Mode {
    /// The dashboard of `headroom train`: `q` stops the run.
    #[default]
    InProcess,
    /// A viewer of a running run: `q` detaches, stopping the run asks first.
    Attached { address: String },
    /// A finished (or growing) log: read-only, with replay controls.
    Replay { source: String },
}

impl Mode {
    pub fn is_replay(&self) -> bool {
        matches!(self, Mode::Replay { .. })
    }

    pub fn is_attached(&self) -> bool {
        matches!(self, Mode::Attached { .. })
    }

    /// What the header says about where the picture comes from; nothing in-process.
    pub fn tag(&self) -> Option<String> {
        match self {
            Mode::InProcess => None,
            Mode::Attached { address } => Some(format!("attached to {address}")),
            Mode::Replay { source } => Some(format!("replay of {source}")),
        }
    }
}

/// The connection to the run as the screen shows it.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum LinkView {
    #[default]
    Up,
    /// Dropped; the client retries (`(attempt, in seconds)` once it said when).
    Lost {
        reason: String,
        retry: Option<(u32, f64)>,
    },
    /// Over for good: the run ended or the server refused this viewer.
    Closed { reason: String },
}

impl LinkView {
    pub fn is_up(&self) -> bool {
        *self == LinkView::Up
    }

    /// The banner line shown instead of the keys while the link is not up.
    pub fn banner(&self) -> Option<String> {
        match self {
            LinkView::Up => None,
            LinkView::Lost {
                reason,
                retry: Some((attempt, in_s)),
            } => Some(format!(
                "connection lost: {reason} · retrying in {} (attempt {attempt}) · q detaches",
                fmt_wait(*in_s)
            )),
            LinkView::Lost {
                reason,
                retry: None,
            } => Some(format!("connection lost: {reason} · retrying · q detaches")),
            LinkView::Closed { reason } => Some(format!(
                "connection closed: {reason} · last picture kept · q closes"
            )),
        }
    }
}

/// `2 s`, `0.5 s`, `1m30s`.
fn fmt_wait(secs: f64) -> String {
    if secs < 10.0 {
        let s = format!("{secs:.1}");
        format!("{} s", s.trim_end_matches('0').trim_end_matches('.'))
    } else {
        fmt_duration(secs)
    }
}

/// The replay as the footer shows it, given at each frame (time is handed in).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayView {
    pub position: f64,
    pub total: f64,
    pub speed: f64,
    pub paused: bool,
    pub ended: bool,
    pub following: bool,
}

impl ReplayView {
    pub fn of(state: &ReplayState, position: f64) -> ReplayView {
        ReplayView {
            position,
            total: state.total.max(position),
            speed: state.speed,
            paused: state.paused,
            ended: state.ended,
            following: state.following,
        }
    }

    /// Equal as drawn: positions within the same second.
    pub fn looks_like(&self, other: &ReplayView) -> bool {
        let whole = |v: &ReplayView| ReplayView {
            position: v.position.floor(),
            total: v.total.floor(),
            ..*v
        };
        whole(self) == whole(other)
    }

    /// `▶ 4× 1m05s / 10m00s`, `paused · 1/2× · …`, `end of log · …`.
    pub fn status_line(&self) -> String {
        let state = if self.ended {
            "end of log"
        } else if self.paused {
            "paused"
        } else if self.following {
            "▶ following"
        } else {
            "▶"
        };
        format!(
            "{state} · {} · {} / {}",
            fmt_speed(self.speed),
            fmt_duration(self.position),
            fmt_duration(self.total)
        )
    }
}

/// `2×`, `1/4×`, `1024×`.
pub fn fmt_speed(speed: f64) -> String {
    if speed >= 1.0 {
        format!("{speed:.0}×")
    } else {
        format!("1/{:.0}×", 1.0 / speed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_and_waits_read_naturally() {
        assert_eq!(fmt_speed(1.0), "1×");
        assert_eq!(fmt_speed(0.0625), "1/16×");
        assert_eq!(fmt_speed(1024.0), "1024×");
        assert_eq!(fmt_wait(2.0), "2 s");
        assert_eq!(fmt_wait(0.5), "0.5 s");
        assert_eq!(fmt_wait(90.0), "1m30s");
    }

    #[test]
    fn the_banner_says_what_happened_and_what_q_does() {
        let lost = LinkView::Lost {
            reason: "the server closed the connection".into(),
            retry: Some((2, 2.0)),
        };
        let text = lost.banner().unwrap();
        assert!(
            text.starts_with("connection lost: the server closed"),
            "{text}"
        );
        assert!(text.contains("retrying in 2 s"), "{text}");
        assert!(LinkView::Up.banner().is_none());
    }
}
