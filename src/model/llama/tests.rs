use super::super::rng::test_util::bits;
use super::super::sample::forward_logits;
use super::super::sample::test_util::{
    assert_deterministic, assert_learns_pi_digits, batch_of, check_model_gradients, fingerprint,
    perturbed, step,
};
use super::super::workspace::poison_pool;
use super::*;
use std::sync::Arc;

/// Grouped-query (4 query heads over 2 key/value heads), a head width that is not
/// `d_model / heads`, untied.
fn tiny() -> LlamaConfig {
    LlamaConfig {
        vocab: 13,
        max_positions: 8,
        d_model: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        ffn: 12,
        layers: 2,
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        qkv_bias: false,
        tie_embeddings: false,
    }
}

fn llama(cfg: LlamaConfig) -> Llama {
    Llama::new(cfg).expect("valid config")
}

#[test]
fn names_and_shapes_follow_transformers() {
    let m = llama(LlamaConfig {
        qkv_bias: true,
        ..tiny()
    });
    let units = m.units();
    let names: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.embed_tokens",
            "model.layers.0",
            "model.layers.1",
            "head"
        ]
    );
    let params: Vec<(String, Vec<usize>)> = units[2]
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    let s = |n: &str, sh: &[usize]| (format!("model.layers.1.{n}"), sh.to_vec());
    assert_eq!(
        params,
        [
            s("self_attn.q_proj.weight", &[16, 8]),
            s("self_attn.q_proj.bias", &[16]),
            s("self_attn.k_proj.weight", &[8, 8]),
            s("self_attn.k_proj.bias", &[8]),
            s("self_attn.v_proj.weight", &[8, 8]),
            s("self_attn.v_proj.bias", &[8]),
            s("self_attn.o_proj.weight", &[8, 16]),
            s("mlp.gate_proj.weight", &[12, 8]),
            s("mlp.up_proj.weight", &[12, 8]),
            s("mlp.down_proj.weight", &[8, 12]),
            s("input_layernorm.weight", &[8]),
            s("post_attention_layernorm.weight", &[8]),
        ]
    );
    let head: Vec<&str> = units[3].params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(head, ["model.norm.weight", "lm_head.weight"]);
    let tied = llama(LlamaConfig {
        tie_embeddings: true,
        ..tiny()
    });
    assert_eq!(tied.units()[3].params.len(), 1);
    assert_eq!(
        tied.ties(),
        vec![Tie {
            owner: 0,
            param: 0,
            user: 3
        }]
    );
}

#[test]
fn new_rejects_bad_configs() {
    let bad = |cfg: LlamaConfig, want: &str| {
        let err = Llama::new(cfg).expect_err(want);
        assert!(err.contains(want), "{err}");
    };
    bad(
        LlamaConfig {
            kv_heads: 3,
            ..tiny()
        },
        "kv_heads (3) must divide heads (4)",
    );
    bad(
        LlamaConfig {
            head_dim: 3,
            ..tiny()
        },
        "must be even",
    );
    bad(LlamaConfig { ffn: 0, ..tiny() }, "ffn is 0");
    bad(
        LlamaConfig {
            rope_theta: 0.5,
            ..tiny()
        },
        "rope_theta",
    );
    bad(
        LlamaConfig {
            norm_eps: 0.0,
            ..tiny()
        },
        "norm_eps",
    );
}

#[test]
fn gradients_match_finite_differences() {
    for (qkv_bias, tie_embeddings) in [(false, false), (true, true)] {
        let m = llama(LlamaConfig {
            qkv_bias,
            tie_embeddings,
            ..tiny()
        });
        let params = perturbed(&m, 3, 0.3);
        check_model_gradients(&m, &params, &batch_of(13, 2, 6, 1), 5e-3, 1e-2);
    }
}

/// With a loss mask the gradient is the one of the kept targets' loss alone (each weighing
/// `micro_batches / step_tokens`): finite differences of that loss agree, and the dropped rows
/// of the logits' gradient are exactly zero.
#[test]
fn masked_gradients_are_the_kept_targets_gradients() {
    let m = llama(tiny());
    let params = perturbed(&m, 5, 0.3);
    let mut mb = batch_of(13, 2, 6, 3);
    // Row 0 keeps its last 2 targets (a completion after a prompt), row 1 its last 4.
    let keep: Vec<bool> = (0..12)
        .map(|i| i % 6 >= if i < 6 { 4 } else { 2 })
        .collect();
    mb.loss_mask = Some(crate::model::LossMask {
        keep: keep.clone(),
        step_tokens: 9,
        micro_batches: 2,
    });
    check_model_gradients(&m, &params, &mb, 5e-3, 1e-2);
    let logits = forward_logits(&m, &params, &mb);
    let (_, g) = m.loss(logits, &mb);
    for (row, kept) in g.chunks_exact(13).zip(&keep) {
        assert_eq!(row.iter().any(|&x| x != 0.0), *kept);
    }
}

/// Multi-head attention is grouped-query attention with one query head per key/value head.
#[test]
fn full_heads_gradients_match_finite_differences() {
    let m = llama(LlamaConfig {
        kv_heads: 4,
        head_dim: 2,
        ..tiny()
    });
    let params = perturbed(&m, 4, 0.3);
    check_model_gradients(&m, &params, &batch_of(13, 2, 5, 2), 5e-3, 1e-2);
}

/// Repeating a key/value head over its group is the same as storing the repeated weights in
/// a model with as many key/value heads as query heads: same logits, and the grouped model's
/// k/v gradients are the sums of the full model's over each group.
#[test]
fn grouped_query_attention_is_repeated_key_value_heads() {
    let grouped = llama(tiny());
    let full = llama(LlamaConfig {
        kv_heads: 4,
        ..tiny()
    });
    let pg = perturbed(&grouped, 5, 0.3);
    let (d, hd) = (8, 4);
    // k_proj/v_proj rows: kv head j's rows repeated for query heads 2j, 2j+1.
    let repeat = |w: &[f32]| -> Vec<f32> {
        (0..4)
            .flat_map(|h| w[(h / 2) * hd * d..(h / 2 + 1) * hd * d].to_vec())
            .collect()
    };
    let mut pf: Vec<Vec<f32>> = pg.clone();
    for layer in 1..=2 {
        let [qw, _, kw, _, vw, _, rest @ ..] = split_params(&pg[layer], grouped.cfg.layer_lens());
        let rest: Vec<f32> = rest.concat();
        pf[layer] = [qw.to_vec(), repeat(kw), repeat(vw), rest].concat();
    }
    let mb = batch_of(13, 2, 6, 7);
    let (a, b) = (step(&grouped, &pg, &mb), step(&full, &pf, &mb));
    let close = |x: &[f32], y: &[f32], what: &str| {
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                "{what}[{i}]: {p} vs {q}"
            );
        }
    };
    close(&a.logits, &b.logits, "logits");
    for layer in 1..=2 {
        let [_, _, gk, _, gv, ..] = split_params(&a.grads[layer], grouped.cfg.layer_lens());
        let [_, _, fk, _, fv, ..] = split_params(&b.grads[layer], full.cfg.layer_lens());
        for (g, f) in [(gk, fk), (gv, fv)] {
            let summed: Vec<f32> = (0..2)
                .flat_map(|j| {
                    let part = |h: usize| &f[h * hd * d..(h + 1) * hd * d];
                    part(2 * j)
                        .iter()
                        .zip(part(2 * j + 1))
                        .map(|(x, y)| x + y)
                        .collect::<Vec<_>>()
                })
                .collect();
            close(g, &summed, "k/v gradient");
        }
    }
}

#[test]
fn kept_activations_give_the_recomputed_bits() {
    let m = llama(LlamaConfig {
        qkv_bias: true,
        ..tiny()
    });
    let params = perturbed(&m, 3, 0.3);
    let mb = batch_of(13, 2, 6, 1);
    let s = step(&m, &params, &mb);
    for (u, p) in params.iter().enumerate().take(m.units().len() - 1) {
        let x = &s.inputs[u];
        let (out, kept) = m.forward_keep(u, p, x, &mb);
        assert_eq!(bits(&out), bits(&m.forward(u, p, x, &mb)), "unit {u}");
        assert_eq!(kept.is_some(), u >= 1, "unit {u}");
        let mut g = vec![0.0; p.len()];
        let dx = m.backward_kept(u, p, x, kept, &s.input_grads[u + 1], &mb, &mut g);
        assert_eq!(bits(&dx), bits(&s.input_grads[u]), "unit {u}");
        assert_eq!(bits(&g), bits(&s.grads[u]), "unit {u}");
    }
}

#[test]
fn deterministic_and_scratch_is_never_read_stale() {
    let cfg = LlamaConfig {
        vocab: 64,
        max_positions: 40,
        d_model: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 96,
        layers: 2,
        ..tiny()
    };
    let m = llama(cfg);
    let params = perturbed(&m, 5, 0.05);
    let mb = batch_of(64, 2, 40, 4);
    let first = fingerprint(&m, &params, &mb);
    for poison in [f32::NAN, -1e30] {
        poison_pool(poison);
        assert!(fingerprint(&m, &params, &mb) == first, "poison {poison}");
    }
    assert_deterministic(Arc::new(m), params, mb);
}

#[test]
#[should_panic(expected = "exceeds the model's max_positions")]
fn forward_rejects_sequences_beyond_max_positions() {
    let m = llama(tiny());
    m.forward(0, &m.init_unit(0, 0), &[], &batch_of(13, 1, 9, 0));
}

#[test]
fn loss_falls_on_a_repeating_pattern() {
    let cfg = LlamaConfig {
        vocab: 10,
        max_positions: 16,
        d_model: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 64,
        layers: 2,
        ..tiny()
    };
    let m = llama(cfg);
    assert_learns_pi_digits(&m);
}

/// The KV-cache decoder (rotating each new row at its position, attending over `kv_heads`
/// cached heads) gives the full forward's logits at every position.
#[test]
fn the_kv_cache_decoder_matches_the_full_forward() {
    for tie_embeddings in [false, true] {
        let m = llama(LlamaConfig {
            tie_embeddings,
            qkv_bias: true,
            ..tiny()
        });
        let params = perturbed(&m, 5, 0.5);
        let mb = batch_of(13, 1, 8, 3);
        let full = forward_logits(&m, &params, &mb);
        let mut dec = m.decoder(&params).expect("the Llama decodes");
        for (i, &t) in mb.inputs.iter().enumerate() {
            let row = dec.push(t);
            for (a, b) in row.iter().zip(&full[i * 13..(i + 1) * 13]) {
                assert!((a - b).abs() < 1e-5, "position {i}: {a} vs {b}");
            }
        }
        assert_eq!(dec.len(), dec.capacity());
    }
}

/// RoPE's table is transformers' (`inv_freq = 1/θ^(2i/d)`, angle = pos · inv_freq), and the
/// inverse rotation undoes the forward one.
#[test]
fn rope_rotates_pairs_half_a_head_apart() {
    let t = RopeTable::new(10_000.0, 4, 3);
    let x0 = vec![1.0f32, 2.0, 3.0, 4.0];
    let mut x = [x0.clone(), x0.clone(), x0.clone()].concat();
    super::super::ops::rope_rotate(&mut x, 4, 3, 0, &t, false);
    assert_eq!(&x[..4], &x0[..], "position 0 is not rotated");
    let (c, s) = ((2.0f64).cos() as f32, (2.0f64).sin() as f32);
    // Position 2, pair 0 (elements 0 and 2) turns by 2 rad; pair 1 by 2/100.
    assert!((x[8] - (1.0 * c - 3.0 * s)).abs() < 1e-6);
    assert!((x[10] - (3.0 * c + 1.0 * s)).abs() < 1e-6);
    super::super::ops::rope_rotate(&mut x, 4, 3, 0, &t, true);
    for (a, b) in x.iter().zip(x0.iter().cycle()) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}
