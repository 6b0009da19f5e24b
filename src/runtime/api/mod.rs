//! The operator's and embedder's surface: starting a cluster from Rust code (`cluster`), the
//! control handle (`control`), the in-process elastic job (`job`), what `GET /status` reports (`status`) and
//! the HTTP endpoint over the handle (`http`), a worker's notice (`notice`).
//!
//! Imports: the actors and what they run (`actors`, `step`, `transport`, `clock`). Never
//! `procs`: the worker-process mode builds on this surface, not the other way round.
//!
//! Usage: README.md (The control API).

pub mod cluster;
pub mod control;
pub mod http;
pub mod job;
pub mod notice;
pub mod status;
