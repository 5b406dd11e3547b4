//! The JavaScript API (wasm32 only): conversions, callbacks, promises and errors over the pure
//! Rust core. The generation loop is `Generation`; between its steps control returns to the
//! event loop. File reading, the event queue of `stream()` and `readable()` live in
//! `js/helpers.js` (a wasm-bindgen snippet). The TypeScript declarations are in `types.rs`.

mod processors;
mod transcribe;
mod types;
mod vision;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use js_sys::{Array, Function, Object, Promise, Reflect, Uint8Array, JSON};
use serde_json::{json, Map, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{future_to_promise, JsFuture};

use crate::chat::ChatTemplate;
use crate::error::Error;
use crate::generate::{Generation, Output, Sequence, TokenEvent};
use crate::model::onnx::{Decoded, StreamDecoder};
use crate::model::{Model, ModelFiles};

/// The threads build (`threads` feature): `initThreadPool(n)` starts `n` workers sharing the
/// module's memory; call it once after `init()`, before loading a model.
#[cfg(feature = "threads")]
pub use wasm_bindgen_rayon::init_thread_pool;

/// The threads build: the multiply-accumulates from which a matmul is split across the threads
/// (default 262144; 0 splits every one, as the tests do on the tiny fixtures).
#[cfg(feature = "threads")]
#[wasm_bindgen(js_name = setParallelThreshold)]
pub fn set_parallel_threshold(macs: f64) -> Result<(), JsError> {
    if !(macs >= 0.0 && macs.fract() == 0.0 && macs <= u32::MAX as f64) {
        return Err(JsError::new(&format!(
            "setParallelThreshold: {macs} is not a count of multiply-accumulates (a whole number from 0)"
        )));
    }
    crate::model::ops::parallel::set_threshold(macs as usize);
    Ok(())
}

#[wasm_bindgen(module = "/js/helpers.js")]
extern "C" {
    #[wasm_bindgen(catch, js_name = readModelFiles)]
    async fn read_model_files(
        files: JsValue,
        on_progress: JsValue,
        sink: &JsValue,
    ) -> Result<JsValue, JsValue>;
    #[wasm_bindgen(catch, js_name = fetchModelFolder)]
    async fn fetch_model_folder(
        base: JsValue,
        variant: JsValue,
        on_progress: JsValue,
        sink: &JsValue,
    ) -> Result<JsValue, JsValue>;
    #[wasm_bindgen(js_name = yieldToEventLoop)]
    fn yield_to_event_loop() -> Promise;
    #[wasm_bindgen(js_name = isAborted)]
    fn is_aborted(signal: &JsValue) -> bool;
    #[wasm_bindgen(catch, js_name = imagePixels)]
    fn image_pixels(image: &JsValue) -> Result<JsValue, JsValue>;
    #[wasm_bindgen(js_name = tokenQueue)]
    fn token_queue(options: &JsValue) -> TokenQueue;

    type TokenQueue;
    #[wasm_bindgen(method, getter)]
    fn options(this: &TokenQueue) -> JsValue;
    #[wasm_bindgen(method)]
    fn attach(this: &TokenQueue, promise: &Promise);
    #[wasm_bindgen(method)]
    fn iterator(this: &TokenQueue) -> JsValue;
    #[wasm_bindgen(method)]
    fn readable(this: &TokenQueue) -> JsValue;
}

/// A JavaScript `Error` with the message of a core error.
fn js_error(e: Error) -> JsValue {
    JsError::new(&e.to_string()).into()
}

fn invalid(message: String) -> JsValue {
    js_error(Error::InvalidInput(message))
}

fn get(obj: &JsValue, key: &str) -> JsValue {
    Reflect::get(obj, &JsValue::from_str(key)).unwrap_or(JsValue::UNDEFINED)
}

/// A JSON value as a plain JavaScript value.
fn to_js(v: &Value) -> Result<JsValue, JsValue> {
    JSON::parse(&v.to_string())
}

/// The loaded model and its chat template, shared by the requests in flight.
struct Loaded {
    model: Model,
    chat: Option<ChatTemplate>,
}

/// A loaded model (see the TypeScript declarations for the documentation of each method).
#[wasm_bindgen(js_name = Model, skip_typescript)]
pub struct JsModel {
    inner: Rc<Loaded>,
}

/// The files whose bodies `js/helpers.js` streams into wasm memory chunk by chunk (Responses and
/// URLs): no JavaScript copy of a whole file is made, so a model fetched from a URL is held once
/// (here) until it is decoded, not also in the JavaScript heap. The decoder graph (`model`), an
/// encoder-decoder's encoder (`encoder`) and a vision-language model's `embed_tokens` and
/// `vision_encoder` are decoded as they arrive (`onnx::StreamDecoder`), their large initializers
/// straight into the buffers of their tensors: their bytes are never held whole, and their
/// weights once.
struct Received {
    files: Rc<RefCell<HashMap<String, Incoming>>>,
    /// `sink(file, chunk, total)` for `js/helpers.js`; alive while the files are read.
    sink: Closure<dyn FnMut(String, Uint8Array, JsValue)>,
}

/// A file as it arrives.
enum Incoming {
    Bytes(Vec<u8>),
    /// A decoder keeps its first error and reports it when it finishes.
    Onnx(Box<StreamDecoder>),
}

/// The file decoded as it streams in: the decoder graph.
const STREAMED_GRAPH: &str = "model";

/// An encoder-decoder's encoder graph, also decoded as it streams in.
const STREAMED_ENCODER: &str = "encoder";

/// A vision-language model's embeddings and vision encoder, also decoded as they stream in.
const STREAMED_EMBED_TOKENS: &str = "embed_tokens";
const STREAMED_VISION_ENCODER: &str = "vision_encoder";

/// How much of a file given as bytes is copied into wasm memory at a time for the decoder.
const FEED_CHUNK: u32 = 1 << 20;

/// Grows wasm memory by `bytes` at once, for a file about to be decoded into it: the allocator
/// (dlmalloc) grows the memory by what each allocation lacks, and each `memory.grow` costs about
/// 1.4 ms in V8 whatever its size (Node 20: 4000 pages one at a time took 5.5 s, sixteen at a time
/// 0.25 s), so one per initializer of a large model added up to most of a second. The block is
/// freed at once, to the allocator's free top that the next allocations are carved from: the
/// file's weights fill it, so the memory ends no larger. Nothing happens when it cannot grow.
fn reserve_heap(bytes: usize) {
    let mut room = Vec::<u8>::new();
    if room.try_reserve_exact(bytes).is_ok() {
        std::hint::black_box(&mut room);
    }
}

/// Feed `chunk` to the decoder through `staging` (wasm memory); an error stays in the decoder.
fn feed(decoder: &mut StreamDecoder, chunk: &Uint8Array, staging: &mut Vec<u8>) {
    staging.resize(chunk.length() as usize, 0);
    chunk.copy_to(staging);
    let _ = decoder.feed(staging);
}

impl Received {
    fn new() -> Received {
        let files: Rc<RefCell<HashMap<String, Incoming>>> = Rc::default();
        let into = files.clone();
        let mut staging = Vec::new();
        let sink = Closure::new(move |file: String, chunk: Uint8Array, total: JsValue| {
            let mut files = into.borrow_mut();
            let incoming = files.entry(file.clone()).or_insert_with(|| {
                // The announced length, so the buffer is not regrown (each regrowth would hold
                // the old and the new buffer at once); a length that cannot be reserved (a wrong
                // Content-Length) is not, rather than aborting the instance.
                let total = total.as_f64().filter(|t| *t > 0.0).unwrap_or(0.0) as usize;
                let streamed = [
                    STREAMED_GRAPH,
                    STREAMED_ENCODER,
                    STREAMED_EMBED_TOKENS,
                    STREAMED_VISION_ENCODER,
                ];
                if streamed.contains(&file.as_str()) {
                    reserve_heap(total);
                    return Incoming::Onnx(Box::new(StreamDecoder::new_apart(&file)));
                }
                let mut bytes = Vec::new();
                let _ = bytes.try_reserve_exact(total);
                Incoming::Bytes(bytes)
            });
            match incoming {
                Incoming::Bytes(bytes) => {
                    let at = bytes.len();
                    bytes.resize(at + chunk.length() as usize, 0);
                    chunk.copy_to(&mut bytes[at..]);
                }
                Incoming::Onnx(decoder) => feed(decoder, &chunk, &mut staging),
            }
        });
        Received { files, sink }
    }

    fn sink(&self) -> &JsValue {
        self.sink.as_ref()
    }

    /// The bytes of file `name`: given as bytes (`Uint8Array` in `read`), or streamed here.
    fn take(&self, read: &JsValue, name: &str) -> Option<Vec<u8>> {
        let v = get(read, name);
        match v.dyn_ref::<Uint8Array>() {
            Some(bytes) => Some(bytes.to_vec()),
            None => match self.files.borrow_mut().remove(name) {
                Some(Incoming::Bytes(bytes)) => Some(bytes),
                _ => None,
            },
        }
    }

    /// The decoder graph, decoded: streamed here, or given as bytes (fed to the decoder a
    /// slice at a time, so wasm memory never holds the whole file either). `file_name`: for
    /// messages.
    fn take_graph(
        &self,
        read: &JsValue,
        name: &str,
        file_name: &str,
    ) -> Result<Option<Decoded>, Error> {
        let v = get(read, name);
        if let Some(bytes) = v.dyn_ref::<Uint8Array>() {
            reserve_heap(bytes.length() as usize);
            let mut decoder = StreamDecoder::new_apart(file_name);
            let mut staging = Vec::new();
            let mut at = 0;
            while at < bytes.length() {
                let end = bytes.length().min(at + FEED_CHUNK);
                feed(&mut decoder, &bytes.subarray(at, end), &mut staging);
                at = end;
            }
            return decoder.finish().map(Some);
        }
        // The sink makes a decoder for this file's chunks (never bytes).
        let Some(Incoming::Onnx(mut decoder)) = self.files.borrow_mut().remove(name) else {
            return Ok(None);
        };
        decoder.set_file_name(file_name);
        decoder.finish().map(Some)
    }
}

/// `Model.load(files, options)` as a Rust future (the tests call it directly).
pub async fn load_model(files: JsValue, options: JsValue) -> Result<JsModel, JsValue> {
    let on_progress = get(&options, "on_progress");
    let received = Received::new();
    let bytes = read_model_files(files, on_progress, received.sink()).await?;
    model_from_bytes(&bytes, &received)
}

/// `Model.fromUrl(base, options)` as a Rust future.
pub async fn load_model_from_url(base: JsValue, options: JsValue) -> Result<JsModel, JsValue> {
    if !(base.is_string() || base.is_instance_of::<js_sys::Object>()) {
        return Err(invalid(format!(
            "Model.fromUrl expects the URL of a model folder, got {}",
            describe(&base)
        )));
    }
    let received = Received::new();
    let bytes = fetch_model_folder(
        base,
        get(&options, "variant"),
        get(&options, "on_progress"),
        received.sink(),
    )
    .await?;
    model_from_bytes(&bytes, &received)
}

fn model_from_bytes(bytes: &JsValue, received: &Received) -> Result<JsModel, JsValue> {
    let file = |name: &str| received.take(bytes, name);
    let required = |name: &str| {
        file(name)
            .ok_or_else(|| js_error(Error::Model(format!("the model file `{name}` is missing"))))
    };
    let model_name = get(bytes, "model_name")
        .as_string()
        .unwrap_or_else(|| "model.onnx".into());
    let files = ModelFiles {
        model_proto: Some(
            received
                .take_graph(bytes, STREAMED_GRAPH, &model_name)
                .map_err(js_error)?
                .ok_or_else(|| {
                    js_error(Error::Model("the model file `model` is missing".into()))
                })?,
        ),
        model_name,
        external_data: file("external_data"),
        config: required("config")?,
        generation_config: file("generation_config"),
        tokenizer: required("tokenizer")?,
        encoder_proto: received
            .take_graph(bytes, STREAMED_ENCODER, "encoder_model.onnx")
            .map_err(js_error)?,
        encoder_external_data: file("encoder_external_data"),
        preprocessor_config: file("preprocessor_config"),
        embed_tokens_proto: received
            .take_graph(bytes, STREAMED_EMBED_TOKENS, "embed_tokens.onnx")
            .map_err(js_error)?,
        vision_encoder_proto: received
            .take_graph(bytes, STREAMED_VISION_ENCODER, "vision_encoder.onnx")
            .map_err(js_error)?,
        ..ModelFiles::default()
    };
    let model = Model::load_owned(files).map_err(js_error)?;
    let chat = ChatTemplate::from_files(
        file("chat_template").as_deref(),
        file("tokenizer_config").as_deref(),
    )
    .map_err(js_error)?;
    Ok(JsModel {
        inner: Rc::new(Loaded { model, chat }),
    })
}

#[wasm_bindgen(js_class = Model)]
impl JsModel {
    /// Load a model from its files (bytes, Blobs, Responses or URLs).
    pub fn load(files: JsValue, options: JsValue) -> Promise {
        future_to_promise(async move { load_model(files, options).await.map(JsValue::from) })
    }

    /// Load the model folder served under a URL prefix.
    #[wasm_bindgen(js_name = fromUrl)]
    pub fn from_url(base: JsValue, options: JsValue) -> Promise {
        future_to_promise(
            async move { load_model_from_url(base, options).await.map(JsValue::from) },
        )
    }

    /// Generate; resolves with the result (finish reason `abort` when the signal fired).
    pub fn generate(&self, input: JsValue, options: JsValue) -> Promise {
        let inner = self.inner.clone();
        future_to_promise(async move { run(&inner, &input, &options).await })
    }

    /// The tokens as an async iterator of events.
    pub fn stream(&self, input: JsValue, options: JsValue) -> JsValue {
        let queue = token_queue(&options);
        queue.attach(&self.generate(input, queue.options()));
        queue.iterator()
    }

    /// The text as a `ReadableStream` of UTF-8 bytes.
    pub fn readable(&self, input: JsValue, options: JsValue) -> JsValue {
        let queue = token_queue(&options);
        queue.attach(&self.generate(input, queue.options()));
        queue.readable()
    }

    /// Token ids of a text (`add_special_tokens` defaults to true, as transformers does).
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: Option<bool>,
    ) -> Result<Vec<u32>, JsValue> {
        self.inner
            .model
            .tokenizer
            .encode(text, add_special_tokens.unwrap_or(true))
            .map_err(js_error)
    }

    /// Text of token ids (special tokens skipped).
    pub fn decode(&self, ids: Vec<u32>) -> Result<String, JsValue> {
        self.inner.model.tokenizer.decode(&ids).map_err(js_error)
    }

    /// Render chat messages with the model's chat template.
    #[wasm_bindgen(js_name = applyChatTemplate)]
    pub fn apply_chat_template(
        &self,
        messages: JsValue,
        add_generation_prompt: Option<bool>,
    ) -> Result<String, JsValue> {
        render_chat(
            &self.inner,
            &messages,
            add_generation_prompt.unwrap_or(true),
        )
    }

    /// Whether the model has a chat template.
    #[wasm_bindgen(getter, js_name = hasChatTemplate)]
    pub fn has_chat_template(&self) -> bool {
        self.inner.chat.is_some()
    }

    /// Width of the logits.
    #[wasm_bindgen(getter, js_name = vocabSize)]
    pub fn vocab_size(&self) -> usize {
        self.inner.model.vocab_size()
    }

    /// The model's generation config (`generation_config.json` as the engine read it).
    #[wasm_bindgen(getter, js_name = generationConfig)]
    pub fn generation_config(&self) -> Result<JsValue, JsValue> {
        let c = &self.inner.model.generation_config;
        to_js(&json!({
            "max_length": c.max_length,
            "max_new_tokens": c.max_new_tokens,
            "do_sample": c.do_sample,
            "temperature": c.temperature,
            "top_k": c.top_k,
            "top_p": c.top_p,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_ids(),
            "pad_token_id": c.pad_token_id,
        }))
    }
}

fn describe(v: &JsValue) -> String {
    if v.is_undefined() {
        return "undefined".into();
    }
    if let Some(s) = v.as_string() {
        let short: String = s.chars().take(40).collect();
        return format!("the string {short:?}");
    }
    if Array::is_array(v) {
        return "an array".into();
    }
    match JSON::stringify(v).ok().and_then(|s| s.as_string()) {
        Some(s) => s.chars().take(60).collect(),
        None => v.js_typeof().as_string().unwrap_or_default(),
    }
}

fn render_chat(
    inner: &Loaded,
    messages: &JsValue,
    add_generation_prompt: bool,
) -> Result<String, JsValue> {
    let Some(chat) = &inner.chat else {
        return Err(invalid(
            "chat messages were given but the model has no chat template (give \
             `chat_template` or a `tokenizer_config` with one to Model.load)"
                .into(),
        ));
    };
    let text = JSON::stringify(messages)
        .ok()
        .and_then(|s| s.as_string())
        .ok_or_else(|| invalid("chat messages cannot be written as JSON".into()))?;
    chat.render_json(&text, add_generation_prompt)
        .map_err(js_error)
}

/// The prompts of an input: text, token ids, chat messages, or a list of texts or of id lists.
fn prompts_of(inner: &Loaded, input: &JsValue) -> Result<Vec<Vec<u32>>, JsValue> {
    const EXPECTED: &str = "input must be text, token ids, chat messages [{role, content}], \
         or a list of texts or of token-id lists";
    let tokenizer = &inner.model.tokenizer;
    if let Some(text) = input.as_string() {
        return Ok(vec![tokenizer.encode(&text, true).map_err(js_error)?]);
    }
    let Some(list) = input.dyn_ref::<Array>() else {
        return Err(invalid(format!("{EXPECTED}, got {}", describe(input))));
    };
    let items: Vec<JsValue> = list.iter().collect();
    let Some(first) = items.first() else {
        return Err(invalid(
            "input is an empty list: give text, token ids or chat messages".into(),
        ));
    };
    if first.as_f64().is_some() {
        return Ok(vec![token_ids(&items, None)?]);
    }
    if first.is_string() {
        return items
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_string() {
                Some(text) => tokenizer.encode(&text, true).map_err(js_error),
                None => Err(invalid(format!(
                    "input {i} must be text like input 0, got {}",
                    describe(t)
                ))),
            })
            .collect();
    }
    if Array::is_array(first) {
        return items
            .iter()
            .enumerate()
            .map(|(i, p)| match p.dyn_ref::<Array>() {
                Some(a) => token_ids(&a.iter().collect::<Vec<_>>(), Some(i)),
                None => Err(invalid(format!(
                    "input {i} must be a list of token ids like input 0, got {}",
                    describe(p)
                ))),
            })
            .collect();
    }
    if first.is_object() {
        let text = render_chat(inner, input, true)?;
        // transformers' apply_chat_template(tokenize=True) encodes with add_special_tokens=False.
        return Ok(vec![tokenizer.encode(&text, false).map_err(js_error)?]);
    }
    Err(invalid(format!(
        "{EXPECTED}, got a list of {}",
        describe(first)
    )))
}

fn token_ids(items: &[JsValue], prompt: Option<usize>) -> Result<Vec<u32>, JsValue> {
    let which = prompt
        .map(|p| format!(" of prompt {p}"))
        .unwrap_or_default();
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_f64() {
            Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => Ok(x as u32),
            _ => Err(invalid(format!(
                "token id at position {i}{which} must be a non-negative integer, got {}",
                describe(v)
            ))),
        })
        .collect()
}

/// The options of a request: the callbacks, and the generation options as JSON.
struct Options {
    on_token: Option<Function>,
    signal: JsValue,
    /// `logits_processor`: JavaScript functions (see `processors.rs`).
    logits_processor: JsValue,
    generation: Map<String, Value>,
}

fn parse_options(options: &JsValue) -> Result<Options, JsValue> {
    if options.is_undefined() || options.is_null() {
        return Ok(Options {
            on_token: None,
            signal: JsValue::UNDEFINED,
            logits_processor: JsValue::UNDEFINED,
            generation: Map::new(),
        });
    }
    if !options.is_object() || Array::is_array(options) || options.is_function() {
        return Err(invalid(format!(
            "options must be an object of generation_config.json fields, got {}",
            describe(options)
        )));
    }
    let on_token = get(options, "on_token");
    let on_token = if on_token.is_undefined() || on_token.is_null() {
        None
    } else {
        Some(on_token.dyn_into::<Function>().map_err(|v| {
            invalid(format!(
                "`on_token` must be a function, got {}",
                describe(&v)
            ))
        })?)
    };
    let signal = get(options, "signal");
    if !(signal.is_undefined() || signal.is_null() || get(&signal, "aborted").as_bool().is_some()) {
        return Err(invalid(format!(
            "`signal` must be an AbortSignal, got {}",
            describe(&signal)
        )));
    }
    // The rest are generation_config.json fields: copy them, as JSON, for the core to check.
    let rest = Object::new();
    for key in Object::keys(options.unchecked_ref::<Object>()).iter() {
        let name = key.as_string().unwrap_or_default();
        if name == "on_token"
            || name == "signal"
            || name == processors::OPTION
            || vision::OPTION_NAMES.contains(&name.as_str())
        {
            continue;
        }
        let value = get(options, &name);
        if value.is_undefined() {
            continue;
        }
        if value.is_function() || value.is_symbol() || value.is_bigint() {
            return Err(invalid(format!(
                "option `{name}` must be a JSON value (number, boolean, string, list), got a {}",
                value.js_typeof().as_string().unwrap_or_default()
            )));
        }
        if let Some(x) = value.as_f64() {
            if !x.is_finite() {
                return Err(invalid(format!(
                    "option `{name}` must be a finite number, got {x}"
                )));
            }
        }
        Reflect::set(&rest, &key, &value)?;
    }
    let text = JSON::stringify(&rest)?
        .as_string()
        .ok_or_else(|| invalid("options cannot be written as JSON".into()))?;
    let generation: Map<String, Value> = serde_json::from_str(&text)
        .map_err(|e| invalid(format!("options are not valid JSON values: {e}")))?;
    Ok(Options {
        on_token,
        signal,
        logits_processor: get(options, processors::OPTION),
        generation,
    })
}

fn event_to_js(e: &TokenEvent) -> Result<JsValue, JsValue> {
    let o = Object::new();
    Reflect::set(&o, &"row".into(), &(e.row as f64).into())?;
    Reflect::set(&o, &"token_id".into(), &e.token_id.into())?;
    Reflect::set(&o, &"text".into(), &e.text.as_str().into())?;
    Reflect::set(&o, &"finished".into(), &e.finished.is_some().into())?;
    let reason = e
        .finished
        .map(|f| JsValue::from_str(f.as_str()))
        .unwrap_or(JsValue::NULL);
    Reflect::set(&o, &"finish_reason".into(), &reason)?;
    if let Some(lp) = e.logprob {
        Reflect::set(&o, &"logprob".into(), &lp.into())?;
    }
    if let Some(top) = &e.top_logprobs {
        Reflect::set(&o, &"top_logprobs".into(), &to_js(&json!(top))?)?;
    }
    Ok(o.into())
}

/// One sequence of a result, as JSON.
fn sequence_json(s: &Sequence) -> Value {
    let mut v = json!({
        "token_ids": s.token_ids,
        "text": s.text,
        "finish_reason": s.finish_reason.as_str(),
    });
    if let (Some(scores), Some(lps)) = (&s.scores, &s.logprobs) {
        v["scores"] = json!(scores);
        v["logprobs"] = json!(lps);
    }
    if let Some(score) = s.sequence_score {
        v["sequence_score"] = json!(score);
    }
    if let Some(top) = &s.top_logprobs {
        v["top_logprobs"] = json!(top);
    }
    v
}

fn output_to_js(out: &Output) -> Result<JsValue, JsValue> {
    let sequences: Vec<Value> = out
        .sequences
        .iter()
        .map(|row| Value::Array(row.iter().map(sequence_json).collect()))
        .collect();
    let first = sequences
        .first()
        .and_then(|r| r.get(0))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let mut result = first;
    result["sequences"] = Value::Array(sequences);
    to_js(&result)
}

/// One request: step the generation, sending events, yielding to the event loop between steps.
async fn run(inner: &Loaded, input: &JsValue, js_options: &JsValue) -> Result<JsValue, JsValue> {
    let options = parse_options(js_options)?;
    let (prompts, images) = vision::prompts_and_images(inner, input, js_options)?;
    let model = &inner.model;
    let thrown = processors::Thrown::default();
    let custom = processors::parse(&options.logits_processor, &thrown).map_err(js_error)?;
    let mut generation =
        Generation::with_images(model, &prompts, &images, &options.generation, custom)
            .map_err(js_error)?;
    loop {
        if is_aborted(&options.signal) {
            // Stop and release the cache now; the result keeps the tokens so far.
            generation.abort();
            break;
        }
        if generation.is_finished() {
            break;
        }
        let events = generation.step(model).map_err(|e| {
            // A processor that threw: its exception is the `cause` of the error.
            let error = js_error(e);
            if let Some(exception) = thrown.borrow_mut().take() {
                let _ = Reflect::set(&error, &"cause".into(), &exception);
            }
            error
        })?;
        if let Some(on_token) = &options.on_token {
            for event in &events {
                // An exception in the callback ends the request with that exception.
                on_token.call1(&JsValue::UNDEFINED, &event_to_js(event)?)?;
            }
        }
        JsFuture::from(yield_to_event_loop()).await?;
    }
    output_to_js(&generation.output(model).map_err(js_error)?)
}
