// OpenAI-style `POST /v1/completions` and `POST /v1/chat/completions` over onnx-generate's
// JavaScript API, shared by the Cloudflare Worker (examples/worker) and the Deno server
// (examples/deno). It only uses web-standard APIs (Request, Response, ReadableStream,
// AbortController, TextEncoder), so both runtimes import this one file.
//
//   const handle = createHandler({ loadModel: () => Model.load(files), modelId: "llama" });
//   export default { fetch: handle };            // a Worker
//   Deno.serve({ hostname: "127.0.0.1" }, handle); // Deno
//
// What it does:
// * validates the request body (an unknown field, a value of the wrong type or out of range,
//   an unknown model or malformed JSON is a 400 with OpenAI's error body
//   `{error: {message, type, param, code}}`; the server keeps serving);
// * maps the OpenAI fields to the engine's generation options (see `mapRequest`);
// * answers `stream: true` with server-sent events (one chunk per token with its text, and its
//   log-probs when asked, then each choice's finish reason, then `data: [DONE]`), and
//   `stream: false` with one JSON body with `usage`;
// * stops the generation when the client goes away (the response stream is cancelled, or the
//   request's signal fires): the engine's AbortSignal.

/** An invalid request: answered with `status` and OpenAI's error body. */
export class RequestError extends Error {
  constructor(message, { param = null, code = null, status = 400, type = "invalid_request_error" } = {}) {
    super(message);
    this.param = param;
    this.code = code;
    this.status = status;
    this.type = type;
  }
}

const JSON_HEADERS = { "content-type": "application/json" };
const SSE_HEADERS = {
  "content-type": "text/event-stream; charset=utf-8",
  "cache-control": "no-cache",
  connection: "keep-alive",
};

function jsonResponse(body, status = 200) {
  return new Response(JSON.stringify(body), { status, headers: JSON_HEADERS });
}

/** OpenAI's error body. */
export function errorBody(e) {
  return { error: { message: e.message, type: e.type, param: e.param, code: e.code } };
}

function errorResponse(e) {
  return jsonResponse(errorBody(e), e.status);
}

/**
 * An engine error as a RequestError: the engine's messages start with the kind of error
 * (src/error.rs): a bad request is a 400, a failure of the model or backend a 500.
 */
function engineError(e) {
  if (e instanceof RequestError) return e;
  const message = String((e && e.message) || e);
  if (/^(invalid input|unsupported|tokenizer): /.test(message)) {
    return new RequestError(message, { code: "invalid_value" });
  }
  return new RequestError(message, { status: 500, type: "server_error", code: "engine_error" });
}

// ---------------------------------------------------------------------------------------------
// Request validation

const describe = (v) => (v === null ? "null" : Array.isArray(v) ? "an array" : `${typeof v} ${JSON.stringify(v)}`.slice(0, 60));

function check(ok, param, expected, value) {
  if (!ok) throw new RequestError(`\`${param}\` must be ${expected}, got ${describe(value)}`, { param, code: "invalid_value" });
}

function optNumber(body, name, { min, max, integer = false, minExclusive = false }) {
  const v = body[name];
  if (v === undefined || v === null) return undefined;
  const range = `${integer ? "an integer" : "a number"} ${minExclusive ? ">" : ">="} ${min}${max === undefined ? "" : ` and <= ${max}`}`;
  check(typeof v === "number" && Number.isFinite(v) && (!integer || Number.isInteger(v)), name, range, v);
  check(minExclusive ? v > min : v >= min, name, range, v);
  if (max !== undefined) check(v <= max, name, range, v);
  return v;
}

function optBoolean(body, name) {
  const v = body[name];
  if (v === undefined || v === null) return undefined;
  check(typeof v === "boolean", name, "a boolean", v);
  return v;
}

/** A field OpenAI has that this server does not implement: only its neutral value passes. */
function neutral(body, name, isNeutral, what) {
  const v = body[name];
  if (v === undefined || v === null || isNeutral(v)) return;
  throw new RequestError(`\`${name}\` is not supported by this server (${what})`, { param: name, code: "unsupported_parameter" });
}

const COMMON_FIELDS = [
  "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
  "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
  // Extensions other OpenAI-compatible servers (vLLM) also take.
  "top_k", "min_p", "repetition_penalty", "return_tokens_as_token_ids",
];
const FIELDS = {
  completions: new Set([...COMMON_FIELDS, "prompt", "echo", "suffix", "best_of"]),
  chat: new Set([...COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs"]),
};

/** The chat messages of a request, with text content. */
function chatMessages(messages) {
  check(Array.isArray(messages) && messages.length > 0, "messages", "a non-empty list of {role, content}", messages);
  return messages.map((m, i) => {
    const param = `messages[${i}]`;
    check(m !== null && typeof m === "object" && !Array.isArray(m), param, "an object {role, content}", m);
    check(typeof m.role === "string", `${param}.role`, "a string", m.role);
    let content = m.content;
    if (Array.isArray(content)) {
      // The list form: only text parts.
      content = content
        .map((part, j) => {
          check(part && part.type === "text" && typeof part.text === "string", `${param}.content[${j}]`, 'a text part {type: "text", text}', part);
          return part.text;
        })
        .join("");
    }
    check(typeof content === "string", `${param}.content`, "a string or a list of text parts", m.content);
    return { role: m.role, content };
  });
}

/** The prompts of a completions request as token-id lists. */
function completionPrompts(model, prompt) {
  const expected = "a string, a list of strings, a list of token ids or a list of token-id lists";
  const isIds = (a) => Array.isArray(a) && a.length > 0 && a.every((x) => Number.isInteger(x) && x >= 0);
  if (typeof prompt === "string") return [model.encode(prompt, true)];
  check(Array.isArray(prompt) && prompt.length > 0, "prompt", expected, prompt);
  if (prompt.every((p) => typeof p === "string")) return prompt.map((p) => model.encode(p, true));
  if (isIds(prompt)) return [Uint32Array.from(prompt)];
  check(prompt.every(isIds), "prompt", expected, prompt);
  return prompt.map((p) => Uint32Array.from(p));
}

/**
 * The engine request of an OpenAI request body:
 * - `prompt` (completions: text encoded with special tokens, or token ids) or `messages`
 *   (chat: rendered with the model's chat template, `add_generation_prompt`);
 * - `n` copies of each prompt as rows of one batch: choice `p * n + i` is row `p * n + i`;
 * - `max_tokens` (`max_completion_tokens`) -> `max_new_tokens` (completions default 16, as
 *   OpenAI; chat: the model's generation config);
 * - `temperature` 0 -> greedy (`do_sample: false`); otherwise sampling with `temperature`,
 *   `top_p` and `top_k` 0 (OpenAI has no top-k; the extension `top_k` sets one). OpenAI's
 *   default temperature is 1;
 * - `seed` -> `seed` (row r samples with seed + r), `stop` -> `stop_strings` (the text is cut
 *   before the stop string, as OpenAI does), `logit_bias` -> `sequence_bias` of one-token
 *   sequences, `logprobs` / `top_logprobs` -> `token_logprobs` / `top_logprobs`.
 */
export function mapRequest(model, body, kind, modelId) {
  check(body !== null && typeof body === "object" && !Array.isArray(body), "body", "a JSON object", body);
  for (const name of Object.keys(body)) {
    if (!FIELDS[kind].has(name)) {
      throw new RequestError(`Unrecognized request argument supplied: ${name}`, { param: name, code: "unknown_parameter" });
    }
  }
  check(typeof body.model === "string", "model", "the name of the model (a string)", body.model);
  if (body.model !== modelId) {
    throw new RequestError(`The model \`${body.model}\` does not exist; this server serves \`${modelId}\``, {
      param: "model",
      code: "model_not_found",
    });
  }
  const chat = kind === "chat";
  const stream = optBoolean(body, "stream") ?? false;
  const n = optNumber(body, "n", { min: 1, max: 16, integer: true }) ?? 1;
  const maxTokens =
    optNumber(body, "max_completion_tokens", { min: 1, integer: true }) ??
    optNumber(body, "max_tokens", { min: 1, integer: true }) ??
    (chat ? undefined : 16);
  const temperature = optNumber(body, "temperature", { min: 0, max: 2 }) ?? 1;
  const topP = optNumber(body, "top_p", { min: 0, max: 1, minExclusive: true });
  const topK = optNumber(body, "top_k", { min: 0, integer: true });
  const minP = optNumber(body, "min_p", { min: 0, max: 1 });
  const repetitionPenalty = optNumber(body, "repetition_penalty", { min: 0, minExclusive: true });
  const seed = optNumber(body, "seed", { min: 0, max: Number.MAX_SAFE_INTEGER, integer: true });
  const tokenIds = optBoolean(body, "return_tokens_as_token_ids") ?? false;
  neutral(body, "presence_penalty", (v) => v === 0, "only 0");
  neutral(body, "frequency_penalty", (v) => v === 0, "only 0; `repetition_penalty` is the engine's penalty");
  neutral(body, "echo", (v) => v === false, "only false");
  neutral(body, "suffix", (v) => v === "", "no insertion");
  neutral(body, "best_of", (v) => v === n, "only best_of = n");

  let includeUsage = false;
  if (body.stream_options !== undefined && body.stream_options !== null) {
    check(typeof body.stream_options === "object" && !Array.isArray(body.stream_options), "stream_options", "an object {include_usage}", body.stream_options);
    includeUsage = optBoolean(body.stream_options, "include_usage") ?? false;
  }

  let stop = body.stop ?? [];
  if (typeof stop === "string") stop = [stop];
  check(Array.isArray(stop) && stop.length <= 4 && stop.every((s) => typeof s === "string" && s.length > 0), "stop", "a non-empty string or a list of up to 4", body.stop);

  // Log-probs: completions `logprobs: k` (0..5: the chosen token and the k most likely);
  // chat `logprobs: true` with `top_logprobs: k` (0..20).
  let logprobs = false;
  let topLogprobs = 0;
  if (chat) {
    logprobs = optBoolean(body, "logprobs") ?? false;
    topLogprobs = optNumber(body, "top_logprobs", { min: 0, max: 20, integer: true }) ?? 0;
    if (topLogprobs > 0 && !logprobs) {
      throw new RequestError("`top_logprobs` needs `logprobs: true`", { param: "top_logprobs", code: "invalid_value" });
    }
  } else {
    const k = optNumber(body, "logprobs", { min: 0, max: 5, integer: true });
    logprobs = k !== undefined;
    topLogprobs = k ?? 0;
  }

  let logitBias;
  if (body.logit_bias !== undefined && body.logit_bias !== null) {
    check(typeof body.logit_bias === "object" && !Array.isArray(body.logit_bias), "logit_bias", "an object {token id: bias}", body.logit_bias);
    logitBias = Object.entries(body.logit_bias).map(([id, bias]) => {
      check(/^\d+$/.test(id), "logit_bias", "keyed by token ids", id);
      check(typeof bias === "number" && bias >= -100 && bias <= 100, `logit_bias.${id}`, "a number in [-100, 100]", bias);
      return [[Number(id)], bias];
    });
  }

  let prompts;
  if (chat) {
    const text = model.applyChatTemplate(chatMessages(body.messages), true);
    // transformers' apply_chat_template(tokenize=True) encodes without special tokens.
    prompts = [model.encode(text, false)];
  } else {
    prompts = completionPrompts(model, body.prompt);
  }
  const rows = prompts.flatMap((p) => Array.from({ length: n }, () => Array.from(p)));

  const options = {};
  if (maxTokens !== undefined) options.max_new_tokens = maxTokens;
  if (temperature === 0) {
    options.do_sample = false;
  } else {
    Object.assign(options, { do_sample: true, temperature, top_k: topK ?? 0 });
    if (topP !== undefined) options.top_p = topP;
    if (minP !== undefined) options.min_p = minP;
  }
  if (repetitionPenalty !== undefined) options.repetition_penalty = repetitionPenalty;
  if (seed !== undefined) options.seed = seed;
  if (stop.length) options.stop_strings = stop;
  if (logitBias && logitBias.length) options.sequence_bias = logitBias;
  if (logprobs) {
    options.token_logprobs = true;
    if (topLogprobs > 0) options.top_logprobs = topLogprobs;
  }
  return { rows, promptTokens: rows.reduce((s, r) => s + r.length, 0), options, stream, includeUsage, stop, logprobs, topLogprobs, tokenIds, chat };
}

// ---------------------------------------------------------------------------------------------
// One choice: text deltas with stop strings cut, log-probs

/** Where the first stop string starts in `text` at or after `from`, or -1. */
function firstStop(text, stops, from) {
  let best = -1;
  for (const s of stops) {
    const i = text.indexOf(s, from);
    if (i >= 0 && (best < 0 || i < best)) best = i;
  }
  return best;
}

/** How many characters at the end of `text` could begin a stop string (held back). */
function heldBack(text, stops) {
  let held = 0;
  for (const s of stops) {
    for (let k = Math.min(s.length - 1, text.length); k > held; k--) {
      if (text.endsWith(s.slice(0, k))) {
        held = k;
        break;
      }
    }
  }
  return held;
}

const FINISH = { eos: "stop", stop_string: "stop", length: "length", abort: "abort" };

class Choice {
  constructor(index, stops) {
    this.index = index;
    this.stops = stops;
    this.maxStop = Math.max(0, ...stops.map((s) => s.length));
    this.text = ""; // everything the engine produced
    this.sent = 0; // characters of `text` given out
    this.finish = null;
    this.tokens = 0;
    this.logprobs = []; // {id, logprob, top, offset}
  }

  /** The delta of one token event: `{text, logprob, finish}` (null once the choice ended). */
  push(event) {
    this.tokens++;
    if (this.finish) return null;
    let logprob = null;
    const eos = event.finished && event.finish_reason === "eos";
    if (event.logprob !== undefined && !eos) {
      logprob = { id: event.token_id, logprob: event.logprob, top: event.top_logprobs || [], offset: this.text.length };
      this.logprobs.push(logprob);
    }
    this.text += event.text;
    let end;
    const stop = this.stops.length ? firstStop(this.text, this.stops, Math.max(0, this.sent - this.maxStop)) : -1;
    if (stop >= 0) {
      end = stop;
      this.finish = "stop";
    } else if (event.finished) {
      end = this.text.length;
      this.finish = FINISH[event.finish_reason] || "stop";
    } else {
      end = this.text.length - heldBack(this.text.slice(this.sent), this.stops);
    }
    const text = this.text.slice(this.sent, Math.max(end, this.sent));
    this.sent = Math.max(end, this.sent);
    return { text, logprob, finish: this.finish };
  }

  /** The text given out (stop string cut). */
  get output() {
    return this.text.slice(0, this.sent);
  }
}

// ---------------------------------------------------------------------------------------------
// Response formats

/** Token strings: the token's text, or `token_id:N` with `return_tokens_as_token_ids`. */
function tokenNamer(model, asIds) {
  const cache = new Map();
  return (id) => {
    if (asIds) return `token_id:${id}`;
    let s = cache.get(id);
    if (s === undefined) {
      s = model.decode([id]);
      cache.set(id, s);
    }
    return s;
  };
}

const utf8 = (s) => Array.from(new TextEncoder().encode(s));

/** Log-probs of tokens in the completions format. */
function completionLogprobs(items, name) {
  return {
    tokens: items.map((t) => name(t.id)),
    token_logprobs: items.map((t) => t.logprob),
    top_logprobs: items.map((t) => Object.fromEntries(t.top.map(([id, lp]) => [name(id), lp]))),
    text_offset: items.map((t) => t.offset),
  };
}

/** Log-probs of tokens in the chat format. */
function chatLogprobs(items, name, top) {
  return {
    content: items.map((t) => {
      const token = name(t.id);
      return {
        token,
        logprob: t.logprob,
        bytes: utf8(token),
        top_logprobs: t.top.slice(0, top).map(([id, lp]) => ({ token: name(id), logprob: lp, bytes: utf8(name(id)) })),
      };
    }),
    refusal: null,
  };
}

function usage(req, choices) {
  const completion = choices.reduce((s, c) => s + c.tokens, 0);
  return { prompt_tokens: req.promptTokens, completion_tokens: completion, total_tokens: req.promptTokens + completion };
}

// ---------------------------------------------------------------------------------------------
// The handler

/** Counters of the generations (served at `GET /debug/stats` when `debug` is set). */
function newStats() {
  return { requests: 0, active: 0, completed: 0, aborted: 0, failed: 0, tokens: 0, last_aborted_tokens: null };
}

/**
 * The request handler: `(request, context?) => Promise<Response>`; `context.waitUntil` (a
 * Worker's ExecutionContext) keeps a generation running after its client went away.
 * - `loadModel()`: resolves with a loaded `Model` (called once, on the first request that needs
 *   it; a failed load is retried by the next request);
 * - `modelId`: the name requests must give in `model`;
 * - `debug`: also serve `GET /debug/stats` (generation counters, wasm memory size);
 * - `memoryBytes()`: the wasm memory size, for the stats.
 */
export function createHandler({ loadModel, modelId, debug = false, memoryBytes = () => null }) {
  const stats = newStats();
  let loading = null;
  const model = () => {
    if (!loading) {
      loading = Promise.resolve()
        .then(loadModel)
        .catch((e) => {
          loading = null;
          throw new RequestError(`the model could not be loaded: ${e.message}`, { status: 500, type: "server_error", code: "model_load_failed" });
        });
    }
    return loading;
  };

  async function complete(request, kind, waitUntil) {
    const text = await request.text();
    let body;
    try {
      body = JSON.parse(text);
    } catch (e) {
      throw new RequestError(`We could not parse the JSON body of your request: ${e.message}`, { code: "invalid_json" });
    }
    const m = await model();
    let req;
    try {
      req = mapRequest(m, body, kind, modelId);
    } catch (e) {
      throw engineError(e);
    }
    return generate(m, req, request.signal, waitUntil);
  }

  /** Run one request: a streamed response or one JSON body. */
  async function generate(m, req, requestSignal, waitUntil) {
    const controller = new AbortController();
    if (requestSignal) {
      if (requestSignal.aborted) controller.abort();
      else requestSignal.addEventListener("abort", () => controller.abort(), { once: true });
    }
    const choices = req.rows.map((_, i) => new Choice(i, req.stop));
    const id = `${req.chat ? "chatcmpl" : "cmpl"}-${crypto.randomUUID()}`;
    const created = Math.floor(Date.now() / 1000);
    const name = tokenNamer(m, req.tokenIds);
    const object = req.chat ? (req.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";

    // Events become SSE chunks (stream) or accumulate in the choices; `wake` resumes a reader.
    const pending = [];
    let wake = () => {};
    let settled = false;
    let failure = null;
    const chunk = (choiceList, extra = {}) =>
      `data: ${JSON.stringify({ id, object, created, model: modelId, choices: choiceList, ...extra })}\n\n`;
    const onToken = (event) => {
      const choice = choices[event.row];
      const delta = choice && choice.push(event);
      if (delta && req.stream && (delta.text || delta.logprob || delta.finish)) {
        const lp = delta.logprob
          ? req.chat
            ? chatLogprobs([delta.logprob], name, req.topLogprobs)
            : completionLogprobs([delta.logprob], name)
          : null;
        const c = req.chat
          ? { index: choice.index, delta: delta.text ? { content: delta.text } : {}, logprobs: lp, finish_reason: delta.finish }
          : { index: choice.index, text: delta.text, logprobs: lp, finish_reason: delta.finish };
        pending.push(chunk([c]));
        wake();
      }
      // Every choice has ended (a stop string can end one before the engine stops its row).
      if (choices.every((c) => c.finish)) controller.abort();
    };

    stats.requests++;
    stats.active++;
    const generation = m.generate(req.rows, { ...req.options, signal: controller.signal, on_token: onToken }).then(
      (result) => {
        const aborted = result.sequences.some((p) => p.some((s) => s.finish_reason === "abort")) && !choices.every((c) => c.finish);
        const tokens = choices.reduce((s, c) => s + c.tokens, 0);
        stats.tokens += tokens;
        if (aborted) {
          stats.aborted++;
          stats.last_aborted_tokens = tokens;
        } else {
          stats.completed++;
        }
        if (req.stream) {
          if (req.includeUsage) pending.push(chunk([], { usage: usage(req, choices) }));
          pending.push("data: [DONE]\n\n");
        }
      },
      (e) => {
        stats.failed++;
        failure = engineError(e);
        if (req.stream) pending.push(`data: ${JSON.stringify(errorBody(failure))}\n\n`);
      },
    );
    generation.finally(() => {
      stats.active--;
      settled = true;
      wake();
    });
    // In a Worker, a client that disconnects ends the request's context, and with it the
    // timers the generation yields on: waitUntil keeps the generation running until it has
    // seen the abort and released its memory.
    if (waitUntil) waitUntil(generation);

    if (!req.stream) {
      await generation;
      if (failure) throw failure;
      return jsonResponse({
        id,
        object,
        created,
        model: modelId,
        choices: choices.map((c) =>
          req.chat
            ? {
                index: c.index,
                message: { role: "assistant", content: c.output },
                logprobs: req.logprobs ? chatLogprobs(c.logprobs, name, req.topLogprobs) : null,
                finish_reason: c.finish,
              }
            : {
                index: c.index,
                text: c.output,
                logprobs: req.logprobs ? completionLogprobs(c.logprobs, name) : null,
                finish_reason: c.finish,
              },
        ),
        usage: usage(req, choices),
      });
    }

    // Streaming: wait for the first token or the end, so that a request the engine refuses
    // (a bad option value) is a 400 rather than an error inside a 200 stream.
    const next = () => new Promise((resolve) => (wake = resolve));
    while (!pending.length && !settled) await next();
    if (failure && !choices.some((c) => c.tokens)) throw failure;
    if (req.chat) {
      const roles = choices.map((c) => ({ index: c.index, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null }));
      pending.unshift(chunk(roles));
    }
    const encoder = new TextEncoder();
    const body = new ReadableStream({
      async pull(out) {
        while (!pending.length && !settled) await next();
        if (pending.length) out.enqueue(encoder.encode(pending.splice(0).join("")));
        else out.close();
      },
      cancel() {
        // The client went away: stop generating after the current step.
        controller.abort();
      },
    });
    return new Response(body, { headers: SSE_HEADERS });
  }

  return async function handle(request, context) {
    const waitUntil = context && typeof context.waitUntil === "function" ? (p) => context.waitUntil(p) : null;
    const url = new URL(request.url);
    const route = `${request.method} ${url.pathname}`;
    try {
      switch (url.pathname) {
        case "/v1/completions":
        case "/v1/chat/completions":
          if (request.method !== "POST") throw new RequestError(`${route}: use POST`, { status: 405, code: "method_not_allowed" });
          return await complete(request, url.pathname === "/v1/completions" ? "completions" : "chat", waitUntil);
        case "/v1/models":
          return jsonResponse({ object: "list", data: [{ id: modelId, object: "model", created: 0, owned_by: "onnx-generate" }] });
        case "/debug/stats":
          if (debug) return jsonResponse({ ...stats, wasm_memory_bytes: memoryBytes() });
      }
      throw new RequestError(`no route ${route}; this server answers POST /v1/completions, POST /v1/chat/completions and GET /v1/models`, {
        status: 404,
        code: "not_found",
      });
    } catch (e) {
      return errorResponse(engineError(e));
    }
  };
}
