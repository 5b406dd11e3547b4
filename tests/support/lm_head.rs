//! The bounds of the `lm_head`'s logits (`model::lm_head`, greedy decoding) against the exact
//! logits, which are the plan's: shared by native tests (tests/lm_head_bounds.rs) and wasm
//! tests (the simd128 int8 kernel; tests/wasm_api).
#![allow(dead_code)]

use std::sync::Arc;

use onnx_generate::decoder::Head;
use onnx_generate::model::lm_head::LmHead;
use onnx_generate::model::ops::linalg::panel_index;
use onnx_generate::model::ops::matmul_weights::{Layout, Weights};
use tract_onnx::prelude::*;

/// A deterministic pseudo-random stream in [-1, 1] (xorshift64).
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Rows of very different scales: plain, all zero, one outlier, subnormal, tiny and large.
fn weights(k: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut next = uniform(seed);
    let mut w = vec![0f32; n * k];
    for (j, row) in w.chunks_exact_mut(k).enumerate() {
        let scale = match j % 6 {
            0 => 1.0,
            1 => 0.0,
            2 => 1e-3,
            3 => 1e-40,
            4 => 37.0,
            _ => 0.05,
        };
        row.iter_mut().for_each(|v| *v = next() * scale);
        if j % 6 == 4 {
            row[j % k] = 1e4;
        }
    }
    w
}

/// Inputs: plain, a wide range of magnitudes, all zero, one large value among small ones.
fn inputs(k: usize) -> Vec<Vec<f32>> {
    let mut next = uniform(0x9e37_79b9_7f4a_7c15);
    let plain: Vec<f32> = (0..k).map(|_| next() * 3.0).collect();
    let wide: Vec<f32> = (0..k)
        .map(|i| next() * 10f32.powi(i as i32 % 9 - 4))
        .collect();
    let mut spike: Vec<f32> = (0..k).map(|_| next() * 1e-3).collect();
    spike[k / 2] = 800.0;
    vec![plain, wide, vec![0.0; k], spike]
}

fn head(w: &[f32], k: usize, n: usize, layout: Layout, f16_weights: bool, dt: DatumType) -> LmHead {
    let mut values = w.to_vec();
    if layout == Layout::Panels {
        for j in 0..n {
            for i in 0..k {
                values[panel_index(j, i, n, k)] = w[j * k + i];
            }
        }
    }
    let tensor = if f16_weights {
        let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        Tensor::from_shape(&[n, k], &h).unwrap()
    } else {
        Tensor::from_shape(&[n, k], &values).unwrap()
    };
    let op = Weights {
        k,
        n,
        layout,
        label: "lm_head".into(),
    };
    LmHead::new(op, Arc::new(tensor), dt).unwrap()
}

/// For f32 weights (as rows and in panels) and f16 weights, logits of f32 and of f16: each
/// logit one at a time (`Head::logit`) is bit for bit the full product's, each bound is at
/// least its logit and at most `|x|_1 max |w_j| / 100` above it, and the same in parts; an
/// input or a weight that is not finite gives no bounds.
pub fn check_bounds() {
    // 1030 rows: the int8 copy's pieces of 512 rows, and a partial one. With `k` a multiple
    // of 4, a piece's rows in `matmul_integer`'s blocks of four columns but its last `count %
    // 16` (`k` a multiple of 16 or not: the simd128 placement's tail); otherwise as they lie.
    for (k, n) in [
        (4, 9),
        (20, 13),
        (36, 130),
        (576, 23),
        (20, 1030),
        (48, 1030),
        (30, 1030),
        (7, 40),
    ] {
        let w = weights(k, n, 0x243f_6a88_85a3_08d3 ^ k as u64);
        let cases = [
            (Layout::Nk, false, f32::datum_type()),
            (Layout::Panels, false, f32::datum_type()),
            (Layout::Nk, true, f32::datum_type()),
            (Layout::Nk, false, f16::datum_type()),
        ];
        // Panels need `k` a multiple of 4.
        let cases = cases
            .into_iter()
            .filter(|c| c.0 != Layout::Panels || k.is_multiple_of(4));
        for (layout, f16_weights, dt) in cases {
            let head = head(&w, k, n, layout, f16_weights, dt);
            let case = format!("k={k} n={n} {layout:?} f16 weights {f16_weights} {dt:?}");
            let xs: Vec<Vec<f32>> = inputs(k)
                .into_iter()
                .map(|mut x| {
                    if dt == f16::datum_type() {
                        // Logits within f16's range.
                        x.iter_mut().for_each(|v| *v *= 1e-4);
                    }
                    x
                })
                .collect();
            for x in &xs {
                let mut full = vec![0f32; n];
                head.full(x, 1, &mut full).unwrap();
                let mut bounds = vec![0f32; n];
                assert!(head.bounds(x, &mut bounds).unwrap(), "{case}");
                for j in 0..n {
                    let exact = head.logit(x, j).unwrap();
                    assert_eq!(exact.to_bits(), full[j].to_bits(), "{case}: logit {j}");
                    let wj = |i: usize| {
                        let v = w[j * k + i];
                        if f16_weights {
                            f16::from_f32(v).to_f32()
                        } else {
                            v
                        }
                    };
                    // The bound's terms: half a step of the row's int8 grid times |x|_1, and
                    // the input's rounding, far below this.
                    let max_w = (0..k).fold(0f64, |m, i| m.max(wj(i).abs() as f64));
                    let l1: f64 = x.iter().map(|v| v.abs() as f64).sum();
                    let room = l1 * max_w / 100.0;
                    let (e, b) = (exact as f64, bounds[j] as f64);
                    assert!(
                        e <= b,
                        "{case}: logit {j} {exact} above its bound {}",
                        bounds[j]
                    );
                    let slack = if dt == f16::datum_type() {
                        // One f16 rounding of the bound: 2^-10 of it.
                        b.abs() / 1024.0 + 1e-7
                    } else {
                        1e-30
                    };
                    assert!(
                        b - e <= room + slack,
                        "{case}: logit {j} {exact}, bound {b}, |x|_1 max |w_j| / 100 {room}"
                    );
                }
                // Several logits at once (`Head::some_logits`: rows four at a time), in any
                // order and repeated: each logit's bits.
                let tokens: Vec<u32> = (0..n as u32).rev().step_by(3).chain(0..n as u32).collect();
                let mut some = vec![f32::NAN; tokens.len()];
                head.some_logits(x, &tokens, &mut some).unwrap();
                for (&j, v) in tokens.iter().zip(&some) {
                    let want = full[j as usize].to_bits();
                    assert_eq!(v.to_bits(), want, "{case}: some logits, {j}");
                }
                let outside = head.some_logits(x, &[0, n as u32], &mut [0.0; 2]);
                assert!(outside.is_err(), "{case}: logit {n} of {n}");
            }
            // The copy made and the bounds computed in parts (in parallel in the threads
            // build): the same bits.
            for parts in [2, 3, 4] {
                let split = self::head(&w, k, n, layout, f16_weights, dt);
                for x in &xs {
                    let (mut one, mut parted) = (vec![0f32; n], vec![0f32; n]);
                    assert!(head.bounds_in_parts(x, &mut one, 1).unwrap(), "{case}");
                    assert!(
                        split.bounds_in_parts(x, &mut parted, parts).unwrap(),
                        "{case}"
                    );
                    let bits = |v: &[f32]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&one), bits(&parted), "{case}: {parts} parts");
                }
            }
            let mut out = vec![0f32; n];
            let mut x = inputs(k).remove(0);
            x[k - 1] = f32::INFINITY;
            assert!(
                !head.bounds(&x, &mut out).unwrap(),
                "{case}: an infinite input"
            );
        }
        let mut bad = w.clone();
        bad[k + 1] = f32::NAN;
        let head = head(&bad, k, n, Layout::Nk, false, f32::datum_type());
        let mut out = vec![0f32; n];
        let x = inputs(k).remove(0);
        assert!(!head.bounds(&x, &mut out).unwrap(), "k={k}: a NaN weight");
    }
}
