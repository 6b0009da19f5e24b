//! Chunk states as one frame payload, for resharding and buddy replicas.
//!
//! The values travel as raw little-endian f32 after a small fixed header per chunk; a
//! per-element serializer cost a fifth of a step's CPU when every step refreshes the replicas.
//! Every chunk carries a CRC-32 of its header and bytes, computed by the sender and checked by
//! the receiver, so a damaged or mismatched parcel is refused whole and never applied. Lengths
//! are checked against the payload before anything is allocated.

use bytes::Bytes;

use crate::plan::RankId;
use crate::runtime::step::comm::CommError;
use crate::runtime::step::state::rank_state::ChunkState;
use crate::wire::f32s::{get_f32s, put_f32s};

/// unit, index (u32 each), three lengths (u64 each), CRC-32.
const CHUNK_HEADER: usize = 4 + 4 + 3 * 8 + 4;

/// The chunks, each with its CRC, as one payload.
pub(crate) fn encode_parcel(chunks: &[ChunkState]) -> Bytes {
    let values: usize = chunks
        .iter()
        .map(|c| c.params.len() + c.m.len() + c.v.len())
        .sum();
    let mut out = Vec::with_capacity(4 + chunks.len() * CHUNK_HEADER + 4 * values);
    out.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    for c in chunks {
        let head = out.len();
        out.extend_from_slice(&c.unit.to_le_bytes());
        out.extend_from_slice(&c.index.to_le_bytes());
        for part in [&c.params, &c.m, &c.v] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
        }
        let crc_at = out.len();
        out.extend_from_slice(&[0; 4]);
        for part in [&c.params, &c.m, &c.v] {
            put_f32s(&mut out, part);
        }
        let mut h = crc32fast::Hasher::new();
        h.update(&out[head..crc_at]);
        h.update(&out[crc_at + 4..]);
        out[crc_at..crc_at + 4].copy_from_slice(&h.finalize().to_le_bytes());
    }
    Bytes::from(out)
}

/// Decodes a parcel from `from` and checks it holds exactly the `expect`ed chunks, in order,
/// each matching its CRC.
pub(crate) fn decode_parcel(
    from: RankId,
    payload: &[u8],
    expect: &[(usize, usize)],
) -> Result<Vec<ChunkState>, CommError> {
    let bad = |what: String| CommError::Protocol { from, what };
    let mut rest = payload;
    let mut take = |n: usize, what: &str| -> Result<&[u8], CommError> {
        if rest.len() < n {
            return Err(bad(format!("parcel truncated in {what}")));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let count = u32_at(take(4, "the count")?, 0) as usize;
    if count != expect.len() {
        return Err(bad(format!(
            "parcel has {count} chunks, {} expected",
            expect.len()
        )));
    }
    let mut out = Vec::with_capacity(count);
    for &(u, i) in expect {
        let head = take(CHUNK_HEADER, "a chunk header")?;
        let (unit, index) = (u32_at(head, 0), u32_at(head, 4));
        if (unit as usize, index as usize) != (u, i) {
            return Err(bad(format!(
                "parcel holds chunk {unit}/{index} where {u}/{i} was expected"
            )));
        }
        let len = |k: usize| {
            let at = 8 + 8 * k;
            u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"))
        };
        let values = len(0)
            .checked_add(len(1))
            .and_then(|n| n.checked_add(len(2)))
            .and_then(|n| n.checked_mul(4))
            .filter(|&n| n <= payload.len() as u64)
            .ok_or_else(|| bad(format!("chunk {u}/{i}: lengths exceed the parcel")))?;
        let body = take(values as usize, "chunk values")?;
        let mut h = crc32fast::Hasher::new();
        h.update(&head[..CHUNK_HEADER - 4]);
        h.update(body);
        if h.finalize() != u32_at(head, CHUNK_HEADER - 4) {
            return Err(bad(format!("chunk {u}/{i} failed verification")));
        }
        let (p, m) = (4 * len(0) as usize, 4 * (len(0) + len(1)) as usize);
        out.push(ChunkState {
            unit,
            index,
            params: get_f32s(&body[..p]),
            m: get_f32s(&body[p..m]),
            v: get_f32s(&body[m..]),
        });
    }
    if !rest.is_empty() {
        return Err(bad(format!("{} stray bytes after the parcel", rest.len())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks() -> Vec<ChunkState> {
        vec![
            ChunkState {
                unit: 0,
                index: 2,
                params: vec![1.0, -0.0, f32::from_bits(0x7fc0_0001)],
                m: vec![0.5; 3],
                v: vec![0.25; 3],
            },
            ChunkState {
                unit: 3,
                index: 0,
                params: vec![2.0; 5],
                m: vec![],
                v: vec![],
            },
        ]
    }

    const EXPECT: [(usize, usize); 2] = [(0, 2), (3, 0)];

    #[test]
    fn parcels_round_trip_bit_for_bit() {
        let back = decode_parcel(1, &encode_parcel(&chunks()), &EXPECT).unwrap();
        let bits = |c: &[ChunkState]| -> Vec<Vec<u32>> {
            c.iter()
                .flat_map(|c| [&c.params, &c.m, &c.v])
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&back), bits(&chunks()));
        assert!(decode_parcel(1, &encode_parcel(&[]), &[])
            .unwrap()
            .is_empty());
    }

    #[test]
    fn every_flipped_bit_truncation_or_mismatch_is_refused() {
        let good = encode_parcel(&chunks()).to_vec();
        for at in 0..good.len() {
            for bit in [0, 7] {
                let mut b = good.clone();
                b[at] ^= 1 << bit;
                assert!(
                    decode_parcel(1, &b, &EXPECT).is_err(),
                    "byte {at} bit {bit}"
                );
            }
        }
        for n in 0..good.len() {
            assert!(decode_parcel(1, &good[..n], &EXPECT).is_err(), "{n} bytes");
        }
        assert!(decode_parcel(1, &good, &[(0, 2), (3, 1)]).is_err());
        assert!(decode_parcel(1, &good, &EXPECT[..1]).is_err());
        let mut longer = good.clone();
        longer.push(0);
        assert!(decode_parcel(1, &longer, &EXPECT).is_err());
    }

    #[test]
    fn absurd_lengths_are_refused_before_allocating() {
        let mut b = encode_parcel(&chunks()).to_vec();
        // The first chunk's params length, just after the count, unit and index.
        b[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = decode_parcel(1, &b, &EXPECT).unwrap_err();
        assert!(format!("{err:?}").contains("exceed"), "{err:?}");
    }
}
