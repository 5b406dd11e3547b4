"""Reference cases for the contrib-op unit tests (src/model/ops/*), computed with onnxruntime.

Run once from the repository root with the real-model environment:

    .realmodels/venv/bin/python scripts/op_references.py

For each case it writes tests/fixtures/ops/NAME.onnx (a one-node graph, or the few nodes of a
pattern such as DynamicQuantizeLinear -> MatMulInteger) and NAME.json: every graph input and
output as {name, dtype, shape, data}, outputs being onnxruntime's. A case may carry
"present_valid": the valid positions of each row of the rank-4 (KV cache) outputs; only those
are compared (onnxruntime leaves the rest of a non-shared present buffer unspecified).
"""

import json
import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

OUT = os.path.join("tests", "fixtures", "ops")
rng = np.random.default_rng(7)

NP_TO_ONNX = {
    np.float32: TensorProto.FLOAT,
    np.int64: TensorProto.INT64,
    np.int32: TensorProto.INT32,
    np.uint8: TensorProto.UINT8,
    np.int8: TensorProto.INT8,
}


def vi(name, arr):
    return helper.make_tensor_value_info(name, NP_TO_ONNX[arr.dtype.type], list(arr.shape))


def save(name, nodes, inputs, initializers=None, outputs=("y",), extra=None, opset=21):
    """inputs: dict name -> array (graph inputs); initializers: dict name -> array."""
    initializers = initializers or {}
    graph = helper.make_graph(
        nodes,
        name,
        [vi(n, a) for n, a in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [onnx.numpy_helper.from_array(a, n) for n, a in initializers.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    path = os.path.join(OUT, name + ".onnx")
    onnx.save(model, path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    results = sess.run(list(outputs), inputs)
    case = {
        "inputs": [desc(n, a) for n, a in inputs.items()],
        "outputs": [desc(n, np.asarray(a)) for n, a in zip(outputs, results)],
    }
    case.update(extra or {})
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(case, f)
    print(name, [np.asarray(r).shape for r in results])


def desc(name, a):
    dtype = {np.float32: "f32", np.int64: "i64", np.int32: "i32", np.uint8: "u8", np.int8: "i8"}[
        a.dtype.type
    ]
    data = a.reshape(-1).tolist()
    if dtype == "f32":
        data = [float(x) for x in data]
    return {"name": name, "dtype": dtype, "shape": list(a.shape), "data": data}


def f32(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rotary_caches(positions, half):
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    t = np.arange(positions)[:, None] * inv[None, :]
    return np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)


def gqa(name, batch, seq, heads, kv, dim, buffer, lengths, packed, rotary, interleaved=0,
        window=-1, softcap=0.0):
    """`lengths`: past positions of each row already in the buffer (0 for a first prompt)."""
    total = max(lengths) + seq
    inputs = {}
    if packed:
        inputs["query"] = f32(batch, seq, (heads + 2 * kv) * dim)
    else:
        inputs["query"] = f32(batch, seq, heads * dim)
        inputs["key"] = f32(batch, seq, kv * dim)
        inputs["value"] = f32(batch, seq, kv * dim)
    pk = np.zeros((batch, kv, buffer, dim), np.float32)
    pv = np.zeros((batch, kv, buffer, dim), np.float32)
    for b, l in enumerate(lengths):
        pk[b, :, :l] = f32(kv, l, dim)
        pv[b, :, :l] = f32(kv, l, dim)
    inputs["past_key"] = pk
    inputs["past_value"] = pv
    inputs["seqlens_k"] = np.array([l + seq - 1 for l in lengths], np.int32)
    inputs["total_sequence_length"] = np.array(total, np.int32)
    names = ["query", "key" if not packed else "", "value" if not packed else "",
             "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    if rotary:
        cos, sin = rotary_caches(buffer, dim // 2)
        inputs["cos_cache"] = cos
        inputs["sin_cache"] = sin
        names += ["cos_cache", "sin_cache"]
    node = helper.make_node(
        "GroupQueryAttention", names, ["y", "present_key", "present_value"],
        domain="com.microsoft", num_heads=heads, kv_num_heads=kv, do_rotary=int(rotary),
        rotary_interleaved=interleaved, local_window_size=window, softcap=softcap,
    )
    valid = [l + seq for l in lengths]
    save(name, [node], inputs, outputs=("y", "present_key", "present_value"),
         extra={"present_valid": valid})


def pack(q, bits):
    """q: uint [..., n] values < 2**bits along the last axis -> bytes, low bits first."""
    per = 8 // bits
    n = q.shape[-1]
    padded = np.zeros(q.shape[:-1] + ((n + per - 1) // per * per,), np.uint8)
    padded[..., :n] = q
    padded = padded.reshape(q.shape[:-1] + (-1, per))
    out = np.zeros(padded.shape[:-1], np.uint8)
    for i in range(per):
        out |= (padded[..., i] << (bits * i)).astype(np.uint8)
    return out


def matmul_nbits(name, rows, k, n, bits, block, zero_points, bias=False):
    blocks = (k + block - 1) // block
    q = rng.integers(0, 2 ** bits, size=(n, blocks, block), dtype=np.uint8)
    b = pack(q, bits)  # [n, blocks, block * bits / 8]
    scales = (rng.random((n * blocks,)) * 0.1 + 0.01).astype(np.float32)
    inits = {"b": b, "scales": scales}
    names = ["a", "b", "scales"]
    if zero_points:
        z = rng.integers(0, 2 ** bits, size=(n, blocks), dtype=np.uint8)
        inits["zero_points"] = pack(z, bits).reshape(-1)
        names.append("zero_points")
    if bias:
        inits["bias"] = f32(n)
        names += [""] * (5 - len(names)) + ["bias"]
    node = helper.make_node("MatMulNBits", names, ["y"], domain="com.microsoft", K=k, N=n,
                            bits=bits, block_size=block)
    save(name, [node], {"a": f32(*rows, k)}, inits)


def gather_block_quantized(name, rows, cols, bits, block, zero_points, indices):
    blocks = (cols + block - 1) // block
    q = rng.integers(0, 2 ** bits, size=(rows, cols), dtype=np.uint8)
    inits = {"data": pack(q, bits), "scales": (rng.random((rows, blocks)) + 0.1).astype(np.float32)}
    names = ["data", "indices", "scales"]
    if zero_points:
        z = rng.integers(0, 2 ** bits, size=(rows, blocks), dtype=np.uint8)
        inits["zero_points"] = pack(z, bits)
        names.append("zero_points")
    node = helper.make_node("GatherBlockQuantized", names, ["y"], domain="com.microsoft",
                            bits=bits, block_size=block, gather_axis=0, quantize_axis=1)
    save(name, [node], {"indices": np.array(indices, np.int64)}, inits)


def main():
    os.makedirs(OUT, exist_ok=True)
    gqa("gqa_prompt_packed_rotary", 2, 5, 4, 2, 16, 8, [0, 0], packed=True, rotary=True)
    gqa("gqa_decode_rotary_interleaved", 2, 1, 4, 2, 16, 8, [3, 5], packed=False, rotary=True,
        interleaved=1)
    gqa("gqa_subsequent_window_softcap", 1, 3, 6, 2, 16, 10, [4], packed=True, rotary=False,
        window=2, softcap=5.0)
    gqa("gqa_decode_mha", 2, 1, 2, 2, 16, 12, [7, 2], packed=True, rotary=True)

    matmul_nbits("mnb_q4_b32", (1, 3), 64, 24, 4, 32, False)
    matmul_nbits("mnb_q4_b16_zp_bias", (2,), 48, 10, 4, 16, True, bias=True)
    matmul_nbits("mnb_q4_b128_zp_partial", (3,), 200, 7, 4, 128, True)
    matmul_nbits("mnb_q8_b64_zp", (2, 2), 128, 9, 8, 64, True)
    matmul_nbits("mnb_q8_b256", (1,), 256, 5, 8, 256, False)

    gather_block_quantized("gbq_q4_b32", 10, 64, 4, 32, False, [[1, 9, 0], [3, 3, 7]])
    gather_block_quantized("gbq_q4_b16_zp", 6, 48, 4, 16, True, [5, 0, 2])
    gather_block_quantized("gbq_q8_b32_zp", 5, 64, 8, 32, True, [[4], [1]])

    x = f32(2, 3, 16)
    save("simplified_layer_norm",
         [helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], epsilon=1e-5, axis=-1)],
         {"x": x + 0.5}, {"g": f32(16)})
    save("skip_simplified_layer_norm",
         [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g"],
                           ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5)],
         {"x": x, "skip": f32(2, 3, 16)}, {"g": f32(16)}, outputs=("y", "sum"))
    save("skip_layer_norm",
         [helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "beta", "bias"],
                           ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5)],
         {"x": x, "skip": f32(2, 3, 16)}, {"g": f32(16), "beta": f32(16), "bias": f32(16)},
         outputs=("y", "sum"))
    cos, sin = rotary_caches(16, 4)
    for inter in (0, 1):
        save(f"rotary_embedding_interleaved{inter}",
             [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"],
                               domain="com.microsoft", interleaved=inter, num_heads=2)],
             {"x": f32(2, 3, 16), "pos": np.array([[0, 1, 2], [5, 6, 7]], np.int64)},
             {"cos": cos, "sin": sin})
    w = rng.integers(-127, 128, size=(16, 8), dtype=np.int8)
    save("dynamic_quantize_matmul_integer",
         [helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "as", "az"]),
          helper.make_node("MatMulInteger", ["aq", "w", "az", "wz"], ["acc"]),
          helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
          helper.make_node("Mul", ["as", "ws"], ["s"]),
          helper.make_node("Mul", ["accf", "s"], ["y"])],
         {"a": f32(3, 16)},
         {"w": w, "wz": np.array(0, np.int8), "ws": np.array(0.02, np.float32)})

    # One-dimensional convolutions (src/model/ops/conv1d.rs): Whisper's two (kernel 3, pads 1,
    # strides 1 and 2), asymmetric pads without bias, and a grouped, dilated one for tract.
    def conv1d(name, x, w, bias, **attrs):
        inits = {"w": w}
        names = ["x", "w"]
        if bias:
            inits["b"] = f32(w.shape[0])
            names.append("b")
        save(name, [helper.make_node("Conv", names, ["y"], **attrs)], {"x": x}, inits)

    conv1d("conv1d_k3_s1_p1_bias", f32(1, 5, 19), f32(9, 5, 3), True,
           kernel_shape=[3], pads=[1, 1], strides=[1])
    conv1d("conv1d_k3_s2_p1_batch2", f32(2, 6, 20), f32(7, 6, 3), True,
           kernel_shape=[3], pads=[1, 1], strides=[2])
    conv1d("conv1d_k4_s3_asymmetric_pads_no_bias", f32(1, 4, 23), f32(10, 4, 4), False,
           pads=[2, 0], strides=[3])
    conv1d("conv1d_grouped_dilated", f32(1, 4, 12), f32(6, 2, 3), True,
           group=2, dilations=[2], pads=[1, 1])

    # tract's DFT (its `Fft` op), which runs on crates/rustfft (Cargo.toml's patch): a power of
    # two (radix-2), another length (direct DFT), inverse, and a real input.
    def dft(name, x, **attrs):
        save(name, [helper.make_node("DFT", ["x", "", "axis"], ["y"], **attrs)], {"x": x},
             {"axis": np.array(1, np.int64)}, opset=20)

    dft("dft_8_complex", f32(2, 8, 2), inverse=0)
    dft("dft_12_complex_inverse", f32(1, 12, 2), inverse=1)
    dft("dft_10_real", f32(3, 10, 1), inverse=0)


if __name__ == "__main__":
    main()
