//! Hugging Face GPT-2 directories: what transformers computes on a checkpoint is what our GPT
//! computes on it after `--init hf:DIR`, an exported directory has transformers' layout and
//! reads back bit for bit, and bad directories are refused naming the file and the problem.
//!
//! The fixture (`tests/fixtures/hf/`) is a tiny random GPT-2 that transformers 5.24 saved
//! sharded, with the logits, loss and gradients transformers computed on one batch;
//! `tests/fixtures/hf/make_gpt2.py` wrote it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;

use common::ezero::{ezero, ok, refused, s, step_dir};
use elastic_zero::checkpoint::hf::{self, files::TensorDir, source::TensorSource};
use elastic_zero::checkpoint::interchange::consolidated_params;
use elastic_zero::checkpoint::read::load_path;
use elastic_zero::config::TrainConfig;
use elastic_zero::job::build_model;
use elastic_zero::model::sample::forward_backward;
use elastic_zero::model::{MicroBatch, Model};
use elastic_zero::summary::param_sha256;

fn fixture() -> PathBuf {
    fixture_named("gpt2-tiny")
}

/// A model directory under `tests/fixtures/hf/`.
pub(crate) fn fixture_named(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The model `--init hf:DIR` builds, and its parameters from the directory.
pub(crate) fn load(dir: &Path) -> (std::sync::Arc<dyn Model>, Vec<Vec<f32>>, TrainConfig) {
    let mut cfg = TrainConfig {
        seq_len: 8,
        ..TrainConfig::default()
    };
    hf::config::read(dir).unwrap().apply(&mut cfg, dir);
    let model = build_model(&cfg).unwrap();
    let params = hf::import(dir, &model.units()).unwrap();
    (model, params, cfg)
}

#[test]
#[allow(clippy::single_range_in_vec_init)]
fn ranks_read_only_the_ranges_they_keep() {
    use elastic_zero::model::weights::WeightSource;
    let dir = fixture();
    let (model, whole, _) = load(&dir);
    let units = model.units();
    // GPT-2 stores its Conv1D weights transposed (read whole) and the rest as we lay them out
    // (read by byte range): any ranges read as the same elements as the whole unit.
    let w = hf::weights(&dir, &units).unwrap();
    for (u, full) in whole.iter().enumerate() {
        let n = full.len();
        let ranges = [0..1, 3..n / 4, n / 2..n / 2 + 5, n - 2..n];
        let got = w.read(u, &ranges).unwrap();
        for (r, v) in ranges.iter().zip(&got) {
            assert_eq!(v[..], full[r.clone()], "unit {u} {r:?}");
        }
    }
    // A range inside the embedding reads its elements' bytes and nothing more.
    let w = hf::weights(&dir, &units).unwrap();
    let emb = &units[0].params[0];
    assert_eq!(emb.name, "tok.weight");
    let dtype_bytes = {
        let td = TensorDir::open(&dir).unwrap();
        let (_, t) = td
            .tensors
            .iter()
            .find(|(k, _)| k.ends_with("wte.weight"))
            .unwrap();
        t.len / t.shape.iter().product::<usize>() as u64
    };
    w.read(0, &[10..10 + emb.numel() / 2]).unwrap();
    assert_eq!(
        w.source().bytes_read(),
        (emb.numel() / 2) as u64 * dtype_bytes
    );
    assert!(w
        .read(0, &[0..units[0].numel() + 1])
        .unwrap_err()
        .contains("past unit 0"));
}

#[test]
fn under_stage_3_the_ranks_together_read_the_model_once() {
    use elastic_zero::model::weights::WeightSource;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Counts the elements asked for.
    struct Counted<W>(W, AtomicUsize);
    impl<W: WeightSource> WeightSource for Counted<W> {
        fn read(
            &self,
            unit: usize,
            ranges: &[std::ops::Range<usize>],
        ) -> Result<Vec<Vec<f32>>, String> {
            let n: usize = ranges.iter().map(|r| r.len()).sum();
            self.1.fetch_add(n, Ordering::Relaxed);
            self.0.read(unit, ranges)
        }
        fn describe(&self) -> String {
            self.0.describe()
        }
    }

    let dir = fixture();
    let (model, whole, cfg) = load(&dir);
    let numel: usize = whole.iter().map(Vec::len).sum();
    for (stage, ranks) in [(3, 2), (3, 3), (2, 2)] {
        let cfg = TrainConfig {
            stage,
            ranks,
            steps: 2,
            chunk_elems: 64,
            ..cfg.clone()
        };
        let run = |init: Arc<dyn WeightSource>| {
            let data = elastic_zero::job::build_dataset(&cfg).unwrap();
            let spec = elastic_zero::runtime::ClusterSpec {
                init: Some(init),
                ..elastic_zero::runtime::ClusterSpec::new(model.clone(), data, cfg.clone())
            };
            crate::common::train_blocking(spec, ())
                .unwrap()
                .param_sha256
        };
        let counted = Arc::new(Counted(
            hf::weights(&dir, &model.units()).unwrap(),
            AtomicUsize::new(0),
        ));
        let from_file = run(counted.clone());
        let each_rank_whole = if stage == 3 { 1 } else { ranks as usize };
        assert_eq!(
            counted.1.load(Ordering::Relaxed),
            numel * each_rank_whole,
            "stage {stage}, {ranks} ranks"
        );
        assert_eq!(from_file, run(Arc::new(whole.clone())), "stage {stage}");
    }
}

/// `ezero train` from the fixture: 2 ranks, 2 micro-batches of seq 8, then `extra`.
fn fine_tune_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--seq-len",
        "8",
        "--ranks",
        "2",
        "--micro-batches",
        "2",
        "--sample-tokens",
        "0",
        "--init",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.push(format!("hf:{}", s(&fixture())));
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

fn close(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    let scale = theirs.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale + 1e-7,
            "{what}[{i}]: ours {a}, transformers {b} (scale {scale})"
        );
    }
}

/// Our model from fixture `name` against what transformers computed on it
/// (`<name>-expected.safetensors`): logits, loss and every parameter's gradient, by
/// transformers' name. Returns how many gradients were compared.
pub(crate) fn matches_transformers(name: &str) -> usize {
    let dir = fixture_named(name);
    let (model, params, _) = load(&dir);
    let exp =
        TensorDir::open_file(&dir.with_file_name(format!("{name}-expected.safetensors"))).unwrap();
    let ids: Vec<u32> = {
        let info = &exp.tensors["input_ids"];
        let bytes = std::fs::read(&info.file).unwrap();
        let raw = &bytes[info.start as usize..(info.start + info.len) as usize];
        raw.chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let (rows, cols) = (2, 9);
    assert_eq!(ids.len(), rows * cols);
    let mb = MicroBatch {
        loss_mask: None,
        inputs: ids
            .chunks(cols)
            .flat_map(|r| r[..cols - 1].to_vec())
            .collect(),
        targets: ids.chunks(cols).flat_map(|r| r[1..].to_vec()).collect(),
        batch: rows,
        seq: cols - 1,
    };
    let step = forward_backward(model.as_ref(), &params, &mb);
    close("logits", &step.logits, &exp.read_f32("logits").unwrap());
    close("loss", &[step.loss], &exp.read_f32("loss").unwrap());
    let units = model.units();
    let td = TensorDir::open(&dir).unwrap();
    let naming = hf::naming_of(&hf::config::read(&dir).unwrap(), &td);
    let mut checked = 0;
    for t in hf::source::export_tensors(&*naming, &units, &step.grads) {
        let (name, _, ours) = t.unwrap();
        close(
            &name,
            &ours,
            &exp.read_f32(&format!("grad.{name}")).unwrap(),
        );
        checked += 1;
    }
    checked
}

#[test]
fn a_gpt2_checkpoint_computes_what_transformers_computes() {
    let (_, _, cfg) = load(&fixture());
    assert!(cfg.tie_embeddings, "GPT-2 ties its head to wte");
    // wte, wpe, 12 per block, ln_f's two; no lm_head (tied).
    assert_eq!(matches_transformers("gpt2-tiny"), 2 + 2 * 12 + 2);
}

/// A copy of the fixture whose weights are rewritten by `edit` (name, shape, values).
fn variant(
    edit: impl Fn(&mut Vec<(String, Vec<usize>, Vec<f32>)>),
    dtype: safetensors::Dtype,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let td = TensorDir::open(&fixture()).unwrap();
    let mut tensors: Vec<_> = td
        .tensors
        .iter()
        .map(|(n, i)| (n.clone(), i.shape.clone(), td.read_f32(n).unwrap()))
        .collect();
    edit(&mut tensors);
    let out = tensors
        .into_iter()
        .map(|(name, shape, v)| hf::files::OutTensor {
            name,
            shape,
            bytes: match dtype {
                safetensors::Dtype::BF16 => v
                    .iter()
                    .flat_map(|&x| {
                        elastic_zero::checkpoint::interchange::f32_to_bf16(x).to_le_bytes()
                    })
                    .collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        })
        .collect();
    hf::files::write_checkpoint(dir.path(), out, dtype, u64::MAX).unwrap();
    std::fs::copy(
        fixture().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    dir
}

#[test]
fn hub_names_bf16_weights_and_stale_buffers_load() {
    let (_, want, _) = load(&fixture());
    // The hub's gpt2 has no `transformer.` prefix and carries the old attention buffers.
    let hub = variant(
        |t| {
            for (n, _, _) in t.iter_mut() {
                *n = n.trim_start_matches("transformer.").to_string();
            }
            t.push(("h.0.attn.bias".into(), vec![1, 1, 16, 16], vec![1.0; 256]));
            t.push(("h.0.attn.masked_bias".into(), vec![], vec![-1e4]));
        },
        safetensors::Dtype::F32,
    );
    let (_, got, _) = load(hub.path());
    assert_eq!(param_sha256(&got), param_sha256(&want));
    let bf16 = variant(|_| {}, safetensors::Dtype::BF16);
    let (_, got, _) = load(bf16.path());
    let rounded: Vec<Vec<f32>> = want
        .iter()
        .map(|u| {
            u.iter()
                .map(|&x| elastic_zero::model::gemm::round_bf16(x))
                .collect()
        })
        .collect();
    assert_eq!(param_sha256(&got), param_sha256(&rounded));
}

#[test]
fn bad_directories_are_refused_naming_the_file_and_the_problem() {
    let train = |dir: &Path| {
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
    let empty = tempfile::tempdir().unwrap();
    refused(&train(empty.path()), "no config.json", "Hugging Face");
    let gguf = empty.path().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let damaged = "truncated GGUF";
    refused(&ezero(&["train", "--init", s(&gguf)]), "Q4_1.gguf", damaged);
    let gen = ["generate", "--init", s(&gguf), "--prompt", "x"];
    refused(&ezero(&gen), "Q4_1.gguf", damaged);
    let llama = tempfile::tempdir().unwrap();
    std::fs::write(
        llama.path().join("config.json"),
        r#"{"model_type": "mistral", "architectures": ["MistralForCausalLM"]}"#,
    )
    .unwrap();
    refused(
        &train(llama.path()),
        "config.json",
        "supported: gpt2, llama, qwen2",
    );
    let missing = variant(
        |t| t.retain(|(n, _, _)| n != "transformer.h.1.mlp.c_fc.weight"),
        safetensors::Dtype::F32,
    );
    refused(
        &train(missing.path()),
        "transformer.h.1.mlp.c_fc.weight",
        "has no tensor",
    );
    let wrong = variant(
        |t| {
            for (n, shape, _) in t.iter_mut() {
                if n == "transformer.h.0.attn.c_proj.weight" {
                    shape.reverse();
                    shape[0] = 16;
                    shape[1] = 64;
                }
            }
        },
        safetensors::Dtype::F32,
    );
    refused(
        &train(wrong.path()),
        "transformer.h.0.attn.c_proj.weight",
        "has shape",
    );
    let long = ezero(&[
        "train",
        "--init",
        &format!("hf:{}", s(&fixture())),
        "--seq-len",
        "32",
    ]);
    refused(&long, "config.json", "max_positions");
    let clash = ezero(&[
        "train",
        "--init",
        &format!("hf:{}", s(&fixture())),
        "--d-model",
        "64",
    ]);
    refused(&clash, "--d-model 64", "contradicts");
}

#[test]
fn fine_tuned_weights_export_as_a_directory_transformers_reads() {
    let t = tempfile::tempdir().unwrap();
    let saves = t.path().join("saves");
    let save = ["--steps", "2", "--save-dir", s(&saves), "--save-every", "2"];
    ok(&ezero(&fine_tune_args(&save)));
    let out = t.path().join("export");
    ok(&ezero(&[
        "checkpoint",
        "export",
        s(&step_dir(&saves, 2)),
        "--format",
        "hf",
        "--out",
        s(&out),
        "--max-shard-bytes",
        "50000",
    ]));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "gpt2");
    assert_eq!(cfg["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["activation_function"], "gelu_new");
    assert_eq!(cfg["n_positions"], 16);
    assert!(
        out.join("generation_config.json").exists(),
        "companion files copied"
    );
    let td = TensorDir::open(&out).unwrap();
    assert!(td.tensors.keys().all(|k| k.starts_with("transformer.")));
    assert!(
        !td.tensors.contains_key("lm_head.weight"),
        "tied: no lm_head"
    );
    assert!(out.join(hf::files::INDEX_FILE).exists(), "sharded at 50 kB");
    let bytes = std::fs::read(td.tensors.values().next().unwrap().file.clone()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(
        header["__metadata__"]["format"], "pt",
        "transformers requires it"
    );
    // The export reads back to the checkpoint's weights, bit for bit.
    let (_, back, _) = load(&out);
    let saved = consolidated_params(&load_path(&step_dir(&saves, 2)).unwrap());
    assert_eq!(param_sha256(&back), param_sha256(&saved));
}

fn sample() -> (String, Vec<u32>, u32) {
    let path = fixture().with_file_name("gpt2-tiny-sample.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    (
        v["text"].as_str().unwrap().to_string(),
        ids,
        v["eot"].as_u64().unwrap() as u32,
    )
}

#[test]
fn corpora_are_tokenized_as_the_python_tokenizer_does_and_cached() {
    use elastic_zero::data::{DataFormat, TokenData};
    let (text, ids, eot) = sample();
    let t = tempfile::tempdir().unwrap();
    let tokenizer = fixture().join("tokenizer.json");
    let cache = t.path().join("cache");
    let plain = t.path().join("corpus.txt");
    std::fs::write(&plain, &text).unwrap();
    let load = |p: &Path, f| TokenData::load(p, f, &tokenizer, Some(&cache)).unwrap();
    let first = load(&plain, DataFormat::Auto);
    assert!(
        first.describe().contains("tokenized"),
        "{}",
        first.describe()
    );
    assert_eq!(first.vocab(), 300);
    let again = load(&plain, DataFormat::Text);
    assert!(again.describe().contains("cache"), "{}", again.describe());
    let whole = |d: &TokenData| d.micro_batch(0, 0, 0, 1, d.len_tokens() - 1);
    let mb = whole(&first);
    assert_eq!(
        [&mb.inputs[..], &mb.targets[mb.targets.len() - 1..]].concat(),
        ids
    );
    assert_eq!(whole(&again), mb);
    // A damaged cache is not used: the corpus is tokenized again.
    for f in std::fs::read_dir(&cache).unwrap() {
        let p = f.unwrap().path();
        let mut b = std::fs::read(&p).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&p, b).unwrap();
    }
    let redone = load(&plain, DataFormat::Text);
    assert!(redone.describe().contains("tokenized"));
    assert_eq!(whole(&redone), mb);
    // JSON Lines: one document per record, joined by the end-of-text token.
    let jsonl = t.path().join("corpus.jsonl");
    let rec = serde_json::json!({ "text": text }).to_string();
    std::fs::write(&jsonl, format!("{rec}\n\n{rec}\n")).unwrap();
    let docs = load(&jsonl, DataFormat::Auto);
    let mb = whole(&docs);
    let mut want = ids.clone();
    want.push(eot);
    want.extend(&ids);
    assert_eq!(
        [&mb.inputs[..], &mb.targets[mb.targets.len() - 1..]].concat(),
        want
    );
}

#[test]
fn fine_tuning_reads_the_models_tokenizer_and_refuses_bad_data() {
    let t = tempfile::tempdir().unwrap();
    let (text, _, _) = sample();
    let jsonl = t.path().join("corpus.jsonl");
    let rec = serde_json::json!({ "text": text.repeat(4) }).to_string();
    std::fs::write(&jsonl, format!("{rec}\n{rec}\n")).unwrap();
    let cache = t.path().join("cache");
    let train = |data: &Path| {
        Command::new(env!("CARGO_BIN_EXE_ezero"))
            .args(fine_tune_args(&["--steps", "2", "--data", s(data)]))
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .unwrap()
    };
    let out = train(&jsonl);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("tokens(") && stdout.contains("300-id vocabulary"),
        "{stdout}"
    );
    // A record without `text`, named by file and line.
    let broken = t.path().join("broken.jsonl");
    std::fs::write(&broken, format!("{rec}\n{{\"txt\": \"x\"}}\n")).unwrap();
    let out = train(&broken);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("broken.jsonl:2") && err.contains("`text`"),
        "{err}"
    );
    // A tokenizer with more ids than the model embeds.
    let out = ezero(&[
        "train",
        "--data",
        s(&jsonl),
        "--tokenizer",
        s(&fixture().join("tokenizer.json")),
        "--steps",
        "1",
    ]);
    refused(&out, "vocab", "the model embeds only 256 ids");
}

#[test]
fn generate_continues_a_prompt_from_a_directory_or_a_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let init = format!("hf:{}", s(&fixture()));
    let gen = |source: &[&str], seed: &str| {
        let mut args = vec!["generate", "--prompt", "The model", "--max-new-tokens", "6"];
        args.extend_from_slice(source);
        args.extend_from_slice(&["--seed", seed, "--top-k", "20"]);
        ok(&ezero(&args)).stdout.clone()
    };
    let a = gen(&["--init", &init], "1");
    assert!(a.starts_with("The model"), "{a}");
    assert_eq!(a, gen(&["--init", &init], "1"), "a seed fixes the draw");
    let saves = t.path().join("saves");
    let save = ["--steps", "1", "--save-dir", s(&saves), "--save-every", "1"];
    ok(&ezero(&fine_tune_args(&save)));
    let b = gen(&["--checkpoint", s(&saves)], "1");
    assert!(b.starts_with("The model"), "{b}");
    refused(
        &ezero(&["generate", "--prompt", "x"]),
        "--init",
        "--checkpoint",
    );
}

fn digest(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("param-sha256: "))
        .unwrap_or_else(|| panic!("no digest in:\n{stdout}"))
        .to_string()
}

/// Worker processes start from the directory too, and train the in-process run's bits; on
/// real text (the fixture's own script, through its tokenizer) the loss falls.
#[test]
fn worker_processes_fine_tune_the_same_bits_and_the_loss_falls() {
    let t = tempfile::tempdir().unwrap();
    let corpus = fixture().with_file_name("make_gpt2.py");
    let cache = t.path().join("cache");
    let run = |args: Vec<String>| {
        let out = Command::new(env!("CARGO_BIN_EXE_ezero"))
            .args(args)
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let json = t.path().join("summary.json");
    let train = fine_tune_args(&[
        "--steps",
        "30",
        "--lr",
        "1e-2",
        "--data",
        s(&corpus),
        "--json",
        s(&json),
    ]);
    let in_process = run(train.clone());
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(
        last < first - 1.0,
        "the loss must fall on real text: {first} -> {last}"
    );
    // The same job as worker processes: launch sets the world size from --nprocs.
    let mut launch: Vec<String> = ["launch", "--nprocs", "2", "--"].map(String::from).to_vec();
    let mut rest = train.into_iter().skip(1);
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--ranks" | "--json" => {
                rest.next();
            }
            _ => launch.push(a),
        }
    }
    assert_eq!(digest(&run(launch)), digest(&in_process));
}
