//! Heap buffers aligned for direct I/O: address, length and (by the tier's layout) file offset
//! are multiples of 4096, which is what O_DIRECT asks of 512e and 4Kn devices alike.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::plan::tier::IO_ALIGN_BYTES;

/// An owned, zero-initialised, 4096-byte-aligned buffer whose length is a multiple of 4096. It
/// moves to the I/O thread with each request and back with the completion, so no buffer is ever
/// shared while the kernel writes into it.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// The io_uring this buffer is registered with and its index there. The tag travels with
    /// the memory it names: a buffer allocated later at the same address has none, so a fixed
    /// operation can never reach pages the ring pinned for a buffer since dropped.
    fixed: Option<(u64, u16)>,
}

// SAFETY: the buffer is uniquely owned heap memory; moving it between threads is like moving a
// `Vec<u8>`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes (rounded up to a multiple of 4096; at least 4096).
    pub fn new(len: usize) -> Self {
        let align = IO_ALIGN_BYTES as usize;
        let len = len.max(1).div_ceil(align) * align;
        let layout = Layout::from_size_align(len, align).expect("aligned layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            fixed: None,
        }
    }

    /// This buffer's index in ring `ring`'s registered buffers, if it is registered there.
    pub fn fixed_in(&self, ring: u64) -> Option<u16> {
        self.fixed.and_then(|(r, i)| (r == ring).then_some(i))
    }

    /// Records that ring `ring` registered this buffer at `index`.
    pub(super) fn mark_fixed(&mut self, ring: u64, index: u16) {
        self.fixed = Some((ring, index));
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as `f32` values (4096-byte alignment satisfies `f32`'s).
    pub fn f32s(&self) -> &[f32] {
        // SAFETY: aligned, initialised, any bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast(), self.len / 4) }
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len / 4) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, IO_ALIGN_BYTES as usize).expect("layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_rounded_and_zeroed() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert!(b.bytes().iter().all(|&x| x == 0));
        b.f32s_mut()[3] = 1.5;
        assert_eq!(b.f32s()[3], 1.5);
        assert_eq!(b.f32s().len(), 2048);
    }
}
