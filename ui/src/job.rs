//! A torchrun job as the screen holds it: the latest rows rank 0 gathered for every rank,
//! which rank the user selected, and whether that rank's own stream can be shown. Pure:
//! the client does the switching ([`crate::feed::Feed::select_rank`]); this only records
//! what was asked and what came of it.
use headroom_core::{JobRanks, RankRow, RunStatus};

#[derive(Debug, Clone, PartialEq)]
pub struct JobView {
    /// The newest rows (rank 0 sends them at every step's agreement).
    pub rows: JobRanks,
    /// The run's time of the record that brought them.
    pub t: f64,
    /// The rank whose row is marked and whose panels the user asked for.
    pub selected: u32,
    /// The selected rank's stream could not be reached (another machine, a replay of one
    /// log, a rank that is gone), and why; the panels stay on the rank they show.
    pub unreachable: Option<(u32, String)>,
}

impl JobView {
    /// First rows of a job: the selection starts on the rank the panels show.
    pub fn new(rows: JobRanks, t: f64, panels: Option<u32>) -> JobView {
        JobView {
            selected: panels.unwrap_or(0).min(rows.world_size.saturating_sub(1)),
            rows,
            t,
            unreachable: None,
        }
    }

    pub fn update(&mut self, rows: JobRanks, t: f64) {
        self.rows = rows;
        self.t = t;
        self.selected = self.selected.min(self.rows.world_size.saturating_sub(1));
    }

    /// The job's loss: the mean of the ranks' losses (each rank trains on an equal share
    /// of the global batch), over the ranks that reported one.
    pub fn loss(&self) -> Option<f64> {
        let losses: Vec<f64> = self.rows.ranks.iter().filter_map(|r| r.loss).collect();
        (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64)
    }

    /// The most commands any rank has confirmed: a rank below it has not carried out the
    /// latest yet.
    pub fn commands_confirmed(&self) -> u64 {
        self.rows
            .ranks
            .iter()
            .map(|r| r.commands_applied)
            .max()
            .unwrap_or(0)
    }

    /// Ranks that ended in an error, or whose row stopped moving with the job (a rank
    /// gathered at an earlier step than the job's by more than one).
    pub fn in_trouble(&self, row: &RankRow) -> bool {
        row.status == RunStatus::Failed || row.step + 1 < self.rows.step
    }

    /// The selection moved by `by` ranks, wrapping; `None` when it stays.
    pub fn shifted(&self, by: i32) -> Option<u32> {
        let n = self.rows.world_size.max(1) as i64;
        let to = (self.selected as i64 + by as i64).rem_euclid(n) as u32;
        (to != self.selected).then_some(to)
    }

    /// Selects `rank`; false when the job has no such rank.
    pub fn select(&mut self, rank: u32) -> bool {
        if rank >= self.rows.world_size {
            return false;
        }
        self.selected = rank;
        if self.unreachable.as_ref().is_some_and(|(r, _)| *r != rank) {
            self.unreachable = None;
        }
        true
    }
}

/// The rank a run's name says it is: torchrun ranks are named `NAME.JOB.rankR`.
pub fn rank_of_name(name: &str) -> Option<u32> {
    let (_, last) = name.rsplit_once('.')?;
    last.strip_prefix("rank")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rank: u32, step: u64, loss: Option<f64>, commands: u64) -> RankRow {
        RankRow {
            rank,
            step,
            loss,
            commands_applied: commands,
            status: RunStatus::Running,
            ..RankRow::default()
        }
    }

    fn job(ranks: Vec<RankRow>) -> JobRanks {
        JobRanks {
            job: "j".into(),
            step: 10,
            world_size: ranks.len() as u32,
            uniform_micro_batch: false,
            agree_us: 80.0,
            ranks,
        }
    }

    #[test]
    fn the_jobs_loss_is_the_mean_of_the_ranks_that_reported_one() {
        let v = JobView::new(
            job(vec![
                row(0, 10, Some(2.0), 0),
                row(1, 10, Some(3.0), 0),
                row(2, 10, None, 0),
            ]),
            1.0,
            None,
        );
        assert_eq!(v.loss(), Some(2.5));
        let none = JobView::new(job(vec![row(0, 0, None, 0)]), 1.0, None);
        assert_eq!(none.loss(), None);
    }

    #[test]
    fn selection_wraps_starts_on_the_panels_rank_and_refuses_a_rank_the_job_lacks() {
        let rows = job((0..4).map(|r| row(r, 10, None, 0)).collect());
        let mut v = JobView::new(rows.clone(), 1.0, Some(2));
        assert_eq!(v.selected, 2);
        assert_eq!(v.shifted(1), Some(3));
        v.select(3);
        assert_eq!(v.shifted(1), Some(0), "wraps");
        assert_eq!(v.shifted(-4), None, "a whole turn is no move");
        assert!(!v.select(4));
        assert_eq!(v.selected, 3);
        // A job that shrank (a restart with fewer ranks) keeps a selection it has.
        let mut fewer = rows;
        fewer.world_size = 2;
        fewer.ranks.truncate(2);
        v.update(fewer, 2.0);
        assert_eq!(v.selected, 1);
    }

    #[test]
    fn a_note_about_an_unreachable_rank_goes_when_another_is_selected() {
        let mut v = JobView::new(
            job((0..3).map(|r| row(r, 10, None, 0)).collect()),
            1.0,
            None,
        );
        v.unreachable = Some((2, "on another machine".into()));
        v.select(2);
        assert!(v.unreachable.is_some(), "still that rank");
        v.select(1);
        assert!(v.unreachable.is_none());
    }

    #[test]
    fn a_failed_or_stalled_rank_is_in_trouble_and_commands_count_to_the_most_confirmed() {
        let mut failed = row(1, 10, None, 2);
        failed.status = RunStatus::Failed;
        let v = JobView::new(
            job(vec![
                row(0, 10, None, 3),
                failed.clone(),
                row(2, 8, None, 3),
            ]),
            1.0,
            None,
        );
        assert!(!v.in_trouble(&v.rows.ranks[0]));
        assert!(v.in_trouble(&failed));
        assert!(v.in_trouble(&v.rows.ranks[2]), "two steps behind");
        assert_eq!(v.commands_confirmed(), 3);
    }

    #[test]
    fn torchrun_rank_names_say_their_rank() {
        assert_eq!(rank_of_name("ddp.4f2a.rank3"), Some(3));
        assert_eq!(rank_of_name("my.model.j1.rank0"), Some(0));
        assert_eq!(rank_of_name("tiny"), None);
        assert_eq!(rank_of_name("a.rankx"), None);
    }
}
