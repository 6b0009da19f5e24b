use super::*;

fn dev(capacity_bytes: u64, link_bytes_per_s: f64) -> SimDevice {
    SimDevice::new(SimSpec {
        capacity_bytes,
        link_bytes_per_s,
    })
}

#[test]
fn an_allocation_past_the_capacity_is_refused_with_the_tensor_and_the_numbers() {
    let d = dev(1000, 1e12);
    let a = d.alloc("blocks.0.params", DeviceKind::Params, 200).unwrap();
    let err = d
        .alloc("blocks.1.params", DeviceKind::Params, 51)
        .unwrap_err();
    assert_eq!(
        err,
        DeviceError::OutOfMemory {
            tensor: "blocks.1.params".into(),
            kind: "params",
            requested_bytes: 204,
            in_use_bytes: 800,
            capacity_bytes: 1000,
        }
    );
    let text = err.to_string();
    assert!(text.contains("blocks.1.params") && text.contains("--device-memory-max"));
    // Exactly at the capacity fits; freeing gives the bytes back.
    let b = d.alloc("fits", DeviceKind::Grads, 50).unwrap();
    assert_eq!(d.counters().resident_bytes, 1000);
    d.free(a);
    d.free(b);
    assert_eq!(d.counters().resident_bytes, 0);
    assert_eq!(d.counters().peak_bytes, 1000);
    assert!(d.reserve("acts", DeviceKind::Activations, 1001).is_err());
}

#[test]
fn copies_round_trip_and_count_the_bytes_that_cross_the_link() {
    let d = dev(1 << 20, 1e12);
    let buf = d.alloc("w", DeviceKind::Params, 4).unwrap();
    let ev = d
        .upload(HostData::F32(vec![1.0, -2.5, 3.0, 0.125]), &buf)
        .unwrap();
    d.wait(&ev);
    let back = d.download(&buf);
    d.wait(&back);
    assert_eq!(back.take().unwrap(), vec![1.0, -2.5, 3.0, 0.125]);
    // bf16 crosses at 2 bytes an element and is widened exactly.
    let vals = [1.5f32, -0.0078125, 256.0, 3.0];
    let ev = d.upload(HostData::bf16_of(&vals), &buf).unwrap();
    d.wait(&ev);
    d.with_view(&buf, &mut |v| assert_eq!(v, vals));
    let c = d.counters();
    assert_eq!((c.h2d_bytes, c.d2h_bytes), (16 + 8, 16));
    assert_eq!((c.h2d_copies, c.d2h_copies), (2, 1));
    let wrong = d.upload(HostData::F32(vec![0.0; 3]), &buf);
    assert!(matches!(wrong, Err(DeviceError::SizeMismatch { .. })));
    d.free(buf);
}

#[test]
fn the_copy_queue_is_ordered_and_a_copy_runs_beside_compute() {
    // 4 MiB at 100 MB/s: 42 ms a copy.
    let d = dev(64 << 20, 1e8);
    let n = 1 << 20;
    let a = d.alloc("a", DeviceKind::Params, n).unwrap();
    let (ones, twos) = (vec![1.0; n], vec![2.0; n]);
    let t0 = Instant::now();
    let first = d.upload(HostData::F32(ones), &a).unwrap();
    let second = d.upload(HostData::F32(twos), &a).unwrap();
    let read = d.download(&a);
    // Queued, not done: the caller's thread is free to compute meanwhile.
    let queued = t0.elapsed();
    assert!(!second.is_done() && !read.is_done());
    d.wait(&read);
    // The download saw the second upload, so both ran before it, in order.
    assert!(first.is_done() && second.is_done());
    assert!(read.take().unwrap().iter().all(|&x| x == 2.0));
    let c = d.counters();
    let total = t0.elapsed();
    assert!(queued < total / 3, "queueing took {queued:?} of {total:?}");
    assert!(total >= Duration::from_millis(125), "three 42 ms copies");
    assert!(c.link_busy_s >= 0.125);
    assert!(c.copy_wait_s > 0.0 && c.copy_wait_s <= total.as_secs_f64());
    d.free(a);
}

#[test]
fn resident_bytes_are_counted_by_kind() {
    let d = dev(1 << 20, 1e12);
    let p = d.alloc("p", DeviceKind::Params, 10).unwrap();
    let g = d.alloc("g", DeviceKind::Grads, 20).unwrap();
    let a = d.reserve("x", DeviceKind::Activations, 100).unwrap();
    let c = d.counters();
    assert_eq!(c.resident(DeviceKind::Params), 40);
    assert_eq!(c.resident(DeviceKind::Grads), 80);
    assert_eq!(c.resident(DeviceKind::Activations), 100);
    assert_eq!(c.resident_bytes, 220);
    d.free(g);
    let c = d.counters();
    assert_eq!((c.resident_grads_bytes, c.peak_grads_bytes), (0, 80));
    d.free(p);
    d.free(a);
    assert_eq!(d.counters().resident_bytes, 0);
}

#[test]
fn the_cpu_backend_has_no_device_and_the_sim_backend_opens_one_per_call() {
    use crate::model::backend::{Backend, Cpu, SimBackend};
    assert!(Cpu.open_device().is_none());
    let spec = SimSpec {
        capacity_bytes: 100,
        link_bytes_per_s: 1e9,
    };
    let b = SimBackend::new(Arc::new(Cpu), spec);
    let (d1, d2) = (b.open_device().unwrap(), b.open_device().unwrap());
    let x = d1.alloc("x", DeviceKind::Params, 25).unwrap();
    // Each rank's device has its own budget.
    assert_eq!(d2.counters().resident_bytes, 0);
    d1.free(x);
}

#[test]
fn freed_memory_is_reused_zeroed_and_the_spare_pool_stays_within_the_capacity() {
    let d = dev(64, 1e12);
    let a = d.alloc("a", DeviceKind::Grads, 8).unwrap();
    d.with_view_mut(&a, &mut |v| v.fill(7.0));
    let first = a.mem.as_ref().unwrap().lock().unwrap().as_ptr();
    d.free(a);
    // The next buffer of that size is the same memory, zeroed as a fresh one is.
    let b = d.alloc("b", DeviceKind::Params, 8).unwrap();
    assert_eq!(b.mem.as_ref().unwrap().lock().unwrap().as_ptr(), first);
    d.with_view(&b, &mut |v| assert!(v.iter().all(|x| x.to_bits() == 0)));
    d.free(b);
    // Spare memory of other sizes is kept only up to the capacity, oldest first out.
    for elems in [4, 6, 10] {
        let c = d.alloc("c", DeviceKind::Grads, elems).unwrap();
        d.free(c);
    }
    let spare: Vec<usize> = d.arena.lock().unwrap().spare.iter().map(Vec::len).collect();
    assert_eq!(spare, vec![6, 10], "8 and 4 went first");
    assert_eq!(d.counters().resident_bytes, 0);
}
