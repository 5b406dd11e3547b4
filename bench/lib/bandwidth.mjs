// Memory bandwidth inside wasm: the module of bandwidth.wat sums a large buffer of f32 (SIMD,
// four accumulators) on one thread, or on `threads` workers that each read their own part of
// one shared memory at the same time; each reads its range as one stream (`sum`) and as four
// quarters side by side (`sum4`), and the faster is the result. The same code runs in Node and
// in the browser page; the caller passes `spawn(url)`, which starts a worker running
// bandwidth-worker.mjs.
//
// GB/s = bytes read / seconds, with GB = 1e9 bytes; the best of `passes` timed passes after a
// warm-up pass (the physical limit is what the machine reaches, not its average under load).

const PAGE = 65536;
/** Bytes by which `sum4`'s quarters are shortened: a cache line more than a page. */
const SKEW = 4096 + 64;

/** Reply of a worker (a Node worker_threads Worker or a browser Worker) to one message. */
function ask(worker, message) {
  return new Promise((resolve, reject) => {
    const handle = (data) => (data && data.error ? reject(new Error(data.error)) : resolve(data));
    if (typeof worker.once === "function") worker.once("message", handle);
    else worker.addEventListener("message", (e) => handle(e.data), { once: true });
    worker.postMessage(message);
  });
}

export async function measureBandwidth({ wasm, megabytes = 512, passes = 5, threads = 1, spawn }) {
  const bytes = megabytes * 1024 * 1024;
  const pages = Math.ceil(bytes / PAGE) + 1;
  const memory = new WebAssembly.Memory({ initial: pages, maximum: pages, shared: true });
  // Touch every page with non-zero values, so reads come from committed memory.
  new Float32Array(memory.buffer, 0, bytes / 4).fill(1);
  const module = await WebAssembly.compile(wasm);
  let run;
  let cleanup = () => {};
  // Each reader's range: a multiple of 256 bytes, so that `sum4`'s quarters are whole lines.
  const part = threads === 1 ? bytes : Math.floor(bytes / threads / 256) * 256;
  // `sum4` reads a range 4 * SKEW bytes shorter, so that its quarters do not lie a power of two
  // apart (nor a multiple of a 4 KiB page): there they map to the same cache sets and memory
  // banks, and on a 2-core AMD EPYC (Zen 4) the four quarters of 512 MiB read at 17 GB/s
  // where one stream read 24, and four quarters 128 MiB - 4160 bytes apart 26.5.
  const lengths = { sum: part, sum4: part - 4 * SKEW };
  if (threads === 1) {
    const { exports } = await WebAssembly.instantiate(module, { env: { memory } });
    run = async (fn) => {
      const t = performance.now();
      const s = exports[fn](0, lengths[fn]);
      const ms = performance.now() - t;
      if (s !== lengths[fn] / 4) throw new Error(`bandwidth: wrong sum ${s}`);
      return ms;
    };
  } else {
    const workers = [];
    for (let i = 0; i < threads; i++) workers.push(await spawn());
    await Promise.all(workers.map((w) => ask(w, { module, memory })));
    cleanup = () => workers.forEach((w) => w.terminate());
    run = async (fn) => {
      const t = performance.now();
      const sums = await Promise.all(workers.map((w, i) => ask(w, { fn, start: i * part, bytes: lengths[fn] })));
      const ms = performance.now() - t;
      if (sums.some((s) => s !== lengths[fn] / 4)) throw new Error(`bandwidth: wrong sums ${sums}`);
      return ms;
    };
  }
  try {
    const results = [];
    for (const fn of ["sum", "sum4"]) {
      const read = lengths[fn] * threads;
      await run(fn);
      const times = [];
      for (let i = 0; i < passes; i++) times.push(await run(fn));
      const sorted = [...times].sort((a, b) => a - b);
      results.push({ gbps: read / sorted[0] / 1e6, gbps_median: read / sorted[sorted.length >> 1] / 1e6 });
    }
    const [one, four] = results;
    const best = four.gbps > one.gbps ? four : one;
    return {
      threads,
      megabytes,
      gbps: best.gbps,
      gbps_median: best.gbps_median,
      gbps_one_stream: one.gbps,
      gbps_four_streams: four.gbps,
    };
  } finally {
    cleanup();
  }
}
