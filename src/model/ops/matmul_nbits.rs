//! `com.microsoft.MatMulNBits`: `Y = A @ dequantize(B)^T (+ bias)` with `B` block-quantized to
//! 4 or 8 bits along K.
//!
//! `B` is `uint8 [N, ceil(K / block_size), block_size * bits / 8]` (low bits first), `scales`
//! `[N * blocks]` (any float type), `zero_points` optional: `uint8` packed like `B`
//! (`[N * ceil(blocks * bits / 8)]`) or float `[N * blocks]`; absent, the zero point is
//! `2^(bits - 1)`. `bias` `[N]` optional. Block sizes are powers of two from 16 to 256.
//!
//! The weight stays packed. Decoding (one row of `A`) with 4 bits and integer zero points, the
//! row is rounded to 16-bit integers per group of 32 values and the columns' blocks are
//! multiplied with it in integers, four columns at a time (`QuantizedRow`); a prompt of
//! `INTEGER_PROMPT_ROWS` rows or more with such a weight has each row rounded the same way, and
//! eight columns at a time are widened to 16-bit integers once and multiplied with every row
//! (`QuantizedRows`, `Params::q4_prompt`); otherwise the kernel dequantizes four columns at a
//! time (with simd128 in wasm) and multiplies them with every row of `A`. The f32 weight never
//! exists whole in memory. A 4-bit weight that fits is laid out at load in lanes, sixteen
//! columns together, four columns' values in each 16-bit lane (`to_lanes`, by
//! `model::weights`; the `layout` attribute): the decoding kernel separates them with shifts
//! alone, a column a lane of its sums (`kernels::q4_lanes_i16`), and takes every row of `A`,
//! each rounded as a decoding row (the same outputs as the weight as it lies, but for 2 to 7
//! rows, which it rounds too).
//! Not supported (a load-time error naming the node): `g_idx`, other bit widths, a `B`,
//! `scales` or `zero_points` whose shape does not match `K`, `N`, `bits` and `block_size`.

use std::cell::RefCell;
use std::rc::Rc;

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;

use super::linalg::{dot, dot4, dot4x2, side_by_side};
use super::{initializer_dims, input_slot, matmul_output_fact, node_label};

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
    /// `B` and `scales` laid out sixteen columns together at load ([`to_lanes`]): the node's
    /// `layout` attribute is [`LANES_ATTRIBUTE`].
    pub lanes: bool,
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
    let lanes = match node.get_attr_opt::<i64>("layout")? {
        None => false,
        Some(LANES_ATTRIBUTE) if fits_lanes(bits as usize, block_size as usize, n as usize) => true,
        Some(LANES_ATTRIBUTE) => bail!(
            "{label}: B in lanes needs 4 bits, block_size 32 or more and N a multiple of 16; \
             bits={bits} block_size={block_size} N={n}"
        ),
        Some(v) => bail!("{label}: layout {v}; expected {LANES_ATTRIBUTE} (lanes)"),
    };
    Ok(NBits {
        k: k as usize,
        n: n as usize,
        bits: bits as usize,
        block_size: block_size as usize,
        zero_points: input_slot(node, 3),
        bias: input_slot(node, 5),
        inputs: node.input.iter().filter(|s| !s.is_empty()).count(),
        label,
        lanes,
    })
}

/// The `layout` attribute of a `MatMulNBits` whose `B` and `scales` are in lanes
/// ([`to_lanes`], [`scales_to_lanes`]), set by `model::weights` at load.
pub const LANES_ATTRIBUTE: i64 = 1;

/// Columns in lanes go together sixteen at a time, a pass ([`to_lanes`]).
const PASS: usize = 16;

/// Whether a weight of `bits` bits, blocks of `block_size` and `n` columns can be laid out in
/// lanes: 4 bits, whole groups of 32 per block, whole passes of columns.
pub fn fits_lanes(bits: usize, block_size: usize, n: usize) -> bool {
    bits == 4 && block_size >= GROUP && n.is_multiple_of(PASS)
}

/// A 4-bit `B` (`[n, padded / 2]` bytes, each column's blocks padded to `padded` values, low
/// nibble first) into lanes, `dst` as long: sixteen columns `16p..16p + 16` together (a pass),
/// as vectors of eight 16-bit lanes (little-endian), vector `b` holding every column's values
/// `2b` and `2b + 1` (byte `b` of each column): lanes `2i` and `2i + 1` hold those of columns
/// `16p + i`, `+ 4`, `+ 8` and `+ 12` in bits 0-3, 4-7, 8-11 and 12-15, the last with its top
/// bit flipped. Read as four i32, a vector meets the row's pair `(x[2b], x[2b + 1])` in one
/// `i32x4.dot_i16x8_s` a column a lane, and its columns part with shifts alone
/// (`kernels::q4_lanes_i16`).
pub fn to_lanes(src: &[u8], n: usize, padded: usize, dst: &mut [u8]) {
    let bytes = padded / 2;
    assert!(
        src.len() == n * bytes
            && dst.len() == src.len()
            && padded.is_multiple_of(GROUP)
            && n.is_multiple_of(PASS),
        "to_lanes: {} bytes for N={n}, K padded to {padded}",
        src.len()
    );
    for (columns, pass) in src
        .chunks_exact(PASS * bytes)
        .zip(dst.chunks_exact_mut(PASS * bytes))
    {
        for (b, vector) in pass.chunks_exact_mut(16).enumerate() {
            for (i, lanes) in vector.chunks_exact_mut(4).enumerate() {
                let [b0, b1, b2, b3] = [0, 1, 2, 3].map(|s| columns[(4 * s + i) * bytes + b]);
                let lo = (b0 & 15) | (b1 & 15) << 4;
                let hi = (b2 & 15) | ((b3 & 15) ^ 8) << 4;
                let (lo1, hi1) = ((b0 >> 4) | (b1 >> 4) << 4, (b2 >> 4) | ((b3 >> 4) ^ 8) << 4);
                lanes.copy_from_slice(&[lo, hi, lo1, hi1]);
            }
        }
    }
}

/// `scales` (`[n, blocks]` values of `size` bytes each) into lanes, `dst` as long: `[n / 16,
/// blocks, 16]`, a pass's sixteen scales of a block side by side.
pub fn scales_to_lanes(src: &[u8], size: usize, n: usize, blocks: usize, dst: &mut [u8]) {
    assert!(
        src.len() == n * blocks * size && dst.len() == src.len() && n.is_multiple_of(PASS),
        "scales_to_lanes: {} bytes for N={n}, {blocks} blocks of {size}-byte scales",
        src.len()
    );
    let column = blocks * size;
    for (columns, pass) in src
        .chunks_exact(PASS * column)
        .zip(dst.chunks_exact_mut(PASS * column))
    {
        for (c, column) in columns.chunks_exact(column).enumerate() {
            for (blk, value) in column.chunks_exact(size).enumerate() {
                let at = (blk * PASS + c) * size;
                pass[at..at + size].copy_from_slice(value);
            }
        }
    }
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
            let last = super::last_axis(rank, &self.label)?;
            for ax in 0..last {
                s.equals(&outputs[0].shape[ax], &inputs[0].shape[ax])?;
            }
            s.equals(&outputs[0].shape[last], n.clone())
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
        Ok(tvec!(matmul_output_fact(inputs[0], self.0.n)))
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
        let a_data = a32.try_as_plain_ram()?.as_slice::<f32>()?;
        let b = inputs[1].try_as_plain_ram()?.as_slice::<u8>()?;
        let scales = inputs[2].cast_to::<f32>()?;
        let scales = scales.try_as_plain_ram()?.as_slice::<f32>()?;
        let zp_float = match op.zero_points {
            Some(ix) if inputs[ix].datum_type() != u8::datum_type() => {
                Some(inputs[ix].cast_to::<f32>()?)
            }
            _ => None,
        };
        let zp = match (op.zero_points, &zp_float) {
            (Some(_), Some(z)) => Zero::Float(z.try_as_plain_ram()?.as_slice::<f32>()?),
            (Some(ix), None) => Zero::Packed(inputs[ix].try_as_plain_ram()?.as_slice::<u8>()?),
            (None, _) => Zero::Default,
        };
        let bias = op.bias.map(|ix| inputs[ix].cast_to::<f32>()).transpose()?;
        let bias = bias
            .as_ref()
            .map(|t| t.try_as_plain_ram()?.as_slice::<f32>())
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
        let mut shape: TVec<usize> = a.shape().into();
        if let Some(last) = shape.last_mut() {
            *last = op.n;
        }
        let out = super::output_tensor(&shape, |out: &mut [f32]| {
            matmul(op, a_data, rows, b, scales, &zp, out)?;
            if let Some(bias) = bias {
                for row in out.chunks_mut(op.n) {
                    for (o, b) in row.iter_mut().zip(bias) {
                        *o += b;
                    }
                }
            }
            Ok(())
        })?;
        let out = if dt == f32::datum_type() {
            out
        } else {
            out.cast_to_dt(dt)?.into_owned()
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

/// The zero points of every block.
pub enum Zero<'a> {
    /// `2^(bits - 1)`.
    Default,
    /// `uint8`, `bits` per block, each column's blocks starting on a new byte.
    Packed(&'a [u8]),
    Float(&'a [f32]),
}

/// Elements of a 4-bit group: the kernels take a group's bytes at once, low nibbles (even
/// elements) and high nibbles (odd elements) apart, so `A` is reordered to match (`permute`).
const GROUP: usize = 32;

/// `out[r, n] = sum_k a[r, k] * w[n, k]` with `w[n, k] = (q[n, k] - zero) * scale` of its block.
///
/// One row (decoding): each column's packed blocks are read once and multiplied in registers
/// (with the 16-bit row for 4 bits, `QuantizedRow`; in lanes, every row so). Several rows (a
/// prompt): a few columns at a time are widened to 16-bit integers (4 bits, integer zero
/// points, `INTEGER_PROMPT_ROWS` rows or more: `Params::q4_prompt`) or dequantized to f32 into
/// a small buffer, then multiplied with every row, so the widening is paid once per column and
/// the f32 weight never exists whole. Under the `threads` feature the columns are split across
/// the pool (`parallel`).
pub fn matmul(
    op: &NBits,
    a: &[f32],
    rows: usize,
    b: &[u8],
    scales: &[f32],
    zp: &Zero,
    out: &mut [f32],
) -> TractResult<()> {
    let parts = super::parallel::parts_for(rows * op.n * op.k);
    matmul_in_parts(op, a, rows, b, scales, zp, out, parts)
}

/// [`matmul`] with the output columns split in `parts` ranges.
#[allow(clippy::too_many_arguments)]
fn matmul_in_parts(
    op: &NBits,
    a: &[f32],
    rows: usize,
    b: &[u8],
    scales: &[f32],
    zp: &Zero,
    out: &mut [f32],
    parts: usize,
) -> TractResult<()> {
    let (k, n, bits, bs) = (op.k, op.n, op.bits, op.block_size);
    let (blocks, blob, zp_blob) = (op.blocks(), op.blob(), op.zp_blob());
    let zp_len = match zp {
        Zero::Default => 0,
        Zero::Packed(z) => z.len(),
        Zero::Float(z) => z.len(),
    };
    let zp_want = match zp {
        Zero::Default => 0,
        Zero::Packed(_) => n * zp_blob,
        Zero::Float(_) => n * blocks,
    };
    if b.len() != n * blocks * blob
        || scales.len() != n * blocks
        || out.len() != rows * n
        || a.len() != rows * k
        || zp_len != zp_want
    {
        bail!(
            "{}: B has {} bytes, scales {} values and zero points {zp_len}; K={k} N={n} bits={bits} block_size={bs} need {}, {} and {zp_want}",
            op.label,
            b.len(),
            scales.len(),
            n * blocks * blob,
            n * blocks
        );
    }
    if op.lanes && (!fits_lanes(bits, bs, n) || matches!(zp, Zero::Float(_))) {
        bail!(
            "{}: B in lanes needs 4 bits, block_size 32 or more, N a multiple of 16 and integer \
             zero points; bits={bits} block_size={bs} N={n}",
            op.label
        );
    }
    let padded = blocks * bs;
    // A 4-bit weight with integer zero points: a decoding row (padded) as 16-bit integers, so
    // that the kernel multiplies integers (`kernels::q4_columns4_i16`, `q4_column_i16`). In
    // lanes every row so, each taken as a decoding row (`q4_lanes_i16`, which reads the rows in
    // their order): each row has the bits it has alone, with no widened copy of the weight
    // and none in f32. For q4 SmolLM2's weights (a wasm test, Node): 2 rows 8 ms against 27
    // through f32 (at 9f53b22), 4 rows 16 against 39, 7 rows 28 against 61; 16 rows 63-64
    // against 77-78 by `q4_prompt` in lanes, 64 rows 252 against 261, 128 rows 505-506 either
    // way.
    let integer = bits == 4 && bs >= GROUP && !matches!(zp, Zero::Float(_));
    let quantized = (integer && (rows == 1 || op.lanes))
        .then(|| QuantizedRow::of_rows(a, k, padded, !op.lanes))
        .flatten();
    // A prompt of such a weight as it lies, from `INTEGER_PROMPT_ROWS` rows: every row so,
    // eight columns widened at a time (`q4_prompt`).
    let prompt = (integer && !op.lanes && rows >= INTEGER_PROMPT_ROWS)
        .then(|| QuantizedRows::of(a, rows, k, padded))
        .flatten();
    // Otherwise each row of A padded with zeros to whole blocks (the last block may be
    // partial), and for 4 bits as they lie reordered within each group to the nibble order.
    let mut ap = vec![];
    if quantized.is_none() && prompt.is_none() {
        ap.resize(rows * padded, 0f32);
        for r in 0..rows {
            let src = &a[r * k..(r + 1) * k];
            let dst = &mut ap[r * padded..(r + 1) * padded];
            if bits == 4 && !op.lanes {
                permute(src, dst, bs.min(GROUP));
            } else {
                dst[..k].copy_from_slice(src);
            }
        }
    }
    let params = Params {
        bits,
        bs,
        blocks,
        blob,
        zp_blob,
        zp,
        scales,
        lanes: op.lanes,
        quantized: quantized.as_deref().map(Vec::as_slice),
        prompt: prompt.as_ref(),
    };
    // The column ranges run in parallel (`parallel::by_columns`); the same values for any
    // `parts`.
    let align = if op.lanes { PASS } else { COLS };
    super::parallel::by_columns(out, rows, n, align, parts, |cols, block| {
        params.columns(cols, b, &ap, rows, block)
    });
    Ok(())
}

/// Rows of a prompt the kernel in lanes takes at once (`kernels::q4_lanes_i16`): each vector
/// of the pass and its three shifts serve both rows, whose eight sums stay in registers. q4
/// SmolLM2's later prompts of 37 tokens in Node took 155-166 ms against 177-189 one row at a
/// time; three or four rows (twelve or sixteen sums) 172-197.
const LANE_ROWS: usize = 2;

/// Columns grouped by the prompt kernel (`dot4`); split points fall on multiples of it (of
/// [`PASS`] in lanes).
const COLS: usize = 4;

impl Params<'_> {
    /// Columns `cols` of the output into `block` (`[rows, cols.len()]`).
    ///
    /// One row (decoding): each column's packed blocks are read once and multiplied in
    /// registers (`column_dot`). Several rows (a prompt): `COLS` columns at a time are
    /// dequantized into a small buffer, then multiplied with every row.
    fn columns(
        &self,
        cols: std::ops::Range<usize>,
        b: &[u8],
        ap: &[f32],
        rows: usize,
        block: &mut [f32],
    ) {
        let padded = self.blocks * self.bs;
        let width = cols.len();
        if let (true, Some(quantized)) = (self.lanes, self.quantized) {
            // In lanes, pass after pass, one stream, each pass with every row while its weights
            // are in the cache (`kernels::q4_lanes_i16`), `LANE_ROWS` rows at a time.
            let shift = (self.bs / GROUP).trailing_zeros();
            for first in cols.clone().step_by(PASS) {
                let (pass, scales) = (self.pass(b, first), self.pass_scales(first));
                let mut put = |r: usize, sums: &[f32; PASS]| {
                    let at = r * width + first - cols.start;
                    block[at..at + PASS].copy_from_slice(sums);
                };
                let groups = quantized.chunks_exact(LANE_ROWS);
                let rest = groups.remainder();
                for (i, group) in groups.enumerate() {
                    let rows = std::array::from_fn(|m| &group[m]);
                    let sums = self.lanes_rows::<LANE_ROWS>(pass, rows, shift, scales, first);
                    for (m, sums) in sums.iter().enumerate() {
                        put(LANE_ROWS * i + m, sums);
                    }
                }
                for (m, row) in rest.iter().enumerate() {
                    let [sums] = self.lanes_rows(pass, [row], shift, scales, first);
                    put(quantized.len() - rest.len() + m, &sums);
                }
            }
            return;
        }
        if rows == 1 && !self.lanes {
            // Four columns a quarter of the range apart at once: four sequential reads keep
            // more of memory's lines in flight than one.
            let (groups, rest) = side_by_side::<4>(width);
            for four in groups {
                let four = four.map(|i| cols.start + i);
                match self.columns4_dot(four, b) {
                    Some(sums) => {
                        for (c, sum) in four.into_iter().zip(sums) {
                            block[c - cols.start] = sum;
                        }
                    }
                    None => {
                        for c in four {
                            block[c - cols.start] = self.column_dot(c, b, ap);
                        }
                    }
                }
            }
            for i in rest {
                block[i] = self.column_dot(cols.start + i, b, ap);
            }
            return;
        }
        if let Some(prompt) = self.prompt {
            return self.q4_prompt(cols, b, prompt, rows, block);
        }
        // (In lanes, also a decoding row that is not finite.)
        let mut w = vec![0f32; COLS * padded];
        for first in cols.clone().step_by(COLS) {
            let count = COLS.min(cols.end - first);
            if self.lanes {
                self.dequantize_quad(first, b, &mut w);
            } else {
                for c in 0..count {
                    self.dequantize(first + c, b, &mut w[c * padded..(c + 1) * padded]);
                }
            }
            let at = first - cols.start;
            let x = |r: usize| &ap[r * padded..(r + 1) * padded];
            let mut r = 0;
            while r < rows {
                if count == COLS && r + 1 < rows {
                    // Two rows share each loaded weight (the same sums as `dot4`; with four
                    // rows the sixteen accumulators no longer fit the registers).
                    let sums = dot4x2(x(r), x(r + 1), &w);
                    for (i, s) in sums.iter().enumerate() {
                        let o = (r + i) * width + at;
                        block[o..o + COLS].copy_from_slice(s);
                    }
                    r += 2;
                    continue;
                }
                let o = &mut block[r * width + at..r * width + at + count];
                if count == COLS {
                    o.copy_from_slice(&dot4(x(r), &w));
                } else {
                    for (c, o) in o.iter_mut().enumerate() {
                        *o = dot(x(r), &w[c * padded..(c + 1) * padded]);
                    }
                }
                r += 1;
            }
        }
    }
}

/// Value `k` (0 to 15) of column `c` (0 to 15) of a pass in lanes ([`to_lanes`]): in the lane
/// of columns `c % 4`, `+ 4`, `+ 8` and `+ 12`, bits `4 (c / 4)..4 (c / 4) + 4`, the last
/// column's top bit flipped back.
fn lane_value(pass: &[u8], c: usize, k: usize) -> i32 {
    let at = 2 * (k / 2 * 8 + 2 * (c % 4) + k % 2);
    let lane = u16::from_le_bytes([pass[at], pass[at + 1]]) ^ 0x8000;
    ((lane >> (4 * (c / 4))) & 15) as i32
}

/// Reorders `src` into `dst` group by group: the even elements of a group, then the odd ones
/// (the order of a group's low nibbles, then its high nibbles).
fn permute(src: &[f32], dst: &mut [f32], group: usize) {
    let half = group / 2;
    for (g, chunk) in dst.chunks_mut(group).enumerate() {
        for j in 0..half {
            let at = g * group + 2 * j;
            chunk[j] = src.get(at).copied().unwrap_or(0.0);
            chunk[half + j] = src.get(at + 1).copied().unwrap_or(0.0);
        }
    }
}

/// What the kernels need to read one column's blocks.
struct Params<'a> {
    bits: usize,
    bs: usize,
    blocks: usize,
    blob: usize,
    zp_blob: usize,
    zp: &'a Zero<'a>,
    scales: &'a [f32],
    /// `B` and `scales` in lanes ([`to_lanes`]).
    lanes: bool,
    /// The row of `A` as 16-bit integers, when decoding 4-bit weights; in lanes, every row,
    /// each taken as a decoding row.
    quantized: Option<&'a [QuantizedRow]>,
    /// The rows of `A` as 16-bit integers, for a prompt of 4-bit weights as they lie.
    prompt: Option<&'a QuantizedRows>,
}

/// A row of `A` (padded) as 16-bit integers, each group of [`GROUP`] values with its scale:
/// `x ~= q * scale`, `scale = max |x| / 32767`, so a value is off by at most half of 1/32767 of
/// its group's largest. The 4-bit kernel then multiplies integers, eight products per
/// instruction (`i32x4.dot_i16x8_s`), and converts one sum per group and column to f32: q4
/// SmolLM2's matrix-vector products took half the instructions of dequantizing every weight
/// to f32. (onnxruntime's `accuracy_level` 4 rounds `A` to 8 bits per block for the same reason.)
///
/// Each group's values are in the kernel's order ([`q4_order`]), and `sums` holds each group's
/// sum of its values, so that the kernel subtracts `zero * sums` from a group's sum of products
/// instead of the zero point from every weight.
struct QuantizedRow {
    q: Vec<i16>,
    sums: Vec<i32>,
    scales: Vec<f32>,
}

/// Where value `e` of a group of 32 lies in a [`QuantizedRow`] group: a group's 16 bytes read
/// as eight 16-bit lanes hold values `4j..4j + 4` in lane `j` (low nibble first), which the
/// kernel separates with a mask and shifts by 4, 8 and 12 bits; so the group is stored as the
/// values `4j`, then `4j + 1`, `4j + 2` and `4j + 3` (`j` = 0..8).
// (The simd128 kernels' shuffles write this order out; `QuantizedRows` reads it back.)
const fn q4_order(e: usize) -> usize {
    (e % 4) * 8 + e / 4
}

impl QuantizedRow {
    /// The row `x` padded with zeros to `padded` values (a multiple of [`GROUP`]), each group
    /// in the kernel's order ([`q4_order`]) or, for weights in lanes, in its own. `None` when a
    /// value is not finite (the f32 kernel then carries it to the output).
    fn of(x: &[f32], padded: usize, nibble_order: bool) -> Option<QuantizedRow> {
        debug_assert!(padded.is_multiple_of(GROUP) && x.len() <= padded);
        let groups = padded / GROUP;
        let mut q = vec![0i16; padded];
        let mut sums = vec![0i32; groups];
        let mut scales = vec![0f32; groups];
        let (chunks, _) = q.as_chunks_mut::<GROUP>();
        for (g, (xs, qs)) in x.chunks(GROUP).zip(chunks).enumerate() {
            // The last group may be partial: its missing values are zeros.
            let mut group = [0f32; GROUP];
            group[..xs.len()].copy_from_slice(xs);
            let max = kernels::max_abs(&group)?;
            scales[g] = max / 32767.0;
            if max > 0.0 {
                sums[g] = kernels::quantize_group(&group, 32767.0 / max, qs, nibble_order);
            }
        }
        Some(QuantizedRow { q, sums, scales })
    }

    /// Each row of `k` values of `a` as [`QuantizedRow::of`]; `None` when a value is not
    /// finite. The rows of the last call are kept with their `a` (up to [`LAST_ROWS_VALUES`]
    /// values) and given again for the same bits: a layer's q, k and v projections read the
    /// same `A`, and so do its gate and up projections.
    fn of_rows(
        a: &[f32],
        k: usize,
        padded: usize,
        nibble_order: bool,
    ) -> Option<Rc<Vec<QuantizedRow>>> {
        let same = |last: &LastRows| {
            (last.padded, last.nibble_order) == (padded, nibble_order)
                && last.a.len() == a.len()
                && last
                    .a
                    .iter()
                    .zip(a)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
        };
        let hit = LAST_ROWS.with_borrow(|last| {
            last.as_ref()
                .filter(|last| same(last))
                .map(|last| last.rows.clone())
        });
        if hit.is_some() {
            return hit;
        }
        let rows = a
            .chunks_exact(k)
            .map(|row| QuantizedRow::of(row, padded, nibble_order))
            .collect::<Option<Vec<_>>>()
            .map(Rc::new);
        LAST_ROWS.with_borrow_mut(|last| {
            // The copy of `A` goes into the last one's buffer.
            let mut kept = last.take().map(|last| last.a).unwrap_or_default();
            *last = rows
                .as_ref()
                .filter(|_| a.len() <= LAST_ROWS_VALUES)
                .map(|rows| {
                    kept.clear();
                    kept.extend_from_slice(a);
                    LastRows {
                        a: kept,
                        padded,
                        nibble_order,
                        rows: rows.clone(),
                    }
                });
        });
        rows
    }
}

/// The most values of `A` whose rows [`QuantizedRow::of_rows`] keeps (eight rows of 2,048):
/// decoding steps and small batches, not the copy of a prompt.
const LAST_ROWS_VALUES: usize = 16_384;

/// The rows [`QuantizedRow::of_rows`] gave last, with the `A` they came from.
struct LastRows {
    a: Vec<f32>,
    padded: usize,
    nibble_order: bool,
    rows: Rc<Vec<QuantizedRow>>,
}

thread_local! {
    static LAST_ROWS: RefCell<Option<LastRows>> = const { RefCell::new(None) };
}

/// The rows of a prompt as 16-bit integers, each rounded as one decoding row is
/// ([`QuantizedRow`]), for the 4-bit prompt kernel (`q4_prompt`): each group's values as 16
/// pairs `(x[2i], x[2i + 1])` in `K`'s order, one i32 a pair (a splat gives the multiplier of
/// `i32x4.dot_i16x8_s`), and each group's scale.
struct QuantizedRows {
    /// `[rows, groups, 16]`.
    pairs: Vec<i32>,
    /// `[rows, groups]`.
    scales: Vec<f32>,
    groups: usize,
}

impl QuantizedRows {
    /// `rows` rows of `k` values of `a`, each padded with zeros to `padded`; `None` when a
    /// value is not finite (as [`QuantizedRow::of`]).
    fn of(a: &[f32], rows: usize, k: usize, padded: usize) -> Option<QuantizedRows> {
        let groups = padded / GROUP;
        let mut pairs = Vec::with_capacity(rows * padded / 2);
        let mut scales = Vec::with_capacity(rows * groups);
        for row in a.chunks_exact(k).take(rows) {
            let row = QuantizedRow::of(row, padded, true)?;
            for q in row.q.chunks_exact(GROUP) {
                pairs.extend((0..GROUP).step_by(2).map(|e| {
                    let (even, odd) = (q[q4_order(e)], q[q4_order(e + 1)]);
                    (even as u16 as u32 | (odd as u16 as u32) << 16) as i32
                }));
            }
            scales.extend_from_slice(&row.scales);
        }
        Some(QuantizedRows {
            pairs,
            scales,
            groups,
        })
    }
}

/// The fewest rows of a prompt that the 4-bit prompt kernel takes (`Params::q4_prompt`): it
/// widens every weight once, which fewer rows do not repay. SmolLM2 q4 in Node, the prompt's
/// time (a median of six, 1 new token) against the kernel that dequantizes to f32: 2 tokens
/// 48-49 ms against 38-40, 4 tokens 54-56 against 51-52, 8 tokens 72-73 against 77-78, 16
/// tokens 103-106 against 130, 37 tokens 203-206 against 282-284.
pub const INTEGER_PROMPT_ROWS: usize = 8;

/// Columns the 4-bit prompt kernel takes at a time (`kernels::q4_prompt8`).
const PROMPT_COLS: usize = 8;

/// One column of 4-bit weights (`src`, its `scales`) times every row of a prompt: each group's
/// sum of `(q - zero) * x` in integers, then converted and scaled as the decoding kernel does
/// (`kernels::q4_columns4_i16`: the total plus the sum times the row's scale times the block's
/// scale), so a row gives the same bits in a prompt and in a decoding step. `out(r, total)`
/// takes row `r`'s value. The portable prompt kernel, and the columns past the last eight.
#[allow(clippy::too_many_arguments)]
fn q4_prompt_column(
    src: &[u8],
    rows: &QuantizedRows,
    nrows: usize,
    shift: u32,
    scales: &[f32],
    zero: impl Fn(usize) -> u8,
    mut out: impl FnMut(usize, f32),
) {
    let groups = rows.groups;
    let mut totals = vec![0f32; nrows];
    for g in 0..groups {
        let blk = g >> shift;
        let z = zero(blk) as i32;
        // Group g's 16 bytes, low nibble first.
        let bytes = &src[g * GROUP / 2..(g + 1) * GROUP / 2];
        let w: [i32; GROUP] =
            std::array::from_fn(|e| ((bytes[e / 2] >> (4 * (e % 2))) & 15) as i32 - z);
        for (r, total) in totals.iter_mut().enumerate() {
            let pairs = &rows.pairs[(r * groups + g) * 16..(r * groups + g + 1) * 16];
            let mut sum = 0i32;
            for (w, &p) in w.chunks_exact(2).zip(pairs) {
                let (x0, x1) = (p as i16 as i32, (p >> 16) as i16 as i32);
                sum += w[0] * x0 + w[1] * x1;
            }
            *total += sum as f32 * (rows.scales[r * groups + g] * scales[blk]);
        }
    }
    for (r, total) in totals.into_iter().enumerate() {
        out(r, total);
    }
}

impl Params<'_> {
    /// Columns `cols` of a prompt with 4-bit weights and integer zero points into `block`
    /// (`[rows, cols.len()]`), the rows as 16-bit integers: eight columns at a time, their
    /// weights less their zero points widened to 16-bit pairs once and multiplied with every
    /// row eight products an instruction (`kernels::q4_prompt8`), the rest a column at a time.
    fn q4_prompt(
        &self,
        cols: std::ops::Range<usize>,
        b: &[u8],
        prompt: &QuantizedRows,
        rows: usize,
        block: &mut [f32],
    ) {
        let shift = (self.bs / GROUP).trailing_zeros();
        let (blocks, bytes) = (self.blocks, self.blocks * self.blob);
        let width = cols.len();
        let src = |col: usize| &b[col * bytes..(col + 1) * bytes];
        let scales = |col: usize| &self.scales[col * blocks..(col + 1) * blocks];
        let mut wide = vec![];
        let mut first = cols.start;
        while first + PROMPT_COLS <= cols.end {
            let eight: [usize; PROMPT_COLS] = std::array::from_fn(|c| first + c);
            let at = first - cols.start;
            let (src, scales) = (eight.map(src), eight.map(scales));
            match self.zp {
                Zero::Default => kernels::q4_prompt8(
                    src,
                    scales,
                    prompt,
                    rows,
                    shift,
                    |_, _| 8,
                    &mut wide,
                    block,
                    width,
                    at,
                ),
                _ => kernels::q4_prompt8(
                    src,
                    scales,
                    prompt,
                    rows,
                    shift,
                    |c, blk| self.zero(eight[c], blk) as u8,
                    &mut wide,
                    block,
                    width,
                    at,
                ),
            }
            first += PROMPT_COLS;
        }
        for col in first..cols.end {
            let at = col - cols.start;
            let zero = |blk: usize| self.zero(col, blk) as u8;
            let out = |r: usize, v: f32| block[r * width + at] = v;
            q4_prompt_column(src(col), prompt, rows, shift, scales(col), zero, out);
        }
    }

    /// `kernels::q4_lanes_i16` of the pass from column `first` with `M` rows, this weight's
    /// zero points.
    fn lanes_rows<const M: usize>(
        &self,
        pass: &[u8],
        rows: [&QuantizedRow; M],
        shift: u32,
        scales: &[f32],
        first: usize,
    ) -> [[f32; PASS]; M] {
        match self.zp {
            Zero::Default => kernels::q4_lanes_i16(pass, rows, shift, scales, |_, _| 8),
            _ => kernels::q4_lanes_i16(pass, rows, shift, scales, |c, blk| {
                self.zero(first + c, blk) as u8
            }),
        }
    }

    /// The bytes of the pass in lanes ([`to_lanes`]) that holds column `col`.
    fn pass<'b>(&self, b: &'b [u8], col: usize) -> &'b [u8] {
        let bytes = PASS * self.blocks * self.blob;
        &b[col / PASS * bytes..(col / PASS + 1) * bytes]
    }

    /// The scales of the pass in lanes that holds column `col`, `[blocks, 16]`.
    fn pass_scales(&self, col: usize) -> &[f32] {
        let len = PASS * self.blocks;
        &self.scales[col / PASS * len..(col / PASS + 1) * len]
    }

    /// The quad of columns `first..first + 4` (`first` a multiple of 4) in lanes, as f32
    /// (`[4, padded]`): `(q - zero) * scale`, as [`Params::dequantize`]. (For rows that are not
    /// finite: the decoding kernel takes every other row in lanes.)
    fn dequantize_quad(&self, first: usize, b: &[u8], w: &mut [f32]) {
        let (pass, scales) = (self.pass(b, first), self.pass_scales(first));
        let padded = self.blocks * self.bs;
        for (col, w) in (first..first + 4).zip(w.chunks_exact_mut(padded)) {
            let c = col % PASS;
            for (blk, w) in w.chunks_exact_mut(self.bs).enumerate() {
                let (zero, scale) = (self.zero(col, blk), scales[blk * PASS + c]);
                for (i, w) in w.iter_mut().enumerate() {
                    *w = (lane_value(pass, c, blk * self.bs + i) as f32 - zero) * scale;
                }
            }
        }
    }

    /// The zero point of block `blk` of column `col`.
    #[inline(always)]
    fn zero(&self, col: usize, blk: usize) -> f32 {
        match self.zp {
            Zero::Default => (1u32 << (self.bits - 1)) as f32,
            Zero::Float(z) => z[col * self.blocks + blk],
            Zero::Packed(z) => {
                let bit = blk * self.bits;
                let byte = z[col * self.zp_blob + bit / 8];
                ((byte >> (bit % 8)) & ((1u16 << self.bits) - 1) as u8) as f32
            }
        }
    }

    /// [`Params::column_dot`] of columns `cols` with the 16-bit row
    /// (`kernels::q4_columns4_i16`): `None` without it.
    fn columns4_dot(&self, cols: [usize; 4], b: &[u8]) -> Option<[f32; 4]> {
        let row = self.quantized?.first()?;
        let shift = (self.bs / GROUP).trailing_zeros();
        let (blocks, bytes) = (self.blocks, self.blocks * self.blob);
        let mut src = [&b[..0]; 4];
        let mut scales = [&self.scales[..0]; 4];
        for (c, &col) in cols.iter().enumerate() {
            src[c] = b.get(col * bytes..(col + 1) * bytes)?;
            scales[c] = self.scales.get(col * blocks..(col + 1) * blocks)?;
        }
        match self.zp {
            Zero::Default => Some(kernels::q4_columns4_i16(src, row, shift, scales, |_, _| 8)),
            Zero::Packed(_) => Some(kernels::q4_columns4_i16(
                src,
                row,
                shift,
                scales,
                |c, blk| self.zero(cols[c], blk) as u8,
            )),
            Zero::Float(_) => None,
        }
    }

    /// `sum_k x[k] * w[col, k]`, `x` padded (and permuted for 4 bits).
    fn column_dot(&self, col: usize, b: &[u8], x: &[f32]) -> f32 {
        let base = col * self.blocks;
        let src = &b[base * self.blob..(base + self.blocks) * self.blob];
        let scales = &self.scales[base..base + self.blocks];
        if let Some(row) = self.quantized.and_then(|q| q.first()) {
            // Groups per block, as a shift (`bs` is a power of two from 32).
            let shift = (self.bs / GROUP).trailing_zeros();
            match self.zp {
                Zero::Default => {
                    return kernels::q4_column_i16(src, row, shift, scales, |_| 8);
                }
                Zero::Packed(_) => {
                    return kernels::q4_column_i16(src, row, shift, scales, |blk| {
                        self.zero(col, blk) as u8
                    })
                }
                Zero::Float(_) => {}
            }
        }
        if self.bits == 4 && self.bs >= GROUP {
            // The default zero point as a constant, so the kernel inlines it: through
            // `Params::zero`, a call per block, q4 SmolLM2 decoded at 24.6 tok/s in Node
            // instead of 40.7.
            match self.zp {
                Zero::Default => return kernels::q4_column(src, x, self.bs, scales, |_| 8),
                Zero::Packed(_) => {
                    return kernels::q4_column(src, x, self.bs, scales, |blk| {
                        self.zero(col, blk) as u8
                    })
                }
                Zero::Float(_) => {}
            }
        }
        let mut total = 0f32;
        for blk in 0..self.blocks {
            let src = &src[blk * self.blob..(blk + 1) * self.blob];
            let xs = &x[blk * self.bs..(blk + 1) * self.bs];
            let zero = self.zero(col, blk);
            total += if self.bits == 4 {
                q4_dot_any(src, xs, zero, self.bs.min(GROUP)) * scales[blk]
            } else {
                q8_dot(src, xs, zero) * scales[blk]
            };
        }
        total
    }

    /// Column `col` as f32 into `w` (padded, and permuted for 4 bits).
    fn dequantize(&self, col: usize, b: &[u8], w: &mut [f32]) {
        let base = col * self.blocks;
        let src = &b[base * self.blob..(base + self.blocks) * self.blob];
        let scales = &self.scales[base..base + self.blocks];
        // The default zero point as a constant, as in `column_dot`.
        let zero = |blk: usize| self.zero(col, blk);
        match (self.bits, self.zp) {
            (4, Zero::Default) if self.bs >= GROUP => {
                kernels::dequantize_q4(src, self.bs, scales, |_| 8.0, w)
            }
            (4, _) if self.bs >= GROUP => kernels::dequantize_q4(src, self.bs, scales, zero, w),
            (4, _) => {
                for (blk, (src, dst)) in src
                    .chunks_exact(self.blob)
                    .zip(w.chunks_exact_mut(self.bs))
                    .enumerate()
                {
                    dequantize_q4_any(src, zero(blk), scales[blk], dst, self.bs);
                }
            }
            _ => kernels::dequantize_q8(src, self.bs, scales, zero, w),
        }
    }
}

/// One 4-bit block of groups of `group` elements as f32, `(q - zero) * scale`: each group's
/// low nibbles (its even elements), then its high nibbles (the order of the permuted `A`).
fn dequantize_q4_any(src: &[u8], zero: f32, scale: f32, dst: &mut [f32], group: usize) {
    let half = group / 2;
    for (bytes, d) in src.chunks(half).zip(dst.chunks_mut(group)) {
        let (lo, hi) = d.split_at_mut(half);
        for ((byte, l), h) in bytes.iter().zip(lo).zip(hi) {
            *l = ((byte & 0x0f) as f32 - zero) * scale;
            *h = ((byte >> 4) as f32 - zero) * scale;
        }
    }
}

/// `sum (q - zero) * x` over one 4-bit block of groups of `group` elements (any group size,
/// any zero point).
fn q4_dot_any(src: &[u8], x: &[f32], zero: f32, group: usize) -> f32 {
    let half = group / 2;
    let mut acc = 0f32;
    for (bytes, xs) in src.chunks(half).zip(x.chunks(group)) {
        let (lo, hi) = xs.split_at(half);
        for ((byte, l), h) in bytes.iter().zip(lo).zip(hi) {
            acc += ((byte & 0x0f) as f32 - zero) * l + ((byte >> 4) as f32 - zero) * h;
        }
    }
    acc
}

/// `sum (q - zero) * x` over one 8-bit block.
fn q8_dot(src: &[u8], x: &[f32], zero: f32) -> f32 {
    let mut acc = [0f32; 8];
    for (bytes, xs) in src.chunks_exact(8).zip(x.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += (bytes[i] as f32 - zero) * xs[i];
        }
    }
    acc.iter().sum()
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod kernels {
    use super::{GROUP, PASS};

    /// Eight columns of a prompt ([`super::Params::q4_prompt`]): each column by the portable
    /// kernel, `q4_prompt_column`, into columns `at..at + 8` of `out` (`[nrows, width]`).
    /// (`_wide` is the simd128 kernel's buffer of widened weights, which this one needs not.)
    #[allow(clippy::too_many_arguments)]
    pub fn q4_prompt8(
        src: [&[u8]; super::PROMPT_COLS],
        scales: [&[f32]; super::PROMPT_COLS],
        rows: &super::QuantizedRows,
        nrows: usize,
        shift: u32,
        zero: impl Fn(usize, usize) -> u8,
        _wide: &mut Vec<[i32; 4]>,
        out: &mut [f32],
        width: usize,
        at: usize,
    ) {
        for (c, (src, scales)) in src.into_iter().zip(scales).enumerate() {
            let zero = |blk: usize| zero(c, blk);
            super::q4_prompt_column(src, rows, nrows, shift, scales, zero, |r, v| {
                out[r * width + at + c] = v
            });
        }
    }

    /// [`q4_columns4_i16`] of a pass of sixteen columns in lanes (`super::to_lanes`; its
    /// scales `[blocks, 16]`, the rows in their own order) for each of `rows`: the same integer
    /// sums, f32 operations and order, so the same bits.
    pub fn q4_lanes_i16<const M: usize>(
        pass: &[u8],
        rows: [&super::QuantizedRow; M],
        shift: u32,
        scales: &[f32],
        zero: impl Fn(usize, usize) -> u8,
    ) -> [[f32; PASS]; M] {
        rows.map(|row| q4_lanes_row(pass, row, shift, scales, &zero))
    }

    /// [`q4_lanes_i16`] of one row.
    fn q4_lanes_row(
        pass: &[u8],
        row: &super::QuantizedRow,
        shift: u32,
        scales: &[f32],
        zero: impl Fn(usize, usize) -> u8,
    ) -> [f32; PASS] {
        let mut total = [0f32; PASS];
        let groups = pass.chunks_exact(PASS * GROUP / 2);
        for (g, (group, x)) in groups.zip(row.q.chunks_exact(GROUP)).enumerate() {
            let blk = g >> shift;
            // sums[i][s]: column 4s + i's, from bits 4s..4s + 4 of lanes 2i and 2i + 1.
            let mut sums = [[0i32; 4]; 4];
            for (vector, x) in group.chunks_exact(16).zip(x.chunks_exact(2)) {
                for (l, lane) in vector.chunks_exact(2).enumerate() {
                    let lane = u16::from_le_bytes([lane[0], lane[1]]) ^ 0x8000;
                    let x = x[l % 2] as i32;
                    for (s, sum) in sums[l / 2].iter_mut().enumerate() {
                        *sum += ((lane >> (4 * s)) & 15) as i32 * x;
                    }
                }
            }
            for (c, total) in total.iter_mut().enumerate() {
                let sum = sums[c % 4][c / 4] - zero(c, blk) as i32 * row.sums[g];
                *total += sum as f32 * (row.scales[g] * scales[blk * PASS + c]);
            }
        }
        total
    }

    /// The largest magnitude of a group of `x` (`QuantizedRow::of`); `None` when a value is
    /// not finite.
    pub fn max_abs(group: &[f32; GROUP]) -> Option<f32> {
        // A comparison, not `f32::max` (a call to fmaxf in wasm).
        let max = group
            .iter()
            .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        (max.is_finite() && !group.iter().any(|v| v.is_nan())).then_some(max)
    }

    /// A group of `x` rounded to 16-bit integers, `x * inv` (ties to even, within +-32767), in
    /// the kernel's order (`super::q4_order`) or in their own; returns their sum.
    pub fn quantize_group(
        group: &[f32; GROUP],
        inv: f32,
        out: &mut [i16; GROUP],
        nibble_order: bool,
    ) -> i32 {
        let mut sum = 0;
        for (e, x) in group.iter().enumerate() {
            // Ties to even: one `f32.nearest` in wasm (`round` is a call to roundf). A NaN
            // (`0 * inv` where `inv` overflowed) becomes 0.
            let v = (x * inv).round_ties_even().clamp(-32767.0, 32767.0) as i16;
            out[if nibble_order { super::q4_order(e) } else { e }] = v;
            sum += v as i32;
        }
        sum
    }

    /// One column of 4-bit blocks of `bs` (whole groups of 32) as f32, `(q - zero) * scale`
    /// (`super::dequantize_q4_any` block by block).
    pub fn dequantize_q4(
        src: &[u8],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> f32,
        dst: &mut [f32],
    ) {
        let blocks = src.chunks_exact(bs / 2).zip(dst.chunks_exact_mut(bs));
        for (blk, (src, dst)) in blocks.enumerate() {
            super::dequantize_q4_any(src, zero(blk), scales[blk], dst, GROUP);
        }
    }

    /// One column of 8-bit blocks of `bs` as f32, `(q - zero) * scale`.
    pub fn dequantize_q8(
        src: &[u8],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> f32,
        dst: &mut [f32],
    ) {
        for (blk, (src, dst)) in src
            .chunks_exact(bs)
            .zip(dst.chunks_exact_mut(bs))
            .enumerate()
        {
            let (zero, scale) = (zero(blk), scales[blk]);
            for (d, byte) in dst.iter_mut().zip(src) {
                *d = (*byte as f32 - zero) * scale;
            }
        }
    }

    /// `sum_k x[k] * w[k]` over one column of 4-bit blocks of `bs` (whole groups of 32, `x`
    /// permuted to the nibble order), integer zero points. Written so that LLVM vectorizes
    /// it: 16 independent lanes per nibble half; each block's sums are scaled once.
    pub fn q4_column(
        src: &[u8],
        x: &[f32],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> u8,
    ) -> f32 {
        let mut total = [0f32; 16];
        for (blk, (bytes, xs)) in src.chunks_exact(bs / 2).zip(x.chunks_exact(bs)).enumerate() {
            let z = zero(blk) as i16;
            let mut lo_acc = [0f32; 16];
            let mut hi_acc = [0f32; 16];
            for (bytes, xs) in bytes.chunks_exact(GROUP / 2).zip(xs.chunks_exact(GROUP)) {
                for i in 0..16 {
                    let byte = bytes[i];
                    lo_acc[i] += ((byte & 0x0f) as i16 - z) as f32 * xs[i];
                    hi_acc[i] += ((byte >> 4) as i16 - z) as f32 * xs[16 + i];
                }
            }
            let scale = scales[blk];
            for i in 0..16 {
                total[i] += (lo_acc[i] + hi_acc[i]) * scale;
            }
        }
        total.iter().sum()
    }

    /// `sum_k x[k] * w[k]` over one column of 4-bit blocks (whole groups of 32) with `x` as
    /// 16-bit integers (`QuantizedRow`), blocks of `32 << shift` values, integer zero points.
    /// Per group, the integer sum of its products less `zero * sums` (exact, and under 2^24 in
    /// magnitude, so exact in f32 too), converted and multiplied by the group's scale times
    /// the block's, then added to the total. The same f32 operations in the same order as the
    /// simd128 kernels, so all give the same bits.
    pub fn q4_column_i16(
        src: &[u8],
        row: &super::QuantizedRow,
        shift: u32,
        scales: &[f32],
        zero: impl Fn(usize) -> u8,
    ) -> f32 {
        let mut total = 0f32;
        for (g, bytes) in src.chunks_exact(GROUP / 2).enumerate() {
            let blk = g >> shift;
            let x = &row.q[g * GROUP..(g + 1) * GROUP];
            let mut sum = 0i32;
            for (e, byte) in bytes.iter().enumerate() {
                let (lo, hi) = ((byte & 0x0f) as i32, (byte >> 4) as i32);
                sum += lo * x[super::q4_order(2 * e)] as i32
                    + hi * x[super::q4_order(2 * e + 1)] as i32;
            }
            let sum = sum - zero(blk) as i32 * row.sums[g];
            total += sum as f32 * (row.scales[g] * scales[blk]);
        }
        total
    }

    /// [`q4_column_i16`] for four columns; `zero(c, blk)` is column `c`'s zero point.
    pub fn q4_columns4_i16(
        src: [&[u8]; 4],
        row: &super::QuantizedRow,
        shift: u32,
        scales: [&[f32]; 4],
        zero: impl Fn(usize, usize) -> u8,
    ) -> [f32; 4] {
        [0, 1, 2, 3].map(|c| q4_column_i16(src[c], row, shift, scales[c], |blk| zero(c, blk)))
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use core::arch::wasm32::*;

    use super::{GROUP, PASS};

    /// The portable `max_abs` with simd128: the same value (a maximum does not depend on the
    /// order).
    pub fn max_abs(group: &[f32; GROUP]) -> Option<f32> {
        let p = group.as_ptr() as *const v128;
        let (mut max, mut nan) = (f32x4_splat(0.0), i32x4_splat(0));
        for j in 0..GROUP / 4 {
            // SAFETY: values 4j..4j + 4 of the group; v128_load accepts unaligned addresses.
            let x = unsafe { v128_load(p.add(j)) };
            max = f32x4_pmax(max, f32x4_abs(x));
            nan = v128_or(nan, f32x4_ne(x, x));
        }
        let lanes = [
            f32x4_extract_lane::<0>(max),
            f32x4_extract_lane::<1>(max),
            f32x4_extract_lane::<2>(max),
            f32x4_extract_lane::<3>(max),
        ];
        let max = lanes
            .into_iter()
            .fold(0f32, |m, v| if v > m { v } else { m });
        (max.is_finite() && !v128_any_true(nan)).then_some(max)
    }

    /// The portable `quantize_group` with simd128, the same integers: the values rounded four
    /// at a time, then the eight i32x4 narrowed, and for the kernel's order transposed by
    /// shuffles (lane `j` of output vector `r` is value `4j + r`).
    ///
    /// With `inv` finite (`32767 / max` of the group's largest magnitude `max`), each `x * inv`
    /// is within 32767 (and a rounding or two) and is rounded by adding 1.5 * 2^23: the sum lies
    /// in [2^23, 2^24), whose f32 are the integers, so the addition rounds it to the nearest
    /// integer, ties to even as `f32.nearest` (1.5 * 2^23 is even), and its bits less those of
    /// 1.5 * 2^23 are that integer: an addition and a subtraction for `f32x4.nearest` and
    /// `i32x4.trunc_sat_f32x4_s` (a q4 SmolLM2 step's rows, 3,264 values a layer, in
    /// 0.025-0.040 ms against 0.045-0.062 in a wasm benchmark, Node 20, a 2-core Intel Xeon).
    /// An infinite `inv` (`max` below 32767 / `f32::MAX`) takes those two: a NaN (`0 * inv`)
    /// converts to 0 and an infinity saturates before the clamp.
    pub fn quantize_group(
        group: &[f32; GROUP],
        inv: f32,
        out: &mut [i16; GROUP],
        nibble_order: bool,
    ) -> i32 {
        const MAGIC: f32 = 12_582_912.0;
        let p = group.as_ptr() as *const v128;
        let finite = inv.is_finite();
        let (inv, lo, hi) = (f32x4_splat(inv), i32x4_splat(-32767), i32x4_splat(32767));
        let (magic, magic_bits) = (f32x4_splat(MAGIC), i32x4_splat(MAGIC.to_bits() as i32));
        // SAFETY: values 4j..4j + 4 of the group.
        let x = |j: usize| f32x4_mul(unsafe { v128_load(p.add(j)) }, inv);
        let clamp = |r: v128| i32x4_min(i32x4_max(r, lo), hi);
        let v: [v128; 8] = if finite {
            core::array::from_fn(|j| clamp(i32x4_sub(f32x4_add(x(j), magic), magic_bits)))
        } else {
            core::array::from_fn(|j| clamp(i32x4_trunc_sat_f32x4(f32x4_nearest(x(j)))))
        };
        let total = v.iter().fold(i32x4_splat(0), |t, v| i32x4_add(t, *v));
        let total = i32x4_add(total, i32x4_shuffle::<2, 3, 0, 1>(total, total));
        let total = i32x4_add(total, i32x4_shuffle::<1, 0, 3, 2>(total, total));
        // n[a]: values 8a..8a + 8.
        let n: [v128; 4] = core::array::from_fn(|a| i16x8_narrow_i32x4(v[2 * a], v[2 * a + 1]));
        let o = out.as_mut_ptr() as *mut v128;
        if !nibble_order {
            for (a, n) in n.into_iter().enumerate() {
                // SAFETY: values 8a..8a + 8 of the 32 of `out`.
                unsafe { v128_store(o.add(a), n) };
            }
            return i32x4_extract_lane::<0>(total);
        }
        // Values r and r + 1 of each four of two n's: half of output vector r, half of r + 1.
        let p01 = i16x8_shuffle::<0, 4, 8, 12, 1, 5, 9, 13>(n[0], n[1]);
        let q01 = i16x8_shuffle::<2, 6, 10, 14, 3, 7, 11, 15>(n[0], n[1]);
        let p23 = i16x8_shuffle::<0, 4, 8, 12, 1, 5, 9, 13>(n[2], n[3]);
        let q23 = i16x8_shuffle::<2, 6, 10, 14, 3, 7, 11, 15>(n[2], n[3]);
        let rows = [
            i64x2_shuffle::<0, 2>(p01, p23),
            i64x2_shuffle::<1, 3>(p01, p23),
            i64x2_shuffle::<0, 2>(q01, q23),
            i64x2_shuffle::<1, 3>(q01, q23),
        ];
        for (r, row) in rows.into_iter().enumerate() {
            // SAFETY: values 8r..8r + 8 of the 32 of `out`.
            unsafe { v128_store(o.add(r), row) };
        }
        i32x4_extract_lane::<0>(total)
    }

    /// Sixteen bytes as f32, `(q - zero) * scale`, into `dst[0..16]`: the portable kernel's
    /// operations (`q` and `zero` are exact in f32), so the same bits.
    ///
    /// # Safety
    /// `dst..dst + 16` must be writable.
    #[inline(always)]
    unsafe fn dequantize16(q: v128, zero: v128, scale: v128, dst: *mut f32) {
        let (q0, q1) = (u16x8_extend_low_u8x16(q), u16x8_extend_high_u8x16(q));
        let q = [
            u32x4_extend_low_u16x8(q0),
            u32x4_extend_high_u16x8(q0),
            u32x4_extend_low_u16x8(q1),
            u32x4_extend_high_u16x8(q1),
        ];
        for (j, q) in q.into_iter().enumerate() {
            let w = f32x4_mul(f32x4_sub(f32x4_convert_i32x4(q), zero), scale);
            v128_store(dst.add(4 * j) as *mut v128, w);
        }
    }

    /// One column of 4-bit blocks of `bs` (whole groups of 32) as f32 with simd128, in the
    /// portable kernel's order and bits: 16 bytes a group, low nibbles then high nibbles.
    /// Dequantizing a prompt's weights one byte at a time (and one call per block of 32) took
    /// a third of q4 SmolLM2's prompt products.
    pub fn dequantize_q4(
        src: &[u8],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> f32,
        dst: &mut [f32],
    ) {
        let blocks = src.len() / (bs / 2);
        let groups = bs / GROUP;
        assert!(
            blocks <= scales.len() && dst.len() >= blocks * bs && bs.is_multiple_of(GROUP),
            "dequantize_q4: {} bytes, {} scales, {} values, blocks of {bs}",
            src.len(),
            scales.len(),
            dst.len()
        );
        let mask = u8x16_splat(0x0f);
        for (blk, &scale) in scales[..blocks].iter().enumerate() {
            let (zero, scale) = (f32x4_splat(zero(blk)), f32x4_splat(scale));
            for g in blk * groups..(blk + 1) * groups {
                // SAFETY: group g reads src[16g..16g+16] and writes dst[32g..32g+32], in
                // bounds (asserted above); v128_load and v128_store accept unaligned addresses.
                unsafe {
                    let v = v128_load(src.as_ptr().add(g * GROUP / 2) as *const v128);
                    let d = dst.as_mut_ptr().add(g * GROUP);
                    dequantize16(v128_and(v, mask), zero, scale, d);
                    dequantize16(u8x16_shr(v, 4), zero, scale, d.add(GROUP / 2));
                }
            }
        }
    }

    /// One column of 8-bit blocks of `bs` (a multiple of 16) as f32 with simd128.
    pub fn dequantize_q8(
        src: &[u8],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> f32,
        dst: &mut [f32],
    ) {
        let blocks = src.len() / bs;
        assert!(
            blocks <= scales.len() && dst.len() >= blocks * bs && bs.is_multiple_of(16),
            "dequantize_q8: {} bytes, {} scales, {} values, blocks of {bs}",
            src.len(),
            scales.len(),
            dst.len()
        );
        for (blk, &scale) in scales[..blocks].iter().enumerate() {
            let (zero, scale) = (f32x4_splat(zero(blk)), f32x4_splat(scale));
            for c in blk * bs / 16..(blk + 1) * bs / 16 {
                // SAFETY: chunk c reads src[16c..16c+16] and writes dst[16c..16c+16], in
                // bounds (asserted above).
                unsafe {
                    let v = v128_load(src.as_ptr().add(c * 16) as *const v128);
                    dequantize16(v, zero, scale, dst.as_mut_ptr().add(c * 16));
                }
            }
        }
    }

    /// `sum_k x[k] * w[k]` over one column of 4-bit blocks of `bs` (whole groups of 32, `x`
    /// permuted to the nibble order), integer zero points, with simd128: 16 bytes give 32
    /// weights, dequantized in registers; each block's sums are scaled once.
    pub fn q4_column(
        src: &[u8],
        x: &[f32],
        bs: usize,
        scales: &[f32],
        zero: impl Fn(usize) -> u8,
    ) -> f32 {
        let blocks = src.len() / (bs / 2);
        assert!(blocks * bs <= x.len() && blocks <= scales.len() && bs.is_multiple_of(GROUP));
        let groups = bs / GROUP;
        let mask = u8x16_splat(0x0f);
        let mut total = [f32x4_splat(0.0); 4];
        for (blk, &scale) in scales[..blocks].iter().enumerate() {
            let z = u8x16_splat(zero(blk));
            let mut acc = [f32x4_splat(0.0); 4];
            for g in blk * groups..(blk + 1) * groups {
                // SAFETY: group g covers src[16g..16g+16] and x[32g..32g+32], in bounds
                // (checked above); v128_load accepts unaligned addresses.
                unsafe {
                    let v = v128_load(src.as_ptr().add(g * 16) as *const v128);
                    let xp = x.as_ptr().add(g * 32);
                    let lo = i8x16_sub(v128_and(v, mask), z);
                    let hi = i8x16_sub(u8x16_shr(v, 4), z);
                    for (h, q) in [lo, hi].into_iter().enumerate() {
                        let q0 = i16x8_extend_low_i8x16(q);
                        let q1 = i16x8_extend_high_i8x16(q);
                        let w = [
                            f32x4_convert_i32x4(i32x4_extend_low_i16x8(q0)),
                            f32x4_convert_i32x4(i32x4_extend_high_i16x8(q0)),
                            f32x4_convert_i32x4(i32x4_extend_low_i16x8(q1)),
                            f32x4_convert_i32x4(i32x4_extend_high_i16x8(q1)),
                        ];
                        for (j, w) in w.into_iter().enumerate() {
                            let xv = v128_load(xp.add(h * 16 + j * 4) as *const v128);
                            acc[j] = f32x4_add(acc[j], f32x4_mul(w, xv));
                        }
                    }
                }
            }
            let scale = f32x4_splat(scale);
            for j in 0..4 {
                total[j] = f32x4_add(total[j], f32x4_mul(acc[j], scale));
            }
        }
        let s = f32x4_add(f32x4_add(total[0], total[1]), f32x4_add(total[2], total[3]));
        f32x4_extract_lane::<0>(s)
            + f32x4_extract_lane::<1>(s)
            + f32x4_extract_lane::<2>(s)
            + f32x4_extract_lane::<3>(s)
    }

    /// A group's 16 bytes of one column times its 32 values of `x` (`QuantizedRow`, four
    /// i16x8): the bytes read as eight 16-bit lanes, whose four nibbles a mask and shifts by 4,
    /// 8 and 12 bits separate into four i16x8 (no widening of bytes, no zero point subtracted
    /// from each weight), which meet `x` in four `i32x4.dot_i16x8_s`: four partial sums.
    #[inline(always)]
    fn group_dots(v: v128, x: &[v128; 4]) -> v128 {
        let mask = u16x8_splat(0x000f);
        let n0 = v128_and(v, mask);
        let n1 = v128_and(u16x8_shr(v, 4), mask);
        let n2 = v128_and(u16x8_shr(v, 8), mask);
        let n3 = u16x8_shr(v, 12);
        i32x4_add(
            i32x4_add(i32x4_dot_i16x8(n0, x[0]), i32x4_dot_i16x8(n1, x[1])),
            i32x4_add(i32x4_dot_i16x8(n2, x[2]), i32x4_dot_i16x8(n3, x[3])),
        )
    }

    /// A volatile store of `v` into `slot`, which orders V8's code for a loop: its optimising
    /// compiler loads a loop's weights from linear memory in program order ahead of the
    /// arithmetic (loads are in its chain of effects, the arithmetic is placed where it is
    /// used), and in `q4_columns4_i16` the four columns' weights and the row's four vectors
    /// were all loaded at the top of the loop: with each column's nibbles, more vectors than
    /// x86-64's sixteen registers, and 25 of the loop's 134 instructions moved vectors to and
    /// from the stack (`node --print-wasm-code`, Node 20). A store between two columns'
    /// arithmetic and the next two columns' loads keeps those loads after it: 1 of 111. In a
    /// wasm benchmark of q4 SmolLM2's 106 M weights (a 2-core AMD EPYC, best of 20) 6.4-6.5 ms
    /// a row against 8.1-8.2, the same sums.
    #[inline(always)]
    fn fence(slot: &mut v128, v: v128) {
        // SAFETY: `slot` is a valid, aligned v128.
        unsafe { core::ptr::write_volatile(slot, v) }
    }

    /// Lanes 0 and 1 the halves of `x`'s sum, 2 and 3 those of `y`'s (of their four lanes).
    #[inline(always)]
    fn pair_sums(x: v128, y: v128) -> v128 {
        i32x4_add(
            i32x4_shuffle::<0, 4, 1, 5>(x, y),
            i32x4_shuffle::<2, 6, 3, 7>(x, y),
        )
    }

    /// Lane `c` the sum of vector `c`'s four lanes, from `a = pair_sums(v0, v1)` and
    /// `b = pair_sums(v2, v3)`.
    #[inline(always)]
    fn halves_sum(a: v128, b: v128) -> v128 {
        i32x4_add(
            i32x4_shuffle::<0, 1, 4, 5>(a, b),
            i32x4_shuffle::<2, 3, 6, 7>(a, b),
        )
    }

    /// Group `g`'s 32 values of `x` (`QuantizedRow`) as four i16x8.
    ///
    /// # Safety
    /// `row.q[32 g..32 g + 32]` must be in bounds.
    #[inline(always)]
    unsafe fn group_values(row: &super::QuantizedRow, g: usize) -> [v128; 4] {
        let xp = row.q.as_ptr().add(g * GROUP) as *const v128;
        [0, 1, 2, 3].map(|i| v128_load(xp.add(i)))
    }

    /// The bounds that the kernels' unchecked reads rely on.
    fn check(
        groups: usize,
        src: &[&[u8]],
        row: &super::QuantizedRow,
        shift: u32,
        scales: &[&[f32]],
    ) {
        assert!(
            src.iter().all(|s| s.len() >= groups * (GROUP / 2))
                && groups * GROUP <= row.q.len()
                && groups <= row.sums.len()
                && groups <= row.scales.len()
                && scales
                    .iter()
                    .all(|s| (groups.saturating_sub(1) >> shift) < s.len()),
            "q4_column_i16: {groups} groups"
        );
    }

    /// [`q4_column`] with `x` as 16-bit integers (`QuantizedRow`), with simd128 (`group_dots`);
    /// the portable kernel's f32 operations, so the same bits.
    pub fn q4_column_i16(
        src: &[u8],
        row: &super::QuantizedRow,
        shift: u32,
        scales: &[f32],
        zero: impl Fn(usize) -> u8,
    ) -> f32 {
        let groups = src.len() / (GROUP / 2);
        check(groups, &[src], row, shift, &[scales]);
        let mut total = 0f32;
        for g in 0..groups {
            let blk = g >> shift;
            // SAFETY: group g covers src[16g..16g+16], row.q[32g..32g+32], row.sums[g] and
            // row.scales[g], and block blk scales[blk], in bounds (`check`); v128_load accepts
            // unaligned addresses.
            unsafe {
                let d = group_dots(
                    v128_load(src.as_ptr().add(g * 16) as *const v128),
                    &group_values(row, g),
                );
                let d = i32x4_add(d, i32x4_shuffle::<2, 3, 0, 1>(d, d));
                let d = i32x4_add(d, i32x4_shuffle::<1, 0, 3, 2>(d, d));
                let sum =
                    i32x4_extract_lane::<0>(d) - zero(blk) as i32 * *row.sums.get_unchecked(g);
                total += sum as f32 * (*row.scales.get_unchecked(g) * *scales.get_unchecked(blk));
            }
        }
        total
    }

    /// [`q4_column_i16`] for four columns at once: each group's values of `x` loaded once, the
    /// four columns' partial sums added across into one i32x4 (a column a lane), their zero
    /// points, conversion, scales and totals four columns an operation. Per 32 weights a
    /// column, about 19 operations where one column at a time took 36 (its f32 work and zero
    /// point were per column and group): q4 SmolLM2 decoded at 30.0-31.3 ms a token in Node
    /// against 36.0-39.1. One flat loop over the groups: nested loops over the blocks and their
    /// groups (a runtime count of one for blocks of 32) compiled in V8 to a loop that rebuilt
    /// its constants and reloaded spilled registers every group (4.4 G weights/s against 10.6).
    pub fn q4_columns4_i16(
        src: [&[u8]; 4],
        row: &super::QuantizedRow,
        shift: u32,
        scales: [&[f32]; 4],
        zero: impl Fn(usize, usize) -> u8,
    ) -> [f32; 4] {
        let groups = src[0].len() / (GROUP / 2);
        check(groups, &src, row, shift, &scales);
        let mut total = f32x4_splat(0.0);
        let mut slot = i32x4_splat(0);
        for g in 0..groups {
            let blk = g >> shift;
            // SAFETY: as in `q4_column_i16`, for each of the four columns.
            unsafe {
                let x = group_values(row, g);
                let dots = |c: usize| {
                    group_dots(v128_load(src[c].as_ptr().add(g * 16) as *const v128), &x)
                };
                // Lane c: the sum of column c's four partial sums.
                let a = pair_sums(dots(0), dots(1));
                fence(&mut slot, a);
                let b = pair_sums(dots(2), dots(3));
                let sums = halves_sum(a, b);
                let zeros = i32x4(
                    zero(0, blk) as i32,
                    zero(1, blk) as i32,
                    zero(2, blk) as i32,
                    zero(3, blk) as i32,
                );
                let sums = i32x4_sub(
                    sums,
                    i32x4_mul(zeros, i32x4_splat(*row.sums.get_unchecked(g))),
                );
                let block_scales = f32x4(
                    *scales[0].get_unchecked(blk),
                    *scales[1].get_unchecked(blk),
                    *scales[2].get_unchecked(blk),
                    *scales[3].get_unchecked(blk),
                );
                let factor = f32x4_mul(f32x4_splat(*row.scales.get_unchecked(g)), block_scales);
                total = f32x4_add(total, f32x4_mul(f32x4_convert_i32x4(sums), factor));
            }
        }
        [
            f32x4_extract_lane::<0>(total),
            f32x4_extract_lane::<1>(total),
            f32x4_extract_lane::<2>(total),
            f32x4_extract_lane::<3>(total),
        ]
    }

    /// [`q4_columns4_i16`] of a pass of sixteen columns in lanes (`super::to_lanes`; its
    /// scales `[blocks, 16]`, the row in its own order). A vector's four i32 lanes, each the
    /// pair of lanes `n0 + 16 n1 + 256 n2 + 4096 m3` of columns `i`, `i + 4`, `i + 8` and
    /// `i + 12` (`m3` the last one's value less 8, read as a signed lane), and its arithmetic
    /// shifts right by 4, 8 and 12 meet the row's pair of values (a splat) in four
    /// `i32x4.dot_i16x8_s`, whose sums over a group are `A + 16 B + 256 C + 4096 D`,
    /// `B + 16 C + 256 D`, `C + 16 D` and `D`, a column a lane: a shift and a subtraction give
    /// each column's sum (wrapping i32 arithmetic, exact since each true sum is within i32), the
    /// last already less 8 times the row's sum. No masks, and no sums across lanes: per group
    /// of 32 values of four columns about 60 operations, where four columns in each lane (the
    /// sums across lanes) took 72 and `q4_columns4_i16` 87: one row times q4 SmolLM2's weights
    /// in 4.15-4.5 ms against 5.4-5.55 (a wasm test, Node 20; no volatile store, which made it
    /// 4.4-4.6 after every vector or every second or fourth). `M` rows at once (a prompt's,
    /// `LANE_ROWS`) share each vector and its shifts. The same integer sums, f32 operations and
    /// order as the portable kernel, so the same bits.
    pub fn q4_lanes_i16<const M: usize>(
        pass: &[u8],
        rows: [&super::QuantizedRow; M],
        shift: u32,
        scales: &[f32],
        zero: impl Fn(usize, usize) -> u8,
    ) -> [[f32; PASS]; M] {
        let groups = pass.len() / (PASS * GROUP / 2);
        assert!(
            rows.iter().all(|row| groups * GROUP <= row.q.len()
                && groups <= row.sums.len()
                && groups <= row.scales.len())
                && (groups == 0 || (((groups - 1) >> shift) + 1) * PASS <= scales.len()),
            "q4_lanes_i16: {groups} groups"
        );
        let w = pass.as_ptr() as *const v128;
        // The rows' pairs of values, one u32 each.
        let xp = rows.map(|row| row.q.as_ptr() as *const u32);
        let sp = scales.as_ptr() as *const v128;
        // Row m's columns 4s..4s + 4 in total[m][s].
        let mut total = [[f32x4_splat(0.0); 4]; M];
        for g in 0..groups {
            let blk = g >> shift;
            // SAFETY: vectors 16g..16g + 16 of the pass, pairs 16g..16g + 16 of each row, the
            // rows' sums and scales at g, and the block's sixteen scales, all within the
            // asserted lengths; v128 loads are unaligned.
            unsafe {
                let mut acc = [[i32x4_splat(0); 4]; M];
                for b in 16 * g..16 * (g + 1) {
                    let v = v128_load(w.add(b));
                    let shifted = [v, i16x8_shr(v, 4), i16x8_shr(v, 8), i16x8_shr(v, 12)];
                    for (acc, xp) in acc.iter_mut().zip(&xp) {
                        let x = v128_load32_splat(xp.add(b));
                        for (acc, &v) in acc.iter_mut().zip(&shifted) {
                            *acc = i32x4_add(*acc, i32x4_dot_i16x8(v, x));
                        }
                    }
                }
                for s in 0..4 {
                    let z = |i: usize| zero(4 * s + i, blk) as i32 - if s == 3 { 8 } else { 0 };
                    let zeros = i32x4(z(0), z(1), z(2), z(3));
                    let block_scales = v128_load(sp.add(blk * 4 + s));
                    for ((total, acc), row) in total.iter_mut().zip(&acc).zip(rows) {
                        // Columns 4s..4s + 4's sums: acc[s] less 16 times acc[s + 1].
                        let sums = match s {
                            3 => acc[3],
                            _ => i32x4_sub(acc[s], i32x4_shl(acc[s + 1], 4)),
                        };
                        let row_sum = i32x4_splat(*row.sums.get_unchecked(g));
                        let sums = i32x4_sub(sums, i32x4_mul(zeros, row_sum));
                        let row_scale = f32x4_splat(*row.scales.get_unchecked(g));
                        let factor = f32x4_mul(row_scale, block_scales);
                        total[s] =
                            f32x4_add(total[s], f32x4_mul(f32x4_convert_i32x4(sums), factor));
                    }
                }
            }
        }
        total.map(|total| {
            let mut out = [0f32; PASS];
            for (four, total) in out.chunks_exact_mut(4).zip(total) {
                // SAFETY: four values; v128 stores are unaligned.
                unsafe { v128_store(four.as_mut_ptr() as *mut v128, total) };
            }
            out
        })
    }

    /// Eight columns of a prompt ([`super::Params::q4_prompt`]) into columns `at..at + 8` of
    /// `out` (`[nrows, width]`). Their weights less their zero points are widened once, each
    /// group's 16 bytes a column into 32 i16 (natural order, nibbles interleaved by a shuffle)
    /// and four columns' pairs of weights side by side in one vector (`wide`: two vectors per
    /// pair of `K`, columns 0..4 and 4..8); then `q4_prompt_rows` multiplies them with up to
    /// four rows a pass. The same integer sums and f32 operations as `q4_prompt_column`.
    #[allow(clippy::too_many_arguments)]
    pub fn q4_prompt8(
        src: [&[u8]; super::PROMPT_COLS],
        scales: [&[f32]; super::PROMPT_COLS],
        rows: &super::QuantizedRows,
        nrows: usize,
        shift: u32,
        zero: impl Fn(usize, usize) -> u8,
        wide: &mut Vec<v128>,
        out: &mut [f32],
        width: usize,
        at: usize,
    ) {
        let groups = rows.groups;
        let blocks = if groups == 0 {
            0
        } else {
            ((groups - 1) >> shift) + 1
        };
        assert!(
            src.iter().all(|s| s.len() >= groups * (GROUP / 2))
                && scales.iter().all(|s| s.len() >= blocks)
                && rows.pairs.len() >= nrows * groups * 16
                && rows.scales.len() >= nrows * groups
                && (nrows == 0 || out.len() >= (nrows - 1) * width + at + 8),
            "q4_prompt8: {groups} groups, {nrows} rows"
        );
        wide.clear();
        wide.resize(groups * 32, i32x4_splat(0));
        let low = u8x16_splat(0x0f);
        for g in 0..groups {
            let blk = g >> shift;
            for half in 0..2 {
                // Column c's pairs 4j..4j + 4 of the group as i32 lanes.
                let quads: [[v128; 4]; 4] = std::array::from_fn(|c| {
                    let col = 4 * half + c;
                    // SAFETY: bytes 16g..16g + 16 of the column, within the asserted length;
                    // v128_load accepts unaligned addresses.
                    let v = unsafe { v128_load(src[col].as_ptr().add(g * 16) as *const v128) };
                    let (lo, hi) = (v128_and(v, low), u8x16_shr(v, 4));
                    let first =
                        i8x16_shuffle::<0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23>(
                            lo, hi,
                        );
                    let second = i8x16_shuffle::<
                        8,
                        24,
                        9,
                        25,
                        10,
                        26,
                        11,
                        27,
                        12,
                        28,
                        13,
                        29,
                        14,
                        30,
                        15,
                        31,
                    >(lo, hi);
                    let z = i16x8_splat(zero(col, blk) as i16);
                    [
                        i16x8_sub(u16x8_extend_low_u8x16(first), z),
                        i16x8_sub(u16x8_extend_high_u8x16(first), z),
                        i16x8_sub(u16x8_extend_low_u8x16(second), z),
                        i16x8_sub(u16x8_extend_high_u8x16(second), z),
                    ]
                });
                for j in 0..4 {
                    let [a, b, c, d] = [0, 1, 2, 3].map(|col| quads[col][j]);
                    let t0 = i32x4_shuffle::<0, 4, 1, 5>(a, b);
                    let t1 = i32x4_shuffle::<2, 6, 3, 7>(a, b);
                    let t2 = i32x4_shuffle::<0, 4, 1, 5>(c, d);
                    let t3 = i32x4_shuffle::<2, 6, 3, 7>(c, d);
                    let pairs = [
                        i32x4_shuffle::<0, 1, 4, 5>(t0, t2),
                        i32x4_shuffle::<2, 3, 6, 7>(t0, t2),
                        i32x4_shuffle::<0, 1, 4, 5>(t1, t3),
                        i32x4_shuffle::<2, 3, 6, 7>(t1, t3),
                    ];
                    for (i, p) in pairs.into_iter().enumerate() {
                        wide[(g * 16 + 4 * j + i) * 2 + half] = p;
                    }
                }
            }
        }
        let block_scales: Vec<[v128; 2]> = (0..blocks)
            .map(|blk| {
                let s = |c: usize| scales[c][blk];
                [f32x4(s(0), s(1), s(2), s(3)), f32x4(s(4), s(5), s(6), s(7))]
            })
            .collect();
        let mut r = 0;
        while r < nrows {
            let m = 4.min(nrows - r);
            let pass = match m {
                4 => q4_prompt_rows::<4>,
                3 => q4_prompt_rows::<3>,
                2 => q4_prompt_rows::<2>,
                _ => q4_prompt_rows::<1>,
            };
            pass(
                wide,
                rows,
                r,
                shift,
                &block_scales,
                &mut out[r * width..],
                width,
                at,
            );
            r += m;
        }
    }

    /// Rows `r..r + M` of a prompt times eight widened columns (`q4_prompt8`), into columns
    /// `at..at + 8` of `out`'s first `M` rows (`width` apart): per group, two i32x4 sums a row
    /// (`i32x4.dot_i16x8_s` of a pair of weights of four columns with the row's pair), then
    /// added to the row's totals as `q4_columns4_i16` does.
    #[allow(clippy::too_many_arguments)]
    fn q4_prompt_rows<const M: usize>(
        wide: &[v128],
        rows: &super::QuantizedRows,
        r: usize,
        shift: u32,
        block_scales: &[[v128; 2]],
        out: &mut [f32],
        width: usize,
        at: usize,
    ) {
        let groups = rows.groups;
        assert!(wide.len() == groups * 32 && rows.pairs.len() >= (r + M) * groups * 16);
        assert!(rows.scales.len() >= (r + M) * groups && out.len() >= (M - 1) * width + at + 8);
        assert!(groups == 0 || ((groups - 1) >> shift) < block_scales.len());
        let mut total = [[f32x4_splat(0.0); 2]; M];
        for (g, wide) in wide.chunks_exact(32).enumerate() {
            let mut acc = [[i32x4_splat(0); 2]; M];
            for (j, w) in wide.chunks_exact(2).enumerate() {
                for (q, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: ((r + q) groups + g) 16 + j < (r + M) groups 16 (asserted).
                    let x = unsafe {
                        v128_load32_splat(
                            rows.pairs.as_ptr().add(((r + q) * groups + g) * 16 + j) as *const u32
                        )
                    };
                    acc[0] = i32x4_add(acc[0], i32x4_dot_i16x8(w[0], x));
                    acc[1] = i32x4_add(acc[1], i32x4_dot_i16x8(w[1], x));
                }
            }
            // SAFETY: g >> shift < block_scales.len() (asserted for the last group).
            let [s0, s1] = unsafe { *block_scales.get_unchecked(g >> shift) };
            for (q, (total, acc)) in total.iter_mut().zip(acc).enumerate() {
                let row_scale = f32x4_splat(rows.scales[(r + q) * groups + g]);
                total[0] = f32x4_add(
                    total[0],
                    f32x4_mul(f32x4_convert_i32x4(acc[0]), f32x4_mul(row_scale, s0)),
                );
                total[1] = f32x4_add(
                    total[1],
                    f32x4_mul(f32x4_convert_i32x4(acc[1]), f32x4_mul(row_scale, s1)),
                );
            }
        }
        for (q, total) in total.iter().enumerate() {
            let o = &mut out[q * width + at..q * width + at + 8];
            // SAFETY: o has 8 values; v128_store accepts unaligned addresses.
            unsafe {
                v128_store(o.as_mut_ptr() as *mut v128, total[0]);
                v128_store(o.as_mut_ptr().add(4) as *mut v128, total[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::check;
    use super::*;

    /// A deterministic pseudo-random stream of u32 (`testing::xorshift`).
    fn stream(seed: u64) -> impl FnMut() -> u32 {
        let mut state = super::super::testing::xorshift(seed);
        move || (state() >> 32) as u32
    }

    /// `of_rows` gives the kept rows again only for the same bits of `A`, padding and order,
    /// and otherwise rows quantized from what it is given.
    #[test]
    fn kept_rows_only_for_the_same_a() {
        let mut next = stream(0x2545_f491_4f6c_dd1d);
        let (k, padded) = (40, 64);
        let a: Vec<f32> = (0..2 * k)
            .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
            .collect();
        let first = QuantizedRow::of_rows(&a, k, padded, false).unwrap();
        assert!(Rc::ptr_eq(
            &first,
            &QuantizedRow::of_rows(&a, k, padded, false).unwrap()
        ));
        let mut nudged = a.clone();
        nudged[k + 3] = f32::from_bits(nudged[k + 3].to_bits() + 1);
        for (a, padded, order) in [
            (&nudged, padded, false),
            (&a, 96, false),
            (&a, padded, true),
        ] {
            let got = QuantizedRow::of_rows(a, k, padded, order).unwrap();
            assert!(!Rc::ptr_eq(&first, &got));
            for (row, got) in a.chunks_exact(k).zip(got.iter()) {
                let want = QuantizedRow::of(row, padded, order).unwrap();
                assert_eq!(
                    (&got.q, &got.sums, &got.scales),
                    (&want.q, &want.sums, &want.scales)
                );
            }
        }
        // A row that is not finite gives none, and is not kept.
        nudged[5] = f32::NAN;
        assert!(QuantizedRow::of_rows(&nudged, k, padded, false).is_none());
        assert!(QuantizedRow::of_rows(&nudged, k, padded, false).is_none());
    }

    /// Split across 2, 3 and 5 parts (threads under the `threads` feature), the output is
    /// bit-identical to the one-part kernel: decode (1 row) and prompts (7 rows, and 9 for the
    /// 4-bit prompt kernel, `INTEGER_PROMPT_ROWS`), 4 and 8 bits,
    /// default, packed and float zero points, a partial last block, N not a multiple of 4.
    #[test]
    fn column_split_is_bit_identical() {
        let mut next = stream(0x9e37_79b9_7f4a_7c15);
        for (bits, bs, k, n, zp_kind) in [
            (4, 32, 96, 37, 0),
            (4, 16, 80, 21, 1),
            (4, 128, 200, 18, 2),
            (8, 64, 130, 23, 1),
        ] {
            let op = NBits {
                k,
                n,
                bits,
                block_size: bs,
                zero_points: None,
                bias: None,
                inputs: 3,
                label: "test".into(),
                lanes: false,
            };
            let b: Vec<u8> = (0..n * op.blocks() * op.blob())
                .map(|_| next() as u8)
                .collect();
            let scales: Vec<f32> = (0..n * op.blocks())
                .map(|_| (next() % 1000) as f32 / 4000.0)
                .collect();
            let zp_packed: Vec<u8> = (0..n * op.zp_blob()).map(|_| next() as u8).collect();
            let zp_float: Vec<f32> = (0..n * op.blocks()).map(|_| (next() % 16) as f32).collect();
            let zp = match zp_kind {
                0 => Zero::Default,
                1 => Zero::Packed(&zp_packed),
                _ => Zero::Float(&zp_float),
            };
            for rows in [1, 7, 9] {
                let a: Vec<f32> = (0..rows * k)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut one = vec![0f32; rows * n];
                matmul_in_parts(&op, &a, rows, &b, &scales, &zp, &mut one, 1).unwrap();
                assert!(one.iter().any(|v| *v != 0.0));
                for parts in [2, 3, 5] {
                    let mut split = vec![0f32; rows * n];
                    matmul_in_parts(&op, &a, rows, &b, &scales, &zp, &mut split, parts).unwrap();
                    let same = one
                        .iter()
                        .zip(&split)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "bits={bits} bs={bs} rows={rows} parts={parts}");
                }
            }
        }
    }

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
