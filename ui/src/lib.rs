//! headroom's dashboard: state ([`app`], with the memory policy's in [`policy`] and the
//! threshold editor's in [`editor`]), drawing ([`view`]), wording ([`describe`]), keys
//! ([`keys`]), the live loop ([`event_loop`]) and terminal ownership ([`terminal`]). No
//! libtorch here.
pub mod app;
pub mod describe;
pub mod editor;
pub mod event_loop;
pub mod history;
pub mod keys;
pub mod policy;
pub mod terminal;
pub mod view;

pub use app::App;
pub use event_loop::{drive, drive_with, run_dashboard, DashboardExit, DashboardOptions};
pub use terminal::{install_panic_hook, NoTerminal, Suspend, TerminalGuard};
