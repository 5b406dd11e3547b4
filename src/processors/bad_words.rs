//! `sequence_bias` and `bad_words_ids` (a bias of `-inf`): transformers'
//! `SequenceBiasLogitsProcessor` and `NoBadWordsLogitsProcessor`.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::{invalid, Result};

/// Adds a bias to the last token of each biased sequence whose other tokens end the row.
/// One-token sequences form a constant bias built once per request.
pub struct SequenceBias {
    /// `(token, bias)` of the one-token sequences (a later entry for a token replaces an
    /// earlier one, as the dict transformers builds).
    single: Vec<(u32, f32)>,
    /// Longer sequences: `(prefix, last token, bias)`.
    multi: Vec<(Vec<u32>, u32, f32)>,
}

impl SequenceBias {
    /// `sequence_bias`, validated: non-empty, token ids in the vocabulary.
    pub fn new(name: &str, bias: &[(Vec<u32>, f32)], vocab: usize) -> Result<Self> {
        if bias.is_empty() {
            return invalid!("`{name}` must not be empty");
        }
        // transformers turns the list into a dict: a repeated sequence keeps its first place
        // and takes the last bias.
        let mut entries: Vec<(Vec<u32>, f32)> = vec![];
        for (ids, b) in bias {
            if ids.is_empty() {
                return invalid!("`{name}` must not contain an empty token sequence");
            }
            let outside: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|&t| t as usize >= vocab)
                .collect();
            if !outside.is_empty() {
                return invalid!(
                    "`{name}` has token ids outside the vocabulary (0..{vocab}): {outside:?}"
                );
            }
            match entries.iter_mut().find(|(e, _)| e == ids) {
                Some(e) => e.1 = *b,
                None => entries.push((ids.clone(), *b)),
            }
        }
        let mut single = vec![];
        let mut multi = vec![];
        for (ids, b) in entries {
            match ids.split_last() {
                Some((&last, [])) => single.push((last, b)),
                Some((&last, prefix)) => multi.push((prefix.to_vec(), last, b)),
                None => {}
            }
        }
        Ok(SequenceBias { single, multi })
    }

    /// `bad_words_ids`: a bias of `-inf`; a bad word that is exactly one eos token is dropped.
    pub fn bad_words(bad: &[Vec<u32>], eos: &[u32], vocab: usize) -> Result<Self> {
        if bad.is_empty() {
            return invalid!("`bad_words_ids` must be a non-empty list of lists of token ids");
        }
        let kept: Vec<(Vec<u32>, f32)> = bad
            .iter()
            .filter(|w| !(w.len() == 1 && eos.contains(&w[0])))
            .map(|w| (w.clone(), f32::NEG_INFINITY))
            .collect();
        if kept.is_empty() {
            return Ok(SequenceBias {
                single: vec![],
                multi: vec![],
            });
        }
        Self::new("bad_words_ids", &kept, vocab)
    }
}

impl LogitsProcessor for SequenceBias {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        // transformers sums the biases into one tensor and adds it once; adding them one by one
        // gives the same floats for the usual case of one bias per token.
        for &(t, b) in &self.single {
            if let Some(s) = scores.get_mut(t as usize) {
                *s += b;
            }
        }
        for (prefix, last, b) in &self.multi {
            // A sequence longer than the context is ignored.
            if prefix.len() + 1 > ctx.ids.len() {
                continue;
            }
            if ctx.ids.ends_with(prefix) {
                if let Some(s) = scores.get_mut(*last as usize) {
                    *s += b;
                }
            }
        }
        Ok(())
    }

    // Adds a constant to a token's score, or sets it to -inf.
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
    fn one_token_bad_words_are_always_banned_and_eos_is_dropped() {
        let mut p = SequenceBias::bad_words(&[vec![1], vec![2]], &[2], 4).unwrap();
        let mut s = vec![0.0; 4];
        p.process(&ctx(&[0]), &mut s).unwrap();
        assert_eq!(s, vec![0.0, f32::NEG_INFINITY, 0.0, 0.0]);
    }

    #[test]
    fn multi_token_bad_words_need_their_prefix() {
        let mut p = SequenceBias::bad_words(&[vec![1, 2, 3]], &[], 4).unwrap();
        let mut s = vec![0.0; 4];
        p.process(&ctx(&[0, 1]), &mut s).unwrap();
        assert!(s.iter().all(|&x| x == 0.0));
        p.process(&ctx(&[0, 1, 2]), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 0.0, 0.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn sequence_bias_adds_and_validates() {
        let mut p = SequenceBias::new(
            "sequence_bias",
            &[(vec![1], 2.0), (vec![3, 1], -1.0), (vec![1], 3.0)],
            4,
        )
        .unwrap();
        let mut s = vec![0.0; 4];
        p.process(&ctx(&[3]), &mut s).unwrap();
        assert_eq!(s, vec![0.0, 3.0, 0.0, 0.0]);
        let m = SequenceBias::new("sequence_bias", &[(vec![9], 1.0)], 4)
            .err()
            .unwrap()
            .to_string();
        assert!(m.contains("sequence_bias") && m.contains("[9]"), "{m}");
    }
}
