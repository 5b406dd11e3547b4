//! `no_repeat_ngram_size` and `encoder_no_repeat_ngram_size`: ban the token that would repeat
//! an n-gram (of the sequence, or of the encoder input).

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::{invalid, Result};

/// The tokens that followed each earlier occurrence of `prefix` (of length `n - 1`) in `ids`:
/// transformers' `_get_ngrams` + `_get_generated_ngrams`.
fn followers(ids: &[u32], n: usize, prefix: &[u32], out: &mut Vec<u32>) {
    out.clear();
    if n == 0 || ids.len() < n {
        return;
    }
    for w in ids.windows(n) {
        if &w[..n - 1] == prefix {
            out.push(w[n - 1]);
        }
    }
}

fn ban(scores: &mut [f32], tokens: &[u32]) {
    for &t in tokens {
        if let Some(s) = scores.get_mut(t as usize) {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// transformers' `NoRepeatNGramLogitsProcessor`: no n-gram of the sequence (prompt included)
/// occurs twice.
pub struct NoRepeatNGram {
    n: usize,
    banned: Vec<u32>,
}

impl NoRepeatNGram {
    pub fn new(n: usize) -> Result<Self> {
        if n == 0 {
            return invalid!("`no_repeat_ngram_size` must be a strictly positive integer, got 0");
        }
        Ok(NoRepeatNGram { n, banned: vec![] })
    }
}

impl LogitsProcessor for NoRepeatNGram {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let cur_len = ctx.cur_len();
        // `_calc_banned_ngram_tokens`: nothing is banned before n - 1 tokens exist.
        if cur_len + 1 < self.n {
            return Ok(());
        }
        let prefix = &ctx.ids[cur_len + 1 - self.n..];
        followers(ctx.ids, self.n, prefix, &mut self.banned);
        ban(scores, &self.banned);
        Ok(())
    }

    // Sets scores to -inf.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
    }
}

/// transformers' `EncoderNoRepeatNGramLogitsProcessor`: the decoder may not repeat an n-gram of
/// the encoder input. Without encoder ids (decoder-only) it reads the prompt, as transformers
/// passes `inputs_tensor`.
pub struct EncoderNoRepeatNGram {
    n: usize,
    encoder_ids: Option<Vec<Vec<u32>>>,
    per_prompt: usize,
    banned: Vec<u32>,
}

impl EncoderNoRepeatNGram {
    /// `encoder_ids[p]`: the encoder input of prompt `p`, read by rows
    /// `p * per_prompt .. (p + 1) * per_prompt` (transformers: `hypo_idx // num_beams`).
    pub fn new(n: usize, encoder_ids: Option<Vec<Vec<u32>>>, per_prompt: usize) -> Result<Self> {
        if n == 0 {
            return invalid!(
                "`encoder_no_repeat_ngram_size` must be a strictly positive integer, got 0"
            );
        }
        Ok(EncoderNoRepeatNGram {
            n,
            encoder_ids,
            per_prompt: per_prompt.max(1),
            banned: vec![],
        })
    }
}

impl LogitsProcessor for EncoderNoRepeatNGram {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let encoder = match &self.encoder_ids {
            Some(all) => match all.get(ctx.row / self.per_prompt) {
                Some(ids) => ids.as_slice(),
                None => return invalid!("no encoder input ids for row {}", ctx.row),
            },
            None => ctx.prompt(),
        };
        let cur_len = ctx.cur_len();
        // `_get_generated_ngrams` slices `input_ids[cur_len + 1 - n : cur_len]`; with fewer
        // than n - 1 tokens the slice is shorter than any n-gram prefix and bans nothing.
        if cur_len + 1 < self.n {
            return Ok(());
        }
        let prefix = &ctx.ids[cur_len + 1 - self.n..];
        followers(encoder, self.n, prefix, &mut self.banned);
        ban(scores, &self.banned);
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

    fn ctx(ids: &[u32]) -> RowContext<'_> {
        RowContext {
            row: 0,
            ids,
            prompt_len: 1,
            max_length: 100,
        }
    }

    #[test]
    fn bans_the_token_that_repeats_a_bigram() {
        let mut p = NoRepeatNGram::new(2).unwrap();
        let mut s = vec![0.0; 5];
        p.process(&ctx(&[1, 2, 3, 1, 4, 1]), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn trigram_needs_two_tokens() {
        let mut p = NoRepeatNGram::new(3).unwrap();
        let mut s = vec![0.0; 3];
        p.process(&ctx(&[1]), &mut s).unwrap();
        assert!(s.iter().all(|&x| x == 0.0));
        p.process(&ctx(&[1, 2, 0, 1, 2]), &mut s).unwrap();
        assert_eq!(s, vec![f32::NEG_INFINITY, 0.0, 0.0]);
    }

    #[test]
    fn unigram_bans_every_seen_token() {
        let mut p = NoRepeatNGram::new(1).unwrap();
        let mut s = vec![0.0; 3];
        p.process(&ctx(&[2, 2]), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn encoder_ngrams_come_from_the_encoder_input() {
        let mut p = EncoderNoRepeatNGram::new(2, Some(vec![vec![1], vec![5, 6, 5, 7]]), 3).unwrap();
        let mut s = vec![0.0; 8];
        let c = RowContext {
            row: 4,
            ..ctx(&[0, 5])
        };
        p.process(&c, &mut s).unwrap();
        let banned: Vec<usize> = (0..8).filter(|&i| s[i] == f32::NEG_INFINITY).collect();
        assert_eq!(banned, vec![6, 7]);
        // Decoder-only: the prompt (here [3]) has no bigram.
        let mut p = EncoderNoRepeatNGram::new(2, None, 1).unwrap();
        let mut s = vec![0.0; 8];
        p.process(&ctx(&[3, 3]), &mut s).unwrap();
        assert!(s.iter().all(|&x| x == 0.0));
        assert!(EncoderNoRepeatNGram::new(0, None, 1).is_err());
    }
}
