//! The viewer's command line: `ls`, `attach`, `replay`, shared by the full `headroom`
//! binary (beside `train`) and the viewer-only `headroom` a `pip install` gives.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Clone, Subcommand)]
pub enum ViewCommand {
    /// List this user's running runs (each serves its stream on a socket)
    Ls,
    /// Open the dashboard on a running run; q detaches and leaves the run going
    Attach(AttachArgs),
    /// Open the dashboard on a run's JSONL log (read-only): play, pause, step, jump
    Replay(ReplayArgs),
    /// Print a run's log as plain JSONL on stdout, a compressed (.zst) or rotated one too
    /// (its segments first, in order): `headroom cat run.jsonl.zst | jq …`. A damaged
    /// stretch of a compressed log is skipped and said on stderr; the exit status is then 2
    Cat(CatArgs),
}

/// The viewer alone (the Python package's `headroom` command): `train` is the full
/// build's, and says how to get it.
#[derive(Debug, Parser)]
#[command(
    name = "headroom",
    version,
    about = "Watch training runs' memory headroom live in the terminal (the viewer of \
             the Python package; `headroom train` comes with the full build)"
)]
pub struct ViewerCli {
    #[command(subcommand)]
    pub command: ViewerOnly,
}

#[derive(Debug, Subcommand)]
pub enum ViewerOnly {
    #[command(flatten)]
    View(ViewCommand),
    /// Train a byte-level GPT (needs the full build with libtorch: see docs/PYTHON.md)
    #[command(disable_help_flag = true)]
    Train {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Clone, Args)]
pub struct AttachArgs {
    /// A run's name (or NAME-PID, or its pid) from `headroom ls`, a torchrun job (its id,
    /// or the name its ranks share: its rank 0), a socket path, or HOST:PORT; with none,
    /// the only running run (or a choice when there are several)
    #[arg(value_name = "RUN | JOB | SOCKET | HOST:PORT")]
    pub target: Option<String>,
    /// With a job (or one of its ranks): attach this rank's stream instead of rank 0's
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
    /// The run's token, for HOST:PORT (the run writes it 0600 beside its socket; also
    /// HEADROOM_TOKEN)
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct CatArgs {
    /// Run logs (`--log FILE`, `log=`), each with its rotated segments, one after another
    #[arg(value_name = "LOG", required = true, num_args = 1..)]
    pub log: Vec<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// A run's JSONL log (`headroom train --log FILE`, or a Python run's `log=`), plain or
    /// compressed (`.zst`), with its rotated segments (`run.1.jsonl.zst`, …) played first;
    /// for a torchrun job, one log per rank (the panels show one rank at a time, `[` `]` or
    /// the rank's digit switch)
    #[arg(value_name = "LOG", required = true, num_args = 1..)]
    pub log: Vec<PathBuf>,
    /// Playback speed against the run's own clock (e.g. 10 plays ten times as fast)
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub speed: f64,
    /// Keep reading as the log grows (a run still writing it)
    #[arg(long)]
    pub follow: bool,
    /// Start at the end of the log (the final state), instead of playing it; a compressed
    /// log's earlier steps are shown one point per frame from its index (under a second
    /// for a week-long run)
    #[arg(long)]
    pub end: bool,
}
