//! The engine layer: state machines that take events (and the current time) and emit commands.
//! No I/O, no threads, no clock reads: the runtime drives them.
//!
//! Design: docs/elastic.md.

pub mod coordinator;
pub mod ledger;
pub mod messages;
