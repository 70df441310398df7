//! headroom's viewer: the stream's clients (`ls`, `attach`, `replay`) with no libtorch,
//! so the full `headroom` binary and the Python extension's `headroom` command share it.
pub mod attach;
pub mod cat;
pub mod cli;
pub mod client;
pub mod ls;
pub mod watch;

use clap::Parser;
use headroom_host::out;

pub use cli::{AttachArgs, CatArgs, ReplayArgs, ViewCommand, ViewerCli, ViewerOnly};

/// Which program the viewer runs in: what it advises must be something that program
/// does (the pip viewer cannot `headroom train`; its user starts runs from Python).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// The full `headroom` binary, which trains too.
    Full,
    /// The viewer-only `headroom` of the Python package.
    Viewer,
}

/// Runs one viewer command in the full binary.
pub fn run(cmd: ViewCommand) -> anyhow::Result<()> {
    run_as(cmd, Program::Full)
}

/// Runs one viewer command in `program`.
pub fn run_as(cmd: ViewCommand, program: Program) -> anyhow::Result<()> {
    match cmd {
        ViewCommand::Ls => watch::ls(program),
        ViewCommand::Attach(args) => watch::attach(args, program),
        ViewCommand::Replay(args) => watch::replay(args),
        ViewCommand::Cat(args) => cat::cat(&args),
    }
}

/// What `headroom train` says where only the viewer is installed.
pub const TRAIN_NEEDS_FULL_BUILD: &str = "headroom train needs the full build, which links \
    libtorch: in a clone of the repository run ./dev train (or ./dev build, then \
    target/release/headroom train); this `headroom` (from pip install) is the viewer: ls, \
    attach, replay";

/// The viewer-only command line (`argv` with the program name first): its exit status,
/// 0 done, 2 bad input or a failure to connect or read (the message on stderr).
pub fn main_viewer(argv: Vec<String>) -> u8 {
    let cli = match ViewerCli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code().clamp(0, 255) as u8;
        }
    };
    let result = match cli.command {
        ViewerOnly::View(cmd) => run_as(cmd, Program::Viewer),
        ViewerOnly::Train { .. } => Err(anyhow::anyhow!(TRAIN_NEEDS_FULL_BUILD)),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            out::err(&format!("headroom: error: {e:#}"));
            2
        }
    }
}
