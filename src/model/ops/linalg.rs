//! Small f32 kernels shared by the matmul ops, written so that LLVM vectorizes them (SSE/AVX
//! natively, simd128 in wasm): independent accumulators, fixed-width inner loops.

use super::streams;

/// A dot product (eight independent sums).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = len / 8;
    for (xs, ys) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += xs[i] * ys[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..len {
        sum += a[i] * b[i];
    }
    sum
}

/// [`dot`] of `x` with each of four rows that lie anywhere: the same sums, the four rows read
/// side by side (a sampling step's few hundred logits, rows far apart in the `lm_head`).
pub fn dot_rows4(x: &[f32], rows: [&[f32]; 4]) -> [f32; 4] {
    let len = rows.iter().fold(x.len(), |len, r| len.min(r.len()));
    let (x, rows) = (&x[..len], rows.map(|r| &r[..len]));
    let mut acc = [[0f32; 8]; 4];
    for (c, xs) in x.chunks_exact(8).enumerate() {
        for (acc, row) in acc.iter_mut().zip(rows) {
            let ys = &row[c * 8..c * 8 + 8];
            for i in 0..8 {
                acc[i] += xs[i] * ys[i];
            }
        }
    }
    std::array::from_fn(|r| {
        let mut sum: f32 = acc[r].iter().sum();
        for i in len / 8 * 8..len {
            sum += x[i] * rows[r][i];
        }
        sum
    })
}

/// Four dot products of `x` with the four consecutive `x.len()`-long rows of `w` (one pass
/// over `x`): [`dot4x2`] for one row, with the same sums.
pub fn dot4(x: &[f32], w: &[f32]) -> [f32; 4] {
    dot4_rows::<1, false>([x], w)[0]
}

/// [`dot4`] of `x` with each four consecutive rows of `w` (`out.len()` rows, a multiple of
/// four), into `out`: the same sums, the kernel inlined in one loop (a decoding step's keys).
pub fn dot4_each(x: &[f32], w: &[f32], out: &mut [f32]) {
    let k = x.len();
    for (o, rows) in out.chunks_exact_mut(4).zip(w.chunks_exact(4 * k.max(1))) {
        o.copy_from_slice(&dot4_rows::<1, false>([x], rows)[0]);
    }
}

/// [`dot4`] for two rows `x0` and `x1` at once: each weight loaded once for both (`MatMulNBits`
/// takes a prompt's rows in pairs; with the four-lane sums, q4 SmolLM2 reached its first token
/// in wasm 30% sooner).
pub fn dot4x2(x0: &[f32], x1: &[f32], w: &[f32]) -> [[f32; 4]; 2] {
    dot4_rows::<2, false>([x0, x1], w)
}

/// Rows of an `[n, k]` matrix per panel of the panel layout.
pub const PANEL: usize = 4;

/// Where value `(j, i)` of an `[n, k]` matrix (`k` a multiple of four) lies in the panel
/// layout: the rows four by four, each panel's four rows interleaved four values at a time
/// (`[n / 4, k / 4, 4, 4]`), the last `n % 4` rows as they are. A panel is then one stream
/// for the dot products of its four rows: four separate row streams read the weights at half
/// the speed in wasm (measured in Node and Chromium).
pub fn panel_index(j: usize, i: usize, n: usize, k: usize) -> usize {
    if j < n / PANEL * PANEL {
        (j / PANEL) * PANEL * k + (i / 4) * 16 + (j % PANEL) * 4 + i % 4
    } else {
        j * k + i
    }
}

/// `src`, a `[k, n]` matrix, as `[n, k]` into `dst`, in tiles of 16 x 16 values so that
/// reads and writes both stay within a few cache lines.
pub fn transpose_nk<T: Copy>(src: &[T], k: usize, n: usize, dst: &mut [T]) {
    const TILE: usize = 16;
    for i0 in (0..k).step_by(TILE) {
        for j0 in (0..n).step_by(TILE) {
            for j in j0..(j0 + TILE).min(n) {
                for i in i0..(i0 + TILE).min(k) {
                    dst[j * k + i] = src[i * n + j];
                }
            }
        }
    }
}

/// `src`, a `[k, n]` matrix (`k` a multiple of four), as `[n, k]` in panels ([`panel_index`])
/// into `dst`. A panel's four values of four rows are sixteen contiguous values, so `dst` is
/// written in order, a block at a time, each block read from four rows of `src` (the index of
/// every value computed apart took 1.3 s of fp32 SmolLM2's load in Node).
pub fn transpose_panels<T: Copy>(src: &[T], k: usize, n: usize, dst: &mut [T]) {
    const { assert!(PANEL == 4) };
    debug_assert!(k.is_multiple_of(4) && src.len() == k * n && dst.len() == k * n);
    let full = n / PANEL * PANEL;
    let quads = k / 4;
    for (b, block) in dst[..full * k].chunks_exact_mut(16).enumerate() {
        let (j, i) = (b / quads * PANEL, b % quads * 4);
        for r in 0..4 {
            let row = &src[(i + r) * n + j..(i + r) * n + j + PANEL];
            for (c, v) in row.iter().enumerate() {
                block[c * 4 + r] = *v;
            }
        }
    }
    // The last `n % PANEL` rows of the output lie as rows.
    for j in full..n {
        for i in 0..k {
            dst[j * k + i] = src[i * n + j];
        }
    }
}

/// Reads one value in each 64 bytes of `values`, so that a kernel then finds them in the
/// cache. A kernel's own pass over weights in memory keeps few cache lines in flight: the
/// processor runs ahead of the load it waits for by a few hundred instructions, which for a
/// kernel with much arithmetic per byte (f16 widened in registers, 4 and 8 bits) is a dozen
/// lines or fewer, where this loop keeps dozens. A prompt kernel reads the weights it will
/// multiply with many rows first: in Node, SmolLM2's 37-token prompt (after the first of a
/// process) took 256 ms for fp32 with the weights read so first against 267 without, 265.5
/// against 272 for fp16; 224 ms for fp32 with the weights in the cache all along.
///
/// Decoding kernels no longer touch their weights. Touching a run of 32 KB and then
/// multiplying it beat one pass over the weights (fp16 SmolLM2 in Node: 36-40 ms a token
/// against 43-45), but reading four parts of a weight side by side (f16 rows, f32 panels, int8
/// blocks, 4-bit columns, the `lm_head` bounds' panels) beats the runs: fp16 28.5-31 ms against
/// 39.6-41.7, fp32 40.5-41.5 against 45.2-47.5, int8 15.6-19.7 against 18.9-22.6, q4
/// 15.6-17.0 against 18.1-19.6.
pub fn touch<T: Copy>(values: &[T]) {
    let step = (64 / std::mem::size_of::<T>()).max(1);
    for v in values.iter().step_by(step) {
        // SAFETY: `v` refers to a value of the slice; the read is only there to be made.
        unsafe { std::ptr::read_volatile(v) };
    }
}

/// [`dot4`] of the four rows of a panel (`4 * x.len()` values in the panel layout).
pub fn dot4_panel(x: &[f32], panel: &[f32]) -> [f32; 4] {
    dot4_rows::<1, true>([x], panel)[0]
}

/// [`dot4x2`] of the four rows of a panel.
pub fn dot4x2_panel(x0: &[f32], x1: &[f32], panel: &[f32]) -> [[f32; 4]; 2] {
    dot4_rows::<2, true>([x0, x1], panel)
}

/// [`dot`] of `x` with each row of a panel, the same sums (a decoding step).
pub fn dot_panel(x: &[f32], panel: &[f32]) -> [f32; 4] {
    let [sums] = dot_panels(x, [panel]);
    sums
}

/// [`dot_panel`] of each panel, the panels read side by side.
pub fn dot_panels<const P: usize>(x: &[f32], panels: [&[f32]; P]) -> [[f32; 4]; P] {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::dot_panels(x, panels)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        let len = x.len();
        panels.map(|panel| {
            assert!(
                len.is_multiple_of(4) && panel.len() >= PANEL * len,
                "dot_panel: {} values",
                panel.len()
            );
            let at = |r: usize, i: usize| panel[(i / 4) * 16 + r * 4 + i % 4];
            std::array::from_fn(|r| {
                let mut acc = [0f32; 8];
                for c in 0..len / 8 {
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a += x[8 * c + i] * at(r, 8 * c + i);
                    }
                }
                let mut sum: f32 = acc.iter().sum();
                for (i, x) in x.iter().enumerate().skip(len / 8 * 8) {
                    sum += x * at(r, i);
                }
                sum
            })
        })
    }
}

/// Four lanes of partial sums per row and column, summed in lane order at the end, then the
/// tail (one f32x4 accumulator per row and column): explicit simd128 in wasm, the portable
/// loop elsewhere, with the same sums. `w`: four rows of `x.len()` values, or a panel
/// (`PANELS`, `x.len()` a multiple of four).
#[inline(always)]
fn dot4_rows<const R: usize, const PANELS: bool>(x: [&[f32]; R], w: &[f32]) -> [[f32; 4]; R] {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::dot4_rows::<R, PANELS>(x, w)
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        dot4_rows_portable::<R, PANELS>(x, w)
    }
}

#[cfg_attr(
    all(target_arch = "wasm32", target_feature = "simd128"),
    allow(dead_code)
)]
#[inline(always)]
fn dot4_rows_portable<const R: usize, const PANELS: bool>(
    x: [&[f32]; R],
    w: &[f32],
) -> [[f32; 4]; R] {
    let len = x[0].len();
    assert!(w.len() >= 4 * len && (!PANELS || len.is_multiple_of(4)));
    // Value i of weight row c.
    let at = |c: usize, i: usize| {
        if PANELS {
            w[(i / 4) * 16 + c * 4 + i % 4]
        } else {
            w[c * len + i]
        }
    };
    let x = x.map(|x| &x[..len]);
    let mut acc = [[[0f32; 4]; 4]; R];
    let chunks = len / 4;
    for c in 0..chunks {
        let at0 = c * 4;
        for (acc, x) in acc.iter_mut().zip(&x) {
            for (col, acc) in acc.iter_mut().enumerate() {
                for i in 0..4 {
                    acc[i] += x[at0 + i] * at(col, at0 + i);
                }
            }
        }
    }
    let mut out = [[0f32; 4]; R];
    for ((out, acc), x) in out.iter_mut().zip(&acc).zip(&x) {
        for (col, (o, acc)) in out.iter_mut().zip(acc).enumerate() {
            let tail: f32 = (chunks * 4..len).map(|i| x[i] * at(col, i)).sum();
            *o = ((acc[0] + acc[1]) + acc[2]) + acc[3] + tail;
        }
    }
    out
}

/// `2^112`: moves an f16 exponent (bias 15) placed in an f32 (bias 127) to its value.
const F16_EXPONENT_SHIFT: f32 = 5.192_297e33;

/// Inputs below this magnitude can be multiplied by `F16_EXPONENT_SHIFT` and stay finite.
const SCALED_INPUT_LIMIT: f32 = 65536.0;

/// An f16 (its bits) placed in an f32: the sign at bit 31, exponent and mantissa at bits
/// 27..13, so the f32 is exactly `2^-112` times the f16's value for finite values, normal and
/// subnormal (a weight is never infinite or NaN: `matmul_weights` checks at load time). Three
/// integer operations (sign extension, shift, mask), so loops over it vectorize.
#[inline(always)]
fn f16_scaled(h: u16) -> f32 {
    f32::from_bits((((h as i16 as i32) << 13) as u32) & 0x8fff_e000)
}

/// An f16 (its bits) as f32, exact for finite values.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    f16_scaled(h) * F16_EXPONENT_SHIFT
}

/// Whether f16 bits are infinite or NaN.
pub fn f16_is_special(h: u16) -> bool {
    h & 0x7c00 == 0x7c00
}

/// f16 bits to f32.
pub fn f16_to_f32_slice(src: &[u16], dst: &mut [f32]) {
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(h);
    }
}

/// A panel of f16 weights (four rows of `k`, `k` a multiple of four, as they lie) as f32 in
/// the panel layout ([`panel_index`]), for the prompt kernel of panels.
pub fn f16_panel_to_f32(src: &[u16], k: usize, dst: &mut [f32]) {
    assert!(k.is_multiple_of(4) && src.len() == PANEL * k && dst.len() == PANEL * k);
    kernels::f16_panel_to_f32(src, k, dst)
}

/// [`f16_panel_to_f32`] of the values `4i..4i + 4` of each row from `quads.start`.
fn f16_panel_quads(src: &[u16], k: usize, quads: std::ops::Range<usize>, dst: &mut [f32]) {
    for (c, row) in src.chunks_exact(k).enumerate() {
        for i in quads.clone() {
            let at = i * 16 + c * 4;
            for (d, &h) in dst[at..at + 4].iter_mut().zip(&row[4 * i..4 * i + 4]) {
                *d = f16_to_f32(h);
            }
        }
    }
}

/// `x * 2^112` when every value stays finite. Then `scaled_x * f16_scaled(h)` is the same f32
/// product as `x * f16_to_f32(h)` (both factors are exact, so the product rounds the same real
/// number), and the f16 kernels skip a multiplication per weight.
fn scaled_input(x: &[f32]) -> Option<Vec<f32>> {
    x.iter()
        .all(|v| v.abs() < SCALED_INPUT_LIMIT)
        .then(|| x.iter().map(|v| v * F16_EXPONENT_SHIFT).collect())
}

/// Parts of a weight that a decoding kernel reads side by side (f16 rows here, f32 panels in
/// `matmul_weights`, int8 blocks in `matmul_integer`, the `lm_head`'s int8 panels; the 4-bit
/// kernel takes four too): `STREAMS` sequential reads at once keep more of memory's lines in
/// flight than one. In a wasm benchmark of SmolLM2's f16 layers (Node 20, 2 cores), 31.5 ms for
/// one row at a time (each run of rows read into the cache first), 22.7 for two streams, 18.1
/// for four, 17.2 for eight; four adjacent rows, one stream, took 38.7. In the package, eight
/// f16 rows decoded no faster than four, and two f32 panels or two int8 blocks gained half or
/// none of what four do. Where memory is fast, one stream can decode faster: each decoder
/// chooses (`streams`).
pub(crate) const STREAMS: usize = 4;

/// `0..count` for a kernel that reads `N` parts side by side: the groups `[i, i + q, ..,
/// i + (N - 1) q]` (`q = count / N`, `i < q`), then the indices left over, `N q..count`.
pub(crate) fn side_by_side<const N: usize>(
    count: usize,
) -> (impl Iterator<Item = [usize; N]>, std::ops::Range<usize>) {
    let q = count / N;
    let groups = (0..q).map(move |i| std::array::from_fn(|s| i + s * q));
    (groups, N * q..count)
}

/// `out[j] = sum_k x[k] * w[j, k]` with f16 weights `[out.len(), x.len()]`: one dot product
/// per output, those of rows `j`, `j + q`, `j + 2q`, ... (`q` = a [`STREAMS`]th of the rows,
/// or each row alone: `streams::count`) at once.
pub fn matvec_f16_nk(x: &[f32], w: &[u16], out: &mut [f32]) {
    let k = x.len();
    match scaled_input(x) {
        Some(mut xs) => {
            kernels::order_for_dot_f16(&mut xs);
            let rows = w
                .len()
                .checked_div(k)
                .map_or(out.len(), |r| r.min(out.len()));
            if streams::count() == 1 {
                dot_f16_rows::<1>(&xs, w, rows, out);
            } else {
                dot_f16_rows::<STREAMS>(&xs, w, rows, out);
            }
        }
        None => {
            for (w, o) in w.chunks_exact(k).zip(out.iter_mut()) {
                *o = dot_f16_with(x, w, f16_to_f32);
            }
        }
    }
}

/// `matvec_f16_nk` of `rows` rows, `xs` scaled and ordered for `dot_f16_scaled`, `S` rows a
/// `S`th of them apart at once.
fn dot_f16_rows<const S: usize>(xs: &[f32], w: &[u16], rows: usize, out: &mut [f32]) {
    let k = xs.len();
    let row = |j: usize| &w[j * k..(j + 1) * k];
    let (groups, rest) = side_by_side::<S>(rows);
    for js in groups {
        let sums = kernels::dot_f16_scaled(xs, js.map(row));
        for (j, sum) in js.into_iter().zip(sums) {
            out[j] = sum;
        }
    }
    for j in rest {
        [out[j]] = kernels::dot_f16_scaled(xs, [row(j)]);
    }
}

/// `out[j] += sum_k x[k] * w[k * stride + j]` (f16 weights): `out.len()` columns of the
/// `x.len()` rows of a matrix whose rows are `stride` apart; four rows per pass over `out`.
pub fn axpy_rows_f16(x: &[f32], w: &[u16], stride: usize, out: &mut [f32]) {
    match scaled_input(x) {
        Some(xs) => kernels::axpy_rows_f16_scaled(&xs, w, stride, out),
        None => axpy_rows_f16_with(x, w, stride, out, f16_to_f32),
    }
}

/// `sum_k x[k] * f16(w[k])`: eight independent sums (`k % 8`), summed in order at the end.
#[inline(always)]
fn dot_f16_with(x: &[f32], w: &[u16], f16: impl Fn(u16) -> f32) -> f32 {
    let len = x.len().min(w.len());
    let mut acc = [0f32; 8];
    let chunks = len / 8;
    for (xs, ws) in x.chunks_exact(8).zip(w.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += xs[i] * f16(ws[i]);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..len {
        sum += x[i] * f16(w[i]);
    }
    sum
}

/// `out[j] += sum_k x[k] * f16(w[k * stride + j])`, four rows of `w` per pass over `out`,
/// each output adding `((a0 w0 + a1 w1) + a2 w2) + a3 w3`.
#[inline(always)]
fn axpy_rows_f16_with(
    x: &[f32],
    w: &[u16],
    stride: usize,
    out: &mut [f32],
    f16: impl Fn(u16) -> f32,
) {
    let n = out.len();
    let rows = x.len();
    let row = |k: usize| &w[k * stride..k * stride + n];
    let mut k = 0;
    while k + 4 <= rows {
        let (a0, a1, a2, a3) = (x[k], x[k + 1], x[k + 2], x[k + 3]);
        let (w0, w1, w2, w3) = (row(k), row(k + 1), row(k + 2), row(k + 3));
        for j in 0..n {
            out[j] += a0 * f16(w0[j]) + a1 * f16(w1[j]) + a2 * f16(w2[j]) + a3 * f16(w3[j]);
        }
        k += 4;
    }
    while k < rows {
        let a = x[k];
        for (o, &h) in out.iter_mut().zip(row(k)) {
            *o += a * f16(h);
        }
        k += 1;
    }
}

/// The f16 kernels on inputs scaled by `scaled_input`: written for LLVM to vectorize.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
mod kernels {
    use super::{axpy_rows_f16_with, dot_f16_with, f16_panel_quads, f16_scaled};

    /// `super::f16_panel_to_f32`, a quad at a time.
    pub fn f16_panel_to_f32(src: &[u16], k: usize, dst: &mut [f32]) {
        f16_panel_quads(src, k, 0..k / 4, dst)
    }

    /// `x` in the order `dot_f16_scaled` takes it: as it is.
    pub fn order_for_dot_f16(_x: &mut [f32]) {}

    /// `dot_f16_with` of `x` and each row of `w`.
    pub fn dot_f16_scaled<const N: usize>(x: &[f32], w: [&[u16]; N]) -> [f32; N] {
        w.map(|w| dot_f16_with(x, w, f16_scaled))
    }

    pub fn axpy_rows_f16_scaled(x: &[f32], w: &[u16], stride: usize, out: &mut [f32]) {
        axpy_rows_f16_with(x, w, stride, out, f16_scaled)
    }
}

/// The f16 kernels on inputs scaled by `scaled_input`, with simd128: eight f16 per load,
/// widened in registers; and the f32 kernels. They add in the same order as the portable
/// kernels, so both give the same sums, except where the relaxed SIMD build multiplies and adds
/// in one step (`madd`).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod kernels {
    use core::arch::wasm32::*;

    use super::{axpy_rows_f16_with, f16_panel_quads, f16_scaled, F16_EXPONENT_SHIFT};

    /// `acc + a * b` per lane. With relaxed SIMD (the package's second wasm,
    /// `onnx_generate_bg_relaxed.wasm`) one `f32x4.relaxed_madd`, which engines on hardware
    /// with fused multiply-add (x86-64 with FMA3, arm64) round once. The f32 prompt kernel is
    /// bound by its multiplies and adds: alone it ran 1.3x faster in Node on x86-64, and fp32
    /// SmolLM2's 37-token prompt 1.25x. Without relaxed SIMD, a multiply and an add, rounded
    /// each.
    #[inline(always)]
    fn madd(a: v128, b: v128, acc: v128) -> v128 {
        #[cfg(target_feature = "relaxed-simd")]
        {
            f32x4_relaxed_madd(a, b, acc)
        }
        #[cfg(not(target_feature = "relaxed-simd"))]
        {
            f32x4_add(acc, f32x4_mul(a, b))
        }
    }

    /// [`super::matmul_panels8`] with simd128: `R` rows (up to four) a block, a panel of eight
    /// columns a pass (two vectors of its values at a time, each multiplied by a splat of each
    /// row's value).
    pub fn matmul_panels8(
        a: &[f32],
        rows: usize,
        k: usize,
        panels: &[f32],
        cols: std::ops::Range<usize>,
        block: &mut [f32],
    ) {
        let width = cols.len();
        let mut r = 0;
        while r < rows {
            let count = (rows - r).min(4);
            let (a, out) = (
                &a[r * k..(r + count) * k],
                &mut block[r * width..(r + count) * width],
            );
            match count {
                4 => rows_block::<4>(a, k, panels, &cols, out),
                3 => rows_block::<3>(a, k, panels, &cols, out),
                2 => rows_block::<2>(a, k, panels, &cols, out),
                _ => rows_block::<1>(a, k, panels, &cols, out),
            }
            r += count;
        }
    }

    /// `R` rows of [`matmul_panels8`] (`a` `[R, k]`, `out` `[R, width]`).
    #[inline(always)]
    fn rows_block<const R: usize>(
        a: &[f32],
        k: usize,
        panels: &[f32],
        cols: &std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let width = cols.len();
        let ap = a.as_ptr();
        for j in (0..width).step_by(8) {
            let panel = &panels[8 * k * ((cols.start + j) / 8)..][..8 * k];
            let pp = panel.as_ptr();
            let mut acc = [[f32x4_splat(0.0); 2]; R];
            for i in 0..k {
                // SAFETY: values 8i..8i + 8 of the panel (`8 k` values) and value `i` of rows
                // `0..R` of `a` (`R k` values, asserted by the caller); v128 loads are
                // unaligned.
                unsafe {
                    let w0 = v128_load(pp.add(8 * i) as *const v128);
                    let w1 = v128_load(pp.add(8 * i + 4) as *const v128);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x = v128_load32_splat(ap.add(r * k + i) as *const u32);
                        acc[0] = madd(x, w0, acc[0]);
                        acc[1] = madd(x, w1, acc[1]);
                    }
                }
            }
            let take = (width - j).min(8);
            for (r, acc) in acc.iter().enumerate() {
                let mut lanes = [0f32; 8];
                // SAFETY: eight values; v128 stores are unaligned.
                unsafe {
                    v128_store(lanes.as_mut_ptr() as *mut v128, acc[0]);
                    v128_store(lanes.as_mut_ptr().add(4) as *mut v128, acc[1]);
                }
                out[r * width + j..r * width + j + take].copy_from_slice(&lanes[..take]);
            }
        }
    }

    /// `dot4_rows` with simd128: the four weight rows loaded once per step for all `R` rows.
    #[inline(always)]
    pub fn dot4_rows<const R: usize, const PANELS: bool>(
        x: [&[f32]; R],
        w: &[f32],
    ) -> [[f32; 4]; R] {
        let len = x[0].len();
        assert!(
            w.len() >= 4 * len
                && x.iter().all(|x| x.len() >= len)
                && (!PANELS || len.is_multiple_of(4)),
            "dot4: {} weights for four rows of {len}",
            w.len()
        );
        let chunks = len / 4;
        // Weight row c's values 4i..4i+4 at p[c] + i * step.
        let (wp, step) = if PANELS {
            ([0, 1, 2, 3].map(|c| w[c * 4..].as_ptr()), 16)
        } else {
            ([0, 1, 2, 3].map(|c| w[c * len..].as_ptr()), 4)
        };
        let xp = x.map(|x| x.as_ptr());
        let mut acc = [[f32x4_splat(0.0); 4]; R];
        for c in 0..chunks {
            // SAFETY: values 4c..4c+4 of each weight row and each x row are within `len`
            // (asserted above); v128_load accepts unaligned addresses.
            unsafe {
                let wv = wp.map(|p| v128_load(p.add(c * step) as *const v128));
                for (acc, xp) in acc.iter_mut().zip(&xp) {
                    let xv = v128_load(xp.add(c * 4) as *const v128);
                    for (a, wv) in acc.iter_mut().zip(wv) {
                        *a = madd(xv, wv, *a);
                    }
                }
            }
        }
        let mut out = [[0f32; 4]; R];
        for ((out, acc), x) in out.iter_mut().zip(&acc).zip(&x) {
            for (c, (o, a)) in out.iter_mut().zip(acc).enumerate() {
                // A panel has no tail (`len` is a multiple of four).
                let tail: f32 = (chunks * 4..len).map(|i| x[i] * w[c * len + i]).sum();
                *o = ((f32x4_extract_lane::<0>(*a) + f32x4_extract_lane::<1>(*a))
                    + f32x4_extract_lane::<2>(*a))
                    + f32x4_extract_lane::<3>(*a)
                    + tail;
            }
        }
        out
    }

    /// `dot_panels` with simd128: two f32x4 sums per row (the eight lanes of `dot`), each
    /// panel's four rows in one stream, the panels side by side.
    pub fn dot_panels<const P: usize>(x: &[f32], panels: [&[f32]; P]) -> [[f32; 4]; P] {
        let len = x.len();
        assert!(
            len.is_multiple_of(4) && panels.iter().all(|p| p.len() >= super::PANEL * len),
            "dot_panel: panels of four rows of {len}"
        );
        let pairs = len / 8;
        let xp = x.as_ptr();
        let wp = panels.map(|p| p.as_ptr());
        let mut acc = [[[f32x4_splat(0.0); 2]; 4]; P];
        for c in 0..pairs {
            // SAFETY: x[8c..8c+8] and each panel[32c..32c+32] are within the asserted
            // lengths; v128_load accepts unaligned addresses.
            unsafe {
                let x0 = v128_load(xp.add(8 * c) as *const v128);
                let x1 = v128_load(xp.add(8 * c + 4) as *const v128);
                for (acc, wp) in acc.iter_mut().zip(&wp) {
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let w0 = v128_load(wp.add(32 * c + 4 * r) as *const v128);
                        let w1 = v128_load(wp.add(32 * c + 16 + 4 * r) as *const v128);
                        acc[0] = madd(x0, w0, acc[0]);
                        acc[1] = madd(x1, w1, acc[1]);
                    }
                }
            }
        }
        std::array::from_fn(|p| {
            std::array::from_fn(|r| {
                let [a, b] = acc[p][r];
                let lanes = [
                    f32x4_extract_lane::<0>(a),
                    f32x4_extract_lane::<1>(a),
                    f32x4_extract_lane::<2>(a),
                    f32x4_extract_lane::<3>(a),
                    f32x4_extract_lane::<0>(b),
                    f32x4_extract_lane::<1>(b),
                    f32x4_extract_lane::<2>(b),
                    f32x4_extract_lane::<3>(b),
                ];
                let mut sum: f32 = lanes.iter().sum();
                for i in pairs * 8..len {
                    sum += x[i] * panels[p][(i / 4) * 16 + r * 4 + i % 4];
                }
                sum
            })
        })
    }

    /// Eight f16 at `p` as two f32x4 of `f16_scaled` values.
    ///
    /// # Safety
    /// `p..p + 8` must be readable.
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> (v128, v128) {
        let v = v128_load(p as *const v128);
        let mask = u32x4_splat(0x8fff_e000);
        let lo = v128_and(i32x4_shl(i32x4_extend_low_i16x8(v), 13), mask);
        let hi = v128_and(i32x4_shl(i32x4_extend_high_i16x8(v), 13), mask);
        (lo, hi)
    }

    /// `super::f16_panel_to_f32`: eight values of each row at a time (`load8`, scaled back to
    /// their f32 values), written to two quads of the panel; a last odd quad by the portable
    /// loop.
    pub fn f16_panel_to_f32(src: &[u16], k: usize, dst: &mut [f32]) {
        assert!(src.len() >= 4 * k && dst.len() >= 4 * k);
        let eights = k / 8;
        let shift = f32x4_splat(F16_EXPONENT_SHIFT);
        let d = dst.as_mut_ptr();
        for j in 0..eights {
            for c in 0..4 {
                // SAFETY: values 8j..8j + 8 of row c (8j + 8 <= k) and quads 2j and 2j + 1 of
                // the panel (16 (2j + 1) + 4c + 4 <= 16 (k / 4)) are within the asserted
                // lengths; v128 loads and stores are unaligned.
                unsafe {
                    let (lo, hi) = load8(src.as_ptr().add(c * k + 8 * j));
                    v128_store(d.add(32 * j + 4 * c) as *mut v128, f32x4_mul(lo, shift));
                    v128_store(
                        d.add(32 * j + 16 + 4 * c) as *mut v128,
                        f32x4_mul(hi, shift),
                    );
                }
            }
        }
        f16_panel_quads(src, k, 2 * eights..k / 4, dst);
    }

    /// `x` in the order `dot_f16_scaled` takes it: in each whole chunk of eight, the even
    /// values, then the odd ones (the order in which the kernel widens the weights); the tail
    /// as it is.
    pub fn order_for_dot_f16(x: &mut [f32]) {
        for chunk in x.chunks_exact_mut(8) {
            let c: [f32; 8] = [0, 2, 4, 6, 1, 3, 5, 7].map(|i| chunk[i]);
            chunk.copy_from_slice(&c);
        }
    }

    /// `dot_f16_with` of `x` (ordered by `order_for_dot_f16`) and each row of `w`, the rows
    /// read side by side. Each load of eight f16 widens in five simd operations, the even ones
    /// shifted up and both arithmetic-shifted into place and masked (`f16_scaled`'s bits),
    /// against seven for `load8`'s widening of the low and high halves. A row's two sums hold
    /// in lane `l` its weights `2l` (even) and `2l + 1` (odd) of each chunk of eight, so the
    /// sums are added in the portable kernel's order. Two sums a row keep the four rows' sums,
    /// the two loads of `x`, the mask and a weight being widened within x86-64's sixteen simd
    /// registers; with four sums a row V8 kept half of them on the stack.
    pub fn dot_f16_scaled<const N: usize>(x: &[f32], w: [&[u16]; N]) -> [f32; N] {
        let len = x.len();
        let w = w.map(|w| &w[..len]);
        let chunks = len / 8;
        let mask = u32x4_splat(0x8fff_e000);
        let mut acc = [[f32x4_splat(0.0); 2]; N];
        for c in 0..chunks {
            // SAFETY: chunk c covers x[8c..8c+8] and each w[8c..8c+8], within `len`;
            // v128_load accepts unaligned addresses.
            unsafe {
                let xp = x.as_ptr().add(c * 8);
                let xe = v128_load(xp as *const v128);
                let xo = v128_load(xp.add(4) as *const v128);
                for (acc, w) in acc.iter_mut().zip(&w) {
                    let v = v128_load(w.as_ptr().add(c * 8) as *const v128);
                    let even = v128_and(i32x4_shr(i32x4_shl(v, 16), 3), mask);
                    let odd = v128_and(i32x4_shr(v, 3), mask);
                    acc[0] = madd(xe, even, acc[0]);
                    acc[1] = madd(xo, odd, acc[1]);
                }
            }
        }
        std::array::from_fn(|r| {
            let lanes = acc[r].map(|a| {
                [
                    f32x4_extract_lane::<0>(a),
                    f32x4_extract_lane::<1>(a),
                    f32x4_extract_lane::<2>(a),
                    f32x4_extract_lane::<3>(a),
                ]
            });
            let mut sum = 0f32;
            for i in 0..8 {
                sum += lanes[i % 2][i / 2];
            }
            for i in chunks * 8..len {
                sum += x[i] * f16_scaled(w[r][i]);
            }
            sum
        })
    }

    pub fn axpy_rows_f16_scaled(x: &[f32], w: &[u16], stride: usize, out: &mut [f32]) {
        let n = out.len();
        let rows = x.len();
        assert!(
            rows == 0 || (n <= stride && (rows - 1) * stride + n <= w.len()),
            "axpy_rows_f16: {} weights for {rows} rows of {n} columns, {stride} apart",
            w.len()
        );
        let blocks = n / 8;
        let full = rows / 4 * 4;
        for k in (0..full).step_by(4) {
            let a = [x[k], x[k + 1], x[k + 2], x[k + 3]].map(|v| f32x4_splat(v));
            for b in 0..blocks {
                // SAFETY: rows k..k+4 of w and out[8b..8b+8] are in bounds (asserted above).
                unsafe {
                    let wp = w.as_ptr().add(k * stride + b * 8);
                    let (l0, h0) = load8(wp);
                    let (l1, h1) = load8(wp.add(stride));
                    let (l2, h2) = load8(wp.add(2 * stride));
                    let (l3, h3) = load8(wp.add(3 * stride));
                    let lo = f32x4_add(f32x4_mul(a[0], l0), f32x4_mul(a[1], l1));
                    let lo = f32x4_add(f32x4_add(lo, f32x4_mul(a[2], l2)), f32x4_mul(a[3], l3));
                    let hi = f32x4_add(f32x4_mul(a[0], h0), f32x4_mul(a[1], h1));
                    let hi = f32x4_add(f32x4_add(hi, f32x4_mul(a[2], h2)), f32x4_mul(a[3], h3));
                    let op = out.as_mut_ptr().add(b * 8) as *mut v128;
                    v128_store(op, f32x4_add(v128_load(op), lo));
                    v128_store(op.add(1), f32x4_add(v128_load(op.add(1)), hi));
                }
            }
            // The columns past the last whole block, added as the portable kernel adds them.
            for j in blocks * 8..n {
                let h = |r: usize| f16_scaled(w[(k + r) * stride + j]);
                out[j] += x[k] * h(0) + x[k + 1] * h(1) + x[k + 2] * h(2) + x[k + 3] * h(3);
            }
        }
        if full < rows {
            axpy_rows_f16_with(&x[full..], &w[full * stride..], stride, out, f16_scaled);
        }
    }
}
/// `out[j] += sum_k x[k] * w[k * stride + j]` (f32 weights): `out.len()` columns of the
/// `x.len()` rows of a matrix whose rows are `stride` apart; four rows per pass over `out`.
pub fn axpy_rows(x: &[f32], w: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    axpy_rows_with(x, |k| &w[k * stride..k * stride + n], out);
}

/// The values of `[k, n]` in panels of eight columns ([`panels8_from_rows`]): `n` rounded up
/// to whole panels.
pub fn panels8_len(k: usize, n: usize) -> usize {
    n.div_ceil(8) * 8 * k
}

/// `src`, an `[n, k]` matrix (the keys of an attention head), as `[k, n]` in panels of eight
/// columns into `dst` ([`panels8_len`] values): panel `p` holds value `i` of rows `8 p
/// .. 8 p + 8` at `8 k p + 8 i ..`, zeros past the last row, so that [`matmul_panels8`] reads
/// each panel in one stream and computes a last partial panel as the others.
pub fn panels8_from_rows(src: &[f32], k: usize, n: usize, dst: &mut [f32]) {
    assert!(
        src.len() >= n * k && dst.len() >= panels8_len(k, n),
        "panels8_from_rows: {} and {} values for [{n}, {k}]",
        src.len(),
        dst.len()
    );
    if k == 0 {
        return;
    }
    for (p, panel) in dst.chunks_exact_mut(8 * k).take(n.div_ceil(8)).enumerate() {
        panel.fill(0.0);
        for (c, row) in src[8 * p * k..(8 * p + 8).min(n) * k]
            .chunks_exact(k)
            .enumerate()
        {
            for (i, &v) in row.iter().enumerate() {
                panel[8 * i + c] = v;
            }
        }
    }
}

/// Columns `cols` (`cols.start` a multiple of eight) of `a @ b` for the `rows` rows of `a`
/// (`[rows, k]`), `b` `[k, n]` in panels of eight columns ([`panels8_from_rows`]), into
/// `block` (`[rows, cols.len()]`): each output one sum over `k` in order, `acc + a * b` from
/// zero (`madd` in the relaxed SIMD build), so an output's bits depend neither on the rows nor
/// on the columns computed with it. With simd128 four rows and a panel at a time, the panel's
/// values multiplied by a row's value: no sums across lanes, which the prompt kernel's dot
/// products end with, and the scores of a prompt's attention are short dot products (a head's
/// 64 values), each through `matmul_weights`' prompt path. In V8 profiles of a 1,001-token q4
/// SmolLM2 prompt (Node), the products of the attention took 3.0-3.2 s against 3.4.
pub fn matmul_panels8(
    a: &[f32],
    rows: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    cols: std::ops::Range<usize>,
    block: &mut [f32],
) {
    let width = cols.len();
    assert!(
        a.len() >= rows * k
            && cols.start.is_multiple_of(8)
            && cols.end <= n
            && panels.len() >= panels8_len(k, n)
            && block.len() >= rows * width,
        "matmul_panels8: {rows} rows of {k}, {} values of B for {n} columns, columns {cols:?}",
        panels.len()
    );
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        kernels::matmul_panels8(a, rows, k, panels, cols, block);
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        // A panel's eight sums side by side, each over `k` in order (LLVM vectorizes the
        // lanes).
        for (r, out) in block.chunks_exact_mut(width.max(1)).take(rows).enumerate() {
            for (j, out) in out.chunks_mut(8).enumerate() {
                let p = cols.start / 8 + j;
                let mut acc = [0f32; 8];
                for (&x, w) in a[r * k..(r + 1) * k]
                    .iter()
                    .zip(panels[8 * k * p..8 * k * (p + 1)].chunks_exact(8))
                {
                    for (acc, &w) in acc.iter_mut().zip(w) {
                        *acc += x * w;
                    }
                }
                out.copy_from_slice(&acc[..out.len()]);
            }
        }
    }
}

/// [`axpy_rows`] with row `k` of the matrix given by `row(k)` (`out.len()` values).
pub fn axpy_rows_with<'a>(x: &[f32], row: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    let n = out.len();
    let rows = x.len();
    let row = |k: usize| &row(k)[..n];
    let mut k = 0;
    while k + 4 <= rows {
        let (a0, a1, a2, a3) = (x[k], x[k + 1], x[k + 2], x[k + 3]);
        let (w0, w1, w2, w3) = (row(k), row(k + 1), row(k + 2), row(k + 3));
        for j in 0..n {
            out[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
        }
        k += 4;
    }
    while k < rows {
        let a = x[k];
        for (o, &v) in out.iter_mut().zip(row(k)) {
            *o += a * v;
        }
        k += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `matmul_panels8` on `panels8_from_rows`' panels: each output the sum over `k` in order,
    /// bit for bit, for any rows and columns with it; the last panel full and not. (The
    /// simd128 kernel: `tests/wasm_api`, `matmul_panels8_sums_each_output_in_order`.)
    #[test]
    fn panels8_products_sum_each_output_in_order() {
        let mut next = super::super::testing::uniform(0x3c6e_f372_fe94_f82b);
        for (rows, k, n) in [(5usize, 64usize, 21usize), (2, 3, 16), (1, 9, 5)] {
            let a: Vec<f32> = (0..rows * k).map(|_| next()).collect();
            let keys: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let mut panels = vec![f32::NAN; panels8_len(k, n)];
            panels8_from_rows(&keys, k, n, &mut panels);
            let mut whole = vec![0f32; rows * n];
            matmul_panels8(&a, rows, k, &panels, n, 0..n, &mut whole);
            for r in 0..rows {
                for j in 0..n {
                    let mut acc = 0f32;
                    for i in 0..k {
                        acc += a[r * k + i] * keys[j * k + i];
                    }
                    assert_eq!(
                        whole[r * n + j].to_bits(),
                        acc.to_bits(),
                        "{rows} {k} {n}: {r} {j}"
                    );
                }
            }
            if n <= 8 {
                continue;
            }
            let cols = 8..n.min(16);
            let mut block = vec![0f32; rows * cols.len()];
            matmul_panels8(&a, rows, k, &panels, n, cols.clone(), &mut block);
            for (r, got) in block.chunks_exact(cols.len()).enumerate() {
                assert_eq!(
                    got,
                    &whole[r * n + cols.start..r * n + cols.end],
                    "{rows} {k} {n}"
                );
            }
        }
    }

    /// `transpose_panels` puts every value of the `[k, n]` transpose at its `panel_index`:
    /// whole panels and one, two, three rows past them.
    #[test]
    fn transpose_panels_puts_each_value_at_its_panel_index() {
        let k = 12;
        for n in [8, 9, 10, 11] {
            let rows: Vec<u32> = (0..(n * k) as u32).collect();
            let mut want = vec![0u32; n * k];
            for j in 0..n {
                for i in 0..k {
                    want[panel_index(j, i, n, k)] = rows[j * k + i];
                }
            }
            let mut got = vec![0u32; n * k];
            let columns: Vec<u32> = (0..k * n).map(|v| rows[(v % n) * k + v / n]).collect();
            transpose_panels(&columns, k, n, &mut got);
            assert_eq!(got, want, "n={n}");
        }
    }

    /// The panel kernels give the row kernels' sums bit for bit: two whole panels and three
    /// rows past them, K a multiple of eight and not.
    #[test]
    fn panel_kernels_match_the_row_kernels() {
        let mut next = super::super::testing::uniform(0x5851_f42d_4c95_7f2d);
        for k in [24, 20] {
            let n = 11;
            let rows: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let mut panels = vec![0f32; n * k];
            for j in 0..n {
                for i in 0..k {
                    panels[panel_index(j, i, n, k)] = rows[j * k + i];
                }
            }
            // The rows past the last panel lie as they are.
            assert_eq!(panels[8 * k..], rows[8 * k..]);
            let x0: Vec<f32> = (0..k).map(|_| next()).collect();
            let x1: Vec<f32> = (0..k).map(|_| next()).collect();
            for p in 0..n / PANEL {
                let (w, panel) = (&rows[p * 4 * k..], &panels[p * 4 * k..(p + 1) * 4 * k]);
                assert_eq!(dot4_panel(&x0, panel), dot4(&x0, w), "k={k}");
                assert_eq!(dot4x2_panel(&x0, &x1, panel), dot4x2(&x0, &x1, w), "k={k}");
                let each: Vec<f32> = (0..4).map(|r| dot(&x0, &w[r * k..(r + 1) * k])).collect();
                assert_eq!(dot_panel(&x0, panel).to_vec(), each, "k={k}");
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_finite_values() {
        for bits in 0..=u16::MAX {
            if f16_is_special(bits) {
                continue;
            }
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert_eq!(got.to_bits(), want.to_bits(), "bits {bits:#06x}");
        }
    }

    /// Deterministic finite f16 weights (every exponent, subnormals and both signs) and
    /// activations.
    fn case(k: usize, n: usize, big: bool) -> (Vec<f32>, Vec<u16>) {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let w = (0..k * n)
            .map(|_| {
                let h = next() as u16;
                if f16_is_special(h) {
                    h & 0x83ff
                } else {
                    h
                }
            })
            .collect();
        let mut x: Vec<f32> = (0..k)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        if big {
            x[k / 2] = 70000.0; // beyond SCALED_INPUT_LIMIT: the unscaled path
        }
        (x, w)
    }

    /// f16 rows read one at a time or four side by side (`streams`) give the same bits, with
    /// rows left over after the groups of four.
    #[test]
    fn f16_rows_one_at_a_time_or_side_by_side_give_the_same_sums() {
        let (k, n) = (40, 103);
        let (x, w) = case(k, n, false);
        let mut xs = scaled_input(&x).unwrap();
        kernels::order_for_dot_f16(&mut xs);
        let mut one = vec![0f32; n];
        dot_f16_rows::<1>(&xs, &w, n, &mut one);
        let mut four = vec![0f32; n];
        dot_f16_rows::<STREAMS>(&xs, &w, n, &mut four);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&one), bits(&four));
        let mut all = vec![0f32; n];
        matvec_f16_nk(&x, &w, &mut all);
        assert_eq!(bits(&all), bits(&four));
    }

    /// The f16 kernels give the f32 kernels' sums on the converted weights, bit for bit, on
    /// the scaled path and on the path for large inputs, with row and column tails.
    #[test]
    fn f16_kernels_match_the_f32_kernels() {
        for (k, n, big) in [
            (7, 13, false),
            (32, 24, false),
            (12, 40, true),
            (33, 5, true),
            // 700 rows: four streams of 175 (`STREAMS`).
            (48, 700, false),
        ] {
            let (x, w) = case(k, n, big);
            let mut w32 = vec![0f32; w.len()];
            f16_to_f32_slice(&w, &mut w32);
            // [k, n]: rows of w added into out.
            let mut want = vec![0.5f32; n];
            axpy_rows(&x, &w32, n, &mut want);
            let mut got = vec![0.5f32; n];
            axpy_rows_f16(&x, &w, n, &mut got);
            assert_eq!(got, want, "axpy k={k} n={n} big={big}");
            // The last 3 columns only, rows n apart.
            let mut want = vec![0.5f32; 3];
            axpy_rows(&x, &w32[n - 3..], n, &mut want);
            let mut got = vec![0.5f32; 3];
            axpy_rows_f16(&x, &w[n - 3..], n, &mut got);
            assert_eq!(got, want, "axpy k={k} n={n} big={big}");
            // [n, k]: one dot product per output.
            let want: Vec<f32> = w32
                .chunks_exact(k)
                .take(n)
                .map(|r| dot_f16_ref(&x, r))
                .collect();
            let mut got = vec![0f32; n];
            matvec_f16_nk(&x, &w, &mut got);
            assert_eq!(got, want, "matvec k={k} n={n} big={big}");
        }
    }

    /// `dot_f16_with`'s order of additions over f32 weights.
    fn dot_f16_ref(x: &[f32], w: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for (xs, ws) in x.chunks_exact(8).zip(w.chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += xs[i] * ws[i];
            }
        }
        let mut sum: f32 = acc.iter().sum();
        for i in x.len() / 8 * 8..x.len() {
            sum += x[i] * w[i];
        }
        sum
    }
}
