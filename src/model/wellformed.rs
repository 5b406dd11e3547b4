//! What an ONNX graph must be before tract reads it. tract takes some of it for granted and
//! panics (or allocates without end) on a graph that breaks it, and a panic in wasm kills the
//! instance; so a malformed file is refused here with an error that names the node or tensor:
//! every name a node reads and every output of the graph is defined (an input, an initializer,
//! a node's output, or a name of an enclosing graph for a subgraph), every node has outputs
//! and every node but a source reads something, every tensor's dimensions are non-negative
//! and their product fits in memory's addresses, `axis` and `axes` attributes are within the
//! 64 axes a tensor may have, and a `Transpose`'s `perm` is a permutation.

use std::collections::HashSet;

use tract_onnx::pb;

use super::onnx::number_type;
use super::ops::node_label;
use crate::error::{Error, Result};

/// The most axes a tensor may have (as NumPy 2; tract has no limit, and loops over an `axis`
/// attribute's value before it checks it).
const MAX_RANK: i64 = 64;

/// Ops of the default domain that take no inputs.
const SOURCES: [&str; 4] = ["Constant", "RandomNormal", "RandomUniform", "SequenceEmpty"];

/// Checks `graph` (of the file `file_name`) and its subgraphs.
pub fn check(graph: &pb::GraphProto, file_name: &str) -> Result<()> {
    check_graph(graph, &HashSet::new()).map_err(|e| Error::Model(format!("{file_name}: {e}")))
}

fn check_graph<'a>(
    graph: &'a pb::GraphProto,
    outer: &HashSet<&'a str>,
) -> std::result::Result<(), String> {
    let mut defined = outer.clone();
    defined.extend(graph.input.iter().map(|i| i.name.as_str()));
    defined.extend(graph.initializer.iter().map(|t| t.name.as_str()));
    defined.extend(
        graph
            .node
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str)),
    );
    for t in &graph.initializer {
        check_tensor(t)?;
    }
    for node in &graph.node {
        let label = node_label(node);
        if node.output.is_empty() {
            return Err(format!("{label} has no outputs"));
        }
        if node.input.iter().all(String::is_empty)
            && !(node.domain.is_empty() && SOURCES.contains(&node.op_type.as_str()))
        {
            return Err(format!("{label} has no inputs"));
        }
        if let Some(name) = node
            .input
            .iter()
            .find(|i| !i.is_empty() && !defined.contains(i.as_str()))
        {
            return Err(format!(
                "{label} reads '{name}', which no input, initializer or node of the graph defines"
            ));
        }
        let beyond = |v: &i64| !(-MAX_RANK..MAX_RANK).contains(v);
        for attr in &node.attribute {
            for t in attr.t.iter().chain(&attr.tensors) {
                check_tensor(t).map_err(|e| format!("{label}, attribute {}: {e}", attr.name))?;
            }
            for g in attr.g.iter().chain(&attr.graphs) {
                check_graph(g, &defined)
                    .map_err(|e| format!("{label}, subgraph {}: {e}", attr.name))?;
            }
            if (attr.name == "axis" || attr.name == "axes")
                && (beyond(&attr.i) || attr.ints.iter().any(beyond))
            {
                let value = match attr.ints.is_empty() {
                    true => attr.i.to_string(),
                    false => format!("{:?}", attr.ints),
                };
                return Err(format!(
                    "{label}: {} {value} is beyond the {MAX_RANK} axes a tensor may have",
                    attr.name
                ));
            }
        }
        if node.op_type == "Transpose" && node.domain.is_empty() {
            if let Some(perm) = node.attribute.iter().find(|a| a.name == "perm") {
                let mut seen = vec![false; perm.ints.len()];
                for &p in &perm.ints {
                    match usize::try_from(p).ok().and_then(|p| seen.get_mut(p)) {
                        Some(s) if !*s => *s = true,
                        _ => {
                            return Err(format!(
                                "{label}: perm {:?} is not a permutation of 0..{}",
                                perm.ints,
                                perm.ints.len()
                            ))
                        }
                    }
                }
            }
        }
    }
    if let Some(o) = graph
        .output
        .iter()
        .find(|o| !defined.contains(o.name.as_str()))
    {
        return Err(format!(
            "the graph's output '{}' is not an input, initializer or node output of the graph",
            o.name
        ));
    }
    Ok(())
}

/// Dimensions non-negative, their product in bytes (8 a value of a type that is not a
/// number) an address.
fn check_tensor(t: &pb::TensorProto) -> std::result::Result<(), String> {
    let size = number_type(t.data_type).map_or(8, |dt| dt.size_of());
    let bytes = t.dims.iter().try_fold(size, |n, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| n.checked_mul(d))
            .filter(|&n| n <= isize::MAX as usize)
    });
    match bytes {
        Some(_) => Ok(()),
        None => Err(format!(
            "tensor '{}' has dimensions {:?}; expected non-negative ones whose product fits in \
             memory",
            t.name, t.dims
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.into(),
            name: format!("{op}_0"),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn value(name: &str) -> pb::ValueInfoProto {
        pb::ValueInfoProto {
            name: name.into(),
            ..Default::default()
        }
    }

    fn graph(nodes: Vec<pb::NodeProto>) -> pb::GraphProto {
        pb::GraphProto {
            node: nodes,
            input: vec![value("x")],
            output: vec![value("y")],
            ..Default::default()
        }
    }

    fn error(g: &pb::GraphProto) -> String {
        check(g, "m.onnx").unwrap_err().to_string()
    }

    #[test]
    fn a_well_formed_graph_passes() {
        let mut g = graph(vec![node("Neg", &["x"], &["y"])]);
        check(&g, "m.onnx").unwrap();
        // Optional inputs left empty, sources without inputs, a subgraph reading outer names.
        let inner = pb::GraphProto {
            node: vec![node("Add", &["x", "c"], &["z"])],
            output: vec![value("z")],
            ..Default::default()
        };
        let mut iff = node("If", &["c"], &["y"]);
        iff.attribute.push(pb::AttributeProto {
            name: "then_branch".into(),
            g: Some(inner),
            ..Default::default()
        });
        g.node = vec![
            node("Constant", &[], &["c"]),
            iff,
            node("Clip", &["x", "", "c"], &["w"]),
        ];
        check(&g, "m.onnx").unwrap();
    }

    #[test]
    fn undefined_names_are_refused() {
        let e = error(&graph(vec![node("Neg", &["nowhere"], &["y"])]));
        assert!(
            e.contains("m.onnx: Neg node 'Neg_0' reads 'nowhere', which no input"),
            "{e}"
        );
        let e = error(&graph(vec![node("Neg", &["x"], &["z"])]));
        assert!(e.contains("the graph's output 'y' is not"), "{e}");
    }

    #[test]
    fn nodes_without_inputs_or_outputs_are_refused() {
        for inputs in [&[][..], &[""]] {
            let e = error(&graph(vec![node("Transpose", inputs, &["y"])]));
            assert!(
                e.contains("Transpose node 'Transpose_0' has no inputs"),
                "{e}"
            );
        }
        let e = error(&graph(vec![node("Neg", &["x"], &[])]));
        assert!(e.contains("Neg node 'Neg_0' has no outputs"), "{e}");
    }

    #[test]
    fn a_transpose_needs_a_permutation() {
        for perm in [vec![0, 2, 2], vec![0, 3, 1], vec![-1, 0]] {
            let mut t = node("Transpose", &["x"], &["y"]);
            t.attribute.push(pb::AttributeProto {
                name: "perm".into(),
                ints: perm.clone(),
                ..Default::default()
            });
            let e = error(&graph(vec![t]));
            assert!(
                e.contains(&format!("perm {perm:?} is not a permutation")),
                "{e}"
            );
        }
    }

    #[test]
    fn axes_lie_within_a_rank() {
        let mut n = node("LayerNormalization", &["x", "x"], &["y"]);
        n.attribute.push(pb::AttributeProto {
            name: "axis".into(),
            i: 1 << 40,
            ..Default::default()
        });
        let e = error(&graph(vec![n.clone()]));
        assert!(
            e.contains("'LayerNormalization_0': axis 1099511627776 is beyond the 64 axes"),
            "{e}"
        );
        n.attribute[0].i = -64;
        check(&graph(vec![n.clone()]), "m.onnx").unwrap();
        n.attribute[0] = pb::AttributeProto {
            name: "axes".into(),
            ints: vec![0, -65],
            ..Default::default()
        };
        assert!(error(&graph(vec![n])).contains("axes [0, -65] is beyond"));
    }

    #[test]
    fn tensors_need_dimensions_that_fit() {
        for dims in [vec![2, -1], vec![1 << 40, 1 << 30], vec![i64::MIN]] {
            let mut g = graph(vec![node("Add", &["x", "w"], &["y"])]);
            g.initializer.push(pb::TensorProto {
                name: "w".into(),
                dims: dims.clone(),
                data_type: 1,
                ..Default::default()
            });
            let e = error(&g);
            assert!(
                e.contains(&format!("tensor 'w' has dimensions {dims:?}")),
                "{e}"
            );
        }
    }
}
