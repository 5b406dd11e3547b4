//! Attention without its score matrix: `MatMulRuntime(Q, K) -> [Add(mask)] -> Softmax ->
//! [NanTo] -> MatMulRuntime(P, V)` computed a block of query rows at a time, so that the scores
//! of one block (about 256 KiB) exist at once instead of those of every head and row. Whisper
//! base's encoder (no mask or guard) held `[8, 1500, 1500]` f32 scores per layer (72 MB), and
//! wasm memory never shrinks: after transcribing `beckett.wav` in Node, wasm memory went from
//! 463 to 414 MB and the process from 590 to 545 MB. A decoder's prompt step (SmolLM2: the
//! causal mask added, a NaN guard after the softmax, grouped heads, the cache in two parts)
//! held `[9, rows, positions]` scores per layer, up to 512 rows (74 MB at 4,000 positions), and
//! went over them four times (the product, the mask, the softmax, the guard) out of the
//! processor's caches.
//!
//! The same operations in the same order: each block goes through the products' kernels as the
//! whole would (`matmul_runtime::ready` prepares `K` and `V` once per head of the cache; every
//! block has at least `PROMPT_ROWS` rows, an even count but the last, so the kernels are those
//! of the whole, pairing the same rows), then the mask's sums (`scores + mask`, as
//! `BroadcastArith`), tract's softmax kernels over its rows, each row at the alignment it has
//! in the whole tensor (`SoftmaxRows`), and the guard: the outputs are bit for bit those of the
//! ops one after the other, natively and in wasm (`tests/support/attention.rs`). The positions
//! that no row of a block sees are left out of its products where that pays (see `by_blocks`).
//! Shapes the blocks do not cover (batch axes that broadcast, a mask that widens the scores,
//! fewer rows than `PROMPT_ROWS`: a decoding step) run the ops one after the other.

use tract_onnx::tract_core::ops::nn::{Softmax, SoftmaxKind};
use tract_onnx::tract_core::tract_linalg::element_wise::ElementWise;
use tract_onnx::tract_core::tract_linalg::reduce::{MapReduce, Reduce};
use tract_onnx::tract_core::tract_linalg::routines::{softmax_rows_f32, Func, SoftmaxRowsF32};
use tract_onnx::tract_hir::internal::*;

use super::binary::{Arith, BroadcastArith};
use super::matmul_runtime::{multiply, multiply_first, ready, RuntimeOp, PROMPT_ROWS};
use super::nan_guard::NanTo;

/// Bytes of f32 scores per block of query rows.
const BLOCK_BYTES: usize = 256 << 10;

/// The ops, fused. Inputs: `Q`; `K` (`scores`' `B`, in two parts with `scores.split_b`); `V`
/// (`values`' `B`, in two parts with `values.split_b`); then the mask when `mask`.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct AttentionOp {
    pub scores: RuntimeOp,
    /// `Add(scores, mask)` between the scores and the softmax.
    pub mask: bool,
    pub softmax: Softmax,
    /// The softmax's NaN guard (`Where(IsNaN(p), c, p)`, rows masked entirely).
    pub nan_to: Option<NanTo>,
    pub values: RuntimeOp,
}

impl AttentionOp {
    /// How many inputs `K` and `V` take.
    fn parts(&self) -> (usize, usize) {
        (
            1 + self.scores.split_b as usize,
            1 + self.values.split_b as usize,
        )
    }
}

impl Op for AttentionOp {
    fn name(&self) -> StaticName {
        "Attention".into()
    }
    op_as_typed_op!();
}

impl TypedOp for AttentionOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let (nk, nv) = self.parts();
        let mut scores = self.scores.output_facts(&inputs[..1 + nk])?.remove(0);
        if self.mask {
            scores = BroadcastArith(Arith::Add)
                .output_facts(&[&scores, inputs[1 + nk + nv]])?
                .remove(0);
        }
        let mut facts: TVec<&TypedFact> = tvec![&scores];
        facts.extend_from_slice(&inputs[1 + nk..1 + nk + nv]);
        self.values.output_facts(&facts)
    }
    as_op!();
}

impl EvalOp for AttentionOp {
    op_out_of_plan!();

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (nk, nv) = self.parts();
        ensure!(
            inputs.len() == 1 + nk + nv + self.mask as usize,
            "Attention: {} inputs",
            inputs.len()
        );
        if let Some(out) = self.by_blocks(&inputs)? {
            return Ok(tvec!(out.into_tvalue()));
        }
        let mut scores = self.scores.eval(ctx, inputs[..1 + nk].into())?;
        if self.mask {
            scores.push(inputs[1 + nk + nv].clone());
            scores = BroadcastArith(Arith::Add).eval(ctx, scores)?;
        }
        let mut p = self.softmax.eval(ctx, scores)?;
        if let Some(guard) = &self.nan_to {
            p = guard.eval(ctx, p)?;
        }
        p.extend(inputs[1 + nk..1 + nk + nv].iter().cloned());
        self.values.eval(ctx, p)
    }
}

/// One operand of the products by blocks: its values, and how many positions each part holds
/// per head (`K` `[.., heads, n, d]` or, without `trans_b`, `[.., d, n]` in one part; `V`
/// `[.., heads, n, e]`).
struct Parts<'a> {
    values: TVec<&'a [f32]>,
    positions: TVec<usize>,
    /// Values per position.
    width: usize,
}

impl<'a> Parts<'a> {
    /// `ts`, of `lead`'s batch and head axes and one width, when they are.
    fn of(ts: &'a [TValue], lead: &[usize]) -> TractResult<Option<Parts<'a>>> {
        let rank = lead.len() + 2;
        let width = ts[0].shape().get(rank - 1).copied();
        let (mut values, mut positions) = (tvec![], tvec![]);
        for t in ts {
            if t.rank() != rank
                || t.shape()[..rank - 2] != *lead
                || t.shape().get(rank - 1) != width.as_ref()
            {
                return Ok(None);
            }
            positions.push(t.shape()[rank - 2]);
            values.push(t.try_as_plain_ram()?.as_slice::<f32>()?);
        }
        Ok(width.map(|width| Parts {
            values,
            positions,
            width,
        }))
    }

    /// Head `i` (counted over the batch and head axes) as `[n, width]` rows: where it lies, or
    /// its parts joined into `joined`.
    fn head<'b>(&'b self, i: usize, joined: &'b mut Vec<f32>) -> &'b [f32] {
        let w = self.width;
        if let ([part], [n]) = (&self.values[..], &self.positions[..]) {
            return &part[i * n * w..(i + 1) * n * w];
        }
        joined.clear();
        for (part, n) in self.values.iter().zip(&self.positions) {
            joined.extend_from_slice(&part[i * n * w..(i + 1) * n * w]);
        }
        joined
    }
}

impl AttentionOp {
    /// The output a block of query rows at a time, or `None` for shapes the blocks do not
    /// cover: `Q` `[.., heads, m, d]` with `m` at least `PROMPT_ROWS`; `K` `[.., heads / group,
    /// n, d]` (`[.., d, n]` in one part unless `scores.trans_b`) and `V` `[.., heads / group,
    /// n, e]`, in parts along `n`, with `Q`'s batch axes and one group for both; a mask whose
    /// axes are 1 or the scores'.
    fn by_blocks(&self, inputs: &[TValue]) -> TractResult<Option<Tensor>> {
        let (nk, nv) = self.parts();
        let q = &inputs[0];
        let (ks, vs) = (&inputs[1..1 + nk], &inputs[1 + nk..1 + nk + nv]);
        let mask = self.mask.then(|| &inputs[1 + nk + nv]);
        let group = self.scores.group;
        let rank = q.rank();
        let f32s = inputs.iter().all(|t| t.datum_type() == f32::datum_type());
        if !f32s
            || rank < 2 + (group > 1) as usize
            || self.values.trans_b
            || self.values.group != group
            || (self.scores.split_b && !self.scores.trans_b)
        {
            return Ok(None);
        }
        let (m, d) = (q.shape()[rank - 2], q.shape()[rank - 1]);
        if m < PROMPT_ROWS {
            return Ok(None);
        }
        // The batch and head axes of `K` and `V` as `Q`'s, heads `group` times fewer.
        let mut lead: TVec<usize> = q.shape()[..rank - 2].into();
        if group > 1 {
            if !lead[rank - 3].is_multiple_of(group) {
                return Ok(None);
            }
            lead[rank - 3] /= group;
        }
        // (`K` as `[.., d, n]`, one part: `d` rows of `n` values, taken as it lies.)
        let (Some(keys), Some(values)) = (Parts::of(ks, &lead)?, Parts::of(vs, &lead)?) else {
            return Ok(None);
        };
        let n: usize = values.positions.iter().sum();
        let e = values.width;
        let (kn, kd) = if self.scores.trans_b {
            (keys.positions.iter().sum(), keys.width)
        } else {
            (keys.width, keys.positions[0])
        };
        if kd != d || kn != n || n == 0 {
            return Ok(None);
        }
        // The mask's strides over the scores' axes (0 where it broadcasts).
        let mut scores_shape: TVec<usize> = q.shape().into();
        scores_shape[rank - 1] = n;
        let mask = match mask {
            None => None,
            Some(t) => {
                let shape = t.shape();
                let fits = t.rank() == rank
                    && shape
                        .iter()
                        .zip(&scores_shape)
                        .all(|(&a, &s)| a == s || a == 1);
                if !fits {
                    return Ok(None);
                }
                let mut strides = tvec![0; rank];
                let mut at = 1;
                for ax in (0..rank).rev() {
                    if shape[ax] != 1 {
                        strides[ax] = at;
                    }
                    at *= shape[ax];
                }
                Some((t.try_as_plain_ram()?.as_slice::<f32>()?, strides))
            }
        };
        let softmax = SoftmaxRows::new()?;
        // An even count: the prompt kernels take the rows in pairs from the first, and a row
        // summed alone (the last of an odd count) adds in another order.
        let block = (BLOCK_BYTES / (4 * n)).max(PROMPT_ROWS) & !1;
        let qs = q.try_as_plain_ram()?.as_slice::<f32>()?;
        let heads: usize = q.shape()[..rank - 2].iter().product();
        let mut shape: TVec<usize> = q.shape().into();
        shape[rank - 1] = e;
        let out = super::output_tensor(&shape, |out| {
            let (mut ready_keys, mut ready_values) = (Vec::new(), Vec::new());
            let (mut joined_keys, mut joined_values) = (Vec::new(), Vec::new());
            // A block's scores, placed in it at the alignment its rows have in the whole.
            let mut buffer = vec![0f32; m.min(block + PROMPT_ROWS) * n + ALIGN];
            let (mut compact, mut short_values) = (Vec::new(), Vec::new());
            for kv in 0..heads / group {
                let kh = keys.head(kv, &mut joined_keys);
                let kb = ready(self.scores.trans_b, kh, m, d, n, &mut ready_keys);
                let vh = values.head(kv, &mut joined_values);
                let vb = ready(false, vh, m, n, e, &mut ready_values);
                for head in kv * group..(kv + 1) * group {
                    // Where the head's mask starts: its index over the batch and head axes.
                    let mask_at = mask.as_ref().map(|(_, strides)| {
                        let (mut at, mut rest) = (0, head);
                        for ax in (0..rank - 2).rev() {
                            at += rest % scores_shape[ax] * strides[ax];
                            rest /= scores_shape[ax];
                        }
                        at
                    });
                    let mut r0 = 0;
                    while r0 < m {
                        // The last block takes the rows a block of their own would have too
                        // few of.
                        let r1 = if m - r0 < block + PROMPT_ROWS {
                            m
                        } else {
                            r0 + block
                        };
                        let rows = r1 - r0;
                        let at = head * m + r0;
                        let s = aligned_as(&mut buffer, at * n, rows * n);
                        // The mask's row `r` of the block: its values, or its one value.
                        let mask_row = |r: usize| {
                            let (mask, strides) = mask.as_ref()?;
                            let from = mask_at? + (r0 + r) * strides[rank - 2];
                            Some(match strides[rank - 1] {
                                0 => &mask[from..from + 1],
                                _ => &mask[from..from + n],
                            })
                        };
                        // How many columns each row of the block sees, up to its last one.
                        let seen = |r: usize| match mask_row(r) {
                            Some(row) if row.len() == n => row
                                .iter()
                                .rposition(|&v| v != f32::NEG_INFINITY)
                                .map_or(0, |j| j + 1),
                            Some(one) if one[0] == f32::NEG_INFINITY => 0,
                            _ => n,
                        };
                        let (live, blind) = (0..rows).fold((0, false), |(live, blind), r| {
                            let seen = seen(r);
                            (live.max(seen), blind || seen == 0)
                        });
                        // The columns past `live` are -inf once masked, whatever a (finite)
                        // product: they are not computed.
                        let xq = &qs[at * d..(at + rows) * d];
                        let w = multiply_first(&kb, xq, d, n, live, s, &mut compact);
                        for (r, row) in s.chunks_exact_mut(n).enumerate() {
                            row[w..].fill(f32::NEG_INFINITY);
                            // `scores + mask`, as `BroadcastArith` adds them.
                            match mask_row(r) {
                                Some([one]) => row[..w].iter_mut().for_each(|x| *x += one),
                                Some(values) => {
                                    for (x, y) in row[..w].iter_mut().zip(values) {
                                        *x += y;
                                    }
                                }
                                None => {}
                            }
                        }
                        softmax.run(s, n)?;
                        if let Some(guard) = &self.nan_to {
                            guard.apply(s);
                        }
                        let into = &mut out[at * e..(at + rows) * e];
                        // Past `live`, P is +0 in every row seeing a column (exp underflows to
                        // 0 at -inf in tract's kernels) and in a row seeing none when the guard
                        // makes its NaNs 0. Each sum of `P V` starts at +0 and adding a zero
                        // to it changes nothing, so over the positions up to the next multiple
                        // of 4 the sums are those of the whole, where a position keeps its lane
                        // (`dot4x2`, `dot4x2_panel`) when it is below `4 * (n / 4)`; the
                        // others were a tail of zeros. (A zero times an infinite value, NaN, is
                        // left out too: the values are finite.) The values are then laid out
                        // again for those positions, which pays when it saves more than 16
                        // times its copies (a block of few rows saves little: the prompt's
                        // last steps after a long past).
                        let zeros = !blind || self.nan_to.as_ref().is_some_and(|g| g.is_zero());
                        let short = live.div_ceil(4) * 4;
                        let full = n / 4 * 4;
                        if self.mask && zeros && short == 0 {
                            // Every sum is of zeros alone: +0.
                            into.fill(0.0);
                        } else if self.mask
                            && zeros
                            && short < full
                            && (full - short) * rows > 16 * short
                        {
                            compact.clear();
                            for row in s.chunks_exact(n) {
                                compact.extend_from_slice(&row[..short]);
                            }
                            let vs = ready(false, &vh[..short * e], m, short, e, &mut short_values);
                            multiply(&vs, &compact, short, e, into);
                        } else {
                            multiply(&vb, s, n, e, into);
                        }
                        r0 = r1;
                    }
                }
            }
            Ok(())
        })?;
        Ok(Some(out))
    }
}

/// Values per alignment the block's rows keep (64 bytes: tract's tensors are aligned to its
/// vector size, at most 64 bytes, and its kernels to at most that).
const ALIGN: usize = 16;

/// `len` values of `buffer` (which has `ALIGN` more) starting at the alignment that value
/// `offset` of a tensor has: `offset` modulo `ALIGN` values past a 64-byte boundary.
fn aligned_as(buffer: &mut [f32], offset: usize, len: usize) -> &mut [f32] {
    let address = buffer.as_ptr() as usize / 4;
    let start = (offset % ALIGN + ALIGN - address % ALIGN) % ALIGN;
    &mut buffer[start..start + len]
}

/// tract's `Softmax` (f32, over the last axis, `SoftmaxKind::Softmax`) over rows of a
/// contiguous buffer, as tract-core's `Softmax::eval_t` computes those of a tensor: its rows
/// kernel when the row's length is a multiple of 4 and the host has one (wasm), else each row
/// by the max, exp-sum and scale kernels. Those round a row by its address alignment (their
/// first and last values go through a scratch buffer), which `aligned_as` keeps as in the
/// whole tensor: the same bits.
struct SoftmaxRows {
    rows: Option<SoftmaxRowsF32>,
    max: Box<dyn Reduce<f32>>,
    exp_sum: Box<dyn MapReduce<f32, f32>>,
    scale: Box<dyn ElementWise<f32, f32>>,
}

impl SoftmaxRows {
    fn new() -> TractResult<SoftmaxRows> {
        Ok(SoftmaxRows {
            rows: softmax_rows_f32(),
            max: Func::ReduceMax.reduce_f32()?,
            exp_sum: Func::Softmax2.map_reduce_f32()?,
            scale: Func::MulByScalar.ew_f32_param()?,
        })
    }

    /// The softmax of each row of `n` values of `data`, in place.
    fn run(&self, data: &mut [f32], n: usize) -> TractResult<()> {
        match self.rows {
            Some(rows) if n.is_multiple_of(4) => rows(data, n),
            _ => {
                for row in data.chunks_exact_mut(n) {
                    let max = self.max.run(row)?;
                    let sum = self.exp_sum.run_with_params(row, max)?;
                    self.scale.run_with_params(row, sum.recip())?;
                }
            }
        }
        Ok(())
    }
}

/// Fuses each `MatMulRuntime -> [Add(mask)] -> Softmax (last axis) -> [NanTo] -> MatMulRuntime`
/// whose scores, masked scores and probabilities go nowhere else into an [`AttentionOp`], in
/// place: the last product takes `Q`, `K`, `V` and the mask; the others, read by nothing, are
/// left out of the plan. Returns how many attentions were fused.
pub fn fuse(model: &mut TypedModel) -> TractResult<usize> {
    let mut fused = 0;
    for id in 0..model.nodes().len() {
        let Some((op, inputs)) = fusable(model, id)? else {
            continue;
        };
        model.node_mut(id).op = Box::new(op);
        for (slot, input) in inputs.into_iter().enumerate() {
            model.add_edge(input, InletId::new(id, slot))?;
        }
        fused += 1;
    }
    Ok(fused)
}

/// When node `id` is the `P @ V` of `P = [NanTo](Softmax([Add](Q @ K, mask)))` (f32, the
/// softmax over the last axis, no intermediate read elsewhere or an output): the fused op and
/// its inputs.
fn fusable(model: &TypedModel, id: usize) -> TractResult<Option<(AttentionOp, Vec<OutletId>)>> {
    let node = model.node(id);
    let Some(values) = node.op_as::<RuntimeOp>() else {
        return Ok(None);
    };
    let only_reader = |outlet: OutletId| super::only_reader(model, outlet);
    let producer = |outlet: OutletId| model.node(outlet.node);
    let mut p = node.inputs[0];
    let nan_to = producer(p).op_as::<NanTo>().cloned();
    if nan_to.is_some() {
        if !only_reader(p) {
            return Ok(None);
        }
        p = producer(p).inputs[0];
    }
    let Some(softmax) = producer(p).op_as::<Softmax>() else {
        return Ok(None);
    };
    let rank = model.outlet_fact(p)?.rank();
    if values.trans_b
        || !only_reader(p)
        || softmax.kind != SoftmaxKind::Softmax
        || softmax.quant_output_dt.is_some()
        || *softmax.axes != [rank - 1]
    {
        return Ok(None);
    }
    let mut s = producer(p).inputs[0];
    let mut mask = None;
    if let Some(BroadcastArith(Arith::Add)) = producer(s).op_as::<BroadcastArith>() {
        // The scores, the operand a product makes; the mask, the other.
        let [x, y] = producer(s).inputs[..] else {
            return Ok(None);
        };
        let (scores, other) = if producer(x).op_as::<RuntimeOp>().is_some() {
            (x, y)
        } else {
            (y, x)
        };
        if !only_reader(s) {
            return Ok(None);
        }
        mask = Some(other);
        s = scores;
    }
    let Some(scores) = producer(s).op_as::<RuntimeOp>() else {
        return Ok(None);
    };
    if !only_reader(s) {
        return Ok(None);
    }
    let op = AttentionOp {
        scores: scores.clone(),
        mask: mask.is_some(),
        softmax: softmax.clone(),
        nan_to,
        values: values.clone(),
    };
    let mut inputs = producer(s).inputs.to_vec();
    inputs.extend_from_slice(&node.inputs[1..]);
    inputs.extend(mask);
    Ok(Some((op, inputs)))
}

#[cfg(test)]
#[path = "../../../tests/support/attention.rs"]
mod cases;

#[cfg(test)]
mod tests {
    use super::*;

    /// Fused and not (`tests/support/attention.rs`: several blocks and one, with and without
    /// a mask, its guard, grouped heads and the cache in two parts, and the shapes the blocks
    /// leave to the ops one after the other): the same bits (as in wasm, tests/wasm_api).
    #[test]
    fn fused_attention_gives_the_same_outputs() {
        super::cases::check_fused_attention();
    }

    /// Scores read by another node, or a softmax over another axis, stay as they are.
    #[test]
    fn leaves_other_forms_as_they_are() {
        for (axis, scores_out) in [(2, true), (1, false)] {
            let mut model = TypedModel::default();
            let t = |s: &[usize]| Tensor::zero::<f32>(s).unwrap();
            let q = model.add_const("q", t(&[2, 8, 4])).unwrap();
            let k = model.add_const("k", t(&[2, 8, 4])).unwrap();
            let v = model.add_const("v", t(&[2, 8, 4])).unwrap();
            let op = RuntimeOp {
                trans_b: true,
                group: 1,
                split_b: false,
            };
            let s = model.wire_node("qk", op, &[q, k]).unwrap();
            let softmax = Softmax::new(tvec![axis], None, SoftmaxKind::Softmax);
            let p = model.wire_node("softmax", softmax, &s).unwrap();
            let op = RuntimeOp {
                trans_b: false,
                group: 1,
                split_b: false,
            };
            let y = model.wire_node("pv", op, &[p[0], v]).unwrap();
            let outputs = if scores_out {
                vec![y[0], s[0]]
            } else {
                vec![y[0]]
            };
            model.select_output_outlets(&outputs).unwrap();
            assert_eq!(
                fuse(&mut model).unwrap(),
                0,
                "axis {axis}, scores an output {scores_out}"
            );
        }
    }
}
