use super::super::rng::test_util::{bits, check_grad, dot, randn};
use super::*;
use crate::model::attention::{attention_backward, attention_forward, AttnShape};
use crate::model::backend::Cpu;
use crate::model::layers::{LayerNorm, Linear};

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                .sum::<f64>() as f32;
        }
    }
    c
}

fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|i| a[(i % rows) * cols + i / rows])
        .collect()
}

fn assert_close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "[{i}] {x} vs {y}");
    }
}

#[test]
fn matmul_variants_match_naive() {
    for &(m, k, n) in &[(3, 5, 7), (17, 33, 9), (1, 1, 1), (4, 0, 3), (64, 40, 70)] {
        let a = randn(m * k, 1, 1.0);
        let b = randn(k * n, 2, 1.0);
        let want = naive_matmul(&a, &b, m, k, n);
        let mut c = vec![f32::NAN; m * n];
        matmul(&a, &b, &mut c, m, k, n, false);
        assert_close(&c, &want, 1e-5);
        let mut c = vec![f32::NAN; m * n];
        matmul_nt(&a, &transpose(&b, k, n), &mut c, m, k, n, false);
        assert_close(&c, &want, 1e-5);
        let mut c = vec![1.0; m * n];
        matmul_tn(&transpose(&a, m, k), &b, &mut c, m, k, n, true);
        let plus_one: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        assert_close(&c, &plus_one, 1e-5);
    }
}

#[test]
fn linear_gradients() {
    let (rows, d_in, d_out) = (5, 4, 3);
    let x = randn(rows * d_in, 1, 1.0);
    let w = randn(d_out * d_in, 2, 0.5);
    let b = randn(d_out, 3, 0.5);
    let r = randn(rows * d_out, 4, 1.0);
    let obj = |x: &[f32], w: &[f32], b: &[f32]| {
        let lin = Linear::new(&Cpu, w, Some(b), d_in, d_out);
        dot(&lin.forward(x), &r)
    };
    let lin = Linear::new(&Cpu, &w, Some(&b), d_in, d_out);
    let (mut gw, mut gb) = (vec![0.0; w.len()], vec![0.0; b.len()]);
    let gx = lin.backward(&x, &r, &mut gw, Some(&mut gb));
    check_grad("linear x", &x, &gx, 1e-2, 1e-3, &|v| obj(v, &w, &b));
    check_grad("linear w", &w, &gw, 1e-2, 1e-3, &|v| obj(&x, v, &b));
    check_grad("linear b", &b, &gb, 1e-2, 1e-3, &|v| obj(&x, &w, v));
    // No-bias form and accumulation into existing gradients.
    let nb = Linear::new(&Cpu, &w, None, d_in, d_out);
    let mut gw2 = gw.clone();
    nb.backward(&x, &r, &mut gw2, None);
    let doubled: Vec<f32> = gw.iter().map(|g| 2.0 * g).collect();
    assert_close(&gw2, &doubled, 1e-6);
    assert_close(
        &nb.forward(&x),
        &naive_matmul(&x, &transpose(&w, d_out, d_in), rows, d_in, d_out),
        1e-6,
    );
}

#[test]
fn layernorm_forward_normalises_and_gradients() {
    let (rows, d) = (4, 6);
    let mut x = randn(rows * d, 5, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        *v = *v * (1 + i / d) as f32 + (i / d) as f32; // rows with different mean and scale
    }
    let (ones, zeros) = (vec![1.0; d], vec![0.0; d]);
    let y = LayerNorm::new(&Cpu, &ones, &zeros).forward(&x);
    for row in y.chunks(d) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / d as f32;
        assert!(
            mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-4,
            "mean {mean} var {var}"
        );
    }
    let w: Vec<f32> = randn(d, 6, 0.3).iter().map(|v| 1.0 + v).collect();
    let b = randn(d, 7, 0.3);
    let r = randn(rows * d, 8, 1.0);
    let obj = |x: &[f32], w: &[f32], b: &[f32]| dot(&LayerNorm::new(&Cpu, w, b).forward(x), &r);
    let (mut gw, mut gb) = (vec![0.0; d], vec![0.0; d]);
    let gx = LayerNorm::new(&Cpu, &w, &b).backward(&x, &r, &mut gw, &mut gb);
    check_grad("layernorm x", &x, &gx, 1e-2, 2e-3, &|v| obj(v, &w, &b));
    check_grad("layernorm w", &w, &gw, 1e-2, 1e-3, &|v| obj(&x, v, &b));
    check_grad("layernorm b", &b, &gb, 1e-2, 1e-3, &|v| obj(&x, &w, v));
}

#[test]
fn exp_matches_std() {
    let mut worst = 0.0f64;
    for i in -70_800..70_900 {
        let x = i as f64 / 100.0 + 0.003;
        worst = worst.max((exp(x) / x.exp() - 1.0).abs());
    }
    assert!(worst < 1e-11, "worst relative error {worst:e}");
    assert_eq!(
        (exp(0.0), exp(-709.0), exp(f64::NEG_INFINITY)),
        (1.0, 0.0, 0.0)
    );
    assert_eq!(exp(f64::INFINITY), exp(709.0));
    assert!(exp(f64::NAN).is_nan());
}

#[test]
fn gelu_values_and_gradient() {
    // x/2 · (1 + erf(x/√2)) from CPython.
    let xs = [-6.0, -3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0];
    let want = [
        -5.919525870226207e-09,
        -0.004049694094890287,
        -0.15865525393145707,
        -0.0460172162722971,
        0.0,
        0.053982783727702904,
        0.8413447460685429,
        2.99595030590511,
    ];
    for ((&x, &y), &w) in xs.iter().zip(&gelu_forward(&xs)).zip(&want) {
        let ok = (y as f64 - w).abs() <= 2e-7 * f64::abs(w);
        assert!(ok, "gelu({x}) = {y}, want {w}");
    }
    let x: Vec<f32> = randn(40, 9, 2.0);
    let r = randn(40, 10, 1.0);
    let gx = gelu_backward(&x, &r);
    check_grad("gelu", &x, &gx, 1e-3, 1e-3, &|v| dot(&gelu_forward(v), &r));
    let (y, _) = gelu_with_derivative(&x);
    assert_eq!(bits(&y), bits(&gelu_forward(&x)));
}

/// Straightforward per-element causal attention, for checking the strided-gemm version.
fn naive_attention(qkv: &[f32], s: AttnShape) -> Vec<f32> {
    let (t, d, hd) = (s.seq, s.d_model, s.d_model / s.heads);
    let at = |b: usize, i: usize, part: usize, h: usize, c: usize| {
        qkv[(b * t + i) * 3 * d + part * d + h * hd + c] as f64
    };
    let mut y = vec![0.0; s.batch * t * d];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|c| at(b, i, 0, h, c) * at(b, j, 1, h, c))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                for c in 0..hd {
                    let acc: f64 = (0..=i)
                        .map(|j| (sc[j] - m).exp() / z * at(b, j, 2, h, c))
                        .sum();
                    y[(b * t + i) * d + h * hd + c] = acc as f32;
                }
            }
        }
    }
    y
}

#[test]
fn attention_matches_naive_and_is_causal() {
    let s = AttnShape::new(2, 5, 6, 3);
    let qkv = randn(2 * 5 * 18, 11, 1.0);
    let y = attention_forward(&qkv, s);
    assert_close(&y, &naive_attention(&qkv, s), 1e-5);
    // Perturbing the last position of batch row 0 leaves every earlier output unchanged.
    let mut q2 = qkv.clone();
    for v in &mut q2[4 * 18..5 * 18] {
        *v += 1.0;
    }
    let y2 = attention_forward(&q2, s);
    assert_eq!(y[..4 * 6], y2[..4 * 6]);
    assert_eq!(y[5 * 6..], y2[5 * 6..]);
    assert_ne!(y[4 * 6..5 * 6], y2[4 * 6..5 * 6]);
}

#[test]
fn attention_matches_naive_across_causal_blocks() {
    // 70 positions: three query blocks, the last one partial.
    let s = AttnShape::new(2, 70, 4, 2);
    let qkv = randn(2 * 70 * 12, 17, 1.0);
    assert_close(&attention_forward(&qkv, s), &naive_attention(&qkv, s), 1e-5);
}

#[test]
fn attention_gradient_across_causal_blocks() {
    let s = AttnShape::new(1, 70, 4, 2);
    let qkv = randn(70 * 12, 18, 1.0);
    let r = randn(70 * 4, 19, 1.0);
    let g = attention_backward(&qkv, &r, s);
    check_grad("attention qkv, 70 positions", &qkv, &g, 1e-2, 2e-3, &|v| {
        dot(&attention_forward(v, s), &r)
    });
}

#[test]
fn attention_gradient() {
    let s = AttnShape::new(2, 4, 6, 2);
    let qkv = randn(2 * 4 * 18, 12, 1.0);
    let r = randn(2 * 4 * 6, 13, 1.0);
    let g = attention_backward(&qkv, &r, s);
    check_grad("attention qkv", &qkv, &g, 1e-2, 2e-3, &|v| {
        dot(&attention_forward(v, s), &r)
    });
}

#[test]
fn embedding_gradient_accumulates_repeats() {
    let (rows, d) = (5, 3);
    let table = randn(rows * d, 14, 1.0);
    let ids = [1u32, 4, 1, 0, 1];
    let y = embedding_forward(&table, &ids, d);
    assert_eq!(y[..3], table[3..6]);
    let r = randn(ids.len() * d, 15, 1.0);
    let mut g = vec![0.0; table.len()];
    embedding_backward(&ids, &r, d, &mut g);
    check_grad("embedding", &table, &g, 1e-2, 1e-3, &|v| {
        dot(&embedding_forward(v, &ids, d), &r)
    });
    assert!(g[2 * d..3 * d].iter().all(|&v| v == 0.0));
}

#[test]
#[should_panic(expected = "out of range")]
fn embedding_rejects_out_of_range_ids() {
    embedding_forward(&[0.0; 6], &[3], 2);
}

#[test]
fn cross_entropy_value_and_gradient() {
    let (n, vocab) = (4, 7);
    let (loss, _) = cross_entropy(&vec![0.5; n * vocab], &[0, 1, 2, 6], vocab);
    assert!((loss as f64 - (vocab as f64).ln()).abs() < 1e-6);
    let logits = randn(n * vocab, 16, 2.0);
    let targets = [3u32, 0, 6, 3];
    let (_, g) = cross_entropy(&logits, &targets, vocab);
    for row in g.chunks(vocab) {
        assert!(row.iter().map(|&v| v as f64).sum::<f64>().abs() < 1e-7); // softmax - onehot
    }
    check_grad("cross_entropy", &logits, &g, 1e-2, 1e-2, &|v| {
        cross_entropy(v, &targets, vocab).0 as f64
    });
    assert_eq!(cross_entropy(&[], &[], vocab), (0.0, vec![]));
}

/// Every row kept at weight `1 / n` is the unmasked loss bit for bit; a dropped row's gradient
/// is zero and the kept rows' equal the cross-entropy of those rows alone (weight `1 / kept`).
#[test]
fn masked_cross_entropy_keeps_the_unmasked_bits() {
    let (n, vocab) = (5, 9);
    let logits = randn(n * vocab, 17, 2.0);
    let targets = [3u32, 0, 8, 3, 1];
    let (loss, g) = cross_entropy(&logits, &targets, vocab);
    let mut all = logits.clone();
    let total = masked_cross_entropy_in_place(&mut all, &targets, &[true; 5], vocab, 1.0 / 5.0);
    assert_eq!((total as f32).to_bits(), loss.to_bits());
    assert_eq!(bits(&all), bits(&g));
    let keep = [false, true, false, true, true];
    let mut some = logits.clone();
    let total = masked_cross_entropy_in_place(&mut some, &targets, &keep, vocab, 1.0 / 3.0);
    let rows: Vec<usize> = (0..n).filter(|&i| keep[i]).collect();
    let alone_logits: Vec<f32> = rows
        .iter()
        .flat_map(|&i| logits[i * vocab..(i + 1) * vocab].to_vec())
        .collect();
    let alone_targets: Vec<u32> = rows.iter().map(|&i| targets[i]).collect();
    let (alone_loss, alone) = cross_entropy(&alone_logits, &alone_targets, vocab);
    assert_eq!((total as f32).to_bits(), alone_loss.to_bits());
    for i in 0..n {
        let row = &some[i * vocab..(i + 1) * vocab];
        match rows.iter().position(|&r| r == i) {
            Some(k) => assert_eq!(bits(row), bits(&alone[k * vocab..(k + 1) * vocab])),
            None => assert!(row.iter().all(|&v| v == 0.0)),
        }
    }
}

#[test]
fn split_params_cuts_in_order() {
    let buf: Vec<f32> = (0..6).map(|v| v as f32).collect();
    let [a, b, c] = split_params(&buf, [1, 3, 2]);
    assert_eq!(
        (a, b, c),
        (&[0.0][..], &[1.0, 2.0, 3.0][..], &[4.0, 5.0][..])
    );
    let mut buf = buf;
    let [x, y] = split_params_mut(&mut buf, [4, 2]);
    x[0] = 9.0;
    y[1] = 7.0;
    assert_eq!(buf, [9.0, 1.0, 2.0, 3.0, 4.0, 7.0]);
}
