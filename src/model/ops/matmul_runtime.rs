//! `MatMulRuntime` (made by `model::weights::runtime_matmuls` from the `MatMul`s whose `B` is
//! computed in the graph: the attention products `Q K^T` and `P V`): `Y = A @ B` with numpy
//! broadcasting of the batch axes, f32. One row of `A` (a decoding step) multiplies `B` as it
//! lies (`linalg::axpy_rows`); more rows (a prompt, an encoder's frames) multiply a transposed
//! copy of `B` with the prompt kernel of `MatMulWeights`. With `trans_b = 1` (made from a
//! `MatMul` by `Transpose(K)`, the keys of `Q K^T`), `B` is given as `K`, `[.., n, k]`: one
//! dot product per output for a decoding step, the prompt kernel on a panel copy otherwise,
//! and no transposed copy of the keys in tract at every step (Whisper's decoder transposed its
//! 1500 cached encoder keys per layer per step: a quarter of a step).
//!
//! tract's matmul packs both operands of such a product at every step, then runs its 8x8
//! kernel for the one row of a decoding step: in Whisper's decoder, whose cross-attention reads
//! 1500 encoder positions per layer, packing and that kernel were 84% of a step. In its encoder
//! (1500 frames), the first token of Whisper base came 2.6 s after the call in wasm instead of
//! 3.1 s. Other forms (an operand of rank 1, not f32) are wired as tract-onnx's `MatMul`.

use tract_onnx::prelude::*;
use tract_onnx::tract_hir::internal::*;
use tract_onnx::tract_hir::ops::matmul::{compute_shapes, MatMulInference};

use super::linalg::{axpy_rows, panels_from_rows, transpose_nk, transpose_panels};
use super::matmul_weights::{self, Layout};

/// From this many rows of `A` (a prompt, an encoder), `B` is transposed for the prompt kernel;
/// fewer (a decoding step's one row) multiply `B` as it lies.
const PROMPT_ROWS: usize = 4;

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
        model.wire_node(prefix, RuntimeOp { trans_b }, inputs)
    }
}

/// `A @ B`, or `A @ B^T` when `trans_b` (`B` given as `[.., n, k]`).
#[derive(Debug, Clone, Default, Hash, PartialEq, Eq)]
pub struct RuntimeOp {
    pub trans_b: bool,
}

impl Op for RuntimeOp {
    fn name(&self) -> StaticName {
        MATMUL_RUNTIME.into()
    }
    op_as_typed_op!();
}

impl TypedOp for RuntimeOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let (_, _, _, c) = compute_shapes(
            inputs[0].shape.to_tvec(),
            inputs[1].shape.to_tvec(),
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
        let (a, b) = (&inputs[0], &inputs[1]);
        let (ashape, bshape, _, cshape) = compute_shapes(
            a.shape().into(),
            b.shape().into(),
            false,
            self.trans_b,
            false,
        )?;
        let rank = cshape.len();
        let n = bshape[rank - if self.trans_b { 2 } else { 1 }];
        let (m, k) = (ashape[rank - 2], ashape[rank - 1]);
        let mut out = vec![0f32; cshape.iter().product()];
        let x = a.try_as_plain_ram()?.as_slice::<f32>()?;
        let w = b.try_as_plain_ram()?.as_slice::<f32>()?;
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
        let (sa, sb) = (strides(&ashape, m * k), strides(&bshape, k * n));
        let batches: usize = cshape[..rank - 2].iter().product();
        let mut transposed = Vec::new();
        for (batch, c) in out
            .chunks_exact_mut((m * n).max(1))
            .enumerate()
            .take(batches)
        {
            let (mut ia, mut ib, mut rest) = (0, 0, batch);
            for ax in (0..rank - 2).rev() {
                let i = rest % cshape[ax];
                rest /= cshape[ax];
                ia += i * sa[ax];
                ib += i * sb[ax];
            }
            let wb = &w[ib..ib + k * n];
            let xb = &x[ia..ia + m * k];
            if self.trans_b {
                // B^T as it lies is `[n, k]`: the weights' kernels read it in place, through a
                // panel copy for several rows (as from `[k, n]` below).
                if m >= PROMPT_ROWS && k.is_multiple_of(4) {
                    transposed.resize(k * n, 0.0);
                    panels_from_rows(wb, k, n, &mut transposed);
                    matmul_weights::matmul_f32_nk(xb, m, &transposed, k, n, Layout::Panels, c);
                } else {
                    matmul_weights::matmul_f32_nk(xb, m, wb, k, n, Layout::Nk, c);
                }
            } else if m >= PROMPT_ROWS {
                // B transposed to [n, k] (k n copies against m k n products), in panels when K
                // allows, then the prompt kernel of the weight matmuls: two rows of A per pass
                // over four columns.
                let layout = if k.is_multiple_of(4) {
                    Layout::Panels
                } else {
                    Layout::Nk
                };
                transposed.resize(k * n, 0.0);
                match layout {
                    Layout::Panels => transpose_panels(wb, k, n, &mut transposed),
                    _ => transpose_nk(wb, k, n, &mut transposed),
                }
                matmul_weights::matmul_f32_nk(xb, m, &transposed, k, n, layout, c);
            } else {
                for (r, row) in c.chunks_exact_mut(n.max(1)).enumerate() {
                    axpy_rows(&xb[r * k..(r + 1) * k], wb, n, row);
                }
            }
        }
        Ok(tvec!(Tensor::from_shape(&cshape, &out)?.into_tvalue()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                .wire_node("ours", RuntimeOp { trans_b }, &[sa, sb])
                .unwrap();
            m.select_output_outlets(&o).unwrap();
            let ours = m
                .into_runnable()
                .unwrap()
                .run(tvec!())
                .unwrap()
                .remove(0)
                .into_tensor();
            let mut model = TypedModel::default();
            let ia = model.add_const("a", a).unwrap();
            let ib = model.add_const("b", b).unwrap();
            let out = MatMulInference::default()
                .with_b_trans(trans_b)
                .wire("mm", &mut model, &[ia, ib])
                .unwrap();
            model.select_output_outlets(&out).unwrap();
            let theirs = model
                .into_runnable()
                .unwrap()
                .run(tvec!())
                .unwrap()
                .remove(0)
                .into_tensor();
            let case = format!("{ashape:?} x {bshape:?}, trans_b {trans_b}");
            assert_eq!(ours.shape(), theirs.shape(), "{case}");
            ours.close_enough(&theirs, Approximation::Approximate)
                .unwrap_or_else(|e| panic!("{case}: {e}"));
        }
    }
}
