//! Penalties on tokens already seen: `repetition_penalty`, `encoder_repetition_penalty`, and
//! the length penalty on eos tokens `exponential_decay_length_penalty`.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::{invalid, Result};

/// Divide positive scores, multiply negative scores by `penalty` at every token id of `ids`.
/// As transformers' gather-then-scatter, every occurrence reads the original score, so a token
/// that occurs several times is penalised once. `buf` is reused between steps.
fn penalize(scores: &mut [f32], ids: &[u32], penalty: f32, buf: &mut Vec<f32>) {
    buf.clear();
    buf.extend(ids.iter().map(|&t| {
        let s = scores.get(t as usize).copied().unwrap_or(0.0);
        if s < 0.0 {
            s * penalty
        } else {
            s / penalty
        }
    }));
    for (&t, &v) in ids.iter().zip(buf.iter()) {
        if let Some(s) = scores.get_mut(t as usize) {
            *s = v;
        }
    }
}

/// transformers' `RepetitionPenaltyLogitsProcessor`: every token of the sequence (prompt
/// included) has its score divided by `penalty` when positive, multiplied when negative.
pub struct RepetitionPenalty {
    penalty: f32,
    buf: Vec<f32>,
}

impl RepetitionPenalty {
    pub fn new(penalty: f32) -> Result<Self> {
        if penalty.is_nan() || penalty <= 0.0 {
            return invalid!(
                "`repetition_penalty` must be a strictly positive number, got {penalty}"
            );
        }
        Ok(RepetitionPenalty {
            penalty,
            buf: vec![],
        })
    }
}

impl LogitsProcessor for RepetitionPenalty {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        penalize(scores, ctx.ids, self.penalty, &mut self.buf);
        Ok(())
    }

    // `s * penalty` below zero, `s / penalty` above, with `penalty > 0`: non-decreasing.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `EncoderRepetitionPenaltyLogitsProcessor`: the tokens of the encoder input are
/// favoured (the inverse penalty). Without encoder ids (a decoder-only model) it reads the
/// prompt, as transformers passes `inputs_tensor`. (With several rows per prompt, transformers'
/// gather only reaches the first rows; here every row reads its prompt's encoder input.)
pub struct EncoderRepetitionPenalty {
    inverse: f32,
    encoder_ids: Option<Vec<Vec<u32>>>,
    per_prompt: usize,
    buf: Vec<f32>,
}

impl EncoderRepetitionPenalty {
    /// `encoder_ids[p]`: the encoder input of prompt `p`, read by rows
    /// `p * per_prompt .. (p + 1) * per_prompt`.
    pub fn new(
        penalty: f32,
        encoder_ids: Option<Vec<Vec<u32>>>,
        per_prompt: usize,
    ) -> Result<Self> {
        if penalty.is_nan() || penalty <= 0.0 {
            return invalid!(
                "`encoder_repetition_penalty` must be a strictly positive number, got {penalty}"
            );
        }
        Ok(EncoderRepetitionPenalty {
            inverse: 1.0 / penalty,
            encoder_ids,
            per_prompt: per_prompt.max(1),
            buf: vec![],
        })
    }
}

impl LogitsProcessor for EncoderRepetitionPenalty {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let ids = match &self.encoder_ids {
            Some(all) => match all.get(ctx.row / self.per_prompt) {
                Some(ids) => ids.as_slice(),
                None => return invalid!("no encoder input ids for row {}", ctx.row),
            },
            None => ctx.prompt(),
        };
        penalize(scores, ids, self.inverse, &mut self.buf);
        Ok(())
    }

    // `s * penalty` below zero, `s / penalty` above, with `penalty > 0`: non-decreasing.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `ExponentialDecayLengthPenalty`: after `start` new tokens, the eos scores grow
/// by `|score| * (factor ^ (cur_len - regulation_start) - 1)`.
pub struct ExponentialDecayLengthPenalty {
    start: usize,
    factor: f32,
    eos: Vec<u32>,
}

impl ExponentialDecayLengthPenalty {
    pub fn new(start: usize, factor: f32, eos: Vec<u32>) -> Self {
        ExponentialDecayLengthPenalty { start, factor, eos }
    }
}

impl LogitsProcessor for ExponentialDecayLengthPenalty {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let regulation_start = self.start + ctx.prompt_len;
        let cur_len = ctx.cur_len();
        if cur_len > regulation_start {
            let idx = (cur_len - regulation_start) as i32;
            // Python's `pow(factor, idx) - 1` in double, then a float32 multiply.
            let grow = (super::warpers::as_typed(self.factor).powi(idx) - 1.0) as f32;
            for &e in &self.eos {
                if let Some(s) = scores.get_mut(e as usize) {
                    *s += s.abs() * grow;
                }
            }
        }
        Ok(())
    }

    // `s + |s| grow` is not monotone for `grow > 1`: the eos logits must be exact (they are
    // the only scores it changes).
    fn on_bounds(&self, ctx: &RowContext) -> OnBounds {
        if ctx.cur_len() > self.start + ctx.prompt_len {
            OnBounds::ExactAt(self.eos.clone())
        } else {
            OnBounds::Monotone
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(ids: &[u32], prompt_len: usize) -> RowContext<'_> {
        RowContext {
            row: 0,
            ids,
            prompt_len,
            max_length: 100,
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_once() {
        let mut p = RepetitionPenalty::new(2.0).unwrap();
        let mut s = vec![4.0, -4.0, 4.0];
        p.process(&ctx(&[0, 1, 0, 0], 2), &mut s).unwrap();
        assert_eq!(s, vec![2.0, -8.0, 4.0]);
        assert!(RepetitionPenalty::new(0.0).is_err());
    }

    #[test]
    fn encoder_repetition_penalty_favours_encoder_tokens() {
        let mut p = EncoderRepetitionPenalty::new(2.0, Some(vec![vec![5], vec![2]]), 2).unwrap();
        let mut s = vec![4.0, 4.0, -4.0];
        let c = RowContext {
            row: 3,
            ..ctx(&[0, 1], 1)
        };
        p.process(&c, &mut s).unwrap();
        assert_eq!(s, vec![4.0, 4.0, -2.0]);
        // Decoder-only: the prompt.
        let mut p = EncoderRepetitionPenalty::new(2.0, None, 1).unwrap();
        let mut s = vec![4.0, 4.0, -4.0];
        p.process(&ctx(&[0, 1], 1), &mut s).unwrap();
        assert_eq!(s, vec![8.0, 4.0, -4.0]);
        // A row without encoder ids is an error, not a panic.
        let mut p = EncoderRepetitionPenalty::new(2.0, Some(vec![]), 1).unwrap();
        assert!(p.process(&ctx(&[0], 1), &mut s).is_err());
    }

    #[test]
    fn exponential_decay_starts_after_start_new_tokens() {
        let mut p = ExponentialDecayLengthPenalty::new(1, 2.0, vec![1]);
        let mut s = vec![1.0, -3.0];
        p.process(&ctx(&[7, 7, 7], 2), &mut s).unwrap();
        assert_eq!(s, vec![1.0, -3.0]);
        p.process(&ctx(&[7, 7, 7, 7, 7], 2), &mut s).unwrap();
        // idx 2: |-3| * (4 - 1) = 9.
        assert_eq!(s, vec![1.0, 6.0]);
    }
}
