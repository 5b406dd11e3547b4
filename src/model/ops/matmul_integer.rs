//! `MatMulInteger` whose `B` is an 8-bit initializer `[K, N]` (dynamically quantized int8
//! exports: `DynamicQuantizeLinear` -> `MatMulInteger` -> `Cast` -> `Mul` by the scales):
//! `Y[m, n] = sum_k (A[m, k] - a_zero) * (B[k, n] - b_zero[n])`, int32.
//!
//! The weight is read one byte a weight, in one of two [`Layout`]s: as it lies (`[K, N]`), or
//! in column blocks (`Layout::Blocks`, [`to_blocks`]: the rewrite before tract stores a
//! matrix that only `MatMulInteger`s read so, in place, when K is a multiple of 4 and N of 16,
//! and sets the node's `layout` attribute to 1). `A - a_zero` is formed once per row as int16,
//! and the simd128 kernels multiply pairs of weights with `i32x4.dot_i16x8_s`. In blocks, the
//! bytes as they lie: a prompt's rows four at a time down each block, a decoding step's single
//! row down four blocks at a time, each in one stream. As it lies: a prompt's rows six at a
//! time down widened blocks of columns, a decoding step's four rows of `B` at a time across all
//! columns. The `B` zero point is subtracted afterwards as
//! `b_zero[n] * sum_k (A[m, k] - a_zero)`. Integer sums are exact, so every kernel gives the
//! same values as tract's own `MatMulInteger`, which this replaces (SmolLM2 int8 decoded at
//! 0.6x transformers.js with it: its int32 kernel computes a 4x4 tile for the single row of a
//! decode step, and the weights are repacked at load).
//!
//! A product whose sums only go through the export's `Cast` and `Mul` by the scales takes the
//! scales as inputs and returns the scaled f32: before tract parses the graph when the scales
//! are one-value f32s it can tell without shapes ([`fuse_scales_in_graph`]), else after tract's
//! optimisation ([`fuse_scales`]).
//!
//! Other forms (a `B` computed in the graph, not 2-D or not 8-bit, a zero point that is not an
//! initializer) go to tract-onnx's `MatMulInteger`.

use std::collections::{HashMap, HashSet};

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::{self, tensor_proto::DataType, NodeProto};
use tract_onnx::tract_core::ops::cast::Cast;
use tract_onnx::tract_core::ops::change_axes::IntoShape;
use tract_onnx::tract_hir::internal::*;

use super::binary::{Arith, BroadcastArith};
use super::{initializer, input_slot, matmul_output_fact, node_label};

/// tract-onnx's builder, for the forms this op leaves to it.
pub(super) static TRACT: super::TractBuilder = super::TractBuilder::new();

/// How the weight's bytes lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[K, N]`, as in the file.
    Rows,
    /// Blocks of 4 columns, one after the other, each `K x 4` bytes: for every four rows of
    /// `B` (a quad), 16 bytes. `B[4 q + i, 4 b + c]` is byte [`block_byte`]`(c, i)` of quad
    /// `q` of block `b`, its top bit flipped where [`flipped`] says so. Read as eight i16, a
    /// quad is the bytes of columns 0 and 1 side by side for rows `4q..4q + 4`, then those of
    /// columns 2 and 3: each i16 is an even column's byte, unsigned, plus 256 times an odd
    /// column's, signed (`blocks_dot`). A decoding step reads each block front to back, its
    /// four sums in two registers. K must be a multiple of 4, N of 16 (the prompt kernel
    /// takes four blocks at a time).
    Blocks,
}

/// Where `B[4 q + i, 4 b + c]` lies in quad `q` of block `b` (`Layout::Blocks`).
#[inline(always)]
pub(crate) fn block_byte(c: usize, i: usize) -> usize {
    8 * (c / 2) + 2 * i + c % 2
}

/// The bit that `Layout::Blocks` flips in column `c`'s bytes (stored = byte ^ flip): signed
/// weights of even columns and unsigned ones of odd columns move by 128, so that the even
/// columns' bytes are unsigned and the odd columns' signed.
#[inline(always)]
pub(crate) fn flipped(c: usize, signed: bool) -> u8 {
    if c.is_multiple_of(2) == signed {
        0x80
    } else {
        0
    }
}

/// The value of the `layout` attribute of a `MatMulInteger` whose weight is in blocks.
pub const BLOCKS_ATTRIBUTE: i64 = 1;

/// Whether a `[k, n]` weight can be stored in blocks.
pub fn fits_blocks(k: usize, n: usize) -> bool {
    k.is_multiple_of(4) && n.is_multiple_of(16)
}

/// `src`, a `[k, n]` matrix of bytes (int8 where `signed`, else uint8), into `dst` in blocks
/// (`Layout::Blocks`); `k` and `n` fit ([`fits_blocks`]).
pub fn to_blocks(src: &[u8], k: usize, n: usize, signed: bool, dst: &mut [u8]) {
    assert!(fits_blocks(k, n) && src.len() == k * n && dst.len() == k * n);
    for (b, block) in dst.chunks_exact_mut(4 * k).enumerate() {
        for (q, quad) in block.chunks_exact_mut(16).enumerate() {
            for i in 0..4 {
                let row = &src[(4 * q + i) * n + 4 * b..][..4];
                for (c, &v) in row.iter().enumerate() {
                    quad[block_byte(c, i)] = v ^ flipped(c, signed);
                }
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IntegerWeights {
    pub k: usize,
    pub n: usize,
    pub layout: Layout,
    /// Slots among the wired inputs.
    pub a_zero: Option<usize>,
    pub b_zero: Option<usize>,
    /// How many scale inputs follow the others (`fuse_scales`): none, the output is the
    /// int32 sums; one or two f32 of one value each, the output is f32, the sums times their
    /// product.
    pub scales: usize,
    pub label: String,
}

pub fn matmul_integer(
    ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    let label = node_label(node);
    let blocks = match node.get_attr_opt::<i64>("layout")? {
        None => false,
        Some(BLOCKS_ATTRIBUTE) => true,
        Some(v) => bail!("{label}: layout {v}; expected {BLOCKS_ATTRIBUTE} (blocks)"),
    };
    let scales = node.get_attr_opt::<i64>(SCALES_ATTRIBUTE)?.unwrap_or(0);
    // `fuse_scales_in_graph`'s form: the zero-point slots, then the scales.
    if scales != 0 && (scales != 2 || node.input.len() != 6) {
        bail!(
            "{label}: {scales} scales after {} inputs; expected 2 after A, B and the two \
             zero-point slots",
            node.input.len() as i64 - scales
        );
    }
    match parse(ctx, node).map(|op| IntegerWeights {
        scales: scales as usize,
        ..op
    }) {
        Some(mut op) if blocks => {
            if !fits_blocks(op.k, op.n) {
                bail!(
                    "{label}: B in blocks needs K a multiple of 4 and N of 16; it is [{}, {}]",
                    op.k,
                    op.n
                );
            }
            op.layout = Layout::Blocks;
            Ok((expand(op), vec![]))
        }
        // tract would read the blocks as rows, and has no scale inputs.
        None if blocks || scales != 0 => bail!(
            "{label}: B in blocks or scale inputs need B an 8-bit matrix initializer with a \
             zero point of its type (one, or one per column), and the node one output"
        ),
        Some(op) => Ok((expand(op), vec![])),
        None => TRACT.build(ctx, node),
    }
}

/// The op, when `B` is an 8-bit 2-D initializer and its zero point (if any) one too, a scalar or
/// one per column.
fn parse(ctx: &ParsingContext, node: &NodeProto) -> Option<IntegerWeights> {
    let eight_bits = |t: &super::InitializerInfo| {
        t.data_type == DataType::Int8 as i32 || t.data_type == DataType::Uint8 as i32
    };
    let b = initializer(ctx, node.input.get(1)?)?;
    let (k, n) = match b.dims.as_slice() {
        &[k, n] if k > 0 && n > 0 && eight_bits(&b) => (k as usize, n as usize),
        _ => return None,
    };
    let b_zero = input_slot(node, 3);
    if b_zero.is_some() {
        let z = initializer(ctx, &node.input[3])?;
        let len: i64 = z.dims.iter().product();
        if z.data_type != b.data_type || !(len == 1 || len == n as i64) {
            return None;
        }
    }
    if node.output.len() != 1 {
        return None;
    }
    Some(IntegerWeights {
        k,
        n,
        layout: Layout::Rows,
        a_zero: input_slot(node, 2),
        b_zero,
        scales: 0,
        label: node_label(node),
    })
}

impl Expansion for IntegerWeights {
    fn name(&self) -> StaticName {
        "MatMulIntegerWeights".into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        let count =
            2 + self.a_zero.is_some() as usize + self.b_zero.is_some() as usize + self.scales;
        check_input_arity(inputs, count)?;
        check_output_arity(outputs, 1)?;
        let dt = if self.scales > 0 {
            f32::datum_type()
        } else {
            i32::datum_type()
        };
        s.equals(&outputs[0].datum_type, dt)?;
        s.equals(&outputs[0].rank, &inputs[0].rank)?;
        let (k, n) = (self.k.to_dim(), self.n.to_dim());
        s.given(&inputs[0].rank, move |s, rank| {
            let last = super::last_axis(rank, &self.label)?;
            for ax in 0..last {
                s.equals(&outputs[0].shape[ax], &inputs[0].shape[ax])?;
            }
            s.equals(&inputs[0].shape[last], k.clone())?;
            s.equals(&outputs[0].shape[last], n.clone())
        })
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let label = &self.label;
        let a = model.outlet_fact(inputs[0])?;
        if a.datum_type != u8::datum_type() && a.datum_type != i8::datum_type() {
            bail!("{label}: A is {:?}; expected uint8 or int8", a.datum_type);
        }
        match a.shape.last().map(|d| d.to_usize()) {
            Some(Ok(k)) if k != self.k => bail!("{label}: A has {k} columns; K is {}", self.k),
            None => bail!("{label}: A is a scalar"),
            _ => {}
        }
        model.wire_node(prefix, IntegerWeightsOp(self.clone()), inputs)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IntegerWeightsOp(pub IntegerWeights);

impl Op for IntegerWeightsOp {
    fn name(&self) -> StaticName {
        "MatMulIntegerWeights".into()
    }
    op_as_typed_op!();
}

impl TypedOp for IntegerWeightsOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let shape = matmul_output_fact(inputs[0], self.0.n).shape;
        let dt = if self.0.scales > 0 {
            f32::datum_type()
        } else {
            i32::datum_type()
        };
        Ok(tvec!(TypedFact::dt_shape(dt, shape)))
    }
    as_op!();
}

/// The values of an 8-bit tensor as i32.
fn as_i32(t: &Tensor) -> TractResult<Vec<i32>> {
    let plain = t.try_as_plain_ram()?;
    Ok(if t.datum_type() == u8::datum_type() {
        plain.as_slice::<u8>()?.iter().map(|&v| v as i32).collect()
    } else {
        plain.as_slice::<i8>()?.iter().map(|&v| v as i32).collect()
    })
}

impl EvalOp for IntegerWeightsOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let op = &self.0;
        let (k, n) = (op.k, op.n);
        let a = &inputs[0];
        let b = &inputs[1];
        let label = &op.label;
        if !a.len().is_multiple_of(k) || b.len() != k * n {
            bail!(
                "{label}: A has {} values (K={k}), B {} (expected {})",
                a.len(),
                b.len(),
                k * n
            );
        }
        let a_zero = match op.a_zero {
            Some(ix) => match as_i32(&inputs[ix])?.as_slice() {
                [z] => *z,
                z => bail!(
                    "{label}: A's zero point has {} values; expected one",
                    z.len()
                ),
            },
            None => 0,
        };
        let b_zero = match op.b_zero {
            Some(ix) => as_i32(&inputs[ix])?,
            None => vec![0],
        };
        let rows = a.len() / k;
        // A - a_zero, in [-255, 255], straight from A's bytes.
        let plain_a = a.try_as_plain_ram()?;
        let shifted: Vec<i16> = if a.datum_type() == u8::datum_type() {
            let a = plain_a.as_slice::<u8>()?;
            a.iter().map(|&v| (v as i32 - a_zero) as i16).collect()
        } else {
            let a = plain_a.as_slice::<i8>()?;
            a.iter().map(|&v| (v as i32 - a_zero) as i16).collect()
        };
        let mut out = vec![0i32; rows * n];
        let plain = b.try_as_plain_ram()?;
        let w = if b.datum_type() == u8::datum_type() {
            Bytes::U8(plain.as_slice::<u8>()?)
        } else {
            Bytes::I8(plain.as_slice::<i8>()?)
        };
        matmul(&shifted, rows, w, k, n, op.layout, &mut out);
        if b_zero.iter().any(|&z| z != 0) {
            for (r, row) in out.chunks_exact_mut(n).enumerate() {
                let sum = shifted[r * k..(r + 1) * k]
                    .iter()
                    .fold(0i32, |s, &v| s.wrapping_add(v as i32));
                for (j, o) in row.iter_mut().enumerate() {
                    let z = if b_zero.len() == 1 {
                        b_zero[0]
                    } else {
                        b_zero[j]
                    };
                    *o = o.wrapping_sub(z.wrapping_mul(sum));
                }
            }
        }
        let mut shape: TVec<usize> = a.shape().into();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        if op.scales == 0 {
            return Ok(tvec!(Tensor::from_shape(&shape, &out)?.into_tvalue()));
        }
        // The graph's `Cast` and `Mul`s: each sum as f32 (rounded as `Cast` rounds), times the
        // product of the scales.
        // (One times the first scale is exactly the first scale.)
        let mut scale = 1f32;
        for t in &inputs[inputs.len() - op.scales..] {
            match t.try_as_plain_ram()?.as_slice::<f32>()? {
                [v] => scale *= v,
                v => bail!("{label}: a scale has {} values; expected one", v.len()),
            }
        }
        let scaled = super::output_tensor(&shape, |scaled: &mut [f32]| {
            for (s, &v) in scaled.iter_mut().zip(&out) {
                *s = v as f32 * scale;
            }
            Ok(())
        })?;
        Ok(tvec!(scaled.into_tvalue()))
    }
}

/// Dynamically quantized exports follow each `MatMulInteger` with a `Cast` to float and a
/// `Mul` by one value, the product of the row's scale (`DynamicQuantizeLinear`'s) and the
/// weight's, reshaped to the output's rank: four nodes per product, 840 per step of int8
/// SmolLM2. Where the sums go only to that `Cast` and it only to that `Mul`, the product takes
/// the scales as inputs and returns the scaled f32 itself (the same operations, so the same
/// values); the rest, read by nothing, is left out of the plan. Returns how many products
/// took their scales.
pub fn fuse_scales(model: &mut TypedModel) -> TractResult<usize> {
    let mut fused = 0;
    for id in 0..model.nodes().len() {
        let Some(op) = model.node(id).op_as::<IntegerWeightsOp>().cloned() else {
            continue;
        };
        if op.0.scales != 0 {
            continue;
        }
        let Some(cast) = only_reader(model, id) else {
            continue;
        };
        let to_f32 = model.node(cast).op_as::<Cast>().map(|c| c.to) == Some(f32::datum_type());
        let Some(mul) = only_reader(model, cast).filter(|_| to_f32) else {
            continue;
        };
        let is_mul = matches!(
            model.node(mul).op_as::<BroadcastArith>(),
            Some(BroadcastArith(Arith::Mul))
        );
        let inputs = &model.node(mul).inputs;
        let Some(&other) = inputs.iter().find(|o| o.node != cast).filter(|_| is_mul) else {
            continue;
        };
        let Some(scales) = scale_factors(model, other)? else {
            continue;
        };
        if model.output_outlets()?.contains(&OutletId::new(mul, 0)) {
            continue;
        }
        // In place (as `matmul_runtime::grouped_kv`): the scales become inputs of the product,
        // its output f32, and the readers of the `Mul` read it instead.
        let first = model.node(id).inputs.len();
        for (i, scale) in scales.iter().enumerate() {
            model.add_edge(*scale, InletId::new(id, first + i))?;
        }
        let mut with_scales = op.0.clone();
        with_scales.scales = scales.len();
        let fact =
            IntegerWeightsOp(with_scales.clone()).output_facts(&model.node_input_facts(id)?)?;
        let node = model.node_mut(id);
        node.op = Box::new(IntegerWeightsOp(with_scales));
        node.outputs[0].fact = fact[0].clone();
        move_readers(model, OutletId::new(mul, 0), OutletId::new(id, 0))?;
        fused += 1;
    }
    Ok(fused)
}

/// The `scales` attribute of a `MatMulInteger` that [`fuse_scales_in_graph`] gave its scales:
/// how many scale inputs follow `A`, `B` and the two zero-point slots.
pub const SCALES_ATTRIBUTE: &str = "scales";

/// [`fuse_scales`] on the ONNX graph, before tract parses it, for the form that needs no
/// shapes: `MatMulInteger` -> `Cast` to float -> `Mul` by `Mul(x_scale, w_scale)`, where each
/// scale is a one-value f32 initializer or the `y_scale` of a `DynamicQuantizeLinear` (a
/// scalar by its definition). The product takes the two scales as inputs after its zero-point
/// slots (the `scales` attribute says how many), writes the `Mul`'s output and the three
/// nodes go: 630 of int8 SmolLM2's 4,792 nodes, which tract would otherwise analyse and
/// optimise at every load. The same operations as the graph's (`IntegerWeightsOp`), so the same
/// values. Returns how many products took their scales.
pub fn fuse_scales_in_graph(graph: &mut pb::GraphProto) -> usize {
    // Readers of each value: nodes at any depth, and the outputs of the graph and subgraphs.
    let mut reads = HashMap::new();
    crate::model::weights::count_reads(&graph.node, &mut reads);
    for o in &graph.output {
        reads.entry(o.name.clone()).or_default().all += 1;
    }
    let read_once = |name: &str| reads.get(name).is_some_and(|r| r.all == 1);
    let producer: HashMap<&str, usize> = graph
        .node
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let readers: HashMap<&str, usize> = graph
        .node
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.input.iter().map(move |o| (o.as_str(), i)))
        .collect();
    let one_f32: HashSet<&str> = graph
        .initializer
        .iter()
        .filter(|t| t.data_type == DataType::Float as i32 && t.dims.iter().product::<i64>() == 1)
        .map(|t| t.name.as_str())
        .chain(
            graph
                .node
                .iter()
                .filter(|n| n.op_type == "DynamicQuantizeLinear" && n.domain.is_empty())
                .filter_map(|n| n.output.get(1).map(|o| o.as_str())),
        )
        .filter(|name| !name.is_empty())
        .collect();
    let is = |i: usize, op: &str| graph.node[i].op_type == op && graph.node[i].domain.is_empty();
    // Node indices: (product, cast, mul, the scales' mul unless others read it), the scales.
    type Fusion = ([usize; 3], Option<usize>, [String; 2]);
    let mut fusions: Vec<Fusion> = vec![];
    for (mm, node) in graph.node.iter().enumerate() {
        let inputs = node.input.len();
        if !is(mm, "MatMulInteger") || !(2..=4).contains(&inputs) || node.output.len() != 1 {
            continue;
        }
        let sums = node.output[0].as_str();
        let Some(&cast) = readers.get(sums).filter(|_| read_once(sums)) else {
            continue;
        };
        let to = graph.node[cast]
            .attribute
            .iter()
            .find(|a| a.name == "to")
            .map(|a| a.i);
        if !is(cast, "Cast")
            || to != Some(DataType::Float as i64)
            || graph.node[cast].output.len() != 1
        {
            continue;
        }
        let cast_out = graph.node[cast].output[0].as_str();
        let Some(&mul) = readers.get(cast_out).filter(|_| read_once(cast_out)) else {
            continue;
        };
        let m = &graph.node[mul];
        if !is(mul, "Mul") || m.input.len() != 2 || m.input[0] == m.input[1] || m.output.len() != 1
        {
            continue;
        }
        let scale = if m.input[0] == cast_out {
            &m.input[1]
        } else {
            &m.input[0]
        };
        let Some(&scale_mul) = producer.get(scale.as_str()).filter(|&&i| is(i, "Mul")) else {
            continue;
        };
        let factors = &graph.node[scale_mul].input;
        if factors.len() != 2 || !factors.iter().all(|f| one_f32.contains(f.as_str())) {
            continue;
        }
        let own = read_once(scale).then_some(scale_mul);
        fusions.push((
            [mm, cast, mul],
            own,
            [factors[0].clone(), factors[1].clone()],
        ));
    }
    let mut dropped = HashSet::new();
    for ([mm, cast, mul], scale_mul, scales) in &fusions {
        let out = graph.node[*mul].output[0].clone();
        let node = &mut graph.node[*mm];
        // The zero-point slots, empty when absent, then the scales.
        node.input.resize(4, String::new());
        node.input.extend(scales.iter().cloned());
        node.output[0] = out;
        node.attribute.push(pb::AttributeProto {
            name: SCALES_ATTRIBUTE.into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: 2,
            ..Default::default()
        });
        dropped.extend([*cast, *mul]);
        dropped.extend(*scale_mul);
    }
    let mut at = 0;
    graph.node.retain(|_| {
        at += 1;
        !dropped.contains(&(at - 1))
    });
    fusions.len()
}

/// Every reader of `from` reads `to` instead.
fn move_readers(model: &mut TypedModel, from: OutletId, to: OutletId) -> TractResult<()> {
    let readers = model.node(from.node).outputs[from.slot].successors.clone();
    for inlet in readers {
        model.add_edge(to, inlet)?;
    }
    Ok(())
}

/// The one node that reads `node`'s single output, when the output is not one of the graph's.
fn only_reader(model: &TypedModel, node: usize) -> Option<usize> {
    let outlet = OutletId::new(node, 0);
    super::only_reader(model, outlet).then(|| model.outlet_successors(outlet)[0].node)
}

/// The factors of a scale of one f32 value: through reshapes, the two operands of a `Mul` of
/// one value each, else the scale itself. `None` when it is not one f32 value.
fn scale_factors(model: &TypedModel, scale: OutletId) -> TractResult<Option<TVec<OutletId>>> {
    let one_f32 = |o: OutletId| -> TractResult<bool> {
        let fact = model.outlet_fact(o)?;
        Ok(fact.datum_type == f32::datum_type() && fact.shape.iter().all(|d| d.is_one()))
    };
    if !one_f32(scale)? {
        return Ok(None);
    }
    let mut at = scale;
    loop {
        let node = model.node(at.node);
        let reshape = node.op_as::<AxisOp>().is_some() || node.op_as::<IntoShape>().is_some();
        if reshape && node.inputs.len() == 1 && one_f32(node.inputs[0])? {
            at = node.inputs[0];
        } else {
            break;
        }
    }
    let node = model.node(at.node);
    let factors = match node.op_as::<BroadcastArith>() {
        Some(BroadcastArith(Arith::Mul))
            if node.inputs.len() == 2 && one_f32(node.inputs[0])? && one_f32(node.inputs[1])? =>
        {
            node.inputs.iter().copied().collect()
        }
        _ => tvec![at],
    };
    Ok(Some(factors))
}

/// The weight's bytes, signed or not.
#[derive(Clone, Copy)]
pub enum Bytes<'a> {
    I8(&'a [i8]),
    U8(&'a [u8]),
}

/// `out[r, j] = sum_k a[r, k] * w[k, j]` (wrapping i32 sums), `a` `[rows, k]`, `w` `[k, n]` in
/// `layout`; under the `threads` feature the columns are split across the threads
/// (`parallel`).
pub fn matmul(
    a: &[i16],
    rows: usize,
    w: Bytes,
    k: usize,
    n: usize,
    layout: Layout,
    out: &mut [i32],
) {
    let parts = super::parallel::parts_for(rows * k * n);
    matmul_in_parts(a, rows, w, k, n, layout, out, parts)
}

/// [`matmul`] of one row on the calling thread, for a caller that splits the columns itself
/// (the `lm_head`'s bound pass, `lm_head`).
pub(crate) fn matvec(a: &[i16], w: Bytes, k: usize, n: usize, layout: Layout, out: &mut [i32]) {
    matmul_in_parts(a, 1, w, k, n, layout, out, 1)
}

/// [`matmul`] with the output columns split in `parts` ranges of whole sixteen columns
/// (integer sums: the same values for any split).
#[allow(clippy::too_many_arguments)]
fn matmul_in_parts(
    a: &[i16],
    rows: usize,
    w: Bytes,
    k: usize,
    n: usize,
    layout: Layout,
    out: &mut [i32],
    parts: usize,
) {
    let (signed, w) = match w {
        // SAFETY: the same memory, read as bytes.
        Bytes::I8(w) => (true, unsafe {
            std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len())
        }),
        Bytes::U8(w) => (false, w),
    };
    super::parallel::by_columns(out, rows, n, 16, parts, |cols, block| {
        // The kernels of the weight as it lies add to `block` (the simd128 prompt passes store
        // their blocks of sixteen columns, the portable kernel adds the rest): from zero.
        if layout == Layout::Rows {
            block.fill(0);
        }
        match (layout, signed) {
            (Layout::Rows, true) => {
                kernels::rows::<true>(a, rows, &w[cols.start..], k, n, cols.len(), block)
            }
            (Layout::Rows, false) => {
                kernels::rows::<false>(a, rows, &w[cols.start..], k, n, cols.len(), block)
            }
            // A range of whole blocks is a contiguous run of them.
            (Layout::Blocks, true) => {
                kernels::blocks::<true>(a, rows, &w[cols.start * k..cols.end * k], k, block)
            }
            (Layout::Blocks, false) => {
                kernels::blocks::<false>(a, rows, &w[cols.start * k..cols.end * k], k, block)
            }
        }
    });
}

/// The value of byte `v` of the weight, signed or not.
#[inline(always)]
fn byte<const SIGNED: bool>(v: u8) -> i32 {
    if SIGNED {
        v as i8 as i32
    } else {
        v as i32
    }
}

/// `out[r, j] += sum over k in ks of a[r, k] * w[k * stride + j]` for the columns `cols` of
/// `out` (`[rows, n]`).
#[allow(clippy::too_many_arguments)]
fn portable<const SIGNED: bool>(
    a: &[i16],
    rows: usize,
    w: &[u8],
    k: usize,
    stride: usize,
    n: usize,
    ks: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    out: &mut [i32],
) {
    for r in 0..rows {
        let o = &mut out[r * n..(r + 1) * n];
        for kk in ks.clone() {
            let x = a[r * k + kk] as i32;
            let row = &w[kk * stride..kk * stride + n];
            for j in cols.clone() {
                o[j] = o[j].wrapping_add(x.wrapping_mul(byte::<SIGNED>(row[j])));
            }
        }
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod kernels {
    /// The portable kernel (LLVM vectorizes its inner loop): `n` columns of `w`, whose rows are
    /// `stride` apart, into `out` (`[rows, n]`).
    pub fn rows<const SIGNED: bool>(
        a: &[i16],
        rows: usize,
        w: &[u8],
        k: usize,
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        super::portable::<SIGNED>(a, rows, w, k, stride, n, 0..k, 0..n, out);
    }

    /// `out[r, j] = sum_k a[r, k] * W[k, j]` for `W` in blocks (`Layout::Blocks`): `w` holds
    /// the blocks of the `out.len() / rows` columns of `out` (`[rows, n]`).
    pub fn blocks<const SIGNED: bool>(a: &[i16], rows: usize, w: &[u8], k: usize, out: &mut [i32]) {
        let n = out.len() / rows.max(1);
        for (b, block) in w.chunks_exact(4 * k).enumerate() {
            for r in 0..rows {
                let x = &a[r * k..(r + 1) * k];
                let mut sums = [0i32; 4];
                for (q, quad) in block.chunks_exact(16).enumerate() {
                    let x = &x[4 * q..4 * q + 4];
                    for (c, sum) in sums.iter_mut().enumerate() {
                        for (i, &x) in x.iter().enumerate() {
                            let v = quad[super::block_byte(c, i)] ^ super::flipped(c, SIGNED);
                            *sum =
                                sum.wrapping_add((x as i32).wrapping_mul(super::byte::<SIGNED>(v)));
                        }
                    }
                }
                out[r * n + 4 * b..r * n + 4 * b + 4].copy_from_slice(&sums);
            }
        }
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use core::arch::wasm32::*;

    use super::super::linalg::{side_by_side, STREAMS};

    /// `(a, b)` as one i32: a splat of it is the i16x8 multiplier of a pair of weight rows.
    #[inline(always)]
    fn pair(a: i16, b: i16) -> i32 {
        (a as u16 as u32 | (b as u16 as u32) << 16) as i32
    }

    /// The low and high eight bytes of `v` as i16x8, signed or not.
    #[inline(always)]
    fn widen<const SIGNED: bool>(v: v128) -> (v128, v128) {
        if SIGNED {
            (i16x8_extend_low_i8x16(v), i16x8_extend_high_i8x16(v))
        } else {
            (u16x8_extend_low_u8x16(v), u16x8_extend_high_u8x16(v))
        }
    }

    /// Sixteen columns of two weight rows as four i16x8 vectors of `(r0[j], r1[j])` pairs,
    /// vector `i` those of columns `4i..4i + 4`: the operands of `i32x4.dot_i16x8_s`.
    #[inline(always)]
    fn widen_pairs<const SIGNED: bool>(r0: v128, r1: v128) -> [v128; 4] {
        let lo = i8x16_shuffle::<0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23>(r0, r1);
        let hi =
            i8x16_shuffle::<8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31>(r0, r1);
        let (v0, v1) = widen::<SIGNED>(lo);
        let (v2, v3) = widen::<SIGNED>(hi);
        [v0, v1, v2, v3]
    }

    /// One row of `a` (a decoding step), `w` as it lies: four rows of `w` per pass over the
    /// sixteen-column blocks of `out`, whose sums stay in memory (L1: at most a few KiB). Each
    /// pass reads four rows of `w` front to back, which the prefetcher follows; walking down
    /// `K` sixteen columns at a time (as the prompt kernel does, its rows reusing each block
    /// from the cache) jumps `stride` bytes per load, and read the weights at 3.4-4.1 GB/s
    /// where this kernel reads 4.5-5.0 (a test streaming 88 MB; plain reads: 8-9 GB/s). The
    /// rows past the last four and the columns past the last block are added by the portable
    /// kernel.
    fn matvec<const SIGNED: bool>(
        a: &[i16],
        w: &[u8],
        k: usize,
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        let blocks = n / 16;
        let quads = k / 4;
        let o = out.as_mut_ptr() as *mut v128;
        for q in 0..quads {
            let x01 = i32x4_splat(pair(a[4 * q], a[4 * q + 1]));
            let x23 = i32x4_splat(pair(a[4 * q + 2], a[4 * q + 3]));
            let p = w[4 * q * stride..].as_ptr();
            for blk in 0..blocks {
                // SAFETY: rows 4q..4q + 4 of w, columns 16 blk..16 blk + 16, are within the
                // bytes asserted by `rows` (4q + 3 < k, 16 blk + 16 <= n <= stride), and
                // out[16 blk..16 blk + 16] within `out`; v128 loads and stores are unaligned.
                unsafe {
                    let at = p.add(blk * 16);
                    let r = [0, 1, 2, 3].map(|i| v128_load(at.add(i * stride) as *const v128));
                    let w01 = widen_pairs::<SIGNED>(r[0], r[1]);
                    let w23 = widen_pairs::<SIGNED>(r[2], r[3]);
                    for j in 0..4 {
                        let sum =
                            i32x4_add(i32x4_dot_i16x8(w01[j], x01), i32x4_dot_i16x8(w23[j], x23));
                        let acc = o.add(4 * blk + j);
                        v128_store(acc, i32x4_add(v128_load(acc), sum));
                    }
                }
            }
        }
        super::portable::<SIGNED>(a, 1, w, k, stride, n, 4 * quads..k, 0..blocks * 16, out);
        super::portable::<SIGNED>(a, 1, w, k, stride, n, 0..k, blocks * 16..n, out);
    }

    /// One row of `a` (a decoding step), `w` in blocks: `STREAMS` blocks a quarter of the
    /// weight apart read at once, each front to back, its four sums in two registers
    /// (`blocks_dot`): eight for four blocks, which x86-64's sixteen simd registers hold, so
    /// four streams are read whatever `streams::count` says. With blocks of sixteen columns
    /// and their bytes widened to i16, 14 simd operations per 32 weights, where `matvec` takes
    /// 20 (in Node, SmolLM2's `[576, 1536]` in cache at 29.5 GB/s against 22.1); four blocks
    /// at once decoded int8 SmolLM2 on a 2-core Xeon in 15.6-19.7 ms a token against
    /// 18.9-22.6 for one, but their 32 sums did not fit the registers and on a 2-core AMD
    /// EPYC one block decoded faster. Now 10 operations per 32 weights: in a wasm benchmark
    /// of 106 MB of int8 weights (Node 20, the EPYC, best of 30) 3.6-3.8 ms a row, where
    /// sixteen-column blocks took 4.2-4.4 widened and 4.0-4.2 as here but one block at a
    /// time; 295 KB in cache 7.0 us against 9.5 widened.
    fn matvec_blocks<const SIGNED: bool>(a: &[i16], w: &[u8], k: usize, out: &mut [i32]) {
        assert!(a.len() == k && w.len() == k * out.len() && k.is_multiple_of(4));
        let fix = [fix::<SIGNED>(moved(a))];
        // N is a multiple of 16 (`fits_blocks`, and `parallel`'s ranges): the blocks come in
        // fours, and the rest is there for any count.
        let (groups, rest) = side_by_side::<STREAMS>(out.len() / 4);
        for bs in groups {
            blocks_dot::<1, STREAMS>(a, w, k, bs, fix, out, 0);
        }
        for b in rest {
            blocks_dot::<1, 1>(a, w, k, [b], fix, out, 0);
        }
    }

    /// What the flipped bytes (`flipped`) move each column's sum by for the row `a`: 128 times
    /// the row's sum (wrapping, as every sum here).
    fn moved(a: &[i16]) -> i32 {
        a.iter().fold(0i32, |s, &v| s.wrapping_add(v as i32)) << 7
    }

    /// `moved` (of a row) taken from the even columns' sums of a block of signed weights, added
    /// to the odd ones of unsigned weights.
    #[inline(always)]
    fn fix<const SIGNED: bool>(moved: i32) -> v128 {
        if SIGNED {
            i32x4(moved.wrapping_neg(), 0, moved.wrapping_neg(), 0)
        } else {
            i32x4(0, moved, 0, moved)
        }
    }

    /// The four sums of each of the blocks `blocks` for `M` rows of `a` (`k` values each) into
    /// `out` (row `m` from `m * n`: the sums of block `b` at `4 b..4 b + 4`), `fix[m]` added.
    ///
    /// A quad's sixteen bytes read as eight i16 are `e + 256 o` for the pairs of an even
    /// column's unsigned byte `e` and an odd column's signed byte `o` (`Layout::Blocks`), and
    /// their arithmetic shift right by 8 is `o`: `i32x4.dot_i16x8_s` of each with the row's
    /// four values gives `E + 256 O` and `O` for the two columns' halves, and `E` is the first
    /// less 256 times the second (in wrapping i32 arithmetic, as every sum here): one shift
    /// per sixteen weights, where widening their bytes to i16 took three operations, and done
    /// once for the `M` rows.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn blocks_dot<const M: usize, const S: usize>(
        a: &[i16],
        w: &[u8],
        k: usize,
        blocks: [usize; S],
        fix: [v128; M],
        out: &mut [i32],
        n: usize,
    ) {
        assert!(a.len() >= M * k && k.is_multiple_of(4));
        let mut acc = [[[i32x4_splat(0); 2]; S]; M];
        let p = blocks.map(|b| w[4 * k * b..4 * k * (b + 1)].as_ptr());
        // SAFETY: block b is bytes 4 k b..4 k (b + 1) of w (sliced above), quad q its bytes
        // 16 q..16 q + 16 (q < k / 4), and a[m k + 4q..m k + 4q + 4] within a (m < M,
        // asserted); loads are unaligned.
        unsafe {
            for q in 0..k / 4 {
                let v = p.map(|p| v128_load(p.add(16 * q) as *const v128));
                let odd = v.map(|v| i16x8_shr(v, 8));
                for (m, acc) in acc.iter_mut().enumerate() {
                    let x = v128_load64_splat(a.as_ptr().add(m * k + 4 * q) as *const u64);
                    for (acc, (&v, &odd)) in acc.iter_mut().zip(v.iter().zip(&odd)) {
                        acc[0] = i32x4_add(acc[0], i32x4_dot_i16x8(v, x));
                        acc[1] = i32x4_add(acc[1], i32x4_dot_i16x8(odd, x));
                    }
                }
            }
        }
        for (m, (acc, fix)) in acc.into_iter().zip(fix).enumerate() {
            for ([both, odd], b) in acc.into_iter().zip(blocks) {
                // Lanes 0 and 1 of `even` hold column 0's two halves, lanes 2 and 3 column
                // 2's; `odd` those of columns 1 and 3.
                let even = i32x4_sub(both, i32x4_shl(odd, 8));
                let sums = i32x4_add(
                    i32x4_shuffle::<0, 4, 2, 6>(even, odd),
                    i32x4_shuffle::<1, 5, 3, 7>(even, odd),
                );
                let o = &mut out[m * n + 4 * b..m * n + 4 * b + 4];
                // SAFETY: o holds 4 values.
                unsafe { v128_store(o.as_mut_ptr() as *mut v128, i32x4_add(sums, fix)) };
            }
        }
    }

    /// Rows of `a` a pass of the prompt kernel multiplies with a block's widened weights:
    /// six rows by eight columns are twelve accumulators. V8 keeps four of them on the stack
    /// (with the two weight vectors, the multiplier and each product before its add, x86's
    /// sixteen registers are one short), but the pass is bound by `i32x4.dot_i16x8_s` itself:
    /// five rows, with one accumulator on the stack, were no faster (`bench/HISTORY.md`).
    const ROWS: usize = 6;

    /// Blocks of sixteen columns the prompt kernel widens at a time: their rows of `w` (as it
    /// lies) are read 64 bytes (a cache line) at a time, where one block's rows were 16 bytes
    /// each, `stride` apart.
    const GROUP: usize = 4;

    /// `(a[r, 2i], a[r, 2i + 1])` as one i32 per pair (`k / 2` per row): a splat gives the i16x8
    /// multiplier.
    fn pairs_of(a: &[i16], rows: usize, k: usize) -> Vec<i32> {
        let pairs_k = k / 2;
        let mut pairs: Vec<i32> = Vec::with_capacity(rows * pairs_k);
        for r in 0..rows {
            let row = &a[r * k..r * k + 2 * pairs_k];
            pairs.extend(row.chunks_exact(2).map(|p| pair(p[0], p[1])));
        }
        pairs
    }

    /// The prompt kernel's widened weights of `GROUP` blocks: block g's columns 8h..8h + 8 at
    /// 4 g pairs_k + 2 (h pairs_k + i), two vectors per pair of rows i, so that a pass over one
    /// half reads them in order. Vector `j` (columns 4j..4j + 4) of pair `i` of block `g`.
    #[inline(always)]
    fn wide_index(pairs_k: usize, g: usize, i: usize, j: usize) -> usize {
        4 * g * pairs_k + 2 * ((j / 2) * pairs_k + i) + j % 2
    }

    /// Several rows of `a` (a prompt; one goes to `matvec`), `w` as it lies, in blocks of
    /// sixteen columns: `GROUP` blocks' bytes are widened once, two rows of `w` interleaved
    /// into i16 pairs (`widen_pairs`), into `wide`; then `passes`. The columns past the last 16
    /// and an odd last row of `w` are added by the portable kernel.
    pub fn rows<const SIGNED: bool>(
        a: &[i16],
        rows: usize,
        w: &[u8],
        k: usize,
        stride: usize,
        n: usize,
        out: &mut [i32],
    ) {
        assert!(k == 0 || (n <= stride && (k - 1) * stride + n <= w.len()));
        assert!(a.len() == rows * k && out.len() == rows * n);
        if rows == 1 {
            return matvec::<SIGNED>(a, w, k, stride, n, out);
        }
        let pairs_k = k / 2;
        let pairs = pairs_of(a, rows, k);
        let blocks = n / 16;
        let mut wide = vec![i32x4_splat(0); 4 * pairs_k * GROUP];
        for first in (0..blocks).step_by(GROUP) {
            let count = GROUP.min(blocks - first);
            for i in 0..pairs_k {
                for g in 0..count {
                    // SAFETY: rows 2i and 2i + 1 of w, the sixteen columns of block first + g,
                    // are within the asserted bytes (2i + 1 < k, 16 (first + g) + 16 <= n);
                    // v128_load is unaligned.
                    let v = unsafe {
                        let p = w.as_ptr().add(2 * i * stride + (first + g) * 16);
                        widen_pairs::<SIGNED>(
                            v128_load(p as *const v128),
                            v128_load(p.add(stride) as *const v128),
                        )
                    };
                    for (j, v) in v.into_iter().enumerate() {
                        wide[wide_index(pairs_k, g, i, j)] = v;
                    }
                }
            }
            passes(&wide, &pairs, pairs_k, rows, first, count, n, out);
        }
        // The rest: the last row of w when K is odd (every column), the columns past the blocks.
        let tail_k = 2 * pairs_k..k;
        super::portable::<SIGNED>(a, rows, w, k, stride, n, tail_k, 0..blocks * 16, out);
        super::portable::<SIGNED>(a, rows, w, k, stride, n, 0..k, blocks * 16..n, out);
    }

    /// Rows of `a` the prompt kernel over blocks takes a pass (`blocks_dot`): their eight sums,
    /// a block's quad, its shifted copy and a row's four values stay in V8's registers, which
    /// six rows (twelve sums) did not. In a wasm benchmark of SmolLM2's 106 M int8 weights in
    /// blocks (Node 20, the 2-core EPYC, 16 to 100 rows) 37-40 G products/s, against 24-28 for
    /// the blocks widened to i16 pairs and `passes` of six rows, widening included.
    const BLOCK_ROWS: usize = 4;

    /// Rows of `a`, `w` in blocks (the `out.len() / rows` columns of `out`): `BLOCK_ROWS` rows
    /// at a time over each block of four columns, read as they lie (`blocks_dot`), sixteen
    /// columns (four blocks) at a time so that the last rows (fewer than `BLOCK_ROWS`) share
    /// each quad over several blocks.
    pub fn blocks<const SIGNED: bool>(a: &[i16], rows: usize, w: &[u8], k: usize, out: &mut [i32]) {
        let n = out.len() / rows.max(1);
        assert!(a.len() == rows * k && w.len() == k * n && super::fits_blocks(k, n));
        if rows == 1 {
            return matvec_blocks::<SIGNED>(a, w, k, out);
        }
        let fixes: Vec<i32> = (0..rows).map(|r| moved(&a[r * k..(r + 1) * k])).collect();
        let fix = |r: usize| fix::<SIGNED>(fixes[r]);
        let full = rows - rows % BLOCK_ROWS;
        for g in (0..n / 4).step_by(4) {
            for b in g..g + 4 {
                for r in (0..full).step_by(BLOCK_ROWS) {
                    let fix = std::array::from_fn(|m| fix(r + m));
                    let (a, out) = (&a[r * k..], &mut out[r * n..]);
                    blocks_dot::<BLOCK_ROWS, 1>(a, w, k, [b], fix, out, n);
                }
            }
            let (a, out) = (&a[full * k..], &mut out[full * n..]);
            match rows - full {
                1 => blocks_dot::<1, 4>(a, w, k, [g, g + 1, g + 2, g + 3], [fix(full)], out, n),
                2 => {
                    let fix = [fix(full), fix(full + 1)];
                    blocks_dot::<2, 2>(a, w, k, [g, g + 1], fix, out, n);
                    blocks_dot::<2, 2>(a, w, k, [g + 2, g + 3], fix, out, n);
                }
                3 => {
                    let fix = [fix(full), fix(full + 1), fix(full + 2)];
                    for b in g..g + 4 {
                        blocks_dot::<3, 1>(a, w, k, [b], fix, out, n);
                    }
                }
                _ => {}
            }
        }
    }

    /// The products of `count` widened blocks (`wide`, from block `first`) with every row of
    /// `a` (`pairs`): each half of a block (eight columns) with `ROWS` rows a pass, by
    /// `i32x4.dot_i16x8_s` with the pair `(a[k], a[k + 1])`. 19-23 GMAC/s in Node for SmolLM2's
    /// shapes and 37 rows with the weights in cache (16 from memory), against 7 when each pair
    /// of rows of `a` widened the weights again and kept sixteen columns of sums for each.
    #[allow(clippy::too_many_arguments)]
    fn passes(
        wide: &[v128],
        pairs: &[i32],
        pairs_k: usize,
        rows: usize,
        first: usize,
        count: usize,
        n: usize,
        out: &mut [i32],
    ) {
        for g in 0..count {
            for half in 0..2 {
                let at = 4 * g * pairs_k + 2 * half * pairs_k;
                let wide = &wide[at..at + 2 * pairs_k];
                let col = (first + g) * 16 + 8 * half;
                let mut r = 0;
                while r < rows {
                    let m = ROWS.min(rows - r);
                    let pass = match m {
                        6 => pass::<6>,
                        5 => pass::<5>,
                        4 => pass::<4>,
                        3 => pass::<3>,
                        2 => pass::<2>,
                        _ => pass::<1>,
                    };
                    let pairs = &pairs[r * pairs_k..(r + m) * pairs_k];
                    pass(wide, pairs, pairs_k, &mut out[r * n..], n, col);
                    r += m;
                }
            }
        }
    }

    /// `M` rows of `a` (`pairs`, `pairs_k` per row) times eight columns of widened weights
    /// (`wide`, two vectors per pair of rows of `w`) into columns `col..col + 8` of `out`'s
    /// first `M` rows (`n` apart).
    fn pass<const M: usize>(
        wide: &[v128],
        pairs: &[i32],
        pairs_k: usize,
        out: &mut [i32],
        n: usize,
        col: usize,
    ) {
        assert!(wide.len() == 2 * pairs_k && pairs.len() == M * pairs_k);
        assert!(out.len() >= (M - 1) * n + col + 8);
        let mut acc = [[i32x4_splat(0); 2]; M];
        for i in 0..pairs_k {
            let (w0, w1) = (wide[2 * i], wide[2 * i + 1]);
            for (q, acc) in acc.iter_mut().enumerate() {
                // SAFETY: q pairs_k + i < M pairs_k = pairs.len() (asserted).
                let x =
                    unsafe { v128_load32_splat(pairs.as_ptr().add(q * pairs_k + i) as *const u32) };
                acc[0] = i32x4_add(acc[0], i32x4_dot_i16x8(w0, x));
                acc[1] = i32x4_add(acc[1], i32x4_dot_i16x8(w1, x));
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            let o = &mut out[q * n + col..q * n + col + 8];
            // SAFETY: o has 8 values; v128_store is unaligned.
            unsafe {
                v128_store(o.as_mut_ptr() as *mut v128, acc[0]);
                v128_store(o.as_mut_ptr().add(4) as *mut v128, acc[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's sums are the exact integer products, for signed and unsigned weights, odd
    /// K, N not a multiple of 16, one to five rows, the columns in one to three parts (threads
    /// under the `threads` feature; the simd128 kernel runs in the wasm tests), with the weight
    /// as it lies and, where the shape fits, in blocks.
    #[test]
    fn matmul_is_exact() {
        let mut state = super::super::testing::xorshift(0x9e37_79b9_7f4a_7c15);
        let mut next = move || (state() >> 24) as u32;
        for (k, n) in [(7, 5), (32, 48), (33, 37), (576, 192)] {
            let w: Vec<u8> = (0..k * n).map(|_| next() as u8).collect();
            let layouts = |signed: bool| {
                let mut layouts = vec![(Layout::Rows, w.clone())];
                if fits_blocks(k, n) {
                    let mut in_blocks = vec![0u8; k * n];
                    to_blocks(&w, k, n, signed, &mut in_blocks);
                    layouts.push((Layout::Blocks, in_blocks));
                }
                layouts
            };
            for rows in 1..=5 {
                let a: Vec<i16> = (0..rows * k).map(|_| (next() % 511) as i16 - 255).collect();
                for signed in [true, false] {
                    let want: Vec<i32> = (0..rows * n)
                        .map(|i| {
                            let (r, j) = (i / n, i % n);
                            (0..k)
                                .map(|kk| {
                                    let b = w[kk * n + j];
                                    let b = if signed { b as i8 as i32 } else { b as i32 };
                                    a[r * k + kk] as i32 * b
                                })
                                .sum()
                        })
                        .collect();
                    for (layout, w) in layouts(signed) {
                        let signed_w: Vec<i8> = w.iter().map(|&b| b as i8).collect();
                        let bytes = if signed {
                            Bytes::I8(&signed_w)
                        } else {
                            Bytes::U8(&w)
                        };
                        for parts in [1, 2, 3] {
                            let mut got = vec![0i32; rows * n];
                            matmul_in_parts(&a, rows, bytes, k, n, layout, &mut got, parts);
                            assert_eq!(
                                got, want,
                                "k={k} n={n} rows={rows} signed={signed} {layout:?} parts={parts}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Quad `q` of block `b` holds `B[4 q + i, 4 b + c]` at `block_byte(c, i)`, each value
    /// once: read as i16, the even columns' bytes are the low ones and unsigned, the odd
    /// columns' the high ones and signed (`B`'s signed bytes of even columns plus 128, its
    /// unsigned bytes of odd columns less 128), columns 0 and 1 in the quad's first eight bytes.
    #[test]
    fn blocks_put_every_byte_in_its_place() {
        let (k, n) = (8, 32);
        let w: Vec<u8> = (0..k * n).map(|i| (i * 7) as u8).collect();
        for signed in [true, false] {
            let mut blocks = vec![0u8; k * n];
            to_blocks(&w, k, n, signed, &mut blocks);
            let mut seen = vec![false; k * n];
            for b in 0..n / 4 {
                for q in 0..k / 4 {
                    for c in 0..4 {
                        for i in 0..4 {
                            let place = block_byte(c, i);
                            assert_eq!(place / 8, c / 2, "c={c} i={i}");
                            assert_eq!(place % 2, c % 2, "c={c} i={i}: low bytes for even columns");
                            let at = 4 * k * b + 16 * q + place;
                            assert!(!seen[at], "b={b} q={q} c={c} i={i}: byte {at} twice");
                            seen[at] = true;
                            let v = w[(4 * q + i) * n + 4 * b + c];
                            let want = match (signed, c.is_multiple_of(2)) {
                                (true, true) => (v as i8 as i32 + 128) as u8,
                                (false, false) => (v as i32 - 128) as i8 as u8,
                                _ => v,
                            };
                            assert_eq!(blocks[at], want, "signed={signed} b={b} q={q} c={c} i={i}");
                        }
                    }
                }
            }
        }
    }

    /// `fuse_scales_in_graph` on an int8 export's form (`DynamicQuantizeLinear` of `x`, two
    /// products of it, each `Cast` and multiplied by the product of `x`'s scale and its
    /// weight's): both products take their scales and the six nodes after them go, and tract
    /// runs the graph to the same f32 bits; a `Cast` read twice or a scale of unknown size
    /// leaves its product as it was.
    #[test]
    fn scales_fused_before_tract_give_the_same_bits() {
        use tract_onnx::prelude::Framework;
        let mut state = super::super::testing::xorshift(0x2545_f491_4f6c_dd1d);
        let mut next = move || (state() >> 24) as u32;
        let (k, n) = (32, 16);
        let node = |op: &str, inputs: &[&str], outputs: &[&str]| pb::NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let cast = |input: &str, output: &str| pb::NodeProto {
            attribute: vec![pb::AttributeProto {
                name: "to".into(),
                i: DataType::Float as i64,
                r#type: pb::attribute_proto::AttributeType::Int as i32,
                ..Default::default()
            }],
            ..node("Cast", &[input], &[output])
        };
        let init = |name: &str, dt: DataType, dims: Vec<i64>, raw: Vec<u8>| pb::TensorProto {
            name: name.into(),
            data_type: dt as i32,
            dims,
            raw_data: raw,
            ..Default::default()
        };
        let weights = |name: &str, next: &mut dyn FnMut() -> u32| {
            init(
                name,
                DataType::Int8,
                vec![k as i64, n as i64],
                (0..k * n).map(|_| next() as u8).collect(),
            )
        };
        let scale =
            |name: &str, v: f32| init(name, DataType::Float, vec![], v.to_le_bytes().to_vec());
        let zero = |name: &str| init(name, DataType::Int8, vec![], vec![3]);
        let graph = |extra_reader: bool, unknown_scale: bool, next: &mut dyn FnMut() -> u32| {
            let mut nodes = vec![
                node("DynamicQuantizeLinear", &["x"], &["xq", "xs", "xz"]),
                node("MatMulInteger", &["xq", "w1", "xz", "z1"], &["y1"]),
                cast("y1", "c1"),
                node("Mul", &["xs", "s1"], &["m1"]),
                node("Mul", &["c1", "m1"], &["o1"]),
                node("MatMulInteger", &["xq", "w2", "xz", "z2"], &["y2"]),
                cast("y2", "c2"),
                node("Identity", &["xs"], &["xs_copy"]),
                node(
                    "Mul",
                    &[if unknown_scale { "xs_copy" } else { "xs" }, "s2"],
                    &["m2"],
                ),
                node("Mul", &["m2", "c2"], &["o2"]),
            ];
            let mut outputs = vec!["o1", "o2"];
            if extra_reader {
                // Before the `Mul`: the pass must count the readers, not find the last one.
                nodes.insert(3, node("Identity", &["c1"], &["more"]));
                outputs.push("more");
            }
            pb::ModelProto {
                opset_import: vec![pb::OperatorSetIdProto {
                    domain: String::new(),
                    version: 17,
                }],
                graph: Some(pb::GraphProto {
                    node: nodes,
                    initializer: vec![
                        weights("w1", next),
                        weights("w2", next),
                        zero("z1"),
                        zero("z2"),
                        scale("s1", 0.0213),
                        scale("s2", 0.0071),
                    ],
                    input: vec![pb::ValueInfoProto {
                        name: "x".into(),
                        r#type: Some(pb::TypeProto {
                            value: Some(pb::type_proto::Value::TensorType(
                                pb::type_proto::Tensor {
                                    elem_type: DataType::Float as i32,
                                    shape: None,
                                },
                            )),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    output: outputs
                        .iter()
                        .map(|o| pb::ValueInfoProto {
                            name: o.to_string(),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }
        };
        let x: Vec<f32> = (0..3 * k).map(|_| next() as f32 / 1e3 - 2.0).collect();
        let x = Tensor::from_shape(&[3, k], &x).unwrap();
        let run = |proto: &pb::ModelProto| -> Vec<Vec<u32>> {
            let mut model = crate::model::ops::onnx()
                .model_for_proto_model(proto)
                .unwrap();
            model.set_input_fact(0, f32::fact([3, k]).into()).unwrap();
            let plan = model.into_optimized().unwrap().into_runnable().unwrap();
            plan.run(tvec!(x.clone().into()))
                .unwrap()
                .iter()
                .map(|t| {
                    let t = t.cast_to::<f32>().unwrap();
                    let v = t
                        .try_as_plain_ram()
                        .unwrap()
                        .as_slice::<f32>()
                        .unwrap()
                        .to_vec();
                    v.iter().map(|v| v.to_bits()).collect()
                })
                .collect()
        };
        for (extra_reader, unknown_scale) in [(false, false), (true, false), (false, true)] {
            let mut proto = graph(extra_reader, unknown_scale, &mut next);
            let before = run(&proto);
            let g = proto.graph.as_mut().unwrap();
            let nodes = g.node.len();
            let fused = fuse_scales_in_graph(g);
            let with_scales: Vec<&[String]> = g
                .node
                .iter()
                .filter(|n| n.attribute.iter().any(|a| a.name == SCALES_ATTRIBUTE))
                .map(|n| &n.input[4..])
                .collect();
            let expected = if extra_reader || unknown_scale { 1 } else { 2 };
            assert_eq!(
                fused, expected,
                "extra_reader {extra_reader}, unknown_scale {unknown_scale}"
            );
            assert_eq!(g.node.len(), nodes - 3 * expected);
            assert_eq!(with_scales.len(), expected);
            assert!(with_scales.iter().all(|s| s[0] == "xs"));
            assert_eq!(
                before,
                run(&proto),
                "extra_reader {extra_reader}, unknown_scale {unknown_scale}"
            );
        }
    }

    /// Malformed nodes in the pattern (a `Cast` or `Mul` without output, a product with five
    /// inputs) are left as they are, for tract to refuse, and the pass does not panic.
    #[test]
    fn scales_are_not_fused_into_malformed_nodes() {
        let node = |op: &str, inputs: &[&str], outputs: &[&str]| pb::NodeProto {
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: vec![pb::AttributeProto {
                name: "to".into(),
                i: DataType::Float as i64,
                ..Default::default()
            }],
            ..Default::default()
        };
        let scale = |name: &str| pb::TensorProto {
            name: name.into(),
            data_type: DataType::Float as i32,
            float_data: vec![0.5],
            ..Default::default()
        };
        for (mm_inputs, cast_out, mul_out) in [
            (&["a", "w", "az", "wz"][..], &[][..], &["o"][..]),
            (&["a", "w", "az", "wz"][..], &["c"][..], &[][..]),
            (&["a", "w", "az", "wz", "extra"][..], &["c"][..], &["o"][..]),
        ] {
            let mut graph = pb::GraphProto {
                node: vec![
                    node("MatMulInteger", mm_inputs, &["y"]),
                    node("Cast", &["y"], cast_out),
                    node("Mul", &["s1", "s2"], &["m"]),
                    node("Mul", &["c", "m"], mul_out),
                ],
                initializer: vec![scale("s1"), scale("s2")],
                ..Default::default()
            };
            let before = graph.clone();
            assert_eq!(fuse_scales_in_graph(&mut graph), 0);
            assert_eq!(graph, before);
        }
    }

    /// `fuse_scales` on `MatMulInteger` -> `Cast` -> `Mul` by the product of two scalar scales
    /// raised to the output's rank (as int8 exports run in tract; `A` and the scales are
    /// inputs): the plan runs one product, with both scales, and no `Cast`, and returns the same
    /// f32 bits as the graph did; with a second reader of the `Cast`, nothing changes.
    #[test]
    fn scales_fused_into_the_product_give_the_same_bits() {
        let mut state = super::super::testing::xorshift(0x5851_f42d_4c95_7f2d);
        let mut next = move || (state() >> 24) as u32;
        let (k, n) = (40, 24);
        let a: Vec<u8> = (0..3 * k).map(|_| next() as u8).collect();
        let b: Vec<u8> = (0..k * n).map(|_| next() as u8).collect();
        let a = Tensor::from_shape(&[1, 3, k], &a).unwrap();
        let b = Tensor::from_shape(&[k, n], &b).unwrap();
        for second_reader in [false, true] {
            let mut model = TypedModel::default();
            let inputs = [
                model.add_source("a", u8::fact([1, 3, k])).unwrap(),
                model.add_const("b", b.clone()).unwrap(),
                model.add_const("a_zero", tensor0(131u8)).unwrap(),
                model.add_const("b_zero", tensor0(127u8)).unwrap(),
            ];
            let p = model.add_source("p", f32::scalar_fact()).unwrap();
            let q = model.add_source("q", f32::scalar_fact()).unwrap();
            let op = IntegerWeightsOp(IntegerWeights {
                k,
                n,
                layout: Layout::Rows,
                a_zero: Some(2),
                b_zero: Some(3),
                scales: 0,
                label: "test".into(),
            });
            let sums = model.wire_node("mm", op, &inputs).unwrap();
            let cast = model
                .wire_node(
                    "cast",
                    Cast {
                        to: f32::datum_type(),
                    },
                    &sums,
                )
                .unwrap();
            let mul = BroadcastArith(Arith::Mul);
            let mut scale = model.wire_node("scale", mul.clone(), &[p, q]).unwrap();
            for axis in 0..3 {
                scale = model
                    .wire_node(format!("rank{axis}"), AxisOp::Add(0), &scale)
                    .unwrap();
            }
            let y = model.wire_node("y", mul, &[cast[0], scale[0]]).unwrap();
            // Read by another node, as in the graphs (a product's output is not the graph's).
            let y = model.wire_node("reader", AxisOp::Add(0), &y).unwrap();
            let mut outputs = y.to_vec();
            if second_reader {
                outputs.push(model.wire_node("more", AxisOp::Add(0), &cast).unwrap()[0]);
            }
            model.select_output_outlets(&outputs).unwrap();
            let run = |m: TypedModel| {
                let inputs = tvec!(
                    a.clone().into(),
                    tensor0(0.0123f32).into(),
                    tensor0(0.731f32).into()
                );
                m.into_runnable()
                    .unwrap()
                    .run(inputs)
                    .unwrap()
                    .remove(0)
                    .into_tensor()
            };
            let before = run(model.clone());
            let fused = fuse_scales(&mut model).unwrap();
            // What the plan runs.
            let order = model.eval_order().unwrap();
            let ran = || order.iter().map(|&n| model.node(n));
            let casts = ran().filter(|n| n.op_as::<Cast>().is_some()).count();
            let scales: Vec<usize> = ran()
                .filter_map(|n| n.op_as::<IntegerWeightsOp>().map(|op| op.0.scales))
                .collect();
            if second_reader {
                assert_eq!((fused, casts, scales), (0, 1, vec![0]));
            } else {
                assert_eq!((fused, casts, scales), (1, 0, vec![2]));
            }
            let after = run(model);
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap();
                v.iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(before.shape(), after.shape());
            assert_eq!(
                bits(&before),
                bits(&after),
                "second reader: {second_reader}"
            );
        }
    }
}
