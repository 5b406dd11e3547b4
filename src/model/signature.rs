//! What a decoder graph declares: its inputs and outputs by name, the KV cache layout, and the
//! cache mode, decided once here from the graph.

use std::collections::BTreeSet;

use tract_onnx::pb;
use tract_onnx::pb::tensor_shape_proto::dimension::Value as DimValue;

use crate::error::{Error, Result};

/// ONNX element types this engine binds (`TensorProto.DataType`).
pub const ONNX_FLOAT: i32 = 1;
pub const ONNX_INT32: i32 = 6;
pub const ONNX_INT64: i32 = 7;
pub const ONNX_BOOL: i32 = 9;
pub const ONNX_FLOAT16: i32 = 10;

/// How the KV cache is kept between steps (see DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// `com.microsoft.GroupQueryAttention`: one buffer as long as the mask, written in place.
    InPlace,
    /// The graph declares `position_ids`: a preallocated buffer whose free rows the mask hides.
    Append,
    /// Positions come from the past length: the cache has its exact length.
    Grow,
}

impl CacheMode {
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::InPlace => "in_place",
            CacheMode::Append => "append",
            CacheMode::Grow => "grow",
        }
    }
}

/// Element type of the KV cache (and of the logits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
}

/// One dimension of a declared input or output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dim {
    Fixed(i64),
    Named(String),
    Unknown,
}

/// A graph input or output as declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub elem_type: i32,
    pub dims: Vec<Dim>,
}

/// The names of one layer's cache tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerNames {
    pub past_key: String,
    pub past_value: String,
    pub present_key: String,
    pub present_value: String,
}

/// The signature of a decoder graph.
#[derive(Debug, Clone)]
pub struct Signature {
    pub inputs: Vec<TensorDecl>,
    pub outputs: Vec<TensorDecl>,
    /// `input_ids` (false: `inputs_embeds`).
    pub takes_ids: bool,
    pub ids_type: i32,
    pub has_attention_mask: bool,
    pub has_position_ids: bool,
    /// Number of axes of `position_ids` (2, or 3 for M-RoPE).
    pub position_axes: usize,
    pub has_use_cache_branch: bool,
    pub has_encoder_hidden_states: bool,
    /// Self-attention cache of each layer.
    pub layers: Vec<LayerNames>,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kv_dtype: Dtype,
    pub logits_name: String,
    pub cache_mode: CacheMode,
}

impl Signature {
    /// Read the signature of `model`. `config` is the model's `config.json` (used where the
    /// graph leaves the head count or size symbolic).
    pub fn read(model: &pb::ModelProto, config: &serde_json::Value) -> Result<Signature> {
        let graph = model
            .graph
            .as_ref()
            .ok_or_else(|| Error::Model("the ONNX file contains no graph".into()))?;
        let initializers: BTreeSet<&str> =
            graph.initializer.iter().map(|t| t.name.as_str()).collect();
        let inputs: Vec<TensorDecl> = graph
            .input
            .iter()
            .filter(|i| !initializers.contains(i.name.as_str()))
            .map(decl)
            .collect();
        let outputs: Vec<TensorDecl> = graph.output.iter().map(decl).collect();
        let mut ops = BTreeSet::new();
        collect_ops(graph, &mut ops);

        let input = |n: &str| inputs.iter().find(|i| i.name == n);
        let ids = input("input_ids");
        let embeds = input("inputs_embeds");
        if ids.is_none() && embeds.is_none() {
            return Err(Error::Model(format!(
                "the graph declares neither `input_ids` nor `inputs_embeds` (its inputs: {})",
                names(&inputs)
            )));
        }
        let logits_name = outputs
            .iter()
            .find(|o| o.name == "logits")
            .map(|o| o.name.clone())
            .ok_or_else(|| {
                Error::Model(format!(
                    "the graph has no `logits` output (its outputs: {})",
                    names(&outputs)
                ))
            })?;

        let mut layers = vec![];
        for l in 0.. {
            let (pk, pv) = self_attention_past_names(&inputs, l);
            let (Some(pk), Some(pv)) = (pk, pv) else {
                break;
            };
            let present_key = present_name(&pk);
            let present_value = present_name(&pv);
            for p in [&present_key, &present_value] {
                if !outputs.iter().any(|o| &o.name == p) {
                    return Err(Error::Model(format!(
                        "the graph declares the cache input `{}` but no output `{p}`",
                        if p == &present_key { &pk } else { &pv }
                    )));
                }
            }
            layers.push(LayerNames {
                past_key: pk,
                past_value: pv,
                present_key,
                present_value,
            });
        }
        if layers.is_empty() {
            return Err(Error::Model(format!(
                "the graph has no KV cache inputs `past_key_values.N.key|value`: a model exported \
                 without past key values cannot generate incrementally (its inputs: {})",
                names(&inputs)
            )));
        }
        let past = input(&layers[0].past_key)
            .cloned()
            .ok_or_else(|| Error::Model("internal: the first past input disappeared".into()))?;
        let kv_dtype = match past.elem_type {
            ONNX_FLOAT => Dtype::F32,
            ONNX_FLOAT16 => Dtype::F16,
            t => {
                return Err(Error::Unsupported(format!(
                    "KV cache element type {t} of `{}` (supported: float32, float16)",
                    past.name
                )))
            }
        };
        if past.dims.len() != 4 {
            return Err(Error::Model(format!(
                "`{}` has {} axes; expected [batch, kv_heads, past_length, head_dim]",
                past.name,
                past.dims.len()
            )));
        }
        let kv_heads = fixed(&past.dims[1])
            .or_else(|| config_kv_heads(config))
            .ok_or_else(|| {
                Error::Model(format!(
                    "the number of KV heads is symbolic in `{}` and config.json does not give it",
                    past.name
                ))
            })?;
        let head_dim = fixed(&past.dims[3])
            .or_else(|| config_head_dim(config))
            .ok_or_else(|| {
                Error::Model(format!(
                    "the head size is symbolic in `{}` and config.json does not give it",
                    past.name
                ))
            })?;

        let gqa = ops.iter().any(|(_, op)| op == "GroupQueryAttention");
        let position_ids = input("position_ids");
        let cache_mode = if gqa {
            CacheMode::InPlace
        } else if position_ids.is_some() {
            CacheMode::Append
        } else {
            CacheMode::Grow
        };
        Ok(Signature {
            takes_ids: ids.is_some(),
            ids_type: ids.or(embeds).map(|d| d.elem_type).unwrap_or(ONNX_INT64),
            has_attention_mask: input("attention_mask").is_some(),
            has_position_ids: position_ids.is_some(),
            position_axes: position_ids.map(|p| p.dims.len()).unwrap_or(0),
            has_use_cache_branch: input("use_cache_branch").is_some(),
            has_encoder_hidden_states: input("encoder_hidden_states").is_some(),
            layers,
            kv_heads,
            head_dim,
            kv_dtype,
            logits_name,
            cache_mode,
            inputs,
            outputs,
        })
    }

    pub fn input(&self, name: &str) -> Option<&TensorDecl> {
        self.inputs.iter().find(|i| i.name == name)
    }
}

fn decl(v: &pb::ValueInfoProto) -> TensorDecl {
    let (elem_type, dims) = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(pb::type_proto::Value::TensorType(t)) => (
            t.elem_type,
            t.shape
                .as_ref()
                .map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match &d.value {
                            Some(DimValue::DimValue(n)) => Dim::Fixed(*n),
                            Some(DimValue::DimParam(p)) => Dim::Named(p.clone()),
                            None => Dim::Unknown,
                        })
                        .collect()
                })
                .unwrap_or_default(),
        ),
        _ => (0, vec![]),
    };
    TensorDecl {
        name: v.name.clone(),
        elem_type,
        dims,
    }
}

/// `domain.op_type` of the graph's nodes (subgraphs included) outside the standard ONNX domain,
/// for error messages.
pub(crate) fn non_standard_ops(graph: &pb::GraphProto) -> Vec<String> {
    let mut ops = BTreeSet::new();
    collect_ops(graph, &mut ops);
    ops.into_iter()
        .filter(|(domain, _)| !domain.is_empty() && domain != "ai.onnx")
        .map(|(domain, op)| format!("{domain}.{op}"))
        .collect()
}

fn collect_ops(graph: &pb::GraphProto, ops: &mut BTreeSet<(String, String)>) {
    for node in &graph.node {
        ops.insert((node.domain.clone(), node.op_type.clone()));
        for attr in &node.attribute {
            if let Some(g) = &attr.g {
                collect_ops(g, ops);
            }
        }
    }
}

/// The self-attention past names of layer `l`: `past_key_values.l.key` (decoder-only) or
/// `past_key_values.l.decoder.key` (encoder-decoder).
fn self_attention_past_names(inputs: &[TensorDecl], l: usize) -> (Option<String>, Option<String>) {
    let find = |suffix: &str| {
        [
            format!("past_key_values.{l}.{suffix}"),
            format!("past_key_values.{l}.decoder.{suffix}"),
        ]
        .into_iter()
        .find(|n| inputs.iter().any(|i| &i.name == n))
    };
    (find("key"), find("value"))
}

/// `past_key_values.3.key` -> `present.3.key`.
pub fn present_name(past: &str) -> String {
    match past.strip_prefix("past_key_values.") {
        Some(rest) => format!("present.{rest}"),
        None => past.to_owned(),
    }
}

fn names(decls: &[TensorDecl]) -> String {
    decls
        .iter()
        .map(|d| d.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn fixed(d: &Dim) -> Option<usize> {
    match d {
        Dim::Fixed(n) if *n > 0 => Some(*n as usize),
        _ => None,
    }
}

fn config_usize(config: &serde_json::Value, keys: &[&str]) -> Option<usize> {
    let c = config.get("text_config").unwrap_or(config);
    keys.iter()
        .find_map(|k| c.get(k).and_then(|v| v.as_u64()))
        .map(|n| n as usize)
}

fn config_kv_heads(config: &serde_json::Value) -> Option<usize> {
    config_usize(
        config,
        &[
            "num_key_value_heads",
            "num_attention_heads",
            "n_head",
            "num_heads",
        ],
    )
}

fn config_head_dim(config: &serde_json::Value) -> Option<usize> {
    config_usize(config, &["head_dim", "d_kv"]).or_else(|| {
        let hidden = config_usize(config, &["hidden_size", "n_embd", "d_model"])?;
        let heads = config_usize(config, &["num_attention_heads", "n_head", "num_heads"])?;
        (heads > 0).then(|| hidden / heads)
    })
}
