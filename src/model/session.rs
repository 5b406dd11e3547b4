//! tract's state of a plan, kept from one decoding step to the next.

use std::sync::Arc;

use tract_onnx::prelude::*;

/// The state of the last plan a decoder state ran. tract's `SimplePlan::run` builds a
/// `SimpleState` and drops it at every call: a slot per node, the plan's constants cloned
/// in, every op's session (hundreds of nodes: 0.3 ms of a SmolLM2 step in wasm). A step of
/// the same plan runs this one again (tract clears its values after each run). Kept while no
/// op holds a state of its own between runs (decoder graphs have none), dropped when a run
/// fails.
#[derive(Default)]
pub struct Session(Option<TypedSimpleState>);

impl Session {
    pub fn run(
        &mut self,
        plan: &Arc<TypedRunnableModel>,
        inputs: TVec<TValue>,
    ) -> TractResult<TVec<TValue>> {
        let mut state = match self.0.take() {
            Some(state) if Arc::ptr_eq(state.plan(), plan) => state,
            _ => plan.spawn()?,
        };
        let outputs = state.run(inputs)?;
        if state.op_states.iter().all(Option::is_none) {
            self.0 = Some(state);
        }
        Ok(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y = x + x` over a symbolic length, run with other lengths, after a failed run too.
    #[test]
    fn runs_the_plan_again_with_other_shapes_and_after_a_failure() {
        let mut model = TypedModel::default();
        let s = model.symbols.sym("S");
        let x = model.add_source("x", f32::fact(&[s.to_dim()])).unwrap();
        let y = model
            .wire_node("y", tract_onnx::tract_core::ops::math::add(), &[x, x])
            .unwrap();
        model.select_output_outlets(&y).unwrap();
        let plan = model.into_runnable().unwrap();
        let mut session = Session::default();
        let mut run = |v: Vec<f32>| session.run(&plan, tvec![tensor1(&v).into()]);
        assert_eq!(*run(vec![1.0, 2.0]).unwrap()[0], tensor1(&[2f32, 4.0]));
        assert_eq!(*run(vec![3.0]).unwrap()[0], tensor1(&[6f32]));
        let wrong = session.run(&plan, tvec![tensor1(&[1i64]).into()]);
        assert!(wrong.is_err(), "an i64 input ran: {wrong:?}");
        assert!(session.0.is_none());
        let again = session.run(&plan, tvec![tensor1(&[1f32, 2.0, 3.0]).into()]);
        assert_eq!(*again.unwrap()[0], tensor1(&[2f32, 4.0, 6.0]));
        assert!(session.0.is_some());
    }
}
