//! The token embeddings of a decoder that reads `inputs_embeds` (vision-language models):
//! `embed_tokens.onnx`, `input_ids [batch, sequence] -> inputs_embeds [batch, sequence, hidden]`,
//! compiled once by tract with symbolic batch and sequence.

use std::sync::Arc;

use tract_onnx::prelude::*;

use crate::error::{backend, in_file, Error, Result};
use crate::model::onnx::Decoded;
use crate::model::tract_decoder::GraphTemplate;

/// A compiled embeddings graph.
#[derive(Debug)]
pub struct Embedder {
    plan: Arc<TypedRunnableModel>,
    /// Width of an embedding.
    pub hidden: usize,
}

impl Embedder {
    /// The embeddings of a decoded `embed_tokens.onnx`: its large initializers (the table)
    /// become tensors one at a time (kept apart while it streamed in, or converted from the
    /// protobuf, each one's bytes freed before the next), so the load holds the table once.
    pub fn new(decoded: Decoded) -> Result<Embedder> {
        let mut model = GraphTemplate::of(decoded)
            .and_then(|template| template.parse())
            .map_err(in_file("embed_tokens.onnx"))?;
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::onnx::{self, StreamDecoder};

    /// The embeddings graph decoded as it streams in (as the package reads
    /// `embed_tokens.onnx`), its large initializers kept apart, gives the embeddings of the graph
    /// decoded whole, to the bit: with the package's threshold and with 1 KB.
    #[test]
    fn embeddings_streamed_in_are_those_of_the_graph_decoded_whole() {
        for name in ["qwen2-vl", "smolvlm"] {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm/models");
            let bytes = std::fs::read(dir.join(name).join("onnx/embed_tokens.onnx")).unwrap();
            let ids = [0, 5, 17, 3, 42, 1];
            let whole = onnx::decode(&bytes, None, "embed_tokens.onnx").unwrap();
            let whole = Embedder::new(Decoded {
                proto: whole,
                apart: onnx::Apart::new(),
            })
            .unwrap();
            let want = whole.embed(&ids, 2, 3).unwrap();
            assert_eq!(want.len(), 6 * whole.hidden, "{name}");
            for large in [crate::model::ops::LARGE_INITIALIZER as u64, 1024] {
                let mut stream = StreamDecoder::new_apart("embed_tokens.onnx").with_large(large);
                for chunk in bytes.chunks(4096) {
                    stream.feed(chunk).unwrap();
                }
                let decoded = onnx::prepare(stream.finish().unwrap(), None, "e.onnx").unwrap();
                assert!(!decoded.apart.is_empty(), "{name}: the table is kept apart");
                let got = Embedder::new(decoded).unwrap().embed(&ids, 2, 3).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name}, {large} bytes apart");
            }
        }
    }
}
