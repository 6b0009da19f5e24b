//! The layers the built-in models are made of, as views of a unit's parameters that run on the
//! model's [`Backend`]: a linear layer (`y = x · Wᵀ + b`, PyTorch's `W: [d_out, d_in]`) and a
//! layer norm over the last dimension.

use super::backend::Backend;
use super::gemm::Layout;
use super::ops::check_len;

/// `y = x · Wᵀ + b` over rows of `x`, with PyTorch's layout `W: [d_out, d_in]`.
#[derive(Clone, Copy, Debug)]
pub struct Linear<'a> {
    pub be: &'a dyn Backend,
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub d_in: usize,
    pub d_out: usize,
}

impl<'a> Linear<'a> {
    pub fn new(
        be: &'a dyn Backend,
        weight: &'a [f32],
        bias: Option<&'a [f32]>,
        d_in: usize,
        d_out: usize,
    ) -> Self {
        Self {
            be,
            weight,
            bias,
            d_in,
            d_out,
        }
    }

    fn rows(&self, x: &[f32]) -> usize {
        check_len("linear weight", self.weight.len(), self.d_out * self.d_in);
        if let Some(b) = self.bias {
            check_len("linear bias", b.len(), self.d_out);
        }
        assert!(
            self.d_in > 0 && x.len().is_multiple_of(self.d_in),
            "linear input not a multiple of d_in"
        );
        x.len() / self.d_in
    }

    /// `x: [rows, d_in]` → `y: [rows, d_out]` (overwritten).
    pub fn forward_into(&self, x: &[f32], y: &mut [f32]) {
        let rows = self.rows(x);
        check_len("linear output", y.len(), rows * self.d_out);
        if let Some(b) = self.bias {
            self.be.broadcast_rows(b, y);
        }
        let (lx, lw) = (
            Layout::row_major(rows, self.d_in),
            Layout::row_major(self.d_out, self.d_in).transposed(),
        );
        let ly = Layout::row_major(rows, self.d_out);
        self.be
            .gemm(x, lx, self.weight, lw, y, ly, self.bias.is_some());
    }

    /// `x: [rows, d_in]` → `[rows, d_out]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0.0; self.rows(x) * self.d_out];
        self.forward_into(x, &mut y);
        y
    }

    /// Adds `dL/dW` and `dL/db` into the gradient buffers and writes `dL/dx` into `dx`
    /// (overwritten).
    pub fn backward_into(
        &self,
        x: &[f32],
        dy: &[f32],
        grad_weight: &mut [f32],
        grad_bias: Option<&mut [f32]>,
        dx: &mut [f32],
    ) {
        let rows = self.rows(x);
        let (d_in, d_out) = (self.d_in, self.d_out);
        check_len("linear dy", dy.len(), rows * d_out);
        check_len("linear dx", dx.len(), rows * d_in);
        check_len("linear grad weight", grad_weight.len(), d_out * d_in);
        // dW += dyᵀ · x
        let (ldy_t, lx) = (
            Layout::row_major(rows, d_out).transposed(),
            Layout::row_major(rows, d_in),
        );
        let lgw = Layout::row_major(d_out, d_in);
        self.be.gemm(dy, ldy_t, x, lx, grad_weight, lgw, true);
        if let Some(gb) = grad_bias {
            check_len("linear grad bias", gb.len(), d_out);
            self.be.sum_rows(dy, gb);
        }
        // dx = dy · W
        let (ldy, lw) = (
            Layout::row_major(rows, d_out),
            Layout::row_major(d_out, d_in),
        );
        self.be.gemm(dy, ldy, self.weight, lw, dx, lx, false);
    }

    /// Adds `dL/dW` and `dL/db` into the gradient buffers and returns `dL/dx`.
    pub fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        grad_weight: &mut [f32],
        grad_bias: Option<&mut [f32]>,
    ) -> Vec<f32> {
        let mut dx = vec![0.0; self.rows(x) * self.d_in];
        self.backward_into(x, dy, grad_weight, grad_bias, &mut dx);
        dx
    }
}

/// Layer norm over the last dimension (`weight.len()`), biased variance like PyTorch's
/// `nn.LayerNorm`.
///
/// The `*_into` forms take a `stats` buffer of `2 · rows` (mean, 1/std per row): the forward
/// writes it and the backward reads it, so a backward that has just recomputed the forward does
/// not recompute the statistics.
#[derive(Clone, Copy, Debug)]
pub struct LayerNorm<'a> {
    pub be: &'a dyn Backend,
    pub weight: &'a [f32],
    pub bias: &'a [f32],
}

impl<'a> LayerNorm<'a> {
    pub fn new(be: &'a dyn Backend, weight: &'a [f32], bias: &'a [f32]) -> Self {
        Self { be, weight, bias }
    }

    fn rows(&self, x: &[f32]) -> usize {
        let d = self.weight.len();
        assert!(
            d > 0 && x.len().is_multiple_of(d),
            "layernorm input not a multiple of {d}"
        );
        x.len() / d
    }

    /// `y = LN(x)` (overwritten), and the row statistics into `stats` (`2 · rows`).
    pub fn forward_into(&self, x: &[f32], y: &mut [f32], stats: &mut [f32]) {
        self.be
            .layer_norm_forward(x, self.weight, self.bias, y, stats);
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let (mut y, mut stats) = (vec![0.0; x.len()], vec![0.0; 2 * self.rows(x)]);
        self.forward_into(x, &mut y, &mut stats);
        y
    }

    /// Adds the weight and bias gradients and writes `dL/dx` into `dx` (overwritten), given the
    /// `stats` that [`forward_into`](Self::forward_into) wrote for this `x`.
    pub fn backward_into(
        &self,
        x: &[f32],
        stats: &[f32],
        dy: &[f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32],
        dx: &mut [f32],
    ) {
        let w = self.weight;
        self.be
            .layer_norm_backward(x, stats, dy, w, grad_weight, grad_bias, dx);
    }

    /// Adds the weight and bias gradients and returns `dL/dx`, recomputing the statistics.
    pub fn backward(
        &self,
        x: &[f32],
        dy: &[f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32],
    ) -> Vec<f32> {
        let (mut h, mut stats) = (vec![0.0; x.len()], vec![0.0; 2 * self.rows(x)]);
        self.forward_into(x, &mut h, &mut stats);
        let mut dx = h; // reused: forward_into only ran for the statistics
        self.backward_into(x, &stats, dy, grad_weight, grad_bias, &mut dx);
        dx
    }
}
