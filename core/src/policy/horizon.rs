//! The length horizon: which sequence length a size is planned for.
//!
//! The controller works in tokens, and a token in a longer sequence costs more, so every
//! size is planned for the longest length still to come: the longest within the trainer's
//! horizon when it says ([`Upcoming`]) and the lengths have only risen so far, else the
//! configured maximum (lengths that fall as well as rise may bring it on any step), and
//! never shorter than the longest it has been told of or run.
use super::messages::Upcoming;

#[derive(Debug, Clone)]
pub struct Horizon {
    /// The longest length the run feeds (0: not configured).
    max_seq_len: usize,
    /// What the trainer said of the steps to come before this step, if anything.
    upcoming: Option<Upcoming>,
    /// The longest length the controller had been told of before this step.
    foreseen: usize,
    /// The longest length any step has run (kept when readings are forgotten).
    longest_run: usize,
    /// A step ran shorter than one before it: the lengths are not a ramp, and any later
    /// step may bring the longest the run feeds.
    lengths_fall: bool,
    /// The latest step observed.
    last_step: u64,
}

/// What the forecast learned of the lengths ahead of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outlook {
    /// The step's own length is longer than any told of before: nobody announced it.
    pub unforeseen: bool,
    /// A longer length came into view (on a ramp, every step).
    pub rising: bool,
}

impl Horizon {
    pub fn new(max_seq_len: usize) -> Horizon {
        Horizon {
            max_seq_len,
            upcoming: None,
            foreseen: 0,
            longest_run: 0,
            lengths_fall: false,
            last_step: 0,
        }
    }

    /// Before a step of `seq_len`, told (or not) the longest length within the horizon.
    pub fn look_ahead(&mut self, seq_len: usize, upcoming: Option<Upcoming>) -> Outlook {
        self.upcoming = upcoming;
        let plan = self.plan_seq(seq_len);
        let outlook = Outlook {
            unforeseen: seq_len > self.foreseen,
            rising: plan > self.foreseen,
        };
        self.foreseen = self.foreseen.max(plan);
        outlook
    }

    /// A step ran at `seq_len`.
    pub fn ran(&mut self, step: u64, seq_len: usize) {
        self.last_step = self.last_step.max(step);
        self.lengths_fall |= seq_len < self.longest_run;
        self.longest_run = self.longest_run.max(seq_len);
    }

    pub fn upcoming(&self) -> Option<Upcoming> {
        self.upcoming
    }
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }
    pub fn lengths_fall(&self) -> bool {
        self.lengths_fall
    }
    pub fn last_step(&self) -> u64 {
        self.last_step
    }

    /// The length growth is planned for: the longest to come, as far as the controller
    /// knows, and never shorter than the longest it has been told of or run. A horizon
    /// moves every step: planning for only its own longest would grow when a long length
    /// drops out of it and shrink when the next one comes in (random lengths churn), and
    /// a length seen once in a schedule comes again.
    pub fn plan_seq(&self, seq_len: usize) -> usize {
        // Lengths that fall as well as rise (random, bucketed) can bring the longest the
        // run feeds on any step, past the horizon's view: a size planned for the horizon's
        // longest is shrunk again when a longer one comes into view, long after the run
        // settled. A ramp only rises, and the horizon lets it use the room its shorter
        // lengths leave.
        let ahead = match self.upcoming {
            Some(u) if !(self.lengths_fall && self.max_seq_len > 0) => u.seq_len,
            _ => self.max_seq_len,
        };
        ahead.max(seq_len).max(self.foreseen).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ramp_plans_for_the_horizon_and_random_lengths_for_the_longest() {
        let mut h = Horizon::new(256);
        // Not told: the configured longest.
        assert!(h.look_ahead(64, None).rising);
        assert_eq!(h.plan_seq(64), 256);
        // Told, lengths rising: the horizon's longest, and never shorter than told before.
        let mut h = Horizon::new(256);
        let up = |seq_len, step| Some(Upcoming { seq_len, step });
        assert!(h.look_ahead(64, up(80, 16)).rising);
        h.ran(1, 64);
        assert_eq!(h.plan_seq(64), 80);
        assert!(!h.look_ahead(66, up(70, 17)).rising);
        assert_eq!(h.plan_seq(66), 80);
        h.ran(2, 66);
        // A step shorter than one before: the lengths fall, any step may bring 256.
        h.ran(3, 40);
        assert!(h.lengths_fall());
        assert_eq!(h.plan_seq(40), 256);
    }

    #[test]
    fn a_length_longer_than_any_told_of_is_unforeseen() {
        let mut h = Horizon::new(0);
        assert!(h.look_ahead(64, None).unforeseen);
        assert!(!h.look_ahead(64, None).unforeseen);
        let o = h.look_ahead(128, None);
        assert!(o.unforeseen && o.rising);
    }
}
