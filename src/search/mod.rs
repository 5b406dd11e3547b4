//! Choosing tokens from processed scores: greedy here; sampling and beam search in their own
//! modules; softmax and log-probs.

pub mod distribution;
pub mod sampling;

pub mod beam;

/// Index of the largest score (the first one on ties, as `torch.argmax`): a score replaces
/// the best so far only when larger, so a NaN never wins unless it is the first score.
pub fn argmax(scores: &[f32]) -> u32 {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if let Some(best) = simd::argmax(scores) {
        return best;
    }
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// [`argmax`] in two vector passes (greedy decoding's vocabulary is tens of thousands of
/// scores a step): the largest score that is not NaN, then the first index equal to it, which
/// is the scalar loop's answer when the first score is not NaN (`==` also takes -0 and +0 as
/// equal, as `>` does). `None` where the scalar loop decides (a NaN first, a short row).
/// NaNs become `-inf` before the maximum: no max instruction's NaN rule is relied on (the
/// relaxed build's code in Node 20 with `--experimental-wasm-relaxed-simd` let a NaN replace
/// a lane's maximum under `f32x4.pmax`).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::*;

    pub fn argmax(scores: &[f32]) -> Option<u32> {
        let chunks = scores.len() / 16;
        if chunks == 0 || scores[0].is_nan() {
            return None;
        }
        let p = scores.as_ptr() as *const v128;
        let low = f32x4_splat(f32::NEG_INFINITY);
        let mut m = [low; 4];
        for c in 0..chunks {
            for (l, m) in m.iter_mut().enumerate() {
                // SAFETY: values 16c + 4l..16c + 4l + 4 lie within the chunks; v128_load
                // accepts unaligned addresses.
                let v = unsafe { v128_load(p.add(4 * c + l)) };
                let v = v128_bitselect(v, low, f32x4_eq(v, v));
                *m = f32x4_pmax(*m, v);
            }
        }
        let m = f32x4_pmax(f32x4_pmax(m[0], m[1]), f32x4_pmax(m[2], m[3]));
        let lanes = [
            f32x4_extract_lane::<0>(m),
            f32x4_extract_lane::<1>(m),
            f32x4_extract_lane::<2>(m),
            f32x4_extract_lane::<3>(m),
        ];
        let max = lanes
            .into_iter()
            .chain(scores[16 * chunks..].iter().copied())
            .fold(f32::NEG_INFINITY, |m, s| if s > m { s } else { m });
        let target = f32x4_splat(max);
        for c in 0..chunks {
            // SAFETY: as above.
            let hit = unsafe {
                v128_or(
                    v128_or(
                        f32x4_eq(v128_load(p.add(4 * c)), target),
                        f32x4_eq(v128_load(p.add(4 * c + 1)), target),
                    ),
                    v128_or(
                        f32x4_eq(v128_load(p.add(4 * c + 2)), target),
                        f32x4_eq(v128_load(p.add(4 * c + 3)), target),
                    ),
                )
            };
            if v128_any_true(hit) {
                let at = scores[16 * c..16 * c + 16].iter().position(|&s| s == max)?;
                return Some((16 * c + at) as u32);
            }
        }
        let at = scores[16 * chunks..].iter().position(|&s| s == max)?;
        Some((16 * chunks + at) as u32)
    }
}

/// `log(sum(exp(scores)))`, stable; `-inf` when every score is `-inf`.
pub fn log_sum_exp(scores: &[f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f32 = scores.iter().map(|&s| (s - max).exp()).sum();
    max + sum.ln()
}

/// `log_softmax(scores)[index]`.
pub fn log_softmax_at(scores: &[f32], index: usize) -> f32 {
    scores[index] - log_sum_exp(scores)
}

/// `softmax(scores)` in float32 as torch computes it: `exp(x - max) / sum`. All `-inf`
/// scores give all zeros.
pub fn softmax_into(scores: &[f32], out: &mut Vec<f32>) {
    out.clear();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        out.resize(scores.len(), 0.0);
        return;
    }
    // `exp(-inf - max)` is 0: the scores that the warpers removed (most of a vocabulary
    // after `top_k`) skip the exponential.
    out.extend(scores.iter().map(|&s| match s {
        f32::NEG_INFINITY => 0.0,
        s => (s - max).exp(),
    }));
    let sum: f32 = out.iter().sum();
    out.iter_mut().for_each(|p| *p /= sum);
}

/// `log_softmax(scores)` in float32: `x - max - log(sum(exp(x - max)))`.
pub fn log_softmax_into(scores: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(scores);
    log_softmax_in_place(out);
}

/// `log_softmax` in place.
pub fn log_softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return;
    }
    let sum: f32 = scores.iter().map(|&s| (s - max).exp()).sum();
    let shift = max + sum.ln();
    scores.iter_mut().for_each(|s| *s -= shift);
}

/// The `n` largest `log_softmax(scores)` values with their token ids, most likely first (ties:
/// the smaller id first). Tokens with probability zero are left out.
pub fn top_logprobs(scores: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return vec![];
    }
    let lse = log_sum_exp(scores);
    let mut ids: Vec<u32> = (0..scores.len() as u32)
        .filter(|&i| scores[i as usize] > f32::NEG_INFINITY)
        .collect();
    let by_score = |a: &u32, b: &u32| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    if ids.len() > n {
        ids.select_nth_unstable_by(n - 1, by_score);
        ids.truncate(n);
    }
    ids.sort_by(by_score);
    ids.into_iter()
        .map(|i| (i, scores[i as usize] - lse))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn top_logprobs_are_sorted_and_skip_impossible_tokens() {
        let s = [0.0f32, 2.0, f32::NEG_INFINITY, 1.0];
        let t = top_logprobs(&s, 5);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 0]);
        assert!((t[0].1 - log_softmax_at(&s, 1)).abs() < 1e-6);
        assert_eq!(top_logprobs(&s, 1).len(), 1);
        let mut p = vec![];
        softmax_into(&s, &mut p);
        assert_eq!(p[2], 0.0);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let s = [0.5f32, -1.0, 2.0];
        let total: f32 = (0..3).map(|i| log_softmax_at(&s, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
