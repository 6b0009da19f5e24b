//! Fine-tuning as practitioners do it: help and messages, output paths checked before the
//! work, and continued training.

use crate::common::ezero::{ezero, ok, refused, s, step_dir, train_cli};

/// Every `train` flag says what it does and its default.
#[test]
fn every_train_flag_has_a_description_and_its_default() {
    let r = ezero(&["train", "--help"]);
    ok(&r);
    // An option starts a line with `--name` indented less than the descriptions (which may
    // start with a flag's name too); its text runs to the next one.
    let mut flags: Vec<(String, String)> = Vec::new();
    for line in r.stdout.lines() {
        let t = line.trim_start();
        let indent = line.len() - t.len();
        if indent <= 6 && (t.starts_with("--") || t.starts_with("-h, --")) {
            let name = t.split_whitespace().next().unwrap_or_default().to_string();
            flags.push((name, t.to_string()));
        } else if let Some((_, text)) = flags.last_mut() {
            text.push(' ');
            text.push_str(t);
        }
    }
    assert!(flags.len() > 50, "{}", r.stdout);
    for (name, text) in &flags {
        if text.contains("--help") {
            continue;
        }
        assert!(text.contains("[default"), "{name} has no default: {text}");
        let described = text.split_whitespace().count() > 3;
        assert!(described, "{name} has no description: {text}");
    }
    for form in ["hf:DIR", "gguf:FILE", "safetensors", "Llama", "Qwen2"] {
        let init = &flags.iter().find(|(n, _)| n == "--init").unwrap().1;
        assert!(init.contains(form), "--init help lacks {form}: {init}");
    }
}

/// A mistyped flag is never pointed at a test hook (they are environment variables).
#[test]
fn test_hooks_are_not_suggested() {
    for typo in ["--panic-a", "--sigterm-a", "--signal-at"] {
        let r = ezero(&["train", typo, "1"]);
        assert_eq!(r.code, 2);
        let tip = r.stderr.lines().find(|l| l.contains("similar argument"));
        let named = |w: &str| tip.is_some_and(|l| l.contains(w));
        assert!(
            !["panic", "sigterm", "signal", "hook"]
                .iter()
                .any(|w| named(w)),
            "{}",
            r.stderr
        );
    }
    // A benchmark's worker processes learn their rank from the environment too.
    let r = ezero(&["bench", "collectives", "--worker-ran", "1"]);
    assert_eq!(r.code, 2);
    assert!(!r.stderr.contains("worker-rank"), "{}", r.stderr);
}

/// Bad input gets one line naming what was wrong and exit 2, before anything trains.
#[test]
fn fine_tuning_mistakes_get_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "This License applies to any program ".repeat(40)).unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let hf_weights = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf/qwen2-tiny/model.safetensors"
    );
    refused(&train_cli(&["--lr", "-1"]), "lr", "positive");
    refused(
        &train_cli(&["--weight-decay", "-0.5"]),
        "weight_decay",
        "positive",
    );
    refused(
        &train_cli(&["--init", s(&corpus)]),
        "corpus.txt",
        "not a safetensors or GGUF file",
    );
    refused(
        &train_cli(&["--init", hf_weights]),
        "model.safetensors",
        "--init hf:",
    );
    refused(&train_cli(&["--data", s(&empty)]), "empty.txt", "is empty");
}

/// Every output path is checked before training starts: a run that cannot write its summary
/// or its checkpoints trains nothing.
#[test]
fn unwritable_outputs_are_refused_before_training() {
    refused(
        &train_cli(&["--steps", "2", "--json", "/nonexistent-dir/run.json"]),
        "/nonexistent-dir/run.json",
        "does not exist",
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("ckpt");
    refused(
        &train_cli(&["--steps", "2", "--save-dir", s(&under_file)]),
        "--save-dir",
        "not a directory",
    );
    refused(
        &train_cli(&["--steps", "2", "--json", s(dir.path())]),
        "--json",
        "is a directory",
    );
    refused(
        &train_cli(&["--metrics-file", "/nonexistent-dir/log.jsonl"]),
        "--metrics-file",
        "does not exist",
    );
    refused(
        &train_cli(&["--eval-data", "/nonexistent/eval.txt"]),
        "eval_data",
        "does not exist",
    );
}

/// A run continued from step k to N under a constant schedule has the bits of an uninterrupted
/// N-step run; under the cosine schedule a new length is a new schedule and needs
/// `--reschedule`; only the keys that differ are named.
#[test]
fn resume_to_more_steps_under_a_constant_schedule_is_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ck");
    let constant = ["--lr-schedule", "constant", "--warmup-steps", "2"];
    let mut first: Vec<&str> = constant.to_vec();
    first.extend(["--steps", "3", "--save-dir", s(&save), "--save-every", "3"]);
    ok(&train_cli(&first));
    let mut longer: Vec<&str> = constant.to_vec();
    longer.extend(["--steps", "6"]);
    let whole = train_cli(&longer);
    ok(&whole);
    // The resumed runs save into the same directory: name the checkpoint of step 3.
    let save = step_dir(&save, 3);
    let resumed = train_cli(&["--resume", s(&save), "--steps", "6"]);
    ok(&resumed);
    assert_eq!(resumed.sha(), whole.sha());
    // Shorter than the saved run's length, still past its step.
    ok(&train_cli(&["--resume", s(&save), "--steps", "4"]));
    let r = train_cli(&["--resume", s(&save), "--steps", "2"]);
    refused(&r, "`steps` is 2", "already at step 3");
    let r = train_cli(&["--resume", s(&save), "--steps", "6", "--seed", "5"]);
    refused(&r, "`seed`", "data order");
    assert!(!r.stderr.contains("chunk_elems"), "{}", r.stderr);

    let cosine = dir.path().join("cos");
    ok(&train_cli(&[
        "--steps",
        "3",
        "--save-dir",
        s(&cosine),
        "--save-every",
        "3",
    ]));
    let cosine = step_dir(&cosine, 3);
    let r = train_cli(&["--resume", s(&cosine), "--steps", "6"]);
    refused(&r, "`steps`", "--reschedule");
    let r = train_cli(&["--resume", s(&cosine), "--steps", "6", "--reschedule"]);
    ok(&r);
}

/// The exported directory is complete: a 4.x reader (top-level `rope_theta`, `torch_dtype`)
/// reads the source's RoPE base, the tokenizer files name the specials, and every file is
/// mode 0644.
#[test]
fn an_export_is_a_complete_hugging_face_directory() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama-tiny");
    let saves = t.path().join("saves");
    let init = format!("hf:{fixture}");
    ok(&ezero(&[
        "train",
        "--init",
        &init,
        "--seq-len",
        "8",
        "--ranks",
        "2",
        "--micro-batches",
        "2",
        "--steps",
        "1",
        "--sample-tokens",
        "0",
        "--save-dir",
        s(&saves),
        "--save-every",
        "1",
    ]));
    let out = t.path().join("export");
    ok(&ezero(&[
        "checkpoint",
        "export",
        s(&step_dir(&saves, 1)),
        "--format",
        "hf",
        "--out",
        s(&out),
    ]));
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    let cfg = read("config.json");
    // What transformers 4.x reads: the top-level keys only.
    assert_eq!(cfg["rope_theta"].as_f64(), Some(500000.0), "{cfg}");
    assert_eq!(
        cfg["rope_parameters"]["rope_theta"].as_f64(),
        Some(500000.0)
    );
    assert_eq!(cfg["torch_dtype"], "float32");
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer.json")).unwrap())
            .unwrap();
    let eos = elastic_zero::checkpoint::hf::tokenizer_files::token_text(&tok, 299).unwrap();
    let tc = read("tokenizer_config.json");
    assert_eq!(tc["eos_token"], eos.as_str());
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(read("special_tokens_map.json")["eos_token"], eos.as_str());
    assert_eq!(read("generation_config.json")["eos_token_id"], 299);
    for e in std::fs::read_dir(&out).unwrap() {
        let e = e.unwrap();
        let mode = e.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "{}", e.path().display());
    }
    // The export's output is checked before the checkpoint is read.
    let r = ezero(&[
        "checkpoint",
        "export",
        s(&step_dir(&saves, 1)),
        "--out",
        "/nonexistent-dir/model.safetensors",
    ]);
    refused(&r, "--out", "does not exist");
}

/// `--eval-data`: the held-out loss equals the mean cross-entropy computed here in f64 from
/// the saved parameters' logits on the same windows; `--metrics-file` has one record a step
/// with the schedule's learning rate, which the progress line shows too.
#[test]
fn eval_loss_and_the_run_log_match_independent_computations() {
    use elastic_zero::checkpoint::interchange::consolidated_params;
    use elastic_zero::checkpoint::read::load_path;
    use elastic_zero::job::{build_eval_dataset, build_model, eval::eval_batches, lr_schedule};
    let t = tempfile::tempdir().unwrap();
    let train_txt = t.path().join("train.txt");
    let eval_txt = t.path().join("eval.txt");
    std::fs::write(
        &train_txt,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    std::fs::write(&eval_txt, "a lazy dog sleeps; the fox runs on. ".repeat(10)).unwrap();
    let (saves, json, log) = (
        t.path().join("ck"),
        t.path().join("run.json"),
        t.path().join("log.jsonl"),
    );
    let r = ezero(&[
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
        "3",
        "--micro-batch-size",
        "2",
        "--steps",
        "3",
        "--ranks",
        "2",
        "--sample-tokens",
        "0",
        "--data",
        s(&train_txt),
        "--eval-data",
        s(&eval_txt),
        "--save-dir",
        s(&saves),
        "--save-every",
        "3",
        "--json",
        s(&json),
        "--metrics-file",
        s(&log),
    ]);
    ok(&r);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ours = summary["eval_loss"].as_f64().unwrap();
    let loaded = load_path(&step_dir(&saves, 3)).unwrap();
    let cfg = loaded.manifest.config.clone();
    let params = consolidated_params(&loaded);
    let model = build_model(&cfg).unwrap();
    let data = build_eval_dataset(&cfg).unwrap().unwrap();
    let batches = eval_batches(&cfg, &data);
    assert_eq!(batches.len(), 3);
    let want = mean_cross_entropy(model.as_ref(), &params, &batches);
    assert!(
        (ours - want).abs() < 1e-5,
        "eval loss {ours}, computed here {want}"
    );
    let ppl = summary["eval_perplexity"].as_f64().unwrap();
    assert!((ppl - ours.exp()).abs() < 1e-9 * ppl);
    assert!(r.stdout.contains("eval: loss"), "{}", r.stdout);
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 3);
    let schedule = lr_schedule(&cfg);
    for (i, rec) in records.iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(rec["step"], step);
        assert_eq!(rec["lr"].as_f64().unwrap() as f32, schedule.lr_at(step));
        assert_eq!(rec["members"], 2);
        assert_eq!(rec["loss"].as_f64(), summary["losses"][i].as_f64());
        assert!(rec["grad_norm"].as_f64().unwrap() > 0.0 && rec["step_s"].as_f64().is_some());
    }
    assert!(r
        .stdout
        .lines()
        .any(|l| l.starts_with("step ") && l.contains(" lr ")));
}

/// The mean over `batches` of each one's mean cross-entropy, in f64 from the model's logits.
fn mean_cross_entropy(
    model: &dyn elastic_zero::model::Model,
    params: &[Vec<f32>],
    batches: &[elastic_zero::model::MicroBatch],
) -> f64 {
    use elastic_zero::model::sample::forward_logits;
    let mut total = 0.0;
    for mb in batches {
        let logits = forward_logits(model, params, mb);
        let v = logits.len() / mb.targets.len();
        let ce: f64 = mb
            .targets
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let row = &logits[i * v..(i + 1) * v];
                let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                max + sum.ln() - row[t as usize] as f64
            })
            .sum();
        total += ce / mb.targets.len() as f64;
    }
    total / batches.len() as f64
}

/// The byte-level model refuses JSON Lines unless told to read the bytes (`--data-format
/// text`); `--vocab` sets the ids the model embeds, at least the data's.
#[test]
fn jsonl_without_a_tokenizer_is_refused_unless_read_as_text_and_vocab_is_a_flag() {
    let t = tempfile::tempdir().unwrap();
    let jsonl = t.path().join("chat.jsonl");
    let record = r#"{"text": "the quick brown fox jumps over the lazy dog"}"#;
    std::fs::write(&jsonl, format!("{record}\n").repeat(20)).unwrap();
    let r = train_cli(&["--steps", "1", "--data", s(&jsonl)]);
    refused(&r, "chat.jsonl", "--data-format text");
    ok(&train_cli(&[
        "--steps",
        "1",
        "--data",
        s(&jsonl),
        "--data-format",
        "text",
    ]));
    let r = train_cli(&[
        "--steps",
        "1",
        "--data",
        s(&jsonl),
        "--data-format",
        "text",
        "--vocab",
        "300",
    ]);
    ok(&r);
    refused(
        &train_cli(&[
            "--steps",
            "1",
            "--data",
            s(&jsonl),
            "--data-format",
            "text",
            "--vocab",
            "100",
        ]),
        "vocab",
        "at least 256",
    );
}

/// `generate --stop TEXT` ends the output before TEXT.
#[test]
fn generate_stops_before_the_stop_text() {
    let init = concat!(
        "hf:",
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf/llama-tiny"
    );
    let base = [
        "generate",
        "--init",
        init,
        "--prompt",
        "the",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ];
    let full = ezero(&base);
    ok(&full);
    let text = full.stdout.trim_end_matches('\n').to_string();
    let cont = &text["the".len()..];
    let chars: Vec<char> = cont.chars().collect();
    assert!(chars.len() > 4, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--stop", &stop]);
    let cut = ezero(&args);
    ok(&cut);
    let want = format!("the{}", &cont[..cont.find(&stop).unwrap()]);
    assert_eq!(cut.stdout.trim_end_matches('\n'), want);
}
