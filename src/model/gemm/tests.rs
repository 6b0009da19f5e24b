//! Every path against the contract (one FMA chain per element along k), bit for bit.

use super::*;

/// Deterministic values with varied exponents and signs, so reordered sums would show.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let m = (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
            m * [1.0, 1e-3, 37.0, 0.25][(s & 3) as usize]
        })
        .collect()
}

/// The three stored forms, plus column windows of wider row-major buffers at an offset, as
/// attention's head views.
#[derive(Clone, Copy, Debug)]
enum View {
    Stored(Form),
    Window,
}

/// A product under test: an f32 path against the FMA chain, or a bf16 path against the
/// `vdpbf16ps` chain.
#[derive(Clone, Copy, Debug)]
enum Product {
    F32(GemmPath),
    Bf16(Bf16Path),
}

impl Product {
    #[allow(clippy::too_many_arguments)]
    fn run(
        self,
        a: &[f32],
        la: Layout,
        b: &[f32],
        lb: Layout,
        c: &mut [f32],
        lc: Layout,
        acc: bool,
    ) {
        match self {
            Product::F32(p) => gemm_with(p, a, la, b, lb, c, lc, acc),
            Product::Bf16(p) => gemm_bf16_with(p, a, la, b, lb, c, lc, acc),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reference(
        self,
        a: &[f32],
        la: Layout,
        b: &[f32],
        lb: Layout,
        c: &mut [f32],
        lc: Layout,
        acc: bool,
    ) {
        match self {
            Product::F32(_) => reference(a, la, b, lb, c, lc, acc),
            Product::Bf16(_) => bf16::reference_bf16(a, la, b, lb, c, lc, acc),
        }
    }

    /// Every product this CPU can run.
    fn available() -> Vec<Product> {
        let f32s = GemmPath::available().into_iter().map(Product::F32);
        f32s.chain(Bf16Path::available().into_iter().map(Product::Bf16))
            .collect()
    }
}

/// Runs `path` and its reference on the same inputs and compares the bits.
fn check(path: Product, m: usize, k: usize, n: usize, form: View, acc: bool) {
    let (la, lb, a_len, b_len) = match form {
        View::Stored(f) => f.layouts(m, k, n),
        View::Window => (
            Layout::strided(3, m, k, k + 5),
            Layout::strided(7, k, n, 2 * n + 1),
            3 + m * (k + 5),
            7 + k * (2 * n + 1),
        ),
    };
    let lc = match form {
        View::Window => Layout::strided(2, m, n, n + 3),
        _ => Layout::row_major(m, n),
    };
    let c_len = lc.offset + m * lc.row_stride;
    let a = values(a_len, 1 + m as u32);
    let b = values(b_len, 2 + n as u32);
    // Poison when not accumulating: the product must not read C then.
    let c0 = if acc {
        values(c_len, 3)
    } else {
        vec![f32::NAN; c_len]
    };
    let mut want = c0.clone();
    path.reference(&a, la, &b, lb, &mut want, lc, acc);
    let mut got = c0.clone();
    path.run(&a, la, &b, lb, &mut got, lc, acc);
    for i in 0..m {
        for j in 0..n {
            let s = lc.index(i, j);
            assert_eq!(
                got[s].to_bits(),
                want[s].to_bits(),
                "{path:?} {form:?} m={m} k={k} n={n} acc={acc}: C[{i},{j}] = {} want {}",
                got[s],
                want[s]
            );
        }
    }
    // Slots outside the view are untouched.
    for (s, (&g, &w)) in got.iter().zip(&c0).enumerate() {
        let inside = (0..m).any(|i| {
            s >= lc.index(i, 0) && s < lc.index(i, n) && (s - lc.index(i, 0)) % lc.col_stride == 0
        });
        if !inside {
            assert_eq!(g.to_bits(), w.to_bits(), "{path:?} wrote outside C at {s}");
        }
    }
}

#[test]
fn every_path_matches_its_chain_bit_for_bit() {
    let shapes = [
        (1, 1, 1),
        (1, 7, 1),
        (5, 3, 17),
        (8, 32, 32),
        (6, 16, 16),
        (13, 40, 47),
        (33, 257, 65), // k crosses a KC block (f32)
        (130, 64, 33), // m crosses an MC block of every path
        (9, 1025, 40), // k crosses a bf16 block, odd
    ];
    for path in Product::available() {
        for &(m, k, n) in &shapes {
            for form in [
                View::Stored(Form::Nn),
                View::Stored(Form::Nt),
                View::Stored(Form::Tn),
                View::Window,
            ] {
                for acc in [false, true] {
                    check(path, m, k, n, form, acc);
                }
            }
        }
    }
}

#[test]
fn wide_products_cross_every_block_boundary() {
    // n crosses NC (1024 columns on AVX-512, 512 on AVX2), k crosses KC twice.
    for path in Product::available() {
        check(path, 9, 600, 1030, View::Stored(Form::Nt), true);
    }
}

#[test]
fn empty_depth_zeroes_or_keeps_c() {
    for path in Product::available() {
        let (la, lb, lc) = (
            Layout::row_major(2, 0),
            Layout::row_major(0, 3),
            Layout::row_major(2, 3),
        );
        let mut c = vec![5.0; 6];
        path.run(&[], la, &[], lb, &mut c, lc, true);
        assert_eq!(c, vec![5.0; 6]);
        path.run(&[], la, &[], lb, &mut c, lc, false);
        assert_eq!(c, vec![0.0; 6]);
    }
}

#[test]
fn paths_parse_and_refuse_what_the_cpu_lacks() {
    assert_eq!(GemmPath::parse("portable"), Ok(GemmPath::Portable));
    assert_eq!(GemmPath::parse("auto"), Ok(GemmPath::best()));
    let err = GemmPath::parse("avx1024").unwrap_err();
    assert!(
        err.contains("EZERO_GEMM") && err.contains("avx512, avx2, portable"),
        "{err}"
    );
    for p in GemmPath::ALL {
        assert_eq!(GemmPath::parse(p.name()).is_ok(), p.supported());
    }
}

#[test]
#[should_panic(expected = "gemm operand out of bounds")]
fn out_of_bounds_views_are_refused() {
    let la = Layout::row_major(2, 2);
    let mut c = vec![0.0; 4];
    gemm_with(
        GemmPath::best(),
        &[0.0; 3],
        la,
        &[0.0; 4],
        la,
        &mut c,
        la,
        false,
    );
}

#[test]
fn bf16_rounds_to_nearest_even_and_flushes_denormals() {
    let cases: [(f32, u16); 8] = [
        (1.0, 0x3f80),
        (f32::from_bits(0x3f80_8000), 0x3f80), // a tie rounds to the even 0x3f80
        (f32::from_bits(0x3f81_8000), 0x3f82), // a tie rounds to the even 0x3f82
        (f32::from_bits(0x3f80_8001), 0x3f81), // above the tie rounds up
        (-2.5, 0xc020),
        (f32::INFINITY, 0x7f80),
        (1e-39, 0x0000),  // a denormal is a zero to `vdpbf16ps`
        (-1e-40, 0x8000), // with its sign
    ];
    for (x, want) in cases {
        assert_eq!(to_bf16(x), want, "{x:e}");
    }
    assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    assert_eq!(
        round_bf16(f32::MAX),
        f32::INFINITY,
        "rounds past the largest bf16"
    );
}

#[test]
fn bf16_paths_flush_denormal_sums_like_the_instruction() {
    // Products near f32's smallest normal: the chain's denormal steps flush to zero, and a
    // denormal C counts as zero; every path agrees with the written-out chain.
    let (m, k, n) = (8, 6, 32);
    let (la, lb, lc) = (
        Layout::row_major(m, k),
        Layout::row_major(k, n),
        Layout::row_major(m, n),
    );
    let a: Vec<f32> = values(m * k, 5).iter().map(|v| v * 3e-19).collect();
    let b: Vec<f32> = values(k * n, 6).iter().map(|v| v * 2e-19).collect();
    let c0: Vec<f32> = values(m * n, 7).iter().map(|v| v * 1e-37).collect();
    assert!(c0.iter().any(|v| v.is_subnormal()));
    let mut want = c0.clone();
    bf16::reference_bf16(&a, la, &b, lb, &mut want, lc, true);
    assert!(want.iter().all(|v| !v.is_subnormal()));
    for path in Bf16Path::available() {
        let mut got = c0.clone();
        gemm_bf16_with(path, &a, la, &b, lb, &mut got, lc, true);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{path:?}");
    }
}

#[test]
fn bf16_products_are_close_to_f32_ones() {
    // The rounding of the operands costs about 2^-8 relative per product; the sum stays
    // within a few times that of the f32 product.
    let (m, k, n) = (16, 256, 48);
    let (la, lb, _, _) = Form::Nt.layouts(m, k, n);
    let lc = Layout::row_major(m, n);
    let a = values(m * k, 8);
    let b = values(k * n, 9);
    let (mut exact, mut half) = (vec![0.0; m * n], vec![0.0; m * n]);
    reference(&a, la, &b, lb, &mut exact, lc, false);
    gemm_bf16(&a, la, &b, lb, &mut half, lc, false);
    let scale: f32 = (0..m * n)
        .map(|s| {
            let (i, j) = (s / n, s % n);
            (0..k)
                .map(|p| (a[la.index(i, p)] * b[lb.index(p, j)]).abs())
                .sum::<f32>()
        })
        .fold(0.0, f32::max);
    for (x, y) in exact.iter().zip(&half) {
        assert!((x - y).abs() <= scale * 2.0f32.powi(-7), "{x} vs {y}");
    }
    assert_ne!(exact, half, "the operands were rounded");
}

#[test]
fn bf16_vector_packing_rounds_as_the_scalar_one() {
    if !Bf16Path::Avx512Bf16.supported() {
        return;
    }
    // The conversion instruction against `to_bf16` on the patterns where rounding is subtle:
    // denormals (the largest would round up to a normal were it not a zero), ties, NaNs
    // (signalling, with payloads), the largest finite value (rounds to infinity).
    let special: [u32; 12] = [
        0x007f_ffff,
        0x807f_ffff,
        0x0000_0001,
        0x3f80_8000,
        0x3f81_8000,
        0xbf80_8001,
        0x7fc0_1234,
        0x7f80_0001,
        0xff80_0000,
        0x7f7f_ffff,
        0x0080_0000,
        0x0000_0000,
    ];
    let (rows, k) = (40, 70);
    let mixed = values(rows * k, 11);
    let src: Vec<f32> = (0..rows * k)
        .map(|i| {
            if i % 3 == 0 {
                f32::from_bits(special[(i / 3) % special.len()])
            } else {
                mixed[i]
            }
        })
        .collect();
    let kcp = k.div_ceil(2);
    for (view, pw) in [
        (Layout::row_major(rows, k), 8),              // k contiguous
        (Layout::row_major(rows, k), 32),             // k contiguous, B's panel width
        (Layout::row_major(k, rows).transposed(), 8), // width contiguous
        (Layout::row_major(k, rows).transposed(), 32),
    ] {
        let len = rows.div_ceil(pw) * pw * kcp;
        let (mut fast, mut slow) = (vec![7u32; len], vec![9u32; len]);
        bf16::pack(&src, view, 0, rows, 0, k, pw, &mut fast, true);
        bf16::pack_scalar(&src, view, 0, rows, 0, k, pw, &mut slow);
        assert_eq!(fast, slow, "{view:?} panel width {pw}");
    }
}

#[test]
fn products_split_over_threads_keep_every_bit() {
    // Row blocks of C on 2 and 3 threads, row-major and windowed C, with and without
    // accumulating: the same bits as one thread, and nothing written outside C.
    for &(m, k, n) in &[(67, 256, 515), (200, 300, 160)] {
        for threads in [2, 3] {
            for acc in [false, true] {
                for form in [Form::Nn, Form::Nt, Form::Tn] {
                    let (la, lb, a_len, b_len) = form.layouts(m, k, n);
                    let lc = Layout::strided(5, m, n, n + 2);
                    let c_len = 5 + m * (n + 2) + 7;
                    let a = values(a_len, 11);
                    let b = values(b_len, 12);
                    let c0 = values(c_len, 13);
                    let path = GemmPath::best();
                    let mut want = c0.clone();
                    gemm_with(path, &a, la, &b, lb, &mut want, lc, acc);
                    let mut got = c0.clone();
                    gemm_split(threads, path, &a, la, &b, lb, &mut got, lc, acc);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{form:?} {m}x{k}x{n} threads {threads} acc {acc}"
                    );
                }
            }
        }
    }
}
