//! The token embeddings of a decoder that reads `inputs_embeds` (vision-language models):
//! `embed_tokens.onnx`, `input_ids [batch, sequence] -> inputs_embeds [batch, sequence, hidden]`,
//! compiled once by tract with symbolic batch and sequence.

use std::sync::Arc;

use tract_onnx::pb;
use tract_onnx::prelude::*;

use crate::error::{backend, Error, Result};

/// A compiled embeddings graph.
#[derive(Debug)]
pub struct Embedder {
    plan: Arc<TypedRunnableModel>,
    /// Width of an embedding.
    pub hidden: usize,
}

impl Embedder {
    pub fn new(proto: &pb::ModelProto) -> Result<Embedder> {
        let mut model = super::ops::onnx()
            .with_ignore_output_shapes(true)
            .with_ignore_value_info(true)
            .model_for_proto_model(proto)
            .map_err(|e| Error::Model(format!("tract cannot read embed_tokens.onnx: {e:?}")))?;
        let inputs = model.input_outlets().map_err(backend)?.len();
        if inputs != 1 {
            return Err(Error::Model(format!(
                "embed_tokens.onnx has {inputs} inputs; expected one (input_ids)"
            )));
        }
        let b = TDim::from(model.symbols.sym("batch"));
        let s = TDim::from(model.symbols.sym("sequence"));
        model
            .set_input_fact(0, InferenceFact::dt_shape(i64::datum_type(), [b, s]))
            .map_err(backend)?;
        let plan = model
            .into_optimized()
            .and_then(|m| m.into_runnable())
            .map_err(|e| Error::Model(format!("tract cannot compile embed_tokens.onnx: {e:?}")))?;
        let mut embedder = Embedder { plan, hidden: 0 };
        // One token now: checks the graph runs and gives the width.
        let probe = embedder.embed(&[0], 1, 1)?;
        embedder.hidden = probe.len();
        Ok(embedder)
    }

    /// The embeddings `[rows, seq, hidden]` (f32, row-major) of `ids` (`rows x seq`).
    pub fn embed(&self, ids: &[i64], rows: usize, seq: usize) -> Result<Vec<f32>> {
        let input = Tensor::from_shape(&[rows, seq], ids).map_err(backend)?;
        let mut out = self.plan.run(tvec![input.into()]).map_err(backend)?;
        let out = out.remove(0).into_tensor();
        let out = out.cast_to::<f32>().map_err(backend)?.into_owned();
        match out.shape() {
            &[r, s, _] if r == rows && s == seq => Ok(out
                .try_as_plain_ram()
                .map_err(backend)?
                .as_slice::<f32>()
                .map_err(backend)?
                .to_vec()),
            shape => Err(Error::Model(format!(
                "embed_tokens.onnx returned shape {shape:?} for {rows}x{seq} ids; expected \
                 [batch, sequence, hidden]"
            ))),
        }
    }
}
