//! The files of a model, as bytes. The core never touches a file system (a browser has none);
//! `ModelFiles::from_dir` is the native convenience that reads the standard layouts:
//!
//! * flat (optimum, the fixtures): `DIR/model.onnx` (or `decoder_model_merged.onnx`),
//!   `DIR/config.json`, ...
//! * transformers.js: the ONNX files under `DIR/onnx/` (`model.onnx`, `model_q4.onnx`,
//!   `model_fp16.onnx`, ... chosen by the variant), the JSON files in `DIR`.

use crate::error::{Error, Result};

/// The bytes of a model's files.
#[derive(Debug, Clone, Default)]
pub struct ModelFiles {
    /// File name of the ONNX graph, for messages.
    pub model_name: String,
    pub model: Vec<u8>,
    /// `model.onnx.data`, when the graph keeps its weights outside.
    pub external_data: Option<Vec<u8>>,
    pub config: Vec<u8>,
    pub generation_config: Option<Vec<u8>>,
    pub tokenizer: Vec<u8>,
}

/// The ONNX file names to try, in order, for a variant (`None`: the full-precision model).
pub fn onnx_candidates(variant: Option<&str>) -> Vec<String> {
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
    /// Read a model folder in the flat or the transformers.js layout.
    pub fn from_dir(dir: &std::path::Path, variant: Option<&str>) -> Result<ModelFiles> {
        use std::fs;
        let read = |p: &std::path::Path| {
            fs::read(p).map_err(|e| Error::Model(format!("cannot read {}: {e}", p.display())))
        };
        if !dir.is_dir() {
            return Err(Error::Model(format!(
                "{} is not a model folder",
                dir.display()
            )));
        }
        let candidates = onnx_candidates(variant);
        let onnx_path = [dir.join("onnx"), dir.to_path_buf()]
            .iter()
            .flat_map(|d| candidates.iter().map(move |c| d.join(c)))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                Error::Model(format!(
                    "no ONNX model in {} (looked for {} in it and in its onnx/ folder)",
                    dir.display(),
                    candidates.join(", ")
                ))
            })?;
        let model_name = onnx_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let onnx_dir = onnx_path.parent().unwrap_or(dir);
        let external_data = external_data_names(&model_name)
            .iter()
            .map(|n| onnx_dir.join(n))
            .find(|p| p.is_file())
            .map(|p| read(&p))
            .transpose()?;
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
            model: read(&onnx_path)?,
            model_name,
            external_data,
            config: required("config.json")?,
            generation_config: generation_config
                .is_file()
                .then(|| read(&generation_config))
                .transpose()?,
            tokenizer: required("tokenizer.json")?,
        })
    }
}
