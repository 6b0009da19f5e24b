//! Chunk records on disk: a chunk's parameters, then its `m`, then its `v`, as little-endian f32
//! back to back. The manifest holds each record's offset and element counts, so the files carry
//! no headers and any chunk (or element range) can be read with one seek.

use super::manifest::ChunkEntry;
use crate::runtime::rank_state::ChunkState;

/// Appends `c`'s record to `out`.
pub fn encode_chunk(c: &ChunkState, out: &mut Vec<u8>) {
    for v in [&c.params, &c.m, &c.v] {
        let start = out.len();
        out.resize(start + 4 * v.len(), 0);
        for (dst, x) in out[start..].chunks_exact_mut(4).zip(v.iter()) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
    }
}

/// Little-endian f32 values of `bytes` (whose length is a multiple of 4).
pub fn decode_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The chunk state in `record`, the bytes `entry` describes.
///
/// Panics unless `record.len() == entry.bytes()`; callers slice the record by that length.
pub fn decode_chunk(entry: &ChunkEntry, record: &[u8]) -> ChunkState {
    let p = 4 * entry.params as usize;
    let m = p + 4 * entry.m as usize;
    ChunkState {
        unit: entry.unit,
        index: entry.index,
        params: decode_f32(&record[..p]),
        m: decode_f32(&record[p..m]),
        v: decode_f32(&record[m..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_bit_for_bit() {
        let c = ChunkState {
            unit: 2,
            index: 5,
            params: vec![1.5, -0.0, f32::MIN_POSITIVE, f32::from_bits(0x7fc0_0001)],
            m: vec![0.25; 4],
            v: vec![],
        };
        let mut bytes = Vec::new();
        encode_chunk(&c, &mut bytes);
        assert_eq!(bytes.len(), 32);
        let entry = ChunkEntry {
            unit: 2,
            index: 5,
            offset: 0,
            params: 4,
            m: 4,
            v: 0,
            crc32: String::new(),
        };
        let back = decode_chunk(&entry, &bytes);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.params), bits(&c.params));
        assert_eq!((back.m, back.v), (c.m, c.v));
    }
}
