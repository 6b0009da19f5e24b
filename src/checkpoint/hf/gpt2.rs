//! GPT-2's tensor names and layouts against our GPT's (`model::gpt`).
//!
//! The architectures are the same; transformers stores `c_attn`, `c_proj` and `c_fc` as
//! `Conv1D`, whose weight is `[in, out]`, the transpose of our `[out, in]` Linear, and the
//! hub's checkpoints name tensors without the `transformer.` prefix that `save_pretrained`
//! writes. With tied embeddings there is no `lm_head.weight`: our head borrows `tok.weight`.

use super::super::error::CheckpointError;
use super::files::TensorDir;
use crate::model::UnitSpec;

/// Buffers of old checkpoints that are not parameters (transformers PR #24113).
const STALE_BUFFERS: &[&str] = &[".attn.bias", ".attn.masked_bias"];

/// transformers' name of our parameter `ours` (without the `transformer.` prefix), and whether
/// the stored tensor is the transpose of ours; `None` for a name GPT-2 does not have.
pub fn hf_name(ours: &str) -> Option<(String, bool)> {
    let fixed = match ours {
        "tok.weight" => Some("wte.weight"),
        "pos.weight" => Some("wpe.weight"),
        "ln_f.weight" => Some("ln_f.weight"),
        "ln_f.bias" => Some("ln_f.bias"),
        "head.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some((n.to_string(), false));
    }
    let rest = ours.strip_prefix("blocks.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.split_once('.')?;
    let hf_module = match module {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "qkv" => "attn.c_attn",
        "proj" => "attn.c_proj",
        "fc1" => "mlp.c_fc",
        "fc2" => "mlp.c_proj",
        _ => return None,
    };
    let conv = !module.starts_with("ln");
    Some((
        format!("h.{layer}.{hf_module}.{kind}"),
        conv && kind == "weight",
    ))
}

/// Where a name of transformers' sits in the checkpoint: `lm_head` is never prefixed.
fn stored_name(hf: &str, prefixed: bool) -> String {
    match prefixed && !hf.starts_with("lm_head.") {
        true => format!("transformer.{hf}"),
        false => hf.to_string(),
    }
}

/// `[rows, cols]` row-major into `[cols, rows]`.
pub fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Every unit's full parameters from a GPT-2 checkpoint directory: each tensor is checked
/// against the shape our unit expects (named when missing or wrong), converted to f32, and
/// transposed where transformers' layout differs. Tensors the model does not use are refused,
/// except the stale attention buffers and a tied checkpoint's `lm_head.weight`.
pub fn import(td: &TensorDir, units: &[UnitSpec]) -> Result<Vec<Vec<f32>>, CheckpointError> {
    let prefixed = td.tensors.keys().any(|k| k.starts_with("transformer."));
    let mut unused: std::collections::BTreeSet<&str> =
        td.tensors.keys().map(String::as_str).collect();
    let bad = |what: String| CheckpointError::Incompatible {
        path: td.dir.clone(),
        what,
    };
    let mut out = Vec::with_capacity(units.len());
    for u in units {
        let mut buf = Vec::with_capacity(u.numel());
        for p in &u.params {
            let (hf, conv) = hf_name(&p.name)
                .ok_or_else(|| bad(format!("our parameter `{}` has no GPT-2 name", p.name)))?;
            let name = stored_name(&hf, prefixed);
            let want: Vec<usize> = match conv {
                true => p.shape.iter().rev().copied().collect(),
                false => p.shape.clone(),
            };
            let info = td.tensors.get(&name).ok_or_else(|| {
                bad(format!(
                    "has no tensor `{name}` (the model needs shape {want:?})"
                ))
            })?;
            if info.shape != want {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?}; this model needs {want:?}",
                    info.shape
                )));
            }
            let v = td.read_f32(&name)?;
            match conv {
                true => buf.extend(transpose(&v, want[0], want[1])),
                false => buf.extend(v),
            }
            unused.remove(name.as_str());
        }
        out.push(buf);
    }
    unused.retain(|n| !STALE_BUFFERS.iter().any(|s| n.ends_with(s)) && *n != "lm_head.weight");
    if let Some(extra) = unused.iter().next() {
        return Err(bad(format!(
            "tensor `{extra}` is not a parameter of this GPT-2 ({} such tensors)",
            unused.len()
        )));
    }
    Ok(out)
}

/// transformers' stored name and layout of each of our parameters, in unit order, for export:
/// `(name, shape as stored, values as stored)`.
pub fn export_tensors<'a>(
    units: &'a [UnitSpec],
    params: &'a [Vec<f32>],
) -> impl Iterator<Item = Result<(String, Vec<usize>, Vec<f32>), String>> + 'a {
    units.iter().zip(params).flat_map(|(u, buf)| {
        let mut off = 0;
        u.params.iter().map(move |p| {
            let n = p.numel();
            let v = &buf[off..off + n];
            off += n;
            let (hf, conv) = hf_name(&p.name)
                .ok_or_else(|| format!("parameter `{}` has no GPT-2 name", p.name))?;
            let name = stored_name(&hf, true);
            Ok(match conv {
                true => (
                    name,
                    vec![p.shape[1], p.shape[0]],
                    transpose(v, p.shape[0], p.shape[1]),
                ),
                false => (name, p.shape.clone(), v.to_vec()),
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_with_the_conv1d_transposes() {
        assert_eq!(hf_name("tok.weight"), Some(("wte.weight".into(), false)));
        assert_eq!(
            hf_name("blocks.11.qkv.weight"),
            Some(("h.11.attn.c_attn.weight".into(), true))
        );
        assert_eq!(
            hf_name("blocks.0.fc2.bias"),
            Some(("h.0.mlp.c_proj.bias".into(), false))
        );
        assert_eq!(
            hf_name("blocks.3.ln2.weight"),
            Some(("h.3.ln_2.weight".into(), false))
        );
        assert_eq!(hf_name("blocks.3.mystery.weight"), None);
        assert_eq!(stored_name("lm_head.weight", true), "lm_head.weight");
        assert_eq!(stored_name("wte.weight", true), "transformer.wte.weight");
        assert_eq!(
            transpose(&[1., 2., 3., 4., 5., 6.], 2, 3),
            vec![1., 4., 2., 5., 3., 6.]
        );
    }
}
