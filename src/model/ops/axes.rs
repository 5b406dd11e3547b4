//! `Axes`: tract's `AxisOp` (an axis added, removed or moved, axes reshaped) in compiled plans,
//! evaluated on the input's concrete shape ([`replace`]).
//!
//! Each layer of a SmolLM2 decoding step runs several (the heads split from and merged into
//! the hidden state, the keys and values moved to their axes). tract evaluates a reshape's
//! symbolic dimensions with the step's symbols and works the new shape out in symbolic
//! arithmetic, and moves an axis by copying the tensor even where the axis moved has one
//! element: 0.4 ms of a 14 ms q4 step on a 2-core AMD EPYC (Node 20, a V8 profile). Here a
//! reshape takes its one symbolic dimension, if any, from what the input's elements leave, and
//! an axis moved across axes of one element, or of one element itself, only changes the shape:
//! the elements keep their order, so the values are the same.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;

/// Replaces each `AxisOp` by [`Axes`]; run last, as tract's passes and ours read `AxisOp`s.
/// Returns how many were replaced.
pub fn replace(model: &mut TypedModel) -> TractResult<usize> {
    let mut replaced = 0;
    for id in 0..model.nodes().len() {
        if let Some(op) = model.node(id).op_as::<AxisOp>() {
            let op = op.clone();
            model.node_mut(id).op = Box::new(Axes(op));
            replaced += 1;
        }
    }
    Ok(replaced)
}

/// An `AxisOp` evaluated on the input's concrete shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Axes(pub AxisOp);

impl Op for Axes {
    fn name(&self) -> StaticName {
        "Axes".into()
    }
    op_as_typed_op!();
}

impl TypedOp for Axes {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        self.0.output_facts(inputs)
    }
    as_op!();
}

impl EvalOp for Axes {
    op_out_of_plan!();

    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let mut t = args_1!(inputs).into_tensor();
        let done = match &self.0 {
            AxisOp::Add(ix) if *ix <= t.rank() => Some(t.insert_axis(*ix)),
            AxisOp::Rm(ix) if *ix < t.rank() && t.shape()[*ix] == 1 => Some(t.remove_axis(*ix)),
            AxisOp::Move(from, to) => moved_shape(t.shape(), *from, *to).map(|s| t.set_shape(&s)),
            AxisOp::Reshape(at, from, to) => {
                reshaped(t.shape(), *at, from.len(), to).map(|s| t.set_shape(&s))
            }
            _ => None,
        };
        match done {
            Some(result) => {
                result?;
                Ok(tvec!(t.into_tvalue()))
            }
            // Anything else as tract does it.
            None => self.0.eval(ctx, tvec!(t.into_tvalue())),
        }
    }
}

/// The shape after moving axis `from` to `to`, where that leaves the elements in their order
/// (the axis or every axis it crosses has one element); `None` otherwise.
fn moved_shape(shape: &[usize], from: usize, to: usize) -> Option<TVec<usize>> {
    if from >= shape.len() || to >= shape.len() {
        return None;
    }
    let crossed = if from < to {
        &shape[from + 1..=to]
    } else {
        &shape[to..from]
    };
    if shape[from] != 1 && crossed.iter().any(|&d| d != 1) {
        return None;
    }
    let mut moved: TVec<usize> = shape.into();
    let axis = moved.remove(from);
    moved.insert(to, axis);
    Some(moved)
}

/// The shape after replacing the `count` axes from `at` by `to`: its concrete dimensions, and
/// its one symbolic dimension (if any) what the replaced axes' elements leave; `None` where
/// `to` has more than one symbolic dimension or the elements do not fit.
fn reshaped(shape: &[usize], at: usize, count: usize, to: &[TDim]) -> Option<TVec<usize>> {
    let replaced = shape.get(at..at + count)?;
    let elements: usize = replaced.iter().product();
    let mut dims: TVec<usize> = tvec![];
    let mut unknown = None;
    for (i, d) in to.iter().enumerate() {
        match d.to_usize() {
            Ok(v) => dims.push(v),
            Err(_) if unknown.is_none() => {
                unknown = Some(i);
                dims.push(1);
            }
            Err(_) => return None,
        }
    }
    let known: usize = dims.iter().product();
    match unknown {
        Some(i) if known > 0 && elements.is_multiple_of(known) => dims[i] = elements / known,
        None if known == elements => {}
        _ => return None,
    }
    let mut out: TVec<usize> = shape[..at].into();
    out.extend(dims);
    out.extend_from_slice(&shape[at + count..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each op on each shape: the same shape and values as tract's `AxisOp`, or both refuse.
    #[test]
    fn axes_give_tracts_shapes_and_values() {
        let scope = SymbolScope::default();
        let (s_sym, p_sym) = (scope.sym("S"), scope.sym("P"));
        let (s, p) = (TDim::from(s_sym.clone()), TDim::from(p_sym.clone()));
        let cases: Vec<(AxisOp, Vec<usize>)> = vec![
            (AxisOp::Add(0), vec![2, 3]),
            (AxisOp::Add(2), vec![2, 3]),
            (AxisOp::Rm(1), vec![2, 1, 3]),
            // Moves that leave the elements in order, and ones that do not.
            (AxisOp::Move(1, 2), vec![1, 1, 9, 4]),
            (AxisOp::Move(2, 1), vec![1, 9, 1, 4]),
            (AxisOp::Move(0, 2), vec![1, 1, 1, 5]),
            (AxisOp::Move(1, 2), vec![1, 3, 9, 4]),
            (AxisOp::Move(2, 0), vec![2, 3, 4]),
            (AxisOp::Move(0, 2), vec![2, 3, 4]),
            // Reshapes: concrete, one symbolic dimension, two.
            (
                AxisOp::Reshape(2, tvec![36.into()], tvec![9.into(), 4.into()]),
                vec![1, 1, 36],
            ),
            (
                AxisOp::Reshape(1, tvec![s.clone(), 36.into()], tvec![s.clone() * 36]),
                vec![1, 3, 36],
            ),
            (
                AxisOp::Reshape(
                    1,
                    tvec![s.clone() * 36],
                    tvec![s.clone(), 9.into(), 4.into()],
                ),
                vec![1, 108],
            ),
            (
                AxisOp::Reshape(0, tvec![s.clone() * p.clone()], tvec![s.clone(), p.clone()]),
                vec![6, 2],
            ),
            (
                AxisOp::Reshape(0, tvec![6.into()], tvec![2.into(), 3.into()]),
                vec![6],
            ),
        ];
        let turn = TurnState {
            resolved_symbols: SymbolValues::default().with(&s_sym, 3).with(&p_sym, 2),
            ..Default::default()
        };
        let ctx = turn.context(SessionId::NONE, 0);
        for (op, shape) in cases {
            let len: usize = shape.iter().product();
            let values: Vec<f32> = (0..len).map(|v| v as f32).collect();
            let input = || Tensor::from_shape(&shape, &values).unwrap().into_tvalue();
            let theirs = op.eval(&ctx, tvec![input()]);
            let ours = Axes(op.clone()).eval(&ctx, tvec![input()]);
            match (theirs, ours) {
                (Ok(a), Ok(b)) => assert_eq!(a[0], b[0], "{op:?} on {shape:?}"),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("{op:?} on {shape:?}: tract {a:?}, ours {b:?}"),
            }
        }
    }
}
