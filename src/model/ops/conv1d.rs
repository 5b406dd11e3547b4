//! `Conv` in one dimension with a float32 initializer weight (Whisper's two encoder
//! convolutions): `Y[b, o, t] = bias[o] + sum_{c, j} W[o, c, j] * X[b, c, t * stride + j - pad]`,
//! with zeros outside `X`.
//!
//! Each batch's `X` becomes the matrix of its receptive fields (`[T_out, C_in * K]`, "im2col"),
//! which the prompt kernel of `MatMulWeights` multiplies with `W` read where it lies as
//! `[C_out, C_in * K]`; the result is transposed to `[C_out, T_out]`. tract's own convolution
//! multiplied with its 8x8 wasm kernel: Whisper base's two convolutions (1.55 G multiply-adds)
//! took about 2 s of a profiled transcription in Node (0.25 s with this op), several times the
//! time per product of the attention and MLP matmuls around them.
//!
//! Other forms (more dimensions, groups, dilations, `auto_pad` SAME_*, a weight that is not a
//! float32 initializer) go to tract-onnx's `Conv`.

use tract_onnx::model::ParsingContext;
use tract_onnx::pb::{tensor_proto::DataType, NodeProto};
use tract_onnx::tract_hir::internal::*;

use super::linalg::transpose_nk;
use super::matmul_weights::{matmul_f32_nk, Layout};
use super::{initializer, input_slot, node_label};

/// tract-onnx's builder, for the forms this op leaves to it.
pub(super) static TRACT: super::TractBuilder = super::TractBuilder::new();

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Conv1d {
    pub c_in: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    /// Zeros before and after `X` along its last axis.
    pub pads: [usize; 2],
    pub bias: bool,
    pub label: String,
}

impl Conv1d {
    /// The output length for an input of `t` (`t + pads >= kernel`).
    fn out_len(&self, t: usize) -> usize {
        (t + self.pads[0] + self.pads[1] - self.kernel) / self.stride + 1
    }

    /// [`Conv1d::out_len`] of a length that may be symbolic.
    fn out_dim(&self, t: &TDim) -> TDim {
        let shift = (self.pads[0] + self.pads[1]) as i64 - self.kernel as i64;
        (t.clone() + shift) / self.stride as u64 + 1
    }
}

pub fn conv(
    ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    match parse(ctx, node)? {
        Some(op) => Ok((expand(op), vec![])),
        None => TRACT.build(ctx, node),
    }
}

/// The op, when `W` is a float32 initializer `[C_out, C_in, K]` and the attributes describe one
/// group, no dilation and explicit (or VALID) padding.
fn parse(ctx: &ParsingContext, node: &NodeProto) -> TractResult<Option<Conv1d>> {
    let Some(w) = node.input.get(1).and_then(|w| initializer(ctx, w)) else {
        return Ok(None);
    };
    let (c_out, c_in, kernel) = match w.dims.as_slice() {
        &[o, c, k] if o > 0 && c > 0 && k > 0 && w.data_type == DataType::Float as i32 => {
            (o as usize, c as usize, k as usize)
        }
        _ => return Ok(None),
    };
    let ints = |name: &str| node.get_attr_opt_tvec::<i64>(name);
    let group = node.get_attr_opt::<i64>("group")?.unwrap_or(1);
    let dilations = ints("dilations")?;
    let kernel_shape = ints("kernel_shape")?;
    let strides = ints("strides")?;
    let auto_pad = node.get_attr_opt::<String>("auto_pad")?;
    let pads = match (auto_pad.as_deref(), ints("pads")?) {
        (None | Some("NOTSET"), None) | (Some("VALID"), _) => [0, 0],
        (None | Some("NOTSET"), Some(p)) => match p.as_slice() {
            &[a, b] if a >= 0 && b >= 0 => [a as usize, b as usize],
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let stride = match strides.as_deref() {
        None => 1,
        Some(&[s]) if s > 0 => s as usize,
        _ => return Ok(None),
    };
    let one_group = group == 1;
    let no_dilation = dilations.as_deref().is_none_or(|d| d == [1]);
    let kernel_matches = kernel_shape.as_deref().is_none_or(|k| k == [kernel as i64]);
    let bias = input_slot(node, 2).is_some();
    if !(one_group && no_dilation && kernel_matches) || node.output.len() != 1 {
        return Ok(None);
    }
    Ok(Some(Conv1d {
        c_in,
        c_out,
        kernel,
        stride,
        pads,
        bias,
        label: node_label(node),
    }))
}

impl Expansion for Conv1d {
    fn name(&self) -> StaticName {
        "Conv1dWeights".into()
    }

    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        check_input_arity(inputs, 2 + self.bias as usize)?;
        check_output_arity(outputs, 1)?;
        s.equals(&outputs[0].datum_type, &inputs[0].datum_type)?;
        s.equals(&inputs[0].rank, 3)?;
        s.equals(&outputs[0].rank, 3)?;
        s.equals(&outputs[0].shape[0], &inputs[0].shape[0])?;
        s.equals(&outputs[0].shape[1], self.c_out.to_dim())?;
        s.given(&inputs[0].shape[2], move |s, t| {
            s.equals(&outputs[0].shape[2], self.out_dim(&t))
        })
    }

    fn wire(
        &self,
        prefix: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        let label = &self.label;
        let x = model.outlet_fact(inputs[0])?;
        if x.datum_type != f32::datum_type() {
            bail!("{label}: X is {:?}; expected float", x.datum_type);
        }
        let dims: Vec<Option<usize>> = x.shape.iter().map(|d| d.to_usize().ok()).collect();
        match dims.as_slice() {
            [_, Some(c), _] if *c != self.c_in => {
                bail!("{label}: X has {c} channels; W expects {}", self.c_in)
            }
            [_, _, Some(t)] if t + self.pads[0] + self.pads[1] < self.kernel => bail!(
                "{label}: X has {t} values along its last axis; the kernel needs {} with the pads",
                self.kernel
            ),
            [_, _, _] => {}
            _ => bail!("{label}: X has shape {:?}; expected [N, C, T]", x.shape),
        }
        if let Some(bias) = inputs.get(2) {
            let b = model.outlet_fact(*bias)?;
            if b.datum_type != f32::datum_type() || b.shape.to_tvec() != tvec![self.c_out.to_dim()]
            {
                bail!(
                    "{label}: B is {:?} {:?}; expected float [{}]",
                    b.datum_type,
                    b.shape,
                    self.c_out
                );
            }
        }
        model.wire_node(prefix, Conv1dOp(self.clone()), inputs)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Conv1dOp(pub Conv1d);

impl Op for Conv1dOp {
    fn name(&self) -> StaticName {
        "Conv1dWeights".into()
    }
    op_as_typed_op!();
}

impl TypedOp for Conv1dOp {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let x = inputs[0];
        let shape = [
            x.shape[0].clone(),
            self.0.c_out.to_dim(),
            self.0.out_dim(&x.shape[2]),
        ];
        Ok(tvec!(TypedFact::dt_shape(x.datum_type, shape)))
    }
    as_op!();
}

impl EvalOp for Conv1dOp {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let op = &self.0;
        let x = &inputs[0];
        let &[batch, c_in, t] = x.shape() else {
            bail!(
                "{}: X has shape {:?}; expected [N, C, T]",
                op.label,
                x.shape()
            );
        };
        let w = inputs[1].try_as_plain_ram()?.as_slice::<f32>()?;
        let width = op.c_in * op.kernel;
        if c_in != op.c_in || w.len() != op.c_out * width {
            bail!(
                "{}: X has {c_in} channels and W {} values; expected {} and {}",
                op.label,
                w.len(),
                op.c_in,
                op.c_out * width
            );
        }
        let bias = match inputs.get(2) {
            Some(b) => Some(b.try_as_plain_ram()?.as_slice::<f32>()?),
            None => None,
        };
        if t + op.pads[0] + op.pads[1] < op.kernel {
            bail!(
                "{}: X has {t} values along its last axis; the kernel needs {} with the pads",
                op.label,
                op.kernel
            );
        }
        let x = x.try_as_plain_ram()?.as_slice::<f32>()?;
        let t_out = op.out_len(t);
        let mut fields = vec![0f32; t_out * width];
        let mut product = vec![0f32; t_out * op.c_out];
        let mut out = vec![0f32; batch * op.c_out * t_out];
        for (b, out) in out.chunks_exact_mut(op.c_out * t_out).enumerate() {
            let x = &x[b * c_in * t..(b + 1) * c_in * t];
            receptive_fields(op, x, t, &mut fields);
            matmul_f32_nk(&fields, t_out, w, width, op.c_out, Layout::Nk, &mut product);
            // [T_out, C_out] -> [C_out, T_out].
            transpose_nk(&product, t_out, op.c_out, out);
            if let Some(bias) = bias {
                for (row, b) in out.chunks_exact_mut(t_out).zip(bias) {
                    row.iter_mut().for_each(|v| *v += b);
                }
            }
        }
        Ok(tvec!(
            Tensor::from_shape(&[batch, op.c_out, t_out], &out)?.into_tvalue()
        ))
    }
}

/// `fields[o, c * K + j] = x[c, o * stride + j - pad]` (zero outside `x`), `x` `[C_in, t]`.
fn receptive_fields(op: &Conv1d, x: &[f32], t: usize, fields: &mut [f32]) {
    let width = op.c_in * op.kernel;
    for (o, field) in fields.chunks_exact_mut(width).enumerate() {
        let start = o * op.stride;
        for (c, taps) in field.chunks_exact_mut(op.kernel).enumerate() {
            let row = &x[c * t..(c + 1) * t];
            for (j, v) in taps.iter_mut().enumerate() {
                // Position in the padded input, then in x.
                let at = (start + j).checked_sub(op.pads[0]);
                *v = at.and_then(|i| row.get(i)).copied().unwrap_or(0.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tract_onnx::prelude::*;

    use super::super::testing::check;

    #[test]
    fn conv1d_k3_s1_p1_bias() {
        check("conv1d_k3_s1_p1_bias");
    }

    #[test]
    fn conv1d_k3_s2_p1_batch2() {
        check("conv1d_k3_s2_p1_batch2");
    }

    #[test]
    fn conv1d_k4_s3_asymmetric_pads_no_bias() {
        check("conv1d_k4_s3_asymmetric_pads_no_bias");
    }

    /// Groups and dilations go to tract's `Conv`.
    #[test]
    fn conv1d_grouped_dilated_is_tract_s() {
        check("conv1d_grouped_dilated");
    }

    /// An input of length 0 whose pads make room for the kernel gives the bias (no slice of
    /// length 0 is split).
    #[test]
    fn an_empty_input_with_pads_gives_the_bias() {
        let op = super::Conv1dOp(super::Conv1d {
            c_in: 2,
            c_out: 3,
            kernel: 3,
            stride: 1,
            pads: [2, 2],
            bias: true,
            label: "conv".into(),
        });
        let mut model = TypedModel::default();
        let x = model.add_source("x", f32::fact([1, 2, 0])).unwrap();
        let w = Tensor::from_shape(&[3, 2, 3], &[0.5f32; 18]).unwrap();
        let w = model.add_const("w", w).unwrap();
        let b = Tensor::from_shape(&[3], &[1f32, 2.0, 3.0]).unwrap();
        let b = model.add_const("b", b).unwrap();
        let y = model.wire_node("conv", op, &[x, w, b]).unwrap();
        model.select_output_outlets(&y).unwrap();
        let x = Tensor::zero::<f32>(&[1, 2, 0]).unwrap();
        let mut outputs = model.into_runnable().unwrap().run(tvec![x.into()]).unwrap();
        let out = outputs.remove(0);
        assert_eq!(out.shape(), &[1, 3, 2]);
        let values = out
            .try_as_plain_ram()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()
            .to_vec();
        assert_eq!(values, [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }

    /// The cases above run this op, but for the grouped one.
    #[test]
    fn which_cases_run_this_op() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ops");
        for (name, ours) in [
            ("conv1d_k3_s1_p1_bias", true),
            ("conv1d_k3_s2_p1_batch2", true),
            ("conv1d_k4_s3_asymmetric_pads_no_bias", true),
            ("conv1d_grouped_dilated", false),
        ] {
            let model = super::super::onnx()
                .model_for_path(dir.join(format!("{name}.onnx")))
                .unwrap()
                .into_typed()
                .unwrap();
            let found = model
                .nodes()
                .iter()
                .any(|n| n.op().name() == "Conv1dWeights");
            assert_eq!(found, ours, "{name}");
        }
    }
}
