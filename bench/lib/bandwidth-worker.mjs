// A worker of measureBandwidth (bandwidth.mjs), in Node (worker_threads) or a browser: the
// first message brings the compiled module and the shared memory, each later one a range to sum
// and the export that sums it (`sum` or `sum4`).
const port =
  typeof process !== "undefined" && process.versions && process.versions.node
    ? (await import("node:worker_threads")).parentPort
    : self;
let exports;
port.addEventListener("message", async (e) => {
  try {
    const m = e.data;
    if (m.module) {
      ({ exports } = await WebAssembly.instantiate(m.module, { env: { memory: m.memory } }));
      port.postMessage("ready");
    } else {
      port.postMessage(exports[m.fn](m.start, m.bytes));
    }
  } catch (err) {
    port.postMessage({ error: String(err && err.stack ? err.stack : err) });
  }
});
