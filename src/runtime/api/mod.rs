//! The operator's and embedder's surface: starting a cluster from Rust code (`cluster`), the
//! control handle (`control`), the in-process elastic job (`job`), what `GET /status` reports (`status`) and
//! the HTTP endpoint over the handle (`http`), a worker's notice (`notice`), the run's recent
//! history behind `GET /history` (`history`) and the live page that draws it (`page`).
//!
//! Imports: the actors and what they run (`actors`, `step`, `transport`, `clock`). Never
//! `procs`: the worker-process mode builds on this surface, not the other way round.
//!
//! Usage: README.md (The control API).

pub mod cluster;
pub mod control;
pub mod history;
pub mod http;
pub mod job;
pub mod notice;
pub mod page;
pub mod status;
