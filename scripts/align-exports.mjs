// Makes a second wasm-bindgen build of the same code usable with the first build's JavaScript
// glue: node scripts/align-exports.mjs FIRST.js FIRST_bg.wasm SECOND.js SECOND_bg.wasm
//
// wasm-bindgen names two kinds of wasm functions after numbers that differ between two builds
// with different target features (pkg/'s plain and relaxed SIMD wasm):
// - closure shims, exports such as `__wasm_bindgen_func_elem_1425`, named after their index;
// - closure casts, imports `__wbindgen_generic_N`, numbered in the order of their descriptors,
//   which name the shim's index, so two builds can number the same casts differently.
// The second wasm's shim exports and cast imports are renamed to the first build's names, and
// then the second build's glue, so renamed, must be the first build's: line for line outside
// the casts and the shims' wrappers (comments aside), and the same set of those. That check is
// what makes the renaming right: the second wasm then runs with glue that is its own. The
// pairing it checks: the shims in the order of their indices (the code's order, which target
// features do not change; each pair of the same wasm type), and each cast with the first
// build's cast of the same descriptor calling the paired shim (of the same wasm type). Fails,
// changing nothing, when anything differs or a renamed export or import would collide.
import { readFileSync, writeFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const fail = (message) => {
  throw new Error(`align-exports: ${message}`);
};

const SHIM = /__wasm_bindgen_func_elem_(\d+)/g;
const CAST = /__wbindgen_generic_\w+/g;

/** The glue without comment lines; its casts and shim wrappers as blocks, each a marker line. */
function readGlue(path) {
  const lines = readFileSync(path, "utf8").split("\n");
  const rest = [];
  const casts = new Map(); // cast name -> its block, with its descriptor comment
  const wrappers = [];
  for (let i = 0; i < lines.length; i++) {
    const cast = lines[i].match(/^(\s+)(__wbindgen_generic_\w+): function\(/);
    const wrapper = /^function __wasm_bindgen_func_elem_\d+\(/.test(lines[i]);
    if (!cast && !wrapper) {
      if (!/^\s*\/\//.test(lines[i])) rest.push(lines[i]);
      continue;
    }
    const end = cast ? `${cast[1]}},` : "}";
    let j = i;
    while (j < lines.length && lines[j] !== end) j++;
    if (j === lines.length) fail(`${path}: no "${end}" closes line ${i + 1}: ${lines[i]}`);
    const block = lines.slice(i, j + 1).join("\n");
    if (cast) casts.set(cast[2], block);
    else wrappers.push(block);
    rest.push(cast ? "@cast" : "@wrapper");
    i = j;
  }
  const shims = [...new Set([...lines.join("\n").matchAll(SHIM)].map((m) => m[0]))];
  shims.sort((x, y) => Number(x.match(/\d+$/)[0]) - Number(y.match(/\d+$/)[0]));
  return { rest, casts, wrappers, shims };
}

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

/** The sections of a wasm, the entries of its import (2) and export (7) sections, and the type
 * (its bytes, as hex) of each imported and exported function, by name. Only what wasm-bindgen's
 * output holds: function types of plain value types; imports of functions, tables, memories and
 * globals. */
function readWasm(path) {
  const bytes = readFileSync(path);
  const sections = [];
  const types = [];
  const funcTypes = []; // function index -> type index, imports first
  const imports = new Map(); // function import name -> type
  const exportIndex = new Map(); // function export name -> function index
  for (let at = 8; at < bytes.length; ) {
    const id = bytes[at];
    const [size, start] = uleb(bytes, at + 1);
    const section = { id, bytes: bytes.subarray(at, start + size), entries: [] };
    sections.push(section);
    at = start + size;
    let [count, p] = [0, start];
    if ([1, 2, 3, 7].includes(id)) [count, p] = uleb(bytes, start);
    for (let e = 0; e < count; e++) {
      if (id === 1) {
        if (bytes[p] !== 0x60) fail(`${path}: type ${e} is not a plain function type`);
        const from = p;
        let n;
        [n, p] = uleb(bytes, p + 1);
        [n, p] = uleb(bytes, p + n);
        p += n;
        types.push(bytes.subarray(from, p).toString("hex"));
      } else if (id === 3) {
        let type;
        [type, p] = uleb(bytes, p);
        funcTypes.push(type);
      } else if (id === 2 || id === 7) {
        // An import: module name, name, kind, description; an export: name, kind, index.
        let moduleName = Buffer.alloc(0);
        if (id === 2) {
          const [n, q] = uleb(bytes, p);
          moduleName = bytes.subarray(p, q + n);
          p = q + n;
        }
        const [n, from] = uleb(bytes, p);
        const name = bytes.subarray(from, from + n).toString("utf8");
        p = from + n;
        const tailStart = p;
        const kind = bytes[p++];
        let index;
        if (id === 7 || kind === 0) [index, p] = uleb(bytes, p);
        else if (kind === 1 || kind === 2) {
          if (kind === 1) p++; // the table's reference type
          const flags = bytes[p++];
          [, p] = uleb(bytes, p);
          if (flags & 1) [, p] = uleb(bytes, p);
        } else if (kind === 3) p += 2; // value type, mutability
        else fail(`${path}: import ${name} is of kind ${kind}, which this script does not read`);
        section.entries.push({ moduleName, name, kind, tail: bytes.subarray(tailStart, p) });
        if (id === 2 && kind === 0) {
          imports.set(name, types[index]);
          funcTypes.push(index);
        }
        if (id === 7 && kind === 0) exportIndex.set(name, index);
      }
    }
    if ([1, 2, 3, 7].includes(id) && p !== at) fail(`${path}: section ${id} has bytes after its entries`);
  }
  const exports = new Map([...exportIndex].map(([name, f]) => [name, types[funcTypes[f]]]));
  return { bytes, sections, imports, exports };
}

/** The wasm with the names of its imported (`importNames`) and exported (`exportNames`)
 * functions replaced. */
function renameWasm(wasm, importNames, exportNames) {
  const parts = [wasm.bytes.subarray(0, 8)];
  for (const section of wasm.sections) {
    if (section.id !== 2 && section.id !== 7) {
      parts.push(section.bytes);
      continue;
    }
    const names = section.id === 2 ? importNames : exportNames;
    const seen = new Set();
    const entries = [toUleb(section.entries.length)];
    for (const { moduleName, name, kind, tail } of section.entries) {
      const renamed = kind === 0 ? (names.get(name) ?? name) : name;
      const key = section.id === 2 ? `${moduleName.toString("hex")} ${renamed}` : renamed;
      if (seen.has(key)) fail(`two ${section.id === 2 ? "imports" : "exports"} named ${renamed} after renaming`);
      seen.add(key);
      const nameBytes = Buffer.from(renamed, "utf8");
      entries.push(moduleName, toUleb(nameBytes.length), nameBytes, tail);
    }
    const content = Buffer.concat(entries);
    parts.push(Buffer.from([section.id]), toUleb(content.length), content);
  }
  return Buffer.concat(parts);
}

/** Replaces the names in `text` by `names` (an unknown name stays). */
const renamed = (text, pattern, names) => text.replace(pattern, (name) => names.get(name) ?? name);

export function align(firstJs, firstWasm, secondJs, secondWasm) {
  const [a, b] = [readGlue(firstJs), readGlue(secondJs)];
  const [wa, wb] = [readWasm(firstWasm), readWasm(secondWasm)];

  // The shims, in the order of their indices.
  if (a.shims.length !== b.shims.length) {
    fail(`${secondJs} calls ${b.shims.length} closure shims, ${firstJs} ${a.shims.length}`);
  }
  const shims = new Map(b.shims.map((name, i) => [name, a.shims[i]]));
  for (const [nb, na] of shims) {
    const [ta, tb] = [wa.exports.get(na), wb.exports.get(nb)];
    if (!ta || !tb) fail(`${ta ? secondWasm : firstWasm} exports no function ${ta ? nb : na}`);
    if (ta !== tb) fail(`the shims ${na} and ${nb}, paired by their order, differ in type`);
  }

  // The casts: by descriptor (its shim's index aside) and body, with the paired shims' names.
  const castKey = (block) => block.replace(/shim_idx: \d+/g, "shim_idx: #").replace(CAST, "#");
  const byKey = new Map();
  for (const [name, block] of a.casts) {
    const key = castKey(block);
    if (byKey.has(key)) fail(`${firstJs}: the casts ${byKey.get(key)} and ${name} are the same`);
    byKey.set(key, name);
  }
  const casts = new Map();
  for (const [name, block] of b.casts) {
    const match = byKey.get(castKey(renamed(block, SHIM, shims)));
    if (!match) fail(`${secondJs}: ${name} has no counterpart in ${firstJs}:\n${block}`);
    if ([...casts.values()].includes(match)) fail(`${firstJs}: ${match} pairs with two casts`);
    const [ta, tb] = [wa.imports.get(match), wb.imports.get(name)];
    if (!ta || !tb) fail(`${ta ? secondWasm : firstWasm} imports no function ${ta ? name : match}`);
    if (ta !== tb) fail(`the casts ${match} and ${name} differ in wasm type`);
    casts.set(name, match);
  }
  if (casts.size !== a.casts.size) fail(`${secondJs} has ${b.casts.size} casts, ${firstJs} ${a.casts.size}`);

  // The glue, renamed, must be the first build's.
  const rename = (text) => renamed(renamed(text, SHIM, shims), CAST, casts);
  const strip = (block) => block.split("\n").filter((l) => !/^\s*\/\//.test(l)).join("\n");
  const restB = b.rest.map(rename);
  if (restB.length !== a.rest.length) fail(`${secondJs} has ${restB.length} lines of code, ${firstJs} ${a.rest.length}`);
  restB.forEach((line, i) => {
    if (line !== a.rest[i]) fail(`the glue differs at code line ${i + 1}:\n  ${a.rest[i]}\n  ${line}`);
  });
  const blocks = (glue, f) => [...glue.casts.values(), ...glue.wrappers].map((x) => strip(f(x))).sort();
  const [blocksA, blocksB] = [blocks(a, (x) => x), blocks(b, rename)];
  blocksB.forEach((block, i) => {
    if (block !== blocksA[i]) fail(`the glue's casts or shim wrappers differ:\n${blocksA[i]}\n${block}`);
  });

  writeFileSync(secondWasm, renameWasm(wb, casts, shims));
  const moved = (map) => [...map].filter(([x, y]) => x !== y).length;
  return { shims: moved(shims), casts: moved(casts) };
}

if (import.meta.url === pathToFileURL(process.argv[1]).href) {
  const args = process.argv.slice(2);
  if (args.length !== 4) {
    console.error("usage: node scripts/align-exports.mjs FIRST.js FIRST_bg.wasm SECOND.js SECOND_bg.wasm");
    process.exit(2);
  }
  try {
    const { shims, casts } = align(...args);
    console.log(`align-exports: ${args[3]}: ${shims} shim exports and ${casts} cast imports renamed`);
  } catch (e) {
    console.error(e.message);
    process.exit(1);
  }
}
