//! A stop asked for from outside the trainer thread (a signal, the dashboard, a viewer),
//! seen between micro-batches: a long step is given up at its next micro-batch instead of
//! being finished, and whoever asked can say at once what the run will leave behind.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Shared by the trainer and everyone who may ask it to stop. Cloning shares it.
#[derive(Clone, Default)]
pub struct StopSwitch(Arc<Inner>);

#[derive(Default)]
struct Inner {
    abandon: AtomicBool,
    steps_done: AtomicU64,
    in_step: AtomicBool,
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
        self.0.abandon.store(true, Ordering::SeqCst);
        self.progress()
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.0.abandon.load(Ordering::SeqCst)
    }

    pub fn progress(&self) -> Progress {
        Progress {
            steps_done: self.0.steps_done.load(Ordering::SeqCst),
            in_step: self.0.in_step.load(Ordering::SeqCst),
        }
    }

    /// Published by the trainer as it starts and ends each step.
    pub fn publish(&self, steps_done: u64, in_step: bool) {
        self.0.steps_done.store(steps_done, Ordering::SeqCst);
        self.0.in_step.store(in_step, Ordering::SeqCst);
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
}
