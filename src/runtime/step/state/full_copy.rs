//! The full parameter copy that stages 0-2 keep of each unit, in the width the model computes
//! with. In fp32 training it is also the master copy, updated in place. Under bf16 mixed
//! precision it is a bf16 copy (half the bytes), the fp32 masters of the chunks a rank owns live
//! in its shard beside their optimizer state, and the copy is refreshed from them after each
//! update: the model sees exactly the values a stage-3 bf16 gather gives it.

use std::ops::Range;

use crate::model::gemm::{from_bf16, to_bf16};
use crate::reduce::le::extend_le;
use crate::wire::f32s::{decode_f32_into, put_f32s};

/// One unit's full copy (empty at stage 3).
#[derive(Clone, Debug, PartialEq)]
pub enum FullCopy {
    /// fp32: the values are the masters.
    F32(Vec<f32>),
    /// bf16 bit patterns: each is its owner's master rounded to nearest even.
    Bf16(Vec<u16>),
}

impl Default for FullCopy {
    fn default() -> Self {
        FullCopy::F32(Vec::new())
    }
}

impl FullCopy {
    /// A copy of `values`, rounded to bf16 when `bf16`.
    pub fn from_values(values: Vec<f32>, bf16: bool) -> Self {
        if bf16 {
            FullCopy::Bf16(values.iter().map(|&x| to_bf16(x)).collect())
        } else {
            FullCopy::F32(values)
        }
    }

    pub fn len(&self) -> usize {
        match self {
            FullCopy::F32(v) => v.len(),
            FullCopy::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes an element takes here and on the wire of the post-update all-gather.
    pub fn elem_bytes(&self) -> usize {
        match self {
            FullCopy::F32(_) => 4,
            FullCopy::Bf16(_) => 2,
        }
    }

    pub fn bytes(&self) -> u64 {
        (self.len() * self.elem_bytes()) as u64
    }

    /// The fp32 values, when the copy holds them (the masters, in fp32 training).
    pub fn f32s(&self) -> Option<&[f32]> {
        match self {
            FullCopy::F32(v) => Some(v),
            FullCopy::Bf16(_) => None,
        }
    }

    pub fn f32s_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            FullCopy::F32(v) => Some(v),
            FullCopy::Bf16(_) => None,
        }
    }

    /// Elements `r` as f32 (exact: every bf16 is an f32).
    pub fn values(&self, r: Range<usize>) -> Vec<f32> {
        match self {
            FullCopy::F32(v) => v[r].to_vec(),
            FullCopy::Bf16(v) => v[r].iter().map(|&h| from_bf16(h)).collect(),
        }
    }

    /// Sets elements `r` from their masters (rounded under bf16).
    pub fn set_from_masters(&mut self, r: Range<usize>, masters: &[f32]) {
        match self {
            FullCopy::F32(v) => v[r].copy_from_slice(masters),
            FullCopy::Bf16(v) => v[r]
                .iter_mut()
                .zip(masters)
                .for_each(|(d, &x)| *d = to_bf16(x)),
        }
    }

    /// Appends the little-endian bytes of elements `r` to `out`: what an owner sends of them in
    /// the all-gather after the update, [`FullCopy::elem_bytes`] an element.
    pub fn encode_into(&self, r: Range<usize>, out: &mut Vec<u8>) {
        match self {
            FullCopy::F32(v) => put_f32s(out, &v[r]),
            FullCopy::Bf16(v) => extend_le(out, &v[r]),
        }
    }

    /// Writes what [`FullCopy::encode_into`] made of elements `r`.
    pub fn decode_into(&mut self, r: Range<usize>, bytes: &[u8]) {
        match self {
            FullCopy::F32(v) => decode_f32_into(bytes, &mut v[r]),
            FullCopy::Bf16(v) => v[r]
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(d, b)| *d = u16::from_le_bytes([b[0], b[1]])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gemm::round_bf16;

    #[test]
    fn a_bf16_copy_holds_its_masters_rounded_and_travels_in_two_bytes() {
        let masters = vec![1.0f32 + f32::EPSILON, -2.71, 1e-30, 65504.0];
        let mut copy = FullCopy::from_values(masters.clone(), true);
        assert_eq!(copy.bytes(), 8);
        let want: Vec<f32> = masters.iter().map(|&x| round_bf16(x)).collect();
        assert_eq!(copy.values(0..4), want);
        let mut wire = vec![9u8];
        copy.encode_into(1..3, &mut wire);
        assert_eq!(wire.len(), 5, "appended");
        let wire = &wire[1..];
        let mut other = FullCopy::from_values(vec![0.0; 4], true);
        other.decode_into(1..3, wire);
        assert_eq!(other.values(1..3), want[1..3]);
        copy.set_from_masters(0..1, &[2.5]);
        assert_eq!(copy.values(0..1), vec![2.5]);
        assert!(copy.f32s().is_none());
        let f = FullCopy::from_values(masters.clone(), false);
        assert_eq!((f.bytes(), f.f32s()), (16, Some(&masters[..])));
    }
}
