//! The parameter digest, `param-sha256`: what runs, resumes and checkpoints compare to show that
//! two models are bit-identical. It is defined here once. The run summary, the resume check, the
//! checkpoint save and the checkpoint load all feed this hasher, so they cannot drift apart.
//!
//! Definition: SHA-256 of every parameter as little-endian fp32, units in order and each unit's
//! flat buffer in order, as lowercase hex. Chunks cut a unit's buffer into consecutive ranges, so
//! hashing chunks in (unit, index) order gives the digest of the consolidated parameters, for any
//! chunk size. Bits are hashed as they are: -0.0 differs from 0.0, and NaN payloads count.

use sha2::{Digest, Sha256};

/// Parameters encoded per call to SHA-256: enough to amortise the call, small enough for the
/// stack.
const BLOCK_ELEMS: usize = 1024;

/// An incremental `param-sha256`: feed it the parameters in canonical order, in any pieces.
#[derive(Clone, Default)]
pub struct ParamDigest {
    sha: Sha256,
}

impl ParamDigest {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `params`, the next values in canonical order.
    pub fn update(&mut self, params: &[f32]) {
        let mut buf = [0u8; 4 * BLOCK_ELEMS];
        for block in params.chunks(BLOCK_ELEMS) {
            let bytes = &mut buf[..4 * block.len()];
            for (dst, x) in bytes.chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&x.to_le_bytes());
            }
            self.sha.update(bytes);
        }
    }

    /// Appends parameters already encoded as little-endian fp32 (a checkpoint record's
    /// parameters): the same as [`update`](Self::update) of the decoded values, without
    /// decoding them.
    ///
    /// Panics unless `bytes` holds whole fp32 values: a caller slicing at a wrong offset would
    /// otherwise hash a different model without noticing.
    pub fn update_le_bytes(&mut self, bytes: &[u8]) {
        assert!(
            bytes.len().is_multiple_of(4),
            "{} bytes are not a whole number of fp32 parameters",
            bytes.len()
        );
        self.sha.update(bytes);
    }

    /// The digest, as lowercase hex.
    pub fn finish(self) -> String {
        self.sha
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// The digest of `parts` (units, or chunks in (unit, index) order) hashed one after another.
pub fn param_sha256<'a>(parts: impl IntoIterator<Item = &'a [f32]>) -> String {
    let mut d = ParamDigest::new();
    for p in parts {
        d.update(p);
    }
    d.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values spanning several blocks, with both zeros and two NaN payloads among them.
    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|k| match k % 7 {
                0 => -0.0,
                1 => f32::from_bits(0x7fc0_0001),
                2 => f32::from_bits(0x7fc0_0002),
                _ => k as f32 * 0.1,
            })
            .collect()
    }

    #[test]
    fn it_is_sha256_of_the_little_endian_bytes_however_the_values_are_split() {
        let v = values(3 * BLOCK_ELEMS + 5);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let want: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(param_sha256([&v[..]]), want);
        for cut in [0, 1, BLOCK_ELEMS, BLOCK_ELEMS + 1, v.len()] {
            let (a, b) = v.split_at(cut);
            assert_eq!(param_sha256([a, &[][..], b]), want, "cut at {cut}");
            let mut d = ParamDigest::new();
            d.update(a);
            d.update_le_bytes(&bytes[4 * cut..]);
            assert_eq!(d.finish(), want, "bytes after {cut}");
        }
    }

    #[test]
    fn one_flipped_bit_changes_the_digest() {
        let v = values(100);
        let mut w = v.clone();
        w[1] = f32::from_bits(w[1].to_bits() ^ 1);
        assert_ne!(param_sha256([&v[..]]), param_sha256([&w[..]]));
        w[0] = 0.0;
        w[1] = v[1];
        assert_ne!(param_sha256([&v[..]]), param_sha256([&w[..]]));
    }

    #[test]
    #[should_panic(expected = "not a whole number of fp32")]
    fn bytes_that_are_not_whole_values_are_refused() {
        ParamDigest::new().update_le_bytes(&[0; 6]);
    }
}
