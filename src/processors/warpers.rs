//! The sampling warpers (only with `do_sample`): temperature, top_k, top_p, min_p, typical_p,
//! epsilon_cutoff, eta_cutoff; and `renormalize_logits` (log-softmax), which runs last.
//!
//! They follow the float32 arithmetic of transformers' warpers on the CPU: softmax in float32,
//! cumulative sums accumulated in double (as `torch.cumsum` does on the CPU) and compared in
//! float32, so that the kept set (the support) is the same.

use super::{LogitsProcessor, OnBounds, RowContext};
use crate::error::{invalid, Result};
use crate::search::{log_softmax_into, softmax_into};

/// The `k`-th largest score (k >= 1) in `total_cmp` order, `torch.topk(scores, k)[0][..., -1]`.
/// Of a large row it first selects the k-th largest of an even sample of `sqrt(k n)` scores,
/// which is at most the row's: only the scores that reach it can be the row's `k` largest (a
/// few thousand of SmolLM2's 49,152 for k = 50), and those are selected from.
pub(crate) fn kth_largest(scores: &[f32], k: usize, buf: &mut Vec<f32>) -> f32 {
    if scores.is_empty() {
        return f32::NEG_INFINITY;
    }
    let k = k.clamp(1, scores.len());
    let larger_first = |a: &f32, b: &f32| b.total_cmp(a);
    buf.clear();
    let sample = ((k as f64 * scores.len() as f64).sqrt() as usize).max(k);
    if sample * 4 <= scores.len() {
        // At least `sample` scores, so at least `k`.
        buf.extend(scores.iter().step_by(scores.len() / sample));
        let low = *buf.select_nth_unstable_by(k - 1, larger_first).1;
        buf.clear();
        buf.extend(scores.iter().filter(|s| s.total_cmp(&low).is_ge()));
    } else {
        buf.extend_from_slice(scores);
    }
    *buf.select_nth_unstable_by(k - 1, larger_first).1
}

/// The double a user typed for an option stored as `f32` (its shortest decimal form: 0.8f32
/// gives 0.8, not 0.800000011920929), for the places where transformers computes in Python
/// double.
pub(crate) fn as_typed(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// `(key, index)` packed into a `u64` whose integer order is the order of the float key, then
/// of the index: a plain integer sort or selection then does the work, several times faster than
/// sorting indices with a comparison closure, and ties resolve the same way every time.
fn pack(key: &[f32], packed: &mut Vec<u64>) {
    packed.clear();
    packed.extend(key.iter().enumerate().map(|(i, &k)| {
        let b = k.to_bits();
        let ordered = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
        ((ordered as u64) << 32) | i as u64
    }));
}

/// The token index of a packed entry.
fn index(p: u64) -> usize {
    (p & 0xFFFF_FFFF) as usize
}

/// Candidates first considered by the partial sorts of top_p and typical_p; the count grows
/// fourfold until the cut is decided (most steps need a few hundred tokens of a large vocabulary).
const FIRST_CANDIDATES: usize = 256;

/// transformers' `TemperatureLogitsWarper`: scores / temperature.
pub struct Temperature {
    t: f32,
}

impl Temperature {
    pub fn new(t: f32) -> Result<Self> {
        if t.is_nan() || t <= 0.0 {
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

    /// A division by a positive number, rounded to nearest, never lowers a larger score below a
    /// smaller one.
    fn on_bounds(&self, _: &RowContext) -> OnBounds {
        OnBounds::Monotone
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

    /// How many of the largest scores stay (more where scores tie with the last of them).
    pub fn k(&self) -> usize {
        self.k
    }
}

impl LogitsProcessor for TopK {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        let k = self.k.min(scores.len());
        top_k_cut(scores, kth_largest(scores, k, &mut self.buf));
        Ok(())
    }
}

/// `top_k`'s cut: the scores that it does not keep with the cut `kth` become `-inf`.
pub(crate) fn top_k_cut(scores: &mut [f32], kth: f32) {
    for s in scores.iter_mut() {
        if !top_k_keeps(*s, kth) {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// Whether `top_k` keeps `score` with the cut `kth`: transformers removes `score < kth`, so a
/// NaN stays.
pub(crate) fn top_k_keeps(score: f32, kth: f32) -> bool {
    score.partial_cmp(&kth) != Some(std::cmp::Ordering::Less)
}

/// transformers' `TopPLogitsWarper`: keep the smallest set of most likely tokens whose
/// probability reaches `top_p`: in ascending order, tokens whose cumulative probability is
/// `<= 1 - top_p` go, except the `min_tokens_to_keep` most likely.
pub struct TopP {
    threshold: f32,
    keep: usize,
    packed: Vec<u64>,
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
            packed: vec![],
            probs: vec![],
        })
    }
}

impl LogitsProcessor for TopP {
    fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
        // transformers sorts every score ascending and removes the tokens whose cumulative
        // probability is `<= 1 - top_p`: a prefix of that order. Only the `m` most likely tokens
        // are sorted here; the others are a prefix of the ascending order, removed when their
        // total already is `<= 1 - top_p` (else `m` grows).
        let n = scores.len();
        if n == 0 {
            return Ok(());
        }
        softmax_into(scores, &mut self.probs);
        pack(scores, &mut self.packed);
        let protected = n.saturating_sub(self.keep);
        let mut m = FIRST_CANDIDATES.max(self.keep).min(n);
        loop {
            if m < n {
                self.packed.select_nth_unstable(n - m);
            }
            let (rest, top) = self.packed.split_at_mut(n - m);
            let rest_mass: f64 = rest.iter().map(|&p| self.probs[index(p)] as f64).sum();
            if m < n && (rest_mass as f32) > self.threshold {
                m = (m * 4).min(n);
                continue;
            }
            top.sort_unstable();
            // Every partial sum within `rest` is at most `rest_mass`: all of them go.
            for &p in rest.iter() {
                scores[index(p)] = f32::NEG_INFINITY;
            }
            let mut cum = rest_mass;
            for (j, &p) in top.iter().enumerate() {
                let i = index(p);
                cum += self.probs[i] as f64;
                if n - m + j < protected && (cum as f32) <= self.threshold {
                    scores[i] = f32::NEG_INFINITY;
                }
            }
            return Ok(());
        }
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
    packed: Vec<u64>,
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
            packed: vec![],
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
        softmax_into(scores, &mut self.probs);
        pack(&self.shifted, &mut self.packed);
        // Sorted by `shifted` ascending, `last_ind = (cumulative_probs < mass).sum()` (clamped
        // to n - 1) is the first position whose cumulative probability reaches `mass`: only the
        // `m` most typical tokens are sorted, `m` growing until that position is among them.
        let mut m = FIRST_CANDIDATES.max(self.keep).min(n);
        let (limit, protect) = loop {
            if m < n {
                self.packed.select_nth_unstable(m);
            }
            let head = &mut self.packed[..m];
            head.sort_unstable();
            let mut cum = 0.0f64;
            let mut last = None;
            for (pos, &p) in head.iter().enumerate() {
                cum += self.probs[index(p)] as f64;
                if (cum as f32) >= self.mass {
                    last = Some(pos);
                    break;
                }
            }
            let last = match last {
                Some(pos) => pos,
                None if m == n => n - 1,
                None => {
                    m = (m * 4).min(n);
                    continue;
                }
            };
            let protect: Vec<usize> = head[..self.keep.min(m)].iter().map(|&p| index(p)).collect();
            break (self.shifted[index(head[last])], protect);
        };
        for (i, s) in scores.iter_mut().enumerate() {
            if self.shifted[i] > limit && !protect.contains(&i) {
                *s = f32::NEG_INFINITY;
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

    /// The k-th largest through a sample is the full sort's, on rows of every kind of value
    /// (ties, both zeros, infinities, NaN) and small and large `k`.
    #[test]
    fn kth_largest_is_the_sorted_rows() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state >> 40
        };
        let mut buf = vec![];
        for n in [1, 7, 100, 5000, 49_152] {
            for kind in 0..4 {
                let row: Vec<f32> = (0..n)
                    .map(|_| {
                        let v = next();
                        match (kind, v % 97) {
                            (1, 0) => NINF,
                            (1, 1) => f32::INFINITY,
                            (2, 0..=2) => -0.0,
                            (2, 3..=5) => 0.0,
                            (3, 0) => f32::NAN,
                            // Quarter steps (many ties), or spread values.
                            (0 | 1, _) => (v % 64) as f32 / 4.0 - 8.0,
                            _ => v as f32 / 1e5 - 80.0,
                        }
                    })
                    .collect();
                let mut sorted = row.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                for k in [1, 2, 50, 700, 3_125, n - 1, n, n + 3] {
                    let want = sorted[k.clamp(1, n) - 1];
                    let got = kth_largest(&row, k, &mut buf);
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n}, kind {kind}, k {k}");
                }
            }
        }
    }

    #[test]
    fn packed_sort_orders_floats_then_indices() {
        let key = [1.0, -0.0, NINF, 0.0, -2.5, f32::INFINITY, 1.0];
        let mut packed = vec![];
        pack(&key, &mut packed);
        packed.sort_unstable();
        let order: Vec<usize> = packed.iter().map(|&p| index(p)).collect();
        assert_eq!(order, vec![2, 4, 1, 3, 0, 6, 5]);
    }

    /// The partial sorts of top_p and typical_p against a plain full sort, on a vocabulary
    /// larger than the first candidate set, for cuts that need one, two and more rounds.
    #[test]
    fn partial_sorts_equal_full_sorts() {
        let n = 5000;
        let mut x: u64 = 7;
        let scores: Vec<f32> = (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
            })
            .collect();
        let mut probs = vec![];
        softmax_into(&scores, &mut probs);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
        for top_p in [0.05f32, 0.5, 0.9, 0.99, 0.999, 1.0] {
            let threshold = (1.0 - as_typed(top_p)) as f32;
            let mut want = scores.clone();
            let mut cum = 0.0f64;
            for (pos, &i) in order.iter().enumerate() {
                cum += probs[i] as f64;
                if pos < n - 1 && (cum as f32) <= threshold {
                    want[i] = NINF;
                }
            }
            let got = run(&mut TopP::new(top_p, 1).unwrap(), &scores);
            assert_eq!(kept(&got), kept(&want), "top_p {top_p}");
        }
        for mass in [0.01f32, 0.3, 0.9, 0.999] {
            let mut normalized = vec![];
            log_softmax_into(&scores, &mut normalized);
            let ent = -normalized.iter().map(|&l| l * l.exp()).sum::<f32>();
            let shifted: Vec<f32> = normalized.iter().map(|&l| (-l - ent).abs()).collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]).then(a.cmp(&b)));
            let mut cum = 0.0f64;
            let mut below = 0;
            for &i in &order {
                cum += probs[i] as f64;
                if (cum as f32) < mass {
                    below += 1;
                }
            }
            let limit = shifted[order[below.min(n - 1)]];
            let want: Vec<usize> = (0..n)
                .filter(|&i| shifted[i] <= limit || i == order[0])
                .collect();
            let got = run(&mut Typical::new(mass, 1).unwrap(), &scores);
            assert_eq!(kept(&got), want, "typical_p {mass}");
        }
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
