//! The sampling warpers (only with `do_sample`): temperature, top_k, top_p, min_p, typical_p,
//! epsilon_cutoff, eta_cutoff; and `renormalize_logits` (log-softmax), which runs last.
//!
//! They follow the float32 arithmetic of transformers' warpers on the CPU: softmax in float32,
//! cumulative sums accumulated in double (as `torch.cumsum` does on the CPU) and compared in
//! float32, so that the kept set (the support) is the same.

use super::{LogitsProcessor, RowContext};
use crate::error::{invalid, Result};
use crate::search::{log_softmax_into, softmax_into};

/// The `k`-th largest score (k >= 1), `torch.topk(scores, k)[0][..., -1]`.
fn kth_largest(scores: &[f32], k: usize, buf: &mut Vec<f32>) -> f32 {
    buf.clear();
    buf.extend_from_slice(scores);
    let k = k.clamp(1, buf.len().max(1));
    if buf.is_empty() {
        return f32::NEG_INFINITY;
    }
    let (_, kth, _) = buf.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    *kth
}

/// The double a user typed for an option stored as `f32` (its shortest decimal form: 0.8f32
/// gives 0.8, not 0.800000011920929), for the places where transformers computes in Python
/// double.
pub(crate) fn as_typed(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// Indices of `scores` sorted by `key` ascending (ties by index).
fn sorted_indices(key: &[f32], order: &mut Vec<u32>) {
    order.clear();
    order.extend(0..key.len() as u32);
    order.sort_by(|&a, &b| key[a as usize].total_cmp(&key[b as usize]).then(a.cmp(&b)));
}

/// transformers' `TemperatureLogitsWarper`: scores / temperature.
pub struct Temperature {
    t: f32,
}

impl Temperature {
    pub fn new(t: f32) -> Result<Self> {
        if !(t > 0.0) {
            return invalid!("`temperature` must be strictly positive when sampling, got {t}");
        }
        Ok(Temperature { t })
    }
}

impl LogitsProcessor for Temperature {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        scores.iter_mut().for_each(|s| *s /= self.t);
        Ok(())
    }
}

/// transformers' `TopKLogitsWarper`: scores below the k-th largest become `-inf` (ties with it
/// are kept).
pub struct TopK {
    k: usize,
    buf: Vec<f32>,
}

impl TopK {
    pub fn new(top_k: usize, min_tokens_to_keep: usize) -> Self {
        TopK {
            k: top_k.max(min_tokens_to_keep),
            buf: vec![],
        }
    }
}

impl LogitsProcessor for TopK {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        let k = self.k.min(scores.len());
        let threshold = kth_largest(scores, k, &mut self.buf);
        for s in scores.iter_mut() {
            if *s < threshold {
                *s = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `TopPLogitsWarper`: keep the smallest set of most likely tokens whose
/// probability reaches `top_p`: in ascending order, tokens whose cumulative probability is
/// `<= 1 - top_p` go, except the `min_tokens_to_keep` most likely.
pub struct TopP {
    threshold: f32,
    keep: usize,
    order: Vec<u32>,
    probs: Vec<f32>,
}

impl TopP {
    pub fn new(top_p: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(top_p > 0.0 && top_p <= 1.0) {
            return invalid!("`top_p` must be in (0, 1], got {top_p}");
        }
        Ok(TopP {
            // `1 - self.top_p` in Python double, compared with a float32 tensor.
            threshold: (1.0 - as_typed(top_p)) as f32,
            keep: min_tokens_to_keep.max(1),
            order: vec![],
            probs: vec![],
        })
    }
}

impl LogitsProcessor for TopP {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        sorted_indices(scores, &mut self.order);
        softmax_into(scores, &mut self.probs);
        let n = self.order.len();
        let protected = n.saturating_sub(self.keep);
        let mut cum = 0.0f64;
        for (pos, &i) in self.order.iter().enumerate() {
            cum += self.probs[i as usize] as f64;
            if pos < protected && (cum as f32) <= self.threshold {
                scores[i as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `MinPLogitsWarper`: tokens less likely than `min_p` times the most likely one
/// go (the `min_tokens_to_keep` most likely stay).
pub struct MinP {
    min_p: f32,
    keep: usize,
    probs: Vec<f32>,
    buf: Vec<f32>,
}

impl MinP {
    pub fn new(min_p: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&min_p) {
            return invalid!("`min_p` must be in [0, 1], got {min_p}");
        }
        Ok(MinP {
            min_p,
            keep: min_tokens_to_keep.max(1),
            probs: vec![],
            buf: vec![],
        })
    }
}

impl LogitsProcessor for MinP {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        softmax_into(scores, &mut self.probs);
        let top = self.probs.iter().copied().fold(0.0f32, f32::max);
        let cut = self.min_p * top;
        // The `keep` most likely tokens stay: those at or above the keep-th largest score.
        let protect = kth_largest(scores, self.keep, &mut self.buf);
        for (s, &p) in scores.iter_mut().zip(&self.probs) {
            if p < cut && *s < protect {
                *s = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `TypicalLogitsWarper` (locally typical sampling): tokens sorted by how far
/// their information is from the entropy; keep the closest whose probability reaches `mass`.
pub struct Typical {
    mass: f32,
    keep: usize,
    normalized: Vec<f32>,
    shifted: Vec<f32>,
    order: Vec<u32>,
    probs: Vec<f32>,
}

impl Typical {
    pub fn new(mass: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(mass > 0.0 && mass < 1.0) {
            return invalid!("`typical_p` must be in (0, 1) to take effect, got {mass}");
        }
        Ok(Typical {
            mass,
            keep: min_tokens_to_keep.max(1),
            normalized: vec![],
            shifted: vec![],
            order: vec![],
            probs: vec![],
        })
    }
}

impl LogitsProcessor for Typical {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        let n = scores.len();
        if n == 0 {
            return Ok(());
        }
        log_softmax_into(scores, &mut self.normalized);
        // ent = -(normalized * p).nansum()
        let mut ent = 0.0f32;
        for &l in &self.normalized {
            let v = l * l.exp();
            if !v.is_nan() {
                ent += v;
            }
        }
        let ent = -ent;
        self.shifted.clear();
        self.shifted
            .extend(self.normalized.iter().map(|&l| (-l - ent).abs()));
        sorted_indices(&self.shifted, &mut self.order);
        softmax_into(scores, &mut self.probs);
        // last_ind = (cumulative_probs < mass).sum(), clamped to n - 1.
        let mut cum = 0.0f64;
        let mut below = 0usize;
        for &i in &self.order {
            cum += self.probs[i as usize] as f64;
            if (cum as f32) < self.mass {
                below += 1;
            }
        }
        let last = below.min(n - 1);
        let limit = self.shifted[self.order[last] as usize];
        for (pos, &i) in self.order.iter().enumerate() {
            if pos >= self.keep && self.shifted[i as usize] > limit {
                scores[i as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `EpsilonLogitsWarper`: tokens with probability below `epsilon` go (the
/// `min_tokens_to_keep` most likely stay).
pub struct Epsilon {
    epsilon: f32,
    keep: usize,
    probs: Vec<f32>,
    buf: Vec<f32>,
}

impl Epsilon {
    pub fn new(epsilon: f32, min_tokens_to_keep: usize) -> Self {
        Epsilon {
            epsilon,
            keep: min_tokens_to_keep.max(1),
            probs: vec![],
            buf: vec![],
        }
    }
}

impl LogitsProcessor for Epsilon {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        softmax_into(scores, &mut self.probs);
        let protect = kth_largest(scores, self.keep, &mut self.buf);
        for (s, &p) in scores.iter_mut().zip(&self.probs) {
            if p < self.epsilon && *s < protect {
                *s = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `EtaLogitsWarper`: tokens with probability below
/// `min(eta, sqrt(eta) * exp(-entropy))` go (the `min_tokens_to_keep` most likely stay).
pub struct Eta {
    epsilon: f32,
    keep: usize,
    probs: Vec<f32>,
    normalized: Vec<f32>,
    buf: Vec<f32>,
}

impl Eta {
    pub fn new(epsilon: f32, min_tokens_to_keep: usize) -> Self {
        Eta {
            epsilon,
            keep: min_tokens_to_keep.max(1),
            probs: vec![],
            normalized: vec![],
            buf: vec![],
        }
    }
}

impl LogitsProcessor for Eta {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        softmax_into(scores, &mut self.probs);
        // `Categorical(logits=scores).entropy()`: -(clamp(log p, min=f32::MIN) * p).sum()
        log_softmax_into(scores, &mut self.normalized);
        let mut plogp = 0.0f32;
        for (&l, &p) in self.normalized.iter().zip(&self.probs) {
            plogp += l.max(f32::MIN) * p;
        }
        let entropy = -plogp;
        let eta = self.epsilon.min(self.epsilon.sqrt() * (-entropy).exp());
        let protect = kth_largest(scores, self.keep, &mut self.buf);
        for (s, &p) in scores.iter_mut().zip(&self.probs) {
            if p < eta && *s < protect {
                *s = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// transformers' `LogitNormalization` (`renormalize_logits`): log-softmax of the scores.
pub struct LogNormalize;

impl LogitsProcessor for LogNormalize {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        crate::search::log_softmax_in_place(scores);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NINF: f32 = f32::NEG_INFINITY;

    fn run(p: &mut dyn LogitsProcessor, scores: &[f32]) -> Vec<f32> {
        let mut s = scores.to_vec();
        let c = RowContext {
            row: 0,
            ids: &[0],
            prompt_len: 1,
            max_length: 9,
        };
        p.process(&c, &mut s).unwrap();
        s
    }

    fn kept(s: &[f32]) -> Vec<usize> {
        (0..s.len()).filter(|&i| s[i] > NINF).collect()
    }

    fn logs(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    #[test]
    fn top_k_keeps_ties() {
        let s = run(&mut TopK::new(2, 1), &[1.0, 3.0, 2.0, 2.0, 0.0]);
        assert_eq!(kept(&s), vec![1, 2, 3]);
        let s = run(&mut TopK::new(10, 1), &[1.0, 3.0]);
        assert_eq!(kept(&s), vec![0, 1]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let s = logs(&[0.5, 0.3, 0.15, 0.05]);
        assert_eq!(kept(&run(&mut TopP::new(0.8, 1).unwrap(), &s)), vec![0, 1]);
        assert_eq!(
            kept(&run(&mut TopP::new(0.81, 1).unwrap(), &s)),
            vec![0, 1, 2]
        );
        assert_eq!(kept(&run(&mut TopP::new(0.1, 1).unwrap(), &s)), vec![0]);
        assert_eq!(kept(&run(&mut TopP::new(0.1, 2).unwrap(), &s)), vec![0, 1]);
        assert!(TopP::new(0.0, 1).is_err());
    }

    #[test]
    fn min_p_scales_with_the_top_probability() {
        let s = logs(&[0.5, 0.3, 0.15, 0.05]);
        assert_eq!(kept(&run(&mut MinP::new(0.5, 1).unwrap(), &s)), vec![0, 1]);
    }

    #[test]
    fn epsilon_and_eta_cut_unlikely_tokens() {
        let s = logs(&[0.5, 0.3, 0.15, 0.05]);
        assert_eq!(kept(&run(&mut Epsilon::new(0.1, 1), &s)), vec![0, 1, 2]);
        // Entropy of this distribution is about 1.14: eta = min(0.2, 0.447 * 0.32) = 0.143.
        assert_eq!(kept(&run(&mut Eta::new(0.2, 1), &s)), vec![0, 1, 2]);
        // The most likely token always stays.
        assert_eq!(kept(&run(&mut Epsilon::new(0.9, 1), &s)), vec![0]);
    }

    #[test]
    fn typical_keeps_tokens_near_the_entropy() {
        // Uniform-ish: every token is typical; a very peaked token is not.
        let s = logs(&[0.25, 0.25, 0.25, 0.25]);
        assert_eq!(kept(&run(&mut Typical::new(0.5, 1).unwrap(), &s)).len(), 4);
        let s = logs(&[0.9, 0.04, 0.03, 0.03]);
        let k = kept(&run(&mut Typical::new(0.2, 1).unwrap(), &s));
        assert!(!k.is_empty());
    }

    #[test]
    fn temperature_divides_and_renormalize_gives_log_probs() {
        let s = run(&mut Temperature::new(2.0).unwrap(), &[2.0, 4.0]);
        assert_eq!(s, vec![1.0, 2.0]);
        let s = run(&mut LogNormalize, &[0.0, 0.0]);
        assert!((s[0] - 0.5f32.ln()).abs() < 1e-6);
        assert!(Temperature::new(0.0).is_err());
    }
}
