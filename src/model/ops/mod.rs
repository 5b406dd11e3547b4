//! `com.microsoft` contrib ops that onnxruntime-genai and transformers.js exports use, written
//! for tract-onnx's op registry. One module per op; each documents what it supports and fails
//! at load time, naming the node, on anything else.
//!
//! The layer norms (`SimplifiedLayerNormalization`, `SkipSimplifiedLayerNormalization`,
//! `SkipLayerNormalization`), `RotaryEmbedding` and the `MatMulInteger` /
//! `DynamicQuantizeLinear` path are tract-onnx's own; `tests/contrib_ops.rs` checks them
//! against onnxruntime like the ops written here.

pub mod gather_block_quantized;
pub mod group_query_attention;
pub mod matmul_nbits;

use tract_onnx::model::OnnxOpRegister;
use tract_onnx::pb::NodeProto;

/// Register the ops of this module (replacing tract-onnx's builders of the same names).
pub fn register(reg: &mut OnnxOpRegister) {
    reg.insert(
        "GroupQueryAttention",
        group_query_attention::group_query_attention,
    );
    reg.insert("MatMulNBits", matmul_nbits::matmul_nbits);
    reg.insert(
        "GatherBlockQuantized",
        gather_block_quantized::gather_block_quantized,
    );
}

/// tract-onnx with the ops of this module registered.
pub fn onnx() -> tract_onnx::Onnx {
    let mut onnx = tract_onnx::onnx();
    register(&mut onnx.op_register);
    onnx
}

/// `op 'name'` for error messages.
pub(crate) fn node_label(node: &NodeProto) -> String {
    format!("{} node '{}'", node.op_type, node.name)
}

/// Position among the node's non-empty inputs of ONNX input `index` (None: absent).
pub(crate) fn input_slot(node: &NodeProto, index: usize) -> Option<usize> {
    if node.input.get(index).is_none_or(|s| s.is_empty()) {
        return None;
    }
    Some(node.input[..index].iter().filter(|s| !s.is_empty()).count())
}

/// Whether output `index` of the node is wired.
pub(crate) fn has_output(node: &NodeProto, index: usize) -> bool {
    node.output.get(index).is_some_and(|s| !s.is_empty())
}

/// The dims of an initializer of the model, when `name` is one.
pub(crate) fn initializer_dims(
    ctx: &tract_onnx::model::ParsingContext,
    name: &str,
) -> Option<Vec<i64>> {
    let graphs = ctx
        .model
        .graph
        .iter()
        .chain(ctx.parent_graphs.iter().copied());
    for g in graphs {
        if let Some(t) = g.initializer.iter().find(|t| t.name == name) {
            return Some(t.dims.clone());
        }
    }
    None
}
