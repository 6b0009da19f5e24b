//! Instruction tuning: chat templates render as transformers renders them, a masked prompt
//! leaves exactly the gradient of its completion, masked runs keep their bits at every world
//! size and stage, bad records are refused with their file and line, and `--data` takes lists,
//! directories and globs in a fixed order.
//!
//! `tests/fixtures/chat/templates.json` holds transformers' renderings; its script,
//! `tests/fixtures/chat/make_templates.py`, says how they were made.

use std::path::{Path, PathBuf};

use crate::common;

use common::ezero::{copy_dir, ezero, ok, refused, s, Run};
use common::{run_cfg, small};
use elastic_zero::config::{ModelKind, TrainConfig};
use elastic_zero::data::chat::{ChatTemplate, Message};
use elastic_zero::data::Dataset;
use elastic_zero::job::{build_dataset, build_model};
use elastic_zero::model::sample::forward_backward;
use elastic_zero::model::tie::Ties;
use elastic_zero::model::{ops, MicroBatch, Model};
use elastic_zero::reference::train_reference;
use elastic_zero::summary::param_sha256;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
    message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\n' }}{% endif %}";

/// A template short enough for the fixture's 32 positions (its tokenizer spells the ChatML
/// markers out in bytes).
const SHORT: &str = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}\
    {% if add_generation_prompt %}a:{% endif %}";

/// The tiny Llama fixture copied into `dir`, with `template` as its chat template if given.
fn llama_dir(dir: &Path, template: Option<&str>) -> PathBuf {
    let to = dir.join("llama");
    copy_dir(&fixture("hf/llama-tiny"), &to);
    if let Some(t) = template {
        let config = serde_json::json!({ "chat_template": t, "eos_token": "<|endoftext|>" });
        std::fs::write(to.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    to
}

#[test]
fn chat_templates_render_as_transformers_does() {
    let text = std::fs::read_to_string(fixture("chat/templates.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let conv: Vec<Message> = serde_json::from_value(v["conversation"].clone()).unwrap();
    let templates = v["templates"].as_object().unwrap();
    for name in ["smollm2", "llama3", "qwen2", "llama31_style"] {
        let t = &templates[name];
        let str_of = |k: &str| t[k].as_str().unwrap();
        let tmpl = ChatTemplate::new(
            str_of("chat_template"),
            str_of("bos_token"),
            str_of("eos_token"),
        );
        assert_eq!(tmpl.render(&conv, false).unwrap(), str_of("full"), "{name}");
        let prompt = tmpl.render(&conv[..1], true).unwrap();
        assert_eq!(prompt, str_of("first_turn_prompt"), "{name}");
        // The trained parts are the two answers with what the template ends a turn with.
        let parts = tmpl.segments(&conv).unwrap();
        let joined: String = parts.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(joined, str_of("full"), "{name}");
        let trained: Vec<&str> = parts.iter().filter(|p| p.1).map(|p| p.0.as_str()).collect();
        assert_eq!(trained.len(), 2, "{name}: {trained:?}");
        assert!(trained[0].starts_with("Paris."), "{name}: {trained:?}");
        assert!(trained[1].starts_with("Rome."), "{name}: {trained:?}");
        assert!(
            trained.iter().all(|p| p.contains(str_of("eos_token"))),
            "{name}"
        );
    }
}

/// A small Llama over the fixture tokenizer's 300 ids, reading `data`.
fn instruct_cfg(dir: &Path, data: &Path) -> TrainConfig {
    TrainConfig {
        vocab: 300,
        data: Some(data.to_path_buf()),
        tokenizer: Some(dir.join("tokenizer.json")),
        token_cache_dir: Some(dir.join("cache")),
        ..small(ModelKind::Llama)
    }
}

/// Forward, then the backward from a given gradient of the logits, as the trainer chains them.
fn backward_from(
    model: &dyn Model,
    params: &[Vec<f32>],
    mb: &MicroBatch,
    mut g: Vec<f32>,
) -> Vec<Vec<f32>> {
    let ties = Ties::of(model).unwrap();
    let mut inputs = vec![Vec::new()];
    for u in 0..params.len() {
        let out = model.forward(u, &ties.view(u, |v| &params[v]), &inputs[u], mb);
        inputs.push(out);
    }
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    for u in (0..params.len()).rev() {
        let view = ties.view(u, |v| &params[v]);
        let mut gv = vec![0.0; view.len()];
        g = model.backward(u, &view, &inputs[u], &g, mb, &mut gv);
        for (t, r, part) in ties.borrowed_grads(u, &gv) {
            grads[t.owner][r]
                .iter_mut()
                .zip(part)
                .for_each(|(a, b)| *a += b);
        }
        let own = ties.own_grad(u, &gv);
        grads[u].iter_mut().zip(own).for_each(|(a, b)| *a += b);
    }
    grads
}

#[test]
fn a_masked_prompt_leaves_exactly_the_gradient_of_its_completion() {
    let t = tempfile::tempdir().unwrap();
    let dir = llama_dir(t.path(), None);
    let (prompt, completion) = ("Question: name a colour. Answer:", " blue");
    let data = t.path().join("pc.jsonl");
    let rec = serde_json::json!({ "prompt": prompt, "completion": completion });
    std::fs::write(&data, format!("{rec}\n")).unwrap();
    let cfg = TrainConfig {
        micro_batches: 1,
        micro_batch_size: 1,
        seq_len: 48,
        ..instruct_cfg(&dir, &data)
    };
    let dataset = build_dataset(&cfg).unwrap();
    assert!(
        matches!(*dataset, Dataset::Instruct(_)),
        "{}",
        dataset.describe()
    );
    let mb = dataset.micro_batch(cfg.seed, 0, 0, 1, cfg.seq_len);
    // Which targets are the completion's, from our own tokenizing: the completion's ids and
    // the end-of-text after them follow the prompt's.
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let ids = |x: &str| tok.encode(x, false).unwrap().get_ids().to_vec();
    let (p, c) = (ids(prompt).len(), ids(completion).len() + 1);
    let completion_rows: Vec<usize> = (p - 1..p - 1 + c).collect();
    let mask = mb.loss_mask.as_ref().expect("a masked micro-batch");
    let kept: Vec<usize> = (0..cfg.seq_len).filter(|&i| mask.keep[i]).collect();
    assert_eq!(kept, completion_rows);

    let model = build_model(&cfg).unwrap();
    let params: Vec<Vec<f32>> = (0..model.units().len())
        .map(|u| model.init_unit(u, 7))
        .collect();
    let ours = forward_backward(model.as_ref(), &params, &mb);
    // The completion alone: the plain cross-entropy of its rows, nothing on the prompt's.
    let vocab = model.vocab();
    let rows: Vec<f32> = completion_rows
        .iter()
        .flat_map(|&r| ours.logits[r * vocab..(r + 1) * vocab].to_vec())
        .collect();
    let targets: Vec<u32> = completion_rows.iter().map(|&r| mb.targets[r]).collect();
    let (loss, g_rows) = ops::cross_entropy(&rows, &targets, vocab);
    let mut g = vec![0.0f32; ours.logits.len()];
    for (k, &r) in completion_rows.iter().enumerate() {
        g[r * vocab..(r + 1) * vocab].copy_from_slice(&g_rows[k * vocab..(k + 1) * vocab]);
    }
    let alone = backward_from(model.as_ref(), &params, &mb, g);
    assert_eq!(ours.loss.to_bits(), loss.to_bits());
    assert_eq!(param_sha256(&ours.grads), param_sha256(&alone));
}

#[test]
fn masked_runs_match_the_oracle_at_every_world_size_and_stage() {
    let t = tempfile::tempdir().unwrap();
    let dir = llama_dir(t.path(), Some(CHATML));
    let data = t.path().join("mixed.jsonl");
    let chat = |q: &str, a: &str| {
        serde_json::json!({ "messages": [
            { "role": "user", "content": q }, { "role": "assistant", "content": a }
        ]})
    };
    let lines = [
        chat("Hi", "Hello there."),
        serde_json::json!({ "prompt": "Two and two:", "completion": " four" }),
        chat("Colour?", "Blue, mostly."),
        serde_json::json!({ "text": "Plain text trains whole." }),
        serde_json::json!({ "prompt": "A long prompt that goes on and on", "completion": "!" }),
    ];
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(&data, text.join("\n")).unwrap();
    let base = TrainConfig {
        seq_len: 64,
        ..instruct_cfg(&dir, &data)
    };
    let model = build_model(&base).unwrap();
    let dataset = build_dataset(&base).unwrap();
    assert!(matches!(*dataset, Dataset::Instruct(_)));
    let want = param_sha256(&train_reference(&base, model.as_ref(), &dataset, None).params);
    for ranks in 1..=3 {
        for stage in 0..=3 {
            let cfg = TrainConfig {
                ranks,
                stage,
                ..base.clone()
            };
            let got = param_sha256(&run_cfg(&cfg).unwrap().params);
            assert_eq!(got, want, "ranks {ranks} stage {stage}");
        }
    }
    // The same micro-batches in another split of the step: a mean over the step's tokens.
    let split = TrainConfig {
        micro_batches: 3,
        micro_batch_size: 4,
        ranks: 2,
        ..base.clone()
    };
    let one = TrainConfig {
        micro_batches: 1,
        micro_batch_size: 12,
        ..base.clone()
    };
    let digest = |c: &TrainConfig| param_sha256(&run_cfg(c).unwrap().params);
    let oracle = |c: &TrainConfig| {
        let d = build_dataset(c).unwrap();
        param_sha256(&train_reference(c, model.as_ref(), &d, None).params)
    };
    assert_eq!(digest(&split), oracle(&split));
    assert_eq!(digest(&one), oracle(&one));
    // Data of `text` records only keeps the packed token windows.
    let plain = t.path().join("plain.jsonl");
    std::fs::write(&plain, r#"{"text": "Hi. Hello there. Two and two: four."}"#).unwrap();
    let text_cfg = TrainConfig {
        data: Some(plain),
        seq_len: 8,
        ..base.clone()
    };
    assert!(matches!(
        *build_dataset(&text_cfg).unwrap(),
        Dataset::Tokens(_)
    ));
}

/// `ezero train` from the tiny Llama in `dir` on `data`, and more flags.
fn train(dir: &Path, data: &str, extra: &[&str]) -> Run {
    let init = format!("hf:{}", s(dir));
    let mut args = vec![
        "train",
        "--init",
        &init,
        "--data",
        data,
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--sample-tokens",
        "0",
        "--micro-batches",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ezero"))
        .args(&args)
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

#[test]
fn bad_records_are_refused_with_file_and_line_before_training() {
    let t = tempfile::tempdir().unwrap();
    let bare = llama_dir(&t.path().join("bare"), None);
    let write = |name: &str, lines: &[&str]| {
        let p = t.path().join(name);
        std::fs::write(&p, lines.join("\n")).unwrap();
        p
    };
    let good = r#"{"prompt": "a", "completion": "b c d"}"#;
    let chat = r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}"#;
    let cases = [
        (
            write("nofield.jsonl", &[good, r#"{"prompt": "only"}"#]),
            "nofield.jsonl:2",
            "`completion`",
        ),
        (
            write("notjson.jsonl", &[good, good, "{oops"]),
            "notjson.jsonl:3",
            "not JSON",
        ),
        (
            write("notemplate.jsonl", &[good, chat]),
            "notemplate.jsonl:2",
            "no chat template",
        ),
        (
            write(
                "long.jsonl",
                &[
                    &format!(r#"{{"prompt": "{}", "completion": "z"}}"#, "w ".repeat(40)),
                    good,
                ],
            ),
            "long.jsonl:1",
            "--seq-len",
        ),
    ];
    for (path, at, what) in cases {
        refused(&train(&bare, s(&path), &[]), at, what);
    }
    let nothing = t.path().join("none-*.jsonl");
    refused(
        &train(&bare, s(&nothing), &[]),
        "none-*.jsonl",
        "matches no file",
    );
    // With a template the chat record trains.
    let with = llama_dir(&t.path().join("with"), Some(SHORT));
    let run = train(&with, s(&t.path().join("notemplate.jsonl")), &[]);
    ok(&run);
    assert!(run.stdout.contains("instruct("), "{}", run.stdout);
}

#[test]
fn data_lists_directories_and_globs_read_in_a_fixed_order() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("corpus");
    std::fs::create_dir(&d).unwrap();
    for (name, text) in [
        ("b.txt", "the second file, "),
        ("a.txt", "the first file; "),
    ] {
        std::fs::write(d.join(name), text.repeat(30)).unwrap();
    }
    let (a, b) = (d.join("a.txt"), d.join("b.txt"));
    let digest = |data: &[&str]| {
        let mut args = vec!["train", "--steps", "2", "--sample-tokens", "0"];
        for x in data {
            args.extend_from_slice(&["--data", x]);
        }
        ok(&ezero(&args)).sha()
    };
    let repeated = digest(&[s(&a), s(&b)]);
    let list = format!("{},{}", s(&a), s(&b));
    assert_eq!(digest(&[&list]), repeated);
    assert_eq!(
        digest(&[s(&d)]),
        repeated,
        "a directory reads its files by name"
    );
    let glob = format!("{}/*.txt", s(&d));
    assert_eq!(digest(&[&glob]), repeated);
    assert_ne!(
        digest(&[s(&b), s(&a)]),
        repeated,
        "the order given is the order read"
    );
    let missing = d.join("c.txt");
    let run = ezero(&[
        "train",
        "--data",
        s(&a),
        "--data",
        s(&missing),
        "--steps",
        "1",
    ]);
    refused(&run, "c.txt", "does not exist");
}

#[test]
fn generate_chat_wraps_the_prompt_in_the_template() {
    let t = tempfile::tempdir().unwrap();
    let with = llama_dir(&t.path().join("with"), Some(SHORT));
    let gen = |dir: &Path, prompt: &str, chat: bool| {
        let init = format!("hf:{}", s(dir));
        let mut args = vec!["generate", "--init", &init, "--prompt", prompt];
        args.extend_from_slice(&["--max-new-tokens", "4", "--temperature", "0"]);
        if chat {
            args.push("--chat");
        }
        ezero(&args)
    };
    let reply = ok(&gen(&with, "Hi", true)).stdout.clone();
    let rendered = "u:Hi\na:";
    let plain = ok(&gen(&with, rendered, false)).stdout.clone();
    assert_eq!(
        plain,
        format!("{rendered}{reply}"),
        "the reply alone, after the template"
    );
    let bare = llama_dir(&t.path().join("bare"), None);
    refused(
        &gen(&bare, "Hi", true),
        "tokenizer_config.json",
        "chat_template",
    );
}
