// JavaScript side of the wasm binding (a wasm-bindgen snippet, shipped in pkg/snippets/):
// reading model files from bytes, Blobs, Responses and URLs with progress, yielding to the
// event loop, and the queue behind `stream()` and `readable()`.

/** The files `Model.load` reads, with whether each is required. */
const FILES = {
  model: true,
  external_data: false,
  config: true,
  generation_config: false,
  tokenizer: true,
  tokenizer_config: false,
  chat_template: false,
  encoder: false,
  encoder_external_data: false,
  preprocessor_config: false,
  // Vision-language models (transformers.js layout).
  embed_tokens: false,
  vision_encoder: false,
};

function describe(v) {
  if (v === null) return "null";
  if (Array.isArray(v)) return "an array";
  if (typeof v === "object") return (v.constructor && v.constructor.name) || "an object";
  return `${typeof v} ${String(v).slice(0, 40)}`;
}

function report(onProgress, file, loaded, total) {
  if (typeof onProgress === "function") onProgress({ file, loaded, total });
}

/**
 * What `readResponse` returns for a body it handed to `sink` chunk by chunk (the engine copies
 * each chunk into wasm memory as it arrives: no JavaScript copy of the whole file exists).
 */
const STREAMED = { streamed: true };

/**
 * The body of a Response as bytes, reporting progress as chunks arrive; with `sink`, each chunk
 * goes to `sink(file, chunk, total)` instead and the result is `STREAMED`.
 */
async function readResponse(response, file, onProgress, sink) {
  if (!response.ok) {
    throw new Error(`${file}: HTTP ${response.status} ${response.statusText} for ${response.url}`);
  }
  const length = Number(response.headers.get("content-length"));
  const total = Number.isFinite(length) && length > 0 ? length : null;
  if (!response.body) {
    const bytes = new Uint8Array(await response.arrayBuffer());
    report(onProgress, file, bytes.length, bytes.length);
    return bytes;
  }
  return readStream(response.body, total, file, onProgress, sink);
}

/** Bytes read at a time into one reused buffer by `readStreamInto`. */
const STREAM_BUFFER = 1 << 20;

/**
 * A byte stream handed to `sink` through one reused buffer (a BYOB reader): each chunk of a
 * default reader is a new buffer left to the garbage collector, and a 540 MB body read fast
 * kept hundreds of MB of them alive in Chromium.
 */
async function readStreamInto(reader, total, file, onProgress, sink) {
  let buffer = new ArrayBuffer(STREAM_BUFFER);
  let loaded = 0;
  report(onProgress, file, 0, total);
  for (;;) {
    const { done, value } = await reader.read(new Uint8Array(buffer));
    if (done) break;
    sink(file, value, total);
    loaded += value.length;
    report(onProgress, file, loaded, total);
    buffer = value.buffer;
  }
  if (loaded === 0) sink(file, new Uint8Array(0), 0);
  if (total !== loaded) report(onProgress, file, loaded, loaded);
  return STREAMED;
}

/** A ReadableStream of bytes (`total` of them when known), as `readResponse` reads a body. */
async function readStream(stream, total, file, onProgress, sink) {
  if (sink) {
    let byob = null;
    try {
      byob = stream.getReader({ mode: "byob" });
    } catch {
      // Not a byte stream: chunk by chunk below.
    }
    if (byob) return readStreamInto(byob, total, file, onProgress, sink);
  }
  const reader = stream.getReader();
  const chunks = [];
  let loaded = 0;
  report(onProgress, file, 0, total);
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (sink) sink(file, value, total);
    else chunks.push(value);
    loaded += value.length;
    report(onProgress, file, loaded, total);
  }
  if (sink) {
    if (loaded === 0) sink(file, new Uint8Array(0), 0);
    if (total !== loaded) report(onProgress, file, loaded, loaded);
    return STREAMED;
  }
  // A compressed transfer makes Content-Length differ from the bytes read: report the truth.
  if (total !== loaded) report(onProgress, file, loaded, loaded);
  if (chunks.length === 1) return chunks[0];
  const bytes = new Uint8Array(loaded);
  let at = 0;
  for (const c of chunks) {
    bytes.set(c, at);
    at += c.length;
  }
  return bytes;
}

/**
 * Bytes of a Blob read per slice by `readBlobSlices`. Each slice is a new ArrayBuffer, left to
 * the garbage collector once in wasm memory: in Node, fp32 SmolLM2 from a Blob in 2 MiB slices
 * peaked at 750-776 MiB of RSS, in 512 KiB slices at 738-752 MiB, in the same load time.
 */
const BLOB_SLICE = 512 << 10;

/** Slices of a Blob being read at once by `readBlobSlices` (4 MiB: as fast as 4 of 2 MiB). */
const BLOB_READS_AHEAD = 8;

/** A Blob handed to `sink` slice by slice, as `readStream` hands a body's chunks. */
async function readBlobSlices(blob, file, onProgress, sink) {
  const total = blob.size;
  report(onProgress, file, 0, total);
  if (total === 0) sink(file, new Uint8Array(0), 0);
  // Slices are read BLOB_READS_AHEAD ahead of the one being decoded: reading a slice of Node's
  // file-backed Blob waits on the disk thread (181 MB in 204 ms one slice at a time, 118 ms
  // three at a time, on 2 cores).
  const reads = [];
  let next = 0;
  const readMore = () => {
    while (reads.length < BLOB_READS_AHEAD && next < total) {
      reads.push(blob.slice(next, Math.min(total, next + BLOB_SLICE)).arrayBuffer());
      next += BLOB_SLICE;
    }
  };
  readMore();
  for (let at = 0; at < total; at += BLOB_SLICE) {
    const bytes = new Uint8Array(await reads.shift());
    readMore();
    sink(file, bytes, total);
    report(onProgress, file, Math.min(total, at + BLOB_SLICE), total);
  }
  return STREAMED;
}

/** One file from bytes, a Blob/File, a Response, a URL or a URL string. */
async function readSource(source, file, onProgress, sink) {
  if (source instanceof Uint8Array) {
    report(onProgress, file, source.length, source.length);
    return source;
  }
  if (source instanceof ArrayBuffer || ArrayBuffer.isView(source)) {
    const bytes =
      source instanceof ArrayBuffer
        ? new Uint8Array(source)
        : new Uint8Array(source.buffer, source.byteOffset, source.byteLength);
    report(onProgress, file, bytes.length, bytes.length);
    return bytes;
  }
  if (typeof Blob !== "undefined" && source instanceof Blob) {
    // A Blob (a File, or Node's `fs.openAsBlob`) goes into wasm memory with `sink`, a slice at
    // a time (larger than a stream's chunks: Node's 64 KiB chunks made a 540 MB load 0.7 s
    // slower than reading the whole file).
    if (sink && typeof source.slice === "function") {
      return readBlobSlices(source, file, onProgress, sink);
    }
    report(onProgress, file, 0, source.size);
    const bytes = new Uint8Array(await source.arrayBuffer());
    report(onProgress, file, bytes.length, bytes.length);
    return bytes;
  }
  if (typeof Response !== "undefined" && source instanceof Response) {
    return readResponse(source, file, onProgress, sink);
  }
  if (typeof source === "string" || source instanceof URL) {
    let response;
    try {
      response = await fetch(source);
    } catch (e) {
      throw new Error(`${file}: cannot fetch ${source}: ${e.message}`);
    }
    return readResponse(response, file, onProgress, sink);
  }
  throw new Error(
    `${file}: expected bytes (Uint8Array, ArrayBuffer), a Blob, a Response or a URL, got ${describe(source)}`,
  );
}

/** A chat template: its text (a string with `{{` or `{%`), or any source of its bytes. */
async function readText(source, file, onProgress) {
  if (typeof source === "string" && /\{[{%]/.test(source)) {
    return new TextEncoder().encode(source);
  }
  return readSource(source, file, onProgress);
}

/**
 * Read every file of `Model.load`: returns `{name: Uint8Array}` with `model_name`; with `sink`,
 * the bodies of Responses and URLs go to it chunk by chunk (their entries are `STREAMED`).
 * Unknown names are errors that list the valid ones.
 */
export async function readModelFiles(files, onProgress, sink) {
  if (files === null || typeof files !== "object" || Array.isArray(files)) {
    throw new Error(
      `Model.load expects an object of files {${Object.keys(FILES).join(", ")}}, got ${describe(files)}`,
    );
  }
  for (const name of Object.keys(files)) {
    if (!(name in FILES) && name !== "model_name") {
      throw new Error(`unknown model file \`${name}\`; valid names are: ${Object.keys(FILES).join(", ")}`);
    }
  }
  for (const [name, required] of Object.entries(FILES)) {
    if (required && files[name] == null) throw new Error(`the model file \`${name}\` is missing`);
  }
  const out = {};
  const reads = Object.keys(FILES)
    .filter((name) => files[name] != null)
    .map(async (name) => {
      const read = name === "chat_template" ? readText : readSource;
      out[name] = await read(files[name], name, onProgress, sink);
    });
  await Promise.all(reads);
  out.model_name = files.model_name || sourceName(files.model) || "model.onnx";
  return out;
}

function sourceName(source) {
  if (typeof source === "string" || source instanceof URL) {
    return String(source).split(/[?#]/)[0].split("/").pop();
  }
  if (source && typeof source.name === "string") return source.name;
  return null;
}

async function tryFetch(url) {
  try {
    const response = await fetch(url);
    if (response.ok) return response;
    if (response.body) await response.body.cancel();
    return null;
  } catch {
    return null;
  }
}

/**
 * The files of a model folder served under `base` (flat or transformers.js layout):
 * `onnx/model.onnx` or `model.onnx` (`model_{variant}.onnx` with a variant, or
 * `decoder_model_merged*.onnx`), its `.data`, `config.json`, `generation_config.json`,
 * `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`; for an encoder-decoder
 * also `encoder_model*.onnx` (and its `.data`) and `preprocessor_config.json`.
 */
export async function fetchModelFolder(base, variant, onProgress, sink) {
  let root = String(base);
  if (!root.endsWith("/")) root += "/";
  const suffix = variant && variant !== "fp32" ? `_${variant}` : "";
  const at = (name) => [`${root}onnx/${name}`, `${root}${name}`];
  const first = async (urls) => {
    for (const url of urls) {
      const response = await tryFetch(url);
      if (response) return { response, url };
    }
    return null;
  };
  // An encoder-decoder (Whisper, T5, ...): encoder_model.onnx with the merged decoder.
  const encoder = await first(at(`encoder_model${suffix}.onnx`));
  const names = encoder
    ? [`decoder_model_merged${suffix}.onnx`]
    : [`model${suffix}.onnx`, `decoder_model_merged${suffix}.onnx`];
  const candidates = names.flatMap(at);
  const found = await first(candidates);
  if (!found) {
    if (encoder && encoder.response.body) await encoder.response.body.cancel();
    throw new Error(`no ONNX model under ${root} (tried ${candidates.join(", ")})`);
  }
  const { response: model, url: modelUrl } = found;
  const modelName = modelUrl.split("/").pop();
  const files = { model_name: modelName, model };
  if (encoder) files.encoder = encoder.response;
  const optional = {
    external_data: [`${modelUrl}.data`, `${modelUrl}_data`],
    generation_config: [`${root}generation_config.json`],
    tokenizer_config: [`${root}tokenizer_config.json`],
    chat_template: [`${root}chat_template.jinja`],
    preprocessor_config: [`${root}preprocessor_config.json`],
    embed_tokens: [`${root}onnx/embed_tokens${suffix}.onnx`, `${root}embed_tokens${suffix}.onnx`],
    vision_encoder: [`${root}onnx/vision_encoder${suffix}.onnx`, `${root}vision_encoder${suffix}.onnx`],
  };
  if (encoder) optional.encoder_external_data = [`${encoder.url}.data`, `${encoder.url}_data`];
  const required = { config: `${root}config.json`, tokenizer: `${root}tokenizer.json` };
  await Promise.all([
    ...Object.entries(required).map(async ([name, url]) => {
      const r = await tryFetch(url);
      if (!r) throw new Error(`${name}: ${url} could not be fetched`);
      files[name] = r;
    }),
    ...Object.entries(optional).map(async ([name, urls]) => {
      for (const url of urls) {
        const r = await tryFetch(url);
        if (r) {
          files[name] = r;
          return;
        }
      }
    }),
  ]);
  return readModelFiles(files, onProgress, sink);
}

/** A promise that resolves on a later turn of the event loop (after timers and input). */
export function yieldToEventLoop() {
  return new Promise((resolve) => {
    if (typeof setImmediate === "function") {
      setImmediate(resolve);
    } else if (typeof MessageChannel !== "undefined") {
      const channel = new MessageChannel();
      channel.port1.onmessage = () => {
        channel.port1.close();
        resolve();
      };
      channel.port2.postMessage(null);
    } else {
      setTimeout(resolve, 0);
    }
  });
}

/**
 * The pixels of an image part: an `ImageBitmap` (or a canvas) is drawn into an OffscreenCanvas
 * and read back as an `ImageData` (RGBA); anything else is returned as it is.
 */
export function imagePixels(image) {
  const drawable =
    (typeof ImageBitmap !== "undefined" && image instanceof ImageBitmap) ||
    (typeof OffscreenCanvas !== "undefined" && image instanceof OffscreenCanvas) ||
    (typeof HTMLCanvasElement !== "undefined" && image instanceof HTMLCanvasElement);
  if (!drawable) return image;
  if (typeof OffscreenCanvas === "undefined") {
    throw new Error("reading an ImageBitmap needs OffscreenCanvas, which this runtime lacks");
  }
  const { width, height } = image;
  if (!width || !height) return { data: new Uint8Array(0), width, height };
  const ctx = new OffscreenCanvas(width, height).getContext("2d");
  ctx.drawImage(image, 0, 0);
  return ctx.getImageData(0, 0, width, height);
}

/** Whether an options object's `signal` is aborted (any object with `aborted`). */
export function isAborted(signal) {
  return Boolean(signal && signal.aborted);
}

/**
 * The queue between a generation and `stream()` / `readable()`: `options` gets an `on_token`
 * that fills the queue (calling the caller's too) and a `signal` that also fires when the
 * consumer stops reading early.
 */
export function tokenQueue(options) {
  const userOnToken = options && options.on_token;
  const userSignal = options && options.signal;
  const controller = new AbortController();
  if (userSignal) {
    if (userSignal.aborted) controller.abort(userSignal.reason);
    else userSignal.addEventListener("abort", () => controller.abort(userSignal.reason), { once: true });
  }
  const events = [];
  let waiters = [];
  let done = false;
  let failed = false;
  let failure;
  const wake = () => {
    const w = waiters;
    waiters = [];
    for (const f of w) f();
  };
  const next = async () => {
    for (;;) {
      if (events.length) return { value: events.shift(), done: false };
      if (failed) {
        failed = false;
        throw failure;
      }
      if (done) return { value: undefined, done: true };
      await new Promise((r) => waiters.push(r));
    }
  };
  const queueOptions = Object.assign({}, options || {}, {
    signal: controller.signal,
    on_token(event) {
      if (typeof userOnToken === "function") userOnToken(event);
      events.push(event);
      wake();
    },
  });
  return {
    options: queueOptions,
    attach(promise) {
      promise.then(
        () => {
          done = true;
          wake();
        },
        (e) => {
          failed = true;
          failure = e;
          done = true;
          wake();
        },
      );
    },
    iterator() {
      const it = {
        next,
        async return() {
          controller.abort();
          done = true;
          events.length = 0;
          return { value: undefined, done: true };
        },
        [Symbol.asyncIterator]() {
          return it;
        },
      };
      return it;
    },
    readable() {
      const encoder = new TextEncoder();
      return new ReadableStream({
        async pull(c) {
          for (;;) {
            const r = await next();
            if (r.done) {
              c.close();
              return;
            }
            if (r.value.text) {
              c.enqueue(encoder.encode(r.value.text));
              return;
            }
          }
        },
        cancel() {
          controller.abort();
        },
      });
    },
  };
}
