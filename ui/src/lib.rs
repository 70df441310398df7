//! headroom's dashboard: state ([`app`], with the memory policy's in [`policy`] and the
//! threshold editor's in [`editor`], the CPU heap's in [`heap`], evaluation's in
//! [`eval`]), how the screen stands to the run ([`mode`]), drawing ([`view`]), wording
//! ([`describe`]), keys ([`keys`]), where telemetry comes from ([`feed`]: the in-process
//! bus, a socket, or a log being [`replay`]ed), the live loop ([`event_loop`]) and
//! terminal ownership ([`terminal`]). No libtorch here.
pub mod app;
pub mod breakdown;
pub mod describe;
pub mod editor;
pub mod eval;
pub mod event_loop;
pub mod feed;
pub mod heap;
pub mod history;
pub mod job;
pub mod keys;
pub mod mode;
pub mod policy;
pub mod replay;
pub mod terminal;
pub mod view;

pub use app::App;
pub use event_loop::{drive, drive_with, run_dashboard, DashboardExit, DashboardOptions};
pub use feed::{Control, Feed, Link, ReplayControl, ReplayHandle, ReplayState};
pub use mode::Mode;
pub use replay::{replay_feed, replay_job_feed, ReplayOptions};
pub use terminal::{install_panic_hook, NoTerminal, Suspend, TerminalGuard};
