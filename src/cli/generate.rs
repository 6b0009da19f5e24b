//! `ezero generate`: continue a prompt with a pretrained model or a checkpoint,
//! through the model's tokenizer and its KV-cache decoder.

use std::path::{Path, PathBuf};

use clap::Args;

use elastic_zero::checkpoint::interchange::consolidated_params;
use elastic_zero::checkpoint::read::load_path;
use elastic_zero::config::TrainConfig;
use elastic_zero::data::chat::{ChatTemplate, Message};
use elastic_zero::data::tokens::end_of_text;
use elastic_zero::job::build_model;
use elastic_zero::model::sample::{generate_cached, Sampling};
use elastic_zero::model::Model;

use super::init::{import, pretrained, InitSource};
use super::CliError;

/// `ezero generate` flags.
#[derive(Args)]
pub struct GenerateArgs {
    /// A pretrained model: `hf:DIR` (or a directory), a Hugging Face GPT-2, Llama or Qwen2
    /// directory; or `gguf:FILE`, a llama.cpp Llama-family file.
    #[arg(long, conflicts_with = "checkpoint")]
    pub init: Option<PathBuf>,
    /// A checkpoint directory, or a save directory (its newest complete checkpoint).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// The text to continue.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 50)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Draw among the K likeliest tokens only; 0 keeps all.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// tokenizer.json [default: the model directory's, or the checkpoint run's; without one,
    /// text is bytes].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// End the output before the first occurrence of this text (repeatable) [default: none;
    /// generation always stops at the model's eos: generation_config.json's `eos_token_id`,
    /// e.g. an instruct model's end-of-turn, else the tokenizer's end-of-text].
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Treat --prompt as one user message: render it with the model's chat template (from its
    /// tokenizer_config.json) and the generation prompt, stop at the end-of-turn token
    /// (`<|im_end|>`, `<|eot_id|>`, else the eos), and print the reply alone [default: off].
    #[arg(long)]
    pub chat: bool,
}

fn usage(e: impl std::fmt::Display) -> CliError {
    CliError::Usage(e.to_string())
}

pub fn run(args: &GenerateArgs) -> Result<(), CliError> {
    let (cfg, params) = match (&args.init, &args.checkpoint) {
        (Some(init), None) => {
            let src = InitSource::of(init);
            let cache = TrainConfig::default().token_cache();
            let p = pretrained(&src, cache.as_deref())?.ok_or_else(|| {
                usage(format!(
                    "--init {}: not a Hugging Face directory or a GGUF file",
                    init.display()
                ))
            })?;
            let mut cfg = TrainConfig::default();
            p.shape.apply(&mut cfg, &p.dir);
            cfg.seq_len = p.shape.positions();
            let model = build_model(&cfg).map_err(usage)?;
            let params = import(&src, &model.units())?;
            (cfg, params)
        }
        (None, Some(ckpt)) => {
            let loaded = load_path(ckpt).map_err(usage)?;
            let params = consolidated_params(&loaded);
            (loaded.manifest.config, params)
        }
        _ => return Err(usage("give the model: --init hf:DIR or --checkpoint DIR")),
    };
    let model = build_model(&cfg).map_err(usage)?;
    let tokenizer = match args.tokenizer.clone().or_else(|| cfg.tokenizer_path()) {
        Some(p) => Some(load_tokenizer(&p)?),
        None => None,
    };
    let sampling = Sampling {
        new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        seed: args.seed,
        stop: None,
    };
    let mut eos = cfg.hf_dir.as_deref().and_then(generation_eos);
    let prompt = if args.chat {
        let (prompt, turn_end) = chat_prompt(args, &cfg, tokenizer.as_ref())?;
        eos = turn_end.or(eos);
        prompt
    } else {
        args.prompt.clone()
    };
    let mut text = continue_text_until(
        model.as_ref(),
        &params,
        tokenizer.as_ref(),
        &prompt,
        Sampling {
            stop: eos.or(sampling.stop),
            ..sampling
        },
    )?;
    if let Some(cut) = args.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(cut);
    }
    if args.chat {
        println!("{text}");
    } else {
        println!("{}{text}", args.prompt);
    }
    Ok(())
}

/// Tokens that end an assistant's turn, in the order they are looked for.
const END_OF_TURN: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>"];

/// `--prompt` as one user message under the model's chat template with the generation prompt,
/// and the id that ends the reply (an end-of-turn token, else the template's eos).
fn chat_prompt(
    args: &GenerateArgs,
    cfg: &TrainConfig,
    tokenizer: Option<&tokenizers::Tokenizer>,
) -> Result<(String, Option<u32>), CliError> {
    let tok_path = args.tokenizer.clone().or_else(|| cfg.tokenizer_path());
    let (Some(tok), Some(tok_path)) = (tokenizer, tok_path) else {
        return Err(usage(
            "--chat needs the model's tokenizer and chat template: give an instruct model \
             (--init hf:DIR or gguf:FILE) or --tokenizer FILE beside its tokenizer_config.json",
        ));
    };
    let config = match (&cfg.hf_dir, &args.tokenizer) {
        (Some(dir), None) => dir.join("tokenizer_config.json"),
        _ => tok_path.with_file_name("tokenizer_config.json"),
    };
    let template = ChatTemplate::from_tokenizer_config(&config)
        .map_err(usage)?
        .ok_or_else(|| {
            usage(format!(
                "--chat: {} has no `chat_template`: the model is not a chat model; leave out \
                 --chat to continue the prompt as text",
                config.display()
            ))
        })?;
    let message = Message {
        role: "user".into(),
        content: args.prompt.clone(),
    };
    let prompt = template
        .render(&[message], true)
        .map_err(|e| usage(format!("--chat: {e}")))?;
    let turn_end = END_OF_TURN
        .iter()
        .find_map(|t| tok.token_to_id(t))
        .or_else(|| tok.token_to_id(template.eos_token()));
    Ok((prompt, turn_end))
}

/// The first `eos_token_id` of `dir/generation_config.json` (an instruct model's end of turn,
/// which its tokenizer's end-of-text is not).
fn generation_eos(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("generation_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let id = match v.get("eos_token_id")? {
        serde_json::Value::Array(ids) => ids.first()?.as_u64()?,
        id => id.as_u64()?,
    };
    u32::try_from(id).ok()
}

/// [`continue_text`], stopping at `sampling.stop` if it is set, else at the tokenizer's
/// end-of-text.
fn continue_text_until(
    model: &dyn Model,
    params: &[Vec<f32>],
    tokenizer: Option<&tokenizers::Tokenizer>,
    prompt: &str,
    sampling: Sampling,
) -> Result<String, CliError> {
    encode_and_generate(model, params, tokenizer, prompt, sampling, sampling.stop)
}

/// `prompt` continued by `sampling` (its `stop` set to the tokenizer's end-of-text), as text:
/// through `tokenizer`, or bytes without one.
pub(super) fn continue_text(
    model: &dyn Model,
    params: &[Vec<f32>],
    tokenizer: Option<&tokenizers::Tokenizer>,
    prompt: &str,
    sampling: Sampling,
) -> Result<String, CliError> {
    encode_and_generate(model, params, tokenizer, prompt, sampling, None)
}

fn encode_and_generate(
    model: &dyn Model,
    params: &[Vec<f32>],
    tokenizer: Option<&tokenizers::Tokenizer>,
    prompt: &str,
    sampling: Sampling,
    stop: Option<u32>,
) -> Result<String, CliError> {
    let ids: Vec<u32> = match tokenizer {
        Some(t) => t
            .encode(prompt, false)
            .map_err(|e| usage(format!("--prompt: cannot encode: {e}")))?
            .get_ids()
            .to_vec(),
        None => prompt.bytes().map(u32::from).collect(),
    };
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= model.vocab()) {
        return Err(usage(format!(
            "--prompt: token id {bad} is beyond the model's {} ids: give the model's tokenizer",
            model.vocab()
        )));
    }
    let sampling = Sampling {
        stop: stop.or_else(|| tokenizer.and_then(end_of_text)),
        ..sampling
    };
    let out = generate_cached(model, params, &ids, sampling);
    match tokenizer {
        Some(t) => t
            .decode(&out, true)
            .map_err(|e| CliError::Failed(format!("cannot decode: {e}"))),
        None => Ok(
            String::from_utf8_lossy(&out.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned(),
        ),
    }
}

pub(super) fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, CliError> {
    tokenizers::Tokenizer::from_file(path)
        .map_err(|e| usage(format!("{}: not a tokenizer.json: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_token_is_generation_configs_first_eos() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(generation_eos(dir.path()), None);
        let g = dir.path().join("generation_config.json");
        std::fs::write(&g, r#"{"eos_token_id": [2, 0]}"#).unwrap();
        assert_eq!(generation_eos(dir.path()), Some(2));
        std::fs::write(&g, r#"{"bos_token_id": 1, "eos_token_id": 7}"#).unwrap();
        assert_eq!(generation_eos(dir.path()), Some(7));
    }
}
