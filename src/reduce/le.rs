//! Numbers as little-endian bytes in bulk (reduction buffers and tensors on the wire): one `memcpy` on little-endian targets (every target
//! we build for), an element-wise loop elsewhere. Encoding tensors element by element into a
//! zero-filled buffer cost a fifth of a 64 MiB all-reduce's CPU (a `memset` and a loop the
//! compiler did not turn into a copy).

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for i64 {}
    impl Sealed for u16 {}
}

/// A plain number type whose in-memory bytes on a little-endian target are its little-endian
/// encoding: no padding, and every bit pattern a valid value.
pub trait LeNum: sealed::Sealed + Copy {
    const BYTES: usize;
    fn to_le(self, out: &mut [u8]);
    fn from_le(b: &[u8]) -> Self;
}

macro_rules! le_num {
    ($t:ty, $n:expr) => {
        impl LeNum for $t {
            const BYTES: usize = $n;
            fn to_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("BYTES bytes"))
            }
        }
    };
}

le_num!(f32, 4);
le_num!(i64, 8);
// bf16 bit patterns.
le_num!(u16, 2);

/// Appends `v` to `out` as little-endian bytes.
pub fn extend_le<T: LeNum>(out: &mut Vec<u8>, v: &[T]) {
    if cfg!(target_endian = "little") {
        // SAFETY: `T` is f32, i64 or u16 (sealed): no padding, so its slice is `len * BYTES`
        // initialised bytes, and on this target those bytes are the little-endian encoding.
        let bytes =
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * T::BYTES) };
        out.extend_from_slice(bytes);
    } else {
        let start = out.len();
        out.resize(start + v.len() * T::BYTES, 0);
        for (d, &x) in out[start..].chunks_exact_mut(T::BYTES).zip(v) {
            x.to_le(d);
        }
    }
}

/// Overwrites `dst[..bytes.len() / BYTES]` with the little-endian numbers in `bytes` (whose
/// length is a multiple of `BYTES` and at most `dst`'s).
pub fn copy_le_into<T: LeNum>(bytes: &[u8], dst: &mut [T]) {
    let n = bytes.len() / T::BYTES;
    assert!(n <= dst.len(), "{n} numbers into a slice of {}", dst.len());
    if cfg!(target_endian = "little") {
        // SAFETY: as in `extend_le`; any bit pattern is a valid f32, i64 or u16, and `dst` has room
        // for `n` of them.
        let out =
            unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), n * T::BYTES) };
        out.copy_from_slice(&bytes[..n * T::BYTES]);
    } else {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(T::BYTES)) {
            *d = T::from_le(b);
        }
    }
}

/// `v`'s memory as its little-endian bytes, to be written in place (a receive straight into a
/// tensor); `None` on a big-endian target, where the bytes are not the encoding.
pub fn le_bytes_mut<T: LeNum>(v: &mut [T]) -> Option<&mut [u8]> {
    // SAFETY: as in `copy_le_into`: no padding, every bit pattern valid, so any bytes written
    // leave valid numbers; the slice borrows `v` for its lifetime.
    cfg!(target_endian = "little").then(|| unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * T::BYTES)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_encoding_matches_element_wise() {
        let f = [1.5f32, -0.0, f32::MAX, f32::from_bits(0x7fc0_0001)];
        let mut out = vec![9u8];
        extend_le(&mut out, &f);
        let want: Vec<u8> = std::iter::once(9)
            .chain(f.iter().flat_map(|x| x.to_le_bytes()))
            .collect();
        assert_eq!(out, want);
        let mut back = [0f32; 5];
        copy_le_into(&out[1..], &mut back);
        assert_eq!(
            back[..4].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            f.map(f32::to_bits)
        );
        let i = [i64::MIN, -2, 3, i64::MAX];
        let mut out = Vec::new();
        extend_le(&mut out, &i);
        assert_eq!(
            out,
            i.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()
        );
        let mut back = [0i64; 4];
        copy_le_into(&out, &mut back);
        assert_eq!(back, i);
    }
}
