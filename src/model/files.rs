//! The files of a model, as bytes. The core never touches a file system (a browser has none);
//! `ModelFiles::from_dir` is the native convenience that reads the standard layouts:
//!
//! * flat (optimum, the fixtures): `DIR/model.onnx` (or `decoder_model_merged.onnx`),
//!   `DIR/config.json`, ...
//! * transformers.js: the ONNX files under `DIR/onnx/` (`model.onnx`, `model_q4.onnx`,
//!   `model_fp16.onnx`, ... chosen by the variant), the JSON files in `DIR`.

#[cfg(not(target_arch = "wasm32"))]
use crate::error::{Error, Result};

/// The bytes of a model's files.
#[derive(Debug, Clone, Default)]
pub struct ModelFiles {
    /// File name of the ONNX graph, for messages.
    pub model_name: String,
    pub model: Vec<u8>,
    /// The graph, already decoded (`onnx::StreamDecoder`, as the file streamed in;
    /// `onnx::prepare` not applied yet): used instead of `model`, which is then empty.
    pub model_proto: Option<super::onnx::Decoded>,
    /// `model.onnx.data`, when the graph keeps its weights outside.
    pub external_data: Option<Vec<u8>>,
    pub config: Vec<u8>,
    pub generation_config: Option<Vec<u8>>,
    pub tokenizer: Vec<u8>,
    /// Encoder-decoder models: `encoder_model.onnx` (and its external data). `model` is then
    /// the decoder: `decoder_model_merged.onnx`, or `decoder_with_past_model.onnx` of the
    /// split pair whose first-step graph `decoder_model.onnx` is `first_decoder`.
    pub encoder: Option<Vec<u8>>,
    /// The encoder, already decoded (as `model_proto`): used instead of `encoder`.
    pub encoder_proto: Option<super::onnx::Decoded>,
    pub encoder_external_data: Option<Vec<u8>>,
    pub first_decoder: Option<Vec<u8>>,
    pub first_decoder_external_data: Option<Vec<u8>>,
    /// `preprocessor_config.json` (Whisper's feature extractor, a vision model's image
    /// processor).
    pub preprocessor_config: Option<Vec<u8>>,
    /// Vision-language models (transformers.js layout): `embed_tokens.onnx`, the embeddings
    /// of a decoder that reads `inputs_embeds`, and `vision_encoder.onnx`.
    pub embed_tokens: Option<Vec<u8>>,
    /// The embeddings graph, already decoded (as `model_proto`): used instead of
    /// `embed_tokens`.
    pub embed_tokens_proto: Option<super::onnx::Decoded>,
    pub embed_tokens_external_data: Option<Vec<u8>>,
    pub vision_encoder: Option<Vec<u8>>,
    /// The vision encoder, already decoded (as `model_proto`): used instead of
    /// `vision_encoder`.
    pub vision_encoder_proto: Option<super::onnx::Decoded>,
    pub vision_encoder_external_data: Option<Vec<u8>>,
}

/// How an encoder-decoder's decoder is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecoderLayout {
    /// `decoder_model_merged.onnx` when present, else the split pair.
    Auto,
    /// `decoder_model.onnx` + `decoder_with_past_model.onnx`.
    Split,
}

/// The ONNX file names to try, in order, for a variant (`None`: the full-precision model).
pub fn onnx_candidates(variant: Option<&str>) -> Vec<String> {
    decoder_only_candidates(variant)
}

#[cfg(not(target_arch = "wasm32"))]
fn with_variant(stem: &str, variant: Option<&str>) -> String {
    match variant {
        None | Some("") | Some("fp32") => format!("{stem}.onnx"),
        Some(v) => format!("{stem}_{v}.onnx"),
    }
}

fn decoder_only_candidates(variant: Option<&str>) -> Vec<String> {
    match variant {
        None | Some("") | Some("fp32") => {
            vec!["model.onnx".into(), "decoder_model_merged.onnx".into()]
        }
        Some(v) => vec![
            format!("model_{v}.onnx"),
            format!("decoder_model_merged_{v}.onnx"),
        ],
    }
}

/// Names under which an ONNX file's external data is found.
pub fn external_data_names(onnx_name: &str) -> [String; 2] {
    [format!("{onnx_name}.data"), format!("{onnx_name}_data")]
}

#[cfg(not(target_arch = "wasm32"))]
impl ModelFiles {
    /// Read a model folder in the flat or the transformers.js layout (for an encoder-decoder,
    /// the merged decoder when there is one).
    pub fn from_dir(dir: &std::path::Path, variant: Option<&str>) -> Result<ModelFiles> {
        Self::from_dir_with(dir, variant, DecoderLayout::Auto)
    }

    /// Read a model folder; for an encoder-decoder, `layout` picks the decoder files.
    pub fn from_dir_with(
        dir: &std::path::Path,
        variant: Option<&str>,
        layout: DecoderLayout,
    ) -> Result<ModelFiles> {
        use std::fs;
        use std::path::{Path, PathBuf};
        let read = |p: &Path| {
            fs::read(p).map_err(|e| Error::Model(format!("cannot read {}: {e}", p.display())))
        };
        if !dir.is_dir() {
            return Err(Error::Model(format!(
                "{} is not a model folder",
                dir.display()
            )));
        }
        let find = |name: &str| -> Option<PathBuf> {
            [dir.join("onnx"), dir.to_path_buf()]
                .into_iter()
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        };
        // An ONNX file, its name and its external data (`NAME.data` or `NAME_data`).
        let onnx = |p: &Path| -> Result<(String, Vec<u8>, Option<Vec<u8>>)> {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let parent = p.parent().unwrap_or(dir);
            let data = external_data_names(&name)
                .iter()
                .map(|n| parent.join(n))
                .find(|d| d.is_file())
                .map(|d| read(&d))
                .transpose()?;
            Ok((name, read(p)?, data))
        };
        let mut files = ModelFiles::default();
        let mut candidates = decoder_only_candidates(variant);
        if let Some(encoder) = find(&with_variant("encoder_model", variant)) {
            let (_, bytes, data) = onnx(&encoder)?;
            files.encoder = Some(bytes);
            files.encoder_external_data = data;
            let merged = with_variant("decoder_model_merged", variant);
            let with_past = with_variant("decoder_with_past_model", variant);
            let first = with_variant("decoder_model", variant);
            if layout == DecoderLayout::Auto && find(&merged).is_some() {
                candidates = vec![merged];
            } else {
                let first_path = find(&first).ok_or_else(|| {
                    Error::Model(format!(
                        "{} has an encoder but neither {merged} nor {first} + {with_past}",
                        dir.display()
                    ))
                })?;
                let (_, bytes, data) = onnx(&first_path)?;
                files.first_decoder = Some(bytes);
                files.first_decoder_external_data = data;
                candidates = vec![with_past];
            }
        }
        let pre = dir.join("preprocessor_config.json");
        files.preprocessor_config = pre.is_file().then(|| read(&pre)).transpose()?;
        if let Some(path) = find(&with_variant("embed_tokens", variant)) {
            let (_, bytes, data) = onnx(&path)?;
            files.embed_tokens = Some(bytes);
            files.embed_tokens_external_data = data;
        }
        if let Some(path) = find(&with_variant("vision_encoder", variant)) {
            let (_, bytes, data) = onnx(&path)?;
            files.vision_encoder = Some(bytes);
            files.vision_encoder_external_data = data;
        }
        let onnx_path = candidates.iter().find_map(|c| find(c)).ok_or_else(|| {
            Error::Model(format!(
                "no ONNX model in {} (looked for {} in it and in its onnx/ folder)",
                dir.display(),
                candidates.join(", ")
            ))
        })?;
        let (model_name, model, external_data) = onnx(&onnx_path)?;
        let required = |name: &str| {
            let p = dir.join(name);
            if p.is_file() {
                read(&p)
            } else {
                Err(Error::Model(format!(
                    "{name} is missing from {}",
                    dir.display()
                )))
            }
        };
        let generation_config = dir.join("generation_config.json");
        Ok(ModelFiles {
            model_name,
            model,
            external_data,
            config: required("config.json")?,
            generation_config: generation_config
                .is_file()
                .then(|| read(&generation_config))
                .transpose()?,
            tokenizer: required("tokenizer.json")?,
            ..files
        })
    }
}
