//! The tier file's tests: layout, round trips, CRCs, faults, deferred writes and two copies.

use std::sync::{Arc, Mutex};

use super::super::device::{Faults, FaultyDevice, MemDevice};
use super::*;

fn layout() -> TierLayout {
    TierLayout::new(
        vec![3000, 0, 1024],
        1024,
        RecordKinds {
            params: true,
            state: 2,
            grads: 0,
        },
    )
}

#[test]
fn records_tile_each_unit() {
    let l = layout();
    assert_eq!(l.records(), 4);
    assert_eq!(l.unit_records(0), 0..3);
    assert_eq!(l.unit_records(1), 3..3);
    assert_eq!(l.record_span(2), (0, 2048..3000));
    assert_eq!(l.record_span(3), (2, 0..1024));
    assert_eq!(l.stride(), 3 * 4096);
    assert_eq!(l.value_offset(1, 2), (3 * 4096 + 2 * 4096) as u64);
}

fn file(faults: Faults) -> TierFile {
    file_and_bytes(faults).0
}

fn file_and_bytes(faults: Faults) -> (TierFile, Arc<Mutex<Vec<u8>>>) {
    let dev = MemDevice::new();
    let bytes = Arc::clone(&dev.data);
    let f = TierFile::create(
        Path::new("/nonexistent/never-written"),
        Box::new(FaultyDevice::new(dev, faults)),
        layout(),
        2,
    )
    .unwrap();
    (f, bytes)
}

#[test]
fn round_trip_and_partial_reads() {
    let mut f = file(Faults::default());
    let mut b = f.take_buf().unwrap();
    for (i, x) in b.f32s_mut().iter_mut().enumerate() {
        *x = i as f32;
    }
    let p = f.start_write(1, b).unwrap();
    let b = f.finish(p).unwrap();
    f.put_buf(b);
    let b = f.take_buf().unwrap();
    let p = f.start_read(1, 1..3, b).unwrap();
    let b = f.finish(p).unwrap();
    assert_eq!(b.f32s()[0], 1024.0);
    assert_eq!(b.f32s()[2047], 3071.0);
    f.put_buf(b);
    // Elements 1030..1040 of the shard are record 1's elements 6..16; value 2 is v.
    let b = f.take_buf().unwrap();
    let p = f.start_read(1, 2..3, b).unwrap();
    let b = f.finish(p).unwrap();
    let v = b.f32s()[6..16].to_vec();
    assert_eq!(v, (2054..2064).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(f.stats.write_bytes, 3 * 4096);
}

/// The waits of a helper beside compute are not the step's; joining one is.
#[test]
fn waits_beside_compute_are_not_counted() {
    let mut f = file(Faults::default());
    let moved = beside_compute(|| {
        let b = f.take_buf().unwrap();
        let p = f.start_write(0, b).unwrap();
        let b = f.finish(p).unwrap();
        f.put_buf(b);
        f.stats
    });
    assert_eq!(moved.write_bytes, 3 * 4096);
    assert_eq!(moved.wait_s, 0.0);
    f.add_wait(0.25);
    assert_eq!(f.stats.wait_s, 0.25);
    // The thread is the step's again once `beside_compute` returns.
    assert!(!BESIDE_COMPUTE.with(|b| b.get()));
}

#[test]
fn a_damaged_block_is_named_and_not_used() {
    let (mut f, bytes) = file_and_bytes(Faults::default());
    let b = f.take_buf().unwrap();
    let p = f.start_write(2, b).unwrap();
    let b = f.finish(p).unwrap();
    f.put_buf(b);
    // Flip a bit behind the engine's back, in record 2's v.
    bytes.lock().unwrap()[2 * 3 * 4096 + 2 * 4096 + 17] ^= 1;
    let b = f.take_buf().unwrap();
    let p = f.start_read(2, 0..3, b).unwrap();
    let err = f.finish(p).unwrap_err();
    assert_eq!(
        err,
        TierError::Corrupt {
            path: PathBuf::from("/nonexistent/never-written"),
            offset: (2 * 3 * 4096 + 2 * 4096) as u64,
            unit: 0,
        }
    );
    assert!(err.to_string().contains("fails its CRC check"));
    // The buffer went back to the pool.
    assert_eq!(f.pool.len(), 2);
}

/// Record `rec`'s value 0 as the file reads it now.
fn first_value(f: &mut TierFile, rec: usize) -> f32 {
    let b = f.take_buf().unwrap();
    let p = f.start_read(rec, 0..1, b).unwrap();
    let b = f.finish(p).unwrap();
    let x = b.f32s()[0];
    f.put_buf(b);
    x
}

fn write_filled(f: &mut TierFile, rec: usize, x: f32, next: bool, defer: bool) {
    let mut b = f.take_buf().unwrap();
    b.f32s_mut().iter_mut().for_each(|v| *v = x);
    let all = 0..f.layout.kinds.values();
    let p = match next {
        true => f.start_write_next(rec, all, b),
        false => f.start_write_values(rec, all, b),
    }
    .unwrap();
    if defer {
        f.defer(p);
    } else {
        let b = f.finish(p).unwrap();
        f.put_buf(b);
    }
}

#[test]
fn with_two_copies_an_update_becomes_the_state_only_when_committed() {
    let dev = MemDevice::new();
    let bytes = Arc::clone(&dev.data);
    let mut f = TierFile::create_with(
        Path::new("/nonexistent/two"),
        Box::new(dev),
        layout(),
        3,
        true,
    )
    .unwrap();
    assert_eq!(f.file_bytes(), 2 * f.layout.file_bytes());
    write_filled(&mut f, 0, 1.0, false, false);
    write_filled(&mut f, 3, 1.0, false, false);
    // Unit 0's update goes to its other copy, deferred; reads still see the state.
    write_filled(&mut f, 0, 2.0, true, true);
    f.stage_next(0);
    assert_eq!(first_value(&mut f, 0), 1.0);
    // Dropped (a redone pass): nothing changes; written again and committed: it is the
    // state, and only unit 0 moved.
    f.drop_next();
    assert_eq!(f.commit_next(), 0);
    assert_eq!(first_value(&mut f, 0), 1.0);
    write_filled(&mut f, 0, 3.0, true, true);
    f.stage_next(0);
    assert_eq!(f.commit_next(), 1);
    assert_eq!(first_value(&mut f, 0), 3.0);
    assert_eq!(first_value(&mut f, 3), 1.0);
    // The next update goes back to the first copy, over the first state.
    write_filled(&mut f, 0, 4.0, true, false);
    f.stage_next(0);
    assert_eq!(f.commit_next(), 1);
    assert_eq!(first_value(&mut f, 0), 4.0);
    // A damaged block of the second copy is named with its unit.
    write_filled(&mut f, 3, 5.0, true, false);
    f.stage_next(2);
    f.commit_next();
    let second = f.layout.file_bytes() as usize;
    bytes.lock().unwrap()[second + 3 * 3 * 4096 + 5] ^= 1;
    let b = f.take_buf().unwrap();
    let p = f.start_read(3, 0..1, b).unwrap();
    assert!(matches!(
        f.finish(p),
        Err(TierError::Corrupt { unit: 2, .. })
    ));
}

#[test]
fn a_write_waits_for_a_deferred_write_of_the_same_blocks() {
    let mut f = file(Faults::default());
    write_filled(&mut f, 1, 1.0, false, true);
    write_filled(&mut f, 1, 2.0, false, true);
    assert_eq!(
        f.deferred.len(),
        1,
        "the first landed before the second started"
    );
    assert_eq!(first_value(&mut f, 1), 2.0);
}

#[test]
fn a_full_disk_is_a_typed_error() {
    let mut f = file(Faults {
        fail_after_write_bytes: Some(4096),
        errno: libc::ENOSPC,
        ..Faults::default()
    });
    let b = f.take_buf().unwrap();
    let p = f.start_write(0, b).unwrap();
    let err = f.finish(p).unwrap_err();
    assert!(matches!(
        err,
        TierError::Io {
            source: IoError::NoSpace,
            ..
        }
    ));
    assert!(err.to_string().contains("no space left"));
}

#[test]
fn deferred_writes_are_waited_for_by_overlapping_reads_and_their_errors_surface() {
    let mut f = file(Faults::default());
    let mut b = f.take_buf().unwrap();
    b.f32s_mut().iter_mut().for_each(|x| *x = 7.0);
    let p = f.start_write(0, b).unwrap();
    f.defer(p);
    // The deferred write's buffer counts as free and is taken back when wanted.
    assert_eq!(f.free_bufs(), 2);
    let b1 = f.take_buf().unwrap();
    let b2 = f.take_buf().unwrap();
    assert!(f.take_buf().is_none());
    f.put_buf(b2);
    // A read waits for what is deferred and sees it.
    let p = f.start_read(0, 0..1, b1).unwrap();
    assert_eq!(f.finish(p).unwrap().f32s()[0], 7.0);
    // A failed deferred write is reported by the next operation, not lost.
    let mut f = file(Faults {
        fail_after_write_bytes: Some(4096),
        errno: libc::EIO,
        ..Faults::default()
    });
    let b = f.take_buf().unwrap();
    let p = f.start_write(0, b).unwrap();
    f.defer(p);
    // A read of another record leaves it in flight...
    let b = f.take_buf().unwrap();
    let p = f.start_read(1, 0..1, b).unwrap();
    let b = f.finish(p).unwrap();
    f.put_buf(b);
    assert_eq!(f.deferred.len(), 1);
    // ... and one that overlaps it waits for it and gets its error.
    let b = f.take_buf().unwrap();
    assert!(matches!(
        f.start_read(0, 1..2, b),
        Err(TierError::Io { .. })
    ));
    assert_eq!(f.free_bufs(), 2, "every buffer is back");
    assert!(f.settle().is_ok(), "reported once");
}
