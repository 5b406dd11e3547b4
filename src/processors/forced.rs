//! `forced_bos_token_id` and `forced_eos_token_id`.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::Result;

fn force(scores: &mut [f32], ids: &[u32]) {
    scores.fill(f32::NEG_INFINITY);
    for &t in ids {
        if let Some(s) = scores.get_mut(t as usize) {
            *s = 0.0;
        }
    }
}

/// transformers' `ForcedBOSTokenLogitsProcessor`: when the sequence has one token, the next is
/// the BOS token (every other score `-inf`, its score 0).
pub struct ForcedBos {
    bos: u32,
}

impl ForcedBos {
    pub fn new(bos: u32) -> Self {
        ForcedBos { bos }
    }
}

impl LogitsProcessor for ForcedBos {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        if ctx.cur_len() == 1 {
            force(scores, &[self.bos]);
        }
        Ok(())
    }

    // Sets every score to a constant.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `ForcedEOSTokenLogitsProcessor`: at `max_length - 1` the next token is an eos
/// token (the row's `max_length`: its prompt length plus its new-token budget).
pub struct ForcedEos {
    eos: Vec<u32>,
}

impl ForcedEos {
    pub fn new(eos: Vec<u32>) -> Self {
        ForcedEos { eos }
    }
}

impl LogitsProcessor for ForcedEos {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        if ctx.cur_len() + 1 == ctx.max_length {
            force(scores, &self.eos);
        }
        Ok(())
    }

    // Sets every score to a constant.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bos_is_forced_at_length_one_only() {
        let mut p = ForcedBos::new(2);
        let mut s = vec![1.0; 3];
        let c = RowContext {
            row: 0,
            ids: &[0, 1],
            prompt_len: 1,
            max_length: 9,
        };
        p.process(&c, &mut s).unwrap();
        assert_eq!(s, vec![1.0; 3]);
        p.process(&RowContext { ids: &[0], ..c }, &mut s).unwrap();
        assert_eq!(s, vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0]);
    }

    #[test]
    fn eos_is_forced_at_max_length_minus_one() {
        let mut p = ForcedEos::new(vec![0, 1]);
        let mut s = vec![1.0; 3];
        let c = RowContext {
            row: 0,
            ids: &[5, 5],
            prompt_len: 1,
            max_length: 4,
        };
        p.process(&c, &mut s).unwrap();
        assert_eq!(s, vec![1.0; 3]);
        p.process(
            &RowContext {
                ids: &[5, 5, 5],
                ..c
            },
            &mut s,
        )
        .unwrap();
        assert_eq!(s, vec![0.0, 0.0, f32::NEG_INFINITY]);
    }
}
