// scripts/align-exports.mjs on small modules and glue written here, shaped as wasm-bindgen's:
// closure casts numbered in another order in the second build (as a one-line change once made
// them in pkg-threads/), glue that differs beyond the names, and paired shims of different types.
//   node --test js-tests/align-exports.test.mjs
import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { align } from "../scripts/align-exports.mjs";

const uleb = (n) => {
  const out = [];
  do {
    out.push((n & 0x7f) | (n >= 0x80 ? 0x80 : 0));
    n >>>= 7;
  } while (n);
  return out;
};
const str = (s) => [...uleb(s.length), ...Buffer.from(s)];
const vec = (items) => [...uleb(items.length), ...items.flat()];
const section = (id, content) => [id, ...uleb(content.length), ...content];

const CAST = [0x60, 2, 0x7f, 0x7f, 1, 0x6f]; // (i32, i32) -> externref
const UNIT = [0x60, 3, 0x7f, 0x7f, 0x6f, 0]; // (i32, i32, externref) -> ()
const RETPTR = [0x60, 4, 0x7f, 0x7f, 0x7f, 0x6f, 0]; // (retptr, i32, i32, externref) -> ()

/** A module importing a memory and `casts`, defining and exporting `shims` ({ n, type }). */
function wasm(casts, shims) {
  const types = [CAST, UNIT, RETPTR];
  const imports = [
    [...str("env"), ...str("memory"), 2, 0, 1],
    ...casts.map((name) => [...str("./onnx_generate_bg.js"), ...str(name), 0, 0]),
  ];
  const typeOf = (shim) => types.indexOf(shim.type);
  return Buffer.from([
    ...[0, 0x61, 0x73, 0x6d, 1, 0, 0, 0],
    ...section(1, vec(types)),
    ...section(2, vec(imports)),
    ...section(3, vec(shims.map((s) => uleb(typeOf(s))))),
    ...section(7, vec(shims.map((s, i) => [...str(`__wasm_bindgen_func_elem_${s.n}`), 0, ...uleb(casts.length + i)]))),
    ...section(10, vec(shims.map(() => [2, 0, 0x0b]))),
  ]);
}

/** wasm-bindgen-like glue: casts in the given order (each [name, shim, descriptor index]), a
 * promise import calling the `promise` shim, and a wrapper per shim. */
function glue(casts, shims, promise, extra = "") {
  const cast = ([name, shim, idx]) => `        ${name}: function(arg0, arg1) {
            // Cast intrinsic for \`Closure(Closure { arguments: [Externref], shim_idx: ${idx}, ret: ${shim.ret} })\`.
            const ret = makeMutClosure(arg0, arg1, __wasm_bindgen_func_elem_${shim.n});
            return ret;
        },`;
  const wrapper = (s) =>
    s.type === RETPTR
      ? `function __wasm_bindgen_func_elem_${s.n}(arg0, arg1, arg2) {
    const retptr = wasm.__wbindgen_add_to_stack_pointer(-16) >>> 0;
    wasm.__wasm_bindgen_func_elem_${s.n}(retptr, arg0, arg1, arg2);
}`
      : `function __wasm_bindgen_func_elem_${s.n}(arg0, arg1, arg2) {
    wasm.__wasm_bindgen_func_elem_${s.n}(arg0, arg1, arg2);
}`;
  return `function __wbg_get_imports() {
    const import0 = {
        __wbg_new_typed_e09da9dae6ee5935: function(arg0, arg1) {
            const cb0 = (a, b) => __wasm_bindgen_func_elem_${promise.n}(arg0, arg1, a, b);
            return new Promise(cb0);
        },
${casts.map(cast).join("\n")}
    };${extra}
    return { "./onnx_generate_bg.js": import0 };
}

${shims.map(wrapper).join("\n\n")}
`;
}

const g = (n) => `__wbindgen_generic_000000000000000${n}`;
const shim = (n, type, ret = "Unit") => ({ n, type, ret });

/** Writes both builds to a new folder and runs `align` on them; returns the second wasm. */
function run({ first, second, secondExtra = "" }) {
  const dir = mkdtempSync(join(tmpdir(), "align-exports-"));
  try {
    const files = ["a.js", "a.wasm", "b.js", "b.wasm"].map((f) => join(dir, f));
    writeFileSync(files[0], glue(first.casts, first.shims, first.promise));
    writeFileSync(files[1], wasm(first.imports, first.shims));
    writeFileSync(files[2], glue(second.casts, second.shims, second.promise, secondExtra));
    const before = wasm(second.imports, second.shims);
    writeFileSync(files[3], before);
    let error;
    let result;
    try {
      result = align(...files);
    } catch (e) {
      error = e;
    }
    return { error, result, before, after: readFileSync(files[3]) };
  } finally {
    rmSync(dir, { recursive: true });
  }
}

// The first build: shims 10, 20 (returning through a pointer), 30 and 40; its casts sorted
// by descriptor as wasm-bindgen does, which puts shim_idx 855 after 7795 (text order).
const [u1, r, u2, p] = [shim(10, UNIT), shim(20, RETPTR, "Result"), shim(30, UNIT), shim(40, RETPTR)];
const first = {
  shims: [u1, r, u2, p],
  promise: p,
  casts: [[g(1), r, 7772], [g(2), u2, 7795], [g(3), u1, 855]],
  imports: [g(1), g(2), g(3)],
};
// The second: the same code at shims 11, 21, 31, 41, whose first shim's descriptor (1052) now
// sorts first, so each cast has another number.
const [u1b, rb, u2b, pb] = [shim(11, UNIT), shim(21, RETPTR, "Result"), shim(31, UNIT), shim(41, RETPTR)];
const second = {
  shims: [u1b, rb, u2b, pb],
  promise: pb,
  casts: [[g(1), u1b, 1052], [g(2), rb, 7772], [g(3), u2b, 7795]],
  imports: [g(1), g(2), g(3)],
};

test("casts numbered in another order take the first build's numbers, shims its names", () => {
  const { error, result, after } = run({ first, second });
  assert.equal(error, undefined);
  assert.deepEqual(result, { shims: 4, casts: 3 });
  const module = new WebAssembly.Module(after);
  // The second wasm's cast 1 calls shim 11, the first build's cast 3 shim 10; and so on.
  assert.deepEqual(
    WebAssembly.Module.imports(module).map((i) => i.name),
    ["memory", g(3), g(1), g(2)],
  );
  assert.deepEqual(
    WebAssembly.Module.exports(module).map((e) => e.name),
    [10, 20, 30, 40].map((n) => `__wasm_bindgen_func_elem_${n}`),
  );
});

test("the same numbering renames nothing but the shims", () => {
  const same = { ...second, casts: [[g(1), rb, 7772], [g(2), u2b, 7795], [g(3), u1b, 1052]] };
  const { error, result } = run({ first, second: same });
  assert.equal(error, undefined);
  assert.deepEqual(result, { shims: 4, casts: 0 });
});

test("glue that differs beyond the names fails and leaves the wasm as it was", () => {
  const { error, before, after } = run({ first, second, secondExtra: "\n    import0.extra = 1;" });
  assert.match(error?.message ?? "", /lines of code/);
  assert.deepEqual(after, before);
});

test("a cast of another descriptor fails", () => {
  const other = { ...second, casts: [[g(1), u1b, 1052], [g(2), rb, 7772], [g(3), { ...u2b, ret: "Bool" }, 7795]] };
  const { error, before, after } = run({ first, second: other });
  assert.match(error?.message ?? "", /has no counterpart/);
  assert.deepEqual(after, before);
});

test("paired shims of different wasm types fail", () => {
  const [u1c, rc, u2c, pc] = [shim(11, UNIT), shim(21, UNIT, "Result"), shim(31, UNIT), shim(41, RETPTR)];
  const other = {
    shims: [u1c, rc, u2c, pc],
    promise: pc,
    casts: [[g(1), u1c, 1052], [g(2), rc, 7772], [g(3), u2c, 7795]],
    imports: [g(1), g(2), g(3)],
  };
  const { error, before, after } = run({ first, second: other });
  assert.match(error?.message ?? "", /differ in type/);
  assert.deepEqual(after, before);
});
