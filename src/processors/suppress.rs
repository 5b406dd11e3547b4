//! `suppress_tokens` and `begin_suppress_tokens`.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::Result;

fn suppress(scores: &mut [f32], ids: &[u32]) {
    for &t in ids {
        if let Some(s) = scores.get_mut(t as usize) {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// transformers' `SuppressTokensLogitsProcessor`: these tokens are never generated. The mask
/// (the list of ids inside the vocabulary) is built once per request.
pub struct Suppress {
    ids: Vec<u32>,
}

impl Suppress {
    pub fn new(ids: &[u32], vocab: usize) -> Self {
        let mut ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        Suppress { ids }
    }
}

impl LogitsProcessor for Suppress {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        suppress(scores, &self.ids);
        Ok(())
    }

    // Sets scores to -inf.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `SuppressTokensAtBeginLogitsProcessor`: these tokens are not the first
/// generated token (the second when a forced BOS takes the first place of a one-token input).
pub struct BeginSuppress {
    ids: Vec<u32>,
    after_forced_bos: bool,
}

impl BeginSuppress {
    pub fn new(ids: &[u32], forced_bos: bool) -> Self {
        BeginSuppress {
            ids: ids.to_vec(),
            after_forced_bos: forced_bos,
        }
    }
}

impl LogitsProcessor for BeginSuppress {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        // `_get_logits_processor`: begin_index = input length, + 1 when the input has one token
        // and a BOS is forced.
        let mut begin = ctx.prompt_len;
        if ctx.prompt_len <= 1 && self.after_forced_bos {
            begin += 1;
        }
        if ctx.cur_len() == begin {
            suppress(scores, &self.ids);
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

    #[test]
    fn begin_suppress_acts_on_the_first_new_token() {
        let ninf = f32::NEG_INFINITY;
        let mut p = BeginSuppress::new(&[1], false);
        let c = RowContext {
            row: 0,
            ids: &[4, 4],
            prompt_len: 2,
            max_length: 9,
        };
        let mut s = vec![0.0; 2];
        p.process(&c, &mut s).unwrap();
        assert_eq!(s, vec![0.0, ninf]);
        let mut s = vec![0.0; 2];
        p.process(
            &RowContext {
                ids: &[4, 4, 4],
                ..c
            },
            &mut s,
        )
        .unwrap();
        assert_eq!(s, vec![0.0, 0.0]);
        // With a forced BOS after a one-token prompt: the second new token.
        let mut p = BeginSuppress::new(&[1], true);
        let c1 = RowContext {
            ids: &[4],
            prompt_len: 1,
            ..c
        };
        let mut s = vec![0.0; 2];
        p.process(&c1, &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0]);
        p.process(&RowContext { ids: &[4, 4], ..c1 }, &mut s)
            .unwrap();
        assert_eq!(s, vec![0.0, ninf]);
    }

    #[test]
    fn suppress_always() {
        let mut p = Suppress::new(&[0, 0, 7], 2);
        let mut s = vec![1.0; 2];
        let c = RowContext {
            row: 0,
            ids: &[1],
            prompt_len: 1,
            max_length: 3,
        };
        p.process(&c, &mut s).unwrap();
        assert_eq!(s, vec![f32::NEG_INFINITY, 1.0]);
    }
}
