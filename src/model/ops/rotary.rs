//! `Rotary`: the rotary position embedding of Llama-style exports, `x * cos + rotate_half(x) *
//! sin` with `rotate_half(x) = Concat(-x[.., h..], x[.., ..h])` along the last axis of `2h`
//! values (transformers' `apply_rotary_pos_emb` and `rotate_half`), as one op ([`fuse`]).
//!
//! The exports spell it out in seven nodes for the queries and seven for the keys of every
//! layer: two `Slice`s, a `Neg`, a `Concat`, two `Mul`s and an `Add`, each with its own output
//! buffer. Fused, SmolLM2's plan runs 1,202 nodes a step besides its constants instead of
//! 1,562. Here it is one pass over `x`, with the same operations on the same values (each
//! product rounded, then their sum), so the same bits.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::array::{Slice, TypedConcat};
use tract_onnx::tract_core::ops::element_wise::ElementWiseOp;
use tract_onnx::tract_core::ops::math::Neg;

use super::binary::{Arith, BroadcastArith, Runs};

/// `x * cos + rotate_half(x) * sin` over `x`'s last axis of `2 * half` values; `cos` and `sin`
/// have one shape, which broadcasts to `x`'s with the same last axis.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rotary {
    half: usize,
}

impl Op for Rotary {
    fn name(&self) -> StaticName {
        "Rotary".into()
    }
    op_as_typed_op!();
}

impl TypedOp for Rotary {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        ensure!(inputs.len() == 3 && inputs.iter().all(|f| f.datum_type == f32::datum_type()));
        Ok(tvec!(TypedFact::dt_shape(
            f32::datum_type(),
            inputs[0].shape.clone()
        )))
    }
    as_op!();
}

impl EvalOp for Rotary {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (x, cos, sin) = args_3!(inputs);
        let (h, d) = (self.half, 2 * self.half);
        let fits = x.rank() == cos.rank()
            && cos.shape() == sin.shape()
            && x.shape().last() == Some(&d)
            && cos.shape().last() == Some(&d)
            && x.shape()
                .iter()
                .zip(cos.shape())
                .all(|(&x, &c)| c == x || c == 1);
        ensure!(
            fits,
            "Rotary: x {:?} with cos {:?} and sin {:?}; expected cos and sin of one shape that \
             broadcasts to x's, the last axis {d}",
            x.shape(),
            cos.shape(),
            sin.shape()
        );
        // Runs of whole rows of `d` values: `cos` steps through each (its last axis is `d`).
        let runs = Runs::new(x.shape(), x.shape(), cos.shape());
        let (xv, cv, sv) = (
            x.try_as_plain_ram()?,
            cos.try_as_plain_ram()?,
            sin.try_as_plain_ram()?,
        );
        let (xv, cv, sv) = (
            xv.as_slice::<f32>()?,
            cv.as_slice::<f32>()?,
            sv.as_slice::<f32>()?,
        );
        let out = super::output_tensor(x.shape(), |out: &mut [f32]| {
            runs.each(|at, _, at_cs| {
                let rows = out[at..at + runs.len].chunks_exact_mut(d);
                let xs = xv[at..at + runs.len].chunks_exact(d);
                let cs = cv[at_cs..at_cs + runs.len].chunks_exact(d);
                let ss = sv[at_cs..at_cs + runs.len].chunks_exact(d);
                for (((o, x), c), s) in rows.zip(xs).zip(cs).zip(ss) {
                    for i in 0..h {
                        o[i] = x[i] * c[i] + -x[i + h] * s[i];
                    }
                    for i in h..d {
                        o[i] = x[i] * c[i] + x[i - h] * s[i];
                    }
                }
            });
            Ok(())
        })?;
        Ok(tvec!(out.into_tvalue()))
    }
}

/// Replaces each f32 `Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h..2h)), Slice(x, 0..h)), sin))`
/// over the last axis (either operand order of each `Add` and `Mul`) whose intermediates go
/// nowhere else by [`Rotary`] on `x`, `cos` and `sin`, in place; the intermediates, read by
/// nothing, are left out of the plan. Returns how many were replaced.
pub fn fuse(model: &mut TypedModel) -> TractResult<usize> {
    let mut fused = 0;
    for id in 0..model.nodes().len() {
        let Some((x, cos, sin, half)) = rotary(model, id)? else {
            continue;
        };
        model.node_mut(id).op = Box::new(Rotary { half });
        model.add_edge(x, InletId::new(id, 0))?;
        model.add_edge(cos, InletId::new(id, 1))?;
        model.add_edge(sin, InletId::new(id, 2))?;
        fused += 1;
    }
    Ok(fused)
}

/// When node `id` is the rotary embedding as [`fuse`] takes it: `x`, `cos`, `sin` and half of
/// `x`'s last axis.
fn rotary(
    model: &TypedModel,
    id: usize,
) -> TractResult<Option<(OutletId, OutletId, OutletId, usize)>> {
    let node = model.node(id);
    if node.op_as::<BroadcastArith>() != Some(&BroadcastArith(Arith::Add)) {
        return Ok(None);
    }
    let only_reader = |outlet: OutletId| super::only_reader(model, outlet);
    let mul = |outlet: OutletId| {
        let n = model.node(outlet.node);
        (n.op_as::<BroadcastArith>() == Some(&BroadcastArith(Arith::Mul)) && only_reader(outlet))
            .then(|| [n.inputs[0], n.inputs[1]])
    };
    let [Some(a), Some(b)] = [mul(node.inputs[0]), mul(node.inputs[1])] else {
        return Ok(None);
    };
    // One product is `rotate_half(x) * sin`, the other `x * cos`.
    for (x_cos, rotated_sin) in [(a, b), (b, a)] {
        for (rotated, sin) in [
            (rotated_sin[0], rotated_sin[1]),
            (rotated_sin[1], rotated_sin[0]),
        ] {
            let Some((x, half)) = rotate_half(model, rotated)? else {
                continue;
            };
            let cos = match x_cos {
                [v, c] if v == x => c,
                [c, v] if v == x => c,
                _ => continue,
            };
            let (x_fact, cos_fact, sin_fact) = (
                model.outlet_fact(x)?,
                model.outlet_fact(cos)?,
                model.outlet_fact(sin)?,
            );
            let d = (2 * half).to_dim();
            let fits = [x_fact, cos_fact, sin_fact]
                .iter()
                .all(|f| f.datum_type == f32::datum_type() && f.rank() == x_fact.rank())
                && cos_fact.shape == sin_fact.shape
                && cos_fact.shape.last() == Some(&d)
                && x_fact
                    .shape
                    .iter()
                    .zip(cos_fact.shape.iter())
                    .all(|(x, c)| c == x || c.is_one())
                && node.outputs[0].fact.shape == x_fact.shape;
            if fits {
                return Ok(Some((x, cos, sin, half)));
            }
        }
    }
    Ok(None)
}

/// When `outlet` is `Concat(Neg(Slice(x, h..2h)), Slice(x, 0..h))` over the last axis of `x`
/// (`2h` values), its intermediates read by nothing else: `x` and `h`.
fn rotate_half(model: &TypedModel, outlet: OutletId) -> TractResult<Option<(OutletId, usize)>> {
    let only_reader = |outlet: OutletId| super::only_reader(model, outlet);
    let concat = model.node(outlet.node);
    let rank = model.outlet_fact(outlet)?.rank();
    let is_concat = concat
        .op_as::<TypedConcat>()
        .is_some_and(|c| c.axis + 1 == rank);
    let [neg, low] = concat.inputs[..] else {
        return Ok(None);
    };
    if !is_concat || !only_reader(outlet) || !only_reader(neg) || !only_reader(low) {
        return Ok(None);
    }
    let is_neg = model
        .node(neg.node)
        .op_as::<ElementWiseOp>()
        .is_some_and(|op| op.0.is::<Neg>());
    if !is_neg {
        return Ok(None);
    }
    let high = model.node(neg.node).inputs[0];
    if !only_reader(high) {
        return Ok(None);
    }
    // A slice of the last axis of `x`: its input and concrete bounds.
    let slice = |outlet: OutletId| -> Option<(OutletId, usize, usize)> {
        let n = model.node(outlet.node);
        let s = n.op_as::<Slice>()?;
        (s.axis + 1 == rank).then_some(())?;
        Some((
            n.inputs[0],
            s.start.to_usize().ok()?,
            s.end.to_usize().ok()?,
        ))
    };
    let (Some((x, h, end)), Some((x_low, 0, h_low))) = (slice(high), slice(low)) else {
        return Ok(None);
    };
    let d = model
        .outlet_fact(x)?
        .shape
        .last()
        .and_then(|d| d.to_usize().ok());
    if x != x_low || h == 0 || h != h_low || end != 2 * h || d != Some(2 * h) {
        return Ok(None);
    }
    Ok(Some((x, h)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::tract_core::ops::math::neg;

    /// The seven nodes of an export, in each operand order, on `cos` and `sin` that broadcast
    /// over heads or not: fused into one `Rotary` that the plan runs in their place, with the
    /// same bits.
    #[test]
    fn fused_rotary_gives_the_same_bits() {
        let mut next = super::super::testing::uniform(0x2545_f491_4f6c_dd1d);
        for (x_shape, cs_shape, swap_add, swap_muls) in [
            ([1usize, 3, 5, 8], [1usize, 1, 5, 8], false, false),
            ([2, 2, 3, 4], [2, 1, 3, 4], true, false),
            ([1, 2, 1, 64], [1, 1, 1, 64], false, true),
            ([1, 1, 2, 6], [1, 1, 2, 6], true, true),
        ] {
            let mut tensor = |shape: &[usize]| {
                let v: Vec<f32> = (0..shape.iter().product()).map(|_| 4.0 * next()).collect();
                Tensor::from_shape(shape, &v).unwrap()
            };
            let values = tvec![tensor(&x_shape), tensor(&cs_shape), tensor(&cs_shape)];
            let mut model = TypedModel::default();
            let x = model.add_source("x", f32::fact(x_shape)).unwrap();
            let cos = model.add_source("cos", f32::fact(cs_shape)).unwrap();
            let sin = model.add_source("sin", f32::fact(cs_shape)).unwrap();
            let (h, d) = (x_shape[3] / 2, x_shape[3]);
            let high = model.wire_node("high", Slice::new(3, h, d), &[x]).unwrap();
            let negated = model.wire_node("neg", neg(), &high).unwrap();
            let low = model.wire_node("low", Slice::new(3, 0, h), &[x]).unwrap();
            let rotated = model
                .wire_node("concat", TypedConcat::new(3), &[negated[0], low[0]])
                .unwrap();
            let mul = BroadcastArith(Arith::Mul);
            let ordered = |a, b| if swap_muls { [b, a] } else { [a, b] };
            let xc = model
                .wire_node("xc", mul.clone(), &ordered(x, cos))
                .unwrap();
            let rs = model
                .wire_node("rs", mul, &ordered(rotated[0], sin))
                .unwrap();
            let sum = if swap_add {
                [rs[0], xc[0]]
            } else {
                [xc[0], rs[0]]
            };
            let y = model
                .wire_node("add", BroadcastArith(Arith::Add), &sum)
                .unwrap();
            model.select_output_outlets(&y).unwrap();
            let run = |model: TypedModel| {
                let inputs = values.iter().map(|t| t.clone().into_tvalue()).collect();
                let runnable = model.into_runnable().unwrap();
                runnable.run(inputs).unwrap().remove(0).into_tensor()
            };
            let before = run(model.clone());
            assert_eq!(fuse(&mut model).unwrap(), 1);
            let order = model.eval_order().unwrap();
            assert_eq!(order.len(), 4, "x, cos, sin and the fused op");
            assert!(model.node(y[0].node).op_is::<Rotary>());
            let after = run(model);
            let case = format!("x {x_shape:?} cos {cs_shape:?} {swap_add} {swap_muls}");
            assert_eq!(before.shape(), after.shape(), "{case}");
            let (b, a) = (
                before.try_as_plain_ram().unwrap(),
                after.try_as_plain_ram().unwrap(),
            );
            let (b, a) = (b.as_slice::<f32>().unwrap(), a.as_slice::<f32>().unwrap());
            let same = b.iter().zip(a).all(|(b, a)| b.to_bits() == a.to_bits());
            assert!(same, "{case}");
        }
    }

    /// Halves that are not halves, halves turned the other way, or an intermediate read by
    /// another node: left as they are.
    #[test]
    fn leaves_other_forms_as_they_are() {
        for case in 0..3 {
            let mut model = TypedModel::default();
            let x = model.add_source("x", f32::fact([1, 2, 3, 8])).unwrap();
            let cos = model.add_source("cos", f32::fact([1, 1, 3, 8])).unwrap();
            let sin = model.add_source("sin", f32::fact([1, 1, 3, 8])).unwrap();
            let (h, d) = if case == 0 { (3, 6) } else { (4, 8) };
            let high = model.wire_node("high", Slice::new(3, h, d), &[x]).unwrap();
            let negated = model.wire_node("neg", neg(), &high).unwrap();
            let low = model.wire_node("low", Slice::new(3, 0, h), &[x]).unwrap();
            // Case 1 turns the other way: `Concat(x[.., ..h], -x[.., h..])`.
            let halves = if case == 1 {
                [low[0], negated[0]]
            } else {
                [negated[0], low[0]]
            };
            let mut rotated = model
                .wire_node("concat", TypedConcat::new(3), &halves)
                .unwrap();
            if case == 0 {
                // Padded back to the width of x, so that the rest type-checks.
                let tail = model.add_source("tail", f32::fact([1, 2, 3, 2])).unwrap();
                rotated = model
                    .wire_node("pad", TypedConcat::new(3), &[rotated[0], tail])
                    .unwrap();
            }
            let mul = BroadcastArith(Arith::Mul);
            let xc = model.wire_node("xc", mul.clone(), &[x, cos]).unwrap();
            let rs = model.wire_node("rs", mul, &[rotated[0], sin]).unwrap();
            let y = model
                .wire_node("add", BroadcastArith(Arith::Add), &[xc[0], rs[0]])
                .unwrap();
            let outputs = if case == 2 {
                vec![y[0], rs[0]]
            } else {
                vec![y[0]]
            };
            model.select_output_outlets(&outputs).unwrap();
            assert_eq!(fuse(&mut model).unwrap(), 0, "case {case}");
            assert!(
                model.node(y[0].node).op_is::<BroadcastArith>(),
                "case {case}"
            );
        }
    }
}
