//! The CPU backend: a decoder graph compiled once by tract with symbolic batch, sequence and
//! past lengths, so every step of every request runs the same plan (no recompilation).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tract_onnx::pb;
use tract_onnx::prelude::*;

use crate::cache::KvCache;
use crate::decoder::{Decoder, DecoderState, Logits};
use crate::error::{backend, Error, Result};
use crate::model::onnx::specialize_bool_input;
use crate::model::signature::{CacheMode, Dtype, Signature, ONNX_INT32};

/// What the engine binds to each input of the plan, in the plan's order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Ids,
    Mask,
    Positions,
    PastKey(usize),
    PastValue(usize),
}

/// One compiled graph and the positions of what we bind and read.
#[derive(Debug)]
struct Plan {
    runnable: Arc<TypedRunnableModel>,
    roles: Vec<Role>,
    logits: usize,
    /// Output index of each layer's `(present key, present value)`.
    presents: Vec<(usize, usize)>,
}

/// A decoder-only graph compiled by tract.
#[derive(Debug, Clone)]
pub struct TractDecoder(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    sig: Arc<Signature>,
    /// The analysed graph of every step (a merged decoder's cache branch), with symbolic
    /// sequence and past lengths; its weights are shared with the plans compiled from it.
    template: InferenceModel,
    /// A merged decoder in `grow` mode: the no-cache branch, for the first step (past of 0).
    first_template: Option<InferenceModel>,
    /// Compiled plans by `(batch size, first step)`. The batch size is fixed in a plan
    /// because these graphs multiply it with the (symbolic) mask length, which tract cannot
    /// keep symbolic; sequence and past lengths stay symbolic.
    plans: Mutex<HashMap<(usize, bool), Arc<Plan>>>,
    vocab: usize,
}

impl TractDecoder {
    pub fn new(proto: &pb::ModelProto, sig: Arc<Signature>, vocab: usize) -> Result<Self> {
        if !sig.takes_ids {
            return Err(Error::Unsupported(
                "decoders that take `inputs_embeds` need an embeddings model".into(),
            ));
        }
        if sig.has_encoder_hidden_states {
            return Err(Error::Unsupported(
                "this graph is the decoder of an encoder-decoder model (it takes \
                 `encoder_hidden_states`); load the model folder with its encoder"
                    .into(),
            ));
        }
        let (template, first_template) = if sig.has_use_cache_branch {
            let mut with_cache = proto.clone();
            specialize_bool_input(&mut with_cache, "use_cache_branch", true)?;
            let template = parse_graph(&with_cache, &sig)?;
            let first = if sig.cache_mode == CacheMode::Grow {
                let mut no_cache = proto.clone();
                specialize_bool_input(&mut no_cache, "use_cache_branch", false)?;
                Some(parse_graph(&no_cache, &sig)?)
            } else {
                None
            };
            (template, first)
        } else {
            (parse_graph(proto, &sig)?, None)
        };
        let decoder = TractDecoder(Arc::new(Inner {
            sig,
            template,
            first_template,
            plans: Mutex::new(HashMap::new()),
            vocab,
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
        let plan = Arc::new(compile(template.clone(), &self.sig, batch)?);
        plans.insert((batch, first), plan.clone());
        Ok(plan)
    }
}

/// Read the graph into tract and declare its inputs (symbolic sequence and past lengths).
pub(crate) fn parse_graph(proto: &pb::ModelProto, sig: &Signature) -> Result<InferenceModel> {
    let onnx = super::ops::onnx()
        .with_ignore_output_shapes(true)
        .with_ignore_value_info(true);
    onnx.model_for_proto_model(proto).map_err(|e| {
        Error::Model(format!(
            "tract cannot read the graph: {}",
            unsupported_hint(&e, sig)
        ))
    })
}

fn compile(mut model: InferenceModel, sig: &Signature, batch: usize) -> Result<Plan> {
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
            if sig.position_axes != 2 {
                return Err(Error::Unsupported(format!(
                    "`position_ids` with {} axes (M-RoPE decoders need the vision-language path)",
                    sig.position_axes
                )));
            }
            (
                Role::Positions,
                InferenceFact::dt_shape(i64::datum_type(), [b.clone(), s.clone()]),
            )
        } else if let Some(l) = sig.layers.iter().position(|l| l.past_key == name) {
            let shape = [b.clone(), heads.clone(), p.clone(), dim.clone()];
            (Role::PastKey(l), InferenceFact::dt_shape(kv_dt, shape))
        } else if let Some(l) = sig.layers.iter().position(|l| l.past_value == name) {
            let shape = [b.clone(), heads.clone(), p.clone(), dim.clone()];
            (Role::PastValue(l), InferenceFact::dt_shape(kv_dt, shape))
        } else {
            return Err(Error::Unsupported(format!(
                "the decoder input `{name}` (the engine binds input_ids, attention_mask, \
                 position_ids, past_key_values.N.key|value and use_cache_branch)"
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
    let typed = optimize(model).map_err(|e| {
        Error::Model(format!(
            "tract cannot compile the graph: {}",
            unsupported_hint(&e, sig)
        ))
    })?;
    let runnable = typed.into_runnable().map_err(backend)?;
    Ok(Plan {
        runnable,
        roles,
        logits,
        presents,
    })
}

/// tract's declutter and codegen passes, without `FoldUniformMask`.
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
    let mut typed = model.into_typed()?;
    declutter_passes().optimize(&mut typed)?;
    typed.optimize()?;
    Ok(typed)
}

fn declutter_passes() -> tract_onnx::tract_core::optim::Optimizer {
    let mut optimizer = tract_onnx::tract_core::optim::Optimizer::declutter();
    optimizer
        .passes
        .retain(|pass| !format!("{pass:?}").starts_with("FoldUniformMask"));
    optimizer
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
fn unsupported_hint(e: &TractError, sig: &Signature) -> String {
    let custom: Vec<String> = sig
        .ops
        .iter()
        .filter(|(domain, _)| !domain.is_empty() && domain != "ai.onnx")
        .map(|(d, op)| format!("{d}.{op}"))
        .collect();
    if custom.is_empty() {
        format!("{e:?}")
    } else {
        format!(
            "{e:?} (the graph uses non-standard ops: {})",
            custom.join(", ")
        )
    }
}

impl Decoder for TractDecoder {
    fn vocab_size(&self) -> usize {
        self.0.vocab
    }

    fn start(&self, rows: usize, capacity: usize) -> Result<Box<dyn DecoderState>> {
        let sig = &self.0.sig;
        let capacity = match sig.cache_mode {
            CacheMode::Grow => 0,
            _ => capacity.max(1),
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
        }))
    }
}

/// One request's cache, and the decoder whose plans it runs.
struct TractState {
    decoder: Arc<Inner>,
    cache: KvCache,
    /// A failed in_place step lost the buffers it had handed to the graph.
    broken: bool,
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
            return Ok(Logits {
                rows,
                vocab,
                data: vec![0.0; rows * vocab],
            });
        }
        match self.decoder.sig.cache_mode {
            CacheMode::Grow => self.step_grow(tokens, seq),
            CacheMode::InPlace => self.step_in_place(tokens, &counts, seq),
            CacheMode::Append => self.step_append(tokens, &counts, seq),
        }
    }

    fn reorder(&mut self, parents: &[usize]) -> Result<()> {
        self.cache.reorder(parents)
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
        let mut positions = vec![0i64; rows * seq];
        for r in 0..rows {
            let len = self.cache.lengths[r];
            for (j, &t) in tokens[r].iter().enumerate() {
                ids[r * seq + j] = t as i64;
            }
            for j in 0..seq {
                positions[r * seq + j] = (len + j) as i64;
            }
            let m = &mut mask[r * (cap + seq)..(r + 1) * (cap + seq)];
            m[..len].fill(1);
            // Every new position is visible: padding positions (beyond the row's tokens) are
            // hidden from the real ones by causality, and seeing themselves keeps their rows of
            // the attention finite.
            m[cap..].fill(1);
        }
        let plan = self.decoder.plan(rows, false)?;
        let outputs = self.run(&plan, rows, seq, ids, mask, positions)?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            self.cache
                .append(l, &outputs[k], &outputs[v], cap, counts)?;
        }
        self.cache.advance(counts);
        last_logits(&outputs[plan.logits], counts, self.decoder.vocab)
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
        let outputs = self.run(&plan, rows, seq, ids, mask, vec![])?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            let key = outputs[k].clone().into_arc_tensor();
            let value = outputs[v].clone().into_arc_tensor();
            self.cache.layers[l] = (key, value);
        }
        self.broken = false;
        self.cache.advance(counts);
        last_logits(&outputs[plan.logits], counts, self.decoder.vocab)
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
        let outputs = self.run(&plan, rows, seq, ids, mask, vec![])?;
        for (l, &(k, v)) in plan.presents.iter().enumerate() {
            let key = outputs[k].clone().into_arc_tensor();
            let value = outputs[v].clone().into_arc_tensor();
            self.cache.layers[l] = (key, value);
        }
        self.cache.advance(&vec![seq; rows]);
        last_logits(&outputs[plan.logits], &vec![seq; rows], self.decoder.vocab)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        plan: &Plan,
        rows: usize,
        seq: usize,
        ids: Vec<i64>,
        mask: Vec<i64>,
        positions: Vec<i64>,
    ) -> Result<TVec<TValue>> {
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
                Role::Mask => int_tensor(&mask, &[rows, mask.len() / rows.max(1)], fact_dt)?.into(),
                Role::Positions => int_tensor(&positions, &[rows, seq], fact_dt)?.into(),
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
        plan.runnable.run(inputs).map_err(backend)
    }
}

pub(crate) fn int_tensor(values: &[i64], shape: &[usize], dt: DatumType) -> Result<Tensor> {
    let t = Tensor::from_shape(shape, values).map_err(backend)?;
    if dt == i64::datum_type() {
        Ok(t)
    } else {
        t.cast_to_dt(dt).map(|c| c.into_owned()).map_err(backend)
    }
}

/// The logits of position `counts[r] - 1` of each row of `[rows, seq, vocab]`.
pub(crate) fn last_logits(logits: &Tensor, counts: &[usize], vocab: usize) -> Result<Logits> {
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
    let logits = logits.cast_to::<f32>().map_err(backend)?;
    let all = logits
        .try_as_plain_ram()
        .map_err(backend)?
        .as_slice::<f32>()
        .map_err(backend)?;
    let mut data = vec![0.0f32; rows * vocab];
    for r in 0..rows {
        if counts[r] == 0 {
            continue;
        }
        let at = (r * seq + counts[r] - 1) * vocab;
        data[r * vocab..(r + 1) * vocab].copy_from_slice(&all[at..at + vocab]);
    }
    Ok(Logits { rows, vocab, data })
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
        let decoder = TractDecoder::new(&proto, sig.clone(), 512).unwrap();
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
        }
    }

    /// The pass left out by `optimize` is still in tract's declutter list (else the filter
    /// silently does nothing and a newer tract may have renamed it).
    #[test]
    fn fold_uniform_mask_is_left_out() {
        let name = |o: &tract_onnx::tract_core::optim::Optimizer| {
            o.passes
                .iter()
                .filter(|p| format!("{p:?}").starts_with("FoldUniformMask"))
                .count()
        };
        assert_eq!(
            name(&tract_onnx::tract_core::optim::Optimizer::declutter()),
            1
        );
        assert_eq!(name(&declutter_passes()), 0);
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
