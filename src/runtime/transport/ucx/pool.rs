//! Large receive buffers, reused.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Rendezvous receive buffers from this size up are reused: handed back when the message's
/// bytes are dropped, so that a steady exchange of large frames lands in memory that is already
/// mapped (a fresh buffer costs a page fault per 4 KiB, as much as the copy itself).
pub(super) const POOLED_MIN_BYTES: usize = 1 << 20;
/// Free buffers the pool keeps at most.
const POOL_MAX_BUFFERS: usize = 8;

/// Large receive buffers, free for reuse.
#[derive(Default)]
pub(super) struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Pool {
    /// An empty buffer of capacity at least `len`: the smallest free one that fits, or a new one.
    pub(super) fn take(&self, len: usize) -> Vec<u8> {
        if len < POOLED_MIN_BYTES {
            return Vec::with_capacity(len);
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let fit = (0..free.len())
            .filter(|&i| free[i].capacity() >= len)
            .min_by_key(|&i| free[i].capacity());
        match fit {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// `buf` (holding one message) as bytes that go back to the pool when dropped.
    pub(super) fn wrap(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < POOLED_MIN_BYTES {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(self),
        })
    }
}

/// A received message's buffer, back to its pool when dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: std::sync::Weak<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let mut free = pool.free.lock().unwrap_or_else(|p| p.into_inner());
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        if free.len() < POOL_MAX_BUFFERS {
            free.push(buf);
        } else if let Some(i) = (0..free.len()).min_by_key(|&i| free[i].capacity()) {
            // Keep the larger ones.
            if free[i].capacity() < buf.capacity() {
                free[i] = buf;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_receive_buffers_are_reused_once_their_bytes_are_dropped() {
        let pool = Arc::new(Pool::default());
        let buf = pool.take(POOLED_MIN_BYTES);
        let at = buf.as_ptr();
        let mut buf = buf;
        buf.resize(POOLED_MIN_BYTES, 7);
        let bytes = pool.wrap(buf);
        let view = bytes.slice(10..20);
        drop(bytes);
        // A slice still holds the buffer.
        let other = pool.take(POOLED_MIN_BYTES);
        assert_ne!(other.as_ptr(), at);
        drop(view);
        let again = pool.take(POOLED_MIN_BYTES);
        assert_eq!((again.as_ptr(), again.len()), (at, 0));
        drop(other);
        // Small messages are not pooled.
        assert!(pool.take(100).capacity() < POOLED_MIN_BYTES);
    }
}
