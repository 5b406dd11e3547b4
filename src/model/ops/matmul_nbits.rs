//! `com.microsoft.MatMulNBits`: `Y = A @ dequantize(B)^T (+ bias)` with `B` block-quantized to
//! 4 or 8 bits along K.
//!
//! `B` is `uint8 [N, ceil(K / block_size), block_size * bits / 8]` (low bits first), `scales`
//! `[N * blocks]` (any float type), `zero_points` optional: `uint8` packed like `B`
//! (`[N * ceil(blocks * bits / 8)]`) or float `[N * blocks]`; absent, the zero point is
//! `2^(bits - 1)`. `bias` `[N]` optional. Block sizes are powers of two from 16 to 256.
//!
//! The weight stays packed: the kernel dequantizes one block of one column at a time and
//! multiplies it with every row of `A`, so the f32 weight never exists in memory.
//! Not supported (a load-time error naming the node): `g_idx`, other bit widths, a `B`,
//! `scales` or `zero_points` whose shape does not match `K`, `N`, `bits` and `block_size`.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;

use super::{initializer_dims, input_slot, node_label};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NBits {
    pub k: usize,
    pub n: usize,
    pub bits: usize,
    pub block_size: usize,
    /// Slots among the wired inputs.
    pub zero_points: Option<usize>,
    pub bias: Option<usize>,
    pub inputs: usize,
    pub label: String,
}

impl NBits {
    fn blocks(&self) -> usize {
        self.k.div_ceil(self.block_size)
    }
    /// Bytes of one block of one column.
    fn blob(&self) -> usize {
        self.block_size * self.bits / 8
    }
    /// Bytes of the packed zero points of one column.
    fn zp_blob(&self) -> usize {
        (self.blocks() * self.bits).div_ceil(8)
    }
}

pub fn matmul_nbits(
    ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    let op = parse(node)?;
    // A quantized weight stored in the file is checked now, before anything runs.
    if let Some(dims) = node.input.get(1).and_then(|b| initializer_dims(ctx, b)) {
        let want = [op.n as i64, op.blocks() as i64, op.blob() as i64];
        let flat = [(op.n * op.blocks() * op.blob()) as i64];
        if dims != want && dims != flat {
            bail!(
                "{}: the quantized weight '{}' has shape {dims:?}; K={} N={} bits={} block_size={} need {want:?}",
                op.label, node.input[1], op.k, op.n, op.bits, op.block_size
            );
        }
    }
    Ok((expand(op), vec![]))
}

pub fn parse(node: &NodeProto) -> TractResult<NBits> {
    let label = node_label(node);
    let k: i64 = node.get_attr("K")?;
    let n: i64 = node.get_attr("N")?;
    let bits: i64 = node.get_attr_opt("bits")?.unwrap_or(4);
    let block_size: i64 = node.get_attr("block_size")?;
    if k <= 0 || n <= 0 {
        bail!("{label}: K={k} and N={n} must be positive");
    }
    if bits != 4 && bits != 8 {
        bail!("{label}: bits={bits} is not supported (4 or 8)");
    }
    if !(16..=256).contains(&block_size) || (block_size & (block_size - 1)) != 0 {
        bail!("{label}: block_size={block_size} is not supported (a power of two from 16 to 256)");
    }
    if input_slot(node, 4).is_some() {
        bail!("{label}: the input g_idx (act-order) is not supported");
    }
    if node.output.len() != 1 {
        bail!("{label}: expected one output");
    }
    Ok(NBits {
        k: k as usize,
        n: n as usize,
        bits: bits as usize,
        block_size: block_size as usize,
        zero_points: input_slot(node, 3),
        bias: input_slot(node, 5),
        inputs: node.input.iter().filter(|s| !s.is_empty()).count(),
        label,
    })
}

impl Expansion for NBits {
    fn name(&self) -> StaticName {
        "MatMulNBits".into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, self.inputs)?;
        check_output_arity(outputs, 1)?;
        s.equals(&outputs[0].datum_type, &inputs[0].datum_type)?;
        s.equals(&outputs[0].rank, &inputs[0].rank)?;
        let n = self.n.to_dim();
        s.given(&inputs[0].rank, move |s, rank| {
            let rank = rank as usize;
            for ax in 0..rank.saturating_sub(1) {
                s.equals(&outputs[0].shape[ax], &inputs[0].shape[ax])?;
            }
            s.equals(&outputs[0].shape[rank - 1], n.clone())
        })
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        check_facts(self, model, inputs)?;
        model.wire_node(prefix, NBitsOp(self.clone()), inputs)
    }
}

/// Shapes and types of the inputs against the attributes.
fn check_facts(op: &NBits, model: &TypedModel, inputs: &[OutletId]) -> TractResult<()> {
    let label = &op.label;
    let fact = |ix: usize| model.outlet_fact(inputs[ix]);
    let a = fact(0)?;
    if !a.datum_type.is_float() {
        bail!("{label}: A is {:?}; expected a float tensor", a.datum_type);
    }
    match a.shape.last().map(|d| d.to_usize()) {
        Some(Ok(k)) if k != op.k => bail!("{label}: A has {k} columns; K is {}", op.k),
        None => bail!("{label}: A is a scalar"),
        _ => {}
    }
    let elems = |f: &TypedFact| {
        f.shape
            .iter()
            .map(|d| d.to_usize().ok())
            .product::<Option<usize>>()
            .ok_or(())
    };
    let b = fact(1)?;
    if b.datum_type != u8::datum_type() {
        bail!("{label}: B is {:?}; expected uint8", b.datum_type);
    }
    if let Ok(e) = elems(b) {
        let want = op.n * op.blocks() * op.blob();
        if e != want {
            bail!(
                "{label}: B has shape {:?}; K={} N={} bits={} block_size={} need [{}, {}, {}]",
                b.shape,
                op.k,
                op.n,
                op.bits,
                op.block_size,
                op.n,
                op.blocks(),
                op.blob()
            );
        }
    }
    let scales = fact(2)?;
    if let Ok(e) = elems(scales) {
        if e != op.n * op.blocks() {
            bail!(
                "{label}: scales has shape {:?}; expected {} values",
                scales.shape,
                op.n * op.blocks()
            );
        }
    }
    if let Some(z) = op.zero_points {
        let z = fact(z)?;
        let want = if z.datum_type == u8::datum_type() {
            op.n * op.zp_blob()
        } else {
            op.n * op.blocks()
        };
        if let Ok(e) = elems(z) {
            if e != want {
                bail!(
                    "{label}: zero_points has shape {:?}; expected {want} values",
                    z.shape
                );
            }
        }
    }
    if let Some(bias) = op.bias {
        if let Ok(e) = elems(fact(bias)?) {
            if e != op.n {
                bail!("{label}: bias has {e} values; expected N={}", op.n);
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NBitsOp(pub NBits);

impl Op for NBitsOp {
    fn name(&self) -> StaticName {
        "MatMulNBits".into()
    }
    op_as_typed_op!();
}

impl TypedOp for NBitsOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let a = inputs[0];
        let mut shape: TVec<TDim> = a.shape.iter().cloned().collect();
        if let Some(last) = shape.last_mut() {
            *last = self.0.n.to_dim();
        }
        Ok(tvec!(a.datum_type.fact(shape)))
    }
    as_op!();
}

impl EvalOp for NBitsOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let op = &self.0;
        let a = &inputs[0];
        let dt = a.datum_type();
        let a32 = a.cast_to::<f32>()?;
        let a_view = a32.try_as_plain_ram()?;
        let a_data = a_view.as_slice::<f32>()?;
        let b_view = inputs[1].try_as_plain_ram()?;
        let b = b_view.as_slice::<u8>()?;
        let scales = inputs[2].cast_to::<f32>()?;
        let scales_view = scales.try_as_plain_ram()?;
        let scales = scales_view.as_slice::<f32>()?;
        let zp = match op.zero_points {
            Some(ix) if inputs[ix].datum_type() == u8::datum_type() => {
                let v = inputs[ix].try_as_plain_ram()?;
                Zero::Packed(v.as_slice::<u8>()?.to_vec())
            }
            Some(ix) => {
                let t = inputs[ix].cast_to::<f32>()?;
                let v = t.try_as_plain_ram()?;
                Zero::Float(v.as_slice::<f32>()?.to_vec())
            }
            None => Zero::Default,
        };
        let bias = op
            .bias
            .map(|ix| -> TractResult<Vec<f32>> {
                let t = inputs[ix].cast_to::<f32>()?;
                let v = t.try_as_plain_ram()?;
                Ok(v.as_slice::<f32>()?.to_vec())
            })
            .transpose()?;
        let k = op.k;
        if a_data.len() % k != 0 {
            bail!(
                "{}: A has {} values, not a multiple of K={k}",
                op.label,
                a_data.len()
            );
        }
        let rows = a_data.len() / k;
        let mut out = vec![0f32; rows * op.n];
        matmul(op, a_data, rows, b, scales, &zp, &mut out)?;
        if let Some(bias) = bias {
            for row in out.chunks_mut(op.n) {
                for (o, b) in row.iter_mut().zip(&bias) {
                    *o += b;
                }
            }
        }
        let mut shape: TVec<usize> = a.shape().into();
        if let Some(last) = shape.last_mut() {
            *last = op.n;
        }
        let out = Tensor::from_shape(&shape, &out)?;
        let out = if dt == f32::datum_type() {
            out
        } else {
            out.cast_to_dt(dt)?.into_owned()
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

pub enum Zero {
    Default,
    Packed(Vec<u8>),
    Float(Vec<f32>),
}

/// `out[r, n] = sum_k a[r, k] * w[n, k]`, `w` dequantized one block at a time.
pub fn matmul(
    op: &NBits,
    a: &[f32],
    rows: usize,
    b: &[u8],
    scales: &[f32],
    zp: &Zero,
    out: &mut [f32],
) -> TractResult<()> {
    let (k, n, bits, bs) = (op.k, op.n, op.bits, op.block_size);
    let (blocks, blob, zp_blob) = (op.blocks(), op.blob(), op.zp_blob());
    if b.len() != n * blocks * blob || scales.len() != n * blocks || out.len() != rows * n {
        bail!(
            "{}: B has {} bytes and scales {} values; K={k} N={n} bits={bits} block_size={bs} need {} and {}",
            op.label,
            b.len(),
            scales.len(),
            n * blocks * blob,
            n * blocks
        );
    }
    let default_zero = (1u32 << (bits - 1)) as f32;
    let mut w = vec![0f32; bs];
    for col in 0..n {
        for blk in 0..blocks {
            let scale = scales[col * blocks + blk];
            let zero = match zp {
                Zero::Default => default_zero,
                Zero::Float(z) => *z
                    .get(col * blocks + blk)
                    .ok_or_else(|| format_err!("{}: zero_points too short", op.label))?,
                Zero::Packed(z) => {
                    let bit = blk * bits;
                    let byte = *z
                        .get(col * zp_blob + bit / 8)
                        .ok_or_else(|| format_err!("{}: zero_points too short", op.label))?;
                    ((byte >> (bit % 8)) & ((1u16 << bits) - 1) as u8) as f32
                }
            };
            let start = blk * bs;
            let width = bs.min(k - start);
            let src = &b[(col * blocks + blk) * blob..(col * blocks + blk + 1) * blob];
            if bits == 4 {
                for (i, byte) in src.iter().enumerate() {
                    w[2 * i] = ((byte & 0x0f) as f32 - zero) * scale;
                    w[2 * i + 1] = ((byte >> 4) as f32 - zero) * scale;
                }
            } else {
                for (wi, byte) in w.iter_mut().zip(src) {
                    *wi = (*byte as f32 - zero) * scale;
                }
            }
            for r in 0..rows {
                out[r * n + col] += dot(&a[r * k + start..r * k + start + width], &w[..width]);
            }
        }
    }
    Ok(())
}

/// A dot product the compiler vectorizes (eight independent sums).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * b[c * 8 + i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::super::testing::check;

    #[test]
    fn mnb_q4_b32() {
        check("mnb_q4_b32");
    }

    #[test]
    fn mnb_q4_b16_zp_bias() {
        check("mnb_q4_b16_zp_bias");
    }

    #[test]
    fn mnb_q4_b128_zp_partial() {
        check("mnb_q4_b128_zp_partial");
    }

    #[test]
    fn mnb_q8_b64_zp() {
        check("mnb_q8_b64_zp");
    }

    #[test]
    fn mnb_q8_b256() {
        check("mnb_q8_b256");
    }
}
