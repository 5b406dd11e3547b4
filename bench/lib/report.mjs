// The markdown report of a benchmark run: one table of figures with a ratio row per
// transformers.js configuration, the generated texts, memory bandwidth, and sizes.

import { SAMPLING } from "./engines.mjs";
import { MESSAGES, TEXT_PROMPT } from "./models.mjs";

const MB = 2 ** 20;
// fp32 models: the two engines compute the same function, so greedy tokens must be equal.
const MUST_AGREE = new Set(["fp32", "fixture", "whisper"]);

function median(xs) {
  const v = xs.filter((x) => typeof x === "number" && Number.isFinite(x)).sort((a, b) => a - b);
  if (v.length === 0) return null;
  const m = v.length >> 1;
  return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

const fmt = (x, digits = 1) => (x === null || x === undefined || !Number.isFinite(x) ? "-" : x.toFixed(digits));
const ratio = (a, b) => (a && b ? `${(a / b).toFixed(2)}x` : "-");

/** The first index where two id lists differ, or -1. */
function firstDifference(a, b) {
  const n = Math.max(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return -1;
}

/** Median figures of the repetitions of one configuration. */
/**
 * onnx-generate's aggregated runs of `model` in `env` by thread count (the threads build runs in
 * Chromium; the runs say which counts ran), and `against(t)`: the thread count and runs to compare
 * with transformers.js on `t` threads, the same count when it ran, else 1.
 */
function onnxGenerateByThreads(runs, env, model, group) {
  const counts = [...new Set(runs.filter((r) => r.env === env && r.model === model.name && r.engine === "onnx-generate").map((r) => r.threads))].sort((a, b) => a - b);
  const by = new Map(counts.map((t) => [t, group("onnx-generate", t)]));
  const against = (t) => {
    const ogT = by.has(t) ? t : 1;
    return [ogT, by.get(ogT) ?? group("onnx-generate", 1)];
  };
  return { by, against };
}

function aggregate(rs) {
  const ok = rs.filter((r) => !r.error);
  if (ok.length === 0) return { error: rs.map((r) => r.error).join("; ") };
  const pick = (k) => median(ok.map((r) => r[k]));
  const ids = ok[0].token_ids;
  return {
    load_ms: pick("load_ms"),
    transcribe_ms: pick("transcribe_ms"),
    audio_s: pick("audio_s"),
    rtf: pick("rtf"),
    ttft_ms: pick("ttft_ms"),
    prefill_tps: pick("prefill_tps"),
    prefill_again_tps: pick("prefill_again_tps"),
    decode_ms: pick("decode_ms"),
    decode_tps: pick("decode_tps"),
    peak_mb: pick("peak_mb"),
    cpu_per_wall: pick("cpu_per_wall"),
    new_tokens: Math.min(...ok.map((r) => r.new_tokens)),
    prompt_tokens: ok[0].prompt_tokens,
    prompt_ids: ok[0].prompt_ids,
    token_ids: ids,
    text: ok[0].text,
    finish_reason: ok[0].finish_reason,
    reps: ok.length,
    errors: rs.length - ok.length,
    // Repetitions of one configuration must give the same greedy tokens.
    unstable: ok.some((r) => firstDifference(r.token_ids, ids) >= 0),
  };
}

export function report({ machine, options, models: all, runs, bandwidth, sizes }) {
  const lines = [];
  const problems = [];
  const out = (s = "") => lines.push(s);
  const load = (l) => l.map((x) => x.toFixed(2)).join(" ");
  const models = all.filter((m) => !m.speech);
  const speechModels = all.filter((m) => m.speech);

  out(`# onnx-generate vs transformers.js: benchmark results`);
  out();
  out(
    `${machine.date}; ${machine.cores} cores (${machine.cpu}); load average ${load(machine.loadStart)} at the start, ` +
      `${load(machine.loadEnd)} at the end. Node ${machine.node}` +
      (machine.chromium ? `, Chromium ${machine.chromium}` : "") +
      `; transformers.js ${machine.tjs} on onnxruntime-web ${machine.ort} (wasm backend); onnx-generate ${machine.commit}.`,
  );
  // The package's init() picks its relaxed SIMD wasm where the engine has relaxed SIMD.
  const files = [...new Set(runs.map((r) => r.env))].map((env) => {
    const used = [...new Set(runs.filter((r) => r.env === env && r.engine === "onnx-generate" && r.wasm_file).map((r) => `${r.threads > 1 ? "pkg-threads/" : `${options.pkg}/`}${r.wasm_file}`))];
    return used.length ? `${env}: ${used.join(", ")}` : null;
  }).filter(Boolean);
  if (files.length) {
    out();
    out(`onnx-generate's wasm (the one the package's \`wasmFile()\` picks for the engine): ${files.join("; ")}.`);
  }
  out();
  const texts = []; // the generated text of each configuration
  if (models.length > 0) {
    out(
      `Same ONNX files, same prompt (${
        models.every((m) => m.chatTemplate)
          ? `the chat prompt "${MESSAGES[0].content}" with the template's system prompt`
          : `"${TEXT_PROMPT}" for models without a chat template, else the chat prompt "${MESSAGES[0].content}"`
      }), ` +
        (options.sample ? `sampled (${JSON.stringify(SAMPLING)}: the engines' tokens differ)` : "greedy") +
        `, exactly ${options.tokens} new tokens (end-of-sequence disabled with min_new_tokens); ` +
        `${options.reps} repetition(s) per configuration, run A B A B, medians shown. ` +
        `onnx-generate runs on 1 thread from ${options.pkg}/ and, in Chromium, on more from the threads build (pkg-threads/: ` +
        `initThreadPool(n - 1) workers and the page's thread); in Node (no Web Workers) it runs on 1 thread only, and ` +
        `a ratio row "1 / 2" compares its 1-thread run with transformers.js on 2` +
        (options.parallelThreshold === null ? ". " : ` (threads build with setParallelThreshold(${options.parallelThreshold})). `) +
        `The machine is shared: absolute figures drift, the ratios of the same run are what matter.`,
    );
    out();
    out(
      `Figures: **load** = runtime init + model files read + session ready; **first token** = generate() called to the ` +
        `first new token (template, tokenization, prefill); **prefill** = prompt tokens / first-token time; ` +
        `**again** = the same for the same prompt generated once more (one token) after the run, once the engine's ` +
        `code has run (the first prompt of a process also waits for V8 to compile optimised code); ` +
        `**decode** = 1 / median time between new tokens 2..${options.tokens}; **bound** = fraction of the memory-bandwidth ` +
        `bound reached in decode (bytes of weights and KV cache read per token / time per token / bandwidth measured inside ` +
        `wasm on the same thread count); **peak** = peak resident memory of the process (Node) or of the renderer ` +
        `process (Chromium), runtime included; **x model** = peak / (weights + KV cache at the last token); ` +
        `**CPU** = CPU time / wall time of the run. Ratios are onnx-generate / transformers.js: above 1 is better for ` +
        `prefill, decode and bound, below 1 is better for load, first token and memory.`,
    );
    out();
    out(`| env | model | engine | threads | load s | first token s | prefill tok/s | again tok/s | decode tok/s | bound | peak MB | x model | CPU | tokens |`);
    out(`|---|---|---|---|---|---|---|---|---|---|---|---|---|---|`);

    for (const env of Object.keys(bandwidth)) {
      for (const model of models) {
        const group = (engine, threads) =>
          aggregate(runs.filter((r) => r.env === env && r.model === model.name && r.engine === engine && r.threads === threads));
        const bytesPerToken = (a) =>
          model.weights.perToken + model.cacheBytes((a.prompt_tokens || 0) + options.tokens / 2);
        const modelBytes = (a) => model.weights.total + model.cacheBytes((a.prompt_tokens || 0) + options.tokens);
        const bound = (a, threads) => {
          const bw = bandwidth[env][threads];
          if (!a.decode_ms || !bw) return null;
          return bytesPerToken(a) / (a.decode_ms / 1000) / (bw.gbps * 1e9);
        };
        const row = (engine, threads, a) => {
          if (a.error) {
            problems.push(`${env} ${model.name} ${engine} ${threads}t failed: ${a.error}`);
            return `| ${env} | ${model.name} | ${engine} | ${threads} | failed: ${a.error.replace(/\|/g, "/").slice(0, 200)} ||||||||||`;
          }
          const b = bound(a, threads);
          const tokens = `${a.new_tokens}${a.new_tokens < options.tokens ? " (budget)" : ""}`;
          return (
            `| ${env} | ${model.name} | ${engine} | ${threads} | ${fmt(a.load_ms / 1000, 2)} | ${fmt(a.ttft_ms / 1000, 2)} | ` +
            `${fmt(a.prefill_tps)} | ${fmt(a.prefill_again_tps)} | ${fmt(a.decode_tps, 2)} | ${b === null ? "-" : Math.round(b * 100) + "%"} | ` +
            `${fmt(a.peak_mb, 0)} | ${fmt((a.peak_mb * MB) / modelBytes(a), 2)} | ${fmt(a.cpu_per_wall, 2)} | ${tokens} |`
          );
        };
        const { by: ogBy, against } = onnxGenerateByThreads(runs, env, model, group);
        for (const [t, a] of ogBy) {
          out(row("onnx-generate", t, a));
          if (!a.error) texts.push({ env, model: model.name, engine: "onnx-generate", threads: t, ...a });
        }
        if (model.tjsDtype) {
          for (const t of options.threads) {
            // onnx-generate on the same thread count when it ran on it, else on 1.
            const [ogT, og] = against(t);
            const tj = group("transformers.js", t);
            out(row("transformers.js", t, tj));
            if (tj.error) continue;
            texts.push({ env, model: model.name, engine: "transformers.js", threads: t, ...tj });
            if (og.error) continue;
            // A run stopped by the time budget made fewer tokens: compare the tokens both made.
            const n = Math.min(og.token_ids.length, tj.token_ids.length);
            const diff = firstDifference(og.token_ids.slice(0, n), tj.token_ids.slice(0, n));
            const promptDiff = firstDifference(og.prompt_ids, tj.prompt_ids);
            let same = diff >= 0 ? `tokens differ from #${diff + 1}` : n < options.tokens ? `same ${n} first tokens` : "same tokens";
            if (options.sample) same = "sampled";
            if (promptDiff >= 0) same += `; PROMPT IDS DIFFER at ${promptDiff}`;
            if ((diff >= 0 && MUST_AGREE.has(model.name) && !options.sample) || promptDiff >= 0) {
              same = `**MISMATCH**: ${same}`;
              problems.push(`${env} ${model.name}: onnx-generate and transformers.js ${t}t disagree (${same})`);
            }
            const bo = bound(og, ogT);
            const bt = bound(tj, t);
            out(
              `| ${env} | ${model.name} | **ratio** | ${ogT} / ${t} | ${ratio(og.load_ms, tj.load_ms)} | ${ratio(og.ttft_ms, tj.ttft_ms)} | ` +
                `${ratio(og.prefill_tps, tj.prefill_tps)} | ${ratio(og.prefill_again_tps, tj.prefill_again_tps)} | ` +
                `**${ratio(og.decode_tps, tj.decode_tps)}** | ${ratio(bo, bt)} | ` +
                `${ratio(og.peak_mb, tj.peak_mb)} | | | ${same} |`,
            );
          }
        }
        // Sampled tokens differ from run to run (no seed).
        for (const a of ogBy.values()) if (a.unstable && !options.sample) problems.push(`${env} ${model.name}: repetitions gave different tokens`);
      }
    }
    out();
  }
  if (speechModels.length > 0) speechTable({ options, models: speechModels, envs: Object.keys(bandwidth), runs, texts, problems, out });

  out(`## Generated text`);
  out();
  const seen = new Map();
  for (const t of texts) {
    const key = `${t.model}\u0000${t.token_ids.join(",")}`;
    if (!seen.has(key)) seen.set(key, { model: t.model, text: t.text, who: [] });
    seen.get(key).who.push(`${t.engine} ${t.env} ${t.threads}t`);
  }
  for (const { model, text, who } of seen.values()) {
    out(`- **${model}** (${who.join(", ")}): ${JSON.stringify(text)}`);
  }
  out();

  out(`## Memory bandwidth inside wasm, and bytes per token`);
  out();
  out(`| env | threads | GB/s before the runs (one stream / four) | GB/s after the runs | GB/s used for the bound (the better) |`);
  out(`|---|---|---|---|---|`);
  for (const [env, byThreads] of Object.entries(bandwidth)) {
    for (const [t, b] of Object.entries(byThreads)) {
      const streams = `${fmt(b.gbps_one_stream)} / ${fmt(b.gbps_four_streams)}`;
      out(`| ${env} | ${t} | ${fmt(b.gbps_start)} (${streams}) | ${fmt(b.gbps_end)} | ${fmt(b.gbps)} |`);
    }
  }
  out();
  out(
    `Best of 5 passes of bench/lib/bandwidth.wat (f32x4 loads, 4 accumulators) over ${Object.values(Object.values(bandwidth)[0] || {})[0]?.megabytes ?? "-"} MiB, ` +
      `each range read as one stream and as its four quarters side by side (the faster counts), ` +
      `on one thread or split over workers sharing one memory. Bytes per decode token, from the ONNX files: every ` +
      `initializer except tables read only by Gather (the token embeddings), plus the KV cache at the mean position.`,
  );
  out();
  out(`| model | file weights MB | read per token MB | Gather-only MB |`);
  out(`|---|---|---|---|`);
  for (const m of models) {
    out(`| ${m.name} | ${fmt(m.weights.total / MB)} | ${fmt(m.weights.perToken / MB)} | ${fmt(m.weights.gatherOnly / MB)} |`);
  }
  for (const m of speechModels) {
    const e = m.speech.encoderWeights;
    out(`| ${m.name} encoder (once per 30 s window) | ${fmt(e.total / MB)} | - | - |`);
    out(`| ${m.name} decoder (merged) | ${fmt(m.weights.total / MB)} | ${fmt(m.weights.perToken / MB)} | ${fmt(m.weights.gatherOnly / MB)} |`);
  }
  out();

  out(`## Download size`);
  out();
  out(`| engine | file | raw MB | gzip -9 MB |`);
  out(`|---|---|---|---|`);
  for (const s of sizes) out(`| ${s.engine} | ${s.file} | ${fmt(s.raw / MB, 2)} | ${fmt(s.gzip / MB, 2)} |`);
  // The relaxed SIMD wasm and pkg-threads/ replace pkg/'s wasm where they are used: the total
  // counts one package.
  const total = (e) => sizes.filter((s) => s.engine === e && !s.alternative).reduce((a, s) => ({ raw: a.raw + s.raw, gzip: a.gzip + s.gzip }), { raw: 0, gzip: 0 });
  const og = total("onnx-generate");
  const tj = total("transformers.js");
  out(`| **onnx-generate / transformers.js** | all files${sizes.some((s) => s.alternative) ? " (one package)" : ""} | ${ratio(og.raw, tj.raw)} | ${ratio(og.gzip, tj.gzip)} |`);
  out();
  if (problems.length) {
    out(`## Problems`);
    out();
    for (const p of problems) out(`- ${p}`);
    out();
  }
  return { markdown: lines.join("\n"), problems };
}

/**
 * The speech-to-text table: per env and speech model, each engine's load, transcription time,
 * real-time factor, first token, decode, peak memory; a ratio row per transformers.js thread
 * count; whether the two transcripts agree (fp32: they must, else a problem).
 */
function speechTable({ options, models, envs, runs, texts, problems, out }) {
  out(`## Speech to text (real-time factor)`);
  out();
  const clips = [...new Set(models.map((m) => m.speech.clip))].join(", ");
  out(
    `The same ONNX files (encoder_model.onnx + decoder_model_merged.onnx) and the same clip (${clips}), ` +
      `transcribed by onnx-generate's \`model.transcribe(pcm, { language, task: "transcribe" })\` and by transformers.js' ` +
      `Whisper processor + \`WhisperForConditionalGeneration.generate({ language, task: "transcribe" })\` (what its ` +
      `automatic-speech-recognition pipeline runs for a clip under 30 s), greedy, until end-of-text; ` +
      `${options.reps} repetition(s) per configuration, medians shown.`,
  );
  out();
  out(
    `Figures: **load** = runtime init + model files read + sessions ready (processor included); **transcription** = ` +
      `transcription called (log-mel features, encoder, decoding, text) to its result; **RTF** = real-time factor, ` +
      `transcription / audio duration (below 1 is faster than real time); **first token** = transcription called to ` +
      `the first new token (log-mel, encoder, prompt step); **decode** = 1 / median time between new tokens 2..N; ` +
      `**peak**, **x model** (peak / encoder and decoder weights) and **CPU** as above.`,
  );
  out();
  out(`| env | model | engine | threads | load s | transcription s | RTF | first token s | decode tok/s | peak MB | x model | CPU | tokens |`);
  out(`|---|---|---|---|---|---|---|---|---|---|---|---|---|`);
  for (const env of envs) {
    for (const model of models) {
      const group = (engine, threads) =>
        aggregate(runs.filter((r) => r.env === env && r.model === model.name && r.engine === engine && r.threads === threads));
      const modelBytes = model.weights.total + model.speech.encoderWeights.total;
      const row = (engine, threads, a) => {
        if (a.error) {
          problems.push(`${env} ${model.name} ${engine} ${threads}t failed: ${a.error}`);
          return `| ${env} | ${model.name} | ${engine} | ${threads} | failed: ${a.error.replace(/\|/g, "/").slice(0, 200)} |||||||||`;
        }
        const tokens = `${a.new_tokens}${a.finish_reason === "abort" ? " (budget)" : ""}`;
        return (
          `| ${env} | ${model.name} | ${engine} | ${threads} | ${fmt(a.load_ms / 1000, 2)} | ${fmt(a.transcribe_ms / 1000, 2)} | ` +
          `${fmt(a.rtf, 3)} | ${fmt(a.ttft_ms / 1000, 2)} | ${fmt(a.decode_tps, 2)} | ${fmt(a.peak_mb, 0)} | ` +
          `${fmt((a.peak_mb * MB) / modelBytes, 2)} | ${fmt(a.cpu_per_wall, 2)} | ${tokens} |`
        );
      };
      const { by: ogBy, against } = onnxGenerateByThreads(runs, env, model, group);
      for (const [t, a] of ogBy) {
        out(row("onnx-generate", t, a));
        if (!a.error) texts.push({ env, model: model.name, engine: "onnx-generate", threads: t, ...a });
      }
      for (const t of options.threads) {
        const [ogT, og] = against(t);
        const tj = group("transformers.js", t);
        out(row("transformers.js", t, tj));
        if (tj.error) continue;
        texts.push({ env, model: model.name, engine: "transformers.js", threads: t, ...tj });
        if (og.error) continue;
        // Token ids and text: a run stopped by the budget is compared on the tokens both made.
        const n = Math.min(og.token_ids.length, tj.token_ids.length);
        const diff = firstDifference(og.token_ids.slice(0, n), tj.token_ids.slice(0, n));
        const complete = og.finish_reason !== "abort" && tj.finish_reason !== "abort";
        let same =
          diff >= 0
            ? `tokens differ from #${diff + 1}`
            : !complete
              ? `same ${n} first tokens`
              : og.token_ids.length !== tj.token_ids.length
                ? `one stops after ${n} tokens, the other goes on`
                : og.text !== tj.text
                  ? "same tokens, TEXTS DIFFER"
                  : "same text";
        // fp32: the transcripts must be the same (as far as a budget let both go).
        if ((diff >= 0 || (complete && same !== "same text")) && MUST_AGREE.has(model.name)) {
          same = `**MISMATCH**: ${same}`;
          problems.push(`${env} ${model.name}: onnx-generate and transformers.js ${t}t transcribe differently (${same})`);
        }
        out(
          `| ${env} | ${model.name} | **ratio** | ${ogT} / ${t} | ${ratio(og.load_ms, tj.load_ms)} | ` +
            `${ratio(og.transcribe_ms, tj.transcribe_ms)} | **${ratio(og.rtf, tj.rtf)}** | ${ratio(og.ttft_ms, tj.ttft_ms)} | ` +
            `${ratio(og.decode_tps, tj.decode_tps)} | ${ratio(og.peak_mb, tj.peak_mb)} | | | ${same} |`,
        );
      }
      for (const a of ogBy.values()) if (a.unstable) problems.push(`${env} ${model.name}: repetitions gave different tokens`);
    }
  }
  out();
  out(
    `Ratios are onnx-generate / transformers.js: below 1 is better for load, transcription, RTF, first token and ` +
      `memory, above 1 for decode.`,
  );
  out();
}

/** The report of `--batch`: onnx-generate's tokens/s on batches of rows, per env and model. */
export function reportBatches({ machine, options, runs }) {
  const lines = [];
  const problems = [];
  const out = (s = "") => lines.push(s);
  const load = (l) => l.map((x) => x.toFixed(2)).join(" ");
  out(`# onnx-generate in wasm: batches of rows`);
  out();
  out(
    `${machine.date}; ${machine.cores} cores (${machine.cpu}); load average ${load(machine.loadStart)} at the start, ` +
      `${load(machine.loadEnd)} at the end; onnx-generate ${machine.commit}, 1 thread. The prompts and settings of ` +
      `examples/bench_batch.rs (the native figures): greedy, ${options.tokens} new tokens per row, no eos; each size ` +
      `runs twice, the first run also compiles the plan of that batch size, figures of the second.`,
  );
  out();
  out(`| env | model | rows | first run s | steady s | prefill s | decode tok/s | total tok/s | peak MB |`);
  out(`|---|---|---|---|---|---|---|---|---|`);
  for (const r of runs) {
    if (r.error) {
      problems.push(`${r.env} ${r.model} batches failed: ${r.error}`);
      out(`| ${r.env} | ${r.model} | failed: ${r.error.replace(/\|/g, "/").slice(0, 200)} ||||||||`);
      continue;
    }
    for (const b of r.batches) {
      out(
        `| ${r.env} | ${r.model} | ${b.rows} | ${fmt(b.first_run_s, 2)} | ${fmt(b.steady_s, 2)} | ${fmt(b.prefill_s, 2)} | ` +
          `${fmt(b.decode_tps)} | ${fmt(b.total_tps)} | ${fmt(r.peak_mb, 0)} |`,
      );
    }
  }
  out();
  return { markdown: lines.join("\n"), problems };
}
