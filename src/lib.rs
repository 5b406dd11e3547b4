//! onnx-generate: run ONNX decoder language models with tract, token for token as Hugging Face
//! transformers 4.57 `generate()` does.
//!
//! The core is pure Rust and takes bytes, not paths, so it runs unchanged in wasm:
//!
//! ```no_run
//! # fn main() -> onnx_generate::Result<()> {
//! use onnx_generate::{Model, ModelFiles};
//! let files = ModelFiles::from_dir(std::path::Path::new("tests/fixtures/models/llama"), None)?;
//! let model = Model::load(&files)?;
//! let options = serde_json::json!({"max_new_tokens": 8}).as_object().cloned().unwrap_or_default();
//! let out = model.generate_text("hello", &options, |event| print!("{}", event.text))?;
//! println!("\n{:?}", out.sequences[0][0].finish_reason);
//! # Ok(()) }
//! ```

// The threads build (nightly, +atomics) sleeps idle members of a team of threads with wasm's
// `memory.atomic.wait32` (src/model/ops/parallel.rs).
#![cfg_attr(
    all(target_arch = "wasm32", target_feature = "atomics"),
    feature(stdarch_wasm_atomic_wait)
)]

// Test code shared with the integration tests names the crate as they do.
#[cfg(test)]
extern crate self as onnx_generate;

pub mod audio;
pub mod cache;
pub mod chat;
pub mod config;
pub mod decoder;
pub mod error;
pub mod generate;
pub mod model;
pub mod npy;
pub mod processors;
pub mod search;
pub mod tokenizer;
pub mod vision;
#[cfg(target_arch = "wasm32")]
pub mod wasm;
pub mod whisper;

pub use chat::ChatTemplate;
pub use config::{EarlyStopping, GenerationConfig};
pub use decoder::{Decoder, DecoderState, Logits};
pub use error::{Error, Result};
pub use generate::{FinishReason, Generation, Output, Sequence, TokenEvent};
pub use model::{Model, ModelFiles};
pub use tokenizer::{TextStream, Tokenizer};
