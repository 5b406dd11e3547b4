//! The CPU backend: a decoder graph compiled once by tract with symbolic batch, sequence and
//! past lengths, so every step of every request runs the same plan (no recompilation).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use tract_onnx::pb;
use tract_onnx::prelude::*;

use crate::cache::KvCache;
use crate::decoder::{BoundRow, Bounds, Decoder, DecoderState, Logits};
use crate::error::{backend, Error, Result};
use crate::model::embeddings::Embedder;
use crate::model::lm_head::LmHead;
use crate::model::onnx::{into_typed, is_number, specialize_bool_input, Apart, Decoded};
use crate::model::ops::matmul_runtime::past_where_it_lies;
use crate::model::ops::matmul_weights::{Weights, WeightsOp};
use crate::model::ops::parallel::{self, Step};
use crate::model::ops::streams;
use crate::model::session::Session;
use crate::model::signature::{
    non_standard_ops, CacheMode, Dtype, Signature, ONNX_FLOAT16, ONNX_INT32,
};
use crate::vision::RowInputs;

/// What the engine binds to each input of the plan, in the plan's order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Ids,
    /// `inputs_embeds`: the step's ids embedded by `embed_tokens.onnx`, image features in
    /// place of prompt image tokens.
    Embeds,
    Mask,
    Positions,
    PastKey(usize),
    PastValue(usize),
    /// `[rows, 1, 1]`: the position of each row's last token in the step (`LAST_POSITIONS`).
    LastPositions,
}

/// The input added by `logits_of_last_positions`.
const LAST_POSITIONS: &str = "onnx_generate_last_positions";

/// One compiled graph and the positions of what we bind and read.
#[derive(Debug)]
struct Plan {
    runnable: Arc<TypedRunnableModel>,
    roles: Vec<Role>,
    logits: usize,
    /// Output index of each layer's `(present key, present value)`.
    presents: Vec<(usize, usize)>,
    /// Per output, whether it holds only the step's new positions (an `append` present whose
    /// past the attention reads where it lies: `matmul_runtime::past_where_it_lies`), not the
    /// past and new ones.
    new_only: Vec<bool>,
    /// The graph's last op, the `lm_head`, when the engine computes it outside the plan
    /// (`lm_head.rs`): output `logits` is then that op's input, the hidden state.
    head: Option<Arc<LmHead>>,
}

/// A decoder-only graph compiled by tract.
#[derive(Debug, Clone)]
pub struct TractDecoder(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    sig: Arc<Signature>,
    /// The graph of every step (a merged decoder's cache branch); its weights are shared with
    /// the plans compiled from it.
    template: GraphTemplate,
    /// A merged decoder in `grow` mode: the no-cache branch, for the first step (past of 0).
    first_template: Option<GraphTemplate>,
    /// Compiled plans by `(batch size, first step)`. The batch size is fixed in a plan
    /// because these graphs multiply it with the (symbolic) mask length, which tract cannot
    /// keep symbolic; sequence and past lengths stay symbolic.
    plans: Mutex<HashMap<(usize, bool), Arc<Plan>>>,
    vocab: usize,
    /// The token embeddings of a decoder that reads `inputs_embeds`.
    embed: Option<Embedder>,
    /// The `lm_head` computed outside the plans, shared by them (its int8 copy made once).
    head: OnceLock<Arc<LmHead>>,
    /// Parts of a weight its decoding kernels read side by side.
    streams: streams::Choice,
}

impl TractDecoder {
    /// `embed`: the embeddings model of a decoder that reads `inputs_embeds`.
    pub fn new(
        proto: pb::ModelProto,
        sig: Arc<Signature>,
        vocab: usize,
        embed: Option<Embedder>,
    ) -> Result<Self> {
        let decoded = Decoded {
            proto,
            apart: Default::default(),
        };
        Self::new_decoded(decoded, sig, vocab, embed)
    }

    /// [`TractDecoder::new`] of a graph whose large initializers may be kept apart.
    pub fn new_decoded(
        decoded: Decoded,
        sig: Arc<Signature>,
        vocab: usize,
        embed: Option<Embedder>,
    ) -> Result<Self> {
        let Decoded { mut proto, apart } = decoded;
        if !sig.takes_ids && embed.is_none() {
            return Err(Error::Model(
                "the decoder takes `inputs_embeds`: it needs its embeddings model \
                 (embed_tokens.onnx)"
                    .into(),
            ));
        }
        if !sig.takes_ids && sig.cache_mode != CacheMode::Append {
            return Err(Error::Unsupported(format!(
                "a decoder that takes `inputs_embeds` in the {} cache mode (supported: append, \
                 a decoder with position_ids)",
                sig.cache_mode.name()
            )));
        }
        if sig.has_encoder_hidden_states {
            return Err(Error::Unsupported(
                "this graph is the decoder of an encoder-decoder model (it takes \
                 `encoder_hidden_states`); load the model folder with its encoder"
                    .into(),
            ));
        }
        // The large initializers become tensors, shared by both branches of a merged decoder.
        let apart = shared_initializers(&mut proto, apart)?;
        // A merged decoder is specialised into its branches (the `grow` mode's first step
        // takes the no-cache one); each graph is parsed, then its protobuf dropped.
        let (template, first_template) = if sig.has_use_cache_branch {
            let no_cache = (sig.cache_mode == CacheMode::Grow).then(|| proto.clone());
            let mut with_cache = proto;
            specialize_bool_input(&mut with_cache, "use_cache_branch", true)?;
            rewrite_for_tract(&mut with_cache, &sig);
            let template = GraphTemplate::new(with_cache, &apart)?;
            let first = match no_cache {
                Some(mut no_cache) => {
                    specialize_bool_input(&mut no_cache, "use_cache_branch", false)?;
                    rewrite_for_tract(&mut no_cache, &sig);
                    let first = GraphTemplate::new(no_cache, &apart)?;
                    // Parsed once now (its plan is compiled at the first request), so that a
                    // graph tract cannot read fails at load time.
                    first.parse()?;
                    Some(first)
                }
                None => None,
            };
            (template, first)
        } else {
            rewrite_for_tract(&mut proto, &sig);
            (GraphTemplate::new(proto, &apart)?, None)
        };
        let decoder = TractDecoder(Arc::new(Inner {
            sig,
            template,
            first_template,
            plans: Mutex::new(HashMap::new()),
            vocab,
            embed,
            head: OnceLock::new(),
            streams: streams::Choice::default(),
        }));
        // Compile the plan of one row now, so that a graph tract cannot run fails at load time.
        decoder.0.plan(1, false)?;
        Ok(decoder)
    }

    /// Number of plans compiled so far (one per batch size, plus the first step of a merged
    /// decoder in `grow` mode): they do not depend on sequence or past lengths.
    pub fn plans(&self) -> usize {
        self.0.plans.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Width of the token embeddings of a decoder that reads `inputs_embeds`.
    pub fn embedding_width(&self) -> Option<usize> {
        self.0.embed.as_ref().map(|e| e.hidden)
    }

    /// A fresh state whose rows continue the prompts of `rows_inputs` (their image features
    /// and positions); `None`: token embeddings and index positions.
    pub fn start_with(
        &self,
        rows: usize,
        capacity: usize,
        row_inputs: Option<RowInputs>,
    ) -> Result<Box<dyn DecoderState>> {
        if let Some(ri) = &row_inputs {
            if ri.prompt_of.len() != rows {
                return Err(Error::Backend(format!(
                    "{rows} rows but {} prompt rows",
                    ri.prompt_of.len()
                )));
            }
        }
        let sig = &self.0.sig;
        // `append` hands the whole buffer to the graph as its past, and the graph's attention
        // costs as much as the buffer is long: the buffer starts empty and grows with the rows
        // (`KvCache::reserve`). `in_place` attends only to each row's valid positions.
        let capacity = match sig.cache_mode {
            CacheMode::Grow => 0,
            CacheMode::Append => 1,
            CacheMode::InPlace => capacity.max(1),
        };
        let cache = KvCache::new(
            sig.layers.len(),
            rows,
            sig.kv_heads,
            capacity,
            sig.head_dim,
            sig.kv_dtype,
        )?;
        Ok(Box::new(TractState {
            decoder: self.0.clone(),
            cache,
            broken: false,
            rows: row_inputs,
            bounded: false,
            session: Session::default(),
        }))
    }
}

impl Inner {
    fn plan(&self, batch: usize, first: bool) -> Result<Arc<Plan>> {
        let first = first && self.first_template.is_some();
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("the plan cache is poisoned".into()))?;
        if let Some(p) = plans.get(&(batch, first)) {
            return Ok(p.clone());
        }
        let template = match (&self.first_template, first) {
            (Some(t), true) => t,
            _ => &self.template,
        };
        let width = self.embed.as_ref().map(|e| e.hidden);
        let head_of = |op, weight, dt| shared_head(&self.head, op, weight, dt);
        let plan = Arc::new(compile(template, &self.sig, batch, width, head_of)?);
        plans.insert((batch, first), plan.clone());
        Ok(plan)
    }
}

/// The graph's rewrites for this engine: the logits of the last positions only, and, where
/// the mask covers every past and new position (not `in_place`), the exported padding-mask
/// lookup as the mask with two axes inserted (`padding_mask`).
fn rewrite_for_tract(proto: &mut pb::ModelProto, sig: &Signature) {
    logits_of_last_positions(proto, &sig.logits_name);
    if sig.cache_mode != CacheMode::InPlace {
        crate::model::padding_mask::rewrite(proto);
    }
}

/// Make the graph compute the logits of one position per row, the one the engine reads: the
/// `lm_head` input `[rows, seq, hidden]` goes through `GatherND(batch_dims=1)` with a new input
/// `LAST_POSITIONS` (`[rows, 1, 1]`, giving `[rows, 1, hidden]`), so a prompt of `n` tokens
/// computes one row of logits instead of `n` (the `lm_head` is the largest matmul). Left as it
/// is when the logits do not come straight from a matmul of the hidden states.
/// (Indices of `[rows, 1]` and an `Unsqueeze` after the gather would give the same values, but
/// that `Unsqueeze` is rewritten by tract's codegen, which then runs its passes a second time:
/// 25 ms of a native SmolLM2 load.)
fn logits_of_last_positions(proto: &mut pb::ModelProto, logits: &str) {
    let Some(graph) = proto.graph.as_mut() else {
        return;
    };
    let lm_head = [
        "MatMul",
        "MatMulNBits",
        crate::model::weights::MATMUL_WEIGHTS,
    ];
    let producer = |name: &str| {
        graph
            .node
            .iter()
            .position(|n| n.output.first().map(String::as_str) == Some(name))
    };
    // Through the `Identity` that an inlined branch ends with.
    let Some(mut at) = producer(logits) else {
        return;
    };
    if graph.node[at].op_type == "Identity" {
        match graph.node[at].input.first().and_then(|i| producer(i)) {
            Some(p) => at = p,
            None => return,
        }
    }
    let node = &mut graph.node[at];
    if !lm_head.contains(&node.op_type.as_str()) || node.input.is_empty() {
        return;
    }
    let hidden = node.input[0].clone();
    let gathered = format!("{hidden}/{LAST_POSITIONS}");
    node.input[0] = gathered.clone();
    graph.node.push(pb::NodeProto {
        op_type: "GatherND".into(),
        name: gathered.clone(),
        input: vec![hidden, LAST_POSITIONS.into()],
        output: vec![gathered],
        attribute: vec![pb::AttributeProto {
            name: "batch_dims".into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: 1,
            ..Default::default()
        }],
        ..Default::default()
    });
    let int64 = pb::TypeProto {
        value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
            elem_type: pb::tensor_proto::DataType::Int64 as i32,
            shape: None,
        })),
        ..Default::default()
    };
    graph.input.push(pb::ValueInfoProto {
        name: LAST_POSITIONS.into(),
        r#type: Some(int64),
        ..Default::default()
    });
}

/// The tensors of the large initializers, taken out of the protobuf, which keeps their name,
/// type and shape: those whose data was kept apart become tensors in place
/// (`onnx::into_typed`), the others are converted one at a time, each one's bytes freed
/// before the next. The templates made from clones of the protobuf with these
/// ([`GraphTemplate`]) share them: the branches of a merged decoder hold the weights once. The
/// data of a type that is not a number (a boolean mask) goes back into the protobuf, for tract
/// to read.
pub(crate) fn shared_initializers(
    proto: &mut pb::ModelProto,
    mut apart: Apart,
) -> Result<HashMap<String, Arc<Tensor>>> {
    let mut typed = HashMap::new();
    for t in proto
        .graph
        .iter_mut()
        .flat_map(|g| g.initializer.iter_mut())
    {
        if let Some(bytes) = apart.remove(&t.name) {
            if is_number(t.data_type) {
                typed.insert(t.name.clone(), into_typed(t, bytes)?.into_arc_tensor());
            } else {
                t.raw_data = bytes.as_bytes().to_vec();
            }
        } else if t.raw_data.len() >= super::ops::LARGE_INITIALIZER && is_number(t.data_type) {
            let tensor = load_initializer(t)?;
            t.raw_data = Vec::new();
            typed.insert(t.name.clone(), tensor);
        }
    }
    if let Some(name) = apart.keys().next() {
        return Err(Error::Model(format!(
            "the data of `{name}` belongs to no initializer of the graph"
        )));
    }
    Ok(typed)
}

/// An initializer's tensor, converted by tract from its protobuf (with tract-onnx's default
/// data resolver, without building a whole op registry for each initializer).
fn load_initializer(t: &pb::TensorProto) -> Result<Arc<Tensor>> {
    tract_onnx::tensor::load_tensor(&tract_onnx::data_resolver::MmapDataResolver, t, None)
        .map(|t| t.into_arc_tensor())
        .map_err(|e| Error::Model(format!("initializer `{}`: {e}", t.name)))
}

/// A graph that plans are compiled from, parsed again for each plan: its protobuf without the
/// large initializers, encoded, and those initializers as tensors (shared with the plans and
/// with the other branch of a merged decoder). Kept parsed, fp32 SmolLM2's graph held 9.1 MB
/// (natively) for as long as the model was loaded (4,335 nodes of 1,112 bytes in a vector with
/// room for 8,192), and a second copy while a plan was compiled; encoded, 0.9 MB.
#[derive(Debug, Clone)]
pub(crate) struct GraphTemplate {
    encoded: Vec<u8>,
    large: Vec<(super::ops::InitializerInfo, Arc<Tensor>)>,
    /// The graph's ops outside the standard domain, named when tract cannot read it.
    non_standard: Vec<String>,
}

impl GraphTemplate {
    pub(crate) fn new(
        mut proto: pb::ModelProto,
        apart: &HashMap<String, Arc<Tensor>>,
    ) -> Result<GraphTemplate> {
        let large = take_large_initializers(&mut proto, apart)?;
        let encoded = prost::Message::encode_to_vec(&proto);
        let non_standard = proto.graph.as_ref().map_or_else(Vec::new, non_standard_ops);
        Ok(GraphTemplate {
            encoded,
            large,
            non_standard,
        })
    }

    /// The template of a decoded graph whose large initializers no other graph shares (an
    /// encoder's, a vision encoder's, an embeddings graph's).
    pub(crate) fn of(decoded: Decoded) -> Result<GraphTemplate> {
        let Decoded { mut proto, apart } = decoded;
        let tensors = shared_initializers(&mut proto, apart)?;
        GraphTemplate::new(proto, &tensors)
    }

    /// The graph read into tract (the caller declares its inputs: symbolic sequence and past
    /// lengths, an image's shape).
    pub(crate) fn parse(&self) -> Result<InferenceModel> {
        let proto = <pb::ModelProto as prost::Message>::decode(&self.encoded[..])
            .map_err(|e| Error::Backend(format!("the kept graph cannot be decoded: {e}")))?;
        parse_graph_with(&proto, &self.non_standard, self.large.clone())
    }
}

/// The large initializers of a graph, taken out of its protobuf as tract tensors: converted one
/// at a time, each initializer's bytes freed before the next is converted (tract's parser
/// converts every initializer while the protobuf still holds them all, which holds the weights
/// twice); those in `apart` (their data kept apart, no copy) are taken from there.
fn take_large_initializers(
    proto: &mut pb::ModelProto,
    apart: &HashMap<String, Arc<Tensor>>,
) -> Result<Vec<(super::ops::InitializerInfo, Arc<Tensor>)>> {
    let Some(graph) = proto.graph.as_mut() else {
        return Ok(Vec::new());
    };
    let (large, small): (Vec<_>, Vec<_>) = std::mem::take(&mut graph.initializer)
        .into_iter()
        .partition(|t| {
            t.raw_data.len() >= super::ops::LARGE_INITIALIZER || apart.contains_key(&t.name)
        });
    graph.initializer = small;
    let mut tensors = Vec::with_capacity(large.len());
    for t in large {
        let info = super::ops::InitializerInfo::of(&t);
        let tensor = match apart.get(&t.name) {
            Some(tensor) => tensor.clone(),
            None => load_initializer(&t)?,
        };
        drop(t);
        tensors.push((info, tensor));
    }
    Ok(tensors)
}

/// Parse with `apart` (large initializers taken out of the protobuf, as tensors): tract sees
/// each one as an unresolved input, our op parsers read its type and shape from
/// `ops::initializer`, and each becomes a constant again after the parse.
fn parse_graph_with(
    proto: &pb::ModelProto,
    non_standard: &[String],
    apart: Vec<(super::ops::InitializerInfo, Arc<Tensor>)>,
) -> Result<InferenceModel> {
    let onnx = super::ops::onnx()
        .with_ignore_output_shapes(true)
        .with_ignore_value_info(true);
    let infos = apart.iter().map(|(i, _)| i.clone()).collect();
    let parsed = super::ops::with_initializers_apart(infos, || onnx.parse(proto, None));
    let cannot_read = |e: TractError| {
        Error::Model(format!(
            "tract cannot read the graph: {}",
            unsupported_hint(&e, non_standard)
        ))
    };
    let tract_onnx::model::ParseResult {
        mut model,
        unresolved_inputs,
        ..
    } = parsed.map_err(cannot_read)?;
    let mut tensors: HashMap<String, Arc<Tensor>> =
        apart.into_iter().map(|(i, t)| (i.name, t)).collect();
    for name in unresolved_inputs {
        let Some(tensor) = tensors.remove(&name) else {
            return Err(Error::Model(format!(
                "tract cannot read the graph: a node reads `{name}`, which is no input, \
                 initializer or node output"
            )));
        };
        let id = model.node_by_name(&name).map_err(cannot_read)?.id;
        let fact = TypedFact::try_from(tensor.clone()).map_err(backend)?;
        let node = model.node_mut(id);
        node.op = Box::new(tract_onnx::tract_hir::ops::konst::Const::new(tensor).map_err(backend)?);
        node.outputs[0].fact = fact.into();
        model.inputs.retain(|o| o.node != id);
    }
    Ok(model)
}

/// The plan of `template` for `batch` rows; `embed_width`: the width of `inputs_embeds`, for a
/// decoder that reads them.
fn compile(
    template: &GraphTemplate,
    sig: &Signature,
    batch: usize,
    embed_width: Option<usize>,
    head_of: impl FnOnce(Weights, Arc<Tensor>, DatumType) -> Option<Arc<LmHead>>,
) -> Result<Plan> {
    let mut model = template.parse()?;
    let b = TDim::from(batch);
    let s = TDim::from(model.symbols.sym("sequence"));
    let p = TDim::from(model.symbols.sym("past"));
    let kv_dt = match sig.kv_dtype {
        Dtype::F32 => f32::datum_type(),
        Dtype::F16 => f16::datum_type(),
    };
    let id_dt = if sig.ids_type == ONNX_INT32 {
        i32::datum_type()
    } else {
        i64::datum_type()
    };
    let heads = TDim::from(sig.kv_heads);
    let dim = TDim::from(sig.head_dim);
    let mut roles = vec![];
    let inputs = model.input_outlets().map_err(backend)?.to_vec();
    for (ix, outlet) in inputs.iter().enumerate() {
        let name = model.node(outlet.node).name.clone();
        let (role, fact) = if name == "input_ids" {
            (
                Role::Ids,
                InferenceFact::dt_shape(id_dt, [b.clone(), s.clone()]),
            )
        } else if name == "inputs_embeds" {
            let dt = match sig.input(&name).map(|d| d.elem_type) {
                Some(ONNX_FLOAT16) => f16::datum_type(),
                _ => f32::datum_type(),
            };
            let width = TDim::from(embed_width.unwrap_or(0));
            (
                Role::Embeds,
                InferenceFact::dt_shape(dt, [b.clone(), s.clone(), width]),
            )
        } else if name == "attention_mask" {
            // in_place: the mask covers the valid positions of the longest row (new tokens
            // included), at most the buffer's length `past`.
            let total = if sig.cache_mode == CacheMode::InPlace {
                TDim::from(model.symbols.sym("total"))
            } else {
                p.clone() + s.clone()
            };
            let dt = sig.input(&name).map(|d| d.elem_type).unwrap_or(0);
            let dt = if dt == ONNX_INT32 {
                i32::datum_type()
            } else {
                i64::datum_type()
            };
            (Role::Mask, InferenceFact::dt_shape(dt, [b.clone(), total]))
        } else if name == "position_ids" {
            let shape: TVec<TDim> = match sig.position_axes {
                2 => tvec![b.clone(), s.clone()],
                // M-RoPE: temporal, height and width positions.
                3 => tvec![TDim::from(3), b.clone(), s.clone()],
                n => {
                    return Err(Error::Unsupported(format!(
                        "`position_ids` with {n} axes (supported: [batch, sequence], and \
                         [3, batch, sequence] for M-RoPE)"
                    )))
                }
            };
            (
                Role::Positions,
                InferenceFact::dt_shape(i64::datum_type(), shape),
            )
        } else if name == LAST_POSITIONS {
            (
                Role::LastPositions,
                InferenceFact::dt_shape(i64::datum_type(), [b.clone(), 1.into(), 1.into()]),
            )
        } else if let Some(l) = sig.layers.iter().position(|l| l.past_key == name) {
            let shape = [b.clone(), heads.clone(), p.clone(), dim.clone()];
            (Role::PastKey(l), InferenceFact::dt_shape(kv_dt, shape))
        } else if let Some(l) = sig.layers.iter().position(|l| l.past_value == name) {
            let shape = [b.clone(), heads.clone(), p.clone(), dim.clone()];
            (Role::PastValue(l), InferenceFact::dt_shape(kv_dt, shape))
        } else {
            return Err(Error::Unsupported(format!(
                "the decoder input `{name}` (the engine binds input_ids or inputs_embeds, \
                 attention_mask, position_ids, past_key_values.N.key|value and use_cache_branch)"
            )));
        };
        model.set_input_fact(ix, fact).map_err(backend)?;
        roles.push(role);
    }
    let output_names = output_names(&model)?;
    let out = |name: &str| {
        output_names.iter().position(|n| n == name).ok_or_else(|| {
            Error::Model(format!(
                "the graph has no output `{name}` (outputs: {output_names:?})"
            ))
        })
    };
    let logits = out(&sig.logits_name)?;
    let presents = sig
        .layers
        .iter()
        .map(|l| Ok((out(&l.present_key)?, out(&l.present_value)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut typed = optimize(model).map_err(|e| {
        Error::Model(format!(
            "tract cannot compile the graph: {}",
            unsupported_hint(&e, &template.non_standard)
        ))
    })?;
    // `append` hands its buffers to the graph as the past; the other modes keep the
    // presents as the graph makes them (`grow`: they are the cache).
    let new_only = if sig.cache_mode == CacheMode::Append {
        let inputs = typed.input_outlets().map_err(backend)?;
        let pasts: Vec<OutletId> = roles
            .iter()
            .zip(inputs)
            .filter(|(role, _)| matches!(role, Role::PastKey(_) | Role::PastValue(_)))
            .map(|(_, &outlet)| outlet)
            .collect();
        past_where_it_lies(&mut typed, &pasts).map_err(backend)?
    } else {
        vec![false; typed.outputs.len()]
    };
    crate::model::ops::attention::fuse(&mut typed).map_err(backend)?;
    let head = cut_lm_head(&mut typed, logits, head_of).map_err(backend)?;
    crate::model::ops::baked::bake(&mut typed).map_err(backend)?;
    let runnable = typed.into_runnable().map_err(backend)?;
    Ok(Plan {
        runnable,
        roles,
        logits,
        presents,
        new_only,
        head,
    })
}

/// The `lm_head` of a plan whose graph ends with `op` of `weight` (`cut_lm_head`): every plan of
/// a decoder has the same, and the first one compiled keeps it in `cell` (its int8 copy is then
/// made once).
pub(crate) fn shared_head(
    cell: &OnceLock<Arc<LmHead>>,
    op: Weights,
    weight: Arc<Tensor>,
    dt: DatumType,
) -> Option<Arc<LmHead>> {
    match cell.get() {
        Some(h) if h.is_for(&op, &weight) => Some(h.clone()),
        Some(_) => LmHead::new(op, weight, dt).map(Arc::new),
        None => {
            let h = Arc::new(LmHead::new(op, weight, dt)?);
            Some(cell.get_or_init(|| h).clone())
        }
    }
}

/// When the logits output is a `MatMulWeights` of a constant weight that `LmHead` can compute
/// one logit at a time, the output becomes that op's input (the plan then leaves the op out),
/// and the engine computes the logits (`head_logits`).
fn cut_lm_head(
    typed: &mut TypedModel,
    logits: usize,
    head_of: impl FnOnce(Weights, Arc<Tensor>, DatumType) -> Option<Arc<LmHead>>,
) -> TractResult<Option<Arc<LmHead>>> {
    let node = typed.node(typed.output_outlets()?[logits].node);
    let Some(op) = node.op_as::<WeightsOp>() else {
        return Ok(None);
    };
    let (a, b) = (node.inputs[0], node.inputs[1]);
    let Some(weight) = typed.outlet_fact(b)?.konst.clone() else {
        return Ok(None);
    };
    let dt = typed.outlet_fact(a)?.datum_type;
    let Some(head) = head_of(op.0.clone(), weight, dt) else {
        return Ok(None);
    };
    typed.outputs[logits] = a;
    Ok(Some(head))
}

/// The graph typed with one analysis (`typing.rs`), tract's declutter and codegen passes,
/// without `FoldUniformMask` (run by `optimizer.rs`, which applies their patches faster than
/// tract's own session), then the generic float arithmetic tract leaves per element replaced
/// by vectorized ops (`ops::binary`), the rotary embeddings' seven nodes each one op
/// (`ops::rotary`), the softmaxes' NaN guards done in place
/// (`ops::nan_guard`), the attention products of grouped-query attention rewired to read each
/// group's keys and values where they lie (`matmul_runtime::grouped_kv`), the scales of
/// dynamically quantized products applied by the products (`matmul_integer::fuse_scales`), and
/// the axes' reshapes and moves done on concrete shapes (`ops::axes`). The attentions are
/// fused after it (`attention::fuse`): by [`runnable`], or by a decoder's plan once its
/// products read its cache where it lies (`past_where_it_lies`, whose rewrite takes the
/// products as they are).
///
/// That pass splits an op fed by a boolean mask whose value tract derived symbolically from
/// the coordinates (`uniform_tdim`) into one op per region where the mask is constant. A causal
/// mask computed in the graph (`kv_index <= query_index`, as transformers 4.57's
/// `create_causal_mask` exports for Whisper's decoder) is triangular, not two regions, but
/// the pass accepts a split point that is another axis' coordinate and slices the attention
/// scores by it: the first decoder step then fails ("Can not broadcast 4 against 2") or later
/// steps see wrong shapes. Without the pass the mask is computed as the graph says, which
/// matches onnxruntime (`tests/whisper.rs`); the masks of the other exported decoders are
/// runtime inputs, which the pass cannot fold anyway.
pub(crate) fn optimize(model: InferenceModel) -> TractResult<TypedModel> {
    let mut typed = crate::model::typing::into_typed(model)?;
    crate::model::optimizer::declutter_and_optimize(&mut typed)?;
    crate::model::ops::binary::replace_generic(&mut typed)?;
    crate::model::ops::rotary::fuse(&mut typed)?;
    crate::model::ops::nan_guard::fuse(&mut typed)?;
    crate::model::ops::matmul_runtime::grouped_kv(&mut typed)?;
    crate::model::ops::matmul_integer::fuse_scales(&mut typed)?;
    crate::model::ops::axes::replace(&mut typed)?;
    Ok(typed)
}

/// The plan of a graph without a cache read where it lies (an encoder, a seq2seq decoder):
/// [`optimize`], then its attentions fused (`attention::fuse`).
pub(crate) fn runnable(model: InferenceModel) -> TractResult<Arc<TypedRunnableModel>> {
    let mut typed = optimize(model)?;
    crate::model::ops::attention::fuse(&mut typed)?;
    typed.into_runnable()
}

/// [`runnable`], with the `lm_head` of output `logits` left out of the plan when `head_of`
/// gives one (`cut_lm_head`).
pub(crate) fn runnable_without_head(
    model: InferenceModel,
    logits: usize,
    head_of: impl FnOnce(Weights, Arc<Tensor>, DatumType) -> Option<Arc<LmHead>>,
) -> TractResult<(Arc<TypedRunnableModel>, Option<Arc<LmHead>>)> {
    let mut typed = optimize(model)?;
    crate::model::ops::attention::fuse(&mut typed)?;
    let head = cut_lm_head(&mut typed, logits, head_of)?;
    Ok((typed.into_runnable()?, head))
}

/// The names of a graph's outputs, in order.
pub(crate) fn output_names(model: &InferenceModel) -> Result<Vec<String>> {
    Ok(model
        .output_outlets()
        .map_err(backend)?
        .iter()
        .map(|o| {
            model
                .outlet_label(*o)
                .unwrap_or(&model.node(o.node).name)
                .to_owned()
        })
        .collect())
}

/// A tract error, with the list of non-standard ops when the graph has any.
fn unsupported_hint(e: &TractError, non_standard: &[String]) -> String {
    if non_standard.is_empty() {
        format!("{e:?}")
    } else {
        format!(
            "{e:?} (the graph uses non-standard ops: {})",
            non_standard.join(", ")
        )
    }
}

impl Decoder for TractDecoder {
    fn vocab_size(&self) -> usize {
        self.0.vocab
    }

    fn start(&self, rows: usize, capacity: usize) -> Result<Box<dyn DecoderState>> {
        self.start_with(rows, capacity, None)
    }
}

/// One request's cache, and the decoder whose plans it runs.
struct TractState {
    decoder: Arc<Inner>,
    cache: KvCache,
    /// A failed in_place step lost the buffers it had handed to the graph.
    broken: bool,
    /// The prompt of each row and the request's image features and positions.
    rows: Option<RowInputs>,
    /// Greedy decoding, or sampling with `top_k`: a decoding step of one row returns upper bounds
    /// of its logits (`DecoderState::bound_logits`).
    bounded: bool,
    /// tract's state of the last step's plan.
    session: Session,
}

impl DecoderState for TractState {
    fn step(&mut self, tokens: &[&[u32]]) -> Result<Logits> {
        let rows = self.cache.rows();
        if tokens.len() != rows {
            return Err(Error::Backend(format!(
                "a step got tokens for {} rows; the cache has {rows}",
                tokens.len()
            )));
        }
        let counts: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let seq = counts.iter().copied().max().unwrap_or(0);
        let vocab = self.decoder.vocab;
        if seq == 0 {
            return Ok(Logits::exact(rows, vocab, vec![0.0; rows * vocab]));
        }
        // The step's products, the `lm_head`'s included, on a team of threads (`parallel`).
        let kind = if seq == 1 {
            Step::Decoding
        } else {
            Step::Other
        };
        let decoder = Arc::clone(&self.decoder);
        let mut step = || {
            parallel::team(kind, || match self.decoder.sig.cache_mode {
                CacheMode::Grow => self.step_grow(tokens, seq),
                CacheMode::InPlace => self.step_in_place(tokens, &counts, seq),
                CacheMode::Append => self.step_append(tokens, &counts, seq),
            })
        };
        // A step of one row and one token runs the decoding kernels, which read their weights
        // as one stream or as four where that is faster on this machine (`streams`).
        if kind == Step::Decoding && rows == 1 {
            decoder.streams.decoding_step(step)
        } else {
            step()
        }
    }

    fn reorder(&mut self, parents: &[usize]) -> Result<()> {
        self.cache.reorder(parents)?;
        if let Some(rows) = &mut self.rows {
            rows.reorder(parents);
        }
        Ok(())
    }

    fn lengths(&self) -> &[usize] {
        &self.cache.lengths
    }

    fn is_ready_for(&self, rows: usize) -> bool {
        self.decoder
            .plans
            .lock()
            .map(|p| p.contains_key(&(rows, false)))
            .unwrap_or(false)
    }

    fn rows_may_differ(&self) -> bool {
        self.decoder.sig.cache_mode != CacheMode::Grow
    }

    fn bound_logits(&mut self, on: bool) {
        self.bounded = on;
    }
}

impl TractState {
    /// `append`: the past is the whole buffer (capacity `C`); the mask shows each row's valid
    /// positions and its new tokens; positions continue each row's length.
    fn step_append(&mut self, tokens: &[&[u32]], counts: &[usize], seq: usize) -> Result<Logits> {
        let rows = tokens.len();
        let needed = self
            .cache
            .lengths
            .iter()
            .zip(counts)
            .map(|(l, c)| l + c)
            .max()
            .unwrap_or(0);
        self.cache.reserve(needed)?;
        let cap = self.cache.capacity();
        let mut ids = vec![0i64; rows * seq];
        let mut mask = vec![0i64; rows * (cap + seq)];
        let axes = if self.decoder.sig.position_axes == 3 {
            3
        } else {
            1
        };
        let mut positions = vec![0i64; axes * rows * seq];
        for r in 0..rows {
            let len = self.cache.lengths[r];
            for (j, &t) in tokens[r].iter().enumerate() {
                ids[r * seq + j] = t as i64;
            }
            for a in 0..axes {
                for j in 0..seq {
                    positions[(a * rows + r) * seq + j] = match &self.rows {
                        Some(ri) => ri.inputs.position(ri.prompt_of[r], a, len + j),
                        None => (len + j) as i64,
                    };
                }
            }
            let m = &mut mask[r * (cap + seq)..(r + 1) * (cap + seq)];
            m[..len].fill(1);
            // Every new position is visible: padding positions (beyond the row's tokens) are
            // hidden from the real ones by causality, and seeing themselves keeps their rows of
            // the attention finite.
            m[cap..].fill(1);
        }
        let plan = self.decoder.plan(rows, false)?;
        let outputs = self.run(&plan, counts, ids, mask, positions)?;
        // Where a present holds the past too, its new positions come after the buffer's.
        let from = |o: usize| if plan.new_only[o] { 0 } else { cap };
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            let (key, value) = ((&*outputs[k], from(k)), (&*outputs[v], from(v)));
            self.cache.append(l, key, value, counts)?;
        }
        self.cache.advance(counts);
        self.logits(&plan, &outputs[plan.logits], counts)
    }

    /// `in_place` (GroupQueryAttention, past and present share one buffer): every row gets
    /// `seq` positions after its length (its tokens, then padding that later steps overwrite);
    /// the mask's ones count them (the graph derives `seqlens_k` and `total_sequence_length`
    /// from it). The buffers are handed to the graph, which writes the new keys and values in
    /// place and hands them back as the presents: nothing is copied.
    fn step_in_place(&mut self, tokens: &[&[u32]], counts: &[usize], seq: usize) -> Result<Logits> {
        if self.broken {
            return Err(Error::Backend(
                "this request's cache was lost by a failed step; start a new request".into(),
            ));
        }
        let rows = tokens.len();
        let total = self
            .cache
            .lengths
            .iter()
            .map(|l| l + seq)
            .max()
            .unwrap_or(0);
        self.cache.reserve(total)?;
        let mut ids = vec![0i64; rows * seq];
        let mut mask = vec![0i64; rows * total];
        for r in 0..rows {
            for (j, &t) in tokens[r].iter().enumerate() {
                ids[r * seq + j] = t as i64;
            }
            mask[r * total..r * total + self.cache.lengths[r] + seq].fill(1);
        }
        let plan = self.decoder.plan(rows, false)?;
        // The graph owns the buffers while it runs; a failure loses them.
        self.broken = true;
        let outputs = self.run(&plan, counts, ids, mask, vec![])?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            let key = outputs[k].clone().into_arc_tensor();
            let value = outputs[v].clone().into_arc_tensor();
            self.cache.layers[l] = (key, value);
        }
        self.broken = false;
        self.cache.advance(counts);
        self.logits(&plan, &outputs[plan.logits], counts)
    }

    /// `grow`: every row has the same length and the same number of new tokens; the presents
    /// become the cache.
    fn step_grow(&mut self, tokens: &[&[u32]], seq: usize) -> Result<Logits> {
        let rows = tokens.len();
        let len = self.cache.lengths.first().copied().unwrap_or(0);
        if tokens.iter().any(|t| t.len() != seq) || self.cache.lengths.iter().any(|&l| l != len) {
            return Err(Error::Backend(
                "grow mode runs rows of equal lengths with equal numbers of new tokens".into(),
            ));
        }
        let ids: Vec<i64> = tokens
            .iter()
            .flat_map(|t| t.iter().map(|&x| x as i64))
            .collect();
        let mask = vec![1i64; rows * (len + seq)];
        let plan = self.decoder.plan(rows, len == 0)?;
        let counts = vec![seq; rows];
        let outputs = self.run(&plan, &counts, ids, mask, vec![])?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            let key = outputs[k].clone().into_arc_tensor();
            let value = outputs[v].clone().into_arc_tensor();
            self.cache.layers[l] = (key, value);
        }
        self.cache.advance(&vec![seq; rows]);
        self.logits(&plan, &outputs[plan.logits], &counts)
    }

    /// Run `plan` on `ids` (`rows x seq`, each row's `counts[r]` tokens then padding), before
    /// the cache lengths advance.
    fn run(
        &mut self,
        plan: &Plan,
        counts: &[usize],
        ids: Vec<i64>,
        mask: Vec<i64>,
        positions: Vec<i64>,
    ) -> Result<TVec<TValue>> {
        let rows = counts.len();
        let seq = ids.len() / rows.max(1);
        let mut inputs: TVec<TValue> = tvec![];
        let in_place = self.decoder.sig.cache_mode == CacheMode::InPlace;
        let empty = Arc::new(Tensor::zero::<f32>(&[0]).map_err(backend)?);
        for (ix, role) in plan.roles.iter().enumerate() {
            let fact_dt = plan
                .runnable
                .model()
                .input_fact(ix)
                .map_err(backend)?
                .datum_type;
            let v: TValue = match role {
                Role::Ids => int_tensor(&ids, &[rows, seq], fact_dt)?.into(),
                Role::Embeds => self
                    .embeddings(&ids, counts, seq)?
                    .cast_to_dt(fact_dt)
                    .map_err(backend)?
                    .into_owned()
                    .into(),
                Role::Mask => int_tensor(&mask, &[rows, mask.len() / rows.max(1)], fact_dt)?.into(),
                Role::Positions if positions.len() == 3 * rows * seq => {
                    int_tensor(&positions, &[3, rows, seq], fact_dt)?.into()
                }
                Role::Positions => int_tensor(&positions, &[rows, seq], fact_dt)?.into(),
                Role::LastPositions => {
                    let last: Vec<i64> = counts.iter().map(|&c| c.max(1) as i64 - 1).collect();
                    int_tensor(&last, &[rows, 1, 1], fact_dt)?.into()
                }
                Role::PastKey(l) | Role::PastValue(l) if in_place => {
                    // Hand the buffer over (the graph writes into it and returns it).
                    let layer = self
                        .cache
                        .layers
                        .get_mut(*l)
                        .ok_or_else(|| Error::Backend(format!("the cache has no layer {l}")))?;
                    let slot = if matches!(role, Role::PastKey(_)) {
                        &mut layer.0
                    } else {
                        &mut layer.1
                    };
                    TValue::from_const(std::mem::replace(slot, empty.clone()))
                }
                Role::PastKey(l) => TValue::from_const(self.cache.layers[*l].0.clone()),
                Role::PastValue(l) => TValue::from_const(self.cache.layers[*l].1.clone()),
            };
            inputs.push(v);
        }
        self.session.run(&plan.runnable, inputs).map_err(backend)
    }
}

impl TractState {
    /// [`head_logits`] of the plan's output `out`.
    fn logits(&self, plan: &Plan, out: &Tensor, counts: &[usize]) -> Result<Logits> {
        let vocab = self.decoder.vocab;
        head_logits(plan.head.as_ref(), self.bounded, out, counts, vocab)
    }

    /// The embeddings of a step's ids, `[rows, seq, hidden]`: the embeddings model's, with the
    /// rows of image features in place of the prompt's image tokens.
    fn embeddings(&self, ids: &[i64], counts: &[usize], seq: usize) -> Result<Tensor> {
        let embed = self.decoder.embed.as_ref().ok_or_else(|| {
            Error::Model("the decoder takes `inputs_embeds` but has no embeddings model".into())
        })?;
        let mut data = embed.embed(ids, counts.len(), seq)?;
        let hidden = embed.hidden;
        if let Some(ri) = &self.rows {
            for (r, &count) in counts.iter().enumerate() {
                let len = self.cache.lengths[r];
                for j in 0..count {
                    if let Some(f) = ri.inputs.feature(ri.prompt_of[r], len + j) {
                        let at = (r * seq + j) * hidden;
                        data[at..at + hidden].copy_from_slice(f);
                    }
                }
            }
        }
        Tensor::from_shape(&[counts.len(), seq, hidden], &data).map_err(backend)
    }
}

/// The values of `t` as f32: in place for an f32 tensor, else converted.
fn f32_values(t: &Tensor) -> Result<std::borrow::Cow<'_, [f32]>> {
    if t.datum_type() == f32::datum_type() {
        let plain = t.try_as_plain_ram().map_err(backend)?;
        return Ok(std::borrow::Cow::Borrowed(
            plain.as_slice::<f32>().map_err(backend)?,
        ));
    }
    let t = t.cast_to::<f32>().map_err(backend)?;
    let plain = t.try_as_plain_ram().map_err(backend)?;
    Ok(std::borrow::Cow::Owned(
        plain.as_slice::<f32>().map_err(backend)?.to_vec(),
    ))
}

pub(crate) fn int_tensor(values: &[i64], shape: &[usize], dt: DatumType) -> Result<Tensor> {
    let t = Tensor::from_shape(shape, values).map_err(backend)?;
    if dt == i64::datum_type() {
        Ok(t)
    } else {
        t.cast_to_dt(dt).map(|c| c.into_owned()).map_err(backend)
    }
}

/// The logits of each row's last new token from a plan's output `out`: the logits themselves,
/// or the hidden state when the engine computes the `lm_head` (`head`, `cut_lm_head`), with the
/// op's values. A decoding step of one row with `bounded` (`DecoderState::bound_logits`) gets upper
/// bounds of its logits when they exist (`LmHead::bounds`).
pub(crate) fn head_logits(
    head: Option<&Arc<LmHead>>,
    bounded: bool,
    out: &Tensor,
    counts: &[usize],
    vocab: usize,
) -> Result<Logits> {
    let Some(head) = head else {
        return last_logits(out, counts, vocab);
    };
    if head.vocab() != vocab {
        return Err(Error::Model(format!(
            "the logits are {} wide; expected {vocab}",
            head.vocab()
        )));
    }
    let hidden = f32_values(out)?;
    let k = head.hidden_width();
    let shape = out.shape();
    let all_rows = hidden.len() / k.max(1);
    if shape.len() != 3 || hidden.len() != all_rows * k {
        return Err(Error::Backend(format!(
            "the lm_head's input has shape {shape:?}; expected [batch, sequence, {k}]"
        )));
    }
    if bounded && all_rows == 1 && counts == [1] {
        let mut data = vec![0f32; vocab];
        if head.bounds(&hidden, &mut data)? {
            let row = BoundRow::new(hidden.to_vec(), vocab);
            return Ok(Logits {
                rows: 1,
                vocab,
                data,
                bounds: Some(Bounds {
                    head: head.clone(),
                    rows: vec![Some(row)],
                }),
            });
        }
    }
    // The op's product over all its rows, as the plan would have run it.
    let mut all = vec![0f32; all_rows * vocab];
    head.full(&hidden, all_rows, &mut all)?;
    last_rows(&all, shape[0], shape[1], vocab, counts)
}

/// The logits of position `counts[r] - 1` of each row of `[rows, seq, vocab]` (position 0
/// when the graph computed only each row's last position: `[rows, 1, vocab]`).
fn last_logits(logits: &Tensor, counts: &[usize], vocab: usize) -> Result<Logits> {
    let shape = logits.shape();
    let (rows, seq, width) = match shape {
        &[r, s, v] => (r, s, v),
        _ => {
            return Err(Error::Backend(format!(
                "logits have shape {shape:?}; expected [batch, sequence, vocab]"
            )))
        }
    };
    if width != vocab {
        return Err(Error::Model(format!(
            "the logits are {width} wide; expected {vocab}"
        )));
    }
    last_rows(&f32_values(logits)?, rows, seq, vocab, counts)
}

/// [`last_logits`] of the values `all` of `[rows, seq, vocab]`.
fn last_rows(
    all: &[f32],
    rows: usize,
    seq: usize,
    vocab: usize,
    counts: &[usize],
) -> Result<Logits> {
    if all.len() != rows * seq * vocab || counts.len() != rows {
        return Err(Error::Backend(format!(
            "{} logits for {rows} rows of {seq} positions of {vocab} and {} counts",
            all.len(),
            counts.len()
        )));
    }
    let mut data = vec![0.0f32; rows * vocab];
    for r in 0..rows {
        if counts[r] == 0 {
            continue;
        }
        let at = (r * seq + (counts[r] - 1).min(seq - 1)) * vocab;
        data[r * vocab..(r + 1) * vocab].copy_from_slice(&all[at..at + vocab]);
    }
    Ok(Logits::exact(rows, vocab, data))
}

/// `steps` (each row's tokens per step) through three states of one model: `whole`, whose
/// plans compute the `lm_head`, and `cut` and `bounded`, whose plans leave it out (`Plan::head`;
/// `bounded` in greedy decoding). `cut` gives `whole`'s logits bit for bit; `bounded` gives upper
/// bounds of them for a decoding step of one row, which become them exactly (some logits, then
/// the row), and their bits otherwise.
#[cfg(test)]
pub(crate) fn check_head_outside(
    name: &str,
    vocab: usize,
    steps: &[Vec<Vec<u32>>],
    mut whole: Box<dyn DecoderState>,
    mut cut: Box<dyn DecoderState>,
    mut bounded: Box<dyn DecoderState>,
) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    bounded.bound_logits(true);
    for (s, step) in steps.iter().enumerate() {
        let rows = step.len();
        let tokens: Vec<&[u32]> = step.iter().map(|t| t.as_slice()).collect();
        let exact = whole.step(&tokens).unwrap();
        assert!(exact.bounds.is_none());
        let b = cut.step(&tokens).unwrap();
        assert!(b.bounds.is_none(), "{name}: bounds without asking");
        assert_eq!(
            bits(&exact.data),
            bits(&b.data),
            "{name}, {rows} rows, step {s}"
        );
        let mut c = bounded.step(&tokens).unwrap();
        // Bounds only for a decoding step of one row.
        assert_eq!(c.is_bounded(0), rows == 1 && s > 0, "{name}, step {s}");
        for (j, (&e, &u)) in exact.data.iter().zip(&c.data).enumerate() {
            assert!(
                e <= u,
                "{name}, step {s}: logit {j} {e} above its bound {u}"
            );
        }
        if c.is_bounded(0) {
            let some = [0, 3, vocab as u32 - 1];
            c.make_exact(0, &some).unwrap();
            for j in some {
                assert!(c.is_exact(0, j));
                let (e, v) = (exact.data[j as usize], c.data[j as usize]);
                assert_eq!(e.to_bits(), v.to_bits(), "{name}: logit {j}");
            }
            assert!(!c.is_exact(0, 1));
            c.make_row_exact(0).unwrap();
            assert!(!c.is_bounded(0) && c.is_exact(0, 1));
        }
        assert_eq!(bits(&exact.data), bits(&c.data), "{name}, step {s}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{onnx, ModelFiles};

    fn genai_state(capacity: usize) -> TractState {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models/llama-genai");
        let files = ModelFiles::from_dir(&dir, None).unwrap();
        let proto = onnx::decode(
            &files.model,
            files.external_data.as_deref(),
            &files.model_name,
        )
        .unwrap();
        let config: serde_json::Value = serde_json::from_slice(&files.config).unwrap();
        let sig = Arc::new(Signature::read(&proto, &config).unwrap());
        assert_eq!(sig.cache_mode, CacheMode::InPlace);
        let decoder = TractDecoder::new(proto, sig.clone(), 512, None).unwrap();
        let cache = KvCache::new(
            sig.layers.len(),
            2,
            sig.kv_heads,
            capacity,
            sig.head_dim,
            sig.kv_dtype,
        )
        .unwrap();
        TractState {
            decoder: decoder.0.clone(),
            cache,
            broken: false,
            rows: None,
            bounded: false,
            session: Session::default(),
        }
    }

    /// The files and the parsed `config.json` of the fixture model `name`.
    fn fixture(name: &str) -> (ModelFiles, serde_json::Value) {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models")
            .join(name);
        let files = ModelFiles::from_dir(&dir, None).unwrap();
        let config = serde_json::from_slice(&files.config).unwrap();
        (files, config)
    }

    /// An exported `append` decoder (Llama, as optimum exports SmolLM2) attends to the past
    /// where it lies: every plan's presents hold the new positions only
    /// (`past_where_it_lies`), for one row and for a batch. (Its generations are checked
    /// against transformers' in `tests/`.) GPT-2's exports transpose the keys in the graph
    /// before their product, so only their values' presents are new positions only.
    #[test]
    fn append_plans_read_the_past_where_it_lies() {
        for name in ["gpt2", "gpt2-merged", "llama"] {
            let (files, config) = fixture(name);
            let mut proto = onnx::decode(&files.model, None, &files.model_name).unwrap();
            crate::model::weights::runtime_matmuls(&mut proto);
            let sig = Arc::new(Signature::read(&proto, &config).unwrap());
            assert_eq!(sig.cache_mode, CacheMode::Append, "{name}");
            let decoder = TractDecoder::new(proto, sig, 512, None).unwrap();
            for rows in [1, 3] {
                let plan = decoder.0.plan(rows, false).unwrap();
                assert!(!plan.presents.is_empty(), "{name}");
                for &(k, v) in &plan.presents {
                    let keys = plan.new_only[k] || name.starts_with("gpt2");
                    assert!(keys && plan.new_only[v], "{name}, {rows} rows");
                }
            }
        }
    }

    /// A graph whose large initializers were kept apart by the stream decoder (straight into
    /// their tensors' buffers, the f32 weights transposed there) computes the same logits, bit
    /// for bit, as the same graph decoded whole: a plain, a merged and a GQA decoder, fed in
    /// odd-sized chunks.
    #[test]
    fn initializers_kept_apart_give_the_same_logits() {
        for name in ["gpt2", "gpt2-merged", "llama"] {
            let (files, config) = fixture(name);
            let whole = onnx::decode(&files.model, None, &files.model_name).unwrap();
            let mut stream = onnx::StreamDecoder::new_apart(&files.model_name).with_large(1024);
            for chunk in files.model.chunks(4093) {
                stream.feed(chunk).unwrap();
            }
            let apart = onnx::prepare(stream.finish().unwrap(), None, &files.model_name).unwrap();
            assert!(
                apart.apart.len() > 3,
                "{name}: {} kept apart",
                apart.apart.len()
            );
            let sig = Arc::new(Signature::read(&whole, &config).unwrap());
            let vocab = config["vocab_size"].as_u64().unwrap() as usize;
            let logits = |d: TractDecoder| {
                let mut state = d.start(1, 16).unwrap();
                let first = state.step(&[&[1, 5, 9, 2]]).unwrap().data;
                let next = state.step(&[&[7]]).unwrap().data;
                (first, next)
            };
            let a = logits(TractDecoder::new(whole, sig.clone(), vocab, None).unwrap());
            let b = logits(TractDecoder::new_decoded(apart, sig.clone(), vocab, None).unwrap());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(!a.0.is_empty() && !a.1.is_empty(), "{name}");
            assert_eq!(bits(&a.0), bits(&b.0), "{name}: the prompt step");
            assert_eq!(bits(&a.1), bits(&b.1), "{name}: the next step");
        }
    }

    /// The `lm_head` computed outside the plan (`Plan::head`) gives the plan's own logits bit
    /// for bit: each fixture decoder against a plan compiled with its `lm_head` inside, for a
    /// prompt and decoding steps, one row and two. In greedy decoding (`bounded`) a decoding
    /// step of one row gives upper bounds of those logits, which become them exactly.
    #[test]
    fn lm_head_outside_the_plan_gives_the_plan_logits() {
        for name in ["gpt2", "gpt2-merged", "llama", "llama-genai"] {
            let (files, config) = fixture(name);
            let external = files.external_data.as_deref();
            let proto = onnx::decode(&files.model, external, &files.model_name).unwrap();
            let sig = Arc::new(Signature::read(&proto, &config).unwrap());
            let vocab = config["vocab_size"].as_u64().unwrap() as usize;
            let cut = TractDecoder::new(proto, sig.clone(), vocab, None).unwrap();
            assert!(cut.0.plan(1, false).unwrap().head.is_some(), "{name}");
            let mut plans = HashMap::new();
            for rows in [1, 2] {
                let uncut = compile(&cut.0.template, &sig, rows, None, |_, _, _| None);
                plans.insert((rows, false), Arc::new(uncut.unwrap()));
            }
            let whole = TractDecoder(Arc::new(Inner {
                sig: sig.clone(),
                template: cut.0.template.clone(),
                first_template: None,
                plans: Mutex::new(plans),
                vocab,
                embed: None,
                head: OnceLock::new(),
                streams: Default::default(),
            }));
            assert!(whole.0.plan(1, false).unwrap().head.is_none());
            for rows in [1, 2] {
                let steps: Vec<Vec<Vec<u32>>> = vec![
                    vec![vec![1, 5, 9, 2], vec![4, 4, 3, 8]][..rows].to_vec(),
                    vec![vec![7], vec![6]][..rows].to_vec(),
                    vec![vec![3], vec![11]][..rows].to_vec(),
                ];
                let whole = whole.start(rows, 16).unwrap();
                let (cut, bounded) = (cut.start(rows, 16).unwrap(), cut.start(rows, 16).unwrap());
                check_head_outside(name, vocab, &steps, whole, cut, bounded);
            }
        }
    }

    /// Kept-apart data of a number type becomes its tensor in place, and a large initializer
    /// whose data is in the protobuf is taken out of it; a boolean mask's data goes back into
    /// the protobuf (tract reads its bytes as booleans).
    #[test]
    fn shared_initializers_leave_booleans_in_the_protobuf() {
        let tensor = |name: &str, data_type: i32, dims: i64, raw: Vec<u8>| pb::TensorProto {
            name: name.into(),
            data_type,
            dims: vec![dims],
            raw_data: raw,
            ..Default::default()
        };
        let floats: Vec<u8> = (0..300).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let model = pb::ModelProto {
            graph: Some(pb::GraphProto {
                initializer: vec![
                    tensor(
                        "mask",
                        9,
                        2048,
                        (0..2048).map(|i| (i % 3 == 0) as u8).collect(),
                    ),
                    tensor("w", 1, 300, floats),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = prost::Message::encode_to_vec(&model);
        let mut stream = onnx::StreamDecoder::new_apart("m.onnx").with_large(1024);
        stream.feed(&bytes).unwrap();
        let Decoded { mut proto, apart } = stream.finish().unwrap();
        assert_eq!(apart.len(), 2);
        // A large initializer whose data is in the protobuf (a graph decoded whole).
        let big: Vec<u8> = (0..16384).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let graph = proto.graph.as_mut().unwrap();
        graph.initializer.push(tensor("big", 1, 16384, big));
        let typed = shared_initializers(&mut proto, apart).unwrap();
        let mut names: Vec<_> = typed.keys().collect();
        names.sort();
        assert_eq!(names, ["big", "w"]);
        let w = typed["w"].try_as_plain_ram().unwrap();
        assert_eq!(w.as_slice::<f32>().unwrap()[299], 299.0);
        let big = typed["big"].try_as_plain_ram().unwrap();
        assert_eq!(big.as_slice::<f32>().unwrap()[16383], 16383.0);
        let g = proto.graph.unwrap();
        let mask = g.initializer.iter().find(|t| t.name == "mask").unwrap();
        assert_eq!(mask.raw_data.len(), 2048);
        assert_eq!(mask.raw_data[3], 1);
        let big = g.initializer.iter().find(|t| t.name == "big").unwrap();
        assert!(big.raw_data.is_empty() && big.dims == [16384]);
    }

    fn buffers(state: &TractState) -> Vec<*const u8> {
        state
            .cache
            .layers
            .iter()
            .flat_map(|(k, v)| [k.as_bytes().as_ptr(), v.as_bytes().as_ptr()])
            .collect()
    }

    /// The in_place step hands the buffers to GroupQueryAttention, which writes the new rows
    /// into them and returns them: the same memory before and after every step (no copy).
    #[test]
    fn in_place_steps_keep_the_same_buffers() {
        let mut state = genai_state(16);
        let before = buffers(&state);
        state.step(&[&[1, 5, 9], &[1, 7]]).unwrap();
        state.step(&[&[3], &[4]]).unwrap();
        state.step(&[&[6], &[8]]).unwrap();
        assert_eq!(state.cache.lengths, vec![5, 4]);
        assert_eq!(buffers(&state), before, "a step copied the cache");
        assert_eq!(state.cache.capacity(), 16);
    }

    /// Rows of different lengths in one step give the same logits as each row alone.
    #[test]
    fn in_place_rows_are_independent() {
        let mut both = genai_state(8);
        let a = both.step(&[&[1, 5, 9], &[1, 7]]).unwrap();
        let b = both.step(&[&[3], &[4, 2]]).unwrap();
        for (r, (first, second)) in [(&[1u32, 5, 9][..], &[3u32][..]), (&[1, 7], &[4, 2])]
            .into_iter()
            .enumerate()
        {
            let mut alone = genai_state(8);
            alone.cache = KvCache::new(2, 1, 2, 8, 16, Dtype::F32).unwrap();
            let x = alone.step(&[first]).unwrap();
            let y = alone.step(&[second]).unwrap();
            for (p, q) in x.row(0).iter().zip(a.row(r)) {
                assert!((p - q).abs() < 1e-4, "row {r}, step 1: {p} vs {q}");
            }
            for (p, q) in y.row(0).iter().zip(b.row(r)) {
                assert!((p - q).abs() < 1e-4, "row {r}, step 2: {p} vs {q}");
            }
        }
    }
}
