//! GFLOP/s of the model's own matrix products, per kernel path, beside `matrixmultiply` (the
//! kernel we used before) and, when a Python with torch is given, PyTorch's single-thread GEMM
//! on the same shapes in the same run.
//!
//! The shapes are those one micro-batch of the GPT makes (`tokens` rows): every linear layer's
//! forward (`x Wᵀ`, B transposed), input gradient (`dY W`) and weight gradient (`dYᵀ x`, A
//! transposed), and one attention head's products at full sequence length. A flop is counted
//! as in every GEMM benchmark: `2 m k n` per product.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde::{Deserialize, Serialize};

use super::adam::median_call_s;
use crate::model::gemm::{gemm_bf16_with, gemm_with, Bf16Path, Form, GemmPath, Layout};

/// One product of the model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Shape {
    pub name: String,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub form: Form,
}

impl Shape {
    fn new(name: &str, (m, k, n): (usize, usize, usize), form: Form) -> Self {
        let name = name.to_string();
        Self {
            name,
            m,
            k,
            n,
            form,
        }
    }

    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.k as f64 * self.n as f64
    }

    fn layouts(&self) -> (Layout, Layout, usize, usize) {
        self.form.layouts(self.m, self.k, self.n)
    }
}

/// The GPT's products for one micro-batch of `tokens` rows (forward and both backward products
/// of every linear layer, and one attention head's).
pub fn model_shapes(
    d_model: usize,
    heads: usize,
    seq: usize,
    tokens: usize,
    vocab: usize,
) -> Vec<Shape> {
    let (t, d) = (tokens, d_model);
    let mut out = Vec::new();
    for (layer, d_in, d_out) in [
        ("qkv", d, 3 * d),
        ("proj", d, d),
        ("fc1", d, 4 * d),
        ("fc2", 4 * d, d),
        ("head", d, vocab),
    ] {
        out.push(Shape::new(
            &format!("{layer}.fwd"),
            (t, d_in, d_out),
            Form::Nt,
        ));
        out.push(Shape::new(
            &format!("{layer}.dx"),
            (t, d_out, d_in),
            Form::Nn,
        ));
        out.push(Shape::new(
            &format!("{layer}.dw"),
            (d_out, t, d_in),
            Form::Tn,
        ));
    }
    let hd = d / heads.max(1);
    out.push(Shape::new("attn.qk", (seq, hd, seq), Form::Nt));
    out.push(Shape::new("attn.pv", (seq, seq, hd), Form::Nn));
    out.push(Shape::new("attn.dv", (seq, seq, hd), Form::Tn));
    out
}

/// GFLOP/s of one thread on the process's GEMM path for the model's largest linear product
/// (`fc1.fwd`: `tokens × d_model → 4·d_model`), timed for about `min_time_s`: the peak that
/// model FLOPs utilisation is reported against.
pub fn peak_gflops(d_model: usize, tokens: usize, min_time_s: f64) -> f64 {
    let shape = Shape::new("fc1.fwd", (tokens, d_model, 4 * d_model), Form::Nt);
    let ours = Kernel::F32(GemmPath::current());
    shape.flops() / time_ours(&shape, ours, min_time_s / 5.0) / 1e9
}

/// A kernel the benchmark times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Our f32 GEMM on a path.
    F32(GemmPath),
    /// Our bf16 GEMM on a path (f32 in and out, bf16 operands).
    Bf16(Bf16Path),
    /// The `matrixmultiply` crate's f32 GEMM.
    MatrixMultiply,
}

impl Kernel {
    /// The name in results: `ezero-<path>`, `ezero-bf16-<path>` or `matrixmultiply`.
    pub fn name(self) -> String {
        match self {
            Kernel::F32(p) => format!("ezero-{}", p.name()),
            Kernel::Bf16(p) => format!("ezero-bf16-{}", p.name()),
            Kernel::MatrixMultiply => "matrixmultiply".into(),
        }
    }
}

/// One measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GemmResult {
    pub round: u32,
    pub shape: String,
    /// [`Kernel::name`], or `torch` (`torch-bf16` for bf16 operands and output).
    pub kernel: String,
    pub gflops: f64,
}

fn values(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + salt) % 23) as f32 * 0.01 - 0.11)
        .collect()
}

/// Seconds per product of `shape` through `kernel` (median of the timed repeats).
fn time_ours(shape: &Shape, kernel: Kernel, repeat_s: f64) -> f64 {
    let (la, lb, a_len, b_len) = shape.layouts();
    let lc = Layout::row_major(shape.m, shape.n);
    let (a, b) = (values(a_len, 1), values(b_len, 2));
    let mut c = vec![0.0f32; shape.m * shape.n];
    match kernel {
        Kernel::F32(p) => {
            median_call_s(repeat_s, || gemm_with(p, &a, la, &b, lb, &mut c, lc, false))
        }
        Kernel::Bf16(p) => median_call_s(repeat_s, || {
            gemm_bf16_with(p, &a, la, &b, lb, &mut c, lc, false)
        }),
        Kernel::MatrixMultiply => median_call_s(repeat_s, || {
            // SAFETY: the layouts come from the shape and the buffers have their lengths
            // (`Shape::layouts`); `c` is a unique borrow.
            unsafe {
                matrixmultiply::sgemm(
                    shape.m,
                    shape.k,
                    shape.n,
                    1.0,
                    a.as_ptr(),
                    la.row_stride as isize,
                    la.col_stride as isize,
                    b.as_ptr(),
                    lb.row_stride as isize,
                    lb.col_stride as isize,
                    0.0,
                    c.as_mut_ptr(),
                    lc.row_stride as isize,
                    lc.col_stride as isize,
                )
            }
        }),
    }
}

/// The torch side: run with `repeat_s` as its argument, reading shapes on stdin (see the script).
const TORCH_SCRIPT: &str = include_str!("../../benches/gemm_torch.py");

/// A running torch process that times one shape per request.
struct Torch {
    python: String,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Torch {
    fn start(python: &str, repeat_s: f64, bf16: bool) -> Result<Self, String> {
        // The script goes in through the environment so that stdin stays free for shapes.
        let boot = "import os, sys; exec(compile(os.environ['EZERO_GEMM_TORCH'], 'gemm_torch.py', 'exec'))";
        let mut child = Command::new(python)
            .args(["-c", boot, &repeat_s.to_string()])
            .args(bf16.then_some("bf16"))
            .env("EZERO_GEMM_TORCH", TORCH_SCRIPT)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot run {python}: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(format!("{python}: no pipes"));
        };
        let python = python.to_string();
        let stdout = BufReader::new(stdout);
        Ok(Self {
            python,
            child,
            stdin,
            stdout,
        })
    }

    fn time(&mut self, shape: &Shape) -> Result<f64, String> {
        #[derive(Deserialize)]
        struct Reply {
            shape: String,
            gflops: f64,
        }
        let py = &self.python;
        let req = serde_json::to_string(shape).map_err(|e| e.to_string())?;
        writeln!(self.stdin, "{req}")
            .map_err(|e| format!("{py} stopped reading ({e}): see its error above"))?;
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| format!("reading from {py}: {e}"))?;
        if line.is_empty() {
            return Err(format!(
                "{py} exited without timing {}: see its error above (is torch installed?)",
                shape.name
            ));
        }
        let r: Reply =
            serde_json::from_str(&line).map_err(|e| format!("{py} printed {line:?}: {e}"))?;
        if r.shape != shape.name {
            return Err(format!("{py} answered {} for {}", r.shape, shape.name));
        }
        Ok(r.gflops)
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Benchmark settings.
pub struct GemmBench {
    pub shapes: Vec<Shape>,
    pub rounds: u32,
    /// Seconds of timed work per measurement (split over the repeats).
    pub min_time_s: f64,
    /// A Python with torch, for the side-by-side column.
    pub torch_python: Option<String>,
    /// Our kernels to time (each must be supported), `matrixmultiply` among them if wanted.
    pub kernels: Vec<Kernel>,
    /// Torch multiplies bf16 operands into a bf16 output (its mixed-precision matmul) rather
    /// than f32 ones.
    pub torch_bf16: bool,
}

/// Runs every kernel on every shape, round after round; torch times each shape right after
/// ours (before ours on odd rounds), so the pair shares the machine's state. `emit` gets each
/// result.
pub fn run(b: &GemmBench, mut emit: impl FnMut(GemmResult)) -> Result<(), String> {
    let repeat_s = b.min_time_s / 5.0;
    let mut torch = match &b.torch_python {
        Some(py) => Some(Torch::start(py, repeat_s, b.torch_bf16)?),
        None => None,
    };
    let torch_name = if b.torch_bf16 { "torch-bf16" } else { "torch" };
    for round in 0..b.rounds {
        for shape in &b.shapes {
            let timed = |emit: &mut dyn FnMut(GemmResult), kernel: String, gflops: f64| {
                let shape = shape.name.clone();
                emit(GemmResult {
                    round,
                    shape,
                    kernel,
                    gflops,
                });
            };
            let torch_first = round % 2 == 1;
            if let (Some(t), true) = (torch.as_mut(), torch_first) {
                timed(&mut emit, torch_name.into(), t.time(shape)?);
            }
            for &kernel in &b.kernels {
                let s = time_ours(shape, kernel, repeat_s);
                timed(&mut emit, kernel.name(), shape.flops() / s / 1e9);
            }
            if let (Some(t), false) = (torch.as_mut(), torch_first) {
                timed(&mut emit, torch_name.into(), t.time(shape)?);
            }
        }
    }
    Ok(())
}
