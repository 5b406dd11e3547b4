//! `NanTo`: `Where(IsNaN(x), c, x)` with `c` one value, which is `x` with its NaNs replaced by
//! `c`, computed in place ([`fuse`]).
//!
//! The exports of Llama-style decoders (SmolLM2, the fixtures' llama, gpt2 and Whisper
//! decoders) guard each attention's softmax so, against rows masked entirely. tract runs it as
//! `IsNan`, then `Iff` over three broadcast arrays (`ndarray::Zip`, an element at a time): in a
//! 37-token prompt of SmolLM2 in Node, 5.6-7.8 ms of `Iff` and 0.5 of `IsNan`. Here it is one
//! pass over `x`'s own buffer, with the same values.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::element_wise::ElementWiseOp;
use tract_onnx::tract_core::ops::logic::Iff;
use tract_onnx::tract_core::ops::math::IsNan;

/// `x` (f32) with each NaN replaced by the value of these bits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NanTo(u32);

impl NanTo {
    fn value(&self) -> f32 {
        f32::from_bits(self.0)
    }

    /// Whether the value is a zero (of either sign).
    pub(super) fn is_zero(&self) -> bool {
        self.value() == 0.0
    }

    /// `x`'s NaNs replaced, in place (every value written, so that the loop vectorizes).
    pub(super) fn apply(&self, x: &mut [f32]) {
        let value = self.value();
        for v in x {
            *v = if v.is_nan() { value } else { *v };
        }
    }
}

impl Op for NanTo {
    fn name(&self) -> StaticName {
        "NanTo".into()
    }
    op_as_typed_op!();
}

impl TypedOp for NanTo {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        ensure!(inputs.len() == 1 && inputs[0].datum_type == f32::datum_type());
        Ok(tvec!(TypedFact::dt_shape(
            f32::datum_type(),
            inputs[0].shape.clone()
        )))
    }
    as_op!();
}

impl EvalOp for NanTo {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let x = args_1!(inputs);
        // The softmax's own buffer when nothing else reads it (the guard is its only reader).
        let mut out = x.into_tensor();
        {
            let mut plain = out.try_as_plain_ram_mut()?;
            self.apply(plain.as_slice_mut::<f32>()?);
        }
        Ok(tvec!(out.into_tvalue()))
    }
}

/// Replaces each f32 `Iff(IsNan(x), c, x)` whose `c` is a constant of one value and whose
/// output has `x`'s shape by [`NanTo`] on `x`, in place; the `IsNan`, read by nothing else,
/// is left out of the plan. Returns how many were replaced.
pub fn fuse(model: &mut TypedModel) -> TractResult<usize> {
    let mut fused = 0;
    for id in 0..model.nodes().len() {
        let Some((x, value)) = guard(model, id)? else {
            continue;
        };
        model.add_edge(x, InletId::new(id, 0))?;
        for slot in [1, 2] {
            let from = model.node(id).inputs[slot];
            model.node_mut(from.node).outputs[from.slot]
                .successors
                .retain(|s| *s != InletId::new(id, slot));
        }
        let node = model.node_mut(id);
        node.inputs.truncate(1);
        node.op = Box::new(NanTo(value.to_bits()));
        fused += 1;
    }
    Ok(fused)
}

/// When node `id` is `Iff(IsNan(x), c, x)` as [`fuse`] takes it: `x` and `c`'s value.
fn guard(model: &TypedModel, id: usize) -> TractResult<Option<(OutletId, f32)>> {
    let node = model.node(id);
    let [cond, then, x] = node.inputs[..] else {
        return Ok(None);
    };
    if node.op_as::<Iff>().is_none() {
        return Ok(None);
    }
    let is_nan = model
        .node(cond.node)
        .op_as::<ElementWiseOp>()
        .is_some_and(|op| op.0.is::<IsNan>());
    if !is_nan || model.node(cond.node).inputs[..] != [x] {
        return Ok(None);
    }
    let x_fact = model.outlet_fact(x)?;
    if x_fact.datum_type != f32::datum_type() || node.outputs[0].fact.shape != x_fact.shape {
        return Ok(None);
    }
    let then = model.outlet_fact(then)?;
    let value = match &then.konst {
        Some(c) if c.datum_type() == f32::datum_type() && c.len() == 1 => {
            c.try_as_plain_ram()?.as_slice::<f32>()?[0]
        }
        _ => return Ok(None),
    };
    Ok(Some((x, value)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::math::is_nan;

    /// `Where(IsNaN(x), c, else)` as tract types it, `x` and `else` inputs of `shape` (`else`
    /// is `x` itself or another input).
    fn guarded(c: Tensor, shape: &[usize], else_is_x: bool) -> TypedModel {
        let mut model = TypedModel::default();
        let x = model.add_source("x", f32::fact(shape)).unwrap();
        let other = model.add_source("other", f32::fact(shape)).unwrap();
        let cond = model.wire_node("isnan", is_nan(), &[x]).unwrap()[0];
        let c = model.add_const("c", c).unwrap();
        let otherwise = if else_is_x { x } else { other };
        let out = model
            .wire_node("where", Iff, &[cond, c, otherwise])
            .unwrap();
        model.select_output_outlets(&out).unwrap();
        model
    }

    fn run(model: &TypedModel, x: &Tensor) -> Vec<u32> {
        let plan = model.clone().into_runnable().unwrap();
        let out = plan
            .run(tvec![x.clone().into_tvalue(), x.clone().into_tvalue()])
            .unwrap();
        let out = out[0].try_as_plain_ram().unwrap();
        out.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The guard becomes one `NanTo` (no `Iff` or `IsNan` left to run) and gives the values of
    /// tract's ops, bit for bit, for NaNs, infinities, zeros of both signs and other values.
    #[test]
    fn nan_guard_gives_tract_values() {
        let shape = [1, 2, 3, 4];
        let values: Vec<f32> = (0..24)
            .map(|i| match i % 5 {
                0 => f32::NAN,
                1 => -0.0,
                2 => f32::INFINITY,
                _ => i as f32 / 7.0 - 1.0,
            })
            .collect();
        let x = Tensor::from_shape(&shape, &values).unwrap();
        for c in [0f32, -1.5, f32::NEG_INFINITY] {
            let c = Tensor::from_shape(&[1, 1, 1, 1], &[c]).unwrap();
            let mut model = guarded(c.clone(), &shape, true);
            let want = run(&model, &x);
            assert_eq!(fuse(&mut model).unwrap(), 1, "{c:?}");
            let ops: Vec<String> = (model.eval_order().unwrap().iter())
                .map(|&n| model.node(n).op.name().to_string())
                .collect();
            assert!(ops.iter().any(|o| o == "NanTo"), "{ops:?}");
            assert!(!ops.iter().any(|o| o == "Iff" || o == "IsNan"), "{ops:?}");
            assert_eq!(run(&model, &x), want, "{c:?}");
        }
    }

    /// Other forms stay tract's: an else-operand other than the one tested for NaNs, a `c` of
    /// several values.
    #[test]
    fn other_wheres_are_left_alone() {
        let one = Tensor::from_shape(&[1, 1], &[0f32]).unwrap();
        let mut model = guarded(one, &[2, 3], false);
        assert_eq!(fuse(&mut model).unwrap(), 0);
        let three = Tensor::from_shape(&[1, 3], &[0f32, 1.0, 2.0]).unwrap();
        let mut model = guarded(three, &[2, 3], true);
        assert_eq!(fuse(&mut model).unwrap(), 0);
    }
}
