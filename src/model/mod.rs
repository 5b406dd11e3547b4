//! Loading a model from bytes: the ONNX graph (and its external data), `config.json`,
//! `generation_config.json` and `tokenizer.json`.

pub mod files;
pub mod onnx;
pub mod ops;
pub mod signature;
pub mod tract_decoder;

use std::sync::Arc;

use crate::config::GenerationConfig;
use crate::decoder::Decoder;
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
pub use files::ModelFiles;
use signature::Signature;
use tract_decoder::TractDecoder;

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
    decoder: TractDecoder,
}

impl Model {
    /// Load a model from the bytes of its files.
    pub fn load(files: &ModelFiles) -> Result<Model> {
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
        let proto = onnx::decode(
            &files.model,
            files.external_data.as_deref(),
            &files.model_name,
        )?;
        let signature = Arc::new(Signature::read(&proto, &config)?);
        let vocab = logits_width(&signature, &config)?;
        if tokenizer.vocab_size() > vocab {
            return Err(Error::Model(format!(
                "the tokenizer has {} tokens but the model's logits are {vocab} wide: \
                 tokenizer.json does not belong to this model",
                tokenizer.vocab_size()
            )));
        }
        let decoder = TractDecoder::new(&proto, signature.clone(), vocab)?;
        Ok(Model {
            signature,
            config,
            generation_config,
            tokenizer,
            decoder,
        })
    }

    pub fn decoder(&self) -> &dyn Decoder {
        &self.decoder
    }

    /// Number of compiled plans: they are symbolic in batch, sequence and past lengths, so this
    /// does not grow with the requests.
    pub fn plans(&self) -> usize {
        self.decoder.plans()
    }

    /// Width of the logits.
    pub fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
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
