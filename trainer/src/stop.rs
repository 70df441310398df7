//! A stop asked for from outside the trainer thread (a signal, the dashboard, a viewer),
//! seen between micro-batches: a long step is given up at its next micro-batch instead of
//! being finished, and whoever asked can say at once what the run will leave behind.
use std::sync::{Arc, Mutex, MutexGuard};

/// Shared by the trainer and everyone who may ask it to stop. Cloning shares it. One lock
/// (taken once per micro-batch, uncontended) makes "is the step given up?" and "what will
/// the checkpoint be of?" one answer: a stop asked after the step's last micro-batch
/// lets the step complete, and is told so.
#[derive(Clone, Default)]
pub struct StopSwitch(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    abandon: bool,
    steps_done: u64,
    in_step: bool,
    /// The step in progress is past its last micro-batch: it will complete.
    committed: bool,
}

/// Where the run is, as the trainer last published it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Optimizer steps completed (resumed ones included).
    pub steps_done: u64,
    /// A step is being computed (it would be given up by a stop).
    pub in_step: bool,
}

impl Progress {
    /// What a stop asked now will do, said the moment it is asked.
    pub fn stop_text(&self) -> String {
        let n = self.steps_done;
        match (self.in_step, n) {
            (true, 0) => "stopping: step 1, in progress, is abandoned at its next micro-batch; \
                          no step has completed, so there is no checkpoint to write"
                .to_string(),
            (true, n) => format!(
                "stopping: step {}, in progress, is abandoned at its next micro-batch; the \
                 checkpoint will be of step {n} (a resume redoes step {})",
                n + 1,
                n + 1
            ),
            (false, 0) => {
                "stopping: no step has completed, so there is no checkpoint to write".to_string()
            }
            (false, n) => format!("stopping: the checkpoint will be of step {n}"),
        }
    }
}

impl StopSwitch {
    pub fn new() -> StopSwitch {
        StopSwitch::default()
    }

    /// Asks the trainer to give up the step in progress at its next micro-batch boundary
    /// (a stop command must follow, or already be on its way: this only makes it prompt).
    /// Returns where the run was when asked.
    pub fn request(&self) -> Progress {
        let mut s = self.lock();
        s.abandon = true;
        Self::progress_of(&s)
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.lock().abandon
    }

    pub fn progress(&self) -> Progress {
        Self::progress_of(&self.lock())
    }

    fn progress_of(s: &State) -> Progress {
        if s.committed {
            return Progress {
                steps_done: s.steps_done + 1,
                in_step: false,
            };
        }
        Progress {
            steps_done: s.steps_done,
            in_step: s.in_step,
        }
    }

    /// Published by the trainer as it starts and ends each step.
    pub fn publish(&self, steps_done: u64, in_step: bool) {
        let mut s = self.lock();
        s.steps_done = steps_done;
        s.in_step = in_step;
        s.committed = false;
    }

    /// Called by the trainer after the step's last micro-batch: false when a stop came
    /// first (the step is given up), else the step is committed to complete.
    pub fn commit(&self) -> bool {
        let mut s = self.lock();
        if s.abandon {
            return false;
        }
        s.committed = true;
        true
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_text_names_the_checkpoint_a_stop_leaves() {
        let s = StopSwitch::new();
        s.publish(41, true);
        assert!(!s.requested());
        let text = s.request().stop_text();
        assert!(s.requested());
        assert!(
            text.contains("step 42, in progress, is abandoned")
                && text.contains("checkpoint will be of step 41"),
            "{text}"
        );
        s.publish(42, false);
        assert_eq!(
            s.progress().stop_text(),
            "stopping: the checkpoint will be of step 42"
        );
        s.publish(0, true);
        assert!(s.progress().stop_text().contains("no checkpoint"));
    }

    #[test]
    fn a_stop_after_the_last_micro_batch_is_told_the_step_completes() {
        let s = StopSwitch::new();
        s.publish(41, true);
        assert!(s.commit(), "no stop yet: the step goes on to its update");
        let text = s.request().stop_text();
        assert_eq!(text, "stopping: the checkpoint will be of step 42");
        let late = StopSwitch::new();
        late.publish(41, true);
        late.request();
        assert!(!late.commit(), "a stop before the update gives the step up");
    }
}
