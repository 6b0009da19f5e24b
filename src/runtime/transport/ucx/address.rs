//! An engine's address as it travels over the control plane: the UCP worker's address, then
//! the descriptor of the engine's staging segment if it has one (`shm`).

use super::shm::{Descriptor, DESCRIPTOR_BYTES};
use super::UcxError;

/// An engine's address: the UCP worker's, then its staging descriptor if it has one.
pub(super) fn join_address(worker: &[u8], staging: Option<&Descriptor>) -> Vec<u8> {
    let mut a = Vec::with_capacity(4 + worker.len() + DESCRIPTOR_BYTES);
    a.extend_from_slice(&(worker.len() as u32).to_le_bytes());
    a.extend_from_slice(worker);
    if let Some(d) = staging {
        a.extend_from_slice(&d.encode());
    }
    a
}

/// The largest staging segment a peer may describe (it is mapped, not copied, but a bound
/// keeps a bad descriptor from reserving address space at will).
const STAGING_MAX_BYTES: usize = 1 << 30;

/// The parts of an [`Engine::address`].
pub(super) fn split_address(a: &[u8]) -> Result<(&[u8], Option<Descriptor>), UcxError> {
    let bad = |what: String| UcxError::Call {
        call: "reading a peer's address",
        status: what,
    };
    let n = a
        .get(..4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")) as usize)
        .ok_or_else(|| bad(format!("{} bytes, no length", a.len())))?;
    let worker = a
        .get(4..4 + n)
        .filter(|w| !w.is_empty())
        .ok_or_else(|| bad(format!("{} bytes, a worker address of {n}", a.len())))?;
    let staging = match &a[4 + n..] {
        [] => None,
        d => Some(Descriptor::decode(d, STAGING_MAX_BYTES).map_err(bad)?),
    };
    Ok((worker, staging))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_splits_into_its_parts_and_a_malformed_one_is_refused() {
        let d = Descriptor {
            shmid: 7,
            slots: 4,
            slot_bytes: 1 << 22,
            nonce: [3; 16],
        };
        let with = join_address(b"worker", Some(&d));
        assert_eq!(split_address(&with).unwrap(), (&b"worker"[..], Some(d)));
        let without = join_address(b"worker", None);
        assert_eq!(split_address(&without).unwrap(), (&b"worker"[..], None));
        for bad in [
            &with[..2],
            &with[..8],
            &with[..with.len() - 1],
            &join_address(b"", None),
        ] {
            assert!(split_address(bad).is_err(), "{bad:?}");
        }
        let huge = Descriptor {
            slots: 1024,
            slot_bytes: u32::MAX,
            ..d
        };
        let err = split_address(&join_address(b"w", Some(&huge))).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }
}
