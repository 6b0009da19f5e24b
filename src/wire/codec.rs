//! Encoding and one-shot decoding of wire frames (layout in `mod.rs`).

use bincode::{Decode, Encode};
use bytes::Bytes;

use super::frame::{Frame, Tag, TagKind};
use super::{WireError, CHECKSUM_BYTES, MAX_HEADER_BYTES, PREFIX_BYTES, WIRE_VERSION};
use crate::plan::RankId;

/// Which of a connection's two streams a message travels on. Control (heartbeats, small
/// agreement frames) has its own stream so that a bulk transfer never delays it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    Control = 0,
    Bulk = 1,
}

/// One message on the wire.
#[derive(Clone, Debug)]
pub enum WireMsg {
    /// First message on every stream: who is speaking and which lane this stream is.
    Hello { rank: RankId, lane: Lane },
    /// A rank-to-rank frame of the `Transport` seam.
    Frame(Frame),
    /// An opaque message for the process layer (heartbeats, membership), on the control lane.
    Control { from: RankId, payload: Bytes },
}

#[derive(Encode, Decode)]
enum Header {
    Hello {
        rank: u32,
        lane: u8,
    },
    Frame {
        epoch: u64,
        step: u64,
        from: u32,
        kind: u8,
        attempt: u8,
        unit: u32,
        pass: u8,
        piece: u32,
    },
    Control {
        from: u32,
    },
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_HEADER_BYTES>()
}

fn tag_kind(b: u8) -> Result<TagKind, WireError> {
    Ok(match b {
        1 => TagKind::Gather,
        2 => TagKind::ReduceScatter,
        3 => TagKind::GatherGrads,
        4 => TagKind::GatherParams,
        5 => TagKind::Agree,
        6 => TagKind::Reshard,
        7 => TagKind::Replica,
        8 => TagKind::Interrupt,
        9 => TagKind::Broadcast,
        10 => TagKind::Barrier,
        _ => return Err(WireError::UnknownTagKind(b)),
    })
}

fn lane(b: u8) -> Result<Lane, WireError> {
    match b {
        0 => Ok(Lane::Control),
        1 => Ok(Lane::Bulk),
        _ => Err(WireError::UnknownLane(b)),
    }
}

/// The frame as chunks to write in order (prefix+header, payload, checksum), so that the
/// payload `Bytes` goes to the socket layer without a copy.
pub fn encode(msg: &WireMsg) -> [Bytes; 3] {
    encode_summed(msg, None)
}

/// [`encode`], given the payload's CRC-32 when the sender computed it as it wrote the payload
/// (`payload_crc`): the checksum is then combined from the header's and that one, without
/// reading the payload again. It must be the payload's: a wrong one makes the frame fail the
/// receiver's check.
fn encode_summed(msg: &WireMsg, payload_crc: Option<u32>) -> [Bytes; 3] {
    let (header, payload) = header_of(msg);
    let head = head_bytes(&header, payload.len());
    let sum = match payload_crc {
        Some(crc) => crc32_combined(&[&head], crc, payload.len()),
        None => crc32_of(&[&head, &payload]),
    };
    [
        Bytes::from(head),
        payload,
        Bytes::copy_from_slice(&sum.to_le_bytes()),
    ]
}

/// A message's header and payload.
fn header_of(msg: &WireMsg) -> (Header, Bytes) {
    match msg {
        WireMsg::Hello { rank, lane } => (
            Header::Hello {
                rank: *rank,
                lane: *lane as u8,
            },
            Bytes::new(),
        ),
        WireMsg::Frame(f) => (
            Header::Frame {
                epoch: f.epoch,
                step: f.step,
                from: f.from,
                kind: f.tag.kind as u8,
                attempt: f.tag.attempt,
                unit: f.tag.unit,
                pass: f.tag.pass,
                piece: f.tag.piece,
            },
            f.payload.clone(),
        ),
        WireMsg::Control { from, payload } => (Header::Control { from: *from }, payload.clone()),
    }
}

/// Prefix and header of a message whose payload is `payload_len` bytes.
fn head_bytes(header: &Header, payload_len: usize) -> Vec<u8> {
    let mut head = vec![0u8; PREFIX_BYTES + MAX_HEADER_BYTES];
    // Every header variant is far below the limit, so encoding into the slice cannot fail.
    let h = bincode::encode_into_slice(header, &mut head[PREFIX_BYTES..], config())
        .expect("headers are at most 37 bytes");
    head.truncate(PREFIX_BYTES + h);
    let body = (h + payload_len) as u32;
    head[0] = WIRE_VERSION;
    head[1..5].copy_from_slice(&body.to_le_bytes());
    head[5] = h as u8;
    head
}

/// The prefix and header that [`encode`] puts before the payload of a frame with this
/// (epoch, step, sender, tag) and a `payload_len`-byte payload: one encoding per frame, so a
/// receiver that lends a buffer for that frame knows it by these bytes before it arrives.
pub fn frame_head(epoch: u64, step: u64, from: RankId, tag: Tag, payload_len: usize) -> Vec<u8> {
    let header = Header::Frame {
        epoch,
        step,
        from,
        kind: tag.kind as u8,
        attempt: tag.attempt,
        unit: tag.unit,
        pass: tag.pass,
        piece: tag.piece,
    };
    head_bytes(&header, payload_len)
}

/// The frame as one contiguous buffer (tests, fuzzing, small messages).
pub fn encode_to_vec(msg: &WireMsg) -> Vec<u8> {
    encode(msg).iter().flat_map(|b| b.iter().copied()).collect()
}

/// Checks a 6-byte prefix; returns (body length, header length).
pub(super) fn check_prefix(
    prefix: &[u8; PREFIX_BYTES],
    max_frame_bytes: u32,
) -> Result<(usize, usize), WireError> {
    if prefix[0] != WIRE_VERSION {
        return Err(WireError::Version { got: prefix[0] });
    }
    let body = u32::from_le_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as u64;
    let max = max_frame_bytes as u64 + MAX_HEADER_BYTES as u64;
    if body > max {
        return Err(WireError::Oversize { len: body, max });
    }
    let (body, h) = (body as usize, prefix[5] as usize);
    if h == 0 || h > MAX_HEADER_BYTES || h > body {
        return Err(WireError::HeaderLength { len: h, body });
    }
    Ok((body, h))
}

/// CRC-32 of `parts` one after the other, as of their concatenation: every plane's frame
/// checksum (this codec's prefix, header and payload; the TCP plane's header and payload).
pub fn crc32_of(parts: &[&[u8]]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    parts.iter().for_each(|p| crc.update(p));
    crc.finalize()
}

/// The CRC-32 of `parts` followed by a `payload_len`-byte payload whose own CRC-32 is
/// `payload_crc`, without reading the payload.
fn crc32_combined(parts: &[&[u8]], payload_crc: u32, payload_len: usize) -> u32 {
    let mut h = crc32fast::Hasher::new();
    parts.iter().for_each(|p| h.update(p));
    h.combine(&crc32fast::Hasher::new_with_initial_len(
        payload_crc,
        payload_len as u64,
    ));
    h.finalize()
}

/// Decodes a complete frame whose prefix was checked: `rest` is header, payload and checksum,
/// and `got` the checksum the receiver computed over the prefix and `rest` less its last 4
/// bytes.
pub(super) fn decode_body(h: usize, rest: Bytes, got: u32) -> Result<WireMsg, WireError> {
    let body = rest.len() - CHECKSUM_BYTES;
    let c = &rest[body..];
    let expected = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    if got != expected {
        return Err(WireError::Checksum { expected, got });
    }
    decode_header(&rest[..h], rest.slice(h..body))
}

/// A message as two pieces: the payload, and everything `encode` puts around it (prefix and
/// header, then the checksum) in one small buffer. The UCX plane sends the payload where it
/// lies, so that it can land in the receiver's buffer with one copy.
pub fn encode_split(msg: &WireMsg) -> (Vec<u8>, Bytes) {
    encode_split_summed(msg, None)
}

/// [`encode_split`] with the payload's CRC-32 when the sender has it (see [`encode`]).
pub fn encode_split_summed(msg: &WireMsg, payload_crc: Option<u32>) -> (Vec<u8>, Bytes) {
    let [head, payload, sum] = encode_summed(msg, payload_crc);
    let mut around = Vec::with_capacity(head.len() + sum.len());
    around.extend_from_slice(&head);
    around.extend_from_slice(&sum);
    (around, payload)
}

/// What [`encode_split_summed`] puts around a frame's payload, for a payload of `payload_len`
/// bytes whose CRC-32 is `payload_crc` (written elsewhere: the UCX plane's staging slots); the
/// frame's own payload is ignored.
pub fn frame_around(frame: &Frame, payload_len: usize, payload_crc: u32) -> Vec<u8> {
    let (header, _) = header_of(&WireMsg::Frame(Frame {
        payload: Bytes::new(),
        ..frame.clone()
    }));
    let head = head_bytes(&header, payload_len);
    let sum = crc32_combined(&[&head], payload_crc, payload_len);
    let mut around = head;
    around.extend_from_slice(&sum.to_le_bytes());
    around
}

/// Decodes what [`encode_split`] made, with every check of [`decode`]. `payload_crc`: the
/// payload's CRC-32 if the receiver took it as the payload landed (else it is read here).
pub fn decode_split(
    around: &[u8],
    payload: Bytes,
    max_frame_bytes: u32,
    payload_crc: Option<u32>,
) -> Result<WireMsg, WireError> {
    let header = check_split(around, &payload, max_frame_bytes, payload_crc)?;
    decode_header(header, payload)
}

/// Checks what [`encode_split`] made, with every check of [`decode`], for a payload that stays
/// where it landed (a buffer the receiver lent): the message comes back with an empty payload.
/// `payload_crc` as for [`decode_split`].
pub fn check_split_in_place(
    around: &[u8],
    payload: &[u8],
    max_frame_bytes: u32,
    payload_crc: Option<u32>,
) -> Result<WireMsg, WireError> {
    let header = check_split(around, payload, max_frame_bytes, payload_crc)?;
    decode_header(header, Bytes::new())
}

/// The header bytes of a message split as [`encode_split`] does, once every check passed.
fn check_split<'a>(
    around: &'a [u8],
    payload: &[u8],
    max_frame_bytes: u32,
    payload_crc: Option<u32>,
) -> Result<&'a [u8], WireError> {
    if around.len() < PREFIX_BYTES + CHECKSUM_BYTES {
        return Err(WireError::Truncated {
            have: around.len(),
            need: PREFIX_BYTES + CHECKSUM_BYTES,
        });
    }
    let prefix: [u8; PREFIX_BYTES] = around[..PREFIX_BYTES].try_into().expect("length checked");
    let (body, h) = check_prefix(&prefix, max_frame_bytes)?;
    let header = &around[PREFIX_BYTES..around.len() - CHECKSUM_BYTES];
    if header.len() != h || body != h + payload.len() {
        return Err(WireError::Truncated {
            have: PREFIX_BYTES + header.len() + payload.len() + CHECKSUM_BYTES,
            need: PREFIX_BYTES + body + CHECKSUM_BYTES,
        });
    }
    let got = match payload_crc {
        Some(crc) => crc32_combined(&[&prefix, header], crc, payload.len()),
        None => crc32_of(&[&prefix, header, payload]),
    };
    let c = &around[around.len() - CHECKSUM_BYTES..];
    let expected = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    if got != expected {
        return Err(WireError::Checksum { expected, got });
    }
    Ok(header)
}

/// The message of a checked frame: its header bytes and its payload.
fn decode_header(head: &[u8], payload: Bytes) -> Result<WireMsg, WireError> {
    let h = head.len();
    let (header, used): (Header, usize) =
        bincode::decode_from_slice(head, config()).map_err(|e| WireError::Header(e.to_string()))?;
    if used != h {
        return Err(WireError::Header(format!(
            "{} stray bytes after the header",
            h - used
        )));
    }
    // One message, one encoding: a header with non-minimal integers is refused, so that what
    // decodes always re-encodes to the same bytes.
    let mut canon = [0u8; MAX_HEADER_BYTES];
    let n = bincode::encode_into_slice(&header, &mut canon, config())
        .map_err(|e| WireError::Header(e.to_string()))?;
    if canon[..n] != head[..] {
        return Err(WireError::Header("non-canonical header encoding".into()));
    }
    let empty = |kind: &'static str| {
        if payload.is_empty() {
            Ok(())
        } else {
            Err(WireError::UnexpectedPayload {
                kind,
                len: payload.len(),
            })
        }
    };
    Ok(match header {
        Header::Hello { rank, lane: l } => {
            empty("hello")?;
            WireMsg::Hello {
                rank,
                lane: lane(l)?,
            }
        }
        Header::Frame {
            epoch,
            step,
            from,
            kind,
            attempt,
            unit,
            pass,
            piece,
        } => WireMsg::Frame(Frame {
            epoch,
            step,
            from,
            tag: Tag {
                kind: tag_kind(kind)?,
                attempt,
                unit,
                pass,
                piece,
            },
            payload,
        }),
        Header::Control { from } => WireMsg::Control { from, payload },
    })
}

/// Decodes the frame at the start of `buf`; returns it and the bytes it used.
pub fn decode(buf: &[u8], max_frame_bytes: u32) -> Result<(WireMsg, usize), WireError> {
    decode_with(buf, max_frame_bytes, |body| {
        Bytes::copy_from_slice(&buf[body])
    })
}

fn decode_with(
    buf: &[u8],
    max_frame_bytes: u32,
    body_of: impl FnOnce(std::ops::Range<usize>) -> Bytes,
) -> Result<(WireMsg, usize), WireError> {
    if buf.len() < PREFIX_BYTES {
        return Err(WireError::Truncated {
            have: buf.len(),
            need: PREFIX_BYTES,
        });
    }
    let prefix: [u8; PREFIX_BYTES] = buf[..PREFIX_BYTES].try_into().expect("length checked");
    let (body, h) = check_prefix(&prefix, max_frame_bytes)?;
    let total = PREFIX_BYTES + body + CHECKSUM_BYTES;
    if buf.len() < total {
        return Err(WireError::Truncated {
            have: buf.len(),
            need: total,
        });
    }
    let got = crc32_of(&[&prefix, &buf[PREFIX_BYTES..total - CHECKSUM_BYTES]]);
    let rest = body_of(PREFIX_BYTES..total);
    Ok((decode_body(h, rest, got)?, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::{Frame, Tag, TagKind};

    /// A checksum combined from the header's and the payload's CRC is the one computed over
    /// the whole frame; a wrong payload CRC makes the frame fail the receiver's check.
    #[test]
    fn a_summed_encoding_is_the_plain_one_and_a_wrong_sum_is_caught() {
        let payload: Vec<u8> = (0..70_001u32).map(|i| (i * 31 % 251) as u8).collect();
        let msg = WireMsg::Frame(Frame {
            epoch: 2,
            step: 9,
            from: 1,
            tag: Tag {
                kind: TagKind::ReduceScatter,
                attempt: 0,
                unit: 4,
                pass: 0,
                piece: 3,
            },
            payload: Bytes::from(payload.clone()),
        });
        let plain = encode_split(&msg);
        let crc = crc32_of(&[&payload]);
        assert_eq!(encode_split_summed(&msg, Some(crc)), plain);
        let (around, body) = encode_split_summed(&msg, Some(crc ^ 1));
        assert!(matches!(
            decode_split(&around, body, 1 << 20, None),
            Err(WireError::Checksum { .. })
        ));
        let WireMsg::Frame(f) = &msg else {
            unreachable!()
        };
        // The bytes around a payload written elsewhere are the same.
        assert_eq!(frame_around(f, payload.len(), crc), plain.0);
        let (around, body) = plain;
        assert!(decode_split(&around, body.clone(), 1 << 20, None).is_ok());
        // A receiver that took the payload's CRC as it landed: the right one passes, and a
        // payload that does not match its header's checksum fails either way.
        assert!(decode_split(&around, body.clone(), 1 << 20, Some(crc)).is_ok());
        assert!(matches!(
            check_split_in_place(&around, &body, 1 << 20, Some(crc ^ 4)),
            Err(WireError::Checksum { .. })
        ));
        let mut damaged = body.to_vec();
        damaged[7] ^= 1;
        let damaged_crc = crc32_of(&[&damaged]);
        assert!(matches!(
            check_split_in_place(&around, &damaged, 1 << 20, Some(damaged_crc)),
            Err(WireError::Checksum { .. })
        ));
    }
}
