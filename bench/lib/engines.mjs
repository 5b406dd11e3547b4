// One timed generation with each engine, the same code in Node and in the browser page. The
// caller passes the loaded JavaScript modules and a `load` function for the environment
// (bytes from disk in Node, URLs in the page); this file only times and collects.
//
// Both engines: greedy (or with `sample`, sampling with `SAMPLING`), exactly `newTokens` new
// tokens (min_new_tokens = max_new_tokens, so an end-of-sequence token cannot stop either
// early), the prompt rendered and tokenized by each engine itself (the chat template is given
// to transformers.js explicitly: it does not read chat_template.jinja), once to count its ids
// before the timed call and again inside it (so both engines' template and tokenizer code has
// run once when the timing starts). Times come from the streaming callback of each engine:
//   load      start of loading (runtime init included) to a ready model
//   ttft      generate() called to the first new token (tokenization + prefill + one step)
//   decode    the time between consecutive new tokens, 2..N (median)
//   again     the same prompt once more for one token, generate() called to that token: the
//             prefill once the engine's code has run (V8 compiles a wasm function's optimised
//             code while its baseline code runs, so the first prompt of a process pays for it)

const now = () => performance.now();

/** Options shared by both engines for exactly `n` greedy tokens. */
function greedy(n) {
  return { max_new_tokens: n, min_new_tokens: n, do_sample: false };
}

/** The sampling settings of `--sample` (transformers' default `top_k`, a usual temperature). */
export const SAMPLING = { do_sample: true, top_k: 50, temperature: 0.7 };

/** Options for exactly `n` tokens, greedy or sampled. */
function tokens(n, sample) {
  return sample ? { ...greedy(n), ...SAMPLING } : greedy(n);
}

function median(xs) {
  if (xs.length === 0) return null;
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Milliseconds from calling `run(onToken)` to its first `onToken()`. */
async function msToFirstToken(run) {
  const start = now();
  let first = null;
  await run(() => {
    first ??= now() - start;
  });
  return first;
}

/** The figures of one run from its token times (ms since generate() was called). */
function figures({ loadMs, startedAt, times, againMs, promptIds, tokenIds, text, newTokens, extra }) {
  const ttft = times.length > 0 ? times[0] - startedAt : null;
  const gaps = times.slice(1).map((t, i) => t - times[i]);
  const decodeMs = median(gaps);
  return {
    load_ms: loadMs,
    ttft_ms: ttft,
    prompt_tokens: promptIds.length,
    prefill_tps: ttft ? (promptIds.length * 1000) / ttft : null,
    again_ms: againMs,
    prefill_again_tps: againMs ? (promptIds.length * 1000) / againMs : null,
    decode_ms: decodeMs,
    decode_tps: decodeMs ? 1000 / decodeMs : null,
    new_tokens: tokenIds.length,
    complete: tokenIds.length === newTokens,
    prompt_ids: promptIds,
    token_ids: tokenIds,
    text,
    ...extra,
  };
}

/**
 * onnx-generate. `load()` resolves with a `Model` (runtime init included). `input` is chat
 * messages or text. Generation stops early (finish_reason "abort") once `budgetMs` has passed,
 * so a slow variant still reports its load time and the tokens it made.
 */
export async function runOnnxGenerate({ load, input, newTokens, sample = false, budgetMs = Infinity }) {
  const t0 = now();
  const model = await load();
  const loadMs = now() - t0;
  // The prompt's ids before the timed call (transformers.js' runs count theirs the same way).
  const promptIds =
    typeof input === "string"
      ? model.encode(input, true)
      : model.encode(model.applyChatTemplate(input, true), false);
  const times = [];
  const controller = new AbortController();
  const startedAt = now();
  const result = await model.generate(input, {
    ...tokens(newTokens, sample),
    signal: controller.signal,
    on_token: () => {
      times.push(now());
      if (now() - startedAt > budgetMs) controller.abort();
    },
  });
  const againMs = await msToFirstToken((onToken) => model.generate(input, { ...greedy(1), on_token: onToken }));
  return figures({
    loadMs,
    startedAt,
    times,
    againMs,
    promptIds,
    tokenIds: result.token_ids,
    text: result.text,
    newTokens,
    extra: { finish_reason: result.finish_reason },
  });
}

/**
 * transformers.js (stopped after `budgetMs` like onnx-generate): `tjs` is the imported module (its onnxruntime-web backend already set up by
 * the caller), `modelId` a folder under `env.localModelPath`, `dtype` its file suffix
 * (fp32, fp16, q4, q8). `sessionOptions` go to from_pretrained.
 */
export async function runTransformersJs({
  tjs,
  modelId,
  dtype,
  device,
  sessionOptions,
  input,
  chatTemplate,
  newTokens,
  sample = false,
  budgetMs = Infinity,
}) {
  const t0 = now();
  const tokenizer = await tjs.AutoTokenizer.from_pretrained(modelId);
  const model = await tjs.AutoModelForCausalLM.from_pretrained(modelId, {
    dtype,
    device,
    session_options: sessionOptions,
  });
  const loadMs = now() - t0;

  const times = [];
  let sawPrompt = false;
  const budget = new tjs.InterruptableStoppingCriteria();
  // transformers.js calls put() with the prompt first, then with each new token.
  class Timer extends tjs.BaseStreamer {
    put() {
      if (sawPrompt) {
        times.push(now());
        if (now() - startedAt > budgetMs) budget.interrupt();
      }
      sawPrompt = true;
    }
    end() {}
  }
  const tokenize = () =>
    typeof input === "string"
      ? tokenizer(input)
      : tokenizer.apply_chat_template(input, {
          chat_template: chatTemplate,
          add_generation_prompt: true,
          return_dict: true,
        });
  // The prompt's ids before the timed call, as for onnx-generate (which counts them with
  // encode()): both engines' template and tokenizer have run once when the timing starts.
  const promptIds = Array.from(tokenize().input_ids.data, Number);
  const startedAt = now();
  const inputs = tokenize();
  const output = await model.generate({
    ...inputs,
    ...tokens(newTokens, sample),
    streamer: new Timer(),
    stopping_criteria: [budget],
  });
  const tokenIds = output.tolist()[0].slice(promptIds.length).map(Number);
  const text = tokenizer.decode(tokenIds, { skip_special_tokens: true });
  const againMs = await msToFirstToken(async (onToken) => {
    // put() is called with the prompt first, then with the new token.
    let calls = 0;
    class Once extends tjs.BaseStreamer {
      put() {
        if (calls++ > 0) onToken();
      }
      end() {}
    }
    await model.generate({ ...tokenize(), ...greedy(1), streamer: new Once() });
  });
  await model.dispose?.();
  return figures({ loadMs, startedAt, times, againMs, promptIds, tokenIds, text, newTokens, extra: {} });
}

// Speech to text (Whisper): both engines transcribe the same mono PCM (a clip under 30 s is
// one window), greedy, the language given, task "transcribe", until end-of-text (the model's
// generation_config decides the rest, for both). Times:
//   load        start of loading (runtime init, processor / feature extractor included) to a ready model
//   transcribe  transcription called (log-mel features, encoder, decoding, text) to its result
//   ttft        transcription called to the first new token (log-mel + encoder + prompt step)
//   decode      the time between consecutive new tokens, 2..N (median)

/** The figures of one transcription. */
function speechFigures({ loadMs, startedAt, endedAt, times, audioSeconds, tokenIds, text, finishReason }) {
  const gaps = times.slice(1).map((t, i) => t - times[i]);
  const decodeMs = median(gaps);
  const transcribeMs = endedAt - startedAt;
  return {
    load_ms: loadMs,
    transcribe_ms: transcribeMs,
    audio_s: audioSeconds,
    rtf: transcribeMs / 1000 / audioSeconds,
    ttft_ms: times.length > 0 ? times[0] - startedAt : null,
    decode_ms: decodeMs,
    decode_tps: decodeMs ? 1000 / decodeMs : null,
    new_tokens: tokenIds.length,
    token_ids: tokenIds,
    text,
    finish_reason: finishReason,
  };
}

/**
 * onnx-generate's `model.transcribe`: `load()` resolves with a `Model` (runtime init
 * included), `pcm` is a Float32Array at `rate` Hz. Stops (finish_reason "abort") once
 * `budgetMs` has passed since transcription started.
 */
export async function runOnnxGenerateTranscribe({ load, pcm, rate, language, budgetMs = Infinity }) {
  const t0 = now();
  const model = await load();
  const loadMs = now() - t0;
  const times = [];
  const controller = new AbortController();
  const startedAt = now();
  const result = await model.transcribe(pcm, {
    language,
    task: "transcribe",
    sampling_rate: rate,
    do_sample: false,
    signal: controller.signal,
    on_token: () => {
      times.push(now());
      if (now() - startedAt > budgetMs) controller.abort();
    },
  });
  const endedAt = now();
  return speechFigures({
    loadMs,
    startedAt,
    endedAt,
    times,
    audioSeconds: pcm.length / rate,
    tokenIds: result.token_ids,
    text: result.text,
    finishReason: result.finish_reason,
  });
}

/**
 * transformers.js' Whisper: its processor (log-mel features) and
 * WhisperForConditionalGeneration.generate, what its automatic-speech-recognition pipeline
 * runs for a clip under 30 s, called directly so each token can be timed. `pcm` must be at the
 * processor's sampling rate (transformers.js does not resample; its pipeline expects 16 kHz).
 */
export async function runTransformersJsTranscribe({
  tjs,
  modelId,
  dtype,
  device,
  sessionOptions,
  pcm,
  rate,
  language,
  budgetMs = Infinity,
}) {
  const t0 = now();
  // WhisperProcessor: the feature extractor and the tokenizer.
  const processor = await tjs.AutoProcessor.from_pretrained(modelId);
  const model = await tjs.WhisperForConditionalGeneration.from_pretrained(modelId, {
    dtype,
    device,
    session_options: sessionOptions,
  });
  const loadMs = now() - t0;
  const expected = processor.feature_extractor.config.sampling_rate;
  if (rate !== expected) {
    throw new Error(`transformers.js: the audio is at ${rate} Hz, the model takes ${expected} Hz (it does not resample)`);
  }

  const times = [];
  let promptLength = null;
  const budget = new tjs.InterruptableStoppingCriteria();
  // generate() calls put() with the decoder prompt first, then with each new token.
  class Timer extends tjs.BaseStreamer {
    put(ids) {
      if (promptLength === null) {
        promptLength = ids[0].length;
        return;
      }
      times.push(now());
      if (now() - startedAt > budgetMs) budget.interrupt();
    }
    end() {}
  }
  const startedAt = now();
  const { input_features } = await processor(pcm);
  const output = await model.generate({
    inputs: input_features,
    language,
    task: "transcribe",
    do_sample: false,
    streamer: new Timer(),
    stopping_criteria: [budget],
  });
  // The new tokens without the end-of-text token (as onnx-generate's token_ids).
  const eos = [model.generation_config.eos_token_id].flat();
  let tokenIds = output.tolist()[0].slice(promptLength).map(Number);
  const ended = tokenIds.length > 0 && eos.includes(tokenIds.at(-1));
  if (ended) tokenIds = tokenIds.slice(0, -1);
  const text = processor.tokenizer.decode(tokenIds, { skip_special_tokens: true });
  const endedAt = now();
  await model.dispose?.();
  return speechFigures({
    loadMs,
    startedAt,
    endedAt,
    times,
    audioSeconds: pcm.length / rate,
    tokenIds,
    text,
    finishReason: ended ? "eos" : budget.interrupted ? "abort" : "length",
  });
}

/** The prompts of the batch benchmark (the same as examples/bench_batch.rs, natively). */
export const BATCH_TEXTS = [
  "The capital of France is",
  "Write a short poem about the sea.",
  "def fibonacci(n):",
  "Once upon a time, in a small village at the edge of a great forest, there lived",
  "List three uses of copper:",
  "Translate to German: good morning",
  "Why is the sky blue? Explain it to a child in two sentences.",
  "Hello",
];

/**
 * onnx-generate on batches of the first `rows` of BATCH_TEXTS, greedy, `newTokens` per row with
 * no eos, as examples/bench_batch.rs does natively: each size runs twice (the first run also
 * compiles the plan of that batch size), figures of the second (steady) run.
 */
export async function runOnnxGenerateBatches({ load, rowsList, newTokens }) {
  const t0 = now();
  const model = await load();
  const loadMs = now() - t0;
  const options = { max_new_tokens: newTokens, eos_token_id: null, do_sample: false };
  const timed = async (texts) => {
    let first = null;
    const start = now();
    const result = await model.generate(texts, {
      ...options,
      on_token: () => {
        if (first === null) first = now() - start;
      },
    });
    const total = now() - start;
    // sequences: one list per row (of num_return_sequences sequences).
    const tokens = result.sequences.reduce((n, row) => n + row[0].token_ids.length, 0);
    return { total, first: first ?? total, tokens };
  };
  const batches = [];
  for (const rows of rowsList) {
    const texts = BATCH_TEXTS.slice(0, rows);
    if (texts.length < rows) throw new Error(`batch of ${rows} rows: only ${BATCH_TEXTS.length} prompts`);
    const cold = await timed(texts);
    const steady = await timed(texts);
    batches.push({
      rows,
      first_run_s: cold.total / 1000,
      steady_s: steady.total / 1000,
      prefill_s: steady.first / 1000,
      tokens: steady.tokens,
      decode_tps: ((steady.tokens - rows) * 1000) / (steady.total - steady.first),
      total_tps: (steady.tokens * 1000) / steady.total,
    });
  }
  return { load_ms: loadMs, batches };
}
