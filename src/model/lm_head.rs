//! The `lm_head` of a decoder computed outside tract's plan (`tract_decoder`), so that greedy
//! decoding can read a quarter of its bytes.
//!
//! The full logits are the plan's own values (`matmul_weights::product`). For greedy decoding
//! an int8 copy of the weight, one scale per row, gives an upper bound of every logit: the
//! loop then computes exactly only the logits whose bound can win (`generate.rs`); with
//! q4 SmolLM2 1 to 10 of 49,152 a step (a median of 2). The int8 pass reads 28 MB instead of
//! the f32 head's 113 MB: about 4 ms against 11-14 ms of a q4 step in wasm.
//!
//! The bound of logit `j` for the input `x` (`L_j`, the f32 kernel's value of `x . w_j`):
//! - `x` is rounded to integers `X_i` with the scale `sx` (`|x_i - sx X_i| <= dx`), row `j` of
//!   the weight to `Q_ji` with the scale `s_j` (`|w_ji - s_j Q_ji| <= e_j`);
//! - `x . w_j = sx s_j (X . Q_j) + s_j (Q_j . (x - sx X)) + x . (w_j - s_j Q_j)`, so
//!   `x . w_j <= sx s_j I_j + dx s_j |Q_j|_1 + e_j |x|_1` with the exact integer `I_j = X . Q_j`;
//! - the f32 kernel's sums are within `2 k 2^-24 |x|_1 max|w_j|` of `x . w_j` (`k` terms);
//! - so `L_j <= sx s_j I_j + dx p_j + |x|_1 r_j`, with per row `p_j = s_j |Q_j|_1` and
//!   `r_j = e_j + 2 k 2^-24 max|w_j|` rounded up, and a margin for the f32 arithmetic of the
//!   bound itself (`bound`).

use std::sync::{Arc, OnceLock};

use tract_onnx::prelude::*;

use crate::decoder::Head;
use crate::error::{backend, Error, Result};
use crate::model::ops::linalg::side_by_side;
use crate::model::ops::matmul_weights::{one_output, product, Layout, Weights};
use crate::model::ops::{parallel, streams};

/// A `MatMulWeights` at the end of a decoder, with its weight.
#[derive(Debug)]
pub struct LmHead {
    op: Weights,
    weight: Arc<Tensor>,
    /// The type of the op's input and output (the plan's logits type): f32, or f16.
    dt: DatumType,
    /// The int8 copy, made at the first greedy step (`None`: the weight is not finite).
    int8: OnceLock<Option<Int8Rows>>,
}

impl LmHead {
    /// `None` for a layout whose one-row sums cannot be computed one logit at a time.
    pub fn new(op: Weights, weight: Arc<Tensor>, dt: DatumType) -> Option<LmHead> {
        let float = dt == f32::datum_type() || dt == f16::datum_type();
        (op.layout != Layout::Kn && float).then_some(LmHead {
            op,
            weight,
            dt,
            int8: OnceLock::new(),
        })
    }

    pub fn is_for(&self, op: &Weights, weight: &Arc<Tensor>) -> bool {
        self.op == *op && Arc::ptr_eq(&self.weight, weight)
    }

    pub fn hidden_width(&self) -> usize {
        self.op.k
    }

    pub fn vocab(&self) -> usize {
        self.op.n
    }

    /// The logits of `rows` rows of `hidden` into `out` (`rows x vocab`): the plan's values.
    pub fn full(&self, hidden: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        product(&self.op, hidden, rows, &self.weight, out).map_err(backend)?;
        self.round_to_type(out);
        Ok(())
    }

    /// Upper bounds of one row's logits into `out`; false (and `out` unspecified) when there
    /// are none (a value of `hidden` or of the weight is not finite, or a bound overflows).
    /// With the `threads` feature the rows are split across the threads.
    pub fn bounds(&self, hidden: &[f32], out: &mut [f32]) -> Result<bool> {
        let parts = parallel::parts_for(self.op.k * self.op.n);
        self.bounds_in_parts(hidden, out, parts, streams::head_count())
    }

    /// [`LmHead::bounds`] with the int8 copy (when this call makes it) and the bounds computed
    /// in `parts` ranges of rows (`parallel`), each range's panels read four side by side
    /// (`streams` 4) or one at a time (1): the same values for any `parts` and `streams`.
    pub fn bounds_in_parts(
        &self,
        hidden: &[f32],
        out: &mut [f32],
        parts: usize,
        streams: usize,
    ) -> Result<bool> {
        let (k, n) = (self.op.k, self.op.n);
        if hidden.len() != k || out.len() != n {
            return Err(Error::Backend(format!(
                "lm_head bounds of {} values into {} (K={k}, N={n})",
                hidden.len(),
                out.len(),
            )));
        }
        let Some(rows) = self
            .int8
            .get_or_init(|| Int8Rows::of(&self.op, &self.weight, parts))
        else {
            return Ok(false);
        };
        let Some(x) = QuantizedInput::of(hidden) else {
            return Ok(false);
        };
        let bound_of = |j: usize, i: i32| {
            bound(
                x.scale * rows.scale[j],
                i,
                x.rounding * rows.p[j] + x.l1 * rows.r[j],
            )
        };
        // Ranges of a multiple of four rows, so that each four lie in one block of the copy.
        // With panels, four panels a quarter of the range apart at once (`dot_i8x4_streams`),
        // or one at a time where that is faster on this machine (`streams`).
        let four_at_once = panels(k) && streams > 1;
        parallel::by_columns(out, 1, n, 4, parts, |cols, piece| {
            let rows_of = |c: usize| {
                let first = cols.start + 4 * c;
                rows.rows(first, 4.min(cols.end - first), k)
            };
            let len = piece.len();
            let mut put = |c: usize, sums: [i32; 4]| {
                let end = (4 * c + 4).min(len);
                for (r, (o, i)) in piece[4 * c..end].iter_mut().zip(sums).enumerate() {
                    *o = bound_of(cols.start + 4 * c + r, i);
                }
            };
            // Whole panels four at a time; then the rest, a last partial four included.
            let (groups, rest) = side_by_side::<4>(if four_at_once { len / 4 } else { 0 });
            for four in groups {
                let sums = dot_i8x4_streams(&x.values, four.map(rows_of));
                for (c, sums) in four.into_iter().zip(sums) {
                    put(c, sums);
                }
            }
            for c in rest.start..len.div_ceil(4) {
                let panel = panels(k) && 4 * c + 4 <= len;
                put(c, dot_i8x4(&x.values, rows_of(c), panel));
            }
        });
        self.round_to_type(out);
        Ok(out.iter().all(|b| b.is_finite()))
    }

    /// The plan's logits are of the op's type: f16 rounds them (a monotone rounding, so a
    /// bound stays a bound).
    fn round_to_type(&self, out: &mut [f32]) {
        if self.dt == f16::datum_type() {
            out.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32());
        }
    }
}

impl Head for LmHead {
    fn logit(&self, hidden: &[f32], j: usize) -> Result<f32> {
        let mut v = [one_output(&self.op, hidden, &self.weight, j).map_err(backend)?];
        self.round_to_type(&mut v);
        Ok(v[0])
    }

    fn logits(&self, hidden: &[f32], out: &mut [f32]) -> Result<()> {
        self.full(hidden, 1, out)
    }
}

/// Rows whose largest magnitude is below this are rounded to zeros (`Int8Rows::of`).
const TINY: f32 = 1e-30;

/// `2^-24`: the unit roundoff of f32.
const U: f64 = 1.0 / 16_777_216.0;

/// An upper bound of `scale * i + slack` (real arithmetic) computed in f32: each f32 operation
/// is within `2^-24` of its value, so a margin of `2^-18 (|scale i| + slack)` (and the least
/// normal f32, for underflow) covers the few operations here many times over.
#[inline(always)]
fn bound(scale: f32, i: i32, slack: f32) -> f32 {
    let a = scale * i as f32;
    a + slack + (a.abs() + slack) * (1.0 / 262_144.0) + f32::MIN_POSITIVE
}

/// The weight rounded to int8, one scale per row, with each row's terms of the bound.
#[derive(Debug)]
struct Int8Rows {
    /// `[n, k]` (whatever the weight's layout), in blocks of `BLOCK_ROWS` rows: pieces that
    /// fit in the holes the load leaves in the heap, where one allocation of the whole would
    /// grow the memory by all of it. Row-major, or (`panels(k)`) each four rows `4p..4p + 4`
    /// (the last `n % 4` rows stay rows) interleaved sixteen values at a time:
    /// `[n / 4, k / 16, 4, 16]`, so that `dot_i8x4` reads one stream, not four.
    q: Vec<Vec<i8>>,
    /// `s_j`: `max |w_j| / 127`.
    scale: Vec<f32>,
    /// `p_j >= s_j |Q_j|_1`.
    p: Vec<f32>,
    /// `r_j >= e_j + 2 k 2^-24 max |w_j|`.
    r: Vec<f32>,
}

/// Rows of a block of `Int8Rows::q` (a multiple of four, so that `dot_i8x4`'s rows lie in one).
const BLOCK_ROWS: usize = 512;

/// Whether rows of `k` values go in panels (`Int8Rows::q`).
fn panels(k: usize) -> bool {
    k.is_multiple_of(16)
}

impl Int8Rows {
    /// Rows `first..first + count` (within one block).
    fn rows(&self, first: usize, count: usize, k: usize) -> &[i8] {
        let at = first % BLOCK_ROWS * k;
        &self.q[first / BLOCK_ROWS][at..at + count * k]
    }

    /// The copy of `weight`, its blocks made in `parts` ranges (`parallel`).
    fn of(op: &Weights, weight: &Tensor, parts: usize) -> Option<Int8Rows> {
        let blocks = op.n.div_ceil(BLOCK_ROWS);
        let made: Option<Vec<Vec<Int8Rows>>> = parallel::map_ranges(blocks, parts, 1, |range| {
            range.map(|b| Int8Rows::block(op, weight, b)).collect()
        })
        .into_iter()
        .collect();
        let mut rows = Int8Rows {
            q: Vec::with_capacity(blocks),
            scale: Vec::with_capacity(op.n),
            p: Vec::with_capacity(op.n),
            r: Vec::with_capacity(op.n),
        };
        for block in made?.into_iter().flatten() {
            rows.q.extend(block.q);
            rows.scale.extend(block.scale);
            rows.p.extend(block.p);
            rows.r.extend(block.r);
        }
        Some(rows)
    }

    /// Block `b` of the copy (rows `b * BLOCK_ROWS..`, at most `BLOCK_ROWS` of them), as one
    /// `Int8Rows` of one block; `None` when a weight is not finite.
    fn block(op: &Weights, weight: &Tensor, b: usize) -> Option<Int8Rows> {
        let (k, n) = (op.k, op.n);
        let first = b * BLOCK_ROWS;
        let count = (n - first).min(BLOCK_ROWS);
        let mut q = vec![0i8; count * k];
        let (mut scale, mut p, mut r) = (vec![0f32; count], vec![0f32; count], vec![0f32; count]);
        let mut row = vec![0f32; k];
        let mut values = vec![0i8; k];
        let gamma = 2.0 * k as f64 * U;
        let in_panels = if panels(k) { count / 4 * 4 } else { 0 };
        for at in 0..count {
            let w = weight_row(op, weight, first + at, &mut row)?;
            let max = max_abs(w)?;
            // `w / s` rounded to the nearest integer, within `2^-22` of it in f32: each
            // weight is within `s (1/2 + 2^-15)` of `s Q` (`e_j`). A row too small for that
            // relative error (subnormal scales) becomes zeros, within `max` of the weights.
            let (s, err, l1) = if max >= TINY {
                let s = max / 127.0;
                let l1 = quantize_row(w, 1.0 / s, &mut values);
                (s, s as f64 * (0.5 + 1.0 / 32768.0), l1)
            } else {
                values.fill(0);
                (0.0, max as f64, 0)
            };
            if at < in_panels {
                let panel = &mut q[at / 4 * 4 * k..(at / 4 + 1) * 4 * k];
                for (c, v) in values.chunks_exact(16).enumerate() {
                    let to = 64 * c + 16 * (at % 4);
                    panel[to..to + 16].copy_from_slice(v);
                }
            } else {
                q[at * k..(at + 1) * k].copy_from_slice(&values);
            }
            scale[at] = s;
            p[at] = up(s as f64 * l1 as f64);
            r[at] = up(err + gamma * max as f64);
        }
        Some(Int8Rows {
            q: vec![q],
            scale,
            p,
            r,
        })
    }
}

/// Row `j` of the weight as f32: in place for f32 rows, else through `row`.
fn weight_row<'a>(
    op: &Weights,
    weight: &'a Tensor,
    j: usize,
    row: &'a mut [f32],
) -> Option<&'a [f32]> {
    let k = op.k;
    let plain = weight.try_as_plain_ram().ok()?;
    if weight.datum_type() == f16::datum_type() {
        let w = &plain.as_slice::<f16>().ok()?[j * k..(j + 1) * k];
        row.iter_mut().zip(w).for_each(|(v, h)| *v = h.to_f32());
        return Some(row);
    }
    let w = plain.as_slice::<f32>().ok()?;
    if op.layout == Layout::Panels {
        let at = |i| crate::model::ops::linalg::panel_index(j, i, op.n, k);
        row.iter_mut().enumerate().for_each(|(i, v)| *v = w[at(i)]);
        return Some(row);
    }
    Some(&w[j * k..(j + 1) * k])
}

/// The f32 at or above `v` (`v >= 0`).
fn up(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) < v {
        f32::from_bits(f.to_bits() + 1)
    } else {
        f
    }
}

/// One row of the `lm_head`'s input rounded to 16-bit integers.
struct QuantizedInput {
    values: Vec<i16>,
    /// `sx`.
    scale: f32,
    /// `dx >= max |x_i - sx X_i|`.
    rounding: f32,
    /// `>= |x|_1`.
    l1: f32,
}

impl QuantizedInput {
    fn of(x: &[f32]) -> Option<QuantizedInput> {
        if !x.iter().all(|v| v.is_finite()) {
            return None;
        }
        // The integer sums stay within i32: `k * 127 * limit < 2^31`.
        let limit = (i32::MAX as usize / (127 * x.len().max(1))).min(i16::MAX as usize) as f32;
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if max > 0.0 { max / limit } else { 1.0 };
        let (mut rounding, mut l1) = (0f64, 0f64);
        let values = x
            .iter()
            .map(|&v| {
                let q = (v / scale).round_ties_even().clamp(-limit, limit);
                // Exact in f64: an f32 times an integer of 16 bits, and their difference.
                rounding = rounding.max((v as f64 - scale as f64 * q as f64).abs());
                l1 += (v as f64).abs();
                q as i16
            })
            .collect();
        // `l1`'s f64 sum is within `k 2^-53` of its value.
        Some(QuantizedInput {
            values,
            scale,
            rounding: up(rounding),
            l1: up(l1 * (1.0 + 1e-12)),
        })
    }
}

/// The largest magnitude of `w`; `None` when a value is not finite.
fn max_abs(w: &[f32]) -> Option<f32> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::max_abs(w)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        // Comparisons, not `f32::max` (a call in wasm, for its NaN rules).
        let max = w
            .iter()
            .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
        w.iter().all(|v| v.is_finite()).then_some(max)
    }
}

/// `w * inv` rounded to the nearest integer (ties to even) within +-127 into `q`; returns the
/// sum of their magnitudes.
fn quantize_row(w: &[f32], inv: f32, q: &mut [i8]) -> u32 {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::quantize_row(w, inv, q)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        quantize_values(w, inv, q)
    }
}

/// The portable [`quantize_row`] (and the simd128 one's tail).
fn quantize_values(w: &[f32], inv: f32, q: &mut [i8]) -> u32 {
    let mut l1 = 0;
    for (q, &v) in q.iter_mut().zip(w) {
        // `round_ties_even` is one instruction in wasm (`f32.nearest`), `round` a call.
        let i = ((v * inv).round_ties_even() as i32).clamp(-127, 127);
        *q = i as i8;
        l1 += i.unsigned_abs();
    }
    l1
}

/// `sum_i x_i q_ri` for the rows `r` of `q` (`q.len() / x.len()` of them, at most four; the
/// others 0), exact (the caller keeps them within i32). With `panel`, `q` is four rows in
/// the panel layout (`Int8Rows::q`; `x.len()` a multiple of 16).
fn dot_i8x4(x: &[i16], q: &[i8], panel: bool) -> [i32; 4] {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::dot_i8x4(x, q, panel)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        let len = x.len().max(1);
        let at = |r: usize, i: usize| {
            if panel {
                i / 16 * 64 + 16 * r + i % 16
            } else {
                r * len + i
            }
        };
        let mut out = [0i32; 4];
        for (r, o) in out.iter_mut().enumerate().take(q.len() / len) {
            *o = x
                .iter()
                .enumerate()
                .map(|(i, &a)| a as i32 * q[at(r, i)] as i32)
                .sum();
        }
        out
    }
}

/// [`dot_i8x4`] of four panels (`x.len()` a multiple of 16) read side by side: four
/// sequential reads keep more of memory's lines in flight than one. q4 SmolLM2 in Node: 14.9-16.4
/// ms a token against 15.9-17.7 with one panel at a time (each run of panels read into the
/// cache first).
fn dot_i8x4_streams(x: &[i16], panels: [&[i8]; 4]) -> [[i32; 4]; 4] {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::dot_panels(x, panels)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        panels.map(|q| dot_i8x4(x, q, true))
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use core::arch::wasm32::*;

    /// `dot_i8x4_streams` with simd128: sixteen values of `x` loaded once for the sixteen rows
    /// of the four panels, each row's sum in one i32x4.
    pub fn dot_panels(x: &[i16], panels: [&[i8]; 4]) -> [[i32; 4]; 4] {
        let len = x.len();
        assert!(
            len.is_multiple_of(16) && panels.iter().all(|q| q.len() >= 4 * len),
            "dot_panels: panels of four rows of {len}"
        );
        let xp = x.as_ptr();
        let qp = panels.map(|q| q.as_ptr());
        let mut acc = [[i32x4_splat(0); 4]; 4];
        for c in 0..len / 16 {
            // SAFETY: x[16c..16c+16] and each panel's values 64c..64c+64 lie within the
            // lengths asserted above; v128_load accepts unaligned addresses.
            unsafe {
                let x0 = v128_load(xp.add(16 * c) as *const v128);
                let x1 = v128_load(xp.add(16 * c + 8) as *const v128);
                for (acc, qp) in acc.iter_mut().zip(&qp) {
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let w = v128_load(qp.add(16 * (4 * c + r)) as *const v128);
                        let lo = i32x4_dot_i16x8(x0, i16x8_extend_low_i8x16(w));
                        let hi = i32x4_dot_i16x8(x1, i16x8_extend_high_i8x16(w));
                        *acc = i32x4_add(*acc, i32x4_add(lo, hi));
                    }
                }
            }
        }
        acc.map(|acc| {
            acc.map(|a| {
                i32x4_extract_lane::<0>(a)
                    + i32x4_extract_lane::<1>(a)
                    + i32x4_extract_lane::<2>(a)
                    + i32x4_extract_lane::<3>(a)
            })
        })
    }

    /// The portable `max_abs` with simd128 (`f32x4.max` gives NaN for a NaN, so one test at
    /// the end finds a value that is not finite).
    pub fn max_abs(w: &[f32]) -> Option<f32> {
        let chunks = w.len() / 4;
        let mut max = f32x4_splat(0.0);
        for c in 0..chunks {
            // SAFETY: values 4c..4c + 4 of `w`; v128_load accepts unaligned addresses.
            let v = unsafe { v128_load(w.as_ptr().add(4 * c) as *const v128) };
            max = f32x4_max(max, f32x4_abs(v));
        }
        let lanes = [
            f32x4_extract_lane::<0>(max),
            f32x4_extract_lane::<1>(max),
            f32x4_extract_lane::<2>(max),
            f32x4_extract_lane::<3>(max),
        ];
        let tail = w[chunks * 4..].iter().map(|v| v.abs());
        lanes.into_iter().chain(tail).try_fold(0f32, |m, v| {
            v.is_finite().then_some(if v > m { v } else { m })
        })
    }

    /// The portable `quantize_row` with simd128, the same integers: sixteen values at a time
    /// rounded (`f32x4.nearest`), converted, narrowed to bytes with saturation and clamped at
    /// -127; their magnitudes summed by pairwise widening additions.
    pub fn quantize_row(w: &[f32], inv: f32, q: &mut [i8]) -> u32 {
        let len = w.len().min(q.len());
        let chunks = len / 16;
        let (scale, low) = (f32x4_splat(inv), i8x16_splat(-127));
        let mut sums = i32x4_splat(0);
        for c in 0..chunks {
            // SAFETY: values 16c..16c + 16 of `w` and of `q`, within `len`; v128_load and
            // v128_store accept unaligned addresses.
            unsafe {
                let p = w.as_ptr().add(16 * c) as *const v128;
                let i: [v128; 4] = core::array::from_fn(|a| {
                    i32x4_trunc_sat_f32x4(f32x4_nearest(f32x4_mul(v128_load(p.add(a)), scale)))
                });
                let bytes = i8x16_narrow_i16x8(
                    i16x8_narrow_i32x4(i[0], i[1]),
                    i16x8_narrow_i32x4(i[2], i[3]),
                );
                let bytes = i8x16_max(bytes, low);
                v128_store(q.as_mut_ptr().add(16 * c) as *mut v128, bytes);
                let pairs = u16x8_extadd_pairwise_u8x16(i8x16_abs(bytes));
                sums = i32x4_add(sums, u32x4_extadd_pairwise_u16x8(pairs));
            }
        }
        let l1 = (i32x4_extract_lane::<0>(sums)
            + i32x4_extract_lane::<1>(sums)
            + i32x4_extract_lane::<2>(sums)
            + i32x4_extract_lane::<3>(sums)) as u32;
        l1 + super::quantize_values(&w[chunks * 16..len], inv, &mut q[chunks * 16..len])
    }

    /// `dot_i8x4` with simd128: sixteen values of `x` loaded once for the rows, each row's
    /// sixteen weights widened to two i16x8 and multiplied pairwise into i32 lanes
    /// (`i32x4.dot_i16x8_s`); two sums a row, eight independent ones for four rows.
    pub fn dot_i8x4(x: &[i16], q: &[i8], panel: bool) -> [i32; 4] {
        let len = x.len();
        let rows = q.len().checked_div(len).unwrap_or(0).min(4);
        if rows < 4 {
            let mut out = [0i32; 4];
            for (r, o) in out.iter_mut().enumerate().take(rows) {
                *o = dot_rows::<1, false>(x, &q[r * len..(r + 1) * len])[0];
            }
            return out;
        }
        if panel {
            dot_rows::<4, true>(x, q)
        } else {
            dot_rows::<4, false>(x, q)
        }
    }

    /// Sixteen values of row `r` from value `16c` lie at `16c * R + 16r` in a panel of `R`
    /// rows, at `r len + 16c` in rows (with the tail of each row, `len % 16` values, only
    /// there).
    #[inline(always)]
    fn dot_rows<const R: usize, const PANEL: bool>(x: &[i16], q: &[i8]) -> [i32; 4] {
        let len = x.len();
        assert!(
            q.len() >= R * len,
            "dot_i8x4: {} weights for {R} rows of {len}",
            q.len()
        );
        let chunks = len / 16;
        let (xp, qp) = (x.as_ptr(), q.as_ptr());
        let mut acc = [[i32x4_splat(0); 2]; R];
        for c in 0..chunks {
            // SAFETY: x[16c..16c+16] and each row's q[16c..16c+16] lie within the lengths
            // asserted above; v128_load accepts unaligned addresses.
            unsafe {
                let x0 = v128_load(xp.add(16 * c) as *const v128);
                let x1 = v128_load(xp.add(16 * c + 8) as *const v128);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let at = if PANEL {
                        16 * (c * R + r)
                    } else {
                        r * len + 16 * c
                    };
                    let w = v128_load(qp.add(at) as *const v128);
                    acc[0] = i32x4_add(acc[0], i32x4_dot_i16x8(x0, i16x8_extend_low_i8x16(w)));
                    acc[1] = i32x4_add(acc[1], i32x4_dot_i16x8(x1, i16x8_extend_high_i8x16(w)));
                }
            }
        }
        let mut out = [0i32; 4];
        for (r, (o, acc)) in out.iter_mut().zip(&acc).enumerate() {
            let a = i32x4_add(acc[0], acc[1]);
            *o = i32x4_extract_lane::<0>(a)
                + i32x4_extract_lane::<1>(a)
                + i32x4_extract_lane::<2>(a)
                + i32x4_extract_lane::<3>(a);
            for i in chunks * 16..len {
                *o += x[i] as i32 * q[r * len + i] as i32;
            }
        }
        out
    }
}
