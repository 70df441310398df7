//! Four fractions of usable memory: target < warning < critical < emergency.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Fractions of usable memory (0, 1], strictly increasing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// The controller grows the micro-batch until the step's peak sits just under this.
    pub target: f64,
    /// Above this (measured or forecast) a warning is raised and growth stops.
    pub warning: f64,
    /// At or above this the micro-batch shrinks.
    pub critical: f64,
    /// At or above this cached memory is freed and the micro-batch shrinks hard.
    pub emergency: f64,
}

/// Why a set of thresholds was refused. The message names the offending value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThresholdError(pub String);

impl fmt::Display for ThresholdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ThresholdError {}

impl Default for Thresholds {
    fn default() -> Self {
        Profile::Balanced.thresholds()
    }
}

const NAMES: [&str; 4] = ["target", "warning", "critical", "emergency"];

impl Thresholds {
    /// Checked construction.
    pub fn new(
        target: f64,
        warning: f64,
        critical: f64,
        emergency: f64,
    ) -> Result<Self, ThresholdError> {
        let t = Thresholds {
            target,
            warning,
            critical,
            emergency,
        };
        t.validate()?;
        Ok(t)
    }

    pub fn as_array(&self) -> [f64; 4] {
        [self.target, self.warning, self.critical, self.emergency]
    }

    /// Each in (0, 1], strictly increasing.
    pub fn validate(&self) -> Result<(), ThresholdError> {
        let v = self.as_array();
        for (name, x) in NAMES.iter().zip(v) {
            if !(x > 0.0 && x <= 1.0) {
                return Err(ThresholdError(format!(
                    "threshold {name} = {x} is outside (0, 1]; give fractions of usable memory, e.g. 0.90,0.92,0.95,0.97"
                )));
            }
        }
        for i in 1..4 {
            if v[i] <= v[i - 1] {
                return Err(ThresholdError(format!(
                    "threshold {} = {} must be greater than {} = {}; thresholds must increase strictly (target < warning < critical < emergency)",
                    NAMES[i], v[i], NAMES[i - 1], v[i - 1]
                )));
            }
        }
        Ok(())
    }

    /// Parses `t,w,c,e` (four fractions) and validates them.
    pub fn parse(text: &str) -> Result<Self, ThresholdError> {
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        if parts.len() != 4 {
            return Err(ThresholdError(format!(
                "thresholds '{text}' must be four comma-separated fractions target,warning,critical,emergency (e.g. 0.90,0.92,0.95,0.97)"
            )));
        }
        let mut v = [0.0; 4];
        for (i, p) in parts.iter().enumerate() {
            v[i] = p.parse::<f64>().map_err(|_| {
                ThresholdError(format!(
                    "threshold {} '{p}' in '{text}' is not a number",
                    NAMES[i]
                ))
            })?;
        }
        Thresholds::new(v[0], v[1], v[2], v[3])
    }

    /// Replaces these thresholds with `new` if it is valid; otherwise leaves them as they
    /// were and says why.
    pub fn set(&mut self, new: Thresholds) -> Result<(), ThresholdError> {
        new.validate()?;
        *self = new;
        Ok(())
    }
}

impl fmt::Display for Thresholds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.2},{:.2},{:.2},{:.2}",
            self.target, self.warning, self.critical, self.emergency
        )
    }
}

/// Named threshold presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    Aggressive,
    #[default]
    Balanced,
    Conservative,
}

impl Profile {
    /// Every preset, least to most memory kept free.
    pub const ALL: [Profile; 3] = [
        Profile::Aggressive,
        Profile::Balanced,
        Profile::Conservative,
    ];

    /// The preset whose values `t` are exactly, if any (else the thresholds are custom).
    pub fn of(t: Thresholds) -> Option<Profile> {
        Profile::ALL.into_iter().find(|p| p.thresholds() == t)
    }

    pub fn thresholds(self) -> Thresholds {
        let (t, w, c, e) = match self {
            Profile::Aggressive => (0.92, 0.94, 0.96, 0.98),
            Profile::Balanced => (0.90, 0.92, 0.95, 0.97),
            Profile::Conservative => (0.85, 0.88, 0.92, 0.95),
        };
        Thresholds {
            target: t,
            warning: w,
            critical: c,
            emergency: e,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::Aggressive => "aggressive",
            Profile::Balanced => "balanced",
            Profile::Conservative => "conservative",
        }
    }
}

impl FromStr for Profile {
    type Err = ThresholdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "aggressive" => Ok(Profile::Aggressive),
            "balanced" => Ok(Profile::Balanced),
            "conservative" => Ok(Profile::Conservative),
            _ => Err(ThresholdError(format!(
                "profile '{s}' is not one of aggressive, balanced, conservative"
            ))),
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_are_valid_and_balanced_is_default() {
        for p in [
            Profile::Aggressive,
            Profile::Balanced,
            Profile::Conservative,
        ] {
            p.thresholds().validate().unwrap();
            assert_eq!(p.name().parse::<Profile>().unwrap(), p);
        }
        assert_eq!(Thresholds::default().as_array(), [0.90, 0.92, 0.95, 0.97]);
        assert_eq!(
            Profile::Conservative.thresholds().as_array(),
            [0.85, 0.88, 0.92, 0.95]
        );
        assert_eq!(
            Profile::Aggressive.thresholds().as_array(),
            [0.92, 0.94, 0.96, 0.98]
        );
        assert!("greedy"
            .parse::<Profile>()
            .unwrap_err()
            .0
            .contains("aggressive"));
    }

    #[test]
    fn parse_accepts_four_increasing_fractions() {
        let t = Thresholds::parse(" 0.8, 0.85,0.9 ,1.0").unwrap();
        assert_eq!(t.as_array(), [0.8, 0.85, 0.9, 1.0]);
        assert_eq!(Thresholds::parse(&t.to_string()).unwrap(), t);
    }

    #[test]
    fn invalid_thresholds_name_the_problem() {
        let e = Thresholds::parse("0.9,0.92,0.95").unwrap_err().0;
        assert!(e.contains("four"), "{e}");
        let e = Thresholds::parse("0.9,x,0.95,0.97").unwrap_err().0;
        assert!(e.contains("warning") && e.contains("not a number"), "{e}");
        let e = Thresholds::parse("0.9,0.92,0.92,0.97").unwrap_err().0;
        assert!(e.contains("critical") && e.contains("strictly"), "{e}");
        let e = Thresholds::parse("0,0.92,0.95,0.97").unwrap_err().0;
        assert!(e.contains("target") && e.contains("(0, 1]"), "{e}");
        let e = Thresholds::parse("0.9,0.92,0.95,1.2").unwrap_err().0;
        assert!(e.contains("emergency"), "{e}");
        let e = Thresholds::parse("0.9,0.92,0.95,NaN").unwrap_err().0;
        assert!(e.contains("emergency"), "{e}");
    }

    #[test]
    fn a_rejected_change_keeps_the_old_values() {
        let mut t = Profile::Conservative.thresholds();
        let bad = Thresholds {
            target: 0.95,
            warning: 0.9,
            critical: 0.96,
            emergency: 0.97,
        };
        assert!(t.set(bad).is_err());
        assert_eq!(t, Profile::Conservative.thresholds());
        t.set(Profile::Aggressive.thresholds()).unwrap();
        assert_eq!(t, Profile::Aggressive.thresholds());
    }
}
