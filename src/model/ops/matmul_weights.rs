//! `MatMulWeights` (made by `model::weights` from `MatMul`s whose `B` is an initializer):
//! `Y = A @ B` with `B` a float32 or float16 initializer in one of the `Layout`s (its `layout`
//! attribute): `[K, N]`; `[N, K]` (a tied `lm_head` reading the embedding table, an f16 weight
//! `model::weights` transposed at load); `[N, K]` in panels of four rows (an f32 weight
//! `model::weights` transposed at load, `linalg::panel_index`). The weight is read where it
//! lies, never copied or packed; f16 values are converted in registers and the sums are f32.
//!
//! One row of `A` (decoding) streams the weight once: one dot product per output for `[N, K]`.
//! Several rows (a prompt) take four columns of the weight at a time (converted to f32 for f16)
//! and multiply them with every row, two rows at a time for `[N, K]` (`dot4x2`), the rows of a
//! long prompt or an encoder a block at a time (`ROW_BLOCK_BYTES`). Both layouts
//! of `[N, K]` give the same sums. Under the `threads` feature the output columns are split
//! across the threads (`parallel.rs`).

use std::ops::Range;

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::prelude::f16;
use tract_onnx::tract_hir::internal::*;

use super::linalg::{
    axpy_rows, axpy_rows_f16, dot, dot4, dot4_panel, dot4x2, dot4x2_panel, dot_panel, dot_panels,
    dot_rows4, f16_is_special, f16_panel_to_f32, f16_to_f32_slice, matvec_f16_nk, side_by_side,
    touch, STREAMS,
};
use super::{initializer_dims, matmul_output_fact, node_label, streams};

/// How `B` is stored (the `layout` attribute: 0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[K, N]`, as ONNX's `MatMul` reads it.
    Kn,
    /// `[N, K]`.
    Nk,
    /// `[N, K]` in panels of four rows (`linalg::panel_index`; K a multiple of four).
    Panels,
}

impl Layout {
    pub fn attribute(self) -> i64 {
        match self {
            Layout::Kn => 0,
            Layout::Nk => 1,
            Layout::Panels => 2,
        }
    }

    fn of_attribute(v: i64) -> Option<Layout> {
        [Layout::Kn, Layout::Nk, Layout::Panels]
            .into_iter()
            .find(|l| l.attribute() == v)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Weights {
    pub k: usize,
    pub n: usize,
    pub layout: Layout,
    pub label: String,
}

pub fn matmul_weights(
    ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    let label = node_label(node);
    let value = node.get_attr_opt::<i64>("layout")?.unwrap_or(0);
    let layout = Layout::of_attribute(value)
        .ok_or_else(|| format_err!("{label}: layout {value}; expected 0, 1 or 2"))?;
    let dims = node
        .input
        .get(1)
        .and_then(|b| initializer_dims(ctx, b))
        .ok_or_else(|| format_err!("{label}: B must be an initializer"))?;
    let (k, n) = match (dims.as_slice(), layout) {
        (&[k, n], Layout::Kn) | (&[n, k], Layout::Nk | Layout::Panels) if k > 0 && n > 0 => {
            (k as usize, n as usize)
        }
        _ => bail!("{label}: B has shape {dims:?}; expected a non-empty matrix"),
    };
    if layout == Layout::Panels && k % 4 != 0 {
        bail!("{label}: B in panels needs K a multiple of 4; K is {k}");
    }
    if node.input.len() != 2 || node.output.len() != 1 {
        bail!("{label}: expected two inputs and one output");
    }
    Ok((
        expand(Weights {
            k,
            n,
            layout,
            label,
        }),
        vec![],
    ))
}

impl Expansion for Weights {
    fn name(&self) -> StaticName {
        "MatMulWeights".into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, 2)?;
        check_output_arity(outputs, 1)?;
        s.equals(&outputs[0].datum_type, &inputs[0].datum_type)?;
        s.equals(&outputs[0].rank, &inputs[0].rank)?;
        let n = self.n.to_dim();
        s.given(&inputs[0].rank, move |s, rank| {
            let last = super::last_axis(rank, &self.label)?;
            for ax in 0..last {
                s.equals(&outputs[0].shape[ax], &inputs[0].shape[ax])?;
            }
            s.equals(&outputs[0].shape[last], n.clone())
        })
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let label = &self.label;
        let a = model.outlet_fact(inputs[0])?;
        if !a.datum_type.is_float() {
            bail!("{label}: A is {:?}; expected a float tensor", a.datum_type);
        }
        match a.shape.last().map(|d| d.to_usize()) {
            Some(Ok(k)) if k != self.k => bail!("{label}: A has {k} columns; K is {}", self.k),
            None => bail!("{label}: A is a scalar"),
            _ => {}
        }
        let b = model.outlet_fact(inputs[1])?;
        if b.datum_type != f16::datum_type() && b.datum_type != f32::datum_type() {
            bail!(
                "{label}: B is {:?}; expected float or float16",
                b.datum_type
            );
        }
        if let Some(w) = &b.konst {
            if w.len() != self.k * self.n {
                bail!(
                    "{label}: B has {} values; expected {}",
                    w.len(),
                    self.k * self.n
                );
            }
            if b.datum_type == f16::datum_type() {
                let bits = w.try_as_plain_ram()?.as_slice::<f16>()?;
                if bits.iter().any(|h| f16_is_special(h.to_bits())) {
                    bail!("{label}: B holds infinite or NaN float16 weights");
                }
            }
        }
        model.wire_node(prefix, WeightsOp(self.clone()), inputs)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WeightsOp(pub Weights);

impl Op for WeightsOp {
    fn name(&self) -> StaticName {
        "MatMulWeights".into()
    }
    op_as_typed_op!();
}

impl TypedOp for WeightsOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        Ok(tvec!(matmul_output_fact(inputs[0], self.0.n)))
    }
    as_op!();
}

impl EvalOp for WeightsOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let op = &self.0;
        let a = &inputs[0];
        let dt = a.datum_type();
        let a32 = a.cast_to::<f32>()?;
        let x = a32.try_as_plain_ram()?.as_slice::<f32>()?;
        let (k, n) = (op.k, op.n);
        if x.len() % k != 0 || inputs[1].len() != k * n {
            bail!(
                "{}: A has {} values (K={k}), B {} (expected {})",
                op.label,
                x.len(),
                inputs[1].len(),
                k * n
            );
        }
        let rows = x.len() / k;
        let mut shape: TVec<usize> = a.shape().into();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        let out = super::output_tensor(&shape, |out| product(op, x, rows, &inputs[1], out))?;
        let out = if dt == f32::datum_type() {
            out
        } else {
            out.cast_to_dt(dt)?.into_owned()
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

/// `out = x @ B` for `rows` rows of `x` (`[rows, k]`) and the op's weight `b`: the op's
/// values (the `lm_head` outside the plan computes its logits with this: `model::lm_head`).
pub fn product(
    op: &Weights,
    x: &[f32],
    rows: usize,
    b: &Tensor,
    out: &mut [f32],
) -> TractResult<()> {
    let (k, n) = (op.k, op.n);
    if x.len() != rows * k || b.len() != k * n || out.len() != rows * n {
        bail!(
            "{}: {rows} rows of A in {} values, B {} values, {} outputs (K={k}, N={n})",
            op.label,
            x.len(),
            b.len(),
            out.len()
        );
    }
    let w = weight_values(op, b)?;
    let parts = super::parallel::parts_for(rows * k * n);
    matmul(x, rows, w, k, n, op.layout, parts, out);
    Ok(())
}

/// Output `j` of one row `x` times the op's weight `b`: the value [`product`] gives it (a
/// decoding step's `lm_head` one logit at a time). Not for `[K, N]` weights, whose one-row
/// kernel sums each output in an order that depends on its neighbours.
pub fn one_output(op: &Weights, x: &[f32], b: &Tensor, j: usize) -> TractResult<f32> {
    let (k, n) = (op.k, op.n);
    if x.len() != k || j >= n || op.layout == Layout::Kn {
        bail!(
            "{}: output {j} of a row of {} values (K={k}, N={n}, {:?})",
            op.label,
            x.len(),
            op.layout
        );
    }
    let row = j * k..(j + 1) * k;
    // `matmul_nk`'s one-row kernels: a whole panel's four sums, or one dot product.
    Ok(match weight_values(op, b)? {
        W::F32(w) if op.layout == Layout::Panels && j / COLS * COLS + COLS <= n => {
            let first = j / COLS * COLS;
            dot_panel(x, &w[first * k..(first + COLS) * k])[j - first]
        }
        W::F32(w) => dot(x, &w[row]),
        W::F16(w) => {
            let mut out = [0f32];
            matvec_f16_nk(x, &w[row], &mut out);
            out[0]
        }
    })
}

/// [`one_output`] for each output `js[i]` into `out[i]`, the same values; of an f32 `[N, K]`
/// weight four rows at a time, read side by side ([`dot_rows4`]).
pub fn some_outputs(
    op: &Weights,
    x: &[f32],
    b: &Tensor,
    js: &[u32],
    out: &mut [f32],
) -> TractResult<()> {
    let (k, n) = (op.k, op.n);
    if js.len() != out.len() || x.len() != k {
        bail!(
            "{}: {} outputs asked into {} of a row of {} values (K={k}, N={n})",
            op.label,
            js.len(),
            out.len(),
            x.len()
        );
    }
    if let Some(j) = js.iter().find(|&&j| j as usize >= n) {
        bail!("{}: output {j} of {n}", op.label);
    }
    let mut done = 0;
    if let (W::F32(w), Layout::Nk) = (weight_values(op, b)?, op.layout) {
        let row = |j: u32| &w[j as usize * k..(j as usize + 1) * k];
        for (js, out) in js.chunks_exact(4).zip(out.chunks_exact_mut(4)) {
            out.copy_from_slice(&dot_rows4(
                x,
                [row(js[0]), row(js[1]), row(js[2]), row(js[3])],
            ));
        }
        done = js.len() / 4 * 4;
    }
    for (&j, out) in js[done..].iter().zip(&mut out[done..]) {
        *out = one_output(op, x, b, j as usize)?;
    }
    Ok(())
}

/// The values of the op's weight `b`.
fn weight_values<'a>(op: &Weights, b: &'a Tensor) -> TractResult<W<'a>> {
    let plain = b.try_as_plain_ram()?;
    if b.datum_type() == f16::datum_type() {
        if op.layout == Layout::Panels {
            bail!("{}: float16 weights are not stored in panels", op.label);
        }
        let w = plain.as_slice::<f16>()?;
        // SAFETY: f16 is a transparent wrapper of u16.
        Ok(W::F16(unsafe {
            std::slice::from_raw_parts(w.as_ptr() as *const u16, w.len())
        }))
    } else {
        Ok(W::F32(plain.as_slice::<f32>()?))
    }
}

/// `out = x @ w^T` for `rows` rows of `x` (`[rows, k]`) and an f32 `w` `[n, k]` in `layout`
/// (`MatMulRuntime` on a transposed `B`), the columns split as for a weight.
pub fn matmul_f32_nk(
    x: &[f32],
    rows: usize,
    w: &[f32],
    k: usize,
    n: usize,
    layout: Layout,
    out: &mut [f32],
) {
    let parts = super::parallel::parts_for(rows * k * n);
    matmul(x, rows, W::F32(w), k, n, layout, parts, out);
}

/// The weight's values: f32, or f16 bits.
#[derive(Clone, Copy)]
enum W<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl W<'_> {
    /// Values `range` as f32 into `dst`.
    fn to_f32(self, range: std::ops::Range<usize>, dst: &mut [f32]) {
        match self {
            W::F32(w) => dst.copy_from_slice(&w[range]),
            W::F16(w) => f16_to_f32_slice(&w[range], dst),
        }
    }
}

/// Columns grouped by the prompt kernel of `[n, k]` weights (`dot4`); split points fall on
/// multiples of it.
const COLS: usize = 4;

/// `out[r, j] = sum_k x[r, k] * w[.., ..]` (`w` in `layout`), the columns split in `parts`
/// ranges that run in parallel (`parallel::by_columns`); the same values for any `parts`.
#[allow(clippy::too_many_arguments)]
fn matmul(
    x: &[f32],
    rows: usize,
    w: W,
    k: usize,
    n: usize,
    layout: Layout,
    parts: usize,
    out: &mut [f32],
) {
    super::parallel::by_columns(out, rows, n, COLS, parts, |cols, block| match layout {
        Layout::Kn => matmul_kn(x, rows, w, k, n, cols, block),
        Layout::Nk => matmul_nk(x, rows, w, k, n, cols, block, false),
        Layout::Panels => matmul_nk(x, rows, w, k, n, cols, block, true),
    });
}

/// Columns `cols` of `x @ w^T`, `w` `[n, k]` (in panels of four rows when `panels`), into
/// `block` (`[rows, cols.len()]`). `cols` starts at a multiple of four, so each group of four
/// columns is a panel.
#[allow(clippy::too_many_arguments)]
fn matmul_nk(
    x: &[f32],
    rows: usize,
    w: W,
    k: usize,
    n: usize,
    cols: Range<usize>,
    block: &mut [f32],
    panels: bool,
) {
    debug_assert!(cols.start.is_multiple_of(COLS) && cols.end <= n);
    if rows == 1 {
        match w {
            W::F32(w) if panels => {
                // `STREAMS` panels a quarter of the columns apart at once (or one panel at a
                // time: `streams::count`). fp32 SmolLM2 in Node on a 2-core Xeon: 40.5-41.5 ms
                // a token, 42.4-45.2 with two, 45.2-47.5 one panel at a time (each run of
                // panels read into the cache first).
                let whole = cols.len() / COLS;
                let from = &w[cols.start * k..];
                if streams::count() == 1 {
                    panels_side_by_side::<1>(x, from, k, whole, block);
                } else {
                    panels_side_by_side::<STREAMS>(x, from, k, whole, block);
                }
                for j in cols.start + COLS * whole..cols.end {
                    block[j - cols.start] = dot(x, &w[j * k..(j + 1) * k]);
                }
            }
            W::F32(w) => {
                for (j, o) in cols.zip(block.iter_mut()) {
                    *o = dot(x, &w[j * k..(j + 1) * k]);
                }
            }
            W::F16(w) => matvec_f16_nk(x, &w[cols.start * k..cols.end * k], block),
        }
        return;
    }
    let width = cols.len();
    let mut buffer = match w {
        W::F32(_) => vec![],
        W::F16(_) => vec![0f32; COLS * k],
    };
    // The rows a block at a time, each block multiplied with every column before the next:
    // an encoder's 1500 rows (Whisper's `fc2` input is 12 MB) were otherwise read from memory
    // again for every four columns. An even count, so the rows pair as without blocks.
    let block_rows = (ROW_BLOCK_BYTES / (4 * k)).max(2) & !1;
    for r0 in (0..rows).step_by(block_rows) {
        let r1 = (r0 + block_rows).min(rows);
        columns_nk(x, w, k, &cols, r0..r1, block, width, panels, &mut buffer);
    }
}

/// The sums of the first `whole` panels of `w` (four rows of `k` each) with `x`, `S` panels a
/// `S`th of them apart at once, into `block`.
fn panels_side_by_side<const S: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    whole: usize,
    block: &mut [f32],
) {
    let panel = |p: usize| &w[COLS * p * k..COLS * (p + 1) * k];
    let (groups, rest) = side_by_side::<S>(whole);
    for ps in groups {
        let sums = dot_panels(x, ps.map(panel));
        for (p, sums) in ps.into_iter().zip(sums) {
            block[COLS * p..COLS * p + COLS].copy_from_slice(&sums);
        }
    }
    for p in rest {
        block[COLS * p..COLS * p + COLS].copy_from_slice(&dot_panel(x, panel(p)));
    }
}

/// The bytes of `A`'s rows that the prompt kernel of `[n, k]` weights multiplies with all the
/// columns before taking the next rows (within a core's L2 cache with the weights' panels).
const ROW_BLOCK_BYTES: usize = 256 << 10;

/// [`matmul_nk`] for the rows `row_range` (several), every column of `cols`.
#[allow(clippy::too_many_arguments)]
fn columns_nk(
    x: &[f32],
    w: W,
    k: usize,
    cols: &Range<usize>,
    row_range: Range<usize>,
    block: &mut [f32],
    width: usize,
    panels: bool,
    buffer: &mut [f32],
) {
    let rows = row_range.end;
    for first in cols.clone().step_by(COLS) {
        let count = COLS.min(cols.end - first);
        let range = first * k..(first + count) * k;
        if row_range.len() >= 4 {
            // Several rows read these weights: in from memory first, many lines at a time.
            match w {
                W::F32(w) => touch(&w[range.clone()]),
                W::F16(w) => touch(&w[range.clone()]),
            }
        }
        // A whole panel when `panels` (the rows past the last one lie as rows); four f16 rows
        // are widened into one where `K` allows (fp16 SmolLM2's later 37-token prompts in
        // Node: 258-263 ms against 285-302 widened as rows with LLVM's loop).
        let (four, in_panel): (&[f32], bool) = match w {
            W::F32(w) => (&w[range], panels && count == COLS),
            W::F16(w) if count == COLS && k.is_multiple_of(4) => {
                f16_panel_to_f32(&w[range], k, &mut buffer[..COLS * k]);
                (&buffer[..COLS * k], true)
            }
            W::F16(_) => {
                w.to_f32(range, &mut buffer[..count * k]);
                (&buffer[..count * k], false)
            }
        };
        let at = first - cols.start;
        let mut r = row_range.start;
        while r < rows {
            let xr = &x[r * k..(r + 1) * k];
            if count == COLS && r + 1 < rows {
                // Two rows at a time: each weight loaded once for both (`dot4x2`; four rows
                // took 20-30% longer in wasm, their sixteen accumulators spilling from the
                // sixteen SIMD registers of x86-64).
                let next = &x[(r + 1) * k..(r + 2) * k];
                let [o0, o1] = if in_panel {
                    dot4x2_panel(xr, next, four)
                } else {
                    dot4x2(xr, next, four)
                };
                block[r * width + at..r * width + at + COLS].copy_from_slice(&o0);
                block[(r + 1) * width + at..(r + 1) * width + at + COLS].copy_from_slice(&o1);
                r += 2;
                continue;
            }
            let o = &mut block[r * width + at..r * width + at + count];
            if in_panel {
                o.copy_from_slice(&dot4_panel(xr, four));
            } else if count == COLS {
                o.copy_from_slice(&dot4(xr, four));
            } else {
                for (c, o) in o.iter_mut().enumerate() {
                    *o = dot(xr, &four[c * k..(c + 1) * k]);
                }
            }
            r += 1;
        }
    }
}

/// Columns `cols` of `x @ w`, `w` `[k, n]`, added into `block` (`[rows, cols.len()]`, zeroed):
/// a panel of `w`'s rows at a time (converted to f32 for f16) added into every row.
fn matmul_kn(
    x: &[f32],
    rows: usize,
    w: W,
    k: usize,
    n: usize,
    cols: Range<usize>,
    block: &mut [f32],
) {
    let width = cols.len();
    if rows == 1 {
        match w {
            W::F32(w) => axpy_rows(x, &w[cols.start..], n, block),
            W::F16(w) => axpy_rows_f16(x, &w[cols.start..], n, block),
        }
        return;
    }
    // About 64 KiB of f32 per panel of the whole width (the panel height depends on `n`, not on
    // the split, so every column sums in the same order).
    let panel_rows = (16384 / n).clamp(4, k);
    let mut buffer = vec![0f32; panel_rows * width];
    for first in (0..k).step_by(panel_rows) {
        let count = panel_rows.min(k - first);
        let (panel, stride): (&[f32], usize) = match w {
            W::F32(w) => (&w[first * n + cols.start..], n),
            W::F16(_) => {
                for (i, dst) in buffer[..count * width].chunks_exact_mut(width).enumerate() {
                    let at = (first + i) * n + cols.start;
                    w.to_f32(at..at + width, dst);
                }
                (&buffer[..count * width], width)
            }
        };
        for r in 0..rows {
            let xr = &x[r * k + first..r * k + first + count];
            axpy_rows(xr, panel, stride, &mut block[r * width..(r + 1) * width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::linalg::f16_to_f32;
    use super::*;

    /// An `[n, k]` f32 matrix of `next()` values, the same as f16 bits, and in panels.
    fn weights(
        k: usize,
        n: usize,
        next: &mut impl FnMut() -> f32,
    ) -> (Vec<f32>, Vec<u16>, Vec<f32>) {
        let w32: Vec<f32> = (0..k * n).map(|_| next()).collect();
        let w16 = w32
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        let mut panels = vec![0f32; k * n];
        for j in 0..n {
            for i in 0..k {
                panels[super::super::linalg::panel_index(j, i, n, k)] = w32[j * k + i];
            }
        }
        (w32, w16, panels)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// A prompt of more rows than a block (`ROW_BLOCK_BYTES`) gives the bits of its pairs of
    /// rows multiplied apart: f32 weights as rows and in panels, f16 weights.
    #[test]
    fn row_blocks_give_the_values_of_the_rows_apart() {
        let mut next = super::super::testing::uniform(0x9e37_79b9_7f4a_7c15);
        let (k, n, rows) = (8192, 9, 22);
        assert!(ROW_BLOCK_BYTES / (4 * k) < rows / 2);
        let (w32, w16, panels) = weights(k, n, &mut next);
        let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
        for (w, layout) in [
            (W::F32(&w32), Layout::Nk),
            (W::F32(&panels), Layout::Panels),
            (W::F16(&w16), Layout::Nk),
        ] {
            let mut all = vec![0f32; rows * n];
            matmul(&x, rows, w, k, n, layout, 1, &mut all);
            for pair in 0..rows / 2 {
                let mut two = vec![0f32; 2 * n];
                let rows_of_pair = &x[2 * pair * k..(2 * pair + 2) * k];
                matmul(rows_of_pair, 2, w, k, n, layout, 1, &mut two);
                let of_pair = &all[2 * pair * n..(2 * pair + 2) * n];
                assert_eq!(bits(&two), bits(of_pair), "{layout:?} rows {}", 2 * pair);
            }
        }
    }

    /// A decoding step's panels read one at a time or four side by side (`streams`) give the
    /// same bits, with panels left over after the groups of four.
    #[test]
    fn panels_one_at_a_time_or_side_by_side_give_the_same_sums() {
        let mut next = super::super::testing::uniform(0x6a09_e667_f3bc_c908);
        let (k, n) = (72, 4 * 23);
        let (_, _, panels) = weights(k, n, &mut next);
        let x: Vec<f32> = (0..k).map(|_| next()).collect();
        let mut one = vec![0f32; n];
        panels_side_by_side::<1>(&x, &panels, k, n / COLS, &mut one);
        let mut four = vec![0f32; n];
        panels_side_by_side::<STREAMS>(&x, &panels, k, n / COLS, &mut four);
        assert_eq!(bits(&one), bits(&four));
        let mut all = vec![0f32; n];
        matmul(&x, 1, W::F32(&panels), k, n, Layout::Panels, 1, &mut all);
        assert_eq!(bits(&all), bits(&four));
    }

    /// Split across 2, 3 and 5 parts (threads under the `threads` feature), the output is
    /// bit-identical to the one-part kernel: f32 and f16 weights, every layout, decode (1 row)
    /// and prompt (7 rows), N not a multiple of 4. And the panel layout of a matrix gives the
    /// same values as its rows, and a prompt with f16 weights those of their f32 values.
    #[test]
    fn column_split_is_bit_identical() {
        let mut next = super::super::testing::uniform(0x2545_f491_4f6c_dd1d);
        let (k, n) = (72, 4103);
        let (w32, w16, panels) = weights(k, n, &mut next);
        let widened: Vec<f32> = w16.iter().map(|&h| f16_to_f32(h)).collect();
        let cases = [
            (W::F32(&w32), Layout::Kn),
            (W::F32(&w32), Layout::Nk),
            (W::F32(&panels), Layout::Panels),
            (W::F16(&w16), Layout::Kn),
            (W::F16(&w16), Layout::Nk),
        ];
        for rows in [1, 7] {
            let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
            let mut by_rows = vec![0f32; rows * n];
            matmul(&x, rows, W::F32(&w32), k, n, Layout::Nk, 1, &mut by_rows);
            for (w, layout) in cases {
                let mut one = vec![0f32; rows * n];
                matmul(&x, rows, w, k, n, layout, 1, &mut one);
                assert!(one.iter().any(|v| *v != 0.0));
                if layout == Layout::Panels {
                    assert_eq!(bits(&one), bits(&by_rows), "panels, rows={rows}");
                }
                if matches!(w, W::F16(_)) && layout == Layout::Nk && rows > 1 {
                    let mut want = vec![0f32; rows * n];
                    matmul(&x, rows, W::F32(&widened), k, n, Layout::Nk, 1, &mut want);
                    assert_eq!(bits(&one), bits(&want), "f16 as f32, rows={rows}");
                }
                for parts in [2, 3, 5] {
                    let mut split = vec![0f32; rows * n];
                    matmul(&x, rows, w, k, n, layout, parts, &mut split);
                    let f16 = matches!(w, W::F16(_));
                    assert_eq!(
                        bits(&one),
                        bits(&split),
                        "f16={f16} {layout:?} rows={rows} parts={parts}"
                    );
                }
            }
        }
    }
}
