//! Arbitrary bytes into both decoders: never a panic, never an allocation past the limit, and
//! whatever decodes re-encodes to the same bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

use elastic_zero::wire::{decode, encode_to_vec, StreamDecoder};

const MAX: u32 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    if let Ok((msg, used)) = decode(data, MAX) {
        assert_eq!(encode_to_vec(&msg), &data[..used]);
    }
    // The first byte picks a chunk size, so that split points vary too.
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let mut dec = StreamDecoder::new(MAX);
    for chunk in rest.chunks(cut as usize + 1) {
        let mut b = Bytes::copy_from_slice(chunk);
        while !b.is_empty() {
            match dec.next(&mut b) {
                Ok(_) => {}
                Err(_) => return,
            }
        }
        assert!(dec.pending_bytes() <= MAX as usize + 128);
    }
    let _ = dec.finish();
});
