//! `min_length` and `min_new_tokens`: eos tokens are banned until the row is long enough.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::Result;

fn ban_eos(scores: &mut [f32], eos: &[u32]) {
    for &e in eos {
        if let Some(s) = scores.get_mut(e as usize) {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// Where a row's `min_length` comes from.
#[derive(Debug, Clone, Copy)]
pub enum MinLengthFrom {
    /// `min_length` as configured (it counts the prompt).
    Fixed(usize),
    /// `min_new_tokens` set: `_prepare_generated_length` makes `min_length` the input length
    /// plus `min_new_tokens`.
    PromptPlus(usize),
}

/// transformers' `MinLengthLogitsProcessor`: eos is banned while `cur_len < min_length`.
pub struct MinLength {
    from: MinLengthFrom,
    eos: Vec<u32>,
}

impl MinLength {
    pub fn new(from: MinLengthFrom, eos: Vec<u32>) -> Self {
        MinLength { from, eos }
    }
}

impl LogitsProcessor for MinLength {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let min_length = match self.from {
            MinLengthFrom::Fixed(n) => n,
            MinLengthFrom::PromptPlus(n) => ctx.prompt_len + n,
        };
        if ctx.cur_len() < min_length {
            ban_eos(scores, &self.eos);
        }
        Ok(())
    }

    // Sets scores to -inf.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `MinNewTokensLengthLogitsProcessor`: eos is banned while fewer than
/// `min_new_tokens` tokens follow the prompt.
pub struct MinNewTokens {
    min_new_tokens: usize,
    eos: Vec<u32>,
}

impl MinNewTokens {
    pub fn new(min_new_tokens: usize, eos: Vec<u32>) -> Self {
        MinNewTokens {
            min_new_tokens,
            eos,
        }
    }
}

impl LogitsProcessor for MinNewTokens {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        if ctx.new_tokens() < self.min_new_tokens {
            ban_eos(scores, &self.eos);
        }
        Ok(())
    }

    // Sets scores to -inf.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
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
    fn min_length_counts_the_prompt() {
        let mut p = MinLength::new(MinLengthFrom::Fixed(3), vec![1]);
        let mut s = vec![0.0; 2];
        p.process(&ctx(&[0, 0, 0], 3), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0]);
        p.process(&ctx(&[0, 0], 1), &mut s).unwrap();
        assert_eq!(s, vec![0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn min_new_tokens_counts_new_tokens() {
        let mut p = MinNewTokens::new(2, vec![0]);
        let mut s = vec![0.0; 2];
        p.process(&ctx(&[5, 5, 5, 5], 2), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0]);
        p.process(&ctx(&[5, 5, 5], 2), &mut s).unwrap();
        assert_eq!(s, vec![f32::NEG_INFINITY, 0.0]);
        let mut p = MinLength::new(MinLengthFrom::PromptPlus(2), vec![1]);
        let mut s = vec![0.0; 2];
        p.process(&ctx(&[5, 5, 5], 2), &mut s).unwrap();
        assert_eq!(s, vec![0.0, f32::NEG_INFINITY]);
    }
}
