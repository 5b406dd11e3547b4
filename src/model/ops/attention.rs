//! Attention without its score matrix: `MatMulRuntime(Q, K) -> Softmax -> MatMulRuntime(P, V)`
//! (an encoder's self-attention as optimum exports Whisper's: no mask or scale between the
//! products and the softmax) computed a block of query rows at a time, so that the scores of
//! one block (about 256 KiB) exist at once instead of those of every head and row. Whisper
//! base's encoder held `[8, 1500, 1500]` f32 scores per layer (72 MB), and wasm memory never
//! shrinks: after transcribing `beckett.wav` in Node, wasm memory went from 463 to 414 MB and
//! the process from 590 to 545 MB (three runs each, the same text, about the same time).
//!
//! The same operations in the same order: each block goes through the products' kernels as the
//! whole would (`matmul_runtime::ready` prepares `K` and `V` once per head; every block has at
//! least `PROMPT_ROWS` rows, an even count but the last, so the kernels are those of the whole,
//! pairing the same rows), then tract's `Softmax` over its rows. In wasm, whose softmax kernel
//! reads each row from its start, the outputs are bit for bit those of the three ops
//! (`tests/wasm_api`); natively tract's x86 softmax rounds a row by its address alignment, so
//! there they agree to rounding. Shapes the blocks do not cover (batch axes that broadcast,
//! fewer rows than `PROMPT_ROWS`) run the three ops one after the other.

use tract_onnx::tract_core::ops::nn::{Softmax, SoftmaxKind};
use tract_onnx::tract_hir::internal::*;

use super::matmul_runtime::{multiply, ready, RuntimeOp, PROMPT_ROWS};

/// Bytes of f32 scores per block of query rows.
const BLOCK_BYTES: usize = 256 << 10;

/// The three ops, fused: inputs `Q`, `K` (`scores`' `B`) and `V` (`values`' `B`).
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct AttentionOp {
    pub scores: RuntimeOp,
    pub softmax: Softmax,
    pub values: RuntimeOp,
}

impl Op for AttentionOp {
    fn name(&self) -> StaticName {
        "Attention".into()
    }
    op_as_typed_op!();
}

impl TypedOp for AttentionOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let scores = self.scores.output_facts(&inputs[..2])?.remove(0);
        self.values.output_facts(&[&scores, inputs[2]])
    }
    as_op!();
}

impl EvalOp for AttentionOp {
    op_out_of_plan!();

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        if let Some(out) = self.by_blocks(ctx, q, k, v)? {
            return Ok(tvec!(out.into_tvalue()));
        }
        let scores = self.scores.eval(ctx, tvec!(q.clone(), k.clone()))?;
        let p = self.softmax.eval(ctx, scores)?.remove(0);
        self.values.eval(ctx, tvec!(p, v.clone()))
    }
}

impl AttentionOp {
    /// The output a block of query rows at a time, or `None` for shapes the blocks do not
    /// cover: `Q` `[.., m, d]`, `K` `[.., n, d]` (`[.., d, n]` unless `scores.trans_b`) and `V`
    /// `[.., n, e]` with the same batch axes, `m` at least `PROMPT_ROWS`.
    fn by_blocks(
        &self,
        ctx: &EvalContext,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> TractResult<Option<Tensor>> {
        let rank = q.rank();
        let same_batches = rank >= 2
            && k.rank() == rank
            && v.rank() == rank
            && q.shape()[..rank - 2] == k.shape()[..rank - 2]
            && q.shape()[..rank - 2] == v.shape()[..rank - 2];
        if !same_batches
            || self.values.trans_b
            || q.datum_type() != f32::datum_type()
            || k.datum_type() != f32::datum_type()
            || v.datum_type() != f32::datum_type()
        {
            return Ok(None);
        }
        let (m, d) = (q.shape()[rank - 2], q.shape()[rank - 1]);
        let (n, kd) = if self.scores.trans_b {
            (k.shape()[rank - 2], k.shape()[rank - 1])
        } else {
            (k.shape()[rank - 1], k.shape()[rank - 2])
        };
        let (vn, e) = (v.shape()[rank - 2], v.shape()[rank - 1]);
        if m < PROMPT_ROWS || kd != d || vn != n || n == 0 {
            return Ok(None);
        }
        let softmax = Softmax {
            axes: tvec![1],
            ..self.softmax.clone()
        };
        // An even count: the prompt kernels take the rows in pairs from the first, and a row
        // summed alone (the last of an odd count) adds in another order.
        let block = (BLOCK_BYTES / (4 * n)).max(PROMPT_ROWS) & !1;
        let (qs, ks, vs) = (
            q.try_as_plain_ram()?.as_slice::<f32>()?,
            k.try_as_plain_ram()?.as_slice::<f32>()?,
            v.try_as_plain_ram()?.as_slice::<f32>()?,
        );
        let batches: usize = q.shape()[..rank - 2].iter().product();
        let mut out = vec![0f32; batches * m * e];
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for b in 0..batches {
            let kb = ready(
                self.scores.trans_b,
                &ks[b * n * d..(b + 1) * n * d],
                m,
                d,
                n,
                &mut keys,
            );
            let vb = ready(false, &vs[b * n * e..(b + 1) * n * e], m, n, e, &mut values);
            let mut r0 = 0;
            while r0 < m {
                // The last block takes the rows a block of their own would have too few of.
                let r1 = if m - r0 < block + PROMPT_ROWS {
                    m
                } else {
                    r0 + block
                };
                let rows = r1 - r0;
                // The scores straight into the tensor the softmax takes (and works in).
                let mut scores = Tensor::zero::<f32>(&[rows, n])?;
                let at = b * m + r0;
                let mut into = scores.try_as_plain_ram_mut()?;
                multiply(
                    &kb,
                    &qs[at * d..(at + rows) * d],
                    d,
                    n,
                    into.as_slice_mut::<f32>()?,
                );
                let p = softmax.eval(ctx, tvec!(scores.into_tvalue()))?.remove(0);
                let p = p.try_as_plain_ram()?.as_slice::<f32>()?;
                multiply(&vb, p, n, e, &mut out[at * e..(at + rows) * e]);
                r0 = r1;
            }
        }
        let mut shape: TVec<usize> = q.shape().into();
        shape[rank - 1] = e;
        Ok(Some(Tensor::from_shape(&shape, &out)?))
    }
}

/// Fuses each `MatMulRuntime -> Softmax (last axis) -> MatMulRuntime` whose scores and
/// probabilities go nowhere else into an [`AttentionOp`], in place: the last product takes
/// `Q`, `K` and `V`; the first two, read by nothing, are left out of the plan. Returns how many
/// attentions were fused.
pub fn fuse(model: &mut TypedModel) -> TractResult<usize> {
    let mut fused = 0;
    for id in 0..model.nodes().len() {
        let Some((q, k, scores, softmax)) = fusable(model, id)? else {
            continue;
        };
        let values = model
            .node(id)
            .op_as::<RuntimeOp>()
            .cloned()
            .context("values")?;
        let v = model.node(id).inputs[1];
        model.node_mut(id).op = Box::new(AttentionOp {
            scores,
            softmax,
            values,
        });
        model.add_edge(q, InletId::new(id, 0))?;
        model.add_edge(k, InletId::new(id, 1))?;
        model.add_edge(v, InletId::new(id, 2))?;
        fused += 1;
    }
    Ok(fused)
}

/// When node `id` is the `P @ V` of `P = Softmax(Q @ K)` (f32, the last axis, neither
/// intermediate read elsewhere or an output, no grouped heads): `Q`, `K`, the scores' product
/// and the softmax.
fn fusable(
    model: &TypedModel,
    id: usize,
) -> TractResult<Option<(OutletId, OutletId, RuntimeOp, Softmax)>> {
    let node = model.node(id);
    let Some(values) = node.op_as::<RuntimeOp>() else {
        return Ok(None);
    };
    let only_reader = |outlet: OutletId| super::only_reader(model, outlet);
    let p = node.inputs[0];
    let Some(softmax) = model.node(p.node).op_as::<Softmax>() else {
        return Ok(None);
    };
    let rank = model.outlet_fact(p)?.rank();
    if values.group != 1
        || values.split_b
        || values.trans_b
        || !only_reader(p)
        || softmax.kind != SoftmaxKind::Softmax
        || softmax.quant_output_dt.is_some()
        || *softmax.axes != [rank - 1]
    {
        return Ok(None);
    }
    let s = model.node(p.node).inputs[0];
    let Some(scores) = model.node(s.node).op_as::<RuntimeOp>() else {
        return Ok(None);
    };
    if scores.group != 1 || scores.split_b || !only_reader(s) {
        return Ok(None);
    }
    let [q, k] = model.node(s.node).inputs[..] else {
        return Ok(None);
    };
    Ok(Some((q, k, scores.clone(), softmax.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fused and not, on operands whose scores span several blocks (and a last block that
    /// takes the rows short of a block), fewer rows than a block, fewer than `PROMPT_ROWS`
    /// (the ops one after the other), one batch axis and two, `K` given transposed or not:
    /// the plan runs the fused op and no softmax, and the outputs agree.
    #[test]
    fn fused_attention_gives_the_same_outputs() {
        let mut next = super::super::testing::uniform(0x5851_f42d_4c95_7f2d);
        for (batch, m, n, d, e, trans_b) in [
            (&[2usize][..], 150, 1000, 8, 12, true),
            (&[1, 2][..], 70, 300, 12, 8, false),
            (&[3][..], 9, 40, 4, 4, true),
            (&[2][..], 3, 40, 8, 8, true),
            (&[1][..], 1, 17, 8, 8, false),
        ] {
            let shape = |last2: [usize; 2]| [batch, &last2[..]].concat();
            let mut tensor = |shape: &[usize]| {
                let v: Vec<f32> = (0..shape.iter().product()).map(|_| next()).collect();
                Tensor::from_shape(shape, &v).unwrap()
            };
            let q = tensor(&shape([m, d]));
            let k = tensor(&shape(if trans_b { [n, d] } else { [d, n] }));
            let v = tensor(&shape([n, e]));
            let mut model = TypedModel::default();
            let q = model.add_const("q", q).unwrap();
            let k = model.add_const("k", k).unwrap();
            let v = model.add_const("v", v).unwrap();
            let op = RuntimeOp {
                trans_b,
                group: 1,
                split_b: false,
            };
            let s = model.wire_node("qk", op, &[q, k]).unwrap();
            let rank = batch.len() + 2;
            let softmax = Softmax::new(tvec![rank - 1], None, SoftmaxKind::Softmax);
            let p = model.wire_node("softmax", softmax, &s).unwrap();
            let op = RuntimeOp {
                trans_b: false,
                group: 1,
                split_b: false,
            };
            let y = model.wire_node("pv", op, &[p[0], v]).unwrap();
            model.select_output_outlets(&y).unwrap();
            let run = super::super::testing::first_output;
            let before = run(model.clone());
            assert_eq!(fuse(&mut model).unwrap(), 1);
            let order = model.eval_order().unwrap();
            assert!(order
                .iter()
                .all(|&n| model.node(n).op_as::<Softmax>().is_none()));
            let after = run(model);
            let case = format!("batch {batch:?} m {m} n {n} d {d} e {e} trans_b {trans_b}");
            assert_eq!(before.shape(), after.shape(), "{case}");
            // Natively tract sums each softmax row in an order that depends on the row's
            // address (its x86 kernels start at an aligned boundary), so a row of a block can
            // round otherwise than the same row of the whole; in wasm its kernel reads each
            // row from the start and the outputs are the same bits (tests/wasm_api).
            let (b, a) = (
                before
                    .try_as_plain_ram()
                    .unwrap()
                    .as_slice::<f32>()
                    .unwrap(),
                after.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap(),
            );
            for (i, (x, y)) in b.iter().zip(a).enumerate() {
                assert!((x - y).abs() <= 1e-6, "{case}: value {i}: {x} against {y}");
            }
        }
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
