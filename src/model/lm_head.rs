//! The `lm_head` of a decoder computed outside tract's plan (`tract_decoder`; the decoders of
//! encoder-decoder models too, `seq2seq`), so that greedy decoding, and sampling with `top_k`,
//! can read a quarter of its bytes.
//!
//! The full logits are the plan's own values (`matmul_weights::product`). For greedy decoding
//! an int8 copy of the weight, one scale per row, gives an upper bound of every logit: the
//! loop then computes exactly only the logits whose bound can win (`generate.rs`); with
//! q4 SmolLM2 1 to 10 of 49,152 a step (a median of 2). Sampling with `top_k` computes those
//! that can pass it (with q4 SmolLM2 and k = 50, 200 a step, 800 now and then). The int8 pass reads
//! 28 MB instead of the f32 head's 113 MB, with `matmul_integer`'s decoding kernels (the copy is
//! laid out as their weight): in wasm (Node 20, a 2-core AMD EPYC) 1.0-1.2 ms for SmolLM2's head
//! read over and over, where the pass's own kernel took 1.4 at best (`bench/HISTORY.md`).
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
use crate::model::ops::matmul_integer::{self, block_byte, fits_blocks, flipped, matvec, Bytes};
use crate::model::ops::matmul_weights::{one_output, product, some_outputs, Layout, Weights};
use crate::model::ops::parallel;

/// A `MatMulWeights` at the end of a decoder, with its weight.
#[derive(Debug)]
pub struct LmHead {
    op: Weights,
    weight: Arc<Tensor>,
    /// The type of the op's input and output (the plan's logits type): f32, or f16.
    dt: DatumType,
    /// The int8 copy, made at the first step with bounds (`None`: the weight is not finite).
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
        self.bounds_in_parts(hidden, out, parts)
    }

    /// [`LmHead::bounds`] with the int8 copy (when this call makes it) and the bounds computed
    /// in `parts` ranges of whole pieces of the copy (`parallel`): the same values for any
    /// `parts`.
    pub fn bounds_in_parts(&self, hidden: &[f32], out: &mut [f32], parts: usize) -> Result<bool> {
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
        parallel::by_columns(out, 1, n, PIECE_ROWS, parts, |cols, out| {
            let mut sums = [0i32; PIECE_ROWS];
            for (first, out) in cols.step_by(PIECE_ROWS).zip(out.chunks_mut(PIECE_ROWS)) {
                let sums = &mut sums[..out.len()];
                rows.sums(first / PIECE_ROWS, &x.values, k, sums);
                // Slices of the rows' terms, so that LLVM vectorizes the loop.
                let at = first..first + out.len();
                let (scale, p, r) = (&rows.scale[at.clone()], &rows.p[at.clone()], &rows.r[at]);
                let each = out.iter_mut().zip(sums.iter()).zip(scale).zip(p).zip(r);
                for ((((o, &i), &s), &p), &r) in each {
                    *o = bound(x.scale * s, i, x.rounding * p + x.l1 * r);
                }
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

    fn some_logits(&self, hidden: &[f32], tokens: &[u32], out: &mut [f32]) -> Result<()> {
        some_outputs(&self.op, hidden, &self.weight, tokens, out).map_err(backend)?;
        self.round_to_type(out);
        Ok(())
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
    /// The `n` rows (whatever the weight's layout) in pieces of `PIECE_ROWS` rows, pieces that
    /// fit in the holes the load leaves in the heap, where one allocation of the whole would
    /// grow the memory by all of it. A piece of `count` rows is the int8 weight `[k, count]`
    /// of `matmul_integer` (the rows its columns), so that its decoding kernels compute the
    /// sums: its first [`blocked`] columns in blocks (`Layout::Blocks`, read at the memory's
    /// speed), then the others as they lie (`Layout::Rows`, `[k, count - blocked]`).
    q: Vec<Vec<i8>>,
    /// `s_j`: `max |w_j| / 127`.
    scale: Vec<f32>,
    /// `p_j >= s_j |Q_j|_1`.
    p: Vec<f32>,
    /// `r_j >= e_j + 2 k 2^-24 max |w_j|`.
    r: Vec<f32>,
}

/// Rows of a piece of `Int8Rows::q`; the bound pass splits the rows between threads in whole
/// pieces.
const PIECE_ROWS: usize = 512;

/// The rows of a piece of `count` rows of `k` values that go in blocks: all but the last
/// `count % 16`, when `k` is a multiple of 4 (`matmul_integer::fits_blocks`).
fn blocked(k: usize, count: usize) -> usize {
    if fits_blocks(k, 16) {
        count / 16 * 16
    } else {
        0
    }
}

impl Int8Rows {
    /// `sum_i x_i Q_ji` for the rows `j` of piece `piece` into `out` (one per row), exact
    /// (`QuantizedInput` keeps them within i32).
    fn sums(&self, piece: usize, x: &[i16], k: usize, out: &mut [i32]) {
        use matmul_integer::Layout::{Blocks, Rows};
        let count = out.len();
        let blocked = blocked(k, count);
        let (in_blocks, as_rows) = self.q[piece].split_at(blocked * k);
        let (out_blocks, out_rows) = out.split_at_mut(blocked);
        if blocked > 0 {
            matvec(x, Bytes::I8(in_blocks), k, blocked, Blocks, out_blocks);
        }
        if count > blocked {
            matvec(x, Bytes::I8(as_rows), k, count - blocked, Rows, out_rows);
        }
    }

    /// The copy of `weight`, its pieces made in `parts` ranges (`parallel`).
    fn of(op: &Weights, weight: &Tensor, parts: usize) -> Option<Int8Rows> {
        let pieces = op.n.div_ceil(PIECE_ROWS);
        let made: Option<Vec<Vec<Int8Rows>>> = parallel::map_ranges(pieces, parts, 1, |range| {
            range.map(|b| Int8Rows::piece(op, weight, b)).collect()
        })
        .into_iter()
        .collect();
        let mut rows = Int8Rows {
            q: Vec::with_capacity(pieces),
            scale: Vec::with_capacity(op.n),
            p: Vec::with_capacity(op.n),
            r: Vec::with_capacity(op.n),
        };
        for piece in made?.into_iter().flatten() {
            rows.q.extend(piece.q);
            rows.scale.extend(piece.scale);
            rows.p.extend(piece.p);
            rows.r.extend(piece.r);
        }
        Some(rows)
    }

    /// Piece `b` of the copy (rows `b * PIECE_ROWS..`, at most `PIECE_ROWS` of them), as one
    /// `Int8Rows` of one piece; `None` when a weight is not finite.
    fn piece(op: &Weights, weight: &Tensor, b: usize) -> Option<Int8Rows> {
        let (k, n) = (op.k, op.n);
        let first = b * PIECE_ROWS;
        let count = (n - first).min(PIECE_ROWS);
        let blocked = blocked(k, count);
        let mut q = vec![0i8; count * k];
        let (mut scale, mut p, mut r) = (vec![0f32; count], vec![0f32; count], vec![0f32; count]);
        let mut row = vec![0f32; k];
        // Four rows' values, placed in their block once the fourth is rounded.
        let mut four = vec![0i8; 4 * k];
        let gamma = 2.0 * k as f64 * U;
        for at in 0..count {
            let w = weight_row(op, weight, first + at, &mut row)?;
            let max = max_abs(w)?;
            let values = &mut four[at % 4 * k..(at % 4 + 1) * k];
            // `w / s` rounded to the nearest integer, within `2^-22` of it in f32: each
            // weight is within `s (1/2 + 2^-15)` of `s Q` (`e_j`). A row too small for that
            // relative error (subnormal scales) becomes zeros, within `max` of the weights.
            let (s, err, l1) = if max >= TINY {
                let s = max / 127.0;
                let l1 = quantize_row(w, 1.0 / s, values);
                (s, s as f64 * (0.5 + 1.0 / 32768.0), l1)
            } else {
                values.fill(0);
                (0.0, max as f64, 0)
            };
            if at < blocked {
                if at % 4 == 3 {
                    to_block(&four, k, &mut q[(at - 3) * k..(at + 1) * k]);
                }
            } else {
                // Column `at - blocked` of the `[k, count - blocked]` rest.
                let rest = &mut q[blocked * k..];
                for (i, &v) in values.iter().enumerate() {
                    rest[i * (count - blocked) + at - blocked] = v;
                }
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

/// Four rows of `k` int8 values (`four`, one after the other) into `block` as the four
/// columns of one block of `matmul_integer`'s `Layout::Blocks` (`k` a multiple of 4).
fn to_block(four: &[i8], k: usize, block: &mut [i8]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    let from = kernels::to_block(four, k, block);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    let from = 0;
    to_block_from(four, k, from, block);
}

/// [`to_block`]'s quads from `from` on (the portable kernel, and the simd128 one's tail).
fn to_block_from(four: &[i8], k: usize, from: usize, block: &mut [i8]) {
    for q in from..k / 4 {
        for c in 0..4 {
            for i in 0..4 {
                let v = four[c * k + 4 * q + i] as u8 ^ flipped(c, true);
                block[16 * q + block_byte(c, i)] = v as i8;
            }
        }
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
        // The integer sums stay within i32: `k * 127 * limit < 2^31` (`matmul_integer`'s
        // kernels add in wrapping arithmetic, so their partial sums may wrap, not the last).
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

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use core::arch::wasm32::*;

    /// `to_block` with simd128, sixteen values of each row at a time (four quads): the
    /// bytes of rows 0 and 1, and of rows 2 and 3, interleaved, each quad's halves taken from
    /// both, the even columns' top bits flipped. Returns the quads done.
    pub fn to_block(four: &[i8], k: usize, block: &mut [i8]) -> usize {
        assert!(four.len() >= 4 * k && block.len() >= 4 * k);
        let flip = u16x8_splat(super::flipped(0, true) as u16);
        for t in 0..k / 16 {
            // SAFETY: values 16t..16t + 16 of each row lie within 4k values of `four`, and
            // the quads 4t..4t + 4 (bytes 64t..64t + 64) within 4k bytes of `block`;
            // v128_load and v128_store accept unaligned addresses.
            unsafe {
                let [r0, r1, r2, r3] = [0, 1, 2, 3]
                    .map(|c| v128_load(four.as_ptr().add(c * k + 16 * t) as *const v128));
                let p01 = i8x16_shuffle::<0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23>;
                let p89 =
                    i8x16_shuffle::<8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31>;
                let (lo01, hi01, lo23, hi23) = (p01(r0, r1), p89(r0, r1), p01(r2, r3), p89(r2, r3));
                let first = i8x16_shuffle::<0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23>;
                let second =
                    i8x16_shuffle::<8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31>;
                let quads = [
                    first(lo01, lo23),
                    second(lo01, lo23),
                    first(hi01, hi23),
                    second(hi01, hi23),
                ];
                let out = block.as_mut_ptr().add(64 * t) as *mut v128;
                for (i, quad) in quads.into_iter().enumerate() {
                    v128_store(out.add(i), v128_xor(quad, flip));
                }
            }
        }
        k / 16 * 4
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
}
