//! The padding part of the attention mask, as transformers 4.57 exports it, rewritten before
//! tract reads the graph.
//!
//! `sdpa_mask` (masking_utils.py) looks the 2-D `attention_mask` up at every
//! `(batch_idx, kv_idx)` (`padding_mask_function`), with `batch_idx` laid out as
//! `[batch, 1, 1, 1]` and `kv_idx` as `[1, 1, 1, kv_length]`. The ONNX exporter writes that
//! lookup as a gather from the flattened mask:
//!
//! ```text
//! x = Cast(attention_mask)                              [batch, length]
//! Gather(Flatten(x, axis=2), batch_idx * Shape(x)[1] + kv_idx)
//!   -> Reshape([-1]) -> Reshape(Shape(indices))         [batch, 1, 1, kv_length]
//! ```
//!
//! Its values are `x[b, k]`: `x` with two axes inserted (`Unsqueeze(x, [1, 2])`) when
//! `kv_length` is the mask's length, as the engine binds it in the `append` and `grow` modes
//! (past plus new positions; in `in_place` mode the mask is shorter than the buffer). tract
//! simplifies the gather chain in three more rounds of its declutter passes, each over the
//! whole graph: SmolLM2's int8 file loaded natively in about 560 ms with them, 510 ms without;
//! in Node 1.14-1.17 s, 1.05-1.11 s.

use std::collections::HashMap;

use tract_onnx::pb;

/// The graph input the chain starts from.
const MASK: &str = "attention_mask";

/// Replace each such chain's last `Reshape` by `Unsqueeze(x, [1, 2])`, then drop the nodes
/// nothing reads any more. Returns the number of chains replaced.
pub(crate) fn rewrite(proto: &mut pb::ModelProto) -> usize {
    let opset = proto
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(0, |o| o.version);
    let Some(graph) = proto.graph.as_mut() else {
        return 0;
    };
    let found: Vec<(usize, String)> = {
        let g = Lookup::new(graph);
        (graph.node.iter().enumerate())
            .filter_map(|(ix, n)| Some((ix, g.padded_mask(n)?.to_string())))
            .collect()
    };
    for (ix, mask) in &found {
        let node = &mut graph.node[*ix];
        node.op_type = "Unsqueeze".into();
        node.attribute.clear();
        if opset >= 13 {
            let axes = format!("{}/onnx_generate_axes", node.output[0]);
            node.input = vec![mask.clone(), axes.clone()];
            graph.initializer.push(pb::TensorProto {
                name: axes,
                data_type: pb::tensor_proto::DataType::Int64 as i32,
                dims: vec![2],
                int64_data: vec![1, 2],
                ..Default::default()
            });
        } else {
            node.input = vec![mask.clone()];
            node.attribute.push(pb::AttributeProto {
                name: "axes".into(),
                r#type: pb::attribute_proto::AttributeType::Ints as i32,
                ints: vec![1, 2],
                ..Default::default()
            });
        }
    }
    if !found.is_empty() {
        super::onnx::drop_unread_nodes(graph);
    }
    found.len()
}

/// The nodes of a graph by the names of their outputs.
struct Lookup<'a> {
    graph: &'a pb::GraphProto,
    producer: HashMap<&'a str, &'a pb::NodeProto>,
}

impl<'a> Lookup<'a> {
    fn new(graph: &'a pb::GraphProto) -> Self {
        let producer = (graph.node.iter())
            .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
            .filter(|(o, _)| !o.is_empty())
            .collect();
        Lookup { graph, producer }
    }

    /// The node writing `name`, when its op is `op`.
    fn node(&self, name: &str, op: &str) -> Option<&'a pb::NodeProto> {
        self.producer.get(name).copied().filter(|n| n.op_type == op)
    }

    /// `name` through any `Cast`s.
    fn uncast(&self, mut name: &'a str) -> &'a str {
        while let Some(input) = self.node(name, "Cast").and_then(|c| c.input.first()) {
            name = input;
        }
        name
    }

    /// The integers of a constant: a `Constant` node or an initializer.
    fn ints(&self, name: &str) -> Option<Vec<i64>> {
        if let Some(node) = self.node(name, "Constant") {
            let attr = node.attribute.first()?;
            return match attr.name.as_str() {
                "value" => tensor_ints(attr.t.as_ref()?),
                "value_int" => Some(vec![attr.i]),
                "value_ints" => Some(attr.ints.clone()),
                _ => None,
            };
        }
        if self.producer.contains_key(name) {
            return None;
        }
        tensor_ints(self.graph.initializer.iter().find(|t| t.name == name)?)
    }

    /// The 2-D mask that `reshape` lays out as `[batch, 1, 1, length]`, when `reshape` ends
    /// the exported padding-mask lookup (see the module's doc).
    fn padded_mask(&self, reshape: &'a pb::NodeProto) -> Option<&'a str> {
        if reshape.op_type != "Reshape" || reshape.input.len() != 2 || reshape.output.len() != 1 {
            return None;
        }
        let flat = self.node(&reshape.input[0], "Reshape")?;
        if self.ints(flat.input.get(1)?)? != [-1] {
            return None;
        }
        let gather = self.node(&flat.input[0], "Gather")?;
        let flatten = self.node(gather.input.first()?, "Flatten")?;
        if int_attr(gather, "axis", 0) != 0 || int_attr(flatten, "axis", 1) != 2 {
            return None;
        }
        let mask = flatten.input.first()?.as_str();
        let indices = gather.input.get(1)?.as_str();
        let shape = match self.producer.get(reshape.input[1].as_str()) {
            Some(c) if c.op_type == "Concat" && c.input.len() == 1 => c.input[0].as_str(),
            _ => reshape.input[1].as_str(),
        };
        let shape = self.node(shape, "Shape")?;
        let whole = shape.attribute.is_empty() && shape.input.first()? == indices;
        (whole && self.uncast(mask) == MASK && self.is_mask_offsets(indices, mask)).then_some(mask)
    }

    /// The two operands of the `op` node writing `name`, in both orders (`Add` and `Mul`
    /// commute).
    fn operands(&self, name: &str, op: &str) -> Vec<(&'a str, &'a str)> {
        match self.node(name, op).map(|n| n.input.as_slice()) {
            Some([a, b]) => vec![(a, b), (b, a)],
            _ => vec![],
        }
    }

    /// Whether `indices` is `batch_idx * Shape(mask)[1] + kv_idx`.
    fn is_mask_offsets(&self, indices: &str, mask: &str) -> bool {
        self.operands(indices, "Add")
            .into_iter()
            .any(|(positions, rows)| {
                self.unsqueezed_range(positions)
                    .is_some_and(|(_, axis)| axis == 3)
                    && self.is_row_offsets(rows, mask)
            })
    }

    /// Whether `name` is `batch_idx * Shape(mask)[1]`, `batch_idx` counting the rows of a
    /// tensor (`Range(0, Shape(t)[0], 1)`) at axis 0 of four.
    fn is_row_offsets(&self, name: &str, mask: &str) -> bool {
        self.operands(name, "Mul").into_iter().any(|(rows, width)| {
            let counts_rows = self.unsqueezed_range(rows).is_some_and(|(range, axis)| {
                axis == 0 && self.dim_of_shape(&range.input[1], 0).is_some()
            });
            counts_rows && self.dim_of_shape(width, 1) == Some(mask)
        })
    }

    /// The tensor whose dimension `axis` `name` is: `Gather(Shape(t), axis)` (maybe cast).
    fn dim_of_shape(&self, name: &'a str, axis: i64) -> Option<&'a str> {
        let gather = self.node(self.uncast(name), "Gather")?;
        let shape = self.node(gather.input.first()?, "Shape")?;
        let index = self.ints(gather.input.get(1)?)?;
        if int_attr(gather, "axis", 0) != 0 || !shape.attribute.is_empty() || index != [axis] {
            return None;
        }
        shape.input.first().map(String::as_str)
    }

    /// `Range(0, n, 1)` with axes inserted around it to make four: the range and the axis it
    /// ends up on.
    fn unsqueezed_range(&self, mut name: &'a str) -> Option<(&'a pb::NodeProto, usize)> {
        let mut inserted = vec![];
        let range = loop {
            let node = *self.producer.get(name)?;
            match node.op_type.as_str() {
                "Unsqueeze" => {
                    let axes = match node.input.get(1) {
                        Some(axes) => self.ints(axes)?,
                        None => node
                            .attribute
                            .iter()
                            .find(|a| a.name == "axes")?
                            .ints
                            .clone(),
                    };
                    inserted.push(axes);
                    name = node.input.first()?;
                }
                "Range" => break node,
                _ => return None,
            }
        };
        let (start, delta) = (range.input.first()?, range.input.get(2)?);
        if self.ints(start)? != [0] || self.ints(delta)? != [1] {
            return None;
        }
        let (mut rank, mut axis) = (1, 0);
        for axes in inserted.iter().rev() {
            (rank, axis) = unsqueezed_axis(rank, axis, axes)?;
        }
        (rank == 4).then_some((range, axis))
    }
}

/// Where axis `axis` of a tensor of rank `rank` lands once `Unsqueeze` inserts `axes` (ONNX:
/// the positions of the new axes in the output), and the new rank.
fn unsqueezed_axis(rank: usize, axis: usize, axes: &[i64]) -> Option<(usize, usize)> {
    let out = rank + axes.len();
    let mut new: Vec<i64> = axes
        .iter()
        .map(|&a| if a < 0 { a + out as i64 } else { a })
        .collect();
    new.sort_unstable();
    new.dedup();
    if new.len() != axes.len() || new.iter().any(|&a| a < 0 || a >= out as i64) {
        return None;
    }
    let at = (0..out).filter(|&j| !new.contains(&(j as i64))).nth(axis)?;
    Some((out, at))
}

/// An integer attribute, or its default.
fn int_attr(node: &pb::NodeProto, name: &str, default: i64) -> i64 {
    node.attribute
        .iter()
        .find(|a| a.name == name)
        .map_or(default, |a| a.i)
}

/// The values of an int64 or int32 tensor.
fn tensor_ints(t: &pb::TensorProto) -> Option<Vec<i64>> {
    use pb::tensor_proto::DataType;
    if t.data_type == DataType::Int64 as i32 {
        if !t.int64_data.is_empty() {
            return Some(t.int64_data.clone());
        }
        let chunks = t.raw_data.chunks_exact(8);
        Some(
            chunks
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect(),
        )
    } else if t.data_type == DataType::Int32 as i32 {
        if !t.int32_data.is_empty() {
            return Some(t.int32_data.iter().map(|&v| v as i64).collect());
        }
        let chunks = t.raw_data.chunks_exact(4);
        Some(
            chunks
                .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()) as i64)
                .collect(),
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::prelude::*;

    fn node(op: &str, inputs: &[&str], output: &str, ints: &[(&str, i64)]) -> pb::NodeProto {
        pb::NodeProto {
            op_type: op.into(),
            name: output.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.into()],
            attribute: (ints.iter())
                .map(|&(name, i)| pb::AttributeProto {
                    name: name.into(),
                    r#type: pb::attribute_proto::AttributeType::Int as i32,
                    i,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn constant(name: &str, dims: &[i64], values: &[i64]) -> pb::TensorProto {
        pb::TensorProto {
            name: name.into(),
            data_type: pb::tensor_proto::DataType::Int64 as i32,
            dims: dims.to_vec(),
            int64_data: values.to_vec(),
            ..Default::default()
        }
    }

    /// A graph that computes the exported lookup from `attention_mask` (`[batch, length]`,
    /// int64) to `padded` (`[batch, 1, 1, length]`, bool), as SmolLM2's export does (three
    /// one-axis `Unsqueeze`s per range, the indices' shape through a `Concat`). `kv_start`:
    /// where the key positions start (0 in the exported graphs).
    fn lookup_graph(kv_start: i64, flatten_axis: i64) -> pb::ModelProto {
        let bool_type = pb::tensor_proto::DataType::Bool as i64;
        let nodes = vec![
            node("Cast", &["attention_mask"], "x", &[("to", bool_type)]),
            node("Shape", &["x"], "x_shape", &[]),
            node("Gather", &["x_shape", "zero"], "rows", &[("axis", 0)]),
            node("Gather", &["x_shape", "one_1d"], "width", &[("axis", 0)]),
            node("Range", &["zero", "rows", "one"], "row_range", &[]),
            node("Unsqueeze", &["row_range", "axis1"], "r1", &[]),
            node("Unsqueeze", &["r1", "axis2"], "r2", &[]),
            node("Unsqueeze", &["r2", "axis3"], "r3", &[]),
            node("Mul", &["r3", "width"], "row_offsets", &[]),
            node("Gather", &["x_shape", "one"], "length", &[("axis", 0)]),
            node("Range", &["kv_start", "length", "one"], "kv_range", &[]),
            node("Unsqueeze", &["kv_range", "axis0"], "k1", &[]),
            node("Unsqueeze", &["k1", "axis1"], "k2", &[]),
            node("Unsqueeze", &["k2", "axis2"], "k3", &[]),
            node("Add", &["k3", "row_offsets"], "indices", &[]),
            node("Flatten", &["x"], "flat_mask", &[("axis", flatten_axis)]),
            node(
                "Gather",
                &["flat_mask", "indices"],
                "gathered",
                &[("axis", 0)],
            ),
            node("Reshape", &["gathered", "minus_one"], "flat", &[]),
            node("Shape", &["indices"], "indices_shape", &[]),
            node("Concat", &["indices_shape"], "target", &[("axis", 0)]),
            node("Reshape", &["flat", "target"], "padded", &[]),
        ];
        let int64 = pb::tensor_proto::DataType::Int64 as i32;
        let tensor_type = |elem_type: i32| pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type,
                shape: None,
            })),
            ..Default::default()
        };
        let value = |name: &str, elem_type: i32| pb::ValueInfoProto {
            name: name.into(),
            r#type: Some(tensor_type(elem_type)),
            ..Default::default()
        };
        pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            graph: Some(pb::GraphProto {
                node: nodes,
                initializer: vec![
                    constant("zero", &[], &[0]),
                    constant("one", &[], &[1]),
                    constant("kv_start", &[], &[kv_start]),
                    constant("one_1d", &[1], &[1]),
                    constant("minus_one", &[1], &[-1]),
                    constant("axis0", &[1], &[0]),
                    constant("axis1", &[1], &[1]),
                    constant("axis2", &[1], &[2]),
                    constant("axis3", &[1], &[3]),
                ],
                input: vec![value("attention_mask", int64)],
                output: vec![value("padded", pb::tensor_proto::DataType::Bool as i32)],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn run(proto: &pb::ModelProto, mask: &[i64], rows: usize) -> Tensor {
        let length = mask.len() / rows;
        let mut model = crate::model::ops::onnx()
            .model_for_proto_model(proto)
            .unwrap();
        let fact = InferenceFact::dt_shape(i64::datum_type(), [rows, length]);
        model.set_input_fact(0, fact).unwrap();
        let plan = model.into_optimized().unwrap().into_runnable().unwrap();
        let mask = Tensor::from_shape(&[rows, length], mask).unwrap();
        let mut out = plan.run(tvec![mask.into_tvalue()]).unwrap();
        out.remove(0).into_tensor()
    }

    #[test]
    fn the_lookup_becomes_the_mask_with_two_axes_inserted() {
        let original = lookup_graph(0, 2);
        let mut rewritten = original.clone();
        assert_eq!(rewrite(&mut rewritten), 1);
        let graph = rewritten.graph.as_ref().unwrap();
        let ops: Vec<&str> = graph.node.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Cast", "Unsqueeze"]);
        for (mask, rows) in [
            (&[1i64, 1, 0, 1, 1, 0, 1, 1, 1, 1][..], 2),
            (&[0, 1, 1][..], 3),
        ] {
            let want = run(&original, mask, rows);
            let got = run(&rewritten, mask, rows);
            assert_eq!(want, got, "{mask:?}");
            let length = mask.len() / rows;
            assert_eq!(got.shape(), [rows, 1, 1, length]);
            let values: Vec<bool> = mask.iter().map(|&m| m != 0).collect();
            assert_eq!(
                got.try_as_plain_ram().unwrap().as_slice::<bool>().unwrap(),
                values
            );
        }
    }

    #[test]
    fn other_lookups_stay() {
        // Key positions from 1: the lookup reads the next row's first value.
        for (kv_start, flatten_axis) in [(1, 2), (0, 1)] {
            let mut proto = lookup_graph(kv_start, flatten_axis);
            assert_eq!(rewrite(&mut proto), 0, "{kv_start} {flatten_axis}");
            assert_eq!(proto, lookup_graph(kv_start, flatten_axis));
        }
        // Rows laid out on another axis.
        let mut proto = lookup_graph(0, 2);
        let graph = proto.graph.as_mut().unwrap();
        graph.node[5].input[1] = "axis0".into();
        let before = proto.clone();
        assert_eq!(rewrite(&mut proto), 0);
        assert_eq!(proto, before);
        // A mask that is not the graph's `attention_mask`.
        let mut proto = lookup_graph(0, 2);
        let graph = proto.graph.as_mut().unwrap();
        graph.input[0].name = "mask".into();
        graph.node[0].input[0] = "mask".into();
        let before = proto.clone();
        assert_eq!(rewrite(&mut proto), 0);
        assert_eq!(proto, before);
    }

    #[test]
    fn exported_decoders_have_the_lookup() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for file in [
            "models/llama/model.onnx",
            "vlm/models/smolvlm/onnx/decoder_model_merged.onnx",
        ] {
            let bytes = std::fs::read(root.join(file)).unwrap();
            let mut proto = crate::model::onnx::decode(&bytes, None, file).unwrap();
            let nodes = proto.graph.as_ref().unwrap().node.len();
            assert_eq!(rewrite(&mut proto), 1, "{file}");
            let graph = proto.graph.as_ref().unwrap();
            assert!(graph.node.iter().all(|n| n.op_type != "Flatten"), "{file}");
            assert!(graph.node.len() < nodes, "{file}");
        }
    }
}
