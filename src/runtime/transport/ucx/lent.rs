//! Buffers a consumer lends the engine for messages it expects, so that a rendezvous payload
//! lands where it is used instead of in a pooled buffer that the consumer then copies from.
//!
//! A loan names the sender and the first bytes of the message's header (the wire layer's
//! prefix and frame header, which fix epoch, step, tag and payload length), and the payload's
//! length. The engine matches each announced rendezvous message against the open loans; a
//! match is received straight into the loan's memory and needs no receive credit (the memory
//! is the consumer's own). A message that arrived before its loan was made is matched when the
//! loan comes, as long as it is still waiting to be fetched. Loans are grouped in batches that
//! the consumer ends together: ending a batch withdraws its unmatched loans, and the consumer
//! then waits for the matched ones to complete before it touches the memory again. What the
//! consumer promises about that memory is in `transport::shared_memory` (its loans section).

/// Payloads smaller than this are not worth a loan (UCX sends up to 8 KiB eagerly, and a
/// small copy costs less than the bookkeeping). The engine keeps back for loans only
/// messages at least this long: a shorter one is never lent for, and a consumer waiting for it
/// while its loans are open would wait until its deadline.
pub const LEND_MIN_BYTES: usize = 64 << 10;

/// One lent buffer: `len` bytes at address `at`, for the next rendezvous message from engine
/// `from` whose header starts with `key` and whose payload is exactly `len` bytes.
#[derive(Debug, Clone)]
pub struct Loan {
    pub batch: u64,
    pub from: u32,
    pub key: Vec<u8>,
    pub at: usize,
    pub len: usize,
    /// Added into the memory rather than written there.
    pub add: Option<crate::runtime::transport::AddFn>,
}

impl Loan {
    /// Whether the message from `from` with `header` and a `len`-byte payload is this loan's.
    pub fn fits(&self, from: u32, header: &[u8], len: usize) -> bool {
        self.from == from && self.len == len && header.starts_with(&self.key)
    }
}

/// The most loans open at once: a batch is one payload's pieces (4 MiB each), so this covers
/// payloads of up to 16 GiB; a consumer past it receives the usual way.
pub const LOANS_MAX: usize = 4096;

/// The loans not matched yet.
#[derive(Debug, Default)]
pub struct Loans {
    open: Vec<Loan>,
    /// Loans refused for want of room, by batch: never matched, so their batch's end counts
    /// them with the withdrawn ones.
    refused: Vec<u64>,
}

impl Loans {
    /// Opens `loan`; `false` (and nothing opened) when [`LOANS_MAX`] are open.
    pub fn lend(&mut self, loan: Loan) -> bool {
        if self.open.len() >= LOANS_MAX {
            self.refused.push(loan.batch);
            return false;
        }
        self.open.push(loan);
        true
    }

    /// The first open loan for this message, taken off the table.
    pub fn take_match(&mut self, from: u32, header: &[u8], len: usize) -> Option<Loan> {
        let i = self.open.iter().position(|l| l.fits(from, header, len))?;
        Some(self.open.remove(i))
    }

    /// Withdraws the unmatched loans of `batch`; how many there were (refused ones included).
    pub fn end(&mut self, batch: u64) -> usize {
        let before = self.open.len() + self.refused.len();
        self.open.retain(|l| l.batch != batch);
        self.refused.retain(|&b| b != batch);
        before - self.open.len() - self.refused.len()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.open.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loan(batch: u64, from: u32, key: &[u8], at: usize, len: usize) -> Loan {
        Loan {
            batch,
            from,
            key: key.to_vec(),
            at,
            len,
            add: None,
        }
    }

    #[test]
    fn a_message_matches_only_its_sender_key_and_length() {
        let mut t = Loans::default();
        assert!(t.lend(loan(1, 0, b"head-a", 100, 64)));
        assert!(t.lend(loan(1, 0, b"head-b", 200, 64)));
        assert!(t.lend(loan(1, 2, b"head-a", 300, 64)));
        // Wrong sender, wrong length, a header that does not start with the key.
        assert!(t.take_match(1, b"head-a+sum", 64).is_none());
        assert!(t.take_match(0, b"head-a+sum", 65).is_none());
        assert!(t.take_match(0, b"head-c+sum", 64).is_none());
        assert!(
            t.take_match(0, b"head", 64).is_none(),
            "a header shorter than the key"
        );
        assert_eq!(t.take_match(0, b"head-b+sum", 64).map(|l| l.at), Some(200));
        // Taken: the same message again finds nothing.
        assert!(t.take_match(0, b"head-b+sum", 64).is_none());
        assert_eq!(t.take_match(2, b"head-a+sum", 64).map(|l| l.at), Some(300));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn ending_a_batch_withdraws_only_its_unmatched_loans() {
        let mut t = Loans::default();
        t.lend(loan(1, 0, b"a", 1, 8));
        t.lend(loan(1, 0, b"b", 2, 8));
        t.lend(loan(2, 0, b"c", 3, 8));
        assert!(t.take_match(0, b"a", 8).is_some());
        assert_eq!(t.end(1), 1);
        assert_eq!(t.end(1), 0);
        assert_eq!(t.take_match(0, b"c", 8).map(|l| l.batch), Some(2));
        assert!(t.is_empty());
    }

    #[test]
    fn the_table_is_bounded() {
        let mut t = Loans::default();
        for i in 0..LOANS_MAX {
            assert!(t.lend(loan(1, 0, b"k", i, 8)));
        }
        assert!(
            !t.lend(loan(2, 0, b"k", 0, 8)),
            "one past the bound is refused"
        );
        assert_eq!(t.len(), LOANS_MAX);
        // The refused loan counts as unmatched at its batch's end.
        assert_eq!(t.end(2), 1);
        assert_eq!(t.end(1), LOANS_MAX);
    }
}
