//! Chunk records on disk: a chunk's parameters, then its `m`, then its `v`, as little-endian f32
//! back to back. The manifest holds each record's offset and element counts, so the files carry
//! no headers and any chunk (or element range) can be read with one seek.

use super::manifest::ChunkEntry;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::wire::f32s::{get_f32s, put_f32s};

/// Appends `c`'s record to `out`.
pub fn encode_chunk(c: &ChunkState, out: &mut Vec<u8>) {
    for v in [&c.params, &c.m, &c.v] {
        put_f32s(out, v);
    }
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
        params: get_f32s(&record[..p]),
        m: get_f32s(&record[p..m]),
        v: get_f32s(&record[m..]),
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
