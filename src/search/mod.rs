//! Choosing tokens from processed scores: greedy here; sampling and beam search in their own
//! modules; softmax and log-probs.

pub mod distribution;
pub mod sampling;

pub mod beam;

/// Index of the largest score (the first one on ties, as `torch.argmax`).
pub fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
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
    out.extend(scores.iter().map(|&s| (s - max).exp()));
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
