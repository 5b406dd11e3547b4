//! `MatMulNBits` (`model::ops::matmul_nbits`) against the sums in f64 of the dequantized
//! weights: decoding (one row of `A`, which it rounds to 16-bit integers per group of 32) and
//! prompts (several rows: with 4-bit weights and integer zero points each row rounded so too,
//! otherwise through weights dequantized to f32). Shared by native tests
//! (tests/nbits_decode.rs) and wasm tests (the simd128 kernels; tests/wasm_api).
#![allow(dead_code)]

use onnx_generate::model::ops::matmul_nbits::{
    matmul, scales_to_lanes, to_lanes, NBits, Zero, INTEGER_PROMPT_ROWS,
};

/// A deterministic pseudo-random stream of u32 (xorshift64).
fn stream(seed: u64) -> impl FnMut() -> u32 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 32) as u32
    }
}

/// A 4-bit `MatMulNBits` of `K` x `N` in blocks of `bs`, its weight as it lies.
fn q4_op(k: usize, n: usize, bs: usize) -> NBits {
    NBits {
        k,
        n,
        bits: 4,
        block_size: bs,
        zero_points: None,
        bias: None,
        inputs: 3,
        label: "q4".into(),
        lanes: false,
    }
}

/// Each output is within the rounding bound of the 16-bit row (half of 1/32767 of its group's
/// largest magnitude, times the weight, summed) plus f32 rounding, and is bit for bit the
/// result of the kernel's documented arithmetic (`q4_reference`), the same for the portable
/// and the simd128 kernel; a NaN in the row gives NaN.
pub fn check_q4_decode() {
    let mut next = stream(0x243f_6a88_85a3_08d3);
    // Block size, K (a partial last block for 200 and 130), N, packed zero points.
    for (bs, k, n, packed) in [
        (32, 96, 7, false),
        (32, 200, 5, true),
        (128, 384, 6, false),
        (64, 130, 9, true),
    ] {
        let op = q4_op(k, n, bs);
        let blocks = k.div_ceil(bs);
        let zp_blob = blocks.div_ceil(2);
        let b: Vec<u8> = (0..n * blocks * bs / 2).map(|_| next() as u8).collect();
        let scales: Vec<f32> = (0..n * blocks)
            .map(|_| (next() % 1000) as f32 / 4000.0 + 0.01)
            .collect();
        let zp_bytes: Vec<u8> = (0..n * zp_blob).map(|_| next() as u8).collect();
        // Values in [-1, 1], and an outlier sixty times larger every 37 (as activations have).
        // The second group's are subnormal, so that its `32767 / max` overflows to infinity.
        // The third group's largest is 32767 and the others halves of odd integers: each
        // `x * 32767 / max` a tie, rounded to even.
        let a: Vec<f32> = (0..k)
            .map(|i| {
                let v = (next() % 2001) as f32 / 1000.0 - 1.0;
                if (32..64).contains(&i) {
                    v * 1e-40
                } else if i == 64 {
                    32767.0
                } else if (65..96).contains(&i) {
                    (i as f32 - 80.0) + 0.5
                } else if i % 37 == 5 {
                    v * 60.0
                } else {
                    v
                }
            })
            .collect();
        let zero = |col: usize, blk: usize| {
            if packed {
                ((zp_bytes[col * zp_blob + blk / 2] >> (4 * (blk % 2))) & 15) as f64
            } else {
                8.0
            }
        };
        let zp = if packed {
            Zero::Packed(&zp_bytes)
        } else {
            Zero::Default
        };
        let mut got = vec![0f32; n];
        matmul(&op, &a, 1, &b, &scales, &zp, &mut got).unwrap();
        let group_max = |i: usize| {
            let g = i / 32 * 32;
            a[g..(g + 32).min(k)]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs())) as f64
        };
        let exact = q4_reference(&a, &b, &scales, bs, n, |col, blk| zero(col, blk) as i32);
        for (col, (got, exact)) in got.iter().zip(&exact).enumerate() {
            assert_eq!(
                got.to_bits(),
                exact.to_bits(),
                "bs={bs} k={k} col={col}: {got} against the kernel's arithmetic {exact}"
            );
        }
        for (col, got) in got.iter().enumerate() {
            let (mut want, mut bound, mut magnitude) = (0f64, 0f64, 0f64);
            for (i, x) in a.iter().enumerate() {
                let byte = b[(col * blocks + i / bs) * bs / 2 + (i % bs) / 2];
                let q = if i.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                } as f64;
                let w = (q - zero(col, i / bs)) * scales[col * blocks + i / bs] as f64;
                want += w * *x as f64;
                magnitude += (w * *x as f64).abs();
                bound += w.abs() * 0.5 * group_max(i) / 32767.0;
            }
            let err = (*got as f64 - want).abs();
            assert!(
                err <= bound + 1e-6 * magnitude,
                "bs={bs} k={k} col={col}: {got} vs {want} (error {err:e}, bound {bound:e})"
            );
        }
        let mut with_nan = a.clone();
        with_nan[k / 2] = f32::NAN;
        matmul(&op, &with_nan, 1, &b, &scales, &zp, &mut got).unwrap();
        assert!(got.iter().all(|v| v.is_nan()), "bs={bs} k={k}: {got:?}");
    }
}

/// The 4-bit decode kernel's arithmetic, written out (`matmul_nbits`' `QuantizedRow` and
/// `q4_column_i16`): the row, padded to whole blocks, rounded to 16-bit integers per group of
/// 32 (scale `max |x| / 32767`, ties to even); per group, the integer sum of `(q - zero) * x`,
/// converted to f32 and multiplied by the group's scale times the block's, then added to the
/// total.
fn q4_reference(
    a: &[f32],
    b: &[u8],
    scales: &[f32],
    bs: usize,
    n: usize,
    zero: impl Fn(usize, usize) -> i32,
) -> Vec<f32> {
    let blocks = a.len().div_ceil(bs);
    let mut x = a.to_vec();
    x.resize(blocks * bs, 0.0);
    let (xq, xs): (Vec<Vec<i32>>, Vec<f32>) = x
        .chunks(32)
        .map(|g| {
            let max = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let inv = if max > 0.0 { 32767.0 / max } else { 0.0 };
            let q = g
                .iter()
                .map(|v| (v * inv).round_ties_even().clamp(-32767.0, 32767.0) as i32)
                .collect();
            (q, max / 32767.0)
        })
        .unzip();
    (0..n)
        .map(|col| {
            let mut total = 0f32;
            for (g, (xq, xs)) in xq.iter().zip(&xs).enumerate() {
                let blk = g * 32 / bs;
                let sum: i32 = (0..32)
                    .map(|e| {
                        let i = g * 32 + e;
                        let byte = b[(col * blocks + blk) * bs / 2 + (i % bs) / 2];
                        let q = if i.is_multiple_of(2) {
                            byte & 15
                        } else {
                            byte >> 4
                        };
                        (q as i32 - zero(col, blk)) * xq[e]
                    })
                    .sum();
                total += sum as f32 * (xs * scales[col * blocks + blk]);
            }
            total
        })
        .collect()
}

/// `MatMulNBits` on a prompt (several rows of `A`). With 4-bit weights in blocks of 32 or more,
/// integer zero points and `INTEGER_PROMPT_ROWS` rows or more, each row is rounded to 16-bit
/// integers as a decoding row is: each output is bit for bit the decoding kernel's arithmetic
/// on its row (`q4_reference`), and a row with a NaN gives NaN. Otherwise (each column
/// dequantized to f32, then multiplied with every row) against the sums in f64 of the
/// dequantized weights, within the f32 rounding of the dequantization and of the sums. 4 and
/// 8 bits, block sizes 16 to 128 (a partial last block), default, packed and float zero
/// points, 2 to 13 rows, N not a multiple of 4 or of 8 (the 4-bit prompt kernel takes eight
/// columns at a time, up to four rows a pass).
pub fn check_prompt() {
    let mut next = stream(0x1319_8a2e_0370_7344);
    // Bits, block size, K, N, zero points (0 default, 1 packed, 2 float).
    for (bits, bs, k, n, zp_kind) in [
        (4, 16, 80, 7, 1),
        (4, 32, 96, 9, 0),
        (4, 32, 200, 5, 1),
        (4, 64, 130, 19, 1),
        (4, 64, 130, 6, 2),
        (4, 128, 384, 4, 0),
        (4, 128, 200, 16, 0),
        (8, 16, 40, 5, 2),
        (8, 64, 130, 7, 1),
    ] {
        let integer_weights = bits == 4 && bs >= 32 && zp_kind != 2;
        let op = NBits {
            k,
            n,
            bits,
            block_size: bs,
            zero_points: None,
            bias: None,
            inputs: 3,
            label: "prompt".into(),
            lanes: false,
        };
        let blocks = k.div_ceil(bs);
        let blob = bs * bits / 8;
        let zp_blob = (blocks * bits).div_ceil(8);
        let b: Vec<u8> = (0..n * blocks * blob).map(|_| next() as u8).collect();
        let scales: Vec<f32> = (0..n * blocks)
            .map(|_| (next() % 1000) as f32 / 4000.0 + 0.01)
            .collect();
        let zp_bytes: Vec<u8> = (0..n * zp_blob).map(|_| next() as u8).collect();
        let zp_floats: Vec<f32> = (0..n * blocks)
            .map(|_| (next() % 1000) as f32 / 100.0)
            .collect();
        let zero = |col: usize, blk: usize| match zp_kind {
            0 => (1u32 << (bits - 1)) as f64,
            1 => {
                let bit = blk * bits;
                ((zp_bytes[col * zp_blob + bit / 8] >> (bit % 8)) as u32 & ((1 << bits) - 1)) as f64
            }
            _ => zp_floats[col * blocks + blk] as f64,
        };
        let zp = match zp_kind {
            0 => Zero::Default,
            1 => Zero::Packed(&zp_bytes),
            _ => Zero::Float(&zp_floats),
        };
        let weight = |col: usize, i: usize| {
            let blk = i / bs;
            let q = if bits == 4 {
                let byte = b[(col * blocks + blk) * blob + (i % bs) / 2];
                if i.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                }
            } else {
                b[(col * blocks + blk) * blob + i % bs]
            } as f64;
            (q - zero(col, blk)) * scales[col * blocks + blk] as f64
        };
        for rows in [2, 3, 5, 8, 9, 13] {
            let integer = integer_weights && rows >= INTEGER_PROMPT_ROWS;
            let a: Vec<f32> = (0..rows * k)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let mut got = vec![0f32; rows * n];
            matmul(&op, &a, rows, &b, &scales, &zp, &mut got).unwrap();
            if integer {
                for r in 0..rows {
                    let row = &a[r * k..(r + 1) * k];
                    let exact =
                        q4_reference(row, &b, &scales, bs, n, |col, blk| zero(col, blk) as i32);
                    for (col, exact) in exact.iter().enumerate() {
                        let g = got[r * n + col];
                        assert_eq!(
                            g.to_bits(),
                            exact.to_bits(),
                            "bs={bs} k={k} n={n} rows={rows} row {r} col {col}: {g} against the decoding kernel's arithmetic {exact}"
                        );
                    }
                }
                let mut with_nan = a.clone();
                with_nan[k + k / 2] = f32::NAN;
                matmul(&op, &with_nan, rows, &b, &scales, &zp, &mut got).unwrap();
                assert!(
                    got[n..2 * n].iter().all(|v| v.is_nan()),
                    "bs={bs} k={k} rows={rows}: {:?}",
                    &got[n..2 * n]
                );
                continue;
            }
            for r in 0..rows {
                for col in 0..n {
                    let (mut want, mut magnitude) = (0f64, 0f64);
                    for i in 0..k {
                        let p = weight(col, i) * a[r * k + i] as f64;
                        want += p;
                        magnitude += p.abs();
                    }
                    let g = got[r * n + col] as f64;
                    let bound = (k + 2) as f64 * f32::EPSILON as f64 * magnitude;
                    assert!(
                        (g - want).abs() <= bound,
                        "bits={bits} bs={bs} k={k} rows={rows} row {r} col {col}: {g} vs {want} (bound {bound:e})"
                    );
                }
            }
        }
    }
}

/// 4-bit weights in lanes (`to_lanes`, `scales_to_lanes`, as the loader lays them out) give
/// each row the bits that the weights as they lie give it alone (a decoding row, rounded to 16
/// bits): every row of a prompt, which as they lie is rounded so from `INTEGER_PROMPT_ROWS`
/// rows and taken through f32 weights below. With a NaN in a row, every row goes through f32
/// weights, as it does for the weights as they lie: the same outputs within the rounding of
/// sums taken in another order, NaN where the row has one. Block sizes 32 to 128 (a partial
/// last block), default and packed zero points, N of one to three passes of sixteen columns.
pub fn check_lanes() {
    let mut next = stream(0x0a40_9382_2299_f31d);
    for (bs, k, n, packed) in [
        (32, 96, 16, false),
        (32, 200, 32, true),
        (64, 130, 16, true),
        (128, 384, 48, false),
        (64, 256, 16, true),
    ] {
        let op = q4_op(k, n, bs);
        let in_lanes = NBits {
            lanes: true,
            ..op.clone()
        };
        let blocks = k.div_ceil(bs);
        let zp_blob = blocks.div_ceil(2);
        let b: Vec<u8> = (0..n * blocks * bs / 2).map(|_| next() as u8).collect();
        let scales: Vec<f32> = (0..n * blocks)
            .map(|_| (next() % 1000) as f32 / 4000.0 + 0.01)
            .collect();
        let zp_bytes: Vec<u8> = (0..n * zp_blob).map(|_| next() as u8).collect();
        let zp = if packed {
            Zero::Packed(&zp_bytes)
        } else {
            Zero::Default
        };
        let mut lanes_b = vec![0u8; b.len()];
        to_lanes(&b, n, blocks * bs, &mut lanes_b);
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut lane_scale_bytes = vec![0u8; scale_bytes.len()];
        scales_to_lanes(&scale_bytes, 4, n, blocks, &mut lane_scale_bytes);
        let lanes_scales: Vec<f32> = lane_scale_bytes
            .chunks_exact(4)
            .map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]))
            .collect();
        for rows in [1, 2, 3, 7, 8, 9, 13] {
            let mut a: Vec<f32> = (0..rows * k)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            for with_nan in [false, true] {
                if with_nan {
                    a[k / 2] = f32::NAN;
                }
                let mut want = vec![0f32; rows * n];
                if with_nan {
                    matmul(&op, &a, rows, &b, &scales, &zp, &mut want).unwrap();
                } else {
                    for (row, want) in a.chunks_exact(k).zip(want.chunks_exact_mut(n)) {
                        matmul(&op, row, 1, &b, &scales, &zp, want).unwrap();
                    }
                    if rows >= INTEGER_PROMPT_ROWS {
                        // (The prompt kernel, the same bits.)
                        let mut prompt = vec![0f32; rows * n];
                        matmul(&op, &a, rows, &b, &scales, &zp, &mut prompt).unwrap();
                        assert_eq!(
                            prompt.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "bs={bs} k={k} n={n} rows={rows}: the prompt kernel as they lie"
                        );
                    }
                }
                let mut got = vec![0f32; rows * n];
                matmul(&in_lanes, &a, rows, &lanes_b, &lanes_scales, &zp, &mut got).unwrap();
                let same_bits = !with_nan;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let ok = if w.is_nan() {
                        g.is_nan()
                    } else if same_bits {
                        g.to_bits() == w.to_bits()
                    } else {
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs())
                    };
                    assert!(
                        ok,
                        "bs={bs} k={k} n={n} rows={rows} nan={with_nan} output {i}: {g} in lanes, {w} as they lie"
                    );
                }
            }
        }
    }
}
