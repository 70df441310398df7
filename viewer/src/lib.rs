//! headroom's viewer: the stream's clients (`ls`, `attach`, `replay`) with no libtorch,
//! so the full `headroom` binary and the Python extension's `headroom` command share it.
pub mod attach;
pub mod cli;
pub mod client;
pub mod ls;
pub mod watch;

use clap::Parser;
use headroom_host::out;

pub use cli::{AttachArgs, ReplayArgs, ViewCommand, ViewerCli, ViewerOnly};

/// Runs one viewer command.
pub fn run(cmd: ViewCommand) -> anyhow::Result<()> {
    match cmd {
        ViewCommand::Ls => watch::ls(),
        ViewCommand::Attach(args) => watch::attach(args),
        ViewCommand::Replay(args) => watch::replay(args),
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
        ViewerOnly::View(cmd) => run(cmd),
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
