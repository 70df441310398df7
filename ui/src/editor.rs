//! The threshold editor's state: a draft of the four thresholds, which one is selected,
//! and what became of the last attempt to apply it. Pure; the view draws it and the
//! [`crate::app::App`] decides what is sent.
use headroom_core::policy::{Profile, Thresholds};

/// Display names, in the order of [`Thresholds::as_array`].
pub const NAMES: [&str; 4] = ["target", "warning", "critical", "emergency"];

/// Profiles in the order `P` steps through them (least to most memory kept free).
pub const PROFILES: [Profile; 3] = Profile::ALL;

/// The profile after `current`; a custom set starts the cycle at the default.
pub fn next_profile(current: Option<Profile>) -> Profile {
    match current {
        None => Profile::default(),
        Some(p) => {
            let i = PROFILES.iter().position(|q| *q == p).unwrap_or(0);
            PROFILES[(i + 1) % PROFILES.len()]
        }
    }
}

/// The profile whose values these are exactly, if any.
pub fn profile_of(t: &Thresholds) -> Option<Profile> {
    Profile::of(*t)
}

#[derive(Debug, Clone, PartialEq)]
pub enum EditStatus {
    Editing,
    /// Refused, locally by validation or by the trainer: the reason, verbatim.
    Refused(String),
    /// Sent; the editor closes when the trainer confirms these values.
    Sent(Thresholds),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ThresholdEditor {
    pub draft: Thresholds,
    /// Index into [`NAMES`].
    pub selected: usize,
    pub status: EditStatus,
}

impl ThresholdEditor {
    pub fn new(start: Thresholds) -> ThresholdEditor {
        ThresholdEditor {
            draft: start,
            selected: 0,
            status: EditStatus::Editing,
        }
    }

    /// Moves the selection, wrapping around at either end.
    pub fn select(&mut self, by: i32) {
        self.selected = (self.selected as i64 + by as i64).rem_euclid(NAMES.len() as i64) as usize;
    }

    /// Changes the selected threshold by `hundredths` / 100, landing on a whole
    /// hundredth so repeated steps never accumulate float error (0.90 + 0.01 is 0.91,
    /// not 0.9100000000000001, and equals a profile's 0.91 exactly). Not clamped: an
    /// out-of-order draft is allowed and explained on Enter.
    pub fn adjust(&mut self, hundredths: i32) {
        let mut v = self.draft.as_array();
        let x = &mut v[self.selected];
        *x = ((*x * 100.0).round() + hundredths as f64).clamp(0.0, 100.0) / 100.0;
        self.draft = Thresholds {
            target: v[0],
            warning: v[1],
            critical: v[2],
            emergency: v[3],
        };
        self.status = EditStatus::Editing;
    }

    /// Replaces the draft with the next profile's values.
    pub fn cycle_profile(&mut self) {
        self.draft = next_profile(profile_of(&self.draft)).thresholds();
        self.status = EditStatus::Editing;
    }

    /// The draft if it is valid; otherwise the reason, which stays on screen until the
    /// next edit.
    pub fn submit(&mut self) -> Option<Thresholds> {
        match self.draft.validate() {
            Ok(()) => {
                self.status = EditStatus::Sent(self.draft);
                Some(self.draft)
            }
            Err(e) => {
                self.status = EditStatus::Refused(e.to_string());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_land_on_whole_hundredths() {
        let mut e = ThresholdEditor::new(Profile::Balanced.thresholds());
        for _ in 0..7 {
            e.adjust(1);
        }
        assert_eq!(e.draft.target, 0.97);
        for _ in 0..7 {
            e.adjust(-1);
        }
        assert_eq!(e.draft, Profile::Balanced.thresholds());
    }

    #[test]
    fn selection_wraps_both_ways() {
        let mut e = ThresholdEditor::new(Thresholds::default());
        e.select(-1);
        assert_eq!(NAMES[e.selected], "emergency");
        e.select(2);
        assert_eq!(NAMES[e.selected], "warning");
    }

    #[test]
    fn an_invalid_draft_is_refused_with_the_reason_and_an_edit_clears_it() {
        let mut e = ThresholdEditor::new(Thresholds::default());
        e.adjust(2); // target 0.92 = warning
        assert_eq!(e.submit(), None);
        let EditStatus::Refused(reason) = &e.status else {
            panic!("{:?}", e.status)
        };
        assert!(
            reason.contains("warning") && reason.contains("strictly"),
            "{reason}"
        );
        e.adjust(-1);
        assert_eq!(e.status, EditStatus::Editing);
        assert_eq!(e.submit(), Some(e.draft));
        assert_eq!(e.status, EditStatus::Sent(e.draft));
    }

    #[test]
    fn values_stay_within_zero_and_one() {
        let mut e = ThresholdEditor::new(Thresholds::default());
        e.select(3);
        for _ in 0..10 {
            e.adjust(1);
        }
        assert_eq!(e.draft.emergency, 1.0);
    }

    #[test]
    fn profiles_cycle_from_the_drafts_profile() {
        assert_eq!(next_profile(None), Profile::Balanced);
        assert_eq!(next_profile(Some(Profile::Balanced)), Profile::Conservative);
        assert_eq!(
            next_profile(Some(Profile::Conservative)),
            Profile::Aggressive
        );
        let mut e = ThresholdEditor::new(Profile::Balanced.thresholds());
        e.cycle_profile();
        assert_eq!(profile_of(&e.draft), Some(Profile::Conservative));
        e.adjust(1);
        assert_eq!(profile_of(&e.draft), None, "an edited profile is custom");
        e.cycle_profile();
        assert_eq!(profile_of(&e.draft), Some(Profile::Balanced));
    }
}
