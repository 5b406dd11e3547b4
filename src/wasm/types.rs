//! TypeScript declarations of the JavaScript API (the Rust exports are `skip_typescript`, so
//! these are the declarations `pkg/onnx_generate.d.ts` carries).

use wasm_bindgen::prelude::*;

#[wasm_bindgen(typescript_custom_section)]
const TYPES: &'static str = r#"
/** Bytes of a file, or where to read them: a Blob/File, a fetch `Response`, or a URL (these three are streamed into wasm memory as they are read; in Node, `fs.openAsBlob(path)` reads a file that way). */
export type FileSource = Uint8Array | ArrayBuffer | ArrayBufferView | Blob | Response | URL | string;

/** The files of a model for `Model.load`. */
export interface ModelFileSources {
  /** The ONNX graph (`model.onnx`, `model_q4.onnx`, `decoder_model_merged.onnx`, ...). */
  model: FileSource;
  /** `model.onnx.data`, when the graph keeps its weights in an external file. */
  external_data?: FileSource;
  /** `config.json`. */
  config: FileSource;
  /** `generation_config.json`; without it the generation fields of `config.json` are used. */
  generation_config?: FileSource;
  /** `tokenizer.json`. */
  tokenizer: FileSource;
  /** `tokenizer_config.json`: its `chat_template` and special tokens are used for chat input. */
  tokenizer_config?: FileSource;
  /** `chat_template.jinja`, or the template text itself (a string with `{{` or `{%`). */
  chat_template?: FileSource;
  /** Name of the ONNX file, used in messages (default: taken from the URL or File name). */
  model_name?: string;
  /** Vision-language models: `preprocessor_config.json` (the image processor's settings). */
  preprocessor_config?: FileSource;
  /** Vision-language models: `onnx/embed_tokens.onnx` (a decoder that reads inputs_embeds). */
  embed_tokens?: FileSource;
  /** Vision-language models: `onnx/vision_encoder.onnx`. */
  vision_encoder?: FileSource;
}

/** Progress of one file while loading. */
export interface LoadProgress {
  /** Which file: `model`, `external_data`, `config`, `generation_config`, `tokenizer`, ... */
  file: string;
  /** Bytes read so far. */
  loaded: number;
  /** Size of the file, or `null` when the server did not say (no Content-Length). */
  total: number | null;
}

/** Options of `Model.load` and `Model.fromUrl`. */
export interface LoadOptions {
  /** Called as bytes arrive, per file; `loaded === total` when a file is complete. */
  on_progress?: (progress: LoadProgress) => void;
  /** `Model.fromUrl` only: ONNX variant, e.g. `"q4"` reads `onnx/model_q4.onnx`. */
  variant?: string;
}

/** One chat message, as transformers' `apply_chat_template` takes it. */
export interface ChatMessage {
  role: "system" | "user" | "assistant" | "tool" | string;
  /** Text, or parts: `{type: "text", text}` and, for a vision-language model, `{type: "image",
   * image}` with an `ImageData`, an `ImageBitmap` or `{data, width, height}` (RGBA bytes). */
  content: string | ChatContentPart[];
  [key: string]: unknown;
}

/**
 * What to generate from: text (encoded with special tokens, as transformers' tokenizer call
 * does), token ids, chat messages (rendered with the model's chat template with
 * `add_generation_prompt`), or a batch of texts or of token-id lists.
 */
export type GenerateInput = string | number[] | ChatMessage[] | string[] | number[][];

/**
 * A custom logits processor, called once per row per step with:
 * - `tokenIds`: the row's sequence so far, as transformers' `input_ids` holds it: the prompt
 *   then the generated tokens (for an encoder-decoder, the decoder sequence from
 *   `decoder_start_token_id`). A fresh copy the function may keep.
 * - `logits`: the row's scores as the processors before it left them (`vocabSize` values; in
 *   beam search, log-probabilities, as transformers gives its processors). A copy: edit it in
 *   place, or return a new `Float32Array` of the same length to replace it.
 * Set a score to `-Infinity` to forbid a token.
 */
export type LogitsProcessor = (tokenIds: Uint32Array, logits: Float32Array) => void | Float32Array;

/**
 * Options of `generate`, `stream` and `readable`: the fields of `generation_config.json`
 * (snake_case, as transformers names them) override the model's generation config for this
 * request. An unknown name rejects with an Error that lists the valid ones.
 */
/** A part of a chat message's content. */
export type ChatContentPart =
  | { type: "text"; text: string }
  | { type: "image"; image?: ImageData | ImageBitmap | { data: Uint8Array | Uint8ClampedArray; width: number; height: number } };

export interface GenerateOptions {
  /** Maximum number of new tokens (at least 1). */
  max_new_tokens?: number | null;
  /** Maximum length of prompt plus new tokens (used when `max_new_tokens` is not set). */
  max_length?: number | null;
  /** Minimum length of prompt plus new tokens before eos is allowed. */
  min_length?: number | null;
  /** Minimum number of new tokens before eos is allowed. */
  min_new_tokens?: number | null;
  /** Sample instead of choosing the most likely token. */
  do_sample?: boolean | null;
  /** Sampling temperature (with `do_sample`). */
  temperature?: number | null;
  /** Keep the k most likely tokens (with `do_sample`; 0 disables). */
  top_k?: number | null;
  /** Nucleus sampling: keep the smallest set of tokens whose probability reaches p. */
  top_p?: number | null;
  /** Keep tokens whose probability is at least `min_p` times the top one. */
  min_p?: number | null;
  /** Locally typical sampling mass. */
  typical_p?: number | null;
  epsilon_cutoff?: number | null;
  eta_cutoff?: number | null;
  /** Penalty (> 1 discourages) for tokens already in the sequence, prompt included. */
  repetition_penalty?: number | null;
  /** Forbid repeating any n-gram of this size. */
  no_repeat_ngram_size?: number | null;
  /** Token sequences that must not be generated. */
  bad_words_ids?: number[][] | null;
  /** `[token ids, bias]` pairs added to the scores when the sequence would be completed. */
  sequence_bias?: [number[], number][] | null;
  /** Tokens whose score is set to -infinity. */
  suppress_tokens?: number[] | null;
  /** Tokens suppressed at the first generated position. */
  begin_suppress_tokens?: number[] | null;
  forced_bos_token_id?: number | null;
  forced_eos_token_id?: number | number[] | null;
  exponential_decay_length_penalty?: [number, number] | null;
  /** Beam search width (1: no beam search). */
  num_beams?: number | null;
  num_return_sequences?: number | null;
  length_penalty?: number | null;
  early_stopping?: boolean | "never" | null;
  /** Apply log-softmax after all processors. */
  renormalize_logits?: boolean | null;
  /** Stop when the text ends with one of these strings. */
  stop_strings?: string | string[] | null;
  /** Token id(s) that end a sequence. */
  eos_token_id?: number | number[] | null;
  pad_token_id?: number | null;
  bos_token_id?: number | null;
  /** Record the processed score and log-probability of each chosen token. */
  output_scores?: boolean | null;
  /** Alias of `output_scores`. */
  token_logprobs?: boolean | null;
  /** Also record the N most likely tokens of each step with their log-probabilities. */
  top_logprobs?: number | null;
  /**
   * Seed of the sampler: the same seed gives the same tokens. One number `s` seeds row `r`
   * with `s + r`; a list gives one seed per row.
   */
  seed?: number | number[] | null;
  /**
   * Custom logits processors (one function or a list), applied in order where transformers
   * applies `generate(logits_processor=...)`: after the built-in processors (after
   * `begin_suppress_tokens`) and before the sampling warpers (`temperature`, `top_k`,
   * `top_p`, ...). A processor that throws, or returns an array of another length, rejects
   * the request with an Error naming its index (a thrown exception is the Error's `cause`);
   * the model stays usable.
   */
  logits_processor?: LogitsProcessor | LogitsProcessor[] | null;
  /** Called once per new token, in order. Throwing ends the request with that exception. */
  on_token?: (event: TokenEvent) => void;
  /**
   * Stops generation after the current step: the promise then RESOLVES with
   * `finish_reason: "abort"` and the tokens so far (it does not reject); the model stays
   * usable and the request's memory is released.
   */
  signal?: AbortSignal;
  /**
   * Vision-language models: the rows that replace the prompts' image tokens (those of prompt 0
   * in order, then prompt 1's, ...): a tensor `{data: Float32Array, dims: [rows, hidden]}` (a
   * transformers.js Tensor works) or a list of rows.
   */
  image_features?: { data: Float32Array; dims: number[] } | number[][];
  /** Vision-language models: per prompt, its positions (or 3 lists for M-RoPE). */
  position_ids?: (number[] | number[][])[];
  /** Qwen2-VL: `[t, h, w]` per image; the engine computes the M-RoPE positions from it. */
  image_grid_thw?: number[][];
  /** Chat input with images: settings of preprocessor_config.json to override. */
  processor_options?: Record<string, unknown>;
  [field: string]: unknown;
}

/** Why a sequence stopped. */
export type FinishReason = "eos" | "length" | "stop_string" | "abort";

/** One new token of one row. */
export interface TokenEvent {
  /** The prompt (row of the batch) the token belongs to; 0 for a single prompt. */
  row: number;
  /** The new token id (the eos token id on an eos step). */
  token_id: number;
  /**
   * The new text: the deltas of a row concatenate to its final `text`. Empty while a
   * character is split over several tokens, and for an eos token.
   */
  text: string;
  /** True on the row's last event. */
  finished: boolean;
  /** Why the row stopped, on its last event; otherwise null. */
  finish_reason: FinishReason | null;
  /** With `output_scores`: log-probability of the token. */
  logprob?: number;
  /** With `top_logprobs`: the most likely tokens of this step, `[token_id, logprob]`. */
  top_logprobs?: [number, number][];
}

/** One generated sequence. */
export interface GeneratedSequence {
  /** New token ids, without the prompt and without the eos token. */
  token_ids: number[];
  /** Their text (special tokens skipped). */
  text: string;
  finish_reason: FinishReason;
  /** With `output_scores`: the processed score of each chosen token. */
  scores?: number[];
  /** With `output_scores`: the log-probability of each chosen token. */
  logprobs?: number[];
  /** Beam search: the hypothesis score. */
  sequence_score?: number;
  /** With `top_logprobs`: per step, the most likely tokens `[token_id, logprob]`. */
  top_logprobs?: [number, number][][];
}

/** The result of `generate`: the first sequence of the first prompt, and all of them. */
export interface GenerateResult extends GeneratedSequence {
  /** `sequences[prompt][returned sequence]`. */
  sequences: GeneratedSequence[][];
}

/**
 * A loaded decoder-only ONNX language model. Every failure is a rejected promise (or a thrown
 * Error for the synchronous methods) whose message names the bad input; after an error or an
 * abort the model generates correctly again.
 */
export class Model {
  private constructor();
  /** Free the model's memory now (otherwise it is freed when garbage collected). */
  free(): void;
  /** Load a model from its files; `on_progress` reports bytes read per file. */
  static load(files: ModelFileSources, options?: LoadOptions): Promise<Model>;
  /**
   * Load the model folder served under `base` (flat or transformers.js layout): the ONNX file
   * (`onnx/model.onnx` or `model.onnx`, `model_{variant}.onnx` with a variant, or
   * `decoder_model_merged.onnx`) and its `.data`, `config.json`, `generation_config.json`,
   * `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`.
   */
  static fromUrl(base: string | URL, options?: LoadOptions): Promise<Model>;
  /** Generate. Control returns to the event loop between steps. */
  generate(input: GenerateInput, options?: GenerateOptions): Promise<GenerateResult>;
  /** The token events as an async iterator (`for await`); breaking out stops generation. */
  stream(input: GenerateInput, options?: GenerateOptions): AsyncIterableIterator<TokenEvent>;
  /** The text as a stream of UTF-8 bytes, for `new Response(model.readable(...))`. */
  readable(input: GenerateInput, options?: GenerateOptions): ReadableStream<Uint8Array>;
  /** Token ids of a text (`add_special_tokens` defaults to true). */
  encode(text: string, add_special_tokens?: boolean): Uint32Array;
  /** Text of token ids, special tokens skipped. */
  decode(ids: Uint32Array | number[]): string;
  /** The prompt text of chat messages (`add_generation_prompt` defaults to true). */
  applyChatTemplate(messages: ChatMessage[], add_generation_prompt?: boolean): string;
  /** Whether the model has a chat template. */
  readonly hasChatTemplate: boolean;
  /** Width of the model's logits. */
  readonly vocabSize: number;
  /** The model's generation config (main fields). */
  readonly generationConfig: GenerateOptions;
}
"#;
