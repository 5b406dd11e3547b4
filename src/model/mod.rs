//! Loading a model from bytes: the ONNX graph (and its external data), `config.json`,
//! `generation_config.json` and `tokenizer.json`.

pub mod cse;
pub mod embeddings;
pub mod files;
pub mod lm_head;
pub mod onnx;
pub mod ops;
pub mod optimizer;
pub mod padding_mask;
pub mod seq2seq;
pub mod session;
pub mod signature;
pub mod tract_decoder;
pub mod typing;
pub mod weights;
pub mod wellformed;

use std::sync::Arc;

use crate::config::GenerationConfig;
use crate::decoder::{Decoder, DecoderState};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use crate::vision::encoder::VisionEncoder;
use crate::vision::{PromptInputs, RopeConfig, RowInputs, VisionConfig};
use embeddings::Embedder;
pub use files::{DecoderLayout, ModelFiles};
use onnx::{Apart, Decoded};
pub use seq2seq::{Encoded, EncoderInput};
use seq2seq::{Seq2Seq, Seq2SeqGraphs};
use signature::Signature;
use tract_decoder::TractDecoder;

/// The decoder graph as `load_owned` takes it out of the files.
enum Graph {
    Bytes(Vec<u8>),
    Decoded(Box<Decoded>),
}

impl Graph {
    /// A graph taken out of the files: decoded as it streamed in, else its bytes.
    fn take(decoded: &mut Option<Decoded>, bytes: &mut Option<Vec<u8>>) -> Option<Graph> {
        match decoded.take() {
            Some(decoded) => Some(Graph::Decoded(Box::new(decoded))),
            None => bytes.take().map(Graph::Bytes),
        }
    }
}

/// A graph beside the decoder (`embed_tokens.onnx`, `vision_encoder.onnx`), decoded and
/// prepared: `taken` out of the files (`load_owned`; bytes are dropped once decoded, before its
/// weights become tensors), else read from the files (`decoded` as it streamed in, or `bytes`).
fn side_graph(
    taken: Option<Graph>,
    decoded: Option<&Decoded>,
    bytes: Option<&[u8]>,
    data: Option<&[u8]>,
    name: &str,
) -> Result<Option<Decoded>> {
    let whole = |proto| Decoded {
        proto,
        apart: Apart::new(),
    };
    Ok(Some(match (taken, decoded, bytes) {
        (Some(Graph::Decoded(decoded)), _, _) => onnx::prepare(*decoded, data, name)?,
        (Some(Graph::Bytes(bytes)), _, _) => whole(onnx::decode(&bytes, data, name)?),
        (None, Some(decoded), _) => onnx::prepare(decoded.clone(), data, name)?,
        (None, None, Some(bytes)) => whole(onnx::decode(bytes, data, name)?),
        (None, None, None) => return Ok(None),
    }))
}

/// What `Model::load_owned` takes out of the files: the decoder graph, its external data, an
/// encoder decoded as it streamed in, and the graphs beside a vision-language decoder.
struct Owned {
    graph: Graph,
    external: Option<Vec<u8>>,
    encoder: Option<Decoded>,
    embed_tokens: Option<Graph>,
    vision_encoder: Option<Graph>,
}

/// The compiled graphs of a model.
#[derive(Debug)]
enum Engine {
    /// A decoder-only model.
    Decoder(TractDecoder),
    /// An encoder and its decoder.
    Seq2Seq(Arc<Seq2Seq>),
}

/// A loaded decoder-only model. Immutable once loaded: a request keeps its own state, so a
/// failed or aborted request leaves the model usable.
#[derive(Debug)]
pub struct Model {
    pub signature: Arc<Signature>,
    /// `config.json`.
    pub config: serde_json::Value,
    /// `generation_config.json` (or, without one, the generation fields of `config.json`, as
    /// transformers' `GenerationConfig.from_model_config` does).
    pub generation_config: GenerationConfig,
    pub tokenizer: Tokenizer,
    /// `preprocessor_config.json`, when the model has one (Whisper, vision models).
    pub preprocessor_config: Option<serde_json::Value>,
    /// A vision-language decoder (it reads `inputs_embeds`, or M-RoPE positions): its image
    /// token, embedding width and position axes.
    pub vision: Option<VisionConfig>,
    /// `vision_encoder.onnx`, when the folder has one.
    pub vision_encoder: Option<VisionEncoder>,
    engine: Engine,
}

impl Model {
    /// Load a model from the bytes of its files.
    pub fn load(files: &ModelFiles) -> Result<Model> {
        Self::load_from(files, None)
    }

    /// Load a model from its files, releasing the bytes of the decoder graph (and its external
    /// data) as soon as they are decoded: the peak memory of loading holds one copy of the
    /// weights less than `load`.
    pub fn load_owned(mut files: ModelFiles) -> Result<Model> {
        let graph = match files.model_proto.take() {
            Some(decoded) => Graph::Decoded(Box::new(decoded)),
            None => Graph::Bytes(std::mem::take(&mut files.model)),
        };
        let external = files.external_data.take();
        let encoder = files.encoder_proto.take();
        let embed_tokens = Graph::take(&mut files.embed_tokens_proto, &mut files.embed_tokens);
        let vision_encoder =
            Graph::take(&mut files.vision_encoder_proto, &mut files.vision_encoder);
        Self::load_from(
            &files,
            Some(Owned {
                graph,
                external,
                encoder,
                embed_tokens,
                vision_encoder,
            }),
        )
    }

    fn load_from(files: &ModelFiles, owned: Option<Owned>) -> Result<Model> {
        let config: serde_json::Value = serde_json::from_slice(&files.config)
            .map_err(|e| Error::Model(format!("config.json is not valid JSON: {e}")))?;
        if !config.is_object() {
            return Err(Error::Model("config.json is not a JSON object".into()));
        }
        let generation_config = match &files.generation_config {
            Some(bytes) => GenerationConfig::from_model_json(bytes)?,
            None => GenerationConfig::from_model_json(&files.config)?,
        };
        let tokenizer = Tokenizer::from_bytes(&files.tokenizer)?;
        let inline = |proto| Decoded {
            proto,
            apart: Apart::new(),
        };
        let (owned, encoder_decoded, embed_graph, vision_graph) = match owned {
            Some(Owned {
                graph,
                external,
                encoder,
                embed_tokens,
                vision_encoder,
            }) => (
                Some((graph, external)),
                encoder,
                embed_tokens,
                vision_encoder,
            ),
            None => (None, files.encoder_proto.clone(), None, None),
        };
        let decoded = match owned {
            // Dropped at the end of this arm, before tract reads the graph.
            Some((Graph::Bytes(graph), external)) => inline(onnx::decode(
                &graph,
                external.as_deref(),
                &files.model_name,
            )?),
            Some((Graph::Decoded(decoded), external)) => {
                onnx::prepare(*decoded, external.as_deref(), &files.model_name)?
            }
            None => match &files.model_proto {
                Some(decoded) => onnx::prepare(
                    decoded.clone(),
                    files.external_data.as_deref(),
                    &files.model_name,
                )?,
                None => inline(onnx::decode(
                    &files.model,
                    files.external_data.as_deref(),
                    &files.model_name,
                )?),
            },
        };
        let mut decoded = decoded;
        weights::runtime_matmuls(&mut decoded.proto);
        let signature = Arc::new(Signature::read(&decoded.proto, &config)?);
        let vocab = logits_width(&signature, &config)?;
        if tokenizer.vocab_size() > vocab {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model's logits are {vocab} wide: \
                 tokenizer.json does not belong to this model",
                tokenizer.vocab_size()
            )));
        }
        let preprocessor_config = files
            .preprocessor_config
            .as_ref()
            .map(|b| serde_json::from_slice(b))
            .transpose()
            .map_err(|e| {
                Error::Model(format!("preprocessor_config.json is not valid JSON: {e}"))
            })?;
        const ENCODER: &str = "encoder_model.onnx";
        let encoder_data = files.encoder_external_data.as_deref();
        let encoder = match (encoder_decoded, &files.encoder) {
            (Some(decoded), _) => Some(onnx::prepare(decoded, encoder_data, ENCODER)?),
            (None, Some(bytes)) => Some(inline(onnx::decode(bytes, encoder_data, ENCODER)?)),
            (None, None) => None,
        };
        let engine = match encoder {
            Some(mut encoder) => {
                weights::runtime_matmuls(&mut encoder.proto);
                let first = files
                    .first_decoder
                    .as_ref()
                    .map(|b| {
                        let data = files.first_decoder_external_data.as_deref();
                        let mut first = onnx::decode(b, data, "decoder_model.onnx")?;
                        weights::runtime_matmuls(&mut first);
                        Ok(first)
                    })
                    .transpose()?;
                let graphs = Seq2SeqGraphs {
                    encoder,
                    decoder: decoded,
                    first_decoder: first,
                };
                Engine::Seq2Seq(Arc::new(Seq2Seq::new(graphs, signature.clone(), vocab)?))
            }
            None => {
                let embed = if signature.takes_ids {
                    None
                } else {
                    side_graph(
                        embed_graph,
                        files.embed_tokens_proto.as_ref(),
                        files.embed_tokens.as_deref(),
                        files.embed_tokens_external_data.as_deref(),
                        "embed_tokens.onnx",
                    )?
                    .map(Embedder::new)
                    .transpose()?
                };
                Engine::Decoder(TractDecoder::new_decoded(
                    decoded,
                    signature.clone(),
                    vocab,
                    embed,
                )?)
            }
        };
        let vision = match &engine {
            Engine::Decoder(d) if !signature.takes_ids || signature.position_axes == 3 => {
                let hidden = d.embedding_width().unwrap_or(0);
                Some(VisionConfig {
                    image_token_id: VisionConfig::image_token_id_of(&config),
                    position_axes: if signature.position_axes == 3 { 3 } else { 1 },
                    hidden,
                    rope: RopeConfig::from_config(&config),
                })
            }
            _ => None,
        };
        let vision_encoder = match &vision {
            Some(_) => side_graph(
                vision_graph,
                files.vision_encoder_proto.as_ref(),
                files.vision_encoder.as_deref(),
                files.vision_encoder_external_data.as_deref(),
                "vision_encoder.onnx",
            )?
            .map(|d| VisionEncoder::new(d, &config, preprocessor_config.as_ref()))
            .transpose()?,
            None => None,
        };
        if let (Engine::Seq2Seq(s), Some(pre)) = (&engine, &preprocessor_config) {
            check_features_fit(s, pre)?;
        }
        Ok(Model {
            signature,
            config,
            generation_config,
            tokenizer,
            preprocessor_config,
            vision,
            vision_encoder,
            engine,
        })
    }

    /// Whether this is an encoder-decoder model (T5, BART, Marian, Whisper).
    pub fn is_encoder_decoder(&self) -> bool {
        matches!(self.engine, Engine::Seq2Seq(_))
    }

    /// Whether the encoder takes audio features (Whisper) rather than token ids.
    pub fn encoder_takes_features(&self) -> bool {
        matches!(&self.engine, Engine::Seq2Seq(s) if s.takes_features())
    }

    /// A fresh decoder state for `rows` rows, sized for `capacity` positions. An
    /// encoder-decoder runs its encoder on `encoder` here; row `r` of the state uses encoder
    /// row `rows_of[r]`.
    pub fn start(
        &self,
        rows: usize,
        capacity: usize,
        encoder: Option<(&EncoderInput, &[usize])>,
    ) -> Result<Box<dyn DecoderState>> {
        self.start_rows(rows, capacity, encoder, None)
    }

    /// `start`, where a vision-language decoder's row `r` continues prompt `prompt_of[r]` of
    /// `prompts` (its image features and positions).
    pub fn start_rows(
        &self,
        rows: usize,
        capacity: usize,
        encoder: Option<(&EncoderInput, &[usize])>,
        prompts: Option<(&Arc<PromptInputs>, &[usize])>,
    ) -> Result<Box<dyn DecoderState>> {
        let row_inputs = prompts.map(|(inputs, prompt_of)| RowInputs {
            inputs: inputs.clone(),
            prompt_of: prompt_of.to_vec(),
        });
        match (&self.engine, encoder) {
            (Engine::Decoder(d), None) => d.start_with(rows, capacity, row_inputs),
            (Engine::Seq2Seq(_), Some(_)) if row_inputs.is_some() => Err(Error::Unsupported(
                "image inputs for an encoder-decoder model".into(),
            )),
            (Engine::Seq2Seq(s), Some((input, rows_of))) => {
                if rows_of.len() != rows {
                    return Err(Error::InvalidInput(format!(
                        "{rows} rows but {} encoder rows",
                        rows_of.len()
                    )));
                }
                s.start(input, rows_of)
            }
            (Engine::Decoder(_), Some(_)) => Err(Error::InvalidInput(
                "this model is decoder-only: it takes no encoder input".into(),
            )),
            (Engine::Seq2Seq(_), None) => Err(Error::InvalidInput(
                "this model is an encoder-decoder: it needs an encoder input".into(),
            )),
        }
    }

    /// Run the encoder of an encoder-decoder once: requests started from the result
    /// (`EncoderInput::Encoded`) reuse it.
    pub fn encode(&self, input: &EncoderInput) -> Result<EncoderInput> {
        match &self.engine {
            Engine::Seq2Seq(s) => Ok(EncoderInput::Encoded(s.encode(input)?)),
            Engine::Decoder(_) => Err(Error::InvalidInput(
                "this model is decoder-only: it has no encoder".into(),
            )),
        }
    }

    /// The `decoder_start_token_id` of an encoder-decoder (generation config, else config.json).
    pub fn decoder_start_token_id(&self) -> Option<u32> {
        self.generation_config.decoder_start_token_id.or_else(|| {
            let v = self.config.get("decoder_start_token_id")?;
            v.as_u64().map(|v| v as u32)
        })
    }

    /// Number of compiled plans: they are symbolic in batch, sequence and past lengths, so this
    /// does not grow with the requests.
    pub fn plans(&self) -> usize {
        match &self.engine {
            Engine::Decoder(d) => d.plans(),
            Engine::Seq2Seq(s) => s.plans(),
        }
    }

    /// Width of the logits.
    pub fn vocab_size(&self) -> usize {
        match &self.engine {
            Engine::Decoder(d) => d.vocab_size(),
            Engine::Seq2Seq(s) => s.vocab_size(),
        }
    }

    /// Largest number of positions the model was trained for (`max_position_embeddings`).
    pub fn max_positions(&self) -> Option<usize> {
        let c = self.config.get("text_config").unwrap_or(&self.config);
        ["max_position_embeddings", "n_positions"]
            .iter()
            .find_map(|k| c.get(k).and_then(|v| v.as_u64()))
            .map(|n| n as usize)
    }
}

/// The feature extractor of `preprocessor_config.json` must make what the encoder reads
/// (`[mel bins, frames]` of one 30 s window for Whisper).
fn check_features_fit(s: &Seq2Seq, preprocessor: &serde_json::Value) -> Result<()> {
    let Some(shape) = s.feature_shape()? else {
        return Ok(());
    };
    let fe = crate::audio::FeatureExtractor::from_config(preprocessor)?;
    let made = vec![fe.feature_size, fe.frames()];
    if shape != made {
        return Err(Error::Model(format!(
            "preprocessor_config.json makes features of shape {made:?} ([mel bins, frames]) but \
             the encoder takes {shape:?}: the preprocessor config belongs to another model"
        )));
    }
    Ok(())
}

/// The logits width: the graph's last logits axis when fixed, else `vocab_size` of config.json.
fn logits_width(sig: &Signature, config: &serde_json::Value) -> Result<usize> {
    let from_graph = sig
        .outputs
        .iter()
        .find(|o| o.name == sig.logits_name)
        .and_then(|o| o.dims.last())
        .and_then(|d| match d {
            signature::Dim::Fixed(n) if *n > 0 => Some(*n as usize),
            _ => None,
        });
    let c = config.get("text_config").unwrap_or(config);
    let from_config = c
        .get("vocab_size")
        .and_then(|v| v.as_u64())
        .map(|n| n as usize);
    from_graph.or(from_config).ok_or_else(|| {
        Error::Model("the logits width is symbolic and config.json has no `vocab_size`".into())
    })
}
