//! Common subexpressions of an ONNX graph merged before tract parses it: a node with the same
//! op, the same inputs and the same attributes as an earlier node computes the same values, so
//! its consumers read the earlier node's outputs and the node goes.
//!
//! Exporters repeat small computations in every layer: SmolLM2's `model.onnx` has 7,426 nodes,
//! 2,713 of them `Constant`s (the same few axes and scalars again and again) and the `Shape`,
//! `Gather`, `Unsqueeze`, `Concat` chains built from them; merged, 4,042 nodes remain. tract's
//! type inference and optimisation passes cost time per node (two thirds of a load of SmolLM2
//! in wasm), and the graph it runs is the same either way.
//!
//! Kept as they are: nodes that write an output of the graph or of any subgraph (a branch may
//! return an outer value by its name, which must stay), nodes with a
//! subgraph attribute (`If`, `Loop`, `Scan`: their bodies are merged within themselves, and
//! read the outer graph's merged names), and random-number ops and `Dropout` (two draws
//! differ).

use std::collections::{HashMap, HashSet};

use prost::Message;
use tract_onnx::pb;

/// Merge the repeated nodes of `graph` and of its subgraphs.
pub fn merge_common(graph: &mut pb::GraphProto) {
    let mut outputs = HashSet::new();
    collect_outputs(graph, &mut outputs);
    merge_in(graph, &HashMap::new(), &outputs);
}

/// The output names of `graph` and of every subgraph in it.
fn collect_outputs(graph: &pb::GraphProto, into: &mut HashSet<String>) {
    into.extend(graph.output.iter().map(|o| o.name.clone()));
    for g in graph.node.iter().flat_map(super::onnx::subgraphs) {
        collect_outputs(g, into);
    }
}

/// `outer`: the outer graphs' renamed outputs (old name -> the name that replaces it), visible
/// to a subgraph's nodes; `outputs`: the names that stay ([`collect_outputs`]).
fn merge_in(
    graph: &mut pb::GraphProto,
    outer: &HashMap<String, String>,
    outputs: &HashSet<String>,
) {
    let mut renamed = outer.clone();
    let mut first_of: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut merged = vec![];
    for ix in 0..graph.node.len() {
        let node = &mut graph.node[ix];
        for input in node.input.iter_mut() {
            if let Some(to) = renamed.get(input) {
                *input = to.clone();
            }
        }
        let has_subgraph = node
            .attribute
            .iter()
            .any(|a| a.g.is_some() || !a.graphs.is_empty());
        if has_subgraph {
            for a in node.attribute.iter_mut() {
                for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
                    merge_in(g, &renamed, outputs);
                }
            }
            continue;
        }
        let node = &graph.node[ix];
        if node.output.is_empty()
            || node.op_type.starts_with("Random")
            || matches!(
                node.op_type.as_str(),
                "Multinomial" | "Bernoulli" | "Dropout"
            )
            || node.output.iter().any(|o| outputs.contains(o))
        {
            continue;
        }
        match first_of.entry(key(node)) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(ix);
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let first = &graph.node[*o.get()];
                for (dup, kept) in node.output.iter().zip(&first.output) {
                    if !dup.is_empty() {
                        renamed.insert(dup.clone(), kept.clone());
                    }
                }
                merged.push(ix);
            }
        }
    }
    // `merged` is in increasing order.
    let mut merged = merged.into_iter().peekable();
    let mut ix = 0;
    graph.node.retain(|_| {
        let keep = merged.next_if_eq(&ix).is_none();
        ix += 1;
        keep
    });
}

/// What makes two nodes compute the same values: domain, op, inputs, number of outputs and
/// attributes (as encoded), each length-prefixed.
fn key(node: &pb::NodeProto) -> Vec<u8> {
    let mut key = Vec::new();
    let mut put = |bytes: &[u8]| {
        key.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        key.extend_from_slice(bytes);
    };
    put(node.domain.as_bytes());
    put(node.op_type.as_bytes());
    put(&(node.input.len() as u64).to_le_bytes());
    for input in &node.input {
        put(input.as_bytes());
    }
    put(&(node.output.len() as u64).to_le_bytes());
    for a in &node.attribute {
        put(&a.encode_to_vec());
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, inputs: &[&str], outputs: &[&str], attr: Option<i64>) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: attr
                .map(|i| pb::AttributeProto {
                    name: "axis".into(),
                    i,
                    r#type: pb::attribute_proto::AttributeType::Int as i32,
                    ..Default::default()
                })
                .into_iter()
                .collect(),
            ..Default::default()
        }
    }

    fn value(name: &str) -> pb::ValueInfoProto {
        pb::ValueInfoProto {
            name: name.into(),
            ..Default::default()
        }
    }

    fn ops(g: &pb::GraphProto) -> Vec<String> {
        g.node
            .iter()
            .map(|n| {
                format!(
                    "{}({})->{}",
                    n.op_type,
                    n.input.join(","),
                    n.output.join(",")
                )
            })
            .collect()
    }

    #[test]
    fn repeated_chains_are_merged_and_their_readers_renamed() {
        let mut g = pb::GraphProto {
            node: vec![
                node("Constant", &[], &["c1"], Some(0)),
                node("Constant", &[], &["c2"], Some(0)),
                node("Constant", &[], &["c3"], Some(1)),
                node("Gather", &["x", "c1"], &["g1"], Some(0)),
                node("Gather", &["x", "c2"], &["g2"], Some(0)),
                node("Gather", &["x", "c2"], &["g3"], Some(1)),
                node("Add", &["g1", "g2"], &["s"], None),
                node("Add", &["g3", "c3"], &["y"], None),
                node("Add", &["g3", "c3"], &["z"], None),
            ],
            output: vec![value("s"), value("y"), value("z")],
            ..Default::default()
        };
        merge_common(&mut g);
        assert_eq!(
            ops(&g),
            [
                "Constant()->c1",
                "Constant()->c3",
                "Gather(x,c1)->g1",
                "Gather(x,c1)->g3",
                "Add(g1,g1)->s",
                // Both write graph outputs: kept.
                "Add(g3,c3)->y",
                "Add(g3,c3)->z",
            ]
        );
    }

    #[test]
    fn subgraphs_read_merged_names_and_random_ops_and_dropout_stay() {
        let branch = pb::GraphProto {
            node: vec![
                node("Neg", &["c2"], &["n1"], None),
                node("Neg", &["c2"], &["n2"], None),
                node("Add", &["n1", "n2"], &["b"], None),
            ],
            output: vec![value("b")],
            ..Default::default()
        };
        let mut if_node = node("If", &["cond"], &["r"], None);
        if_node.attribute = vec![pb::AttributeProto {
            name: "then_branch".into(),
            g: Some(branch),
            ..Default::default()
        }];
        let mut g = pb::GraphProto {
            node: vec![
                node("Constant", &[], &["c1"], Some(0)),
                node("Constant", &[], &["c2"], Some(0)),
                node("RandomNormalLike", &["c1"], &["r1"], None),
                node("RandomNormalLike", &["c2"], &["r2"], None),
                node("Dropout", &["c1"], &["d1"], None),
                node("Dropout", &["c2"], &["d2"], None),
                if_node,
            ],
            output: vec![value("r")],
            ..Default::default()
        };
        merge_common(&mut g);
        assert_eq!(
            ops(&g),
            [
                "Constant()->c1",
                "RandomNormalLike(c1)->r1",
                "RandomNormalLike(c1)->r2",
                "Dropout(c1)->d1",
                "Dropout(c1)->d2",
                "If(cond)->r",
            ]
        );
        let branch = g.node[5].attribute[0].g.as_ref().unwrap();
        assert_eq!(ops(branch), ["Neg(c1)->n1", "Add(n1,n1)->b"]);
    }

    #[test]
    fn an_outer_value_a_branch_returns_keeps_its_name() {
        let mut if_node = node("If", &["cond"], &["r"], None);
        if_node.attribute = vec![pb::AttributeProto {
            name: "else_branch".into(),
            g: Some(pb::GraphProto {
                output: vec![value("c2")],
                ..Default::default()
            }),
            ..Default::default()
        }];
        let mut g = pb::GraphProto {
            node: vec![
                node("Constant", &[], &["c1"], Some(0)),
                node("Constant", &[], &["c2"], Some(0)),
                node("Constant", &[], &["c3"], Some(0)),
                if_node,
            ],
            output: vec![value("r")],
            ..Default::default()
        };
        merge_common(&mut g);
        assert_eq!(ops(&g), ["Constant()->c1", "Constant()->c2", "If(cond)->r"]);
    }
}
