//! Choosing tokens from processed scores: greedy here; sampling and beam search in their own
//! modules.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let s = [0.5f32, -1.0, 2.0];
        let total: f32 = (0..3).map(|i| log_softmax_at(&s, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
