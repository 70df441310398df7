//! The telemetry stream as a wire protocol (docs/PROTOCOL.md is the spec; a test keeps the
//! two in step).
//!
//! Newline-delimited JSON objects, each with a `kind`. The client speaks first, so nothing
//! of the run is sent to a client that has not shown it may see it: its `hello` names the
//! protocol version it speaks (and carries the token on TCP). The server answers with its
//! own `hello` (or one `error` line, and closes), then a catch-up — the run's start record,
//! the state in force and a bounded recent history, exactly as [`Record`] lines — then
//! `caught_up`, then the live stream. Commands go back on the same connection as
//! `{"kind":"command", ...}` lines and are answered, to every viewer, by the records the
//! trainer already sends (`command_applied`, `thresholds_changed`, `status`).
use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::Command;
use crate::record::Record;
use crate::telemetry::{kept_sample_slot, Telemetry};

/// This build's protocol version. A different major version is refused with an `error`
/// line; a newer minor version is accepted (records of kinds a reader does not know are
/// skipped).
pub const PROTOCOL_MAJOR: u32 = 1;
pub const PROTOCOL_MINOR: u32 = 0;

/// The longest line a server accepts from a client: a command is a few hundred bytes.
pub const MAX_CLIENT_LINE: usize = 64 * 1024;
/// The longest line a client accepts from a server: a run's start record carries the whole
/// config, a segment map a few thousand segments.
pub const MAX_SERVER_LINE: usize = 16 * 1024 * 1024;

/// `"1.0"`: what a hello carries.
pub fn version_string() -> String {
    format!("{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}")
}

/// Checks the other side's version; the error is the line to show or send.
pub fn check_version(theirs: &str) -> Result<(), String> {
    let major = theirs
        .split('.')
        .next()
        .and_then(|m| m.trim().parse::<u32>().ok());
    match major {
        Some(PROTOCOL_MAJOR) => Ok(()),
        Some(m) => Err(format!(
            "protocol version {theirs} is not spoken here (this side speaks {}, major \
             {PROTOCOL_MAJOR}); use a headroom of the same major version ({m}.x) on both sides",
            version_string()
        )),
        None => Err(format!(
            "protocol version \"{theirs}\" is not a version (expected MAJOR.MINOR, e.g. \"{}\")",
            version_string()
        )),
    }
}

/// What a client wants from the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Want {
    /// The catch-up and the live stream; commands accepted.
    #[default]
    Stream,
    /// One `run_status` line, then the server closes (what `headroom ls` asks).
    Status,
}

/// The client's first line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientHello {
    /// `MAJOR.MINOR`.
    pub protocol: String,
    /// The client program, e.g. `headroom attach`.
    pub client: String,
    #[serde(default)]
    pub client_version: String,
    #[serde(default)]
    pub want: Want,
    /// Required on TCP; ignored on the owner-only Unix socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// The server's first line, once the client's hello is accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerHello {
    pub protocol: String,
    /// Unique for the run's process: `<run name>-<pid>-<start time>`.
    pub run_id: String,
    pub run_name: String,
    /// The program producing the stream (`headroom train`, the Python package, ...).
    pub producer: String,
    pub producer_version: String,
    pub pid: u32,
    /// Whether this connection may send commands (false: read-only).
    pub commands: bool,
}

/// A one-line answer to `want: status`: enough for `headroom ls`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RunStatusLine {
    pub run_name: String,
    pub pid: u32,
    pub device: String,
    /// The last completed optimizer step.
    pub step: u64,
    pub total_steps: u64,
    /// `starting`, `running`, `paused`, `stopping`, `finished`, `failed`.
    pub status: String,
    /// The last step's peak as a share of its limit.
    pub usage: Option<f64>,
    pub micro_batch: Option<usize>,
    /// Connected viewers, this one excluded.
    pub viewers: usize,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// `HOST:PORT` when the run also listens on TCP.
    pub tcp: Option<String>,
    /// The multi-process job this run is one rank of (torchrun); absent for a lone run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobRank>,
}

/// One rank of a multi-process job, as torchrun names it (`TORCHELASTIC_RUN_ID`, `RANK`,
/// `LOCAL_RANK`, `WORLD_SIZE`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRank {
    pub id: String,
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
}

/// Error codes of an `error` line.
pub mod code {
    /// The first line was not a hello.
    pub const HANDSHAKE: &str = "handshake";
    /// A major version this side does not speak.
    pub const VERSION: &str = "version";
    /// No token or a wrong one (TCP).
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// Another user's process on the Unix socket.
    pub const FORBIDDEN: &str = "forbidden";
    /// A line that is not JSON, or not a line this side understands.
    pub const BAD_LINE: &str = "bad_line";
    /// A line longer than the limit: the connection is closed.
    pub const TOO_LONG: &str = "too_long";
    /// A command that cannot be applied (the run is over, the queue is full, ...).
    pub const COMMAND: &str = "command_refused";
    /// More commands than the rate allows.
    pub const FLOOD: &str = "flood";
    /// The viewer did not read fast enough to keep events: it is disconnected.
    pub const TOO_SLOW: &str = "too_slow";
    /// Too many viewers at once.
    pub const BUSY: &str = "busy";
}

/// Lines from a client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ClientLine {
    Hello(ClientHello),
    /// `{"kind":"command","command":"pause"}`: the command's own tag and fields beside
    /// `kind`.
    Command(Command),
}

impl ClientLine {
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("client lines serialize")
    }

    /// Parses a client line; the error is the text of the `error` line to answer with.
    pub fn parse(line: &str) -> Result<ClientLine, String> {
        let value: Value =
            serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
        let kind = value
            .get("kind")
            .and_then(Value::as_str)
            .ok_or("a line without a \"kind\" (expected \"hello\" or \"command\")")?
            .to_string();
        serde_json::from_value(value).map_err(|e| match kind.as_str() {
            "hello" | "command" => format!("bad \"{kind}\" line: {e}"),
            _ => format!("unknown kind \"{kind}\" (expected \"hello\" or \"command\")"),
        })
    }
}

/// Protocol lines from the server that are not records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ServerControl {
    Hello(ServerHello),
    /// The catch-up is over; what follows is live.
    CaughtUp {
        records: usize,
    },
    /// The answer to `want: status`.
    RunStatus(RunStatusLine),
    /// High-rate records (samples, segment maps) this viewer missed because it read too
    /// slowly; events are never dropped this way.
    Dropped {
        records: u64,
    },
    /// Something this client did wrong, or why it is being disconnected (`fatal`).
    Error {
        code: String,
        message: String,
        fatal: bool,
    },
}

impl ServerControl {
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("server lines serialize")
    }

    pub fn error(code: &str, message: impl Into<String>, fatal: bool) -> ServerControl {
        ServerControl::Error {
            code: code.to_string(),
            message: message.into(),
            fatal,
        }
    }
}

/// A line from the server: a protocol line or a record.
#[derive(Debug, Clone, PartialEq)]
// A record is the large one and by far the most common line: boxing it would allocate
// twice per line for nothing.
#[allow(clippy::large_enum_variant)]
pub enum ServerLine {
    Control(ServerControl),
    Record(Record),
}

/// The kinds [`ServerControl`] uses; every other kind is a record's.
const CONTROL_KINDS: [&str; 5] = ["hello", "caught_up", "run_status", "dropped", "error"];

impl ServerLine {
    /// Parses a server line. A record of a kind this build does not know is
    /// `Err(BadRecord::UnknownKind)`, which a reader skips.
    pub fn parse(line: &str) -> Result<ServerLine, crate::record::BadRecord> {
        use crate::record::BadRecord;
        let value: Value =
            serde_json::from_str(line).map_err(|e| BadRecord::NotJson(e.to_string()))?;
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
        if CONTROL_KINDS.contains(&kind) {
            let kind = kind.to_string();
            return serde_json::from_value(value)
                .map(ServerLine::Control)
                .map_err(|e| BadRecord::BadFields {
                    kind,
                    error: e.to_string(),
                });
        }
        Record::from_value(value).map(ServerLine::Record)
    }
}

/// How much recent history a catch-up carries: what the dashboard's charts and event log
/// hold (512 chart points, 500 log entries), so an attached screen starts full.
#[derive(Debug, Clone, Copy)]
pub struct CatchUpLimits {
    /// Steps (each with its `step_memory` record).
    pub steps: usize,
    /// Host/device samples: the memory chart is drawn from them.
    pub samples: usize,
    /// Everything that lands in the event log.
    pub events: usize,
}

impl Default for CatchUpLimits {
    fn default() -> CatchUpLimits {
        CatchUpLimits {
            steps: 512,
            samples: 1200,
            events: 500,
        }
    }
}

/// The state a newly attached viewer needs, kept from the records as they pass: the
/// run's start, the state in force (thresholds, status, the micro-batch pin, the end), the
/// latest sample and segment map, and bounded recent history. Records keep their order.
#[derive(Debug, Clone)]
pub struct CatchUp {
    limits: CatchUpLimits,
    seq: u64,
    started: Option<(u64, Record)>,
    thresholds: Option<(u64, Record)>,
    status: Option<(u64, Record)>,
    pin: Option<(u64, Record)>,
    ended: Option<(u64, Record)>,
    segments: Option<(u64, Record)>,
    /// The latest split of a step's memory (the memory panel's stacked bar).
    plan_split: Option<(u64, Record)>,
    /// A job's latest rows (rank 0 of a torchrun job): one per step, only the last counts.
    job_ranks: Option<(u64, Record)>,
    steps: VecDeque<(u64, Record)>,
    samples: VecDeque<(u64, Record)>,
    events: VecDeque<(u64, Record)>,
}

impl CatchUp {
    pub fn new(limits: CatchUpLimits) -> CatchUp {
        CatchUp {
            limits,
            seq: 0,
            started: None,
            thresholds: None,
            status: None,
            pin: None,
            ended: None,
            segments: None,
            plan_split: None,
            job_ranks: None,
            steps: VecDeque::new(),
            samples: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// Takes note of one record of the stream.
    pub fn keep(&mut self, r: &Record) {
        self.seq += 1;
        let item = (self.seq, r.clone());
        let push = |q: &mut VecDeque<(u64, Record)>, cap: usize, item| {
            if q.len() >= cap {
                q.pop_front();
            }
            if cap > 0 {
                q.push_back(item);
            }
        };
        match &r.msg {
            Telemetry::RunStarted(_) => self.started = Some(item),
            Telemetry::Step(_) | Telemetry::StepMemory(_) => {
                // Two records per step.
                push(&mut self.steps, self.limits.steps * 2, item)
            }
            // One reading a slot, the highest, as the log keeps them: the catch-up's
            // chart spans the same time at any sampler rate.
            Telemetry::Sample(s) => {
                // Whether this slot's reading so far holds at least as much memory.
                let kept_higher = self.samples.back().and_then(|(_, last)| match &last.msg {
                    Telemetry::Sample(k) if kept_sample_slot(last.t) == kept_sample_slot(r.t) => {
                        Some(k.memory_used() >= s.memory_used())
                    }
                    _ => None,
                });
                match kept_higher {
                    None => push(&mut self.samples, self.limits.samples, item),
                    Some(false) => *self.samples.back_mut().expect("this slot's reading") = item,
                    Some(true) => {}
                }
            }
            // A plan's check of every step is for the log; no view draws it, and in the
            // event history it would push the run's events out of the catch-up.
            Telemetry::PlanCheck(_) => {}
            Telemetry::Segments(_) => self.segments = Some(item),
            // The memory panel's split, sent at the start and after a lever switch: the
            // latest is in force however long ago it came.
            Telemetry::PlanSplit(_) => self.plan_split = Some(item),
            // Sent at every step: in the event history they would push the run's events
            // out of the catch-up.
            Telemetry::JobRanks(_) => self.job_ranks = Some(item),
            Telemetry::Finished(_) | Telemetry::Failed { .. } => {
                self.ended = Some(item.clone());
                push(&mut self.events, self.limits.events, item)
            }
            msg => {
                match msg {
                    Telemetry::ThresholdsChanged { .. } => self.thresholds = Some(item.clone()),
                    Telemetry::Status { .. } => self.status = Some(item.clone()),
                    Telemetry::CommandApplied {
                        command: Command::PinMicroBatch { .. } | Command::Unpin,
                        ..
                    } => self.pin = Some(item.clone()),
                    _ => {}
                }
                push(&mut self.events, self.limits.events, item)
            }
        }
    }

    /// What a viewer attaching now is sent before the live stream, oldest first.
    pub fn records(&self) -> Vec<Record> {
        let mut all: Vec<&(u64, Record)> = [
            &self.started,
            &self.thresholds,
            &self.status,
            &self.pin,
            &self.ended,
            &self.segments,
            &self.plan_split,
            &self.job_ranks,
        ]
        .into_iter()
        .flatten()
        .chain(self.steps.iter())
        .chain(self.samples.iter())
        .chain(self.events.iter())
        .collect();
        all.sort_by_key(|(seq, _)| *seq);
        all.dedup_by_key(|(seq, _)| *seq);
        all.into_iter().map(|(_, r)| r.clone()).collect()
    }

    /// The `run_status` answer, from what has passed.
    pub fn status_line(&self, pid: u32, viewers: usize, elapsed_s: f64) -> RunStatusLine {
        let mut line = RunStatusLine {
            pid,
            viewers,
            elapsed_s,
            status: "starting".into(),
            ..RunStatusLine::default()
        };
        if let Some((_, r)) = &self.started {
            if let Telemetry::RunStarted(info) = &r.msg {
                line.run_name = info.run_name.clone();
                line.device = info.device.clone();
                line.step = info.start_step;
                line.total_steps = info.total_steps;
            }
        }
        if let Some((_, r)) = &self.status {
            if let Telemetry::Status { status } = &r.msg {
                line.status = status.label().to_string();
            }
        }
        for (_, r) in &self.steps {
            match &r.msg {
                Telemetry::Step(s) => {
                    line.step = s.step;
                    line.total_steps = s.total_steps;
                    line.micro_batch = Some(s.micro_batch);
                }
                Telemetry::StepMemory(m) => line.usage = Some(m.usage),
                _ => {}
            }
        }
        match self.ended.as_ref().map(|(_, r)| &r.msg) {
            Some(Telemetry::Finished(s)) => {
                line.status = "finished".into();
                line.step = s.steps_done;
            }
            Some(Telemetry::Failed { .. }) => line.status = "failed".into(),
            _ => {}
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Thresholds;
    use crate::telemetry::{Level, Notice, RunStatus, SystemSample};

    #[test]
    fn versions_of_another_major_are_refused_with_a_clear_line() {
        assert!(check_version("1.0").is_ok());
        assert!(check_version("1.7").is_ok(), "newer minors are spoken");
        let e = check_version("2.0").unwrap_err();
        assert!(e.contains("2.0") && e.contains("major 1"), "{e}");
        assert!(check_version("banana").unwrap_err().contains("MAJOR.MINOR"));
    }

    #[test]
    fn client_lines_round_trip_and_commands_sit_beside_kind() {
        let cmd = ClientLine::Command(Command::SetThresholds {
            thresholds: Thresholds::default(),
        });
        let line = cmd.to_line();
        assert!(
            line.starts_with("{\"kind\":\"command\",\"command\":\"set_thresholds\""),
            "{line}"
        );
        assert_eq!(ClientLine::parse(&line), Ok(cmd));
        let pause = ClientLine::parse("{\"kind\":\"command\",\"command\":\"pause\"}");
        assert_eq!(pause, Ok(ClientLine::Command(Command::Pause)));
        let hello = ClientLine::parse("{\"kind\":\"hello\",\"protocol\":\"1.0\",\"client\":\"x\"}");
        assert!(matches!(hello, Ok(ClientLine::Hello(h)) if h.want == Want::Stream));
        assert!(ClientLine::parse("nonsense")
            .unwrap_err()
            .contains("not a JSON"));
        assert!(ClientLine::parse("{\"kind\":\"steal\"}")
            .unwrap_err()
            .contains("unknown kind"));
        assert!(
            ClientLine::parse("{\"kind\":\"command\",\"command\":\"explode\"}")
                .unwrap_err()
                .contains("bad \"command\" line"),
        );
    }

    #[test]
    fn server_lines_tell_protocol_from_records() {
        let hello = ServerControl::Hello(ServerHello {
            protocol: version_string(),
            run_id: "r-1-2".into(),
            run_name: "r".into(),
            producer: "headroom train".into(),
            producer_version: "0.1.0".into(),
            pid: 1,
            commands: true,
        });
        assert_eq!(
            ServerLine::parse(&hello.to_line()),
            Ok(ServerLine::Control(hello))
        );
        let rec = Record::new(1.0, 2.0, status(RunStatus::Paused));
        assert_eq!(
            ServerLine::parse(&rec.to_line()),
            Ok(ServerLine::Record(rec))
        );
    }

    fn status(s: RunStatus) -> Telemetry {
        Telemetry::Status { status: s }
    }

    fn notice(i: usize) -> Telemetry {
        Telemetry::Notice(Notice::new(Level::Info, "t", format!("n{i}")))
    }

    #[test]
    fn a_catch_up_keeps_the_state_in_force_and_bounded_history_in_order() {
        let limits = CatchUpLimits {
            steps: 2,
            samples: 3,
            events: 4,
        };
        let mut c = CatchUp::new(limits);
        let mut t = 0.0;
        let mut keep = |c: &mut CatchUp, m: Telemetry| {
            t += 1.0;
            c.keep(&Record::new(0.0, t, m));
        };
        keep(
            &mut c,
            Telemetry::ThresholdsChanged {
                thresholds: Thresholds::default(),
                profile: None,
                source: "config".into(),
            },
        );
        keep(&mut c, status(RunStatus::Running));
        keep(
            &mut c,
            Telemetry::CommandApplied {
                command: Command::PinMicroBatch { micro_batch: 8 },
                applied: "pinned at 8".into(),
            },
        );
        for i in 0..20 {
            keep(&mut c, notice(i));
            keep(&mut c, Telemetry::Sample(SystemSample::default()));
        }
        let out = c.records();
        // Times only rise: the order of the stream is kept.
        assert!(out.windows(2).all(|w| w[0].t < w[1].t));
        let kinds: Vec<&str> = out.iter().map(|r| r.msg.kind()).collect();
        // The thresholds, status and pin fell off the event ring but are in force.
        assert_eq!(
            &kinds[..3],
            ["thresholds_changed", "status", "command_applied"]
        );
        assert_eq!(kinds.iter().filter(|k| **k == "sample").count(), 3);
        assert_eq!(kinds.iter().filter(|k| **k == "notice").count(), 4);
        let line = c.status_line(7, 0, 1.0);
        assert_eq!(line.status, "running");
    }

    /// 20 readings a second keep 4 (the highest of each quarter second): the catch-up's
    /// chart spans as much time as at 4 Hz, and a spike between is not lost.
    #[test]
    fn a_catch_up_keeps_the_highest_reading_of_each_quarter_second() {
        let mut c = CatchUp::new(CatchUpLimits {
            steps: 2,
            samples: 3,
            events: 4,
        });
        for i in 0..40u64 {
            let mut s = SystemSample::default();
            s.host.process_rss = if i == 27 { 1 << 30 } else { i };
            c.keep(&Record::new(
                0.0,
                i as f64 * 0.05 + 0.01,
                Telemetry::Sample(s),
            ));
        }
        let kept: Vec<(f64, u64)> = c
            .records()
            .iter()
            .map(|r| match &r.msg {
                Telemetry::Sample(s) => ((r.t * 100.0).round() / 100.0, s.host.process_rss),
                _ => panic!("only readings were kept"),
            })
            .collect();
        // Slots of 5 readings; the ring holds the last three (1.25–2.0 s), the spike
        // kept in its own.
        assert_eq!(kept, [(1.36, 1 << 30), (1.71, 34), (1.96, 39)]);
    }

    #[test]
    fn a_catch_up_keeps_only_the_latest_job_rows_and_every_event() {
        let limits = CatchUpLimits {
            steps: 2,
            samples: 2,
            events: 3,
        };
        let mut c = CatchUp::new(limits);
        let rows = |step| {
            Telemetry::JobRanks(crate::telemetry::JobRanks {
                job: "j".into(),
                step,
                world_size: 2,
                uniform_micro_batch: false,
                agree_us: 100.0,
                ranks: vec![],
            })
        };
        for i in 0..3 {
            c.keep(&Record::new(0.0, i as f64, notice(i)));
        }
        for step in 1..=50 {
            c.keep(&Record::new(0.0, 10.0 + step as f64, rows(step)));
        }
        let out = c.records();
        let kinds: Vec<&str> = out.iter().map(|r| r.msg.kind()).collect();
        // One record per step would have pushed the three notices out of the history.
        assert_eq!(kinds, ["notice", "notice", "notice", "job_ranks"]);
        assert_eq!(out[3].msg, rows(50));
    }

    #[test]
    fn a_catch_up_keeps_the_latest_memory_split_however_many_events_followed() {
        let limits = CatchUpLimits {
            steps: 2,
            samples: 2,
            events: 3,
        };
        let mut c = CatchUp::new(limits);
        let split = |model_bytes| {
            Telemetry::PlanSplit(crate::telemetry::PlanSplit {
                model_bytes,
                overhead_bytes: 10,
                activations_per_token: 2.5,
            })
        };
        c.keep(&Record::new(0.0, 0.0, split(100)));
        c.keep(&Record::new(0.0, 1.0, split(200)));
        for i in 0..10 {
            c.keep(&Record::new(0.0, 2.0 + i as f64, notice(i)));
        }
        let out = c.records();
        let splits: Vec<&Telemetry> = out
            .iter()
            .map(|r| &r.msg)
            .filter(|m| matches!(m, Telemetry::PlanSplit(_)))
            .collect();
        // The start's split would have left the event history after three notices.
        assert_eq!(splits, [&split(200)]);
    }

    /// docs/PROTOCOL.md and these types say the same thing: every line of its worked
    /// session parses as the side that sends it, and every kind and error code is named.
    #[test]
    fn the_spec_and_the_types_agree() {
        let doc = include_str!("../../docs/PROTOCOL.md");
        let (mut client, mut server) = (0, 0);
        let lines: Vec<&str> = doc.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if let Some(l) = line.strip_prefix("C: ") {
                // A bad line is in the session on purpose: the server's answer follows.
                if let Err(e) = ClientLine::parse(l) {
                    let answer = lines[i + 1].strip_prefix("S: ").unwrap_or("");
                    let expected = ServerControl::error(code::BAD_LINE, e, false).to_line();
                    assert_eq!(answer, expected, "the answer to {l}");
                }
                client += 1;
            } else if let Some(l) = line.strip_prefix("S: ") {
                ServerLine::parse(l).unwrap_or_else(|e| panic!("{l}: {e}"));
                server += 1;
            }
        }
        assert!(
            client >= 4 && server >= 8,
            "{client} client, {server} server lines"
        );
        for kind in CONTROL_KINDS {
            assert!(
                doc.contains(&format!("`{kind}`")),
                "{kind} is not in the spec"
            );
        }
        for c in [
            code::HANDSHAKE,
            code::VERSION,
            code::UNAUTHORIZED,
            code::FORBIDDEN,
            code::BAD_LINE,
            code::TOO_LONG,
            code::COMMAND,
            code::FLOOD,
            code::TOO_SLOW,
            code::BUSY,
        ] {
            assert!(
                doc.contains(&format!("`{c}`")),
                "error code {c} is not in the spec"
            );
        }
        assert!(doc.contains(&format!("version {}", version_string())));
        assert!(doc.contains(&format!("at most {} KiB", MAX_CLIENT_LINE / 1024)));
        let limits = CatchUpLimits::default();
        for n in [limits.steps, limits.samples, limits.events] {
            assert!(doc.contains(&format!("last {n}")), "catch-up limit {n}");
        }
    }
}
