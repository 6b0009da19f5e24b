//! Durable sharded checkpoints: save a run's state at a step boundary, verify it, resume it at
//! any world size and ZeRO stage, and exchange weights with other tools through safetensors.
//!
//! A checkpoint is a directory `ROOT/step-N/` holding one chunk file per rank that owned chunks
//! when the snapshot was taken (written in parallel, each rank's chunks by its own thread) and a
//! `manifest.json` written last. The manifest is the commit record: it carries the shard map,
//! progress, config, optimizer hyper-parameters, data position, the model's parameter names and
//! shapes, and a CRC-32 and length for every file and chunk. Because a chunk is the unit the
//! shard map assigns, a checkpoint saved under one map is read under any other: the runtime's
//! `runtime::resume` re-cuts chunks for the new map, so world size, stage and chunk size may all
//! differ between save and load, and the resumed run continues bit for bit. A resume opens the
//! checkpoint with [`partial::CheckpointSource`] and each rank reads only the records covering
//! the chunks it owns.
//!
//! This module sits above the runtime (it stores what the runtime snapshots) and below the CLI.
//!
//! - [`write`]: the atomic save sequence, and crash points for tests;
//! - [`writer`]: the background thread that saves while training continues;
//! - [`stream`]: the same save fed piece by piece, for state on the tier that RAM cannot hold;
//! - [`read`]: loading and verifying whole; [`partial`]: per-rank reads for a resume; [`store`]: save directories, resolution, retention;
//! - [`manifest`], [`codec`]: the on-disk format; [`meta`]: per-run manifest fields;
//! - [`compat`]: whether a checkpoint may resume a given run;
//! - [`interchange`]: safetensors export and import; [`bench`]: throughput and slowdown.
//! - [`hf`]: Hugging Face model directories (GPT-2) in and out.
//!
//! Design: docs/wire.md (checkpoints on disk).

pub mod bench;
pub mod codec;
pub mod compat;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod interchange;
pub mod manifest;
pub mod meta;
pub mod partial;
pub mod read;
pub mod store;
pub mod stream;
pub mod write;
pub mod writer;

pub use error::CheckpointError;
pub use manifest::Manifest;
pub use meta::CheckpointMeta;
pub use partial::CheckpointSource;
pub use read::{load, load_latest_valid, load_path, read_manifest, verify, Loaded};
pub use stream::CheckpointSink;
pub use write::{save, CrashPoint, SaveOptions, SaveReport};
pub use writer::CheckpointWriter;
