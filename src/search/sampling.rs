//! Sampling from the processed distribution with one seeded generator per row.
//!
//! Seeds (`config.seed`): one seed `s` gives row `r` the seed `s + r`; a list gives one seed per
//! row. Each row draws from its own ChaCha20 stream, so a row's tokens depend only on its seed
//! and its distributions: the same seed gives the same tokens natively, in Node and in a
//! browser. Without a seed, each row's seed comes from the operating system (`getrandom`).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::{invalid, Error, Result};
use crate::search::softmax_into;

/// One generator per row.
pub struct Sampler {
    rngs: Vec<ChaCha20Rng>,
    /// The tokens whose score is not `-inf`, their scores and their probabilities.
    kept: Vec<u32>,
    scores: Vec<f32>,
    probs: Vec<f32>,
}

impl Sampler {
    /// Generators for `rows` rows from `seed` (see the module docs).
    pub fn new(seed: Option<&[u64]>, rows: usize) -> Result<Sampler> {
        let seeds: Vec<u64> = match seed {
            Some([s]) => (0..rows as u64).map(|r| s.wrapping_add(r)).collect(),
            Some(list) if list.len() == rows => list.to_vec(),
            Some(list) => {
                return invalid!(
                    "`seed` must be one seed or one per row ({rows}), got {} seeds",
                    list.len()
                )
            }
            None => (0..rows).map(|_| os_seed()).collect::<Result<_>>()?,
        };
        Ok(Sampler {
            rngs: seeds.into_iter().map(ChaCha20Rng::seed_from_u64).collect(),
            kept: vec![],
            scores: vec![],
            probs: vec![],
        })
    }

    /// Draw a token of row `row` from `softmax(scores)` (transformers:
    /// `torch.multinomial(softmax(next_token_scores), 1)`). Tokens of probability zero are never
    /// drawn.
    pub fn sample(&mut self, row: usize, scores: &[f32]) -> Result<u32> {
        let rng = self
            .rngs
            .get_mut(row)
            .ok_or_else(|| Error::InvalidInput(format!("no sampling generator for row {row}")))?;
        // A `-inf` score has probability 0: it adds nothing to the sums and is never drawn, so
        // the softmax and the draw over the other scores alone (a few dozen of a vocabulary
        // after `top_k`), in the same order, give the same sums and the same token.
        self.kept.clear();
        self.scores.clear();
        for (i, &s) in scores.iter().enumerate() {
            if s != f32::NEG_INFINITY {
                self.kept.push(i as u32);
                self.scores.push(s);
            }
        }
        softmax_into(&self.scores, &mut self.probs);
        let total: f64 = self.probs.iter().map(|&p| p as f64).sum();
        if total.is_nan() || total <= 0.0 {
            return invalid!(
                "every token of row {row} has probability zero after the processors: nothing \
                 can be sampled"
            );
        }
        let u: f64 = rng.random::<f64>() * total;
        let mut cum = 0.0f64;
        let mut last = 0;
        for (&i, &p) in self.kept.iter().zip(&self.probs) {
            if p > 0.0 {
                cum += p as f64;
                last = i;
                if u < cum {
                    return Ok(i);
                }
            }
        }
        // Rounding at the very end: the last token with a non-zero probability.
        Ok(last)
    }
}

fn os_seed() -> Result<u64> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)
        .map_err(|e| Error::Backend(format!("no random seed from the system: {e}")))?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_draws_and_rows_differ() {
        let scores: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = |seed: &[u64], row| {
            let mut s = Sampler::new(Some(seed), 2).unwrap();
            (0..30)
                .map(|_| s.sample(row, &scores).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&[7], 0), draw(&[7], 0));
        assert_ne!(draw(&[7], 0), draw(&[8], 0));
        // One seed: row 1 uses seed + 1.
        assert_eq!(draw(&[7], 1), draw(&[8], 0));
        assert_eq!(draw(&[3, 9], 1), draw(&[9], 0));
        assert!(Sampler::new(Some(&[1, 2, 3]), 2).is_err());
        assert!(Sampler::new(None, 2).is_ok());
    }

    /// The draw over the kept scores alone is the draw over the whole row: the softmax of the
    /// whole row (zeros where `-inf`) and its cumulative sums in f64, token by token, with the
    /// same generator.
    #[test]
    fn draws_over_kept_scores_are_the_whole_rows_draws() {
        let mut next = crate::model::ops::testing::uniform(0x9e37_79b9_7f4a_7c15);
        let ninf = f32::NEG_INFINITY;
        for case in 0..60 {
            let n = [7, 64, 1000][case % 3];
            // Mostly -inf (as after top_k), some scores whose exponential underflows to 0.
            let scores: Vec<f32> = (0..n)
                .map(|_| match next() {
                    u if u < 0.7 => ninf,
                    u if u < 0.75 => -200.0 + u,
                    u => 4.0 * u,
                })
                .collect();
            let seed = case as u64;
            let mut sampler = Sampler::new(Some(&[seed]), 1).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let mut probs = vec![];
            softmax_into(&scores, &mut probs);
            let total: f64 = probs.iter().map(|&p| p as f64).sum();
            for _ in 0..200 {
                let got = sampler.sample(0, &scores);
                if total.is_nan() || total <= 0.0 {
                    assert!(got.is_err(), "case {case}");
                    break;
                }
                let u: f64 = rng.random::<f64>() * total;
                let (mut cum, mut want) = (0.0f64, None);
                let mut last = 0;
                for (i, &p) in probs.iter().enumerate() {
                    if p > 0.0 {
                        cum += p as f64;
                        last = i as u32;
                        if want.is_none() && u < cum {
                            want = Some(i as u32);
                        }
                    }
                }
                assert_eq!(got.unwrap(), want.unwrap_or(last), "case {case}");
            }
        }
        // No score left, or a NaN among them: an error, as for the whole row.
        let mut sampler = Sampler::new(Some(&[1]), 1).unwrap();
        assert!(sampler.sample(0, &[ninf; 5]).is_err());
        assert!(sampler.sample(0, &[ninf, f32::NAN, 1.0]).is_err());
    }

    #[test]
    fn never_draws_impossible_tokens_and_follows_probabilities() {
        let mut s = Sampler::new(Some(&[1]), 1).unwrap();
        let ninf = f32::NEG_INFINITY;
        let scores = [ninf, 0.0, ninf, (3.0f32).ln()];
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[s.sample(0, &scores).unwrap() as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        let share = counts[3] as f64 / 4000.0;
        assert!((share - 0.75).abs() < 0.03, "{counts:?}");
        assert!(s.sample(0, &[ninf, ninf]).is_err());
    }
}
