//! Contrib-op graphs the engine cannot run correctly fail at load time with an error naming the
//! node and the unsupported attribute or the mismatched shape (never wrong numbers). The graphs
//! are the committed one-node references of tests/fixtures/ops, altered.

use std::path::PathBuf;

use onnx_generate::model::ops;
use tract_onnx::pb;
use tract_onnx::prelude::*;

fn proto(name: &str) -> pb::ModelProto {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/ops")
        .join(format!("{name}.onnx"));
    let bytes = std::fs::read(path).unwrap();
    tract_onnx::onnx()
        .proto_model_for_read(&mut &bytes[..])
        .unwrap()
}

/// Rename the node to `bad`, apply `edit`, load and compile; return the error text.
fn load_error(name: &str, edit: impl FnOnce(&mut pb::NodeProto)) -> String {
    let mut model = proto(name);
    let node = &mut model.graph.as_mut().unwrap().node[0];
    node.name = "bad".into();
    edit(node);
    let result = ops::onnx()
        .model_for_proto_model(&model)
        .and_then(|m| m.into_optimized());
    format!("{:?}", result.expect_err("the altered graph loaded"))
}

fn set_int(node: &mut pb::NodeProto, attr: &str, value: i64) {
    let a = node.attribute.iter_mut().find(|a| a.name == attr).unwrap();
    a.i = value;
}

#[test]
fn matmul_nbits_weight_shape_must_match_attributes() {
    let e = load_error("mnb_q4_b32", |n| set_int(n, "N", 25));
    assert!(e.contains("MatMulNBits node 'bad'"), "{e}");
    assert!(
        e.contains("quantized weight 'b' has shape [24, 2, 16]"),
        "{e}"
    );
    let e = load_error("mnb_q4_b32", |n| set_int(n, "K", 96));
    assert!(e.contains("MatMulNBits node 'bad'"), "{e}");
}

#[test]
fn matmul_nbits_unsupported_attributes() {
    let e = load_error("mnb_q4_b32", |n| set_int(n, "bits", 3));
    assert!(
        e.contains("MatMulNBits node 'bad': bits=3 is not supported"),
        "{e}"
    );
    let e = load_error("mnb_q4_b32", |n| set_int(n, "block_size", 24));
    assert!(e.contains("block_size=24 is not supported"), "{e}");
    let e = load_error("mnb_q4_b32", |n| {
        n.input.resize(5, String::new());
        n.input[4] = "a".into();
    });
    assert!(e.contains("g_idx (act-order) is not supported"), "{e}");
}

#[test]
fn group_query_attention_unsupported_inputs_and_attributes() {
    let e = load_error("gqa_decode_mha", |n| {
        n.input.resize(11, String::new());
        n.input[10] = "query".into();
    });
    assert!(
        e.contains("GroupQueryAttention node 'bad': the input attention_bias is not supported"),
        "{e}"
    );
    let e = load_error("gqa_decode_mha", |n| set_int(n, "kv_num_heads", 3));
    assert!(
        e.contains("num_heads 2 must be a positive multiple of kv_num_heads 3"),
        "{e}"
    );
    let e = load_error("gqa_decode_mha", |n| {
        n.input[3] = String::new();
    });
    assert!(e.contains("the input past_key is required"), "{e}");
}

#[test]
fn gather_block_quantized_unsupported_attributes() {
    let e = load_error("gbq_q4_b32", |n| set_int(n, "gather_axis", 1));
    assert!(
        e.contains("GatherBlockQuantized node 'bad': gather_axis=1 is not supported"),
        "{e}"
    );
    let e = load_error("gbq_q4_b32", |n| set_int(n, "bits", 2));
    assert!(e.contains("bits=2 is not supported"), "{e}");
    let e = load_error("gbq_q4_b32", |n| set_int(n, "block_size", 16));
    assert!(e.contains("scales has shape"), "{e}");
}
