// Bytes of weights a decoder reads to produce one token, from the ONNX file itself: every
// initializer (and Constant tensor) counts in full, except tables read only by Gather ops
// (token embeddings: a step reads one row of them). Tied embeddings that also feed the
// lm_head through a Transpose or MatMul are read in full, as they are. Plus the KV cache
// the attention reads at a given position. A minimal protobuf walker reads the file from disk
// by position, skipping tensor payloads, so a 540 MB file is never held in memory.
import { closeSync, fstatSync, openSync, readSync } from "node:fs";

// ONNX TensorProto.DataType -> bits per element.
const BITS = {
  1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64,
  16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4,
};
const GATHER_OPS = new Set(["Gather", "GatherBlockQuantized"]);

/** Reads protobuf fields of a file region [start, end) by position. */
class FileReader {
  constructor(fd) {
    this.fd = fd;
    this.buf = Buffer.alloc(1 << 16);
    this.bufStart = 0;
    this.bufLen = 0;
  }
  byte(pos) {
    if (pos < this.bufStart || pos >= this.bufStart + this.bufLen) {
      this.bufStart = pos;
      this.bufLen = readSync(this.fd, this.buf, 0, this.buf.length, pos);
      if (this.bufLen === 0) throw new Error(`ONNX file truncated at byte ${pos}`);
    }
    return this.buf[pos - this.bufStart];
  }
  varint(pos) {
    let value = 0;
    let scale = 1;
    for (;;) {
      const b = this.byte(pos++);
      value += (b & 0x7f) * scale;
      if (b < 0x80) return [value, pos];
      scale *= 128;
    }
  }
  bytes(pos, len) {
    const out = Buffer.alloc(len);
    readSync(this.fd, out, 0, len, pos);
    return out;
  }
  /** Calls visit(field, wireType, valueOrStart, length) for each field of [start, end). */
  fields(start, end, visit) {
    let pos = start;
    while (pos < end) {
      let key;
      [key, pos] = this.varint(pos);
      const field = Math.floor(key / 8);
      const wire = key & 7;
      if (wire === 0) {
        let v;
        [v, pos] = this.varint(pos);
        visit(field, wire, v, 0);
      } else if (wire === 2) {
        let len;
        [len, pos] = this.varint(pos);
        visit(field, wire, pos, len);
        pos += len;
      } else if (wire === 1) {
        pos += 8;
      } else if (wire === 5) {
        pos += 4;
      } else {
        throw new Error(`unsupported protobuf wire type ${wire} at byte ${pos}`);
      }
    }
  }
  string(pos, len) {
    return this.bytes(pos, len).toString("utf8");
  }
}

function readTensor(r, start, len) {
  const t = { name: "", dims: [], type: 0 };
  r.fields(start, start + len, (f, w, v, l) => {
    if (f === 1 && w === 0) t.dims.push(v);
    else if (f === 1 && w === 2) {
      let p = v;
      while (p < v + l) {
        let d;
        [d, p] = r.varint(p);
        t.dims.push(d);
      }
    } else if (f === 2) t.type = v;
    else if (f === 8) t.name = r.string(v, l);
  });
  const bits = BITS[t.type];
  if (!bits) throw new Error(`tensor ${t.name}: unknown ONNX data type ${t.type}`);
  t.bytes = (t.dims.reduce((a, b) => a * b, 1) * bits) / 8;
  return t;
}

/** Nodes, initializers and input element types of a graph and its subgraphs. */
function readGraph(r, start, len, acc) {
  r.fields(start, start + len, (f, w, v, l) => {
    if (f === 1) readNode(r, v, l, acc);
    else if (f === 5) acc.initializers.push(readTensor(r, v, l));
    else if (f === 11) readInput(r, v, l, acc);
  });
}

function readNode(r, start, len, acc) {
  const node = { inputs: [], op: "" };
  r.fields(start, start + len, (f, w, v, l) => {
    if (f === 1) node.inputs.push(r.string(v, l));
    else if (f === 4) node.op = r.string(v, l);
    else if (f === 5) {
      // AttributeProto: t (5) a tensor (Constant), g (6) / graphs (11) subgraphs (If, Loop).
      r.fields(v, v + l, (af, aw, av, al) => {
        if (af === 5) acc.constants.push(readTensor(r, av, al));
        else if (af === 6 || af === 11) readGraph(r, av, al, acc);
      });
    }
  });
  acc.nodes.push(node);
}

function readInput(r, start, len, acc) {
  let name = "";
  let elem = 0;
  r.fields(start, start + len, (f, w, v, l) => {
    if (f === 1) name = r.string(v, l);
    else if (f === 2) {
      // TypeProto.tensor_type (1) -> elem_type (1)
      r.fields(v, v + l, (tf, tw, tv, tl) => {
        if (tf === 1) r.fields(tv, tv + tl, (ef, ew, ev) => ef === 1 && (elem = ev));
      });
    }
  });
  acc.inputs.push({ name, elem });
}

/**
 * The weights of an ONNX file: `{ total, perToken, gatherOnly, cacheElementBytes }` in bytes.
 * `perToken` counts what a decode step reads (all weights but Gather-only tables).
 */
export function weightBytes(path) {
  const fd = openSync(path, "r");
  try {
    const r = new FileReader(fd);
    const size = fstatSync(fd).size;
    const acc = { nodes: [], initializers: [], constants: [], inputs: [] };
    r.fields(0, size, (f, w, v, l) => {
      if (f === 7) readGraph(r, v, l, acc);
    });
    const consumers = new Map();
    for (const n of acc.nodes) {
      n.inputs.forEach((name, i) => {
        if (!consumers.has(name)) consumers.set(name, []);
        consumers.get(name).push({ op: n.op, index: i });
      });
    }
    let total = 0;
    let gatherOnly = 0;
    for (const t of [...acc.initializers, ...acc.constants]) {
      total += t.bytes;
      const uses = consumers.get(t.name) || [];
      if (uses.length > 0 && uses.every((u) => GATHER_OPS.has(u.op) && u.index === 0)) {
        gatherOnly += t.bytes;
      }
    }
    const past = acc.inputs.find((i) => /^past_key_values\.0\.key$|^past_key_values\.0\.decoder\.key$/.test(i.name));
    const cacheElementBytes = past ? BITS[past.elem] / 8 : 4;
    return { total, perToken: total - gatherOnly, gatherOnly, cacheElementBytes };
  } finally {
    closeSync(fd);
  }
}

/** Bytes of KV cache one decode step reads at `positions` cached positions. */
export function cacheBytesPerToken(config, positions, elementBytes) {
  const layers = config.num_hidden_layers;
  const kvHeads = config.num_key_value_heads ?? config.num_attention_heads;
  const headDim = config.head_dim ?? config.hidden_size / config.num_attention_heads;
  return 2 * layers * kvHeads * headDim * elementBytes * positions;
}
