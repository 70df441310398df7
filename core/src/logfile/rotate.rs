//! When a log file is closed and a fresh one started: `--log-rotate 256MiB` (its size on
//! disk) or `--log-rotate 1d` (its age).
use std::str::FromStr;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotate {
    /// Once the file holds this many bytes.
    Size(u64),
    /// Once the file has been written for this long.
    Every(Duration),
}

/// Below this a log would rotate every few seconds: a mistyped unit, not a wish.
const SMALLEST: u64 = 1 << 20;

impl FromStr for Rotate {
    type Err = String;

    fn from_str(text: &str) -> Result<Rotate, String> {
        let t = text.trim();
        let bad = || {
            format!(
                "log rotation '{text}': give a size (e.g. 256MiB, 1GiB) or an age (e.g. 30min, \
                 12h, 1d)"
            )
        };
        let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len()));
        let secs = match unit {
            "s" => Some(1.0),
            "min" => Some(60.0),
            "h" => Some(3600.0),
            "d" => Some(86400.0),
            _ => None,
        };
        if unit.eq_ignore_ascii_case("m") {
            return Err(format!(
                "log rotation '{text}' is ambiguous: write {n}min for minutes or {n}MiB for a \
                 size",
                n = num.trim()
            ));
        }
        if let Some(per) = secs {
            let n: f64 = num.trim().parse().map_err(|_| bad())?;
            if !(n.is_finite() && n * per >= 1.0) {
                return Err(format!("{}: an age of at least 1 s", bad()));
            }
            return Ok(Rotate::Every(Duration::from_secs_f64(n * per)));
        }
        let bytes = crate::units::parse_bytes(t).map_err(|_| bad())?;
        if bytes < SMALLEST {
            return Err(format!(
                "log rotation '{text}' is under 1MiB: a log would rotate every few seconds; \
                 give e.g. 256MiB"
            ));
        }
        Ok(Rotate::Size(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_ages_parse_and_nonsense_names_the_forms() {
        assert_eq!("256MiB".parse(), Ok(Rotate::Size(256 << 20)));
        assert_eq!("1GiB".parse(), Ok(Rotate::Size(1 << 30)));
        assert_eq!(
            "12h".parse(),
            Ok(Rotate::Every(Duration::from_secs(12 * 3600)))
        );
        assert_eq!("1d".parse(), Ok(Rotate::Every(Duration::from_secs(86400))));
        assert_eq!("90s".parse(), Ok(Rotate::Every(Duration::from_secs(90))));
        for bad in ["", "soon", "5x", "0d"] {
            let e = bad.parse::<Rotate>().unwrap_err();
            assert!(e.contains("256MiB") || e.contains("1 s"), "{bad}: {e}");
        }
        assert!("30m".parse::<Rotate>().unwrap_err().contains("30min"));
        assert_eq!(
            "30min".parse(),
            Ok(Rotate::Every(Duration::from_secs(1800)))
        );
        assert!("100KiB"
            .parse::<Rotate>()
            .unwrap_err()
            .contains("under 1MiB"));
    }
}
