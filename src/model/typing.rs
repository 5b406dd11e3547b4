//! An analysed ONNX graph made typed: what tract's `InferenceModelExt::into_typed` does, without
//! its second type analysis when there is nothing for it to learn.
//!
//! tract-hir 0.23's `into_typed` analyses the graph, runs its `incorporate` pass (ops that
//! rewrite themselves once analysed), compacts the graph, analyses it again, then translates
//! each node. No op of tract-onnx or of this crate rewrites itself there, so the second
//! analysis starts from a fixed point and changes nothing; but it runs every node's inference
//! rules again, and evaluates again every node whose inputs are all known (each `Shape`,
//! `Gather`, `Unsqueeze`, `Concat` of the shape computations, through a model built for each).
//! That was 45% of `into_typed` in a native load of SmolLM2 int8.
//! When some op does rewrite itself, [`into_typed`] takes tract's way.

use std::collections::HashMap;

use tract_onnx::prelude::*;
use tract_onnx::tract_core::model::translator::Translate;
use tract_onnx::tract_hir::infer::{Factoid, InferenceNode, InferenceOp};
use tract_onnx::tract_hir::internal::{format_err, EvalContext, TractErrorContext};

/// `model.into_typed()`, the graph analysed once (module documentation).
pub fn into_typed(mut model: InferenceModel) -> TractResult<TypedModel> {
    model.analyse(false)?;
    let mut rewrites = false;
    for id in model.eval_order()? {
        let node = model.node(id);
        if node.op.incorporate(&model, node)?.is_some() {
            rewrites = true;
            break;
        }
    }
    let model = if rewrites {
        model.incorporate()?
    } else {
        model.into_compact()?
    };
    ToTyped.translate_model(&model)
}

/// The node translation of tract's `into_typed`: a node whose outputs analysis knows becomes
/// constants (unless it is an input, or an op with a state that the constants would lose);
/// any other node is typed by its op.
#[derive(Debug)]
struct ToTyped;

impl Translate<InferenceFact, Box<dyn InferenceOp>, TypedFact, Box<dyn TypedOp>> for ToTyped {
    fn translate_node(
        &self,
        source: &InferenceModel,
        node: &InferenceNode,
        target: &mut TypedModel,
        mapping: &HashMap<OutletId, OutletId>,
    ) -> TractResult<TVec<OutletId>> {
        let known = source
            .node_output_facts(node.id)?
            .iter()
            .all(|f| f.value.is_concrete());
        if known
            && !InferenceModel::is_source(&node.op)
            && node.op.state(&EvalContext::out_of_plan())?.is_none()
        {
            let mut outlets = tvec!();
            for (slot, output) in node.outputs.iter().enumerate() {
                let value =
                    output.fact.value.concretize().ok_or_else(|| {
                        format_err!("the known output {slot} of {node} has no value")
                    })?;
                outlets.push(target.add_const(format!("{}.{slot}", node.name), value)?);
            }
            return Ok(outlets);
        }
        let outlets = node.op.to_typed(source, node, target, mapping)?;
        for outlet in &outlets {
            target
                .outlet_fact(*outlet)?
                .consistent()
                .with_context(|| format!("the typed output {outlet:?} of {node}"))?;
        }
        Ok(outlets)
    }
}
