//! `MatMulRuntime` (made by `model::weights::runtime_matmuls` from the `MatMul`s whose `B` is
//! computed in the graph: the attention products `Q K^T` and `P V`): `Y = A @ B` with numpy
//! broadcasting of the batch axes, f32. One row of `A` (a decoding step) multiplies `B` as it
//! lies (`linalg::axpy_rows`); more rows (a prompt, an encoder's frames) multiply a transposed
//! copy of `B` with the prompt kernel of `MatMulWeights`. With `trans_b = 1` (made from a
//! `MatMul` by `Transpose(K)`, the keys of `Q K^T`), `B` is given as `K`, `[.., n, k]`: one
//! dot product per output for a decoding step, `linalg::matmul_panels8` on a copy in panels
//! otherwise, and no transposed copy of the keys in tract at every step (Whisper's decoder
//! transposed its 1500 cached encoder keys per layer per step: a quarter of a step).
//!
//! tract's matmul packs both operands of such a product at every step, then runs its 8x8
//! kernel for the one row of a decoding step: in Whisper's decoder, whose cross-attention reads
//! 1500 encoder positions per layer, packing and that kernel were 84% of a step. In its encoder
//! (1500 frames), the first token of Whisper base came 2.6 s after the call in wasm instead of
//! 3.1 s. Other forms (an operand of rank 1, not f32) are wired as tract-onnx's `MatMul`.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::array::{MultiBroadcastTo, TypedConcat};
use tract_onnx::tract_hir::internal::*;
use tract_onnx::tract_hir::ops::matmul::{compute_shapes, MatMulInference};

use super::linalg::{
    axpy_rows, axpy_rows_with, dot4, dot4_each, matmul_panels8, panels8_from_rows, panels8_len,
    transpose_nk, transpose_panels,
};
use super::matmul_weights::{self, Layout};

/// From this many rows of `A` (a prompt, an encoder), `B` is transposed for the prompt kernel;
/// fewer (a decoding step's one row) multiply `B` as it lies.
pub(super) const PROMPT_ROWS: usize = 4;

/// The op type of the rewritten `MatMul`s (registered in `ops/mod.rs`).
pub const MATMUL_RUNTIME: &str = "MatMulRuntime";

pub fn matmul_runtime(
    _ctx: &tract_onnx::model::ParsingContext,
    node: &tract_onnx::pb::NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    if node.input.len() != 2 || node.output.len() != 1 {
        bail!(
            "{}: expected two inputs and one output",
            super::node_label(node)
        );
    }
    let trans_b = node.get_attr_opt::<i64>("trans_b")?.unwrap_or(0) != 0;
    Ok((
        expand(Runtime(MatMulInference::default().with_b_trans(trans_b))),
        vec![],
    ))
}

/// The expansion: tract's `MatMul` rules (and its op, for the forms not taken here).
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq)]
pub struct Runtime(MatMulInference);

impl Expansion for Runtime {
    fn name(&self) -> StaticName {
        MATMUL_RUNTIME.into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        self.0.rules(s, inputs, outputs)
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let (a, b) = (model.outlet_fact(inputs[0])?, model.outlet_fact(inputs[1])?);
        let f32s = a.datum_type == f32::datum_type() && b.datum_type == f32::datum_type();
        if !f32s || a.rank() < 2 || b.rank() < 2 {
            return self.0.wire(prefix, model, inputs);
        }
        let trans_b = self.0.b_trans;
        model.wire_node(
            prefix,
            RuntimeOp {
                trans_b,
                group: 1,
                split_b: false,
            },
            inputs,
        )
    }
}

/// `A @ B`, or `A @ B^T` when `trans_b` (`B` given as `[.., n, k]`). With `group` above one,
/// `B`'s third axis from the end (its heads) has `group` times fewer entries than `A`'s, and
/// head `h` of `A` multiplies head `h / group` of `B` (grouped-query attention, `grouped_kv`).
/// With `split_b`, `B` comes as two inputs, a cache's past positions and a step's new ones,
/// and is their concatenation along its second axis from the end (`past_where_it_lies`).
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct RuntimeOp {
    pub trans_b: bool,
    pub group: usize,
    pub split_b: bool,
}

impl RuntimeOp {
    /// `B`'s shape as the product sees it (`b`: the shapes of its parts): the parts
    /// concatenated, its heads repeated `group` times.
    fn b_shape<D: DimLike>(&self, b: &[TVec<D>]) -> TVec<D> {
        let mut shape = b[0].clone();
        let r = shape.len();
        for part in &b[1..] {
            shape[r - 2] = shape[r - 2].clone() + part[r - 2].clone();
        }
        if self.group > 1 {
            shape[r - 3] = shape[r - 3].clone() * self.group;
        }
        shape
    }
}

impl Op for RuntimeOp {
    fn name(&self) -> StaticName {
        MATMUL_RUNTIME.into()
    }
    op_as_typed_op!();
}

impl TypedOp for RuntimeOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let b: TVec<TVec<TDim>> = inputs[1..].iter().map(|f| f.shape.to_tvec()).collect();
        let (_, _, _, c) = compute_shapes(
            inputs[0].shape.to_tvec(),
            self.b_shape(&b),
            false,
            self.trans_b,
            false,
        )?;
        Ok(tvec!(f32::fact(c)))
    }
    as_op!();
}

impl EvalOp for RuntimeOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let a = &inputs[0];
        let rows = if a.rank() >= 2 {
            a.shape()[a.rank() - 2]
        } else {
            1
        };
        let joined;
        let parts: &[TValue] = if self.split_b && rows != 1 {
            // Several rows (a prompt) multiply a copy of B anyway: the parts joined first.
            let axis = inputs[1].rank().saturating_sub(2);
            joined = [Tensor::stack_tensors(axis, &inputs[1..])?.into_tvalue()];
            &joined
        } else {
            &inputs[1..]
        };
        let shapes: TVec<TVec<usize>> = parts.iter().map(|t| t.shape().into()).collect();
        let (ashape, bshape, _, cshape) = compute_shapes(
            a.shape().into(),
            self.b_shape(&shapes),
            false,
            self.trans_b,
            false,
        )?;
        let rank = cshape.len();
        let n = bshape[rank - if self.trans_b { 2 } else { 1 }];
        let (m, k) = (ashape[rank - 2], ashape[rank - 1]);
        let x = a.try_as_plain_ram()?.as_slice::<f32>()?;
        // Element strides of each batch axis in A and B (0 where the axis is broadcast).
        let strides = |shape: &[usize], matrix: usize| {
            let mut s = vec![0usize; rank - 2];
            let mut at = matrix;
            for ax in (0..rank - 2).rev() {
                if shape[ax] != 1 {
                    s[ax] = at;
                }
                at *= shape[ax];
            }
            s
        };
        // Grouped heads: `bshape` counts B's heads `group` times; B's strides come from the
        // shape it has, and `i / group` below picks the head of B.
        let head = (self.group > 1).then(|| rank - 3);
        let sa = strides(&ashape, m * k);
        // Per part of B: its values, its positions (second axis from the end), its strides.
        let parts = parts
            .iter()
            .map(|t| {
                let mut lies = bshape.clone();
                lies[rank - 2] = t.shape()[t.rank() - 2];
                if let Some(h) = head {
                    lies[h] /= self.group;
                }
                let matrix = lies[rank - 2] * lies[rank - 1];
                let values = t.try_as_plain_ram()?.as_slice::<f32>()?;
                Ok((values, lies[rank - 2], strides(&lies, matrix)))
            })
            .collect::<TractResult<Vec<_>>>()?;
        let batches: usize = cshape[..rank - 2].iter().product();
        let mut transposed = Vec::new();
        let out = super::output_tensor(&cshape, |out: &mut [f32]| {
            for (batch, c) in out
                .chunks_exact_mut((m * n).max(1))
                .enumerate()
                .take(batches)
            {
                let (mut ia, mut ib, mut rest) = (0, [0, 0], batch);
                for ax in (0..rank - 2).rev() {
                    let i = rest % cshape[ax];
                    rest /= cshape[ax];
                    ia += i * sa[ax];
                    let ix = if head == Some(ax) { i / self.group } else { i };
                    for (ib, (_, _, sb)) in ib.iter_mut().zip(&parts) {
                        *ib += ix * sb[ax];
                    }
                }
                let xb = &x[ia..ia + m * k];
                match parts[..] {
                    [(w, _, _)] => {
                        let b = ready(
                            self.trans_b,
                            &w[ib[0]..ib[0] + k * n],
                            m,
                            k,
                            n,
                            &mut transposed,
                        );
                        multiply(&b, xb, k, n, c);
                    }
                    // One row and B in two parts, read where they lie: with `trans_b` each
                    // output is one dot product over its part's position; otherwise the row adds
                    // up the positions of both parts in order, as `axpy_rows` over the whole.
                    [(past, p, _), (new, s, _)] if self.trans_b => {
                        let (past, new) = (&past[ib[0]..ib[0] + p * k], &new[ib[1]..ib[1] + s * k]);
                        let (cp, cs) = c.split_at_mut(p);
                        key_scores(xb, past, cp);
                        key_scores(xb, new, cs);
                    }
                    [(past, p, _), (new, s, _)] => {
                        let (past, new) = (&past[ib[0]..ib[0] + p * n], &new[ib[1]..ib[1] + s * n]);
                        let row = |j: usize| match j.checked_sub(p) {
                            None => &past[j * n..(j + 1) * n],
                            Some(j) => &new[j * n..(j + 1) * n],
                        };
                        axpy_rows_with(xb, row, c);
                    }
                    _ => bail!("MatMulRuntime: B in {} parts", parts.len()),
                }
            }
            Ok(())
        })?;
        Ok(tvec!(out.into_tvalue()))
    }
}

/// One batch's `B` made ready for [`multiply`] by [`ready`].
pub(super) enum Ready<'a> {
    /// `[n, k]` (a `B` given transposed, as it lies), for the weights' kernels.
    Nk(&'a [f32]),
    /// A copy `[n, k]` in `Layout`, for the prompt kernel of the weight matmuls.
    Copy(&'a [f32], Layout),
    /// `[k, n]` as it lies: each row of `A` adds up rows of `B`.
    Rows(&'a [f32]),
    /// A `B` given transposed (`[n, k]`) as `[k, n]` in panels of eight columns, for
    /// `linalg::matmul_panels8`.
    Panels8(&'a [f32]),
}

/// `wb`, one batch's `B` (`[k, n]`, or `[n, k]` when `trans_b`), ready to multiply `m` rows of
/// `A`: from `PROMPT_ROWS` rows copied (into `transposed`), fewer (a decoding step's one row)
/// read where it lies.
pub(super) fn ready<'a>(
    trans_b: bool,
    wb: &'a [f32],
    m: usize,
    k: usize,
    n: usize,
    transposed: &'a mut Vec<f32>,
) -> Ready<'a> {
    if trans_b {
        if m >= PROMPT_ROWS {
            // The keys of `Q K^T` in panels of eight, for `linalg::matmul_panels8`.
            transposed.resize(panels8_len(k, n), 0.0);
            panels8_from_rows(wb, k, n, transposed);
            Ready::Panels8(transposed)
        } else {
            Ready::Nk(wb)
        }
    } else if m >= PROMPT_ROWS {
        // B transposed to [n, k] (k n copies against m k n products), in panels when K allows,
        // then the prompt kernel of the weight matmuls: two rows of A per pass over four
        // columns. (`matmul_panels8` on panels of B adds in another order: the int8 SmolLM2
        // file, whose `DynamicQuantizeLinear` rounds a whole prompt with one scale, then
        // answered its question otherwise.)
        transposed.resize(k * n, 0.0);
        if k.is_multiple_of(4) {
            transpose_panels(wb, k, n, transposed);
            Ready::Copy(transposed, Layout::Panels)
        } else {
            transpose_nk(wb, k, n, transposed);
            Ready::Copy(transposed, Layout::Nk)
        }
    } else {
        Ready::Rows(wb)
    }
}

/// `c = xb @ B` for the rows of `xb` (`[rows, k]`), `B` made ready by [`ready`]. Each row's
/// sums are those of the whole when the rows are split in parts of at least `PROMPT_ROWS`
/// rows (fewer: one part, as `ready` was told), each but the last an even count (the prompt
/// kernel takes the rows in pairs from the first).
pub(super) fn multiply(b: &Ready, xb: &[f32], k: usize, n: usize, c: &mut [f32]) {
    let rows = xb.len() / k.max(1);
    match *b {
        Ready::Nk(w) if rows == 1 => key_scores(xb, &w[..k * n], c),
        Ready::Nk(w) => matmul_weights::matmul_f32_nk(xb, rows, w, k, n, Layout::Nk, c),
        Ready::Copy(w, layout) => matmul_weights::matmul_f32_nk(xb, rows, w, k, n, layout, c),
        Ready::Panels8(w) => {
            // Each output one sum in order: the same for any split of the rows or columns.
            let parts = super::parallel::parts_for(rows * k * n);
            super::parallel::by_columns(c, rows, n, 8, parts, |cols, block| {
                matmul_panels8(xb, rows, k, w, n, cols, block)
            });
        }
        Ready::Rows(w) => {
            for (r, row) in c.chunks_exact_mut(n.max(1)).enumerate() {
                axpy_rows(&xb[r * k..(r + 1) * k], w, n, row);
            }
        }
    }
}

/// [`multiply`] for the first `live` columns of `c` (`[rows, n]`) only, where `B` is in panels
/// of eight (`Ready::Panels8`: the keys of a prompt's scores): the columns up to the panel that
/// holds column `live - 1`, computed into `compact` (`[rows, w]`) and copied into `c`'s rows.
/// Each is the sum [`multiply`] would give (one sum in order). Other forms, and columns left
/// out that would save less than 16 times the copy (each is `k` products, a copied value one
/// move), compute every column. Returns `w`, how many columns were computed; the others are
/// left as they are.
pub(super) fn multiply_first(
    b: &Ready,
    xb: &[f32],
    k: usize,
    n: usize,
    live: usize,
    c: &mut [f32],
    compact: &mut Vec<f32>,
) -> usize {
    let w = live.div_ceil(8) * 8;
    let Ready::Panels8(panels) = *b else {
        multiply(b, xb, k, n, c);
        return n;
    };
    if w >= n || (n - w) * k < 16 * w {
        multiply(b, xb, k, n, c);
        return n;
    }
    let rows = xb.len() / k.max(1);
    compact.clear();
    compact.resize(rows * w, 0.0);
    // The first `w` columns are the product with the first `w / 8` panels.
    multiply(&Ready::Panels8(panels), xb, k, w, compact);
    for (row, sums) in c.chunks_exact_mut(n).zip(compact.chunks_exact(w.max(1))) {
        row[..w].copy_from_slice(sums);
    }
    w
}

/// `out[j] = x . keys[j]` for the `out.len()` rows of `keys` (`[n, x.len()]`, a decoding
/// step's keys where they lie): four keys a pass over `x` (`dot4`: each value of `x` loaded
/// once for four keys, four independent sums), the last `n % 4` as the last lanes of the four
/// keys that end the range, or copied into four rows where it has fewer. Each key's sum is
/// computed alone, in the same order wherever it lies, so the keys in one part and in two
/// (`past_where_it_lies`) give the same bits.
fn key_scores(x: &[f32], keys: &[f32], out: &mut [f32]) {
    let k = x.len();
    let parts = super::parallel::parts_for(k * out.len());
    super::parallel::by_columns(out, 1, out.len(), 4, parts, |cols, block| {
        let whole = block.len() / 4 * 4;
        dot4_each(x, &keys[cols.start * k..], &mut block[..whole]);
        for (at, o) in (cols.start + whole..cols.end)
            .step_by(4)
            .zip(block[whole..].chunks_mut(4))
        {
            let rows = &keys[at * k..(at + o.len()) * k];
            if cols.end >= 4 {
                // The last rows of the range, as the last lanes of the four rows that end it
                // (each lane's sum is its own row's): no padded copy at every step.
                let last4 = &keys[(cols.end - 4) * k..cols.end * k];
                o.copy_from_slice(&dot4(x, last4)[4 - o.len()..]);
            } else {
                // Fewer than four keys (the step's own key): copied to the front of four rows
                // kept for it (what the other rows hold reaches no lane that is read).
                FEW_KEYS.with_borrow_mut(|four| {
                    four.resize(4 * k, 0.0);
                    four[..rows.len()].copy_from_slice(rows);
                    o.copy_from_slice(&dot4(x, four)[..o.len()]);
                });
            }
        }
    });
}

thread_local! {
    /// Four rows of keys for [`key_scores`]' ranges of fewer than four (each decoding step's
    /// own key, once a head and layer).
    static FEW_KEYS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Grouped-query attention without repeated keys and values: a `MatMulRuntime` whose `B` is
/// `Reshape(MultiBroadcastTo(AddAxis(x)))`, `x` `[.., kv_heads, L, d]` repeated `rep` times
/// along a new axis and merged into `kv_heads * rep` heads (transformers' `repeat_kv`, as
/// optimum exports it), reads `x` itself with `group = rep`: head `h` of `A` multiplies head
/// `h / rep` of `x` where it lies. The same products, and no copies of the whole cache per
/// layer at every step (in SmolLM2 60 `MultiBroadcastTo`s, each three copies of a layer's keys
/// or values, and the copying `AddAxis` and `Reshape` around them). Returns how many products
/// were rewired; the repeats, read by nothing, are left out of the plan.
pub fn grouped_kv(model: &mut TypedModel) -> TractResult<usize> {
    let mut rewired = 0;
    for id in 0..model.nodes().len() {
        let Some(op) = model.node(id).op_as::<RuntimeOp>().cloned() else {
            continue;
        };
        let (a, b) = (model.node(id).inputs[0], model.node(id).inputs[1]);
        if op.group != 1 {
            continue;
        }
        let Some((x, rep)) = repeated_heads(model, a, b)? else {
            continue;
        };
        // The same output: the product reads `x` in place of the repeats, with its group.
        // (In place rather than through a `ModelPatch`, whose code weighed 19 KB of the
        // gzipped package.)
        model.node_mut(id).op = Box::new(RuntimeOp { group: rep, ..op });
        model.add_edge(x, InletId::new(id, 1))?;
        rewired += 1;
    }
    Ok(rewired)
}

/// The KV cache read where it lies: an output of the graph that is `Concat(past, new)` along
/// the positions axis (the second from the end), `past` one of `pasts` (the cache buffers the
/// engine hands to the graph), and whose only readers in the plan are attention products
/// (`MatMulRuntime`'s `B`), becomes `new` alone, and the products read `past` and `new` as
/// two parts (`split_b`). The exported graphs copy every layer's keys and values into a new
/// tensor at each step only to attend to it and hand it back, and the engine then copies the
/// new positions into its buffer; at 1024 cached positions the copies wrote 47 MB a step
/// in SmolLM2. Returns, per output of the graph, whether it now holds the new positions only.
pub fn past_where_it_lies(model: &mut TypedModel, pasts: &[OutletId]) -> TractResult<Vec<bool>> {
    let live: std::collections::HashSet<usize> = model.eval_order()?.into_iter().collect();
    let mut new_only = vec![false; model.outputs.len()];
    for (ix, is_new_only) in new_only.iter_mut().enumerate() {
        let outlet = model.outputs[ix];
        let node = model.node(outlet.node);
        let Some(concat) = node.op_as::<TypedConcat>() else {
            continue;
        };
        let rank = model.outlet_fact(outlet)?.rank();
        let [past, new] = node.inputs[..] else {
            continue;
        };
        if rank < 3 || concat.axis != rank - 2 || !pasts.contains(&past) {
            continue;
        }
        let readers: Vec<InletId> = model
            .outlet_successors(outlet)
            .iter()
            .filter(|i| live.contains(&i.node))
            .copied()
            .collect();
        let products: Vec<(usize, RuntimeOp)> = readers
            .iter()
            .filter(|i| i.slot == 1)
            .filter_map(|i| Some((i.node, model.node(i.node).op_as::<RuntimeOp>()?.clone())))
            .filter(|(_, op)| !op.split_b)
            .collect();
        if products.is_empty() || products.len() != readers.len() || model.outputs.contains(&new) {
            continue;
        }
        for (id, op) in products {
            model.node_mut(id).op = Box::new(RuntimeOp {
                split_b: true,
                ..op
            });
            model.add_edge(past, InletId::new(id, 1))?;
            model.add_edge(new, InletId::new(id, 2))?;
        }
        model.outputs[ix] = new;
        *is_new_only = true;
    }
    Ok(new_only)
}

/// When `b` is `x` `[.., kv_heads, L, d]` with a new axis before `L`, broadcast along it to
/// `rep` and reshaped to `[.., kv_heads * rep, L, d]`, and `a` has as many heads as `b` on the
/// same axis: `x` and `rep`.
fn repeated_heads(
    model: &TypedModel,
    a: OutletId,
    b: OutletId,
) -> TractResult<Option<(OutletId, usize)>> {
    let producer = |o: OutletId| model.node(o.node);
    let reshape = producer(b);
    if !matches!(reshape.op_as::<AxisOp>(), Some(AxisOp::Reshape(..))) {
        return Ok(None);
    }
    let broadcast = producer(reshape.inputs[0]);
    if broadcast.op_as::<MultiBroadcastTo>().is_none() {
        return Ok(None);
    }
    let added = broadcast.inputs[0];
    let x = match producer(added).op_as::<AxisOp>() {
        Some(AxisOp::Add(_)) => producer(added).inputs[0],
        _ => return Ok(None),
    };
    let shape =
        |o: OutletId| -> TractResult<TVec<TDim>> { Ok(model.outlet_fact(o)?.shape.to_tvec()) };
    let (xs, bs, repeated) = (shape(x)?, shape(b)?, shape(reshape.inputs[0])?);
    let r = xs.len();
    if r < 3 || bs.len() != r || model.outlet_fact(a)?.rank() != r {
        return Ok(None);
    }
    let head = r - 3;
    // x [.., kvh, L, d] -> [.., kvh, 1, L, d] -> [.., kvh, rep, L, d] -> [.., kvh * rep, L, d]
    let (Ok(kv_heads), Ok(rep)) = (xs[head].to_usize(), repeated[head + 1].to_usize()) else {
        return Ok(None);
    };
    let mut want_added = xs.clone();
    want_added.insert(head + 1, 1.into());
    let mut want_repeated = want_added.clone();
    want_repeated[head + 1] = rep.into();
    let mut want_b = xs.clone();
    want_b[head] = (kv_heads * rep).into();
    let fits = rep > 1
        && shape(added)? == want_added
        && repeated == want_repeated
        && bs == want_b
        && model.outlet_fact(a)?.shape[head] == want_b[head];
    Ok(fits.then_some((x, rep)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each key's score has the bits of that key alone in the first row of a padded four,
    /// for every count of keys (whole fours, their tails, fewer than four), split in parts
    /// or not.
    #[test]
    fn key_scores_are_each_keys_own() {
        let mut next = super::super::testing::uniform(0x6a09_e667_f3bc_c908);
        let k = 20;
        let x: Vec<f32> = (0..k).map(|_| next()).collect();
        for n in 1..=11 {
            let keys: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let want: Vec<u32> = keys
                .chunks_exact(k)
                .map(|key| {
                    let mut padded = vec![0f32; 4 * k];
                    padded[..k].copy_from_slice(key);
                    dot4(&x, &padded)[0].to_bits()
                })
                .collect();
            let mut out = vec![0f32; n];
            key_scores(&x, &keys, &mut out);
            assert_eq!(
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "n={n}"
            );
            for parts in [2, 3] {
                out.fill(0.0);
                super::super::parallel::by_columns(&mut out, 1, n, 4, parts, |cols, block| {
                    let keys = &keys[cols.start * k..cols.end * k];
                    key_scores(&x, keys, block);
                });
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "n={n}, {parts} parts");
            }
        }
    }

    /// Against tract's own matmul (EinSum) on the same operands: equal batch axes, broadcast
    /// ones (a batch axis of 1 on either side, a lower-rank operand), one row and several (the
    /// transposed path from `PROMPT_ROWS`, with column and row tails); each with `B` as it
    /// lies and given transposed (`trans_b`, K a multiple of four and not).
    #[test]
    fn same_products_as_tracts_matmul() {
        let mut next = super::super::testing::uniform(0x9e37_79b9_7f4a_7c15);
        let cases: [(&[usize], &[usize]); 8] = [
            (&[1, 8, 1, 64], &[1, 8, 64, 37]),
            (&[1, 2, 37, 64], &[1, 2, 64, 37]),
            (&[1, 2, 9, 6], &[1, 2, 6, 11]),
            (&[2, 9, 13], &[1, 13, 6]),
            (&[2, 3, 5, 16], &[2, 3, 16, 7]),
            (&[2, 1, 4, 6], &[1, 3, 6, 9]),
            (&[3, 4, 6], &[6, 5]),
            (&[4, 6], &[2, 6, 3]),
        ];
        for ((ashape, bshape), trans_b) in cases.iter().flat_map(|c| [(*c, false), (*c, true)]) {
            let mut bshape = bshape.to_vec();
            if trans_b {
                let r = bshape.len();
                bshape.swap(r - 2, r - 1);
            }
            let bshape = &bshape[..];
            let len = |s: &[usize]| s.iter().product::<usize>();
            let a: Vec<f32> = (0..len(ashape)).map(|_| next()).collect();
            let b: Vec<f32> = (0..len(bshape)).map(|_| next()).collect();
            let a = Tensor::from_shape(ashape, &a).unwrap();
            let b = Tensor::from_shape(bshape, &b).unwrap();
            let mut m = TypedModel::default();
            let (sa, sb) = (
                m.add_const("a", a.clone()).unwrap(),
                m.add_const("b", b.clone()).unwrap(),
            );
            let o = m
                .wire_node(
                    "ours",
                    RuntimeOp {
                        trans_b,
                        group: 1,
                        split_b: false,
                    },
                    &[sa, sb],
                )
                .unwrap();
            m.select_output_outlets(&o).unwrap();
            let ours = super::super::testing::first_output(m);
            let mut model = TypedModel::default();
            let ia = model.add_const("a", a).unwrap();
            let ib = model.add_const("b", b).unwrap();
            let out = MatMulInference::default()
                .with_b_trans(trans_b)
                .wire("mm", &mut model, &[ia, ib])
                .unwrap();
            model.select_output_outlets(&out).unwrap();
            let theirs = super::super::testing::first_output(model);
            let case = format!("{ashape:?} x {bshape:?}, trans_b {trans_b}");
            assert_eq!(ours.shape(), theirs.shape(), "{case}");
            ours.close_enough(&theirs, Approximation::Approximate)
                .unwrap_or_else(|e| panic!("{case}: {e}"));
        }
    }

    /// `past_where_it_lies` on `Concat(past, new)` (an output) read by the keys' and the
    /// values' products: the products read the two parts, the output becomes `new`, the plan
    /// runs no `Concat`, and the products' outputs are bit for bit those of the graph as it
    /// was, one row (the parts where they lie) and several (the parts joined), grouped heads
    /// and not, a batch of two. A `Concat` read by another op is left as it is.
    #[test]
    fn products_read_the_past_where_it_lies() {
        let mut next = super::super::testing::uniform(0x6a09_e667_f3bc_c908);
        for (batch, kv_heads, group, rows, past, new) in [
            (1, 3, 3, 1, 7, 1),
            (1, 2, 1, 1, 9, 1),
            (2, 1, 2, 1, 5, 2),
            (1, 3, 3, 5, 4, 5),
        ] {
            let d = 8;
            let heads = kv_heads * group;
            let mut tensor = |shape: &[usize]| {
                let v: Vec<f32> = (0..shape.iter().product()).map(|_| next()).collect();
                Tensor::from_shape(shape, &v).unwrap()
            };
            let q = tensor(&[batch, heads, rows, d]);
            let p = tensor(&[batch, heads, rows, past + new]);
            let (pk, nk) = (
                tensor(&[batch, kv_heads, past, d]),
                tensor(&[batch, kv_heads, new, d]),
            );
            let mut model = TypedModel::default();
            let fact = |t: &Tensor| f32::fact(t.shape());
            let past_key = model.add_source("past", fact(&pk)).unwrap();
            let new_key = model.add_source("new", fact(&nk)).unwrap();
            let q = model.add_const("q", q).unwrap();
            let p = model.add_const("p", p).unwrap();
            let keys = model
                .wire_node("concat", TypedConcat { axis: 2 }, &[past_key, new_key])
                .unwrap()[0];
            let op = |trans_b| RuntimeOp {
                trans_b,
                group,
                split_b: false,
            };
            let scores = model.wire_node("qk", op(true), &[q, keys]).unwrap()[0];
            // The keys serve as the values too: `[past + new, d]` is `P V`'s `B`.
            let values = model.wire_node("pv", op(false), &[p, keys]).unwrap()[0];
            model
                .select_output_outlets(&[scores, values, keys])
                .unwrap();
            let run = |model: &TypedModel| {
                let inputs = tvec!(pk.clone().into_tvalue(), nk.clone().into_tvalue());
                model.clone().into_runnable().unwrap().run(inputs).unwrap()
            };
            let before = run(&model);
            let mut other = model.clone();
            let new_only = past_where_it_lies(&mut model, &[past_key]).unwrap();
            assert_eq!(new_only, [false, false, true]);
            let order = model.eval_order().unwrap();
            assert!(order
                .iter()
                .all(|&n| model.node(n).op_as::<TypedConcat>().is_none()));
            let after = run(&model);
            let case = format!("batch {batch} kv_heads {kv_heads} group {group} rows {rows}");
            let bits = |t: &Tensor| -> Vec<u32> {
                let values = t.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap();
                values.iter().map(|v| v.to_bits()).collect()
            };
            for o in 0..2 {
                assert_eq!(before[o].shape(), after[o].shape(), "{case}");
                assert_eq!(bits(&before[o]), bits(&after[o]), "{case}");
            }
            assert_eq!(*after[2], nk, "{case}");
            // Read by an op other than the products: left as it is.
            let neg = tract_onnx::tract_core::ops::math::neg();
            let negated = other.wire_node("neg", neg, &[keys]).unwrap()[0];
            other
                .select_output_outlets(&[scores, values, keys, negated])
                .unwrap();
            let unchanged = past_where_it_lies(&mut other, &[past_key]).unwrap();
            assert_eq!(unchanged, [false; 4], "{case}");
        }
    }

    /// `grouped_kv` on a graph that repeats `x`'s heads as optimum exports `repeat_kv`
    /// (`AddAxis`, `MultiBroadcastTo`, `Reshape`) before a `MatMulRuntime`: the product is
    /// rewired to read `x` with `group = rep`, the plan runs no `MultiBroadcastTo`, and the outputs
    /// are bit for bit those of the graph as it was: keys (`trans_b`: `A` `[b, heads, S, d]`)
    /// and values (`A` `[b, heads, S, L]`), one row and several, one key head and more, a batch
    /// of two.
    #[test]
    fn grouped_heads_read_the_keys_where_they_lie() {
        let mut next = super::super::testing::uniform(0x2545_f491_4f6c_dd1d);
        for (batch, kv_heads, rep, rows, len, trans_b) in [
            (1, 3, 3, 1, 7, true),
            (1, 3, 3, 1, 7, false),
            (1, 2, 2, 6, 9, true),
            (1, 2, 2, 6, 9, false),
            (2, 1, 4, 5, 6, false),
            (2, 2, 3, 1, 5, true),
        ] {
            let (d, heads) = (8, kv_heads * rep);
            let a_last = if trans_b { d } else { len };
            let mut tensor = |shape: &[usize]| {
                let v: Vec<f32> = (0..shape.iter().product()).map(|_| next()).collect();
                Tensor::from_shape(shape, &v).unwrap()
            };
            let a = tensor(&[batch, heads, rows, a_last]);
            let x = tensor(&[batch, kv_heads, len, d]);
            let mut model = TypedModel::default();
            let a = model.add_const("a", a).unwrap();
            let x = model.add_const("x", x).unwrap();
            let added = model.wire_node("add", AxisOp::Add(2), &[x]).unwrap();
            let shape = ShapeFact::from_dims([batch, kv_heads, rep, len, d]);
            let repeated = model
                .wire_node("repeat", MultiBroadcastTo { shape }, &added)
                .unwrap();
            let merge = AxisOp::Reshape(1, tvec![kv_heads.into(), rep.into()], tvec![heads.into()]);
            let b = model.wire_node("merge", merge, &repeated).unwrap();
            let op = RuntimeOp {
                trans_b,
                group: 1,
                split_b: false,
            };
            let y = model.wire_node("mm", op, &[a, b[0]]).unwrap();
            model.select_output_outlets(&y).unwrap();
            let run = super::super::testing::first_output;
            let before = run(model.clone());
            assert_eq!(grouped_kv(&mut model).unwrap(), 1);
            // The plan runs no repeat.
            let order = model.eval_order().unwrap();
            assert!(order
                .iter()
                .all(|&n| model.node(n).op_as::<MultiBroadcastTo>().is_none()));
            let after = run(model);
            let case = format!(
                "batch {batch} kv_heads {kv_heads} rep {rep} rows {rows} trans_b {trans_b}"
            );
            assert_eq!(before.shape(), after.shape(), "{case}");
            let bits = |t: &Tensor| -> Vec<u32> {
                let values = t.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap();
                values.iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&before), bits(&after), "{case}");
        }
    }
}
