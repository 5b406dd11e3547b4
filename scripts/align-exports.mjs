// Makes a second wasm-bindgen build of the same code usable with the first build's JavaScript
// glue: node scripts/align-exports.mjs FIRST.js SECOND.js SECOND_bg.wasm
//
// wasm-bindgen names some exports after the index of their function (closure shims such as
// `__wasm_bindgen_func_elem_1425`), and the indices of two builds with different target
// features (pkg/'s plain and relaxed SIMD wasm) differ. The two glue files must otherwise be
// the same, line for line (comments aside); the names that differ give the renaming, and the
// second wasm's export section is rewritten with the first build's names. Fails, changing
// nothing, when the glue differs in anything else or a renamed export would collide.
// Known limit: the pairing is by line, and wasm-bindgen numbers the closure imports
// (`__wbindgen_generic_N`) and orders the shims' definitions by their names, so when the two
// builds' shim indices fall in another relative order (seen once, for pkg-threads/, after a
// one-line change in src/model/ops/dynamic_quantize.rs: one name mapped to two), the glue
// cannot be paired from the JavaScript alone and this fails rather than pair wrongly.
import { readFileSync, writeFileSync } from "node:fs";

const [firstJs, secondJs, secondWasm] = process.argv.slice(2);
if (!secondWasm) {
  console.error("usage: node scripts/align-exports.mjs FIRST.js SECOND.js SECOND_bg.wasm");
  process.exit(2);
}
const fail = (message) => {
  console.error(`align-exports: ${message}`);
  process.exit(1);
};

// The glue without comment lines (a closure's shim index appears in one and differs).
const code = (path) => readFileSync(path, "utf8").split("\n").filter((l) => !/^\s*\/\//.test(l));
const [a, b] = [code(firstJs), code(secondJs)];
if (a.length !== b.length) fail(`${secondJs} has ${b.length} lines of code, ${firstJs} ${a.length}`);
const NAME = /__wasm_bindgen_func_elem_\d+/g;
const rename = new Map(); // second build's export name -> first build's
for (let i = 0; i < a.length; i++) {
  if (a[i] === b[i]) continue;
  const [na, nb] = [a[i].match(NAME) || [], b[i].match(NAME) || []];
  if (na.length !== nb.length || a[i].replace(NAME, "#") !== b[i].replace(NAME, "#")) {
    fail(`the glue differs beyond function-index names at code line ${i + 1}:\n  ${a[i]}\n  ${b[i]}`);
  }
  nb.forEach((name, j) => {
    if (rename.has(name) && rename.get(name) !== na[j]) fail(`${name} maps to both ${rename.get(name)} and ${na[j]}`);
    rename.set(name, na[j]);
  });
}

// The wasm's sections; the export section (id 7) rewritten.
const wasm = readFileSync(secondWasm);
const uleb = (bytes, at) => {
  let value = 0;
  let shift = 0;
  for (;;) {
    const byte = bytes[at++];
    value += (byte & 0x7f) * 2 ** shift;
    if (byte < 0x80) return [value, at];
    shift += 7;
  }
};
const toUleb = (value) => {
  const out = [];
  do {
    let byte = value & 0x7f;
    value = Math.floor(value / 128);
    if (value > 0) byte |= 0x80;
    out.push(byte);
  } while (value > 0);
  return Buffer.from(out);
};
const parts = [wasm.subarray(0, 8)];
let renamed = 0;
for (let at = 8; at < wasm.length; ) {
  const id = wasm[at];
  const [size, start] = uleb(wasm, at + 1);
  const end = start + size;
  if (id !== 7) {
    parts.push(wasm.subarray(at, end));
    at = end;
    continue;
  }
  let [count, p] = uleb(wasm, start);
  const entries = [toUleb(count)];
  const names = new Set();
  for (let e = 0; e < count; e++) {
    const [length, from] = uleb(wasm, p);
    let name = wasm.subarray(from, from + length).toString("utf8");
    p = from + length;
    const kind = wasm[p];
    const [, after] = uleb(wasm, p + 1);
    const tail = wasm.subarray(p, after); // kind and index, as they were
    p = after;
    if (rename.has(name)) {
      name = rename.get(name);
      renamed++;
    }
    if (names.has(name)) fail(`two exports named ${name} after renaming (kind ${kind})`);
    names.add(name);
    const bytes = Buffer.from(name, "utf8");
    entries.push(toUleb(bytes.length), bytes, tail);
  }
  if (p !== end) fail("the export section has bytes after its entries");
  const content = Buffer.concat(entries);
  parts.push(Buffer.from([7]), toUleb(content.length), content);
  at = end;
}
if (renamed !== rename.size) fail(`renamed ${renamed} exports, the glue names ${rename.size}`);
writeFileSync(secondWasm, Buffer.concat(parts));
console.log(`align-exports: ${secondWasm}: ${renamed} exports renamed to ${firstJs}'s names`);
