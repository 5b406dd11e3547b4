//! `com.microsoft.GatherBlockQuantized`: rows of a block-quantized table (a quantized
//! embedding, often shared with the LM head), dequantized after the gather.
//!
//! `data` is `uint8 [rows, cols * bits / 8]` (4 bits: two values per byte, low nibble first;
//! 8 bits: one), quantized along its last axis in blocks of `block_size`; `scales` holds
//! `rows * ceil(cols / block_size)` values; `zero_points` (optional, `uint8`) packs one zero
//! per block the same way as `data`; absent, the zero is `2^(bits - 1)`. Output:
//! `indices.shape + [cols]`, of the scales' type. Only the gathered rows are dequantized.
//!
//! Supported: a rank-2 `uint8` table, `gather_axis` 0, `quantize_axis` the last, `bits` 4 or
//! 8, `block_size` a power of two from 16 to 256. Anything else fails at load time, naming
//! the node.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;

use super::{input_slot, node_label};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gbq {
    pub bits: usize,
    pub block_size: usize,
    pub zero_points: Option<usize>,
    pub label: String,
}

pub fn gather_block_quantized(
    _ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    Ok((expand(parse(node)?), vec![]))
}

pub fn parse(node: &NodeProto) -> TractResult<Gbq> {
    let label = node_label(node);
    let bits: i64 = node.get_attr_opt("bits")?.unwrap_or(4);
    let block_size: i64 = node.get_attr_opt("block_size")?.unwrap_or(128);
    let gather_axis: i64 = node.get_attr_opt("gather_axis")?.unwrap_or(0);
    let quantize_axis: i64 = node.get_attr_opt("quantize_axis")?.unwrap_or(1);
    if bits != 4 && bits != 8 {
        bail!("{label}: bits={bits} is not supported (4 or 8)");
    }
    if !(16..=256).contains(&block_size) || (block_size & (block_size - 1)) != 0 {
        bail!("{label}: block_size={block_size} is not supported (a power of two from 16 to 256)");
    }
    if gather_axis != 0 {
        bail!("{label}: gather_axis={gather_axis} is not supported (only 0)");
    }
    if quantize_axis != 1 && quantize_axis != -1 {
        bail!("{label}: quantize_axis={quantize_axis} is not supported (only the last axis of a rank-2 table)");
    }
    if input_slot(node, 1).is_none() || input_slot(node, 2).is_none() {
        bail!("{label}: data, indices and scales are required");
    }
    Ok(Gbq {
        bits: bits as usize,
        block_size: block_size as usize,
        zero_points: input_slot(node, 3),
        label,
    })
}

impl Expansion for Gbq {
    fn name(&self) -> StaticName {
        "GatherBlockQuantized".into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, 3 + self.zero_points.is_some() as usize)?;
        check_output_arity(outputs, 1)?;
        s.equals(&outputs[0].datum_type, &inputs[2].datum_type)?;
        s.equals(&inputs[0].rank, 2)?;
        s.equals(&outputs[0].rank, inputs[1].rank.bex() + 1)?;
        let per_byte = (8 / self.bits) as i64;
        s.given(&inputs[1].rank, move |s, rank| {
            let rank = rank as usize;
            for ax in 0..rank {
                s.equals(&outputs[0].shape[ax], &inputs[1].shape[ax])?;
            }
            s.given(&inputs[0].shape[1], move |s, bytes| {
                s.equals(&outputs[0].shape[rank], bytes * per_byte)
            })
        })
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let label = &self.label;
        let data = model.outlet_fact(inputs[0])?;
        if data.datum_type != u8::datum_type() || data.rank() != 2 {
            bail!(
                "{label}: data is {:?} {:?}; expected a rank-2 uint8 table",
                data.datum_type,
                data.shape
            );
        }
        if let (Ok(rows), Ok(bytes)) = (data.shape[0].to_usize(), data.shape[1].to_usize()) {
            let cols = bytes * 8 / self.bits;
            let blocks = rows * cols.div_ceil(self.block_size);
            let scales = model.outlet_fact(inputs[2])?;
            if let Ok(n) = scales
                .shape
                .iter()
                .map(|d| d.to_usize().ok())
                .product::<Option<usize>>()
                .ok_or(())
            {
                if n != blocks {
                    bail!(
                        "{label}: scales has shape {:?}; a [{rows}, {bytes}] table of {}-bit values in blocks of {} needs {blocks} scales",
                        scales.shape, self.bits, self.block_size
                    );
                }
            }
        }
        model.wire_node(prefix, GbqOp(self.clone()), inputs)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GbqOp(pub Gbq);

impl Op for GbqOp {
    fn name(&self) -> StaticName {
        "GatherBlockQuantized".into()
    }
    op_as_typed_op!();
}

impl TypedOp for GbqOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let mut shape: TVec<TDim> = inputs[1].shape.iter().cloned().collect();
        shape.push(inputs[0].shape[1].clone() * (8 / self.0.bits) as i64);
        Ok(tvec!(inputs[2].datum_type.fact(shape)))
    }
    as_op!();
}

impl EvalOp for GbqOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let g = &self.0;
        let (rows, bytes) = match inputs[0].shape() {
            &[r, b] => (r, b),
            s => bail!("{}: data has shape {s:?}", g.label),
        };
        let cols = bytes * 8 / g.bits;
        let blocks = cols.div_ceil(g.block_size);
        let data_view = inputs[0].try_as_plain_ram()?;
        let data = data_view.as_slice::<u8>()?;
        let indices = inputs[1].cast_to::<i64>()?;
        let indices_view = indices.try_as_plain_ram()?;
        let indices = indices_view.as_slice::<i64>()?;
        let scales = inputs[2].cast_to::<f32>()?;
        let scales_view = scales.try_as_plain_ram()?;
        let scales = scales_view.as_slice::<f32>()?;
        if scales.len() != rows * blocks {
            bail!(
                "{}: {} scales for {rows} rows of {blocks} blocks",
                g.label,
                scales.len()
            );
        }
        let zp = match g.zero_points {
            Some(ix) => {
                let v = inputs[ix].try_as_plain_ram()?;
                Some(v.as_slice::<u8>()?.to_vec())
            }
            None => None,
        };
        let zp_row = (blocks * g.bits).div_ceil(8);
        let default_zero = (1u32 << (g.bits - 1)) as f32;
        let mask = ((1u16 << g.bits) - 1) as u8;
        let mut out = vec![0f32; indices.len() * cols];
        for (i, &ix) in indices.iter().enumerate() {
            let r = if ix < 0 { ix + rows as i64 } else { ix };
            if r < 0 || r as usize >= rows {
                bail!("{}: index {ix} is outside the {rows} rows", g.label);
            }
            let r = r as usize;
            let row = &data[r * bytes..(r + 1) * bytes];
            let o = &mut out[i * cols..(i + 1) * cols];
            for (c, v) in o.iter_mut().enumerate() {
                let bit = c * g.bits;
                let q = (row[bit / 8] >> (bit % 8)) & mask;
                let blk = c / g.block_size;
                let zero = match &zp {
                    Some(z) => {
                        let zb = blk * g.bits;
                        let byte = *z
                            .get(r * zp_row + zb / 8)
                            .ok_or_else(|| format_err!("{}: zero_points too short", g.label))?;
                        ((byte >> (zb % 8)) & mask) as f32
                    }
                    None => default_zero,
                };
                *v = (q as f32 - zero) * scales[r * blocks + blk];
            }
        }
        let mut shape: TVec<usize> = inputs[1].shape().into();
        shape.push(cols);
        let out = Tensor::from_shape(&shape, &out)?;
        let dt = inputs[2].datum_type();
        let out = if dt == f32::datum_type() {
            out
        } else {
            out.cast_to_dt(dt)?.into_owned()
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::check;

    #[test]
    fn gbq_q4_b32() {
        check("gbq_q4_b32");
    }

    #[test]
    fn gbq_q4_b16_zp() {
        check("gbq_q4_b16_zp");
    }

    #[test]
    fn gbq_q8_b32_zp() {
        check("gbq_q8_b32_zp");
    }
}
