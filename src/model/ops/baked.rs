//! `Baked`: an op with its constant inputs held in the op ([`bake`]), so that a plan does not
//! run a `Const` node for each of them at every step.
//!
//! tract's plan evaluates every node of its order at every step, `Const`s included: a node
//! costs its turn of the loop, the gathering of its inputs and the storing and dropping of its
//! outputs. SmolLM2's decoding plan runs 496 `Const` nodes a step beside its 1,202 others: the
//! weights, scales and zero points of its products and the weights of its norms. Baked into
//! their readers, they are handed to the op's own `eval` as they were, in their places.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::konst::Const;

use super::binary::BroadcastArith;
use super::matmul_integer::IntegerWeightsOp;
use super::matmul_nbits::NBitsOp;
use super::matmul_weights::WeightsOp;

/// `inner` with the inputs at the slots of `consts` given: the node's inputs are the others,
/// in order.
#[derive(Debug, Clone)]
pub struct Baked {
    inner: Box<dyn TypedOp>,
    /// (slot among `inner`'s inputs, value), by slot.
    consts: TVec<(usize, TValue)>,
    /// The constants' facts, in the same order: kept from the graph, as a fact made again from
    /// a tensor (`TypedFact::try_from`) scans all its values for a uniform one.
    facts: TVec<TypedFact>,
}

/// `given` with `consts` (slot, value; by slot) put in their slots.
fn merged<T>(
    given: impl IntoIterator<Item = T>,
    consts: impl IntoIterator<Item = (usize, T)>,
) -> TVec<T> {
    let (mut given, mut consts) = (given.into_iter(), consts.into_iter().peekable());
    let mut all = tvec![];
    loop {
        if let Some((_, value)) = consts.next_if(|(slot, _)| *slot == all.len()) {
            all.push(value);
        } else if let Some(value) = given.next() {
            all.push(value);
        } else {
            return all;
        }
    }
}

impl Baked {
    /// `inner`'s inputs: `inputs` with the constants in their slots.
    fn inputs(&self, inputs: TVec<TValue>) -> TVec<TValue> {
        merged(inputs, self.consts.iter().map(|(s, v)| (*s, v.clone())))
    }
}

impl PartialEq for Baked {
    fn eq(&self, other: &Baked) -> bool {
        self.inner.as_op() == other.inner.as_op() && self.consts == other.consts
    }
}

impl Eq for Baked {}

impl Op for Baked {
    fn name(&self) -> StaticName {
        self.inner.name()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        self.inner.info()
    }

    op_as_typed_op!();
}

impl TypedOp for Baked {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let slots = self.consts.iter().map(|(s, _)| *s);
        let all = merged(inputs.iter().copied(), slots.zip(self.facts.iter()));
        self.inner.output_facts(&all)
    }
    as_op!();
}

impl EvalOp for Baked {
    fn eval(&self, ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        self.inner.eval(ctx, self.inputs(inputs))
    }

    fn eval_out_of_plan(&self, inputs: TVec<TValue>) -> TractResult<Option<TVec<TValue>>> {
        self.inner.eval_out_of_plan(self.inputs(inputs))
    }
}

/// Bakes the `Const` inputs of the weight products and of the broadcast arithmetic (this
/// module's ops, stateless, reading no symbols) into [`Baked`] ops; a `Const` that nothing
/// else reads is left out of the plan. Returns how many nodes were baked.
pub fn bake(model: &mut TypedModel) -> TractResult<usize> {
    let mut baked = 0;
    for id in 0..model.nodes().len() {
        let op = &model.node(id).op;
        let ours = op.is::<IntegerWeightsOp>()
            || op.is::<NBitsOp>()
            || op.is::<WeightsOp>()
            || op.is::<BroadcastArith>();
        if !ours {
            continue;
        }
        let inputs = model.node(id).inputs.clone();
        let mut consts = tvec![];
        let mut facts = tvec![];
        let mut kept = tvec![];
        for (slot, &input) in inputs.iter().enumerate() {
            match model.node(input.node).op_as::<Const>() {
                Some(c) => {
                    consts.push((slot, c.val().clone().into_tvalue()));
                    facts.push(model.outlet_fact(input)?.clone());
                }
                None => kept.push(input),
            }
        }
        if consts.is_empty() {
            continue;
        }
        for (slot, input) in inputs.iter().enumerate() {
            model.node_mut(input.node).outputs[input.slot]
                .successors
                .retain(|s| *s != InletId::new(id, slot));
        }
        let node = model.node_mut(id);
        node.inputs.clear();
        node.op = Box::new(Baked {
            inner: node.op.clone(),
            consts,
            facts,
        });
        for (slot, outlet) in kept.into_iter().enumerate() {
            model.add_edge(outlet, InletId::new(id, slot))?;
        }
        baked += 1;
    }
    Ok(baked)
}

#[cfg(test)]
mod tests {
    use super::super::binary::Arith;
    use super::*;

    /// Constants at the first slot, in the middle, at the end, several in a row.
    #[test]
    fn merged_puts_each_constant_in_its_slot() {
        let cases: &[(&[usize], usize)] = &[(&[0], 1), (&[1], 1), (&[1, 3, 5], 3), (&[0, 1], 2)];
        for &(slots, given) in cases {
            let consts = slots.iter().map(|&s| (s, format!("c{s}")));
            let all = merged((0..given).map(|i| format!("g{i}")), consts);
            let mut want = vec![];
            let mut g = 0;
            for slot in 0..given + slots.len() {
                if slots.contains(&slot) {
                    want.push(format!("c{slot}"));
                } else {
                    want.push(format!("g{g}"));
                    g += 1;
                }
            }
            assert_eq!(all.to_vec(), want, "{slots:?}");
        }
    }

    /// A norm's weight times `x` and `x` minus a constant: baked, the plan runs no `Const`
    /// and gives the same values.
    #[test]
    fn baked_ops_give_the_same_values() {
        let mut model = TypedModel::default();
        let x = model.add_source("x", f32::fact([1, 3, 4])).unwrap();
        let weight = tensor3(&[[[0.5f32, -2.0, 3.0, 0.25]]]);
        let weight = model.add_const("weight", weight).unwrap();
        let shift = model.add_const("shift", tensor3(&[[[1.5f32]]])).unwrap();
        let scaled = model
            .wire_node("scaled", BroadcastArith(Arith::Mul), &[weight, x])
            .unwrap();
        let y = model
            .wire_node("shifted", BroadcastArith(Arith::Sub), &[scaled[0], shift])
            .unwrap();
        model.select_output_outlets(&y).unwrap();
        let input = tensor3(&[[
            [1f32, 2.0, 3.0, 4.0],
            [-1.0, 0.5, 7.0, 2.0],
            [0.0, 1.0, -3.0, 9.0],
        ]]);
        let run = |model: TypedModel| {
            let plan = model.into_runnable().unwrap();
            plan.run(tvec![input.clone().into_tvalue()])
                .unwrap()
                .remove(0)
                .into_tensor()
        };
        let before = run(model.clone());
        assert_eq!(bake(&mut model).unwrap(), 2);
        let order = model.eval_order().unwrap();
        assert!(order.iter().all(|&n| !model.node(n).op_is::<Const>()));
        assert_eq!(order.len(), 3, "x and the two baked ops");
        let after = run(model);
        assert_eq!(before, after);
    }
}
