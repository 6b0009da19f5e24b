//! The transport of a process that hosts no rank (the coordinator process). The coordinator
//! actor is generic over its ranks' transport; there it is instantiated with this empty type.

use super::{Frame, Transport, TransportError};
use crate::plan::RankId;

/// The transport type of a process that hosts no rank (the coordinator's): it cannot exist, so
/// nothing there can ever send or receive data frames.
pub enum Detached {}

impl Transport for Detached {
    fn rank(&self) -> RankId {
        match *self {}
    }
    fn send(&self, _: RankId, _: Frame) -> Result<(), TransportError> {
        match *self {}
    }
    fn recv_timeout(&mut self, _: u64) -> Result<Frame, TransportError> {
        match *self {}
    }
}
