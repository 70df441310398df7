//! The run log on disk: plain JSONL, or zstd-framed JSONL with index frames (a name
//! ending in `.zst`), optionally rotated into numbered segments. The format is described
//! in docs/LOG_SCHEMA.md ("Compressed and rotated logs"); these modules are its source of
//! truth. Writing policy (when to flush, when to rotate) is the log writer's
//! (host/src/logger.rs); reading is the replay's.
pub mod compact;
pub mod damage;
pub mod end;
pub mod index;
pub mod names;
pub mod read;
pub mod rotate;
pub mod write;

pub use compact::{compact_line, compact_value};
pub use damage::Damage;
pub use index::IndexEntry;
pub use names::{chain, is_compressed, segment_path, segments};
pub use rotate::Rotate;
pub use write::FrameWriter;
