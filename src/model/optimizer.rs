//! tract's optimiser passes (declutter, codegen), run in the order and to the fixed point that
//! `OptimizerSession::optimize` runs them, with each patch applied by [`apply`].
//!
//! Why not tract's own session: its `ModelPatch::apply` (tract-core 0.23) compares every node a
//! patch adds with every node of the graph (`dyn_eq` on the ops, meant to reuse an identical
//! node, but its `continue` only moves to the next candidate, so the node is added anyway).
//! With SmolLM2's 4,000 to 5,000 nodes and the thousands of patches of a load, that was about
//! 0.33 s of a 2.5 s load in Node (CPU profile of an int8 load: `ModelPatch::apply`, `dyn_eq`
//! and `type_id` self time). [`apply`] makes the same changes to the graph without the
//! comparisons.

use std::collections::HashSet;

use tract_onnx::prelude::*;
use tract_onnx::tract_core::model::{TypedModelPatch, TRACT_STAGE};
use tract_onnx::tract_core::ops::dummy::Dummy;
use tract_onnx::tract_core::ops::source::TypedSource;
use tract_onnx::tract_core::optim::{Optimizer, TypedPass};
use tract_onnx::tract_hir::internal::{format_err, TractErrorContext};

/// tract's declutter passes without `FoldUniformMask` (see `tract_decoder::optimize`).
pub fn declutter_passes() -> Optimizer {
    let mut optimizer = Optimizer::declutter();
    optimizer
        .passes
        .retain(|pass| !format!("{pass:?}").starts_with("FoldUniformMask"));
    optimizer
}

/// `model.declutter()` with [`declutter_passes`], then `model.optimize()` (codegen), each to
/// its fixed point.
pub fn declutter_and_optimize(model: &mut TypedModel) -> TractResult<()> {
    run(&declutter_passes(), model)?;
    run(&Optimizer::codegen(), model)?;
    // What `TypedModel::optimize` records once its passes are done.
    model.properties.insert(
        TRACT_STAGE.to_string(),
        rctensor0(tract_onnx::tract_core::model::STAGE_OPTIMIZED.to_string()),
    );
    Ok(())
}

/// Runs `optimizer`'s passes over `model` until a whole round applies no patch: each pass
/// until it applies none, the graph compacted after each (`OptimizerSession::optimize`).
///
/// A pass is skipped when no patch was applied since its last run ended with none: it would
/// find the same graph and propose nothing again. The patches applied are those of tract's
/// loop, without its last round's runs of passes that have nothing left to do.
fn run(optimizer: &Optimizer, model: &mut TypedModel) -> TractResult<()> {
    let _proofs = model.symbols.proof_cache_session();
    let mut session = optimizer.session();
    // The watchdogs of patches that may only be applied once (`dont_apply_twice`).
    let mut seen = HashSet::new();
    let mut applied = 0usize;
    // Per pass, `applied` when its last run proposed nothing.
    let mut quiet_at: Vec<Option<usize>> = vec![None; optimizer.passes.len()];
    model.compact()?;
    loop {
        let before_round = applied;
        let mut passes = optimizer.passes.clone();
        for (pass, quiet_at) in passes.iter_mut().zip(quiet_at.iter_mut()) {
            if *quiet_at == Some(applied) {
                continue;
            }
            loop {
                let before = applied;
                applied += run_pass(pass.as_mut(), &mut session, &mut seen, model)
                    .with_context(|| format!("running pass {pass:?}"))?;
                if applied == before {
                    break;
                }
                model.compact()?;
            }
            *quiet_at = Some(applied);
            model.compact()?;
        }
        if applied == before_round {
            return Ok(());
        }
        model.compact()?;
    }
}

/// One run of `pass`: every patch it proposes, applied in turn, then its in-place changes.
/// Returns how many patches were applied.
fn run_pass(
    pass: &mut dyn TypedPass,
    session: &mut tract_onnx::tract_core::optim::OptimizerSession,
    seen: &mut HashSet<String>,
    model: &mut TypedModel,
) -> TractResult<usize> {
    pass.reset()?;
    let mut applied = 0;
    while let Some(mut patch) = pass.next(session, model)? {
        if let Some(watchdog) = patch.dont_apply_twice.take() {
            if !seen.insert(watchdog) {
                continue;
            }
        }
        let context = std::mem::take(&mut patch.context);
        apply(patch, model).with_context(|| format!("applying patch {}", context.join(" >> ")))?;
        applied += 1;
    }
    pass.run_direct(model)?;
    Ok(applied)
}

/// Applies `patch` to `target` as `ModelPatch::apply` does, without its comparisons (module
/// documentation):
/// 1. the patch's nodes are added, except its taps (sources standing for outlets of
///    `target`); a source that replaces one of `target`'s inputs takes its place;
/// 2. each shunted outlet's readers (and graph outputs, and label) move to its replacement;
/// 3. the added nodes are wired to their inputs;
/// 4. obliterated nodes become dummies, and so does every node that the shunts left unread
///    (not an input or output of the graph), and in turn its inputs when they end up unread;
/// 5. an added node whose name another node has (or with a `#` suffix) is renamed by
///    `unique_name`.
fn apply(patch: TypedModelPatch, target: &mut TypedModel) -> TractResult<()> {
    let TypedModelPatch {
        model: patch,
        taps: mut mapping,
        shunts,
        obliterate,
        inputs: replaced_inputs,
        ..
    } = patch;
    let mut input_outlets = target.input_outlets()?.to_vec();
    let mut added: Vec<(usize, Vec<OutletId>)> = vec![];
    for node in patch.nodes {
        let is_source = node.op_is::<TypedSource>();
        if is_source && mapping.contains_key(&OutletId::new(node.id, 0)) {
            continue;
        }
        let facts = node.outputs.into_iter().map(|o| o.fact).collect();
        let id = target.add_node(node.name, node.op, facts)?;
        for slot in 0..target.node(id).outputs.len() {
            mapping.insert(OutletId::new(node.id, slot), OutletId::new(id, slot));
        }
        if is_source {
            let replaced = *replaced_inputs.get(&node.id).ok_or_else(|| {
                format_err!("patch source {} replaces no input", target.node(id).name)
            })?;
            for outlet in input_outlets.iter_mut().filter(|o| o.node == replaced) {
                outlet.node = id;
            }
        }
        added.push((id, node.inputs));
    }
    let outlet = |mapping: &std::collections::HashMap<OutletId, OutletId>, o: &OutletId| {
        mapping
            .get(o)
            .copied()
            .ok_or_else(|| format_err!("patch outlet {o:?} is not wired"))
    };
    // In the order tract applies them (the outlets are distinct).
    let mut shunts: Vec<(OutletId, OutletId)> = shunts.into_iter().collect();
    shunts.sort_unstable();
    for &(from, by) in &shunts {
        let by = outlet(&mapping, &by)?;
        let readers = target.node(from.node).outputs[from.slot].successors.clone();
        for reader in readers {
            target.add_edge(by, reader)?;
        }
        for o in target.outputs.iter_mut().filter(|o| **o == from) {
            *o = by;
        }
        if let Some(label) = target.outlet_labels.remove(&from) {
            target.set_outlet_label(by, label)?;
        }
    }
    // `added` is in increasing node order, as tract wires them.
    for (id, inputs) in &added {
        for (slot, input) in inputs.iter().enumerate() {
            target.add_edge(outlet(&mapping, input)?, InletId::new(*id, slot))?;
        }
    }
    for node in obliterate {
        target.node_mut(node).op = Box::new(Dummy::new());
    }
    target.set_input_outlets(&input_outlets)?;
    let mut maybe_unread: HashSet<usize> = shunts.iter().map(|(from, _)| from.node).collect();
    while let Some(&node) = maybe_unread.iter().next() {
        maybe_unread.remove(&node);
        let unread = !target.outputs.iter().any(|o| o.node == node)
            && !target.inputs.iter().any(|i| i.node == node)
            && target
                .node(node)
                .outputs
                .iter()
                .all(|o| o.successors.is_empty());
        if unread {
            let n = target.node_mut(node);
            n.op = Box::new(Dummy::new());
            n.name = format!("Dummy-node-{node}");
            n.outputs.clear();
            let inputs = std::mem::take(&mut n.inputs);
            for input in inputs {
                target.node_mut(input.node).outputs[input.slot]
                    .successors
                    .retain(|s| s.node != node);
                maybe_unread.insert(input.node);
            }
        }
    }
    // Names, in node order (tract renames in its set's order).
    for (id, _) in &added {
        let name = &target.node(*id).name;
        let renamed = if let Some((prefix, _)) = name.split_once('#') {
            Some(target.unique_name(prefix.to_string()).into_owned())
        } else if target.nodes.iter().any(|n| n.id != *id && n.name == *name) {
            Some(target.unique_name(name.clone()).into_owned())
        } else {
            None
        };
        if let Some(name) = renamed {
            target.node_mut(*id).name = name;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use tract_onnx::tract_hir::internal::Factoid;

    /// The pass left out is still in tract's declutter list (else the filter silently does
    /// nothing and a newer tract may have renamed it).
    #[test]
    fn fold_uniform_mask_is_left_out() {
        let count = |o: &Optimizer| {
            o.passes
                .iter()
                .filter(|p| format!("{p:?}").starts_with("FoldUniformMask"))
                .count()
        };
        assert_eq!(count(&Optimizer::declutter()), 1);
        assert_eq!(count(&declutter_passes()), 0);
    }

    /// A fixture graph as tract types it (our ops registered, no rewrites), with a batch of
    /// one (the first axis of each input, as the loaders fix it).
    fn typed(path: &str) -> TypedModel {
        parsed(path).into_typed().unwrap()
    }

    /// A fixture graph as tract reads it, with a batch of one (`typed`).
    fn parsed(path: &str) -> InferenceModel {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
        let mut model = crate::model::ops::onnx()
            .model_for_path(dir.join(path))
            .unwrap();
        for ix in 0..model.input_outlets().unwrap().len() {
            let fact = model.input_fact(ix).unwrap().clone();
            let mut dims: Vec<TDim> = fact.shape.dims().map(|d| d.concretize().unwrap()).collect();
            if let Some(batch) = dims.first_mut() {
                *batch = 1.into();
            }
            let dt = fact.datum_type.concretize().unwrap();
            model
                .set_input_fact(ix, InferenceFact::dt_shape(dt, dims))
                .unwrap();
        }
        model
    }

    /// Each node's op and the outlets it reads, in evaluation order, and the graph's inputs
    /// and outputs: the graph, whatever its nodes are named.
    fn structure(model: &TypedModel) -> Vec<String> {
        let mut lines: Vec<String> = model
            .eval_order()
            .unwrap()
            .into_iter()
            .map(|id| {
                let node = model.node(id);
                let facts: Vec<String> = node
                    .outputs
                    .iter()
                    .map(|o| format!("{:?}", o.fact))
                    .collect();
                format!("{id}: {:?} {:?} -> {facts:?}", node.op, node.inputs)
            })
            .collect();
        lines.push(format!(
            "inputs {:?} outputs {:?}",
            model.inputs, model.outputs
        ));
        lines
    }

    /// `typing::into_typed` (one analysis) gives the graph of tract's `into_typed`: the same
    /// ops reading the same outlets with the same facts, and the same names.
    #[test]
    fn typing_gives_the_graph_of_tracts_into_typed() {
        for path in FIXTURES {
            let theirs = typed(path);
            let ours = crate::model::typing::into_typed(parsed(path)).unwrap();
            assert!(ours.nodes.len() > 10, "{path}: {} nodes", ours.nodes.len());
            assert_eq!(structure(&ours), structure(&theirs), "{path}");
            let names = |m: &TypedModel| m.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>();
            assert_eq!(names(&ours), names(&theirs), "{path}");
        }
    }

    /// Fixture graphs of each kind: a decoder with and without positions, with a cache, an
    /// encoder-decoder's decoder, Whisper's encoder and decoder.
    const FIXTURES: [&str; 6] = [
        "llama/model.onnx",
        "gpt2-nopos/model.onnx",
        "gpt2/model.onnx",
        "t5/decoder_with_past_model.onnx",
        "whisper-tiny/decoder_model.onnx",
        "whisper-tiny/encoder_model.onnx",
    ];

    /// tract's own session and `declutter_and_optimize` give the same graph: the same ops
    /// reading the same outlets with the same facts, and every name unique.
    #[test]
    fn the_graph_is_the_one_tract_makes() {
        for path in FIXTURES {
            let mut theirs = typed(path);
            declutter_passes().optimize(&mut theirs).unwrap();
            theirs.optimize().unwrap();
            let mut ours = typed(path);
            declutter_and_optimize(&mut ours).unwrap();
            assert!(ours.nodes.len() > 10, "{path}: {} nodes", ours.nodes.len());
            assert_eq!(structure(&ours), structure(&theirs), "{path}");
            let keys = |m: &TypedModel| {
                m.properties
                    .keys()
                    .cloned()
                    .collect::<std::collections::BTreeSet<_>>()
            };
            assert_eq!(keys(&ours), keys(&theirs), "{path}");
            let names: HashSet<&str> = ours.nodes.iter().map(|n| n.name.as_str()).collect();
            assert_eq!(names.len(), ours.nodes.len(), "{path}: repeated names");
        }
    }
}
