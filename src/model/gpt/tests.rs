use super::super::backend::GeluForm;
use super::super::param_count;
use super::super::rng::test_util::bits;
use super::super::sample::forward_logits;
use super::super::sample::test_util::{
    assert_deterministic, assert_learns_pi_digits, batch_of, check_model_gradients, fingerprint,
    perturbed, step,
};
use super::super::workspace::poison_pool;
use super::super::ParamSpec;
use super::*;
use std::sync::Arc;

fn tiny() -> Gpt {
    let cfg = GptConfig {
        vocab: 11,
        seq_len: 5,
        d_model: 8,
        heads: 2,
        layers: 2,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    Gpt::new(cfg).expect("valid config")
}

#[test]
fn reference_shape_matches_pytorch() {
    let gpt = Gpt::new(GptConfig::reference()).expect("valid config");
    let units = gpt.units();
    assert_eq!(param_count(&units), 3_323_392);
    let names: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(
        names,
        ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    );
    let shapes = |u: usize| -> Vec<(String, Vec<usize>)> {
        units[u]
            .params
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect()
    };
    let s = |n: &str, sh: &[usize]| (n.to_string(), sh.to_vec());
    assert_eq!(
        shapes(0),
        [s("tok.weight", &[256, 256]), s("pos.weight", &[128, 256])]
    );
    assert_eq!(
        shapes(2),
        [
            s("blocks.1.ln1.weight", &[256]),
            s("blocks.1.ln1.bias", &[256]),
            s("blocks.1.qkv.weight", &[768, 256]),
            s("blocks.1.qkv.bias", &[768]),
            s("blocks.1.proj.weight", &[256, 256]),
            s("blocks.1.proj.bias", &[256]),
            s("blocks.1.ln2.weight", &[256]),
            s("blocks.1.ln2.bias", &[256]),
            s("blocks.1.fc1.weight", &[1024, 256]),
            s("blocks.1.fc1.bias", &[1024]),
            s("blocks.1.fc2.weight", &[256, 1024]),
            s("blocks.1.fc2.bias", &[256]),
        ]
    );
    assert_eq!(
        shapes(5),
        [
            s("ln_f.weight", &[256]),
            s("ln_f.bias", &[256]),
            s("head.weight", &[256, 256])
        ]
    );
    let lens: Vec<usize> = units[1].params.iter().map(ParamSpec::numel).collect();
    assert_eq!(lens, block_lens(256));
    assert_eq!((gpt.vocab(), gpt.max_seq()), (256, 128));
}

#[test]
fn new_rejects_bad_configs() {
    let ok = GptConfig {
        vocab: 11,
        seq_len: 5,
        d_model: 8,
        heads: 2,
        layers: 2,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    let err = Gpt::new(GptConfig {
        heads: 3,
        ..ok.clone()
    })
    .expect_err("3 does not divide 8");
    assert!(
        err.contains("heads") && err.contains("[1, 2, 4, 8]"),
        "{err}"
    );
    for field in ["vocab", "seq_len", "d_model", "heads", "layers"] {
        let mut cfg = ok.clone();
        *match field {
            "vocab" => &mut cfg.vocab,
            "seq_len" => &mut cfg.seq_len,
            "d_model" => &mut cfg.d_model,
            "heads" => &mut cfg.heads,
            _ => &mut cfg.layers,
        } = 0;
        let err = Gpt::new(cfg).expect_err("zero size");
        assert!(err.contains(field) && err.contains("at least 1"), "{err}");
    }
}

#[test]
fn init_is_pure_and_gpt2_style() {
    let gpt = Gpt::new(GptConfig::reference()).expect("valid config");
    let embed = gpt.init_unit(0, 7);
    assert_eq!(embed, gpt.init_unit(0, 7));
    assert_ne!(embed, gpt.init_unit(0, 8));
    let n = embed.len() as f64;
    let mean = embed.iter().map(|&v| v as f64).sum::<f64>() / n;
    let std = (embed
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    assert!(
        mean.abs() < 2e-4 && (std - 0.02).abs() < 4e-4,
        "mean {mean} std {std}"
    );
    let block = gpt.init_unit(1, 7);
    let [ln1_w, ln1_b, qkv_w, qkv_b, ..] = split_params(&block, block_lens(256));
    assert!(ln1_w.iter().all(|&v| v == 1.0) && ln1_b.iter().all(|&v| v == 0.0));
    assert!(qkv_b.iter().all(|&v| v == 0.0) && qkv_w.iter().all(|&v| v != 0.0 && v.abs() < 0.2));
    assert_ne!(
        gpt.init_unit(1, 7),
        gpt.init_unit(2, 7),
        "blocks must differ"
    );
}

#[test]
fn gradients_match_finite_differences() {
    let gpt = tiny();
    let params = perturbed(&gpt, 3, 0.3);
    // eps trades the central difference's truncation error against f32 rounding noise: on
    // the first batch eps 1e-2 left truncation error within 3% of the tolerance (a change of
    // GEMM rounding tipped it); on the second, with smaller gradients, eps 5e-3 let rounding
    // noise exceed it.
    check_model_gradients(&gpt, &params, &batch_of(11, 2, 5, 1), 5e-3, 1e-2);
    check_model_gradients(&gpt, &params, &batch_of(11, 3, 3, 2), 1e-2, 1e-2);
}

/// GPT-2's variant: the head borrows the token embedding. It must compute exactly what an
/// untied GPT whose head weight equals the embedding computes, with the embedding's gradient
/// the sum of both uses.
#[test]
fn a_tied_head_is_an_untied_head_holding_the_embedding() {
    for gelu in [GeluForm::Erf, GeluForm::Tanh] {
        let untied = Gpt::new(GptConfig { gelu, ..tiny().cfg }).expect("valid config");
        let tied = Gpt::new(GptConfig {
            gelu,
            tie_embeddings: true,
            ..tiny().cfg
        })
        .expect("valid config");
        assert_eq!(tied.units().last().map(|u| u.params.len()), Some(2));
        let tie = Tie {
            owner: 0,
            param: 0,
            user: 3,
        };
        assert_eq!(tied.ties(), vec![tie]);
        let mut p_untied = perturbed(&untied, 3, 0.3);
        let tok = 11 * 8;
        let head_w = p_untied[3].split_off(16);
        p_untied[0][..tok].copy_from_slice(&head_w);
        let mut p_tied = p_untied.clone();
        p_untied[3].extend_from_slice(&head_w);
        p_tied[3].truncate(16);
        let mb = batch_of(11, 2, 5, 4);
        let (a, b) = (step(&untied, &p_untied, &mb), step(&tied, &p_tied, &mb));
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{gelu:?}");
        assert_eq!(bits(&a.input_grads[1]), bits(&b.input_grads[1]), "{gelu:?}");
        assert_eq!(bits(&a.grads[1]), bits(&b.grads[1]), "{gelu:?}");
        assert_eq!(bits(&a.grads[3][..16]), bits(&b.grads[3]), "{gelu:?}");
        for (i, (&g_tok, &g_head)) in a.grads[0][..tok].iter().zip(&a.grads[3][16..]).enumerate() {
            assert_eq!(
                b.grads[0][i].to_bits(),
                (g_head + g_tok).to_bits(),
                "{gelu:?} tok[{i}]: head then embedding use"
            );
        }
    }
}

/// The tanh GELU and the tied head against finite differences.
#[test]
fn tied_tanh_gradients_match_finite_differences() {
    let cfg = GptConfig {
        gelu: GeluForm::Tanh,
        tie_embeddings: true,
        ..tiny().cfg
    };
    let gpt = Gpt::new(cfg).expect("valid config");
    let params = perturbed(&gpt, 3, 0.3);
    check_model_gradients(&gpt, &params, &batch_of(11, 2, 5, 3), 5e-3, 1e-2);
}

/// Not part of the `Model` contract, but worth knowing (and pinning): every element of a GEMM
/// is one FMA chain along k, so a row's logits are the same bits whichever rows share its
/// micro-batch.
#[test]
fn logits_of_a_row_do_not_depend_on_its_batch_mates() {
    let cfg = GptConfig {
        vocab: 64,
        seq_len: 32,
        d_model: 256,
        heads: 4,
        layers: 1,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    let gpt = Gpt::new(cfg).expect("valid config");
    let params = perturbed(&gpt, 6, 0.05);
    let both = batch_of(64, 3, 32, 8);
    let row = |r: usize| MicroBatch {
        loss_mask: None,
        inputs: both.inputs[r * 32..(r + 1) * 32].to_vec(),
        targets: both.targets[r * 32..(r + 1) * 32].to_vec(),
        batch: 1,
        seq: 32,
    };
    let alone: Vec<f32> = (0..3)
        .flat_map(|r| forward_logits(&gpt, &params, &row(r)))
        .collect();
    assert_eq!(bits(&forward_logits(&gpt, &params, &both)), bits(&alone));
}

#[test]
fn backward_accumulates_into_grad_params() {
    let gpt = tiny();
    let params = perturbed(&gpt, 3, 0.3);
    let mb = batch_of(11, 2, 5, 1);
    let s = step(&gpt, &params, &mb);
    let mut twice = s.grads[1].clone();
    let dx = gpt.backward(
        1,
        &params[1],
        &s.inputs[1],
        &s.input_grads[2],
        &mb,
        &mut twice,
    );
    assert_eq!(dx, s.input_grads[1]);
    // Equal up to rounding only: the FMA chain starts from the buffer's value, so its partial
    // sums (which can be much larger than the result) round differently.
    for (t, g) in twice.iter().zip(&s.grads[1]) {
        assert!(
            (t - 2.0 * g).abs() <= 1e-5 * g.abs().max(1e-3),
            "{t} vs 2 * {g}"
        );
    }
}

/// `keep_activations` trades memory for compute only: the same bits as recomputing.
#[test]
fn kept_activations_give_the_recomputed_bits() {
    let gpt = tiny();
    let params = perturbed(&gpt, 3, 0.3);
    let mb = batch_of(11, 2, 5, 1);
    let s = step(&gpt, &params, &mb);
    // Every unit but the head (whose output gradient comes from the loss).
    for (u, p) in params.iter().enumerate().take(gpt.units().len() - 1) {
        let x = &s.inputs[u];
        let (out, kept) = gpt.forward_keep(u, p, x, &mb);
        assert_eq!(bits(&out), bits(&gpt.forward(u, p, x, &mb)), "unit {u}");
        // Blocks keep; the embedding recomputes (it has nothing worth keeping).
        assert_eq!(kept.is_some(), u >= 1, "unit {u}");
        let bytes = kept.as_ref().map_or(0, |k| k.bytes);
        assert!(
            u == 0 || bytes > 4 * x.len() as u64,
            "unit {u}: {bytes} bytes"
        );
        let mut g = vec![0.0; p.len()];
        let dx = gpt.backward_kept(u, p, x, kept, &s.input_grads[u + 1], &mb, &mut g);
        assert_eq!(bits(&dx), bits(&s.input_grads[u]), "unit {u}");
        assert_eq!(bits(&g), bits(&s.grads[u]), "unit {u}");
    }
}

#[test]
fn empty_micro_batches_give_zero_loss_and_gradients() {
    let gpt = tiny();
    let params = perturbed(&gpt, 3, 0.3);
    for (batch, seq) in [(0, 5), (2, 0)] {
        let mb = MicroBatch {
            loss_mask: None,
            inputs: vec![],
            targets: vec![],
            batch,
            seq,
        };
        let s = step(&gpt, &params, &mb);
        assert_eq!(s.loss, 0.0);
        assert!(s.grads.iter().flatten().all(|&g| g == 0.0));
    }
}

#[test]
fn deterministic_across_calls_and_threads() {
    // Reference width, so sgemm runs its blocked paths (fc2's k = 1024 spans several blocks).
    let cfg = GptConfig {
        vocab: 64,
        seq_len: 32,
        d_model: 256,
        heads: 4,
        layers: 1,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    let gpt = Gpt::new(cfg).expect("valid config");
    let params = perturbed(&gpt, 5, 0.05);
    assert_deterministic(Arc::new(gpt), params, batch_of(64, 2, 32, 4));
}

/// The scratch arenas are reused without clearing: poisoning them must not change a bit.
#[test]
fn stale_scratch_does_not_leak() {
    let cfg = GptConfig {
        vocab: 64,
        seq_len: 40, // two causal blocks, the second partial
        d_model: 32,
        heads: 4,
        layers: 2,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    let gpt = Gpt::new(cfg).expect("valid config");
    let params = perturbed(&gpt, 7, 0.05);
    let mb = batch_of(64, 3, 40, 9);
    let first = fingerprint(&gpt, &params, &mb);
    for poison in [f32::NAN, -1e30] {
        poison_pool(poison);
        assert!(fingerprint(&gpt, &params, &mb) == first, "poison {poison}");
    }
}

#[test]
#[should_panic(expected = "out of range")]
fn forward_rejects_token_ids_beyond_vocab() {
    let gpt = tiny();
    let mut mb = batch_of(11, 1, 3, 0);
    mb.inputs[2] = 11;
    gpt.forward(0, &gpt.init_unit(0, 0), &[], &mb);
}

#[test]
#[should_panic(expected = "exceeds the model's seq_len")]
fn forward_rejects_sequences_beyond_seq_len() {
    let gpt = tiny();
    gpt.forward(0, &gpt.init_unit(0, 0), &[], &batch_of(11, 1, 6, 0));
}

#[test]
fn loss_falls_on_a_repeating_pattern() {
    let cfg = GptConfig {
        vocab: 10,
        seq_len: 16,
        d_model: 32,
        heads: 4,
        layers: 2,
        gelu: GeluForm::Erf,
        tie_embeddings: false,
    };
    let gpt = Gpt::new(cfg).expect("valid config");
    assert_learns_pi_digits(&gpt);
}

/// The KV-cache decoder gives the full forward's logits at every position (to rounding: its
/// attention sums in another order), and greedy generation picks the same tokens.
#[test]
fn the_kv_cache_decoder_matches_the_full_forward() {
    use super::super::sample::{generate, generate_cached, Sampling};
    for tie_embeddings in [false, true] {
        let gpt = Gpt::new(GptConfig {
            tie_embeddings,
            gelu: GeluForm::Tanh,
            ..tiny().cfg
        })
        .expect("valid config");
        let params = perturbed(&gpt, 5, 0.5);
        let mb = batch_of(11, 1, 5, 3);
        let full = forward_logits(&gpt, &params, &mb);
        let mut dec = gpt.decoder(&params).expect("the GPT decodes");
        for (i, &t) in mb.inputs.iter().enumerate() {
            let row = dec.push(t);
            for (a, b) in row.iter().zip(&full[i * 11..(i + 1) * 11]) {
                assert!((a - b).abs() < 1e-5, "position {i}: {a} vs {b}");
            }
        }
        assert_eq!(dec.len(), dec.capacity());
        let greedy = Sampling {
            new_tokens: 3,
            temperature: 0.0,
            top_k: 0,
            seed: 1,
            stop: None,
        };
        let prompt = &mb.inputs[..2];
        assert_eq!(
            generate_cached(&gpt, &params, prompt, greedy),
            generate(&gpt, &params, prompt, 3, 0.0, 1)
        );
        // Top-1 sampling is greedy whatever the temperature; the table bounds the output.
        let top1 = Sampling {
            temperature: 5.0,
            top_k: 1,
            new_tokens: 10,
            ..greedy
        };
        let out = generate_cached(&gpt, &params, prompt, top1);
        assert_eq!(
            out.len(),
            5 - 2 + 1,
            "the prompt's 2 positions, then 3 more, and the last"
        );
        assert_eq!(&out[..3], &generate(&gpt, &params, prompt, 3, 0.0, 1)[..]);
    }
}
