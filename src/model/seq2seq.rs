//! Encoder-decoder models (T5, BART, Marian, Whisper): `encoder_model.onnx` runs once per
//! request; the decoder is either the merged `decoder_model_merged.onnx` (`use_cache_branch`,
//! specialised into its two branches at load) or the split pair `decoder_model.onnx` (first
//! step) + `decoder_with_past_model.onnx`. The first decoder step computes the cross-attention
//! cache (`present.N.encoder.*`); it is kept as it is for every later step (no copy per step),
//! while the self-attention cache grows with the decoder sequence (these decoders take no
//! positions: they count from the past length).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use tract_onnx::pb;
use tract_onnx::prelude::*;

use crate::cache::gather_rows;
use crate::decoder::{DecoderState, Logits};
use crate::error::{backend, Error, Result};
use crate::model::lm_head::LmHead;
use crate::model::onnx::{specialize_bool_input, Decoded};
use crate::model::ops::matmul_weights::Weights;
use crate::model::ops::parallel::{self, Step};
use crate::model::ops::streams;
use crate::model::session::Session;
use crate::model::signature::{Dtype, Signature, ONNX_INT32};
use crate::model::tract_decoder::{
    head_logits, int_tensor, output_names, runnable, runnable_without_head, shared_head,
    shared_initializers, GraphTemplate,
};

/// What a request gives the encoder.
#[derive(Debug, Clone, PartialEq)]
pub enum EncoderInput {
    /// Token ids of each prompt (T5, BART, Marian); padded to a common length with a mask.
    Ids(Vec<Vec<u32>>),
    /// Input features of each prompt, all of one shape (Whisper: `[mel bins, frames]`).
    Features {
        shape: Vec<usize>,
        rows: Vec<Vec<f32>>,
    },
    /// The encoder's output for an input (`Model::encode`): requests that start from it do
    /// not run the encoder again.
    Encoded(Encoded),
}

/// The output of an encoder run, and whether the encoder read features (Whisper).
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    hidden: Arc<Tensor>,
    mask: Arc<Tensor>,
    from_features: bool,
}

impl EncoderInput {
    pub fn rows(&self) -> usize {
        match self {
            EncoderInput::Ids(p) => p.len(),
            EncoderInput::Features { rows, .. } => rows.len(),
            EncoderInput::Encoded(e) => e.hidden.shape().first().copied().unwrap_or(0),
        }
    }

    /// Whether the encoder reads (or read) audio features rather than token ids.
    pub fn is_features(&self) -> bool {
        match self {
            EncoderInput::Ids(_) => false,
            EncoderInput::Features { .. } => true,
            EncoderInput::Encoded(e) => e.from_features,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Ids,
    EncoderMask,
    EncoderHidden,
    PastKey(usize),
    PastValue(usize),
    CrossKey(usize),
    CrossValue(usize),
}

#[derive(Debug)]
struct Plan {
    runnable: Arc<TypedRunnableModel>,
    roles: Vec<Role>,
    logits: usize,
    presents: Vec<(usize, usize)>,
    /// Present cross-attention outputs (only the first-step graph has them).
    cross: Vec<(usize, usize)>,
    /// The `lm_head` computed outside the plan (output `logits` is then its input), as a
    /// decoder-only model's (`tract_decoder::cut_lm_head`).
    head: Option<Arc<LmHead>>,
}

#[derive(Debug)]
struct EncoderPlan {
    runnable: Arc<TypedRunnableModel>,
    /// Index of the `attention_mask` input, when the encoder takes one.
    mask: Option<usize>,
    output: usize,
}

/// An encoder and its decoder graphs.
#[derive(Debug)]
pub struct Seq2Seq {
    pub signature: Arc<Signature>,
    encoder: GraphTemplate,
    encoder_features: bool,
    first: GraphTemplate,
    with_past: GraphTemplate,
    plans: Mutex<HashMap<(usize, u8), Arc<Plan>>>,
    encoder_plans: Mutex<HashMap<usize, Arc<EncoderPlan>>>,
    /// The `lm_head` computed outside the decoder plans, shared by them (its int8 copy made
    /// once): greedy decoding and sampling with `top_k` read bounds of the logits from it
    /// (`LmHead::bounds`).
    head: OnceLock<Arc<LmHead>>,
    vocab: usize,
    /// How many parts of a weight the decoding steps of one row read side by side, chosen on
    /// the first of them (`streams`), as a decoder-only model's.
    streams: streams::Choice,
}

/// The ONNX graphs of an encoder-decoder model, handed over: each is dropped once parsed.
pub struct Seq2SeqGraphs {
    pub encoder: Decoded,
    /// `decoder_model_merged.onnx`, or `decoder_with_past_model.onnx` of the split pair.
    pub decoder: Decoded,
    /// `decoder_model.onnx` of the split pair.
    pub first_decoder: Option<pb::ModelProto>,
}

impl Seq2Seq {
    pub fn new(graphs: Seq2SeqGraphs, sig: Arc<Signature>, vocab: usize) -> Result<Self> {
        let encoder_sig = graphs
            .encoder
            .proto
            .graph
            .as_ref()
            .map(|g| g.input.iter().map(|i| i.name.clone()).collect::<Vec<_>>())
            .unwrap_or_default();
        let encoder_features = encoder_sig.iter().any(|n| n == "input_features");
        if !encoder_features && !encoder_sig.iter().any(|n| n == "input_ids") {
            return Err(Error::Model(format!(
                "the encoder takes neither `input_ids` nor `input_features` (its inputs: {})",
                encoder_sig.join(", ")
            )));
        }
        let none = HashMap::new();
        let encoder = GraphTemplate::of(graphs.encoder)?;
        let Decoded {
            proto: mut decoder,
            apart,
        } = graphs.decoder;
        // The large initializers become tensors, shared by both branches of a merged decoder.
        let shared = shared_initializers(&mut decoder, apart)?;
        let (first, with_past) = match graphs.first_decoder {
            Some(first) => (
                GraphTemplate::new(first, &none)?,
                GraphTemplate::new(decoder, &shared)?,
            ),
            None => {
                if !sig.has_use_cache_branch {
                    return Err(Error::Model(
                        "the encoder-decoder needs decoder_model_merged.onnx (with \
                         `use_cache_branch`) or both decoder_model.onnx and \
                         decoder_with_past_model.onnx"
                            .into(),
                    ));
                }
                let mut no_cache = decoder.clone();
                specialize_bool_input(&mut no_cache, "use_cache_branch", false)?;
                let mut cache = decoder;
                specialize_bool_input(&mut cache, "use_cache_branch", true)?;
                (
                    GraphTemplate::new(no_cache, &shared)?,
                    GraphTemplate::new(cache, &shared)?,
                )
            }
        };
        let s = Seq2Seq {
            signature: sig,
            encoder,
            encoder_features,
            first,
            with_past,
            plans: Mutex::new(HashMap::new()),
            encoder_plans: Mutex::new(HashMap::new()),
            head: OnceLock::new(),
            streams: streams::Choice::default(),
            vocab,
        };
        // Compile the plans of one row now: a graph tract cannot run fails at load time.
        let encoder = s.encoder_plan(1)?;
        let first = s.plan(1, true)?;
        s.plan(1, false)?;
        check_decoder_fits(&encoder, &first)?;
        Ok(s)
    }

    /// The shape of one row of the encoder's `input_features` (`[mel bins, frames]` for
    /// Whisper), when the encoder takes features of a fixed shape.
    pub fn feature_shape(&self) -> Result<Option<Vec<usize>>> {
        if !self.encoder_features {
            return Ok(None);
        }
        let plan = self.encoder_plan(1)?;
        let fact = plan.runnable.model().input_fact(0).map_err(backend)?;
        Ok(fact.shape.as_concrete().map(|s| s[1..].to_vec()))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Whether the encoder takes features (Whisper) rather than token ids.
    pub fn takes_features(&self) -> bool {
        self.encoder_features
    }

    pub fn plans(&self) -> usize {
        self.plans.lock().map(|p| p.len()).unwrap_or(0)
            + self.encoder_plans.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Run the encoder and return a decoder state for `rows` rows (row `r` uses encoder row
    /// `rows_of[r]`, so the beams of a prompt share its encoder output).
    pub fn start(
        self: &Arc<Self>,
        input: &EncoderInput,
        rows_of: &[usize],
    ) -> Result<Box<dyn DecoderState>> {
        let batch = input.rows();
        let encoded = match input {
            EncoderInput::Encoded(e) => e.clone(),
            other => self.encode(other)?,
        };
        if let Some(&bad) = rows_of.iter().find(|&&r| r >= batch) {
            return Err(Error::InvalidInput(format!(
                "row of encoder input {bad} of {batch}"
            )));
        }
        let hidden = gather_rows(&encoded.hidden, rows_of)?;
        let mask = gather_rows(&encoded.mask, rows_of)?;
        let layers = self.signature.layers.len();
        Ok(Box::new(Seq2SeqState {
            model: self.clone(),
            prompt_of: rows_of.to_vec(),
            hidden: Arc::new(hidden),
            mask: Arc::new(mask),
            cache: vec![None; layers],
            cross: vec![None; layers],
            lengths: vec![0; rows_of.len()],
            scratch: vec![],
            session: Session::default(),
            bounded: false,
        }))
    }

    /// Run the encoder on an input.
    pub fn encode(&self, input: &EncoderInput) -> Result<Encoded> {
        let batch = input.rows();
        if batch == 0 {
            return Err(Error::InvalidInput("no encoder input was given".into()));
        }
        if let EncoderInput::Encoded(e) = input {
            return Ok(e.clone());
        }
        let plan = self.encoder_plan(batch)?;
        let (hidden, mask) = match input {
            EncoderInput::Ids(prompts) => {
                if self.encoder_features {
                    return Err(Error::InvalidInput(
                        "this model's encoder takes audio features, not token ids".into(),
                    ));
                }
                let len = prompts.iter().map(Vec::len).max().unwrap_or(0);
                if len == 0 {
                    return Err(Error::InvalidInput("the encoder input is empty".into()));
                }
                let mut ids = vec![0i64; batch * len];
                let mut mask = vec![0i64; batch * len];
                for (r, p) in prompts.iter().enumerate() {
                    for (j, &t) in p.iter().enumerate() {
                        ids[r * len + j] = t as i64;
                        mask[r * len + j] = 1;
                    }
                }
                let fact = |ix: usize| {
                    plan.runnable
                        .model()
                        .input_fact(ix)
                        .map(|f| f.datum_type)
                        .map_err(backend)
                };
                let mut inputs: TVec<TValue> = tvec![];
                for ix in 0..plan.runnable.model().inputs.len() {
                    let values = if Some(ix) == plan.mask { &mask } else { &ids };
                    inputs.push(int_tensor(values, &[batch, len], fact(ix)?)?.into());
                }
                let out =
                    parallel::team(Step::Other, || plan.runnable.run(inputs)).map_err(backend)?;
                let mask = Tensor::from_shape(&[batch, len], &mask).map_err(backend)?;
                (out[plan.output].clone().into_tensor(), mask)
            }
            EncoderInput::Features { shape, rows } => {
                if !self.encoder_features {
                    return Err(Error::InvalidInput(
                        "this model's encoder takes token ids, not audio features".into(),
                    ));
                }
                let per_row: usize = shape.iter().product();
                if let Some(r) = rows.iter().position(|row| row.len() != per_row) {
                    return Err(Error::InvalidInput(format!(
                        "encoder features of row {r} have {} values; expected {per_row} ({shape:?})",
                        rows[r].len()
                    )));
                }
                let mut full = vec![batch];
                full.extend_from_slice(shape);
                let data: Vec<f32> = rows.iter().flatten().copied().collect();
                let t = Tensor::from_shape(&full, &data).map_err(backend)?;
                let out = parallel::team(Step::Other, || plan.runnable.run(tvec![t.into()]))
                    .map_err(backend)?;
                let hidden = out[plan.output].clone().into_tensor();
                let frames = hidden.shape().get(1).copied().unwrap_or(0);
                let mask = Tensor::from_shape(&[batch, frames], &vec![1i64; batch * frames])
                    .map_err(backend)?;
                (hidden, mask)
            }
            EncoderInput::Encoded(e) => return Ok(e.clone()),
        };
        Ok(Encoded {
            hidden: Arc::new(hidden),
            mask: Arc::new(mask),
            from_features: self.encoder_features,
        })
    }

    fn encoder_plan(&self, batch: usize) -> Result<Arc<EncoderPlan>> {
        let mut plans = self
            .encoder_plans
            .lock()
            .map_err(|_| Error::Backend("plan cache poisoned".into()))?;
        if let Some(p) = plans.get(&batch) {
            return Ok(p.clone());
        }
        let mut model = self.encoder.parse()?;
        let len = TDim::from(model.symbols.sym("encoder_sequence"));
        let inputs = model.input_outlets().map_err(backend)?.to_vec();
        let mut mask = None;
        let mut input = None;
        for (ix, outlet) in inputs.iter().enumerate() {
            let name = model.node(outlet.node).name.clone();
            let fact = match name.as_str() {
                "input_ids" => {
                    input = Some(ix);
                    InferenceFact::dt_shape(i64::datum_type(), [TDim::from(batch), len.clone()])
                }
                "attention_mask" => {
                    mask = Some(ix);
                    InferenceFact::dt_shape(i64::datum_type(), [TDim::from(batch), len.clone()])
                }
                "input_features" => {
                    input = Some(ix);
                    let mut fact = model.input_fact(ix).map_err(backend)?.clone();
                    fact.shape.set_dim(0, TDim::from(batch));
                    fact
                }
                other => {
                    return Err(Error::Unsupported(format!(
                        "the encoder input `{other}` (the engine binds input_ids, attention_mask \
                         and input_features)"
                    )))
                }
            };
            model.set_input_fact(ix, fact).map_err(backend)?;
        }
        if input.is_none() {
            return Err(Error::Model(
                "the encoder has no input_ids or input_features".into(),
            ));
        }
        let output = output_names(&model)?
            .iter()
            .position(|n| n == "last_hidden_state" || n == "encoder_hidden_states")
            .unwrap_or(0);
        let runnable = runnable(model)
            .map_err(|e| Error::Model(format!("tract cannot compile the encoder: {e:?}")))?;
        let plan = Arc::new(EncoderPlan {
            runnable,
            mask,
            output,
        });
        plans.insert(batch, plan.clone());
        Ok(plan)
    }

    /// The decoder plan for `batch` rows: the first step's (no past) or the later steps'.
    fn plan(&self, batch: usize, first: bool) -> Result<Arc<Plan>> {
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("plan cache poisoned".into()))?;
        if let Some(p) = plans.get(&(batch, first as u8)) {
            return Ok(p.clone());
        }
        let template = if first { &self.first } else { &self.with_past };
        let head_of = |op, weight, dt| shared_head(&self.head, op, weight, dt);
        let plan = Arc::new(compile(template.parse()?, &self.signature, batch, head_of)?);
        plans.insert((batch, first as u8), plan.clone());
        Ok(plan)
    }
}

/// The decoder reads the encoder's output as `encoder_hidden_states`: their widths (the hidden
/// size) must agree, else the decoder belongs to another model.
fn check_decoder_fits(encoder: &EncoderPlan, first: &Plan) -> Result<()> {
    let Some(ix) = first.roles.iter().position(|r| *r == Role::EncoderHidden) else {
        return Err(Error::Model(
            "the decoder does not take `encoder_hidden_states`".into(),
        ));
    };
    let width = |fact: &TypedFact| fact.shape.iter().last().and_then(|d| d.to_i64().ok());
    let gives = width(
        encoder
            .runnable
            .model()
            .output_fact(encoder.output)
            .map_err(backend)?,
    );
    let takes = width(first.runnable.model().input_fact(ix).map_err(backend)?);
    match (gives, takes) {
        (Some(g), Some(t)) if g != t => Err(Error::Model(format!(
            "the decoder does not fit the encoder: the encoder's hidden states are {g} wide but \
             the decoder's `encoder_hidden_states` (cross-attention input) are {t} wide; \
             encoder_model.onnx and the decoder come from different models"
        ))),
        _ => Ok(()),
    }
}

/// `past_key_values.3.decoder.key` -> `past_key_values.3.encoder.key`.
fn cross_name(self_name: &str) -> String {
    self_name.replace(".decoder.", ".encoder.")
}

fn compile(
    mut model: InferenceModel,
    sig: &Signature,
    batch: usize,
    head_of: impl FnOnce(Weights, Arc<Tensor>, DatumType) -> Option<Arc<LmHead>>,
) -> Result<Plan> {
    let b = TDim::from(batch);
    let s = TDim::from(model.symbols.sym("sequence"));
    let p = TDim::from(model.symbols.sym("past"));
    let e = TDim::from(model.symbols.sym("encoder_sequence"));
    let kv_dt = match sig.kv_dtype {
        Dtype::F32 => f32::datum_type(),
        Dtype::F16 => f16::datum_type(),
    };
    let heads = TDim::from(sig.kv_heads);
    let dim = TDim::from(sig.head_dim);
    let mut roles = vec![];
    let inputs = model.input_outlets().map_err(backend)?.to_vec();
    for (ix, outlet) in inputs.iter().enumerate() {
        let name = model.node(outlet.node).name.clone();
        let layer = |f: &dyn Fn(&crate::model::signature::LayerNames) -> String| {
            sig.layers.iter().position(|l| f(l) == name)
        };
        let cache = |len: &TDim| {
            InferenceFact::dt_shape(kv_dt, [b.clone(), heads.clone(), len.clone(), dim.clone()])
        };
        let (role, fact) = if name == "input_ids" {
            let dt = if sig.ids_type == ONNX_INT32 {
                i32::datum_type()
            } else {
                i64::datum_type()
            };
            (
                Role::Ids,
                InferenceFact::dt_shape(dt, [b.clone(), s.clone()]),
            )
        } else if name == "encoder_attention_mask" {
            (
                Role::EncoderMask,
                InferenceFact::dt_shape(i64::datum_type(), [b.clone(), e.clone()]),
            )
        } else if name == "encoder_hidden_states" {
            let mut fact = model.input_fact(ix).map_err(backend)?.clone();
            fact.shape.set_dim(0, b.clone());
            fact.shape.set_dim(1, e.clone());
            (Role::EncoderHidden, fact)
        } else if let Some(l) = layer(&|l| l.past_key.clone()) {
            (Role::PastKey(l), cache(&p))
        } else if let Some(l) = layer(&|l| l.past_value.clone()) {
            (Role::PastValue(l), cache(&p))
        } else if let Some(l) = layer(&|l| cross_name(&l.past_key)) {
            (Role::CrossKey(l), cache(&e))
        } else if let Some(l) = layer(&|l| cross_name(&l.past_value)) {
            (Role::CrossValue(l), cache(&e))
        } else {
            return Err(Error::Unsupported(format!(
                "the decoder input `{name}` (the engine binds input_ids, encoder_attention_mask, \
                 encoder_hidden_states and past_key_values.N.decoder|encoder.key|value)"
            )));
        };
        model.set_input_fact(ix, fact).map_err(backend)?;
        roles.push(role);
    }
    let names = output_names(&model)?;
    let out = |n: &str| names.iter().position(|x| x == n);
    let need = |n: &str| {
        out(n).ok_or_else(|| Error::Model(format!("the decoder has no output `{n}` ({names:?})")))
    };
    let logits = need(&sig.logits_name)?;
    let presents = sig
        .layers
        .iter()
        .map(|l| Ok((need(&l.present_key)?, need(&l.present_value)?)))
        .collect::<Result<Vec<_>>>()?;
    let cross = sig
        .layers
        .iter()
        .filter_map(|l| {
            Some((
                out(&cross_name(&l.present_key))?,
                out(&cross_name(&l.present_value))?,
            ))
        })
        .collect::<Vec<_>>();
    let (runnable, head) = runnable_without_head(model, logits, head_of)
        .map_err(|e| Error::Model(format!("tract cannot compile the decoder: {e:?}")))?;
    Ok(Plan {
        runnable,
        roles,
        logits,
        presents,
        cross,
        head,
    })
}

/// One request: the encoder output, the cross-attention cache (written by the first step,
/// then only read), and the self-attention cache of exact length.
struct Seq2SeqState {
    model: Arc<Seq2Seq>,
    /// The encoder row (prompt) of each row.
    prompt_of: Vec<usize>,
    hidden: Arc<Tensor>,
    mask: Arc<Tensor>,
    cache: Vec<Option<(Arc<Tensor>, Arc<Tensor>)>>,
    cross: Vec<Option<(Arc<Tensor>, Arc<Tensor>)>>,
    lengths: Vec<usize>,
    /// Rows in transit during an in-place reorder, kept between steps.
    scratch: Vec<u8>,
    /// tract's state of the last step's plan.
    session: Session,
    /// Greedy decoding, or sampling with `top_k`: a decoding step of one row may return upper
    /// bounds of its logits (`DecoderState::bound_logits`).
    bounded: bool,
}

impl DecoderState for Seq2SeqState {
    fn step(&mut self, tokens: &[&[u32]]) -> Result<Logits> {
        let rows = self.lengths.len();
        if tokens.len() != rows {
            return Err(Error::Backend(format!(
                "a step got tokens for {} rows; the cache has {rows}",
                tokens.len()
            )));
        }
        let seq = tokens.first().map(|t| t.len()).unwrap_or(0);
        let len = self.lengths.first().copied().unwrap_or(0);
        if seq == 0
            || tokens.iter().any(|t| t.len() != seq)
            || self.lengths.iter().any(|&l| l != len)
        {
            return Err(Error::Backend(
                "encoder-decoder steps run rows of equal lengths with equal numbers of new tokens"
                    .into(),
            ));
        }
        let first = len == 0;
        let plan = self.model.plan(rows, first)?;
        let ids: Vec<i64> = tokens
            .iter()
            .flat_map(|t| t.iter().map(|&x| x as i64))
            .collect();
        let sig = &self.model.signature;
        let empty = |len: usize| {
            crate::cache::zeros(sig.kv_dtype, &[rows, sig.kv_heads, len, sig.head_dim])
                .map(Arc::new)
        };
        let encoder_len = self.mask.shape().get(1).copied().unwrap_or(0);
        // The first step's cross-attention inputs (the graph computes them instead): one tensor
        // of zeros for all of them, not one per layer (Whisper base: 12 of 2.9 MB).
        let mut no_cross: Option<Arc<Tensor>> = None;
        let mut inputs: TVec<TValue> = tvec![];
        for (ix, role) in plan.roles.iter().enumerate() {
            let dt = plan
                .runnable
                .model()
                .input_fact(ix)
                .map_err(backend)?
                .datum_type;
            let v = match *role {
                Role::Ids => int_tensor(&ids, &[rows, seq], dt)?.into(),
                Role::EncoderMask => {
                    if dt == i64::datum_type() {
                        TValue::from_const(self.mask.clone())
                    } else {
                        self.mask
                            .cast_to_dt(dt)
                            .map_err(backend)?
                            .into_owned()
                            .into()
                    }
                }
                Role::EncoderHidden => TValue::from_const(self.hidden.clone()),
                Role::PastKey(l) | Role::PastValue(l) => {
                    let key = matches!(role, Role::PastKey(_));
                    match &self.cache[l] {
                        Some((k, v)) => TValue::from_const(if key { k.clone() } else { v.clone() }),
                        None => TValue::from_const(empty(0)?),
                    }
                }
                Role::CrossKey(l) | Role::CrossValue(l) => {
                    let key = matches!(role, Role::CrossKey(_));
                    match &self.cross[l] {
                        Some((k, v)) => TValue::from_const(if key { k.clone() } else { v.clone() }),
                        None => {
                            let zeros = match &no_cross {
                                Some(z) => z.clone(),
                                None => no_cross.insert(empty(encoder_len)?).clone(),
                            };
                            TValue::from_const(zeros)
                        }
                    }
                }
            };
            inputs.push(v);
        }
        let kind = if seq == 1 {
            Step::Decoding
        } else {
            Step::Other
        };
        let step = || parallel::team(kind, || self.session.run(&plan.runnable, inputs));
        let outputs = if kind == Step::Decoding && rows == 1 {
            self.model.streams.decoding_step(step)
        } else {
            step()
        }
        .map_err(backend)?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            self.cache[l] = Some((
                outputs[k].clone().into_arc_tensor(),
                outputs[v].clone().into_arc_tensor(),
            ));
        }
        if first {
            if plan.cross.len() != sig.layers.len() {
                return Err(Error::Model(
                    "the first decoder step does not return the cross-attention cache \
                     (present.N.encoder.key|value)"
                        .into(),
                ));
            }
            for (l, &(k, v)) in plan.cross.iter().enumerate() {
                self.cross[l] = Some((
                    outputs[k].clone().into_arc_tensor(),
                    outputs[v].clone().into_arc_tensor(),
                ));
            }
        }
        for l in self.lengths.iter_mut() {
            *l += seq;
        }
        let counts = vec![seq; rows];
        let out = &outputs[plan.logits];
        head_logits(
            plan.head.as_ref(),
            self.bounded,
            out,
            &counts,
            self.model.vocab,
        )
    }

    fn reorder(&mut self, parents: &[usize]) -> Result<()> {
        let rows = self.lengths.len();
        if let Some(&bad) = parents.iter().find(|&&p| p >= rows) {
            return Err(Error::InvalidInput(format!(
                "reorder: parent row {bad} of {rows} rows"
            )));
        }
        let gather = |t: &Arc<Tensor>| gather_rows(t, parents).map(Arc::new);
        // The self-attention cache: rows copied inside the buffers when the row count holds.
        for entry in self.cache.iter_mut().flatten() {
            crate::cache::reorder_tensor(&mut entry.0, parents, &mut self.scratch)?;
            crate::cache::reorder_tensor(&mut entry.1, parents, &mut self.scratch)?;
        }
        // The cross-attention cache and the encoder output are the same for all beams of a
        // prompt: they move only when a row takes a parent of another prompt, or rows are
        // added or dropped.
        let within_prompts = parents.len() == rows
            && parents
                .iter()
                .enumerate()
                .all(|(r, &p)| self.prompt_of[p] == self.prompt_of[r]);
        if !within_prompts {
            for entry in self.cross.iter_mut().flatten() {
                *entry = (gather(&entry.0)?, gather(&entry.1)?);
            }
            self.hidden = gather(&self.hidden)?;
            self.mask = gather(&self.mask)?;
            self.prompt_of = parents.iter().map(|&p| self.prompt_of[p]).collect();
        }
        self.lengths = parents.iter().map(|&p| self.lengths[p]).collect();
        Ok(())
    }

    fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    fn is_ready_for(&self, rows: usize) -> bool {
        self.model
            .plans
            .lock()
            .map(|p| p.contains_key(&(rows, 0)))
            .unwrap_or(false)
    }

    fn bound_logits(&mut self, on: bool) {
        self.bounded = on;
    }

    fn rows_may_differ(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tract_decoder::check_head_outside;
    use crate::model::{Engine, Model, ModelFiles};

    /// The `lm_head` computed outside the decoder plans (`Plan::head`) gives the plans' own
    /// logits bit for bit: T5's and Whisper's fixtures against plans compiled with their
    /// `lm_head` inside, a first step of three tokens and decoding steps, one row and two. In
    /// greedy decoding (`bounded`) a decoding step of one row gives upper bounds of those
    /// logits, which become them exactly.
    #[test]
    fn lm_head_outside_the_plans_gives_their_logits() {
        let mel: Vec<f32> = (0..80 * 3000)
            .map(|i| (i % 89) as f32 / 89.0 - 0.5)
            .collect();
        let cases = [
            (
                "t5",
                EncoderInput::Ids(vec![vec![5, 9, 13, 1], vec![7, 3, 21, 1]]),
            ),
            (
                "whisper-tiny",
                EncoderInput::Features {
                    shape: vec![80, 3000],
                    rows: vec![mel.clone(), mel.iter().map(|x| -x).collect()],
                },
            ),
        ];
        for (name, input) in cases {
            let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/models")
                .join(name);
            let model = Model::load(&ModelFiles::from_dir(&dir, None).unwrap()).unwrap();
            let Engine::Seq2Seq(cut) = &model.engine else {
                panic!("{name} is not an encoder-decoder");
            };
            assert!(cut.plan(1, false).unwrap().head.is_some(), "{name}");
            let mut plans = HashMap::new();
            for rows in [1, 2] {
                for first in [true, false] {
                    let template = if first { &cut.first } else { &cut.with_past };
                    let whole = compile(
                        template.parse().unwrap(),
                        &cut.signature,
                        rows,
                        |_, _, _| None,
                    );
                    plans.insert((rows, first as u8), Arc::new(whole.unwrap()));
                }
            }
            let whole = Arc::new(Seq2Seq {
                signature: cut.signature.clone(),
                encoder: cut.encoder.clone(),
                encoder_features: cut.encoder_features,
                first: cut.first.clone(),
                with_past: cut.with_past.clone(),
                plans: Mutex::new(plans),
                encoder_plans: Mutex::new(HashMap::new()),
                head: OnceLock::new(),
                vocab: cut.vocab,
                streams: Default::default(),
            });
            assert!(whole.plan(1, false).unwrap().head.is_none());
            let vocab = cut.vocab;
            for rows in [1, 2] {
                let rows_of: Vec<usize> = (0..rows).collect();
                let steps: Vec<Vec<Vec<u32>>> = vec![
                    vec![vec![0, 5, 9], vec![0, 4, 8]][..rows].to_vec(),
                    vec![vec![7], vec![6]][..rows].to_vec(),
                    vec![vec![3], vec![11]][..rows].to_vec(),
                ];
                let whole = whole.start(&input, &rows_of).unwrap();
                let (a, b) = (cut.start(&input, &rows_of), cut.start(&input, &rows_of));
                check_head_outside(name, vocab, &steps, whole, a.unwrap(), b.unwrap());
            }
        }
    }
}
