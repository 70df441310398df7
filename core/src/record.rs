//! A telemetry message stamped with when it was sent: one line of the run log, one
//! record on the wire (docs/PROTOCOL.md), one item on the screen's queues.
//!
//! On disk and on the wire a record is the message's own JSON object (`kind` and its
//! fields) with `ts` and `t` beside them, so a log can be replayed by the same code that
//! reads a live stream.
use serde_json::{json, Value};

use crate::telemetry::Telemetry;

#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    /// Seconds since the run's start.
    pub t: f64,
    pub msg: Telemetry,
}

/// Why a line is not a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadRecord {
    /// Not a JSON object.
    NotJson(String),
    /// A JSON object without a string `kind`.
    NoKind,
    /// A kind this build does not know (a newer producer): skipped, not an error.
    UnknownKind(String),
    /// A known kind whose fields do not fit.
    BadFields { kind: String, error: String },
}

impl std::fmt::Display for BadRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadRecord::NotJson(e) => write!(f, "not a JSON object ({e})"),
            BadRecord::NoKind => write!(f, "a JSON object without a \"kind\""),
            BadRecord::UnknownKind(k) => write!(f, "unknown kind \"{k}\""),
            BadRecord::BadFields { kind, error } => write!(f, "bad \"{kind}\" record ({error})"),
        }
    }
}

impl Record {
    pub fn new(ts: f64, t: f64, msg: Telemetry) -> Record {
        Record { ts, t, msg }
    }

    /// One line of JSON, without the newline.
    pub fn to_line(&self) -> String {
        let mut value = serde_json::to_value(&self.msg)
            .unwrap_or_else(|e| json!({ "kind": "log_error", "error": e.to_string() }));
        if let Some(obj) = value.as_object_mut() {
            obj.insert("ts".into(), json!(self.ts));
            obj.insert("t".into(), json!(self.t));
        }
        value.to_string()
    }

    /// Reads a line written by [`Record::to_line`] (or by another producer speaking the
    /// protocol). `ts` and `t` default to 0 when absent.
    pub fn from_line(line: &str) -> Result<Record, BadRecord> {
        let value: Value =
            serde_json::from_str(line).map_err(|e| BadRecord::NotJson(e.to_string()))?;
        Record::from_value(value)
    }

    pub fn from_value(mut value: Value) -> Result<Record, BadRecord> {
        let obj = value
            .as_object_mut()
            .ok_or_else(|| BadRecord::NotJson("not an object".into()))?;
        let kind = obj
            .get("kind")
            .and_then(Value::as_str)
            .ok_or(BadRecord::NoKind)?
            .to_string();
        let num = |v: Option<Value>| v.and_then(|v| v.as_f64()).unwrap_or(0.0);
        let ts = num(obj.remove("ts"));
        let t = num(obj.remove("t"));
        match serde_json::from_value::<Telemetry>(value) {
            Ok(msg) => Ok(Record { ts, t, msg }),
            Err(e) => {
                let error = e.to_string();
                if error.starts_with("unknown variant") {
                    Err(BadRecord::UnknownKind(kind))
                } else {
                    Err(BadRecord::BadFields { kind, error })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{Level, Notice, RunStatus};

    #[test]
    fn a_record_reads_back_as_written() {
        let r = Record::new(
            1.7e9,
            12.5,
            Telemetry::Notice(Notice::new(Level::Warn, "test", "hello")),
        );
        let line = r.to_line();
        assert!(line.contains("\"kind\":\"notice\"") && line.contains("\"t\":12.5"));
        assert_eq!(Record::from_line(&line), Ok(r));
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        assert!(matches!(
            Record::from_line("garbage"),
            Err(BadRecord::NotJson(_))
        ));
        assert_eq!(Record::from_line("{\"a\":1}"), Err(BadRecord::NoKind));
        assert_eq!(
            Record::from_line("{\"kind\":\"from_the_future\",\"t\":1}"),
            Err(BadRecord::UnknownKind("from_the_future".into()))
        );
        assert!(matches!(
            Record::from_line("{\"kind\":\"status\",\"status\":42}"),
            Err(BadRecord::BadFields { .. })
        ));
        let ok = Record::from_line("{\"kind\":\"status\",\"status\":\"paused\"}").unwrap();
        assert_eq!(
            ok.msg,
            Telemetry::Status {
                status: RunStatus::Paused
            }
        );
        assert_eq!(ok.t, 0.0);
    }
}
