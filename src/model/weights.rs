//! Weight-bound `MatMul`s before tract sees a graph: the weights are read where they lie.
//!
//! * A `MatMul` whose `B` is a float32 or float16 matrix initializer that only `MatMul`s read
//!   (as their `B`; in subgraphs too, such as both branches of a merged decoder's `If`)
//!   becomes a `MatMulWeights` node (`ops/matmul_weights.rs`), the matrix transposed to `[N, K]`
//!   in place, in panels of four rows for f32 (one dot product per output when decoding; tract
//!   would keep its template's copy and a packed copy). Read by other nodes too, a float16
//!   matrix is read as `[K, N]`.
//! * A `MatMul` whose `B` is the `Transpose` of a rank-2 initializer (a tied `lm_head` reading
//!   the embedding table) becomes a `MatMulWeights` node reading the table itself: tract would
//!   otherwise keep a transposed copy and a packed copy of it.
//! * An 8-bit matrix `[K, N]` that only `MatMulInteger`s read (as their `B`, at the top level)
//!   is stored in blocks of four columns in place (`ops/matmul_integer.rs`,
//!   `Layout::Blocks`), the nodes' `layout` attribute set to say so: a decoding step reads
//!   each block in one stream, four blocks at a time.
//! * A 4-bit `MatMulNBits` weight (blocks of 32 values or more, N a multiple of 16, integer
//!   zero points) that only its node reads is laid out in lanes with its scales, sixteen
//!   columns together, four columns' values in each 16-bit lane (`ops/matmul_nbits.rs`,
//!   `to_lanes`), the node's `layout` attribute set to say so: a decoding step separates the
//!   columns with shifts alone, a column a lane of its sums.
//! * In decoder and encoder graphs, the `MatMul`s of runtime operands (the attention products)
//!   become `MatMulRuntime` (`runtime_matmuls`); one by a `Transpose` of the last two axes
//!   (scaled or not: the keys of `Q K^T`) reads the untransposed tensor (`trans_b`), and one by
//!   another `Transpose` reads the keys that a transpose of the same input gives.
//! * float16 graphs (`model_fp16.onnx`) are computed in f32 with the large weights kept in
//!   f16 (tract computes f16 arithmetic slowly without native f16, on x86 and in wasm, and
//!   converting every weight to f32 would double the memory): every `MatMul` whose `B` is a
//!   float16 initializer becomes a `MatMulWeights` node (f16 weights, f32 sums); a `Gather`
//!   from a float16 table gathers f16 rows and casts them; every other float16 value becomes
//!   float32: the remaining initializers, `Constant` and `ConstantOfShape` values,
//!   `Cast(to=float16)`, the graph's inputs and outputs (so the KV cache and the logits are
//!   f32). The result is the f32 model with f16-rounded weights (onnxruntime on x86 also
//!   computes most float16 ops through f32).

use std::collections::{HashMap, HashSet};

use tract_onnx::pb;

use crate::error::{Error, Result};
use crate::model::onnx::Apart;
use crate::model::ops::linalg::{transpose_nk, transpose_panels};
use crate::model::ops::matmul_weights::Layout;
use crate::model::ops::{matmul_integer, matmul_nbits};
use tract_onnx::prelude::Tensor;

const FLOAT: i32 = pb::tensor_proto::DataType::Float as i32;
const FLOAT16: i32 = pb::tensor_proto::DataType::Float16 as i32;
const INT8: i32 = pb::tensor_proto::DataType::Int8 as i32;
const UINT8: i32 = pb::tensor_proto::DataType::Uint8 as i32;

/// The op type of the rewritten `MatMul`s (registered in `ops/mod.rs`).
pub const MATMUL_WEIGHTS: &str = "MatMulWeights";

/// Whether the graph computes in float16 (its inputs, outputs or initializers are float16).
pub fn is_f16_graph(graph: &pb::GraphProto) -> bool {
    let io_f16 = graph
        .input
        .iter()
        .chain(&graph.output)
        .any(|v| value_elem_type(v) == Some(FLOAT16));
    io_f16 || graph.initializer.iter().any(|t| t.data_type == FLOAT16)
}

fn value_elem_type(v: &pb::ValueInfoProto) -> Option<i32> {
    match v.r#type.as_ref()?.value.as_ref()? {
        pb::type_proto::Value::TensorType(t) => Some(t.elem_type),
    }
}

/// Route weight-bound `MatMul`s to `MatMulWeights`, and make a float16 graph compute in f32
/// (see the module's documentation).
///
/// `apart`: the data of initializers kept apart from the protobuf (`onnx::Decoded`).
pub fn rewrite(proto: &mut pb::ModelProto, apart: &mut Apart) -> Result<()> {
    let Some(graph) = proto.graph.as_mut() else {
        return Ok(());
    };
    let f16 = is_f16_graph(graph);
    let matrices: HashSet<String> = float_matrices(&graph.initializer).collect();
    let f16_matrices: HashSet<String> = graph
        .initializer
        .iter()
        .filter(|t| t.data_type == FLOAT16 && t.dims.len() == 2)
        .map(|t| t.name.clone())
        .collect();
    let transposed = transposed_matrices(&graph.node, &matrices);
    // How many reads each value has in the graph and its subgraphs, and how many of those are
    // the `B` of a `MatMul`: a matrix is transposed in place only when `MatMul`s alone read it
    // (one at the top level, or one in each branch of a merged decoder's `If`).
    let mut readers: HashMap<String, Reads> = HashMap::new();
    count_reads(&graph.node, &mut readers);
    // A subgraph's own initializer of the same name would hide the matrix from its nodes.
    let mut shadowed = HashSet::new();
    subgraph_initializers(&graph.node, &mut shadowed);
    // The initializers whose data are bytes (`raw_data`, or kept apart), which transpose in place.
    let in_bytes: HashSet<&str> = graph
        .initializer
        .iter()
        .filter(|t| !t.raw_data.is_empty() || apart.contains_key(&t.name))
        .map(|t| t.name.as_str())
        .collect();
    // The f32 matrices `[K, N]` with K a multiple of four, which transpose into panels.
    let panel_ready: HashSet<&str> = graph
        .initializer
        .iter()
        .filter(|t| t.data_type == FLOAT && t.dims.len() == 2 && t.dims[0] % 4 == 0)
        .map(|t| t.name.as_str())
        .collect();
    // The matrices transposed in place, and their layout.
    let transpose: HashMap<String, Layout> = readers
        .iter()
        .filter(|(_, reads)| reads.all > 0 && reads.all == reads.matmul_b)
        .filter(|(b, _)| !graph.output.iter().any(|o| &o.name == *b) && !shadowed.contains(*b))
        .filter(|(b, _)| matrices.contains(*b) && in_bytes.contains(b.as_str()))
        .map(|(b, _)| {
            let layout = if panel_ready.contains(b.as_str()) {
                Layout::Panels
            } else {
                Layout::Nk
            };
            (b.clone(), layout)
        })
        .collect();
    let integer_blocks = integer_block_matrices(graph, &readers, &in_bytes, &shadowed);
    let lanes = nbits_lanes(graph, &readers, &in_bytes, &shadowed);
    drop((readers, in_bytes, panel_ready));
    let mut kept_f16: HashSet<String> = HashSet::new();
    weights_in_subgraphs(&mut graph.node, &transpose, &mut kept_f16);
    let mut nodes = Vec::with_capacity(graph.node.len());
    for mut node in std::mem::take(&mut graph.node) {
        let b = node.input.get(1).cloned().unwrap_or_default();
        if is_plain_matmul(&node) {
            let f16 = f16_matrices.contains(&b);
            let weight = if let Some(&layout) = transpose.get(&b) {
                Some((b.clone(), layout))
            } else if f16 {
                Some((b.clone(), Layout::Kn))
            } else {
                transposed.get(&b).map(|m| (m.clone(), Layout::Nk))
            };
            if let Some((matrix, layout)) = weight {
                node.op_type = MATMUL_WEIGHTS.into();
                node.input[1] = matrix.clone();
                node.attribute.push(layout_attribute(layout.attribute()));
                kept_f16.insert(matrix);
                nodes.push(node);
                continue;
            }
        }
        let table = node.input.first().cloned().unwrap_or_default();
        if node.op_type == "Gather" && f16_matrices.contains(&table) && node.output.len() == 1 {
            let out = node.output[0].clone();
            let rows = format!("{out}/f16");
            node.output[0] = rows.clone();
            kept_f16.insert(table);
            nodes.push(node);
            nodes.push(cast_node(&format!("{out}/to_f32"), &rows, &out));
            continue;
        }
        nodes.push(node);
    }
    graph.node = nodes;
    // The transposes now read by no node would be folded by tract for nothing.
    let read: HashSet<String> = graph
        .node
        .iter()
        .flat_map(|n| n.input.iter().cloned())
        .chain(graph.output.iter().map(|o| o.name.clone()))
        .collect();
    graph.node.retain(|n| {
        let unread_transpose = n.op_type == "Transpose"
            && transposed.contains_key(&n.output[0])
            && !read.contains(&n.output[0]);
        !unread_transpose
    });
    for t in graph.initializer.iter_mut() {
        if let Some(&layout) = transpose.get(&t.name) {
            transpose_matrix(t, apart.get_mut(&t.name), layout)?;
        }
        if integer_blocks.contains(&t.name) {
            matrix_to_blocks(t, apart.get_mut(&t.name))?;
        }
        if let Some(&lanes) = lanes.get(&t.name) {
            into_lanes(t, apart.get_mut(&t.name), lanes)?;
        }
    }
    for node in graph.node.iter_mut() {
        if is_matmul_nbits(node) && lanes.contains_key(&node.input[1]) {
            node.attribute
                .push(layout_attribute(matmul_nbits::LANES_ATTRIBUTE));
        }
        if is_matmul_integer(node) && integer_blocks.contains(&node.input[1]) {
            node.attribute
                .push(layout_attribute(matmul_integer::BLOCKS_ATTRIBUTE));
        }
    }
    if !f16 {
        return Ok(());
    }
    for t in graph.initializer.iter_mut() {
        if t.data_type == FLOAT16 && !kept_f16.contains(&t.name) {
            // Converted in the protobuf (a new buffer either way).
            if let Some(bytes) = apart.remove(&t.name) {
                t.raw_data = bytes.as_bytes().to_vec();
            }
            tensor_to_f32(t)?;
        }
    }
    for v in graph.input.iter_mut().chain(graph.output.iter_mut()) {
        if let Some(pb::type_proto::Value::TensorType(t)) =
            v.r#type.as_mut().and_then(|t| t.value.as_mut())
        {
            if t.elem_type == FLOAT16 {
                t.elem_type = FLOAT;
            }
        }
    }
    graph.value_info.clear();
    rewrite_nodes(&mut graph.node)
}

/// How a value is read: by how many node inputs (and subgraph outputs), and how many of those
/// are the `B` of a plain `MatMul`.
#[derive(Default)]
pub(crate) struct Reads {
    pub(crate) all: usize,
    matmul_b: usize,
}

/// An ONNX `MatMulInteger` with a `B` and one output.
fn is_matmul_integer(node: &pb::NodeProto) -> bool {
    node.op_type == "MatMulInteger"
        && node.domain.is_empty()
        && node.input.len() >= 2
        && node.output.len() == 1
}

/// The 8-bit matrices `[K, N]` (K a multiple of 4, N of 16, their data bytes) that only
/// `MatMulInteger`s of the graph read, as their `B`, each with no zero point or one initializer
/// of its type with one value or one per column (what `ops::matmul_integer` takes; tract's own
/// `MatMulInteger` would read the blocks as rows): stored in blocks
/// (`matmul_integer::Layout::Blocks`), so that a decoding step reads each block of four
/// columns in one stream.
fn integer_block_matrices(
    graph: &pb::GraphProto,
    readers: &HashMap<String, Reads>,
    in_bytes: &HashSet<&str>,
    shadowed: &HashSet<String>,
) -> HashSet<String> {
    let initializers: HashMap<&str, &pb::TensorProto> = graph
        .initializer
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let eight_bits = [INT8, UINT8];
    let fits = |t: &pb::TensorProto| match t.dims.as_slice() {
        &[k, n] if k > 0 && n > 0 && eight_bits.contains(&t.data_type) => {
            matmul_integer::fits_blocks(k as usize, n as usize)
        }
        _ => false,
    };
    // Per matrix: its reads as the `B` of a `MatMulInteger` that takes it in blocks.
    let mut taken: HashMap<&str, usize> = HashMap::new();
    for node in graph.node.iter().filter(|n| is_matmul_integer(n)) {
        let Some(b) = initializers.get(node.input[1].as_str()).filter(|b| fits(b)) else {
            continue;
        };
        let zero_fits = match node.input.get(3).filter(|z| !z.is_empty()) {
            None => true,
            Some(z) => initializers.get(z.as_str()).is_some_and(|z| {
                let len: i64 = z.dims.iter().product();
                z.data_type == b.data_type && (len == 1 || len == b.dims[1])
            }),
        };
        if zero_fits {
            *taken.entry(b.name.as_str()).or_default() += 1;
        }
    }
    taken
        .into_iter()
        .filter(|(b, count)| readers.get(*b).is_some_and(|r| r.all == *count))
        .filter(|(b, _)| in_bytes.contains(b) && !shadowed.contains(*b))
        .filter(|(b, _)| !graph.output.iter().any(|o| o.name == *b))
        .map(|(b, _)| b.to_string())
        .collect()
}

/// An 8-bit matrix `[K, N]` into blocks, in place from one copy (`matmul_integer::to_blocks`);
/// its dims stay `[K, N]`.
fn matrix_to_blocks(t: &mut pb::TensorProto, apart: Option<&mut Tensor>) -> Result<()> {
    let (k, n) = (t.dims[0] as usize, t.dims[1] as usize);
    let bytes = match apart {
        Some(tensor) => tensor.as_bytes_mut(),
        None => &mut t.raw_data[..],
    };
    if bytes.len() != k * n {
        return Err(Error::Model(format!(
            "tensor `{}` of dims {:?} has {} bytes; expected {}",
            t.name,
            t.dims,
            bytes.len(),
            k * n
        )));
    }
    let copy = bytes.to_vec();
    matmul_integer::to_blocks(&copy, k, n, t.data_type == INT8, bytes);
    Ok(())
}

/// A `MatMulNBits` with its `B` and `scales` and one output.
fn is_matmul_nbits(node: &pb::NodeProto) -> bool {
    node.op_type == "MatMulNBits" && node.input.len() >= 3 && node.output.len() == 1
}

/// What [`into_lanes`] does to an initializer of a `MatMulNBits` in lanes.
#[derive(Clone, Copy)]
enum Lanes {
    /// The 4-bit weight: N columns of `padded` values (`matmul_nbits::to_lanes`).
    Weight { n: usize, padded: usize },
    /// Its scales: N columns of `blocks` (`matmul_nbits::scales_to_lanes`).
    Scales { n: usize, blocks: usize },
}

/// The 4-bit weights of the graph's `MatMulNBits`s that fit lanes (`matmul_nbits::fits_lanes`:
/// blocks of 32 values or more, N a multiple of 16) and their scales, to be laid out so
/// (`matmul_nbits::to_lanes`), so that a decoding step reads four columns' values in each
/// 16-bit lane and separates them with shifts alone: each a `uint8` `B` of `N * blocks *
/// block_size / 2` bytes and its float or float16 scales of `N * blocks` values, data bytes
/// that this node alone reads (no `GatherBlockQuantized` sharing the weight, say), its zero
/// points absent or `uint8`, no `g_idx`.
fn nbits_lanes(
    graph: &pb::GraphProto,
    readers: &HashMap<String, Reads>,
    in_bytes: &HashSet<&str>,
    shadowed: &HashSet<String>,
) -> HashMap<String, Lanes> {
    let initializers: HashMap<&str, &pb::TensorProto> = graph
        .initializer
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let attr = |node: &pb::NodeProto, name: &str| {
        node.attribute.iter().find(|a| a.name == name).map(|a| a.i)
    };
    let own = |name: &str| {
        readers.get(name).is_some_and(|r| r.all == 1)
            && in_bytes.contains(name)
            && !shadowed.contains(name)
            && !graph.output.iter().any(|o| o.name == name)
    };
    let values = |t: &pb::TensorProto| t.dims.iter().product::<i64>();
    let mut lanes = HashMap::new();
    for node in graph.node.iter().filter(|n| is_matmul_nbits(n)) {
        let (Some(k), Some(n), Some(bs)) =
            (attr(node, "K"), attr(node, "N"), attr(node, "block_size"))
        else {
            continue;
        };
        let bits = attr(node, "bits").unwrap_or(4);
        if k <= 0 || n <= 0 || bs <= 0 || attr(node, "layout").is_some() {
            continue;
        }
        let (k, n, bs) = (k as usize, n as usize, bs as usize);
        if !(bs.is_power_of_two() && matmul_nbits::fits_lanes(bits as usize, bs, n)) {
            continue;
        }
        let blocks = k.div_ceil(bs);
        let (b, scales) = (node.input[1].as_str(), node.input[2].as_str());
        let zero_fits = match node.input.get(3).filter(|z| !z.is_empty()) {
            None => true,
            Some(z) => initializers
                .get(z.as_str())
                .is_some_and(|z| z.data_type == UINT8),
        };
        let g_idx = node.input.get(4).is_some_and(|g| !g.is_empty());
        let fits = |name: &str, types: &[i32], len: usize| {
            initializers
                .get(name)
                .is_some_and(|t| types.contains(&t.data_type) && values(t) == len as i64)
                && own(name)
        };
        if zero_fits
            && !g_idx
            && b != scales
            && fits(b, &[UINT8], n * blocks * bs / 2)
            && fits(scales, &[FLOAT, FLOAT16], n * blocks)
        {
            let padded = blocks * bs;
            lanes.insert(b.to_string(), Lanes::Weight { n, padded });
            lanes.insert(scales.to_string(), Lanes::Scales { n, blocks });
        }
    }
    lanes
}

/// A `MatMulNBits`' weight or scales into lanes, in place from one copy; its dims stay.
fn into_lanes(t: &mut pb::TensorProto, apart: Option<&mut Tensor>, lanes: Lanes) -> Result<()> {
    let size = match t.data_type {
        UINT8 => 1,
        FLOAT16 => 2,
        _ => 4,
    };
    let bytes = match apart {
        Some(tensor) => tensor.as_bytes_mut(),
        None => &mut t.raw_data[..],
    };
    let want = t.dims.iter().product::<i64>() as usize * size;
    if bytes.len() != want {
        return Err(Error::Model(format!(
            "tensor `{}` of dims {:?} has {} bytes; expected {want}",
            t.name,
            t.dims,
            bytes.len()
        )));
    }
    let copy = bytes.to_vec();
    match lanes {
        Lanes::Weight { n, padded } => matmul_nbits::to_lanes(&copy, n, padded, bytes),
        Lanes::Scales { n, blocks } => matmul_nbits::scales_to_lanes(&copy, size, n, blocks, bytes),
    }
    Ok(())
}

/// An ONNX `MatMul` of two inputs.
fn is_plain_matmul(node: &pb::NodeProto) -> bool {
    node.op_type == "MatMul" && node.domain.is_empty() && node.input.len() == 2
}

/// The subgraphs of `nodes` (an `If`'s branches, a `Loop`'s body).
fn subgraphs(nodes: &[pb::NodeProto]) -> impl Iterator<Item = &pb::GraphProto> {
    nodes
        .iter()
        .flat_map(|n| n.attribute.iter().filter_map(|a| a.g.as_ref()))
}

/// Adds the reads of `nodes` and of their subgraphs to `reads`.
pub(crate) fn count_reads(nodes: &[pb::NodeProto], reads: &mut HashMap<String, Reads>) {
    for node in nodes {
        for (i, input) in node.input.iter().enumerate() {
            let r = reads.entry(input.clone()).or_default();
            r.all += 1;
            r.matmul_b += (i == 1 && is_plain_matmul(node)) as usize;
        }
    }
    for g in subgraphs(nodes) {
        for o in &g.output {
            reads.entry(o.name.clone()).or_default().all += 1;
        }
        count_reads(&g.node, reads);
    }
}

/// The initializers of the subgraphs of `nodes`, at any depth.
fn subgraph_initializers(nodes: &[pb::NodeProto], names: &mut HashSet<String>) {
    for g in subgraphs(nodes) {
        names.extend(g.initializer.iter().map(|t| t.name.clone()));
        subgraph_initializers(&g.node, names);
    }
}

/// In the subgraphs of `nodes`, the `MatMul`s by a matrix of `transpose` become
/// `MatMulWeights` reading it in its layout (a merged decoder's weights are read from both
/// branches of its `If`: tract multiplied them there, for Whisper base's decoder with its
/// matrix-vector kernel at every step and its 8x8 kernel for the 1500 encoder frames of the
/// cross-attention's keys and values).
fn weights_in_subgraphs(
    nodes: &mut [pb::NodeProto],
    transpose: &HashMap<String, Layout>,
    kept_f16: &mut HashSet<String>,
) {
    let graphs = nodes
        .iter_mut()
        .flat_map(|n| n.attribute.iter_mut().filter_map(|a| a.g.as_mut()));
    for g in graphs {
        for node in g.node.iter_mut() {
            if let Some(&layout) = transpose.get(&node.input.get(1).cloned().unwrap_or_default()) {
                if is_plain_matmul(node) {
                    node.op_type = MATMUL_WEIGHTS.into();
                    node.attribute.push(layout_attribute(layout.attribute()));
                    kept_f16.insert(node.input[1].clone());
                }
            }
        }
        weights_in_subgraphs(&mut g.node, transpose, kept_f16);
    }
}

/// The `MatMul`s of a decoder graph whose `B` is no initializer (the attention products) become
/// `MatMulRuntime` (`ops/matmul_runtime.rs`), in subgraphs too (a merged decoder's branches).
/// Run after `rewrite` (whose weight `MatMul`s read initializers, or the transposed tables it
/// resolves), on decoder graphs and on an encoder's (Whisper's attention over 1500 frames:
/// its encoder took 2.6 s in wasm instead of 3.1 s with tract's packed kernel).
///
/// In a subgraph, a `MatMul` by the transpose of a float matrix initializer (a merged decoder's
/// tied `lm_head`, which `rewrite` does not see in the branches) becomes `MatMulWeights`
/// reading the matrix in place, as `rewrite` makes it at the top level.
///
/// A `MatMul` by `Transpose(K)` over the last two axes (or by a transpose of another tensor
/// that comes to the same, `K` then a transpose of that tensor too), or by that times a scalar
/// `s` ([`transposed_operands`]), becomes `MatMulRuntime(A, K)` (or `(Mul(A, s), K)`) with
/// `trans_b`: tract copied the transposed keys at every step (in Whisper's decoder its 1500
/// cached encoder keys per layer, a quarter of a step).
pub fn runtime_matmuls(proto: &mut pb::ModelProto) {
    /// Float matrices among the initializers in scope.
    fn visit(graph: &mut pb::GraphProto, outer: &HashSet<String>, matrices: &HashSet<String>) {
        let mut initializers = outer.clone();
        initializers.extend(graph.initializer.iter().map(|t| t.name.clone()));
        let mut matrices = matrices.clone();
        matrices.extend(float_matrices(&graph.initializer));
        let transposed = transposed_matrices(&graph.node, &matrices);
        let (keys, mut made) = transposed_operands(graph);
        let mut nodes = Vec::with_capacity(graph.node.len());
        for mut node in std::mem::take(&mut graph.node) {
            let is_matmul = node.op_type == "MatMul" && node.domain.is_empty();
            let b = node.input.get(1).cloned().unwrap_or_default();
            if is_matmul && node.input.len() == 2 && transposed.contains_key(&b) {
                node.op_type = MATMUL_WEIGHTS.into();
                node.input[1] = transposed[&b].clone();
                node.attribute
                    .push(layout_attribute(Layout::Nk.attribute()));
            } else if is_matmul && !initializers.contains(&b) {
                node.op_type = crate::model::ops::matmul_runtime::MATMUL_RUNTIME.into();
                if let Some((k, scale)) = keys.get(&b) {
                    // `K` made before its first product.
                    nodes.extend(made.remove(k));
                    // `A @ (K^T s)` as `(A s) @ K^T`, K read as it lies.
                    if let Some(scale) = scale {
                        let scaled = format!("{}/scaled_a", node.output[0]);
                        let mul = pb::NodeProto {
                            op_type: "Mul".into(),
                            name: scaled.clone(),
                            input: vec![node.input[0].clone(), scale.clone()],
                            output: vec![scaled.clone()],
                            ..Default::default()
                        };
                        nodes.push(mul);
                        node.input[0] = scaled;
                    }
                    node.input[1] = k.clone();
                    node.attribute.push(pb::AttributeProto {
                        name: "trans_b".into(),
                        r#type: pb::attribute_proto::AttributeType::Int as i32,
                        i: 1,
                        ..Default::default()
                    });
                }
            }
            for attr in node.attribute.iter_mut() {
                if let Some(g) = attr.g.as_mut() {
                    visit(g, &initializers, &matrices);
                }
            }
            nodes.push(node);
        }
        graph.node = nodes;
    }
    if let Some(graph) = proto.graph.as_mut() {
        visit(graph, &HashSet::new(), &HashSet::new());
    }
}

/// `MatMul` operands that are a runtime tensor with its last two axes swapped, then maybe
/// scaled by a scalar: `Transpose(K, perm=[0, .., r-1, r-2])` (or another transpose of `K`'s
/// own input that comes to the same), or `Mul` of it by a one-value `Constant` or initializer
/// (optimum's attention scales `Q` and `K^T` by `d^-1/4` each).
/// Operand name -> (`K`, the scale's name); and the `Transpose` nodes that make the `K`s the
/// graph does not have, by name.
#[allow(clippy::type_complexity)]
fn transposed_operands(
    graph: &pb::GraphProto,
) -> (
    HashMap<String, (String, Option<String>)>,
    HashMap<String, pb::NodeProto>,
) {
    let one_value = |t: &pb::TensorProto| t.dims.iter().product::<i64>() == 1;
    let scalars: HashSet<&str> = graph
        .node
        .iter()
        .filter(|n| n.op_type == "Constant" && n.output.len() == 1)
        .filter(|n| {
            n.attribute
                .iter()
                .any(|a| a.t.as_ref().is_some_and(one_value))
        })
        .map(|n| n.output[0].as_str())
        .chain(
            graph
                .initializer
                .iter()
                .filter(|t| one_value(t))
                .map(|t| t.name.as_str()),
        )
        .collect();
    // Each `Transpose` with a `perm`: (input, perm, output).
    let all: Vec<(&str, &[i64], &str)> = graph
        .node
        .iter()
        .filter(|n| n.op_type == "Transpose" && n.input.len() == 1 && n.output.len() == 1)
        .filter_map(|n| Some((n.input[0].as_str(), perm(n)?, n.output[0].as_str())))
        .collect();
    // A transpose swapping the last two axes reads `K`; another, `Transpose(X, p)`, is `K^T`
    // for `K` a sibling `Transpose(X, q)` with `q` being `p` with its last two entries swapped
    // (optimum's Whisper decoder computes the present key `Transpose(X, [0, 2, 1, 3])` and, for
    // `Q K^T`, `Transpose(X, [0, 2, 3, 1])`: a second copy of the keys, per layer, of all 1500
    // encoder positions).
    // Without a sibling, `K` is made (`made`) when `p` takes the last two axes in the reverse
    // of their order in `X` (`X`'s rows as columns: keys, not values such as `Transpose(X, [0, 2,
    // 1, 3])`): Whisper's encoder computes only `Transpose(X, [0, 2, 3, 1])`, whose product then
    // took each block of rows in short dot products (`Ready::Copy`, the head's 64 values). `K`
    // is a copy as `K^T` was.
    let mut made = HashMap::new();
    let transposes: HashMap<&str, String> = all
        .iter()
        .filter_map(|&(x, p, out)| {
            if swaps_last_two(p) {
                return Some((out, x.to_string()));
            }
            let r = p.len();
            let mut q = p.to_vec();
            q.swap(r.checked_sub(2)?, r - 1);
            if let Some((_, _, k)) = all.iter().find(|&&(y, qs, _)| y == x && qs == q) {
                return Some((out, k.to_string()));
            }
            if p[r - 2] < p[r - 1] {
                return None;
            }
            let k = format!("{out}/keys");
            let transpose = pb::NodeProto {
                op_type: "Transpose".into(),
                name: k.clone(),
                input: vec![x.to_string()],
                output: vec![k.clone()],
                attribute: vec![pb::AttributeProto {
                    name: "perm".into(),
                    r#type: pb::attribute_proto::AttributeType::Ints as i32,
                    ints: q,
                    ..Default::default()
                }],
                ..Default::default()
            };
            made.insert(k.clone(), transpose);
            Some((out, k))
        })
        .collect();
    let mut found: HashMap<String, (String, Option<String>)> = transposes
        .iter()
        .map(|(t, k)| (t.to_string(), (k.clone(), None)))
        .collect();
    for n in &graph.node {
        if n.op_type != "Mul" || n.input.len() != 2 || n.output.len() != 1 {
            continue;
        }
        let (x, y) = (n.input[0].as_str(), n.input[1].as_str());
        let scaled = match (transposes.get(x), transposes.get(y)) {
            (Some(k), _) if scalars.contains(y) => Some((k, y)),
            (_, Some(k)) if scalars.contains(x) => Some((k, x)),
            _ => None,
        };
        if let Some((k, s)) = scaled {
            found.insert(n.output[0].clone(), (k.clone(), Some(s.to_string())));
        }
    }
    (found, made)
}

/// A `Transpose` node's `perm`, if it has one (without, it reverses the axes).
fn perm(node: &pb::NodeProto) -> Option<&[i64]> {
    let attr = node.attribute.iter().find(|a| a.name == "perm")?;
    Some(&attr.ints)
}

/// Whether `perm` swaps the last two axes and keeps the others (`[1, 0]` for a matrix).
fn swaps_last_two(perm: &[i64]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[..r - 2]
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i as i64)
        && perm[r - 2..] == [r as i64 - 1, r as i64 - 2]
}

/// The names of the float32 and float16 matrices among `initializers`.
fn float_matrices(initializers: &[pb::TensorProto]) -> impl Iterator<Item = String> + '_ {
    initializers
        .iter()
        .filter(|t| t.dims.len() == 2 && (t.data_type == FLOAT || t.data_type == FLOAT16))
        .map(|t| t.name.clone())
}

/// The outputs of `Transpose(perm=[1, 0])` nodes of one of `matrices` (float matrix
/// initializers): output name -> the matrix.
fn transposed_matrices(
    nodes: &[pb::NodeProto],
    matrices: &HashSet<String>,
) -> HashMap<String, String> {
    nodes
        .iter()
        .filter(|n| n.op_type == "Transpose" && n.input.len() == 1 && n.output.len() == 1)
        .filter(|n| matrices.contains(&n.input[0]))
        .filter(|n| perm(n).is_none_or(swaps_last_two))
        .map(|n| (n.output[0].clone(), n.input[0].clone()))
        .collect()
}

/// The `layout` attribute that tells an op how its weight was laid out here (`Layout`'s, or
/// `MatMulInteger`'s blocks, or `MatMulNBits`' lanes).
fn layout_attribute(value: i64) -> pb::AttributeProto {
    pb::AttributeProto {
        name: "layout".into(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i: value,
        ..Default::default()
    }
}

/// `Cast(to=float16)` -> float, float16 constants -> f32, in subgraphs too.
fn rewrite_nodes(nodes: &mut [pb::NodeProto]) -> Result<()> {
    for node in nodes {
        for attr in node.attribute.iter_mut() {
            if node.op_type == "Cast" && attr.name == "to" && attr.i == FLOAT16 as i64 {
                attr.i = FLOAT as i64;
            }
            if let Some(t) = attr.t.as_mut() {
                if t.data_type == FLOAT16 {
                    tensor_to_f32(t)?;
                }
            }
            if let Some(g) = attr.g.as_mut() {
                for t in g.initializer.iter_mut().filter(|t| t.data_type == FLOAT16) {
                    tensor_to_f32(t)?;
                }
                g.value_info.clear();
                rewrite_nodes(&mut g.node)?;
            }
        }
    }
    Ok(())
}

fn cast_node(name: &str, input: &str, output: &str) -> pb::NodeProto {
    pb::NodeProto {
        op_type: "Cast".into(),
        name: name.into(),
        input: vec![input.into()],
        output: vec![output.into()],
        attribute: vec![pb::AttributeProto {
            name: "to".into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: FLOAT as i64,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The f16 values of a float16 tensor (`raw_data`, or `int32_data` holding the bits).
pub fn f16_bits(t: &pb::TensorProto) -> Result<Vec<u16>> {
    if !t.raw_data.is_empty() {
        if !t.raw_data.len().is_multiple_of(2) {
            return Err(Error::Model(format!(
                "float16 tensor `{}` has {} bytes, an odd number",
                t.name,
                t.raw_data.len()
            )));
        }
        Ok(t.raw_data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect())
    } else {
        Ok(t.int32_data.iter().map(|&v| v as u16).collect())
    }
}

/// A float32 or float16 `[K, N]` matrix as `[N, K]` in `layout` (rows, or panels for f32), in
/// place: its `raw_data`, or its data kept apart.
fn transpose_matrix(
    t: &mut pb::TensorProto,
    apart: Option<&mut Tensor>,
    layout: Layout,
) -> Result<()> {
    let (k, n) = match t.dims.as_slice() {
        &[k, n] if k >= 0 && n >= 0 => (k as usize, n as usize),
        dims => {
            return Err(Error::Model(format!(
                "tensor `{}`: expected a matrix, has dims {dims:?}",
                t.name
            )))
        }
    };
    let size = if t.data_type == FLOAT16 { 2 } else { 4 };
    let bytes = match apart {
        Some(tensor) => tensor.as_bytes_mut(),
        None => &mut t.raw_data[..],
    };
    if bytes.len() != k * n * size {
        return Err(Error::Model(format!(
            "tensor `{}` of dims {:?} has {} bytes; expected {}",
            t.name,
            t.dims,
            bytes.len(),
            k * n * size
        )));
    }
    match (layout, size) {
        (Layout::Panels, 4) if k.is_multiple_of(4) => transpose_values::<4>(bytes, k, n, true),
        (Layout::Nk, 2) => transpose_values::<2>(bytes, k, n, false),
        (Layout::Nk, 4) => transpose_values::<4>(bytes, k, n, false),
        _ => {
            return Err(Error::Model(format!(
                "tensor `{}`: cannot store it {layout:?}",
                t.name
            )))
        }
    }
    t.dims = vec![n as i64, k as i64];
    Ok(())
}

/// `bytes`, a `[k, n]` matrix of `S`-byte values, as `[n, k]` (in panels when `panels`), in
/// place from one copy.
fn transpose_values<const S: usize>(bytes: &mut [u8], k: usize, n: usize, panels: bool) {
    let copy = bytes.to_vec();
    let (src, dst) = (copy.as_chunks::<S>().0, bytes.as_chunks_mut::<S>().0);
    if panels {
        transpose_panels(src, k, n, dst);
    } else {
        transpose_nk(src, k, n, dst);
    }
}

fn tensor_to_f32(t: &mut pb::TensorProto) -> Result<()> {
    let values = f16_bits(t)?;
    t.raw_data = values
        .iter()
        .flat_map(|&h| half::f16::from_bits(h).to_f32().to_le_bytes())
        .collect();
    t.int32_data.clear();
    t.data_type = FLOAT;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops::linalg::panel_index;
    use crate::model::ops::matmul_runtime::MATMUL_RUNTIME;

    /// A `[k, n]` matrix of distinct values, as bytes of `S`-byte values.
    fn matrix<const S: usize>(k: usize, n: usize) -> Vec<u8> {
        (0..k * n)
            .flat_map(|v| (v as u32).to_le_bytes()[..S].to_vec())
            .collect()
    }

    #[test]
    fn transposes_put_every_value_in_its_place() {
        for (k, n) in [(4, 4), (8, 3), (16, 17), (36, 22), (5, 7), (20, 1)] {
            let src = matrix::<4>(k, n);
            let value = |bytes: &[u8], at: usize| bytes[at * 4..at * 4 + 4].to_vec();
            let mut nk = src.clone();
            transpose_values::<4>(&mut nk, k, n, false);
            let mut f16 = matrix::<2>(k, n);
            transpose_values::<2>(&mut f16, k, n, false);
            let mut panels = src.clone();
            if k % 4 == 0 {
                transpose_values::<4>(&mut panels, k, n, true);
            }
            for i in 0..k {
                for j in 0..n {
                    let want = value(&src, i * n + j);
                    assert_eq!(value(&nk, j * k + i), want, "[n, k] {k}x{n} ({i}, {j})");
                    assert_eq!(&f16[(j * k + i) * 2..][..2], &want[..2], "f16 {k}x{n}");
                    if k % 4 == 0 {
                        let at = panel_index(j, i, n, k);
                        assert_eq!(value(&panels, at), want, "panels {k}x{n} ({i}, {j})");
                    }
                }
            }
        }
    }

    /// The keys of `Q K^T`: a `MatMul` by `Mul(Transpose(k, perm=[0, 1, 3, 2]), scale)`
    /// becomes `MatMulRuntime(Mul(q, scale), k)` with `trans_b`; by a `Transpose` alone,
    /// `MatMulRuntime(q, k)` with `trans_b`; by `Transpose(x, [0, 2, 3, 1])` beside
    /// `present = Transpose(x, [0, 2, 1, 3])`, `MatMulRuntime(q, present)` with `trans_b`; by
    /// another alone that reverses the last two axes, `MatMulRuntime(q, Transpose(k, [0, 2, 1,
    /// 3]))` with `trans_b`, that transpose made before the product; other permutations stay
    /// as they are (the values of `P V`).
    #[test]
    fn matmuls_by_transposed_keys_read_the_keys() {
        let node =
            |op: &str, inputs: &[&str], output: &str, perm: Option<Vec<i64>>| pb::NodeProto {
                op_type: op.into(),
                input: inputs.iter().map(|s| s.to_string()).collect(),
                output: vec![output.into()],
                attribute: perm
                    .map(|ints| pb::AttributeProto {
                        name: "perm".into(),
                        ints,
                        ..Default::default()
                    })
                    .into_iter()
                    .collect(),
                ..Default::default()
            };
        let scale = pb::NodeProto {
            op_type: "Constant".into(),
            output: vec!["s".into()],
            attribute: vec![pb::AttributeProto {
                name: "value".into(),
                t: Some(pb::TensorProto {
                    data_type: FLOAT,
                    float_data: vec![0.5],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut proto = pb::ModelProto {
            graph: Some(pb::GraphProto {
                node: vec![
                    scale,
                    node("Transpose", &["k"], "kt", Some(vec![0, 1, 3, 2])),
                    node("Mul", &["kt", "s"], "kts", None),
                    node("MatMul", &["q", "kts"], "scores", None),
                    node("MatMul", &["q", "kt"], "plain", None),
                    node("Transpose", &["k"], "other", Some(vec![0, 2, 3, 1])),
                    node("MatMul", &["q", "other"], "alone", None),
                    node("Transpose", &["v"], "vt", Some(vec![0, 2, 1, 3])),
                    node("MatMul", &["p", "vt"], "values", None),
                    node("Transpose", &["x"], "present", Some(vec![0, 2, 1, 3])),
                    node("Transpose", &["x"], "xt", Some(vec![0, 2, 3, 1])),
                    node("MatMul", &["q", "xt"], "cross", None),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        runtime_matmuls(&mut proto);
        let nodes = proto.graph.unwrap().node;
        let by_output = |o: &str| nodes.iter().find(|n| n.output[0] == o).unwrap();
        let trans_b =
            |n: &pb::NodeProto| n.attribute.iter().any(|a| a.name == "trans_b" && a.i == 1);
        let scaled = by_output("scores/scaled_a");
        assert_eq!(
            (scaled.op_type.as_str(), &scaled.input[..]),
            ("Mul", &["q".to_string(), "s".to_string()][..])
        );
        let scores = by_output("scores");
        assert_eq!(scores.op_type, MATMUL_RUNTIME);
        assert_eq!(scores.input, ["scores/scaled_a", "k"]);
        assert!(trans_b(scores));
        let position = |o: &str| nodes.iter().position(|n| n.output[0] == o).unwrap();
        assert!(
            position("scores/scaled_a") < position("scores"),
            "the Mul before its MatMul"
        );
        let plain = by_output("plain");
        assert_eq!(plain.input, ["q", "k"]);
        assert!(trans_b(plain));
        let made = by_output("other/keys");
        assert_eq!(
            (made.op_type.as_str(), &made.input[..], perm(made)),
            ("Transpose", &["k".to_string()][..], Some(&[0, 2, 1, 3][..]))
        );
        let alone = by_output("alone");
        assert_eq!(alone.op_type, MATMUL_RUNTIME);
        assert_eq!(alone.input, ["q", "other/keys"]);
        assert!(trans_b(alone));
        assert!(position("other/keys") < position("alone"));
        let values = by_output("values");
        assert_eq!(
            (values.op_type.as_str(), &values.input[..]),
            (MATMUL_RUNTIME, &["p".to_string(), "vt".to_string()][..])
        );
        assert!(!trans_b(values));
        assert!(!nodes.iter().any(|n| n.output[0] == "vt/keys"));
        // `x` transposed to `[0, 2, 3, 1]` is the sibling `present` with its last two axes
        // swapped: the product reads `present`.
        let cross = by_output("cross");
        assert_eq!(cross.input, ["q", "present"]);
        assert!(trans_b(cross));
    }

    /// A merged decoder: both branches of an `If` multiply by the matrix `w`, which becomes
    /// `MatMulWeights` in both, transposed once into panels; `e`, also gathered at the top
    /// level, stays a `MatMul` of the matrix as it was.
    #[test]
    fn matrices_read_by_the_branches_of_an_if_are_weights() {
        let (k, n) = (8, 4);
        let init = |name: &str| pb::TensorProto {
            name: name.into(),
            data_type: FLOAT,
            dims: vec![k as i64, n as i64],
            raw_data: matrix::<4>(k, n),
            ..Default::default()
        };
        let node = |op: &str, inputs: &[&str], output: &str| pb::NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.into()],
            ..Default::default()
        };
        let branch = |name: &str| pb::AttributeProto {
            name: name.into(),
            g: Some(pb::GraphProto {
                node: vec![
                    node("MatMul", &["x", "w"], &format!("{name}_w")),
                    node("MatMul", &["x", "e"], &format!("{name}_e")),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut if_node = node("If", &["cond"], "y");
        if_node.attribute = vec![branch("then_branch"), branch("else_branch")];
        let mut proto = pb::ModelProto {
            graph: Some(pb::GraphProto {
                node: vec![if_node, node("Gather", &["e", "ids"], "rows")],
                initializer: vec![init("w"), init("e")],
                ..Default::default()
            }),
            ..Default::default()
        };
        rewrite(&mut proto, &mut Apart::default()).unwrap();
        let graph = proto.graph.unwrap();
        for attr in &graph.node[0].attribute {
            let nodes = &attr.g.as_ref().unwrap().node;
            assert_eq!(nodes[0].op_type, MATMUL_WEIGHTS, "{}", attr.name);
            assert_eq!(nodes[0].attribute[0].i, Layout::Panels.attribute());
            assert_eq!(nodes[1].op_type, "MatMul", "{}", attr.name);
        }
        let mut panels = matrix::<4>(k, n);
        transpose_values::<4>(&mut panels, k, n, true);
        assert_eq!(graph.initializer[0].raw_data, panels, "w in panels, once");
        assert_eq!(
            graph.initializer[1].raw_data,
            matrix::<4>(k, n),
            "e as it was"
        );
    }

    /// `MatMulInteger`s by `w` (`[8, 32]` int8, a zero point per column) read it in blocks:
    /// permuted in place, the nodes' `layout` set, and tract's plan gives the same integer sums
    /// as the graph before the rewrite, for a prompt's three rows and a step's one. `v`, also
    /// read by a `Cast`, and `u`, `[6, 32]`, stay as they are.
    /// The `layout` attribute of the node of `graph` whose first output is `output`.
    fn layout_of(graph: &pb::GraphProto, output: &str) -> Option<i64> {
        let node = graph.node.iter().find(|n| n.output[0] == output).unwrap();
        node.attribute
            .iter()
            .find(|a| a.name == "layout")
            .map(|a| a.i)
    }

    /// The bytes of initializer `name` of `graph`.
    fn raw_of<'g>(graph: &'g pb::GraphProto, name: &str) -> &'g Vec<u8> {
        &graph
            .initializer
            .iter()
            .find(|t| t.name == name)
            .unwrap()
            .raw_data
    }

    /// The outputs of the graph `proto` (one f32 input `[rows, k]`) under tract.
    fn run(
        proto: &pb::ModelProto,
        rows: usize,
        k: usize,
    ) -> tract_onnx::prelude::TVec<tract_onnx::prelude::TValue> {
        use tract_onnx::prelude::*;
        let a: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut model = crate::model::ops::onnx()
            .model_for_proto_model(proto)
            .unwrap();
        model
            .set_input_fact(0, InferenceFact::dt_shape(f32::datum_type(), [rows, k]))
            .unwrap();
        let plan = model.into_optimized().unwrap().into_runnable().unwrap();
        let a = Tensor::from_shape(&[rows, k], &a).unwrap();
        plan.run(tvec![a.into_tvalue()]).unwrap()
    }

    #[test]
    fn integer_matrices_read_only_by_matmul_integers_are_in_blocks() {
        let (k, n) = (8usize, 32usize);
        let bytes = |k: usize| {
            (0..k * n)
                .map(|i| (i * 37 % 251) as u8)
                .collect::<Vec<u8>>()
        };
        let init = |name: &str, dims: Vec<i64>, raw_data: Vec<u8>| pb::TensorProto {
            name: name.into(),
            data_type: INT8,
            dims,
            raw_data,
            ..Default::default()
        };
        let node = |op: &str, inputs: &[&str], outputs: &[&str]| pb::NodeProto {
            op_type: op.into(),
            name: outputs[0].into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let value = |name: &str, elem_type: i32| pb::ValueInfoProto {
            name: name.into(),
            r#type: Some(pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type,
                    shape: None,
                })),
                ..Default::default()
            }),
            ..Default::default()
        };
        let int64 = |name: &str, v: i64| pb::TensorProto {
            name: name.into(),
            data_type: pb::tensor_proto::DataType::Int64 as i32,
            dims: vec![1],
            int64_data: vec![v],
            ..Default::default()
        };
        let zero: Vec<u8> = (0..n).map(|j| (j as i8 - 16) as u8).collect();
        let mut cast = node("Cast", &["v"], &["vf"]);
        cast.attribute.push(pb::AttributeProto {
            name: "to".into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: FLOAT as i64,
            ..Default::default()
        });
        let int32 = pb::tensor_proto::DataType::Int32 as i32;
        let original = pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            graph: Some(pb::GraphProto {
                node: vec![
                    node("DynamicQuantizeLinear", &["a"], &["aq", "as", "az"]),
                    node("MatMulInteger", &["aq", "w", "az", "wz"], &["yw"]),
                    node("MatMulInteger", &["aq", "v", "az"], &["yv"]),
                    node("Slice", &["a", "from", "to", "axis"], &["a6"]),
                    node("DynamicQuantizeLinear", &["a6"], &["a6q", "a6s", "a6z"]),
                    node("MatMulInteger", &["a6q", "u"], &["yu6"]),
                    cast,
                ],
                initializer: vec![
                    init("w", vec![k as i64, n as i64], bytes(k)),
                    init("wz", vec![n as i64], zero),
                    init("v", vec![k as i64, n as i64], bytes(k)),
                    init("u", vec![6, n as i64], bytes(6)),
                    int64("from", 0),
                    int64("to", 6),
                    int64("axis", 1),
                ],
                input: vec![value("a", FLOAT)],
                output: vec![
                    value("yw", int32),
                    value("yv", int32),
                    value("yu6", int32),
                    value("vf", FLOAT),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut rewritten = original.clone();
        rewrite(&mut rewritten, &mut Apart::default()).unwrap();
        let graph = rewritten.graph.as_ref().unwrap();
        let layout = |output: &str| layout_of(graph, output);
        assert_eq!(layout("yw"), Some(matmul_integer::BLOCKS_ATTRIBUTE));
        assert_eq!((layout("yv"), layout("yu6")), (None, None));
        let mut blocks = vec![0u8; k * n];
        matmul_integer::to_blocks(&bytes(k), k, n, true, &mut blocks);
        let raw = |name: &str| raw_of(graph, name);
        assert_eq!(raw("w"), &blocks);
        assert_eq!((raw("v"), raw("u")), (&bytes(k), &bytes(6)));
        for rows in [3usize, 1] {
            let (want, got) = (run(&original, rows, k), run(&rewritten, rows, k));
            for (i, (want, got)) in want.iter().zip(&got).enumerate() {
                assert_eq!(want, got, "output {i}, {rows} rows");
            }
            let plain = got[0].try_as_plain_ram().unwrap();
            let sums = plain.as_slice::<i32>().unwrap();
            assert!(sums.iter().any(|&s| s != 0), "{rows} rows: {sums:?}");
        }
    }

    /// The 4-bit weights of `MatMulNBits`s that fit lanes, and that their node alone reads, are
    /// laid out in lanes with their scales and the node's `layout` attribute says so; the
    /// others stay as they are (float zero points, N not a multiple of 16, a weight another node
    /// reads too). The graphs give the same bits, for a decoding row and for a prompt.
    #[test]
    fn nbits_weights_that_fit_are_in_lanes() {
        let (k, bs) = (64usize, 32usize);
        let blocks = k / bs;
        let bytes = |n: usize, seed: usize| {
            (0..n * k / 2)
                .map(|i| ((i + seed) * 37 % 251) as u8)
                .collect::<Vec<u8>>()
        };
        let scales = |n: usize| {
            (0..n * blocks)
                .flat_map(|i| (0.01 + i as f32 * 0.003).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let init =
            |name: &str, data_type: i32, dims: Vec<i64>, raw_data: Vec<u8>| pb::TensorProto {
                name: name.into(),
                data_type,
                dims,
                raw_data,
                ..Default::default()
            };
        let weight = |name: &str, n: usize, seed: usize| {
            init(
                name,
                UINT8,
                vec![n as i64, blocks as i64, bs as i64 / 2],
                bytes(n, seed),
            )
        };
        let scale = |name: &str, n: usize| init(name, FLOAT, vec![(n * blocks) as i64], scales(n));
        let int = |name: &str, i: i64| pb::AttributeProto {
            name: name.into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i,
            ..Default::default()
        };
        let nbits = |inputs: &[&str], output: &str, n: usize| pb::NodeProto {
            op_type: "MatMulNBits".into(),
            domain: "com.microsoft".into(),
            name: output.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![output.into()],
            attribute: vec![
                int("K", k as i64),
                int("N", n as i64),
                int("bits", 4),
                int("block_size", bs as i64),
            ],
            ..Default::default()
        };
        let value = |name: &str| pb::ValueInfoProto {
            name: name.into(),
            r#type: Some(pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type: FLOAT,
                    shape: None,
                })),
                ..Default::default()
            }),
            ..Default::default()
        };
        let zp_float: Vec<u8> = (0..16 * blocks).flat_map(|_| 7f32.to_le_bytes()).collect();
        let identity = pb::NodeProto {
            op_type: "Identity".into(),
            name: "shared".into(),
            input: vec!["u".into()],
            output: vec!["u_again".into()],
            ..Default::default()
        };
        let original = pb::ModelProto {
            ir_version: 8,
            opset_import: vec![
                pb::OperatorSetIdProto {
                    domain: String::new(),
                    version: 17,
                },
                pb::OperatorSetIdProto {
                    domain: "com.microsoft".into(),
                    version: 1,
                },
            ],
            graph: Some(pb::GraphProto {
                node: vec![
                    nbits(&["a", "w", "ws"], "yw", 16),
                    nbits(&["a", "v", "vs", "vz"], "yv", 16),
                    nbits(&["a", "x", "xs"], "yx", 12),
                    nbits(&["a", "u", "us"], "yu", 16),
                    identity,
                ],
                initializer: vec![
                    weight("w", 16, 1),
                    scale("ws", 16),
                    weight("v", 16, 2),
                    scale("vs", 16),
                    init("vz", FLOAT, vec![(16 * blocks) as i64], zp_float),
                    weight("x", 12, 3),
                    scale("xs", 12),
                    weight("u", 16, 4),
                    scale("us", 16),
                ],
                input: vec![value("a")],
                output: ["yw", "yv", "yx", "yu", "u_again"].map(value).to_vec(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut rewritten = original.clone();
        rewrite(&mut rewritten, &mut Apart::default()).unwrap();
        let graph = rewritten.graph.as_ref().unwrap();
        let layout = |output: &str| layout_of(graph, output);
        assert_eq!(layout("yw"), Some(matmul_nbits::LANES_ATTRIBUTE));
        assert_eq!(
            (layout("yv"), layout("yx"), layout("yu")),
            (None, None, None)
        );
        let raw = |name: &str| raw_of(graph, name);
        let mut lanes = vec![0u8; 16 * k / 2];
        matmul_nbits::to_lanes(&bytes(16, 1), 16, k, &mut lanes);
        let mut lane_scales = vec![0u8; 16 * blocks * 4];
        matmul_nbits::scales_to_lanes(&scales(16), 4, 16, blocks, &mut lane_scales);
        assert_eq!((raw("w"), raw("ws")), (&lanes, &lane_scales));
        assert_ne!(raw("w"), &bytes(16, 1));
        assert_eq!(
            (raw("v"), raw("x"), raw("u")),
            (&bytes(16, 2), &bytes(12, 3), &bytes(16, 4))
        );
        assert_eq!(
            (raw("vs"), raw("xs"), raw("us")),
            (&scales(16), &scales(12), &scales(16))
        );
        for rows in [1usize, 9] {
            let (want, got) = (run(&original, rows, k), run(&rewritten, rows, k));
            for (i, (want, got)) in want.iter().zip(&got).enumerate() {
                assert_eq!(want, got, "output {i}, {rows} rows");
            }
            let plain = got[0].try_as_plain_ram().unwrap();
            let y = plain.as_slice::<f32>().unwrap();
            assert!(y.iter().any(|&v| v != 0.0), "{rows} rows: {y:?}");
        }
    }
}
