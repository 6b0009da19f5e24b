//! The checkpoint tools: `ezero checkpoint inspect`, retention of the newest checkpoints, and
//! the safetensors export (read back by the `safetensors` crate and, if installed, Python).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::ezero::{ezero, ok, refused, s, train_cli, Run};
use elastic_zero::checkpoint::interchange::{bf16_to_f32, f32_to_bf16};
use elastic_zero::checkpoint::{self, store, Loaded};
use elastic_zero::job::build_model;
use elastic_zero::model::UnitSpec;
use elastic_zero::runtime::api::cluster::consolidate;
use elastic_zero::runtime::step::state::rank_state::ChunkState;
use elastic_zero::summary::param_sha256;

#[test]
fn inspect_reports_the_layout_and_retention_keeps_the_newest() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let r = train_cli(&[
        "--steps",
        "5",
        "--ranks",
        "4",
        "--stage",
        "2",
        "--save-dir",
        s(&root),
        "--save-every",
        "1",
        "--keep-checkpoints",
        "2",
    ]);
    let sha = ok(&r).sha();
    let left: Vec<u64> = store::list(&root).unwrap().iter().map(|e| e.step).collect();
    assert_eq!(left, vec![4, 5]);
    let ins = ezero(&["checkpoint", "inspect", s(&root), "--json"]);
    let v: serde_json::Value = serde_json::from_str(ok(&ins).stdout.trim()).unwrap();
    assert_eq!(v["step"], 5);
    assert_eq!(
        (v["world_size"].as_u64(), v["stage"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(
        v["param_sha256"],
        sha.as_str(),
        "the last checkpoint holds the final model"
    );
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    let per_rank: u64 = ranks.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
    assert_eq!(per_rank, v["bytes"].as_u64().unwrap());
    assert_eq!(
        per_rank,
        12 * v["param_count"].as_u64().unwrap(),
        "params + Adam m and v"
    );
    let human = ok(&ezero(&["checkpoint", "inspect", s(&root)]))
        .stdout
        .clone();
    assert!(human.contains("saved by 4 ranks, ZeRO-2") && human.contains("rank 3: rank-00003.bin"));
    // A fresh run may not save over another run's checkpoints, and saving needs a directory.
    let fresh = train_cli(&["--steps", "2", "--save-dir", s(&root)]);
    refused(&fresh, "save_dir", "already holds checkpoints");
    refused(
        &train_cli(&["--steps", "2", "--save-every", "1"]),
        "save_every",
        "save_dir",
    );
}

/// A tiny GPT that saves at its last step, so the checkpoint is the final model.
const GPT: [&str; 19] = [
    "train",
    "--model",
    "gpt",
    "--layers",
    "1",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--micro-batches",
    "2",
    "--micro-batch-size",
    "2",
    "--sample-tokens",
    "0",
    "--chunk-elems",
    "500",
];

/// A checkpoint of [`GPT`] and its exports: fp32, and bf16 with the optimizer state.
struct Exported {
    dir: tempfile::TempDir,
    root: PathBuf,
    fp32: PathBuf,
    bf16: PathBuf,
    loaded: Loaded,
    units: Vec<UnitSpec>,
    /// Each unit's consolidated parameters.
    params: Vec<Vec<f32>>,
}

impl Exported {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ck");
        ok(&train(&[
            "--steps",
            "3",
            "--ranks",
            "3",
            "--save-dir",
            s(&root),
            "--save-every",
            "3",
        ]));
        let loaded = checkpoint::load_path(&root).unwrap();
        let units = build_model(&loaded.manifest.config).unwrap().units();
        let params = consolidate(&loaded.snapshot.map, &loaded.snapshot.chunks);
        let fp32 = dir.path().join("model.safetensors");
        let bf16 = dir.path().join("half.safetensors");
        ok(&ezero(&[
            "checkpoint",
            "export",
            s(&root),
            "--out",
            s(&fp32),
        ]));
        ok(&ezero(&[
            "checkpoint",
            "export",
            s(&root),
            "--out",
            s(&bf16),
            "--bf16",
            "--with-optimizer",
        ]));
        Exported {
            dir,
            root,
            fp32,
            bf16,
            loaded,
            units,
            params,
        }
    }

    fn optimizer_file(&self) -> PathBuf {
        self.dir.path().join("half.optimizer.safetensors")
    }

    /// Each unit's consolidated Adam `m`.
    fn exp_avg(&self) -> Vec<Vec<f32>> {
        let snapshot = &self.loaded.snapshot;
        let as_params: Vec<ChunkState> = snapshot
            .chunks
            .iter()
            .map(|c| ChunkState {
                params: c.m.clone(),
                ..c.clone()
            })
            .collect();
        consolidate(&snapshot.map, &as_params)
    }
}

/// `ezero train` of [`GPT`] with `extra` flags.
fn train(extra: &[&str]) -> Run {
    ezero(&[&GPT[..], extra].concat())
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn export_round_trips_through_safetensors_and_init_starts_from_it() {
    let ex = Exported::new();
    the_exports_read_back_with_the_safetensors_crate(&ex);
    init_starts_from_the_export_and_refuses_another_model(&ex);
}

/// An independent reader: the Python safetensors package reads the same exports.
#[test]
#[ignore = "needs a Python with the safetensors package (EZERO_TRANSFORMERS_PYTHON; bash .ci/run makes one)"]
fn python_safetensors_reads_the_exports() {
    python_reads_the_exports_too(&Exported::new());
}

/// Names, shapes and values: fp32 bit for bit, bf16 rounded from them, and Adam's `m`.
fn the_exports_read_back_with_the_safetensors_crate(ex: &Exported) {
    let bytes = std::fs::read(&ex.fp32).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let half_bytes = std::fs::read(&ex.bf16).unwrap();
    let half = safetensors::SafeTensors::deserialize(&half_bytes).unwrap();
    let opt_bytes = std::fs::read(ex.optimizer_file()).unwrap();
    let opt = safetensors::SafeTensors::deserialize(&opt_bytes).unwrap();
    let named: usize = ex.units.iter().map(|u| u.params.len()).sum();
    assert_eq!((st.len(), half.len(), opt.len()), (named, named, 2 * named));
    let m = ex.exp_avg();
    for (u, unit) in ex.units.iter().enumerate() {
        let mut off = 0;
        for p in &unit.params {
            let want = &ex.params[u][off..off + p.numel()];
            let t32 = st.tensor(&p.name).unwrap();
            assert_eq!(
                (t32.dtype(), t32.shape()),
                (safetensors::Dtype::F32, p.shape.as_slice())
            );
            let got = f32s(t32.data());
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{}",
                p.name
            );
            let t16 = half.tensor(&p.name).unwrap();
            assert_eq!(t16.dtype(), safetensors::Dtype::BF16);
            for (b, w) in t16.data().chunks_exact(2).zip(want) {
                assert_eq!(u16::from_le_bytes([b[0], b[1]]), f32_to_bf16(*w));
                assert!((bf16_to_f32(f32_to_bf16(*w)) - w).abs() <= w.abs() / 128.0);
            }
            let tm = opt.tensor(&format!("{}.exp_avg", p.name)).unwrap();
            assert_eq!(f32s(tm.data()), m[u][off..off + p.numel()].to_vec());
            off += p.numel();
        }
    }
}

/// `--init` from the fp32 export reproduces the checkpoint's weights exactly; weights of
/// another model are refused, naming the tensor, and so is `--init` with `--resume`.
fn init_starts_from_the_export_and_refuses_another_model(ex: &Exported) {
    let sha = &ex.loaded.manifest.param_sha256;
    let r = train(&["--steps", "0", "--init", s(&ex.fp32)]);
    assert_eq!(&ok(&r).sha(), sha);
    assert_eq!(&param_sha256(&ex.params), sha);
    ok(&train(&["--steps", "2", "--init", s(&ex.bf16)]));
    let mut wider = GPT.to_vec();
    wider[6] = "32"; // --d-model 32
    let other = ezero(&[&wider[..], &["--steps", "1", "--init", s(&ex.fp32)]].concat());
    refused(&other, "model.safetensors", "has shape");
    refused(
        &train(&["--resume", s(&ex.root), "--init", s(&ex.fp32)]),
        "--init",
        "--resume",
    );
}

fn python_reads_the_exports_too(ex: &Exported) {
    let units = &ex.units;
    let expect = serde_json::json!({
        "fp32": ex.fp32, "bf16": ex.bf16, "optimizer": ex.optimizer_file(),
        "param_sha256": ex.loaded.manifest.param_sha256,
        "params": units.iter().flat_map(|u| u.params.iter().map(|p| (p.name.clone(), p.shape.clone()))).collect::<Vec<_>>(),
        "state": ex.loaded.manifest.optimizer.state,
    });
    let expect_path = ex.dir.path().join("expect.json");
    std::fs::write(&expect_path, expect.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint_safetensors.py");
    let python = std::env::var("EZERO_TRANSFORMERS_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(&script)
        .arg(&expect_path)
        .output()
        .unwrap_or_else(|e| panic!("this test needs a Python ({python}): {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{python}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
