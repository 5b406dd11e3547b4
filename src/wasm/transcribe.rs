//! `model.transcribe(pcm, options)`: speech to text with a Whisper model, streaming token
//! events like `generate` and resolving like it (one sequence per 30 s window).

use js_sys::{Float32Array, Object, Promise, Reflect};
use serde_json::json;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{future_to_promise, JsFuture};

use super::{
    describe, event_to_js, get, invalid, is_aborted, js_error, parse_options, sequence_json, to_js,
    yield_to_event_loop, JsModel, Loaded,
};
use crate::whisper::{TranscribeOptions, TranscriptionOutput};

/// Options of `transcribe` that are not generation options.
const AUDIO_OPTIONS: [&str; 3] = ["language", "task", "sampling_rate"];

#[wasm_bindgen(js_class = Model)]
impl JsModel {
    /// Transcribe mono PCM; resolves with the text of every 30 s window.
    pub fn transcribe(&self, pcm: JsValue, options: JsValue) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move { transcribe(&inner, &pcm, &options).await })
    }
}

/// A string option (`language`, `task`), absent when undefined or null.
fn string_option(options: &JsValue, name: &str) -> Result<Option<String>, JsValue> {
    let v = get(options, name);
    if v.is_undefined() || v.is_null() {
        return Ok(None);
    }
    v.as_string()
        .map(Some)
        .ok_or_else(|| invalid(format!("`{name}` must be a string, got {}", describe(&v))))
}

async fn transcribe(inner: &Loaded, pcm: &JsValue, options: &JsValue) -> Result<JsValue, JsValue> {
    let model = &inner.model;
    let Some(samples) = pcm.dyn_ref::<Float32Array>() else {
        return Err(invalid(format!(
            "transcribe expects the audio as a Float32Array of mono samples in [-1, 1], got {}",
            describe(pcm)
        )));
    };
    let samples = samples.to_vec();
    let is_options = options.is_object() && !js_sys::Array::is_array(options);
    let (language, task, rate, rest) = if is_options {
        let rate = get(options, "sampling_rate");
        let rate = if rate.is_undefined() || rate.is_null() {
            None
        } else {
            match rate.as_f64() {
                Some(r) if r >= 1.0 && r.fract() == 0.0 && r <= u32::MAX as f64 => Some(r as usize),
                _ => {
                    return Err(invalid(format!(
                        "`sampling_rate` must be a positive whole number of Hz, got {}",
                        describe(&rate)
                    )))
                }
            }
        };
        // The generation options: everything else (on_token and signal included).
        let rest = Object::new();
        for key in Object::keys(options.unchecked_ref::<Object>()).iter() {
            let name = key.as_string().unwrap_or_default();
            if !AUDIO_OPTIONS.contains(&name.as_str()) {
                Reflect::set(&rest, &key, &get(options, &name))?;
            }
        }
        (
            string_option(options, "language")?,
            string_option(options, "task")?,
            rate,
            JsValue::from(rest),
        )
    } else {
        (None, None, None, options.clone())
    };
    let options = parse_options(&rest)?;
    // Raw samples are taken to be at the model's rate unless `sampling_rate` says otherwise, as
    // transformers' ASR pipeline assumes for arrays; another rate is resampled.
    let rate = match rate {
        Some(r) => r,
        None => model.sampling_rate().map_err(js_error)?,
    };
    let mut transcription = model
        .transcribe(
            &samples,
            rate,
            TranscribeOptions {
                language,
                task,
                generation: options.generation,
            },
        )
        .map_err(js_error)?;
    drop(samples);
    loop {
        if is_aborted(&options.signal) {
            transcription.abort(model).map_err(js_error)?;
            break;
        }
        if transcription.is_finished() {
            break;
        }
        let events = transcription.step(model).map_err(js_error)?;
        if let Some(on_token) = &options.on_token {
            for event in &events {
                on_token.call1(&JsValue::UNDEFINED, &event_to_js(event)?)?;
            }
        }
        JsFuture::from(yield_to_event_loop()).await?;
    }
    output_to_js(&transcription.output())
}

/// Like `generate`'s result: the whole transcription at the top level, and
/// `sequences[window][0]` for each 30 s window.
fn output_to_js(out: &TranscriptionOutput) -> Result<JsValue, JsValue> {
    let windows: Vec<_> = out
        .windows
        .iter()
        .map(|s| json!([sequence_json(s)]))
        .collect();
    to_js(&json!({
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason.as_str(),
        "sequences": windows,
    }))
}

#[wasm_bindgen(typescript_custom_section)]
const TYPES: &'static str = r#"
/** The files of an encoder-decoder model (Whisper: `model` is `decoder_model_merged.onnx`). */
export interface ModelFileSources {
  /** `encoder_model.onnx` of an encoder-decoder model. */
  encoder?: FileSource;
  /** The encoder's external data (`encoder_model.onnx.data`), if it has one. */
  encoder_external_data?: FileSource;
  /** `preprocessor_config.json`: Whisper's feature extractor settings (mel bins, sample rate). */
  preprocessor_config?: FileSource;
}

/** Options of `transcribe`: the audio's settings, then any option of `generate`. */
export interface TranscribeOptions extends GenerateOptions {
  /**
   * A language code (`"en"`, `"fr"`) or token (`"<|en|>"`); without it the language is detected
   * from the audio of each window (the most likely language token, as transformers does).
   */
  language?: string | null;
  /** `"transcribe"` (default) or `"translate"` (into English). */
  task?: "transcribe" | "translate" | null;
  /**
   * Sample rate of `pcm` in Hz. Default: the model's (16000 for Whisper), as transformers'
   * pipeline assumes for raw arrays. Audio at another rate (44100 or 48000 from a microphone
   * or a decoded file) is resampled to the model's rate.
   */
  sampling_rate?: number | null;
}

/**
 * The result of `transcribe`, shaped like `generate`'s: the whole transcription at the top
 * level, and `sequences[window][0]` for each 30 s window.
 */
export interface TranscribeResult extends GenerateResult {}

export interface Model {
  /**
   * Transcribe (or translate) mono audio with a Whisper model, in consecutive 30 s windows.
   * Token events stream through `on_token` as with `generate`; their `row` is the window index.
   * `signal` stops after the current step and resolves with `finish_reason: "abort"`. Empty
   * audio, samples that are not finite numbers, or a model without an audio encoder reject
   * with an Error.
   */
  transcribe(pcm: Float32Array, options?: TranscribeOptions): Promise<TranscribeResult>;
}
"#;
