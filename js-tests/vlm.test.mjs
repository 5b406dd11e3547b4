// Vision-language decoders through the JavaScript API of the built package (pkg/), in Node, on
// the tiny Qwen2-VL and SmolVLM fixtures (tests/fixtures/vlm): the golden token ids of
// transformers' generate() with the stored image features (`image_features`, and Qwen2-VL's
// positions from `image_grid_thw` or given as `position_ids`), with chat messages whose image
// parts are RGBA bytes (the engine's own image processor and vision encoder), and bad input.
//   node --test js-tests/vlm.test.mjs
import { test, before } from "node:test";
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { Model, root } from "./pkg.mjs";

const vlm = new URL("tests/fixtures/vlm/", root);

/** A little-endian .npy file: `{data, shape}` (float32 -> Float32Array, uint8 -> Uint8Array). */
async function readNpy(url) {
  const buf = await readFile(url);
  const major = buf[6];
  const headerLen = major === 1 ? buf.readUInt16LE(8) : buf.readUInt32LE(8);
  const start = major === 1 ? 10 : 12;
  const header = buf.subarray(start, start + headerLen).toString("latin1");
  const descr = /'descr':\s*'([^']+)'/.exec(header)[1];
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)[1].split(",").filter((s) => s.trim()).map(Number);
  assert.match(header, /'fortran_order':\s*False/);
  const bytes = buf.subarray(start + headerLen);
  const copy = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
  if (descr === "<f4") return { data: new Float32Array(copy), shape };
  if (descr === "|u1") return { data: new Uint8Array(copy), shape };
  throw new Error(`${url}: unsupported dtype ${descr}`);
}

async function loadModel(name) {
  const dir = new URL(`models/${name}/`, vlm);
  const file = (f) => readFile(new URL(f, dir));
  return Model.load({
    model: await file("onnx/decoder_model_merged.onnx"),
    model_name: "decoder_model_merged.onnx",
    embed_tokens: await file("onnx/embed_tokens.onnx"),
    vision_encoder: await file("onnx/vision_encoder.onnx"),
    config: await file("config.json"),
    generation_config: await file("generation_config.json"),
    tokenizer: await file("tokenizer.json"),
    tokenizer_config: await file("tokenizer_config.json"),
    chat_template: await file("chat_template.jinja"),
    preprocessor_config: await file("preprocessor_config.json"),
  });
}

const golden = {};
const models = {};
before(async () => {
  for (const name of ["qwen2-vl", "smolvlm"]) {
    golden[name] = JSON.parse(await readFile(new URL(`golden/${name}.json`, vlm), "utf8"));
    models[name] = await loadModel(name);
  }
});

const caseOf = (name, id) => golden[name].cases.find((c) => c.id === id);
const options = (c) => {
  const { do_sample, ...rest } = c.generation_kwargs;
  assert.equal(do_sample, false);
  return rest;
};
const features = async (name, c) => {
  const { data, shape } = await readNpy(new URL(`golden/${c.arrays.image_features.file}`, vlm));
  return { data, dims: shape };
};
/** An image of the golden files (uint8 HWC RGB) as `{data, width, height}` RGBA bytes. */
async function rgbaImage(name, image) {
  const { data, shape } = await readNpy(new URL(`golden/${golden[name].images[image].file}`, vlm));
  const [height, width] = shape;
  const rgba = new Uint8Array(width * height * 4);
  for (let i = 0; i < width * height; i++) {
    rgba.set(data.subarray(3 * i, 3 * i + 3), 4 * i);
    rgba[4 * i + 3] = 255;
  }
  return { data: rgba, width, height };
}

for (const name of ["qwen2-vl", "smolvlm"]) {
  test(`${name}: stored image features give the golden ids (one image, two images, eos, a batch)`, async () => {
    const model = models[name];
    for (const id of ["greedy_1img", "greedy_2img", "greedy_eos", "batch_1img_2img"]) {
      const c = caseOf(name, id);
      const extra = name === "qwen2-vl" ? { image_grid_thw: c.prompts.flatMap((p) => p.image_grid_thw) } : {};
      const r = await model.generate(c.prompts.map((p) => p.ids), {
        ...options(c),
        image_features: await features(name, c),
        ...extra,
      });
      const got = c.prompts.length === 1 ? [r.token_ids] : r.sequences.map((s) => s[0].token_ids);
      assert.deepEqual(got, c.expected.map((e) => e[0].new_token_ids), `${name} ${id}`);
    }
  });

  test(`${name}: chat messages with RGBA images go through the image processor and vision encoder`, async () => {
    const model = models[name];
    for (const id of ["greedy_1img", "greedy_2img"]) {
      const c = caseOf(name, id);
      const [prompt] = c.prompts;
      const question = id === "greedy_1img" ? "Describe this image." : "Compare the two images.";
      const images = await Promise.all(prompt.images.map((i) => rgbaImage(name, i)));
      const parts = images.flatMap((image, i) =>
        i > 0 ? [{ type: "text", text: "and" }, { type: "image", image }] : [{ type: "image", image }],
      );
      const messages = [{ role: "user", content: [...parts, { type: "text", text: question }] }];
      // The template renders the same prompt text as the golden file's (image tokens expanded
      // by the engine afterwards).
      assert.equal(model.applyChatTemplate(messages.map((m) => ({
        ...m,
        content: m.content.map(({ image, ...rest }) => rest),
      }))), prompt.text, `${name} ${id}: rendered prompt`);
      const r = await model.generate(messages, options(c));
      assert.deepEqual(r.token_ids, c.expected[0][0].new_token_ids, `${name} ${id}`);
    }
  });

  test(`${name}: bad image input is an error naming it, and the model stays usable`, async () => {
    const model = models[name];
    const c = caseOf(name, "greedy_1img");
    const ids = c.prompts[0].ids;
    await assert.rejects(model.generate(ids, { max_new_tokens: 2 }), /image/i);
    const { data, dims } = await features(name, c);
    await assert.rejects(
      model.generate(ids, { max_new_tokens: 2, image_features: { data: data.subarray(0, 32 * 2), dims: [2, 32] } }),
      /64|32|width|hidden/i,
    );
    await assert.rejects(
      model.generate([{ role: "user", content: [{ type: "image", image: { data: new Uint8Array(0), width: 0, height: 0 } }] }], {
        max_new_tokens: 2,
      }),
      /image/i,
    );
    const extra = name === "qwen2-vl" ? { image_grid_thw: c.prompts[0].image_grid_thw } : {};
    const r = await model.generate(ids, { ...options(c), image_features: { data, dims }, ...extra });
    assert.deepEqual(r.token_ids, c.expected[0][0].new_token_ids);
  });
}

test("qwen2-vl: caller-given 3-D position_ids give the golden ids; a wrong shape is an error", async () => {
  const model = models["qwen2-vl"];
  const c = caseOf("qwen2-vl", "greedy_1img");
  const [prompt] = c.prompts;
  const image_features = await features("qwen2-vl", c);
  const r = await model.generate(prompt.ids, { ...options(c), image_features, position_ids: [prompt.position_ids] });
  assert.deepEqual(r.token_ids, c.expected[0][0].new_token_ids);
  await assert.rejects(
    model.generate(prompt.ids, { ...options(c), image_features, position_ids: [prompt.position_ids.slice(0, 2)] }),
    /position_ids/,
  );
});
