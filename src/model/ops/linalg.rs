//! Small f32 kernels shared by the matmul ops, written so that LLVM vectorizes them (SSE/AVX
//! natively, simd128 in wasm): independent accumulators, fixed-width inner loops.

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

/// Four dot products of `x` with the four consecutive `x.len()`-long rows of `w` (one pass
/// over `x`).
pub fn dot4(x: &[f32], w: &[f32]) -> [f32; 4] {
    let len = x.len();
    let (w0, rest) = w.split_at(len);
    let (w1, rest) = rest.split_at(len);
    let (w2, w3) = rest.split_at(len);
    let w3 = &w3[..len];
    let mut acc = [[0f32; 8]; 4];
    let chunks = len / 8;
    for c in 0..chunks {
        let xs = &x[c * 8..c * 8 + 8];
        for (acc, w) in acc.iter_mut().zip([w0, w1, w2, w3]) {
            let ws = &w[c * 8..c * 8 + 8];
            for i in 0..8 {
                acc[i] += xs[i] * ws[i];
            }
        }
    }
    let mut out = [0f32; 4];
    for (o, (acc, w)) in out.iter_mut().zip(acc.iter().zip([w0, w1, w2, w3])) {
        *o = acc.iter().sum::<f32>() + (chunks * 8..len).map(|i| x[i] * w[i]).sum::<f32>();
    }
    out
}

/// `2^112`: moves an f16 exponent (bias 15) placed in an f32 (bias 127) to its value.
const F16_EXPONENT_SHIFT: f32 = 5.192_297e33;

/// An f16 (its bits) as f32: exact for finite values, normal and subnormal (a weight is never
/// infinite or NaN: `matmul_weights` checks at load time). Branch-free, so loops over it vectorize.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let magnitude = f32::from_bits(((h & 0x7fff) as u32) << 13) * F16_EXPONENT_SHIFT;
    f32::from_bits(magnitude.to_bits() | sign)
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

/// `sum_k x[k] * w[k]` with f16 weights.
pub fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
    let len = x.len().min(w.len());
    let mut acc = [0f32; 16];
    let chunks = len / 16;
    for (xs, ws) in x.chunks_exact(16).zip(w.chunks_exact(16)) {
        for i in 0..16 {
            acc[i] += xs[i] * f16_to_f32(ws[i]);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 16..len {
        sum += x[i] * f16_to_f32(w[i]);
    }
    sum
}

/// `out[j] += sum_k x[k] * w[k * stride + j]` (f16 weights): `out.len()` columns of the
/// `x.len()` rows of a matrix whose rows are `stride` apart; four rows per pass over `out`.
pub fn axpy_rows_f16(x: &[f32], w: &[u16], stride: usize, out: &mut [f32]) {
    let n = out.len();
    let rows = x.len();
    let row = |k: usize| &w[k * stride..k * stride + n];
    let mut k = 0;
    while k + 4 <= rows {
        let (a0, a1, a2, a3) = (x[k], x[k + 1], x[k + 2], x[k + 3]);
        let (w0, w1, w2, w3) = (row(k), row(k + 1), row(k + 2), row(k + 3));
        for j in 0..n {
            out[j] += a0 * f16_to_f32(w0[j])
                + a1 * f16_to_f32(w1[j])
                + a2 * f16_to_f32(w2[j])
                + a3 * f16_to_f32(w3[j]);
        }
        k += 4;
    }
    while k < rows {
        let a = x[k];
        for (o, &h) in out.iter_mut().zip(row(k)) {
            *o += a * f16_to_f32(h);
        }
        k += 1;
    }
}

/// `out[j] += sum_k x[k] * w[k * stride + j]` (f32 weights): `out.len()` columns of the
/// `x.len()` rows of a matrix whose rows are `stride` apart; four rows per pass over `out`.
pub fn axpy_rows(x: &[f32], w: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    let rows = x.len();
    let row = |k: usize| &w[k * stride..k * stride + n];
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
}
