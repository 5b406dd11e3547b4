//! `DynamicQuantizeLinear` (ONNX opset 11): `x` (f32) to `uint8` with the one scale and zero
//! point of its whole range, extended to include 0:
//! `scale = (max(x, 0) - min(x, 0)) / 255`, `zero = clamp(round(-min / scale), 0, 255)`,
//! `y = clamp(round(x / scale) + zero, 0, 255)`, rounding half to even. int8 exports quantize
//! each `MatMulInteger`'s activations with it (four per layer in SmolLM2).
//!
//! tract-onnx has the op, with this arithmetic (a division by the scale, not a multiplication
//! by its inverse, which rounds some values to the other integer; NaN ignored by the range,
//! quantized to 0): this one gives the same bytes (the tests compare the two) and runs at this
//! crate's opt-level 3 in the package, whose dependencies are optimised for size. There
//! tract's took 12 ms of int8 SmolLM2's 37-token prompt, 5 with every crate at 3.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;

use super::node_label;

pub fn dynamic_quantize_linear(
    _ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    Ok((
        expand(Dql {
            label: node_label(node),
        }),
        vec![],
    ))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Dql {
    label: String,
}

impl Expansion for Dql {
    fn name(&self) -> StaticName {
        "DynamicQuantizeLinear".into()
    }

    fn nboutputs(&self) -> TractResult<usize> {
        Ok(3)
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, 1)?;
        check_output_arity(outputs, 3)?;
        s.equals(&inputs[0].datum_type, f32::datum_type())?;
        s.equals(&inputs[0].shape, &outputs[0].shape)?;
        s.equals(&outputs[0].datum_type, u8::datum_type())?;
        s.equals(&outputs[1].datum_type, f32::datum_type())?;
        s.equals(&outputs[1].rank, 0)?;
        s.equals(&outputs[2].datum_type, u8::datum_type())?;
        s.equals(&outputs[2].rank, 0)?;
        Ok(())
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let x = model.outlet_fact(inputs[0])?;
        if x.datum_type != f32::datum_type() {
            bail!("{}: x is {:?}; expected float32", self.label, x.datum_type);
        }
        model.wire_node(prefix, DqlOp, &[inputs[0]])
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DqlOp;

impl Op for DqlOp {
    fn name(&self) -> StaticName {
        "DynamicQuantizeLinear".into()
    }
    op_as_typed_op!();
}

impl TypedOp for DqlOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        Ok(tvec!(
            u8::fact(inputs[0].shape.clone()),
            f32::fact([0usize; 0]),
            u8::fact([0usize; 0])
        ))
    }
    as_op!();
}

impl EvalOp for DqlOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let x_view = inputs[0].try_as_plain_ram()?;
        let x = x_view.as_slice::<f32>()?;
        let (scale, zero) = scale_and_zero(x);
        let mut y = Tensor::zero::<u8>(inputs[0].shape())?;
        quantize(
            x,
            scale,
            zero,
            y.try_as_plain_ram_mut()?.as_slice_mut::<u8>()?,
        );
        Ok(tvec!(
            y.into_tvalue(),
            tensor0(scale).into_tvalue(),
            tensor0(zero).into_tvalue()
        ))
    }
}

/// The scale and zero point of `x`'s range extended to include 0 (NaN ignored).
fn scale_and_zero(x: &[f32]) -> (f32, u8) {
    // Eight independent minima and maxima (a select each, which LLVM vectorizes), combined at
    // the end: the same extremes as one pass, since min and max do not depend on the order.
    let mut lo = [0f32; 8];
    let mut hi = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    let (mut min, mut max) = (0f32, 0f32);
    for &v in lo.iter().chain(rest) {
        min = if v < min { v } else { min };
    }
    for &v in hi.iter().chain(rest) {
        max = if v > max { v } else { max };
    }
    let scale = (max - min) / 255.0;
    // All zeros: 0 / 0 is NaN, which the cast turns into 0 (as tract's f32::max does).
    let zero = (-min / scale).round_ties_even().clamp(0.0, 255.0) as u8;
    (scale, zero)
}

/// `y = clamp(round_half_even(x / scale) + zero, 0, 255)`; NaN (and a zero scale's 0 / 0)
/// quantizes to 0 + `zero`.
fn quantize(x: &[f32], scale: f32, zero: u8, y: &mut [u8]) {
    let zero = zero as i32;
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (((x / scale).round_ties_even() as i32) + zero).clamp(0, 255) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::testing::uniform;

    /// tract-onnx 0.23's arithmetic, one value at a time (`ops::quant`), as it is written there.
    #[allow(clippy::manual_clamp)]
    fn reference(x: &[f32]) -> (Vec<u8>, f32, u8) {
        let (min, max) = x.iter().fold((0f32, 0f32), |(lo, hi), &v| {
            if v < lo {
                (v, hi)
            } else if v > hi {
                (lo, v)
            } else {
                (lo, hi)
            }
        });
        let scale = (max - min) / 255.0;
        let zero = (-min / scale).round_ties_even().max(0.0).min(255.0) as u8;
        let y = x
            .iter()
            .map(|&v| (((v / scale).round_ties_even() as i32) + zero as i32).clamp(0, 255) as u8)
            .collect();
        (y, scale, zero)
    }

    fn run(x: &[f32]) -> (Vec<u8>, f32, u8) {
        let (scale, zero) = scale_and_zero(x);
        let mut y = vec![0u8; x.len()];
        quantize(x, scale, zero, &mut y);
        (y, scale, zero)
    }

    #[test]
    fn the_examples_of_the_onnx_operator_documentation() {
        let cases: [(&[f32], f32, u8, &[u8]); 3] = [
            (
                &[0., 2., -3., -2.5, 1.34, 0.5],
                0.019_607_844,
                153,
                &[153, 255, 0, 26, 221, 179],
            ),
            (
                &[-1., -2.1, -1.3, -2.5, -3.34, -4.],
                0.015_686_275,
                255,
                &[191, 121, 172, 96, 42, 0],
            ),
            (
                &[1., 2.1, 1.3, 2.5, 3.34, 4., 1.5, 2.6, 3.9, 4., 3., 2.345],
                0.015_686_275,
                0,
                &[64, 134, 83, 159, 213, 255, 96, 166, 249, 255, 191, 149],
            ),
        ];
        for (x, scale, zero, y) in cases {
            let got = run(x);
            assert!((got.1 - scale).abs() < 1e-8, "{x:?}: scale {}", got.1);
            assert_eq!((got.2, got.0.as_slice()), (zero, y), "{x:?}");
        }
    }

    #[test]
    fn the_same_bytes_as_tracts_arithmetic() {
        let mut next = uniform(11);
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![0.0; 19],
            vec![f32::NAN, 1.0, -2.0, f32::NAN, 0.5],
            vec![-0.0, 0.0, -0.0],
            (0..37).map(|_| next() * 3.0 + 4.0).collect(),
            (0..40).map(|_| -next().abs() * 7.0).collect(),
        ];
        for len in [1, 7, 8, 9, 576, 1537] {
            cases.push((0..len).map(|_| next() * 20.0).collect());
        }
        // Values on a rounding tie of the first case's scale: x / scale exactly k + 0.5.
        let (_, scale, _) = reference(&cases[cases.len() - 1]);
        cases.push((0..64).map(|k| (k as f32 - 31.5) * scale).collect());
        for x in &cases {
            let (want, got) = (reference(x), run(x));
            assert_eq!(got.0, want.0, "{} values", x.len());
            assert_eq!(
                got.1.to_bits(),
                want.1.to_bits(),
                "scale of {} values",
                x.len()
            );
            assert_eq!(got.2, want.2, "zero point of {} values", x.len());
        }
    }
}
