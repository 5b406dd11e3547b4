//! ONNX protobuf handling before tract sees a graph: decoding bytes, resolving external data
//! from bytes (a browser has no file system), and fixing graph inputs to constants.

use tract_onnx::pb;

use crate::error::{Error, Result};

/// `TensorProto.DataLocation.EXTERNAL`.
const EXTERNAL: i32 = 1;

/// Decode an ONNX file and resolve its external data (`model.onnx.data`) from `external`.
pub fn decode(bytes: &[u8], external: Option<&[u8]>, file_name: &str) -> Result<pb::ModelProto> {
    if bytes.is_empty() {
        return Err(Error::Model(format!("{file_name} is empty")));
    }
    // Straight from the bytes: tract's `proto_model_for_read` copies them into a buffer of its
    // own first, which adds a third copy of the weights to the peak of loading.
    let mut proto = <pb::ModelProto as prost::Message>::decode(bytes)
        .map_err(|e| Error::Model(format!("{file_name} is not a valid ONNX file: {e}")))?;
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| Error::Model(format!("{file_name} contains no graph")))?;
    if graph.node.is_empty() {
        return Err(Error::Model(format!("{file_name} contains an empty graph")));
    }
    inline_external_data(graph, external, file_name)?;
    super::weights::rewrite(&mut proto)?;
    Ok(proto)
}

fn inline_external_data(
    graph: &mut pb::GraphProto,
    external: Option<&[u8]>,
    file_name: &str,
) -> Result<()> {
    for tensor in graph.initializer.iter_mut() {
        inline_tensor(tensor, external, file_name)?;
    }
    for node in graph.node.iter_mut() {
        for attr in node.attribute.iter_mut() {
            if let Some(t) = attr.t.as_mut() {
                inline_tensor(t, external, file_name)?;
            }
            if let Some(g) = attr.g.as_mut() {
                inline_external_data(g, external, file_name)?;
            }
        }
    }
    Ok(())
}

fn inline_tensor(t: &mut pb::TensorProto, external: Option<&[u8]>, file_name: &str) -> Result<()> {
    if t.data_location != Some(EXTERNAL) {
        return Ok(());
    }
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.clone())
    };
    let location = entry("location").unwrap_or_default();
    let data = external.ok_or_else(|| {
        Error::Model(format!(
            "{file_name} keeps its weights in the external data file `{location}`, which was not given"
        ))
    })?;
    let parse = |key: &str| -> Result<Option<usize>> {
        entry(key)
            .map(|v| {
                v.parse::<usize>().map_err(|_| {
                    Error::Model(format!(
                        "tensor `{}`: bad external data {key} {v:?}",
                        t.name
                    ))
                })
            })
            .transpose()
    };
    let offset = parse("offset")?.unwrap_or(0);
    let length = match parse("length")? {
        Some(l) => l,
        None => data.len().saturating_sub(offset),
    };
    let end = offset
        .checked_add(length)
        .filter(|&e| e <= data.len())
        .ok_or_else(|| {
            Error::Model(format!(
                "tensor `{}` lies at bytes {offset}..{} of `{location}`, which has only {} bytes \
             (truncated or wrong external data file?)",
                t.name,
                offset.saturating_add(length),
                data.len()
            ))
        })?;
    t.raw_data = data[offset..end].to_vec();
    t.data_location = None;
    t.external_data.clear();
    Ok(())
}

/// Specialise a graph for a known value of the boolean input `name` (a merged decoder's
/// `use_cache_branch`): every `If` on it is replaced by the nodes of the branch taken, and the
/// input is removed. The step then never runs an `If`, and each branch compiles on its own.
pub fn specialize_bool_input(proto: &mut pb::ModelProto, name: &str, value: bool) -> Result<()> {
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| Error::Model("the ONNX file contains no graph".into()))?;
    let before = graph.input.len();
    graph.input.retain(|i| i.name != name);
    if graph.input.len() == before {
        return Err(Error::Model(format!("the graph has no input `{name}`")));
    }
    let branch_name = if value { "then_branch" } else { "else_branch" };
    let mut nodes = Vec::with_capacity(graph.node.len());
    for node in std::mem::take(&mut graph.node) {
        if node.op_type != "If" || node.input.first().map(String::as_str) != Some(name) {
            nodes.push(node);
            continue;
        }
        let branch = node
            .attribute
            .iter()
            .find(|a| a.name == branch_name)
            .and_then(|a| a.g.clone())
            .ok_or_else(|| {
                Error::Model(format!("`If` node `{}` has no {branch_name}", node.name))
            })?;
        graph.initializer.extend(branch.initializer);
        // Node names are scoped to their graph (and exporters repeat them): number them so
        // they stay unique once inlined.
        nodes.extend(branch.node.into_iter().enumerate().map(|(i, mut n)| {
            n.name = format!("{}/{i}/{}", node.name, n.name);
            n
        }));
        for (inner, outer) in branch.output.iter().zip(&node.output) {
            if &inner.name != outer {
                nodes.push(pb::NodeProto {
                    op_type: "Identity".into(),
                    name: format!("{}/{}", node.name, outer),
                    input: vec![inner.name.clone()],
                    output: vec![outer.clone()],
                    ..Default::default()
                });
            }
        }
    }
    graph.node = nodes;
    // Anything else that reads the input sees the constant.
    if graph.node.iter().any(|n| n.input.iter().any(|i| i == name)) {
        graph.initializer.push(pb::TensorProto {
            name: name.to_owned(),
            dims: vec![1],
            data_type: pb::tensor_proto::DataType::Bool as i32,
            raw_data: vec![value as u8],
            ..Default::default()
        });
    }
    Ok(())
}
