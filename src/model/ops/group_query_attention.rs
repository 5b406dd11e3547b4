//! `com.microsoft.GroupQueryAttention` (CPU semantics of onnxruntime 1.2x), for graphs whose
//! past and present caches share one buffer (`past_present_share_buffer`).
//!
//! Inputs: `query` `[B, S, (N + 2 * KV) * H]` packed, or `query` `[B, S, N * H]` with `key`
//! and `value` `[B, S, KV * H]`; `past_key` / `past_value` `[B, KV, L, H]`, the shared buffer
//! (`L` at least `total_sequence_length`); `seqlens_k` `[B]` (each row's valid length, new
//! tokens included, minus one); `total_sequence_length` (a scalar); `cos_cache` / `sin_cache`
//! `[max_position, R / 2]` when `do_rotary`; optional `position_ids` `[B, S]`.
//!
//! Row `b` has `seqlens_k[b] + 1 - S` past positions (0 on the first prompt, when `S` is the
//! total length); its `S` new keys and values are written at that offset *inside the past
//! buffer*, which becomes `present_key` / `present_value`: when the caller hands the buffer over
//! (it holds no other reference), nothing is copied. Query `s` of row `b` attends to keys
//! `0..=past + s` (causal), the last `local_window_size` of them when `local_window_size`
//! is set (the query's own key included), with scores `scale * q.k` (then `softcap * tanh(x / softcap)` when `softcap > 0`).
//! Query head `n` reads KV head `n / (N / KV)`.
//!
//! Not supported (a load-time error naming the node): `attention_bias`, `head_sink`, quantized
//! caches (`k_scale` / `v_scale`), `smooth_softmax`, `qk_output`, a missing past, float16.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;

use super::{has_output, input_slot, node_label};

/// The attributes and wiring of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Gqa {
    pub num_heads: usize,
    pub kv_num_heads: usize,
    /// 0: `1 / sqrt(head_size)`.
    pub scale: f32,
    pub softcap: f32,
    /// -1: no window.
    pub local_window_size: i64,
    pub do_rotary: bool,
    pub rotary_interleaved: bool,
    /// Slots (among the wired inputs) of the optional inputs.
    pub key: Option<usize>,
    pub value: Option<usize>,
    pub past_key: usize,
    pub past_value: usize,
    pub seqlens_k: usize,
    pub total_sequence_length: usize,
    pub cos_cache: Option<usize>,
    pub sin_cache: Option<usize>,
    pub position_ids: Option<usize>,
    pub inputs: usize,
    pub label: String,
}

impl Eq for Gqa {}

pub fn group_query_attention(
    _ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    Ok((expand(parse(node)?), vec![]))
}

/// Read and check a node's attributes and inputs.
pub fn parse(node: &NodeProto) -> TractResult<Gqa> {
    let label = node_label(node);
    let num_heads: i64 = node.get_attr("num_heads")?;
    let kv_num_heads: i64 = node.get_attr("kv_num_heads")?;
    if num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0 {
        bail!("{label}: num_heads {num_heads} must be a positive multiple of kv_num_heads {kv_num_heads}");
    }
    let attr_i = |n: &str, d: i64| -> TractResult<i64> { Ok(node.get_attr_opt(n)?.unwrap_or(d)) };
    for (name, default) in [("smooth_softmax", 0), ("qk_output", 0)] {
        if attr_i(name, default)? != default {
            bail!("{label}: the attribute {name} is not supported (only {name}={default})");
        }
    }
    if let Some(q) = node.get_attr_opt::<String>("k_quant_type")? {
        if q != "NONE" {
            bail!("{label}: quantized KV caches (k_quant_type={q}) are not supported");
        }
    }
    for (ix, what) in [
        (10, "attention_bias"),
        (11, "head_sink"),
        (12, "k_scale"),
        (13, "v_scale"),
    ] {
        if input_slot(node, ix).is_some() {
            bail!("{label}: the input {what} is not supported");
        }
    }
    let key = input_slot(node, 1);
    let value = input_slot(node, 2);
    if key.is_some() != value.is_some() {
        bail!("{label}: key and value must both be given or both be packed into query");
    }
    let need = |ix: usize, what: &str| {
        input_slot(node, ix).ok_or_else(|| {
            format_err!("{label}: the input {what} is required (this engine shares the past and present buffers)")
        })
    };
    let do_rotary = attr_i("do_rotary", 0)? != 0;
    let (cos_cache, sin_cache) = (input_slot(node, 7), input_slot(node, 8));
    if do_rotary && (cos_cache.is_none() || sin_cache.is_none()) {
        bail!("{label}: do_rotary=1 needs cos_cache and sin_cache");
    }
    if !(has_output(node, 1) && has_output(node, 2)) {
        bail!("{label}: present_key and present_value must be outputs");
    }
    if node.output.iter().skip(3).any(|o| !o.is_empty()) {
        bail!("{label}: only the outputs output, present_key and present_value are supported");
    }
    Ok(Gqa {
        num_heads: num_heads as usize,
        kv_num_heads: kv_num_heads as usize,
        scale: node.get_attr_opt("scale")?.unwrap_or(0.0),
        softcap: node.get_attr_opt("softcap")?.unwrap_or(0.0),
        local_window_size: attr_i("local_window_size", -1)?,
        do_rotary,
        rotary_interleaved: attr_i("rotary_interleaved", 0)? != 0,
        key,
        value,
        past_key: need(3, "past_key")?,
        past_value: need(4, "past_value")?,
        seqlens_k: need(5, "seqlens_k")?,
        total_sequence_length: need(6, "total_sequence_length")?,
        cos_cache: if do_rotary { cos_cache } else { None },
        sin_cache: if do_rotary { sin_cache } else { None },
        position_ids: input_slot(node, 9),
        inputs: node.input.iter().filter(|s| !s.is_empty()).count(),
        label,
    })
}

impl Expansion for Gqa {
    fn name(&self) -> StaticName {
        "GroupQueryAttention".into()
    }

    fn nboutputs(&self) -> TractResult<usize> {
        Ok(3)
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, self.inputs)?;
        check_output_arity(outputs, 3)?;
        let (q, pk, pv) = (&inputs[0], &inputs[self.past_key], &inputs[self.past_value]);
        s.equals(&outputs[0].datum_type, &q.datum_type)?;
        s.equals(&outputs[0].rank, 3)?;
        s.equals(&outputs[0].shape[0], &q.shape[0])?;
        s.equals(&outputs[0].shape[1], &q.shape[1])?;
        let heads = self.num_heads as i64;
        s.given(&pk.shape[3], move |s, dim| {
            s.equals(&outputs[0].shape[2], dim * heads)
        })?;
        s.equals(&outputs[1].datum_type, &pk.datum_type)?;
        s.equals(&outputs[1].shape, &pk.shape)?;
        s.equals(&outputs[2].datum_type, &pv.datum_type)?;
        s.equals(&outputs[2].shape, &pv.shape)?;
        Ok(())
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let label = &self.label;
        for ix in [0, self.past_key, self.past_value] {
            let dt = model.outlet_fact(inputs[ix])?.datum_type;
            if dt != f32::datum_type() {
                bail!("{label}: {dt:?} inputs are not supported (float32 only)");
            }
        }
        let pk = model.outlet_fact(inputs[self.past_key])?;
        if pk.rank() != 4 {
            bail!("{label}: past_key has shape {:?}; expected [batch, kv_num_heads, length, head_size]", pk.shape);
        }
        if let Ok(kv) = pk.shape[1].to_usize() {
            if kv != self.kv_num_heads {
                bail!(
                    "{label}: past_key has {kv} heads; kv_num_heads is {}",
                    self.kv_num_heads
                );
            }
        }
        model.wire_node(prefix, GqaOp(self.clone()), inputs)
    }
}

/// The typed op (the same attributes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GqaOp(pub Gqa);

impl Op for GqaOp {
    fn name(&self) -> StaticName {
        "GroupQueryAttention".into()
    }
    op_as_typed_op!();
}

impl TypedOp for GqaOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let q = inputs[0];
        let pk = inputs[self.0.past_key];
        let pv = inputs[self.0.past_value];
        let dim = pk.shape[3].clone() * self.0.num_heads as i64;
        let out = q
            .datum_type
            .fact([q.shape[0].clone(), q.shape[1].clone(), dim]);
        Ok(tvec!(
            out,
            pk.datum_type.fact(pk.shape.clone()),
            pv.datum_type.fact(pv.shape.clone())
        ))
    }
    as_op!();
}

impl EvalOp for GqaOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let g = &self.0;
        let mut slots: Vec<Option<TValue>> = inputs.into_iter().map(Some).collect();
        let mut take = |ix: usize| {
            slots
                .get_mut(ix)
                .and_then(|s| s.take())
                .ok_or_else(|| format_err!("{}: input {ix} missing", g.label))
        };
        // The caches are taken by value: when the caller kept no other reference (the engine
        // hands its buffers over), `into_tensor` moves them and the new rows land in place.
        let mut present_key = take(g.past_key)?.into_tensor();
        let mut present_value = take(g.past_value)?.into_tensor();
        let query = take(0)?;
        let key = g.key.map(&mut take).transpose()?;
        let value = g.value.map(&mut take).transpose()?;
        let seqlens = take(g.seqlens_k)?;
        let total = take(g.total_sequence_length)?;
        let cos = g.cos_cache.map(&mut take).transpose()?;
        let sin = g.sin_cache.map(&mut take).transpose()?;
        let positions = g.position_ids.map(&mut take).transpose()?;

        let seqlens = seqlens.cast_to::<i64>()?;
        let seqlens = seqlens.try_as_plain_ram()?;
        let seqlens = seqlens.as_slice::<i64>()?;
        let total = total.cast_to::<i64>()?;
        let total = *total
            .try_as_plain_ram()?
            .as_slice::<i64>()?
            .first()
            .ok_or_else(|| format_err!("{}: total_sequence_length is empty", g.label))?;
        let q = query.try_as_plain_ram()?;
        let k = key.as_ref().map(|k| k.try_as_plain_ram()).transpose()?;
        let v = value.as_ref().map(|v| v.try_as_plain_ram()).transpose()?;
        let rotary = match (&cos, &sin) {
            (Some(c), Some(s)) => {
                if c.rank() != 2 || c.shape() != s.shape() {
                    bail!(
                        "{}: cos_cache {:?} and sin_cache {:?} must share one shape [positions, rotary_dim / 2]",
                        g.label,
                        c.shape(),
                        s.shape()
                    );
                }
                Some((c.cast_to::<f32>()?, s.cast_to::<f32>()?))
            }
            _ => None,
        };
        let rotary_views = match &rotary {
            Some((c, s)) => Some((
                c.try_as_plain_ram()?,
                s.try_as_plain_ram()?,
                c.shape().to_vec(),
            )),
            None => None,
        };
        let positions = positions
            .map(|p| p.cast_to::<i64>().map(|c| c.into_owned()))
            .transpose()?;
        let pos_view = positions
            .as_ref()
            .map(|p| p.try_as_plain_ram())
            .transpose()?;

        let (batch, seq) = match query.shape() {
            &[b, s, _] => (b, s),
            s => bail!(
                "{}: query has shape {s:?}; expected [batch, sequence, hidden]",
                g.label
            ),
        };
        let (pb, kv, len, dim) = match present_key.shape() {
            &[b, h, l, d] => (b, h, l, d),
            s => bail!("{}: past_key has shape {s:?}", g.label),
        };
        if present_value.shape() != present_key.shape() || pb != batch || kv != g.kv_num_heads {
            bail!(
                "{}: past_key {:?} / past_value {:?} do not match query {:?} and kv_num_heads {}",
                g.label,
                present_key.shape(),
                present_value.shape(),
                query.shape(),
                g.kv_num_heads
            );
        }
        let shape = Shape {
            batch,
            seq,
            heads: g.num_heads,
            kv,
            dim,
            len,
        };
        let mut out = vec![0f32; batch * seq * g.num_heads * dim];
        {
            let mut pk = present_key.try_as_plain_ram_mut()?;
            let mut pv = present_value.try_as_plain_ram_mut()?;
            let rot = match &rotary_views {
                Some((c, s, shape)) => Some(Rotary {
                    cos: c.as_slice::<f32>()?,
                    sin: s.as_slice::<f32>()?,
                    positions: shape.first().copied().unwrap_or(0),
                    half: shape.get(1).copied().unwrap_or(0),
                    interleaved: g.rotary_interleaved,
                }),
                None => None,
            };
            attend(
                g,
                &shape,
                Inputs {
                    q: q.as_slice::<f32>()?,
                    k: k.as_ref().map(|k| k.as_slice::<f32>()).transpose()?,
                    v: v.as_ref().map(|v| v.as_slice::<f32>()).transpose()?,
                    seqlens,
                    total: total.max(0) as usize,
                    rotary: rot,
                    positions: pos_view.as_ref().map(|p| p.as_slice::<i64>()).transpose()?,
                },
                pk.as_slice_mut::<f32>()?,
                pv.as_slice_mut::<f32>()?,
                &mut out,
            )?;
        }
        let out = Tensor::from_shape(&[batch, seq, g.num_heads * dim], &out)?;
        Ok(tvec!(
            out.into_tvalue(),
            present_key.into_tvalue(),
            present_value.into_tvalue()
        ))
    }
}

struct Shape {
    batch: usize,
    seq: usize,
    heads: usize,
    kv: usize,
    dim: usize,
    /// Positions of the shared buffer.
    len: usize,
}

struct Rotary<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    positions: usize,
    half: usize,
    interleaved: bool,
}

impl Rotary<'_> {
    /// Rotate the first `2 * half` values of `x` by position `pos`.
    fn apply(&self, x: &mut [f32], pos: i64, label: &str) -> TractResult<()> {
        if pos < 0 || pos as usize >= self.positions {
            bail!(
                "{label}: position {pos} is outside the rotary caches ({} positions)",
                self.positions
            );
        }
        let half = self.half;
        if 2 * half > x.len() {
            bail!(
                "{label}: the rotary caches rotate {} values; the head has {}",
                2 * half,
                x.len()
            );
        }
        let at = pos as usize * half;
        let (cos, sin) = (&self.cos[at..at + half], &self.sin[at..at + half]);
        for i in 0..half {
            let (a, b) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * cos[i] - x1 * sin[i];
            x[b] = x1 * cos[i] + x0 * sin[i];
        }
        Ok(())
    }
}

struct Inputs<'a> {
    q: &'a [f32],
    k: Option<&'a [f32]>,
    v: Option<&'a [f32]>,
    seqlens: &'a [i64],
    total: usize,
    rotary: Option<Rotary<'a>>,
    positions: Option<&'a [i64]>,
}

/// Write the new keys and values into the buffers, then attend. `out` is `[B, S, N * H]`.
fn attend(
    g: &Gqa,
    sh: &Shape,
    x: Inputs,
    pk: &mut [f32],
    pv: &mut [f32],
    out: &mut [f32],
) -> TractResult<()> {
    let label = &g.label;
    let (n, kv, dim, seq) = (sh.heads, sh.kv, sh.dim, sh.seq);
    let packed = x.k.is_none();
    let q_width = if packed { (n + 2 * kv) * dim } else { n * dim };
    if x.q.len() != sh.batch * seq * q_width {
        bail!(
            "{label}: query has {} values; expected [{}, {seq}, {q_width}] for {n} heads, {kv} KV heads of size {dim}",
            x.q.len(),
            sh.batch
        );
    }
    for t in [x.k, x.v].into_iter().flatten() {
        if t.len() != sh.batch * seq * kv * dim {
            bail!(
                "{label}: key/value have {} values; expected [{}, {seq}, {}]",
                t.len(),
                sh.batch,
                kv * dim
            );
        }
    }
    if x.seqlens.len() != sh.batch {
        bail!(
            "{label}: seqlens_k has {} values for {} rows",
            x.seqlens.len(),
            sh.batch
        );
    }
    if x.total > sh.len {
        bail!(
            "{label}: total_sequence_length {} exceeds the past buffer of {} positions (the past and present buffers must be shared and long enough)",
            x.total,
            sh.len
        );
    }
    let first_prompt = seq == x.total;
    let scale = if g.scale == 0.0 {
        1.0 / (dim as f32).sqrt()
    } else {
        g.scale
    };
    let group = n / kv;
    let mut qh = vec![0f32; dim];
    let mut scores = vec![0f32; sh.len];
    for b in 0..sh.batch {
        let valid = x.seqlens[b] + 1;
        let past = if first_prompt { 0 } else { valid - seq as i64 };
        if past < 0 || past as usize + seq > sh.len {
            bail!(
                "{label}: row {b} has seqlens_k {} for {seq} new tokens and a buffer of {} positions",
                x.seqlens[b],
                sh.len
            );
        }
        let past = past as usize;
        let position = |s: usize| match x.positions {
            Some(p) => p.get(b * seq + s).copied().unwrap_or(0),
            None => (past + s) as i64,
        };
        // New keys (rotated) and values into the shared buffer.
        for s in 0..seq {
            for h in 0..kv {
                let (ksrc, vsrc) = match (x.k, x.v) {
                    (Some(k), Some(v)) => {
                        let at = (b * seq + s) * kv * dim + h * dim;
                        (&k[at..at + dim], &v[at..at + dim])
                    }
                    _ => {
                        let row = (b * seq + s) * q_width;
                        let ka = row + n * dim + h * dim;
                        let va = row + (n + kv) * dim + h * dim;
                        (&x.q[ka..ka + dim], &x.q[va..va + dim])
                    }
                };
                let at = ((b * kv + h) * sh.len + past + s) * dim;
                pk[at..at + dim].copy_from_slice(ksrc);
                pv[at..at + dim].copy_from_slice(vsrc);
                if let Some(r) = &x.rotary {
                    r.apply(&mut pk[at..at + dim], position(s), label)?;
                }
            }
        }
        for h in 0..n {
            let kh = h / group;
            let kbase = (b * kv + kh) * sh.len * dim;
            for s in 0..seq {
                let qa = (b * seq + s) * q_width + h * dim;
                qh.copy_from_slice(&x.q[qa..qa + dim]);
                if let Some(r) = &x.rotary {
                    r.apply(&mut qh, position(s), label)?;
                }
                let causal = past + s + 1;
                // The window holds the last `local_window_size` keys (the query's own included), as
                // onnxruntime's CPU kernel computes it.
                let window = g.local_window_size;
                let start = if window >= 0 && causal as i64 > window {
                    causal - window as usize
                } else {
                    0
                };
                let mut max = f32::NEG_INFINITY;
                for (t, score) in scores[start..causal].iter_mut().enumerate() {
                    let kk = &pk[kbase + (start + t) * dim..kbase + (start + t + 1) * dim];
                    let mut d = 0f32;
                    for i in 0..dim {
                        d += qh[i] * kk[i];
                    }
                    d *= scale;
                    if g.softcap > 0.0 {
                        d = g.softcap * (d / g.softcap).tanh();
                    }
                    *score = d;
                    max = max.max(d);
                }
                let mut sum = 0f32;
                for score in scores[start..causal].iter_mut() {
                    *score = (*score - max).exp();
                    sum += *score;
                }
                let oa = (b * seq + s) * n * dim + h * dim;
                let o = &mut out[oa..oa + dim];
                for (t, p) in scores[start..causal].iter().enumerate() {
                    let w = p / sum;
                    let vv = &pv[kbase + (start + t) * dim..kbase + (start + t + 1) * dim];
                    for i in 0..dim {
                        o[i] += w * vv[i];
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::check;

    #[test]
    fn gqa_prompt_packed_rotary() {
        check("gqa_prompt_packed_rotary");
    }

    #[test]
    fn gqa_decode_rotary_interleaved() {
        check("gqa_decode_rotary_interleaved");
    }

    #[test]
    fn gqa_subsequent_window_softcap() {
        check("gqa_subsequent_window_softcap");
    }

    #[test]
    fn gqa_decode_mha() {
        check("gqa_decode_mha");
    }

    #[test]
    fn rotary_caches_of_other_shapes_are_an_error() {
        // cos_cache and sin_cache are inputs 7 and 8.
        let e = super::super::testing::run_altered("gqa_decode_rotary_interleaved", |inputs| {
            inputs[8] = inputs[8].slice(0, 0, 1).unwrap();
        })
        .expect("sin_cache of one position ran");
        assert!(
            e.contains("cos_cache [") && e.contains("must share one shape"),
            "{e}"
        );
        let e = super::super::testing::run_altered("gqa_decode_rotary_interleaved", |inputs| {
            let n = inputs[7].len();
            inputs[7] = tract_onnx::prelude::Tensor::from_shape(&[n], &vec![0f32; n]).unwrap();
            inputs[8] = inputs[7].clone();
        })
        .expect("one-axis rotary caches ran");
        assert!(e.contains("must share one shape [positions"), "{e}");
    }
}
