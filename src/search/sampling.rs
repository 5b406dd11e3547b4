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
        softmax_into(scores, &mut self.probs);
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
        for (i, &p) in self.probs.iter().enumerate() {
            if p > 0.0 {
                cum += p as f64;
                last = i;
                if u < cum {
                    return Ok(i as u32);
                }
            }
        }
        // Rounding at the very end: the last token with a non-zero probability.
        Ok(last as u32)
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
