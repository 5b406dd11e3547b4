//! `com.microsoft` contrib ops that onnxruntime-genai and transformers.js exports use, written
//! for tract-onnx's op registry. One module per op; each documents what it supports and fails
//! at load time, naming the node, on anything else.
//!
//! The layer norms (`SimplifiedLayerNormalization`, `SkipSimplifiedLayerNormalization`,
//! `SkipLayerNormalization`) and `RotaryEmbedding` are tract-onnx's own, and so is
//! `MatMulInteger` but for 8-bit weights (`matmul_integer`); `DynamicQuantizeLinear` is written
//! again here with tract's arithmetic (`dynamic_quantize`: for speed in the size-optimised
//! package). `tract_builtins.rs` checks them against onnxruntime like the ops written here.
//! `conv1d` takes the ONNX `Conv`s of one dimension with float32 weights (Whisper's encoder)
//! from tract. `binary` replaces tract's generic float arithmetic in compiled plans and
//! `nan_guard` the softmaxes' NaN guards, `axes` tract's reshapes and moves of axes; `linalg`,
//! `parallel` and `streams` are the kernels' shared parts.

pub mod attention;
pub mod axes;
pub mod baked;
pub mod binary;
pub mod conv1d;
pub mod dynamic_quantize;
pub mod gather_block_quantized;
pub mod group_query_attention;
pub mod linalg;
pub mod matmul_integer;
pub mod matmul_nbits;
pub mod matmul_runtime;
pub mod matmul_weights;
pub mod nan_guard;
pub mod parallel;
pub mod rotary;
pub(crate) mod streams;
pub mod tract_builtins;

use std::sync::OnceLock;

use tract_onnx::model::OnnxOpRegister;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::{
    format_err, InferenceOp, OutletId, TDim, Tensor, ToDim, TractResult, TypedFact, TypedModel,
};

/// Register the ops of this module (replacing tract-onnx's builders of the same names).
pub fn register(reg: &mut OnnxOpRegister) {
    reg.insert(
        "GroupQueryAttention",
        group_query_attention::group_query_attention,
    );
    reg.insert("MatMulNBits", matmul_nbits::matmul_nbits);
    reg.insert(
        matmul_runtime::MATMUL_RUNTIME,
        matmul_runtime::matmul_runtime,
    );
    reg.insert(
        crate::model::weights::MATMUL_WEIGHTS,
        matmul_weights::matmul_weights,
    );
    // tract-onnx's own builders stay for the forms these do not take.
    matmul_integer::TRACT.replace(reg, "MatMulInteger", matmul_integer::matmul_integer);
    conv1d::TRACT.replace(reg, "Conv", conv1d::conv);
    reg.insert(
        "GatherBlockQuantized",
        gather_block_quantized::gather_block_quantized,
    );
    reg.insert(
        "DynamicQuantizeLinear",
        dynamic_quantize::dynamic_quantize_linear,
    );
}

/// An op builder of tract-onnx's registry.
pub(crate) type Builder = fn(
    &tract_onnx::model::ParsingContext,
    &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)>;

/// tract-onnx's builder of an op that one of ours replaces, kept for the forms ours leaves to
/// tract (`matmul_integer`, `conv1d`).
pub(crate) struct TractBuilder(OnceLock<Builder>);

impl TractBuilder {
    pub const fn new() -> TractBuilder {
        TractBuilder(OnceLock::new())
    }

    /// `ours` builds `name` from now on; tract's builder is kept here.
    fn replace(&self, reg: &mut OnnxOpRegister, name: &'static str, ours: Builder) {
        if let Some(&tract) = reg.0.get(name) {
            let _ = self.0.set(tract);
        }
        reg.insert(name, ours);
    }

    /// `node` built by tract's builder.
    pub fn build(
        &self,
        ctx: &tract_onnx::model::ParsingContext,
        node: &NodeProto,
    ) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
        let tract = self.0.get().ok_or_else(|| {
            format_err!(
                "{}: tract's {} is not registered",
                node_label(node),
                node.op_type
            )
        })?;
        tract(ctx, node)
    }
}

/// The last axis of a weight product's `A` of `rank` axes (its `K`): an error for a scalar.
pub(crate) fn last_axis(rank: i64, label: &str) -> TractResult<usize> {
    match rank {
        r if r > 0 => Ok(r as usize - 1),
        _ => Err(format_err!(
            "{label}: A is a scalar; expected its last axis to be K"
        )),
    }
}

/// The output fact of `A x W` with a weight of `n` columns: A's shape with its last axis `n`.
pub(crate) fn matmul_output_fact(a: &TypedFact, n: usize) -> TypedFact {
    let mut shape: Vec<TDim> = a.shape.iter().cloned().collect();
    if let Some(last) = shape.last_mut() {
        *last = n.to_dim();
    }
    TypedFact::dt_shape(a.datum_type, shape)
}

/// Whether `outlet` is its node's only output, read by one node and not an output of the model:
/// what a fusion takes in may then be left out of the plan. Readers whose outputs nothing reads
/// (left out of the plan by an earlier fusion, such as the `IsNan` of `nan_guard::fuse`) do not
/// count.
pub(crate) fn only_reader(model: &TypedModel, outlet: OutletId) -> bool {
    let outputs = model.output_outlets().ok();
    let is_output = |o: OutletId| outputs.is_some_and(|outputs| outputs.contains(&o));
    let live = |node: usize| {
        let node = model.node(node);
        (0..node.outputs.len()).any(|slot| {
            !node.outputs[slot].successors.is_empty() || is_output(OutletId::new(node.id, slot))
        })
    };
    model.node(outlet.node).outputs.len() == 1
        && model
            .outlet_successors(outlet)
            .iter()
            .filter(|inlet| live(inlet.node))
            .count()
            == 1
        && !is_output(outlet)
}

/// An op's output: a zeroed f32 tensor of `shape` whose values `fill` writes where they stay.
/// (`Tensor::from_shape` copies a finished `Vec`: an allocation and a copy more per op; in a
/// V8 profile of int8 SmolLM2's decoding steps, 0.12 ms of a 9.7 ms step went to that copy.)
pub(crate) fn output_tensor(
    shape: &[usize],
    fill: impl FnOnce(&mut [f32]) -> TractResult<()>,
) -> TractResult<Tensor> {
    let mut t = Tensor::zero::<f32>(shape)?;
    fill(t.try_as_plain_ram_mut()?.as_slice_mut::<f32>()?)?;
    Ok(t)
}

/// tract-onnx with the ops of this module registered.
pub fn onnx() -> tract_onnx::Onnx {
    run_static_constructors();
    let mut onnx = tract_onnx::onnx();
    register(&mut onnx.op_register);
    onnx
}

/// tract registers its kernels, routines and transforms with static constructors
/// (`inventory`). In wasm nothing calls them unless the module does: without this call the
/// linker takes the module for a command and wraps every exported function in a call to all
/// of them (114, idempotent), each call from JavaScript, hundreds a decoding step (1.6% of a
/// q4 prompt of 64 tokens in a V8 profile, Node). Every model is parsed by [`onnx`] before
/// tract runs anything, so it runs them there, once.
fn run_static_constructors() {
    #[cfg(target_arch = "wasm32")]
    {
        extern "C" {
            fn __wasm_call_ctors();
        }
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: the linker's function that runs the static constructors, once.
        ONCE.call_once(|| unsafe { __wasm_call_ctors() });
    }
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

/// Initializers of at least this many bytes are handed to tract apart from the protobuf
/// (`tract_decoder::GraphTemplate`).
pub(crate) const LARGE_INITIALIZER: usize = 1 << 16;

/// What our op parsers read of an initializer: its type and shape.
#[derive(Debug, Clone)]
pub(crate) struct InitializerInfo {
    pub name: String,
    pub data_type: i32,
    pub dims: Vec<i64>,
}

impl InitializerInfo {
    pub fn of(t: &tract_onnx::pb::TensorProto) -> InitializerInfo {
        InitializerInfo {
            name: t.name.clone(),
            data_type: t.data_type,
            dims: t.dims.clone(),
        }
    }
}

thread_local! {
    /// The initializers taken out of the protobuf being parsed (`with_initializers_apart`).
    static APART: std::cell::RefCell<Vec<InitializerInfo>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `parse` with `apart` visible to [`initializer`] as initializers of the graph.
pub(crate) fn with_initializers_apart<T>(
    apart: Vec<InitializerInfo>,
    parse: impl FnOnce() -> T,
) -> T {
    let before = APART.with(|a| a.replace(apart));
    let out = parse();
    APART.with(|a| a.replace(before));
    out
}

/// The dims of an initializer of the model, when `name` is one.
pub(crate) fn initializer_dims(
    ctx: &tract_onnx::model::ParsingContext,
    name: &str,
) -> Option<Vec<i64>> {
    initializer(ctx, name).map(|t| t.dims)
}

/// The initializer `name` of the model or of a graph around it, when there is one (in the
/// protobuf, or taken out of it for the parse).
pub(crate) fn initializer(
    ctx: &tract_onnx::model::ParsingContext,
    name: &str,
) -> Option<InitializerInfo> {
    let in_proto = ctx
        .model
        .graph
        .iter()
        .chain(ctx.parent_graphs.iter().copied())
        .find_map(|g| g.initializer.iter().find(|t| t.name == name));
    match in_proto {
        Some(t) => Some(InitializerInfo::of(t)),
        None => APART.with(|a| a.borrow().iter().find(|i| i.name == name).cloned()),
    }
}

/// Runs a case of `tests/fixtures/ops` (made by `scripts/op_references.py` with onnxruntime)
/// through tract with these ops registered and compares every output.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;

    /// A deterministic pseudo-random stream of the kernels' tests: xorshift64's states.
    pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Values in [-1, 1] in steps of 1/1000, from `xorshift`.
    pub fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut next = xorshift(seed);
        move || ((next() >> 40) % 2001) as f32 / 1000.0 - 1.0
    }

    use serde_json::Value;
    use tract_onnx::prelude::*;

    /// The first output of a model without inputs (its operands are constants), run once.
    pub fn first_output(model: TypedModel) -> Tensor {
        model
            .into_runnable()
            .unwrap()
            .run(tvec!())
            .unwrap()
            .remove(0)
            .into_tensor()
    }

    fn tensor(v: &Value) -> Tensor {
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let data = v["data"].as_array().unwrap();
        let f = |x: &Value| x.as_f64().unwrap();
        match v["dtype"].as_str().unwrap() {
            "f32" => {
                let d: Vec<f32> = data.iter().map(|x| f(x) as f32).collect();
                Tensor::from_shape(&shape, &d).unwrap()
            }
            "i64" => {
                let d: Vec<i64> = data.iter().map(|x| x.as_i64().unwrap()).collect();
                Tensor::from_shape(&shape, &d).unwrap()
            }
            "i32" => {
                let d: Vec<i32> = data.iter().map(|x| x.as_i64().unwrap() as i32).collect();
                Tensor::from_shape(&shape, &d).unwrap()
            }
            "u8" => {
                let d: Vec<u8> = data.iter().map(|x| x.as_u64().unwrap() as u8).collect();
                Tensor::from_shape(&shape, &d).unwrap()
            }
            t => panic!("dtype {t}"),
        }
    }

    /// Zero positions `valid[b]..` of axis 2 of every row `b` of a rank-4 cache tensor.
    fn mask_cache(t: &mut [f32], shape: &[usize], valid: &[usize]) {
        let (heads, len, dim) = (shape[1], shape[2], shape[3]);
        for (b, &v) in valid.iter().enumerate() {
            for h in 0..heads {
                let at = (b * heads + h) * len * dim;
                t[at + v * dim..at + len * dim].fill(0.0);
            }
        }
    }

    /// The case `name`: its JSON (inputs, outputs) and its inputs as tensors.
    fn case(name: &str) -> (Value, Vec<Tensor>) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/ops")
            .join(format!("{name}.json"));
        let case: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let inputs = case["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(tensor)
            .collect();
        (case, inputs)
    }

    /// The graph of the case `name`, typed for `inputs` and optimised, run on them.
    fn run(name: &str, inputs: Vec<Tensor>) -> TractResult<TVec<TValue>> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/ops")
            .join(format!("{name}.onnx"));
        let mut model = super::onnx().model_for_path(path)?;
        for (ix, t) in inputs.iter().enumerate() {
            model.set_input_fact(ix, InferenceFact::dt_shape(t.datum_type(), t.shape()))?;
        }
        model
            .into_optimized()?
            .into_runnable()?
            .run(inputs.into_iter().map(|t| t.into_tvalue()).collect())
    }

    /// Runs the case `name` with its inputs altered by `alter`; the error, if any.
    pub fn run_altered(name: &str, alter: impl FnOnce(&mut Vec<Tensor>)) -> Option<String> {
        let (_, mut inputs) = case(name);
        alter(&mut inputs);
        run(name, inputs).err().map(|e| format!("{e:?}"))
    }

    pub fn check(name: &str) {
        let (case, inputs) = case(name);
        let outputs = run(name, inputs).unwrap();
        let valid: Option<Vec<usize>> = case["present_valid"]
            .as_array()
            .map(|v| v.iter().map(|x| x.as_u64().unwrap() as usize).collect());
        for (want, got) in case["outputs"].as_array().unwrap().iter().zip(outputs) {
            let out_name = want["name"].as_str().unwrap();
            let want = tensor(want);
            assert_eq!(got.shape(), want.shape(), "{name}: shape of {out_name}");
            let got = got.cast_to::<f32>().unwrap().into_owned();
            let want = want.cast_to::<f32>().unwrap().into_owned();
            let mut g = got
                .try_as_plain_ram()
                .unwrap()
                .as_slice::<f32>()
                .unwrap()
                .to_vec();
            let mut w = want
                .try_as_plain_ram()
                .unwrap()
                .as_slice::<f32>()
                .unwrap()
                .to_vec();
            if let (Some(valid), 4) = (&valid, got.rank()) {
                mask_cache(&mut g, got.shape(), valid);
                mask_cache(&mut w, got.shape(), valid);
            }
            for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 + 1e-4 * b.abs(),
                    "{name}: {out_name}[{i}] is {a}, onnxruntime gives {b}"
                );
            }
        }
    }
}
