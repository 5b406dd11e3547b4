// The demo page: load a model folder (URL, folder picker or drag and drop) with a progress bar,
// then stream tokens with live tokens/s, and stop with an AbortController.
import init, { Model } from "./pkg/onnx_generate.js";

const $ = (id) => document.getElementById(id);
let model = null;
let controller = null;

// `?model=URL` points the page at another model folder (served here or anywhere reachable).
const params = new URLSearchParams(location.search);
if (params.get("model")) $("model-url").value = params.get("model");

function showError(e) {
  $("error").hidden = false;
  $("error").textContent = String((e && e.message) || e);
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

/** Aggregates per-file progress into the bar. */
function progressTracker() {
  const files = new Map();
  $("load-progress").value = 0;
  return (p) => {
    files.set(p.file, p);
    let loaded = 0;
    let total = 0;
    for (const f of files.values()) {
      loaded += f.loaded;
      total += f.total ?? f.loaded;
    }
    $("load-progress").max = Math.max(total, 1);
    $("load-progress").value = loaded;
    $("model-status").textContent = `Loading ${p.file}: ${(p.loaded / 1e6).toFixed(1)} MB` +
      (p.total ? ` of ${(p.total / 1e6).toFixed(1)} MB` : "");
  };
}

async function loadWith(what, load) {
  clearError();
  $("generate").disabled = true;
  $("load-url").disabled = true;
  if (model) {
    model.free();
    model = null;
  }
  const started = performance.now();
  try {
    model = await load(progressTracker());
    const seconds = ((performance.now() - started) / 1000).toFixed(2);
    $("model-status").textContent = `Loaded ${what} in ${seconds} s (vocabulary ${model.vocabSize}` +
      `${model.hasChatTemplate ? ", chat template" : ", no chat template"}).`;
    $("model-status").dataset.loaded = "true";
    $("generate").disabled = false;
  } catch (e) {
    $("model-status").textContent = "Loading failed.";
    showError(e);
  } finally {
    $("load-url").disabled = false;
  }
}

$("load-url").addEventListener("click", () => {
  const url = new URL($("model-url").value, location.href);
  loadWith(url.href, (on_progress) => Model.fromUrl(url, { on_progress }));
});

/** The model files of a picked or dropped folder, by their path inside it. */
function filesOfFolder(fileList) {
  const byName = new Map();
  for (const f of fileList) {
    const path = (f.webkitRelativePath || f.relativePath || f.name).split("/").slice(1).join("/") || f.name;
    byName.set(path, f);
    if (!byName.has(f.name)) byName.set(f.name, f);
  }
  const preferred = ["model.onnx", "model_q4.onnx", "model_quantized.onnx", "model_fp16.onnx",
    "decoder_model_merged.onnx"];
  const onnxName = preferred.flatMap((n) => [`onnx/${n}`, n]).find((n) => byName.has(n)) ||
    [...byName.keys()].find((n) => n.endsWith(".onnx"));
  if (!onnxName) throw new Error("the folder has no .onnx file");
  const files = { model: byName.get(onnxName), model_name: onnxName.split("/").pop() };
  const data = byName.get(`${onnxName}.data`) || byName.get(`${onnxName}_data`);
  if (data) files.external_data = data;
  const named = { config: "config.json", generation_config: "generation_config.json",
    tokenizer: "tokenizer.json", tokenizer_config: "tokenizer_config.json",
    chat_template: "chat_template.jinja" };
  for (const [key, name] of Object.entries(named)) {
    if (byName.has(name)) files[key] = byName.get(name);
  }
  return files;
}

$("folder-input").addEventListener("change", (ev) => {
  const list = [...ev.target.files];
  if (!list.length) return;
  try {
    const files = filesOfFolder(list);
    loadWith(`${files.model_name} (picked folder)`, (on_progress) => Model.load(files, { on_progress }));
  } catch (e) {
    showError(e);
  }
});

/** All files under a dropped directory entry. */
async function walk(entry, prefix, out) {
  if (entry.isFile) {
    const file = await new Promise((ok, fail) => entry.file(ok, fail));
    file.relativePath = prefix + file.name;
    out.push(file);
  } else if (entry.isDirectory) {
    const reader = entry.createReader();
    for (;;) {
      const batch = await new Promise((ok, fail) => reader.readEntries(ok, fail));
      if (!batch.length) break;
      for (const e of batch) await walk(e, `${prefix}${entry.name}/`, out);
    }
  }
}

const zone = $("drop-zone");
zone.addEventListener("dragover", (ev) => {
  ev.preventDefault();
  zone.classList.add("over");
});
zone.addEventListener("dragleave", () => zone.classList.remove("over"));
zone.addEventListener("drop", async (ev) => {
  ev.preventDefault();
  zone.classList.remove("over");
  try {
    const out = [];
    for (const item of ev.dataTransfer.items) {
      const entry = item.webkitGetAsEntry && item.webkitGetAsEntry();
      if (entry && entry.isDirectory) await walk(entry, "", out);
      else if (entry) await walk(entry, "root/", out);
    }
    const files = filesOfFolder(out);
    loadWith(`${files.model_name} (dropped folder)`, (on_progress) => Model.load(files, { on_progress }));
  } catch (e) {
    showError(e);
  }
});

function options() {
  const num = (id) => Number($(id).value);
  const o = { max_new_tokens: num("max_new_tokens") };
  if ($("do_sample").checked) {
    Object.assign(o, { do_sample: true, temperature: num("temperature"), top_k: num("top_k"),
      top_p: num("top_p"), seed: num("seed") });
  }
  return o;
}

const chat = [];

function renderChat() {
  const log = $("chat-log");
  log.replaceChildren(...chat.map((m) => {
    const div = document.createElement("div");
    div.className = "msg";
    const role = document.createElement("span");
    role.className = "role";
    role.textContent = `${m.role}:`;
    div.append(role, m.content);
    return div;
  }));
}

$("generate").addEventListener("click", async () => {
  clearError();
  const mode = document.querySelector("input[name=mode]:checked").value;
  const prompt = $("prompt").value;
  let input = prompt;
  if (mode === "chat") {
    chat.push({ role: "user", content: prompt });
    renderChat();
    input = chat.slice();
  }
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("output").textContent = "";
  $("output").dataset.tokens = "0";
  $("output").dataset.done = "false";
  let tokens = 0;
  let first = null;
  const started = performance.now();
  const showStats = (reason) => {
    const now = performance.now();
    const rate = first !== null && tokens > 1 ? ((tokens - 1) * 1000) / (now - first) : 0;
    $("stats").textContent = `${tokens} tokens · ${rate.toFixed(1)} tokens/s` +
      (first !== null ? ` · first token ${(first - started).toFixed(0)} ms` : "") +
      (reason ? ` · ${reason}` : "");
  };
  try {
    const result = await model.generate(input, {
      ...options(),
      signal: controller.signal,
      on_token(event) {
        tokens += 1;
        if (first === null) first = performance.now();
        $("output").textContent += event.text;
        $("output").dataset.tokens = String(tokens);
        showStats();
      },
    });
    showStats(result.finish_reason);
    $("output").dataset.finishReason = result.finish_reason;
    if (mode === "chat") {
      chat.push({ role: "assistant", content: result.text });
      renderChat();
    }
  } catch (e) {
    if (mode === "chat") chat.pop();
    showError(e);
  } finally {
    $("output").dataset.done = "true";
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
});

$("stop").addEventListener("click", () => {
  if (controller) controller.abort();
});

await init();
$("model-status").dataset.ready = "true";
