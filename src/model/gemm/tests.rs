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

/// Runs `path` and the reference on the same inputs and compares the bits.
fn check(path: GemmPath, m: usize, k: usize, n: usize, form: View, acc: bool) {
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
    reference(&a, la, &b, lb, &mut want, lc, acc);
    let mut got = c0.clone();
    gemm_with(path, &a, la, &b, lb, &mut got, lc, acc);
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
fn every_path_matches_the_fma_chain_bit_for_bit() {
    let shapes = [
        (1, 1, 1),
        (1, 7, 1),
        (5, 3, 17),
        (8, 32, 32),
        (6, 16, 16),
        (13, 40, 47),
        (33, 257, 65), // k crosses a KC block
        (130, 64, 33), // m crosses an MC block of every path
    ];
    for path in GemmPath::available() {
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
    for path in GemmPath::available() {
        check(path, 9, 600, 1030, View::Stored(Form::Nt), true);
    }
}

#[test]
fn empty_depth_zeroes_or_keeps_c() {
    for path in GemmPath::available() {
        let (la, lb, lc) = (
            Layout::row_major(2, 0),
            Layout::row_major(0, 3),
            Layout::row_major(2, 3),
        );
        let mut c = vec![5.0; 6];
        gemm_with(path, &[], la, &[], lb, &mut c, lc, true);
        assert_eq!(c, vec![5.0; 6]);
        gemm_with(path, &[], la, &[], lb, &mut c, lc, false);
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
