//! Hugging Face Llama and Qwen2 directories: our Llama computes what transformers computes on
//! them (grouped-query attention, RoPE θ from either key, a head width that is not
//! hidden/heads, tied and untied heads, Qwen2's q/k/v biases), fine-tunes from them, exports
//! a directory of the same family that reads back bit for bit, and refuses settings it does not
//! implement by key.
//!
//! Fixtures: `tests/fixtures/hf/make_llama.py` (transformers 5.24) wrote `llama-tiny`,
//! `llama-untied` and `qwen2-tiny` and what transformers computed on each.

use crate::common::ezero::{ezero, ok, refused, s, step_dir};
use crate::hf::{fixture_named, load, matches_transformers};
use elastic_zero::checkpoint::hf::{self, config::HfShape, files::TensorDir};
use elastic_zero::checkpoint::interchange::consolidated_params;
use elastic_zero::checkpoint::read::load_path;
use elastic_zero::config::ModelKind;
use elastic_zero::summary::param_sha256;

#[test]
fn llama_and_qwen2_checkpoints_compute_what_transformers_computes() {
    // Embedding, 9 per layer, the final norm; tied: no lm_head.
    assert_eq!(matches_transformers("llama-tiny"), 1 + 2 * 9 + 1);
    assert_eq!(matches_transformers("llama-untied"), 1 + 2 * 9 + 2);
    // Qwen2: 3 more (q/k/v biases) per layer.
    assert_eq!(matches_transformers("qwen2-tiny"), 1 + 2 * 12 + 1);
}

#[test]
fn config_json_sets_the_family_and_its_constants() {
    let shape = |name: &str| match hf::config::read(&fixture_named(name)).unwrap() {
        HfShape::Llama(l) => l,
        other => panic!("{name}: {other:?}"),
    };
    let tiny = shape("llama-tiny");
    assert_eq!((tiny.heads, tiny.kv_heads, tiny.head_dim), (4, 2, 8));
    assert_eq!(
        (tiny.rope_theta, tiny.norm_eps),
        (5e5, 1e-6),
        "v5's rope_parameters"
    );
    assert!(tiny.tied && !tiny.qkv_bias);
    let untied = shape("llama-untied");
    assert_eq!((untied.d_model, untied.heads, untied.head_dim), (16, 2, 16));
    assert_eq!(
        untied.rope_theta, 1e4,
        "the top-level rope_theta of older files"
    );
    assert!(!untied.tied);
    let qwen = shape("qwen2-tiny");
    assert!(qwen.qkv_bias && qwen.tied);
    let (_, _, cfg) = load(&fixture_named("qwen2-tiny"));
    assert_eq!(cfg.model, ModelKind::Llama);
    assert_eq!((cfg.kv_heads(), cfg.rope_theta), (2, 1e6));
}

/// A copy of fixture `name` with its `config.json` edited by `edit`.
fn with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let src = fixture_named(name);
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
    dir
}

#[test]
fn settings_we_do_not_compute_are_refused_by_key() {
    let train = |dir: &std::path::Path| {
        ezero(&[
            "train",
            "--init",
            &format!("hf:{}", s(dir)),
            "--seq-len",
            "8",
            "--steps",
            "1",
        ])
    };
    let cases: [(&str, serde_json::Value, &str); 4] = [
        ("attention_bias", true.into(), "o_proj"),
        ("hidden_act", "gelu".into(), "only silu"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "unscaled",
        ),
        ("use_sliding_window", true.into(), "not supported"),
    ];
    for (key, value, why) in cases {
        let d = with_config("llama-tiny", |v| v[key] = value.clone());
        refused(&train(d.path()), "config.json", why);
    }
    // A tensor the config implies but the shards lack is named.
    let d = with_config("llama-tiny", |v| v["num_hidden_layers"] = 3.into());
    refused(
        &train(d.path()),
        "model.layers.2.self_attn.q_proj.weight",
        "has no tensor",
    );
    // A shape flag that contradicts config.json, and another model.
    let init = format!("hf:{}", s(&fixture_named("llama-tiny")));
    refused(
        &ezero(&["train", "--init", &init, "--heads", "8"]),
        "--heads 8",
        "contradicts",
    );
    refused(
        &ezero(&["train", "--init", &init, "--model", "gpt"]),
        "--model gpt",
        "llama",
    );
}

#[test]
fn a_fine_tuned_llama_exports_as_its_family_and_reads_back() {
    for (name, family) in [("llama-tiny", "llama"), ("qwen2-tiny", "qwen2")] {
        let t = tempfile::tempdir().unwrap();
        let saves = t.path().join("saves");
        ok(&ezero(&[
            "train",
            "--init",
            &format!("hf:{}", s(&fixture_named(name))),
            "--seq-len",
            "8",
            "--ranks",
            "2",
            "--micro-batches",
            "2",
            "--steps",
            "2",
            "--save-dir",
            s(&saves),
            "--save-every",
            "2",
        ]));
        let out = t.path().join("export");
        let r = ezero(&[
            "checkpoint",
            "export",
            s(&step_dir(&saves, 2)),
            "--format",
            "hf",
            "--out",
            s(&out),
        ]);
        ok(&r);
        assert!(r.stdout.contains(&format!("as {family}")), "{}", r.stdout);
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["model_type"], family);
        assert_eq!(cfg["tie_word_embeddings"], true);
        let td = TensorDir::open(&out).unwrap();
        assert!(
            !td.tensors.contains_key("lm_head.weight"),
            "tied: no lm_head"
        );
        assert!(td.tensors.keys().all(|k| k.starts_with("model.")));
        let (_, back, _) = load(&out);
        let saved = consolidated_params(&load_path(&step_dir(&saves, 2)).unwrap());
        assert_eq!(param_sha256(&back), param_sha256(&saved), "{name}");
    }
}

#[test]
fn a_llama_generates_with_its_tokenizer() {
    let init = format!("hf:{}", s(&fixture_named("llama-tiny")));
    let gen = |seed: &str| {
        let args = [
            "generate",
            "--init",
            &init,
            "--prompt",
            "The model",
            "--max-new-tokens",
            "6",
            "--seed",
            seed,
        ];
        ok(&ezero(&args)).stdout.clone()
    };
    let a = gen("3");
    assert!(a.starts_with("The model"), "{a}");
    assert_eq!(a, gen("3"));
}
