//! Beam search of one prompt, step for step as transformers 4.57's vectorised `_beam_search`
//! (`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
//! `_update_finished_beams`, `_check_early_stop_heuristic`,
//! `_beam_search_has_unfinished_sequences`), for a batch of one: the beams of a prompt never
//! interact with those of another prompt, so each prompt runs its own `BeamSearch` and a batch
//! gives every prompt the result it gets alone.
//!
//! The arithmetic is f32 like torch's: the `-1e9` penalties are added to f32 scores exactly as
//! transformers adds them, so rankings (and their rare ties) come out the same. Removed tokens
//! carry the smallest finite f32 in the processed scores, so no `-inf - -inf` NaN can appear.

use crate::config::EarlyStopping;
use crate::error::{Error, Result};

/// transformers' large negative score for beams that must not be chosen.
const PENALTY: f32 = -1.0e9;

/// A sequence of new tokens with the processed score of each (for transition scores).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hypothesis {
    /// New tokens, the eos token included when it ended the hypothesis.
    pub tokens: Vec<u32>,
    /// Processed score (`log_softmax` + processors) of each token.
    pub scores: Vec<f32>,
    /// `log_softmax` of the processed scores at each token (normalised transition scores).
    pub logprobs: Vec<f32>,
}

/// A finished hypothesis and its score `sum / len ** length_penalty`.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub hypothesis: Hypothesis,
    pub score: f32,
}

/// The settings of a beam search, from the generation config.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamSettings {
    pub num_beams: usize,
    pub length_penalty: f32,
    pub early_stopping: EarlyStopping,
    pub eos: Vec<u32>,
    /// Maximum number of new tokens (`max_length - decoder_prompt_len`).
    pub budget: usize,
}

/// One slot of transformers' `beam_scores` / `sequences` (the finished hypotheses, best first).
#[derive(Debug, Clone)]
struct Slot {
    score: f32,
    /// `Some` when `is_sent_finished` is set for the slot.
    finished: Option<Hypothesis>,
}

/// A candidate continuation: parent beam, token, accumulated score.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    beam: usize,
    token: u32,
    score: f32,
}

/// What the caller does next.
#[derive(Debug, Clone, PartialEq)]
pub enum BeamStep {
    /// Row `b` of the next step continues the old beam `parents[b]` with `tokens[b]`.
    Continue {
        parents: Vec<usize>,
        tokens: Vec<u32>,
    },
    /// The search is over: `finished()` holds the result.
    Done,
}

/// The beam search state of one prompt.
#[derive(Debug, Clone)]
pub struct BeamSearch {
    settings: BeamSettings,
    beams_to_keep: usize,
    running: Vec<Hypothesis>,
    running_scores: Vec<f32>,
    slots: Vec<Slot>,
    heuristic_unsatisfied: bool,
    generated: usize,
    done: bool,
}

impl BeamSearch {
    pub fn new(settings: BeamSettings) -> Result<Self> {
        let n = settings.num_beams;
        if n == 0 {
            return Err(Error::InvalidInput(
                "`num_beams` must be at least 1, got 0".into(),
            ));
        }
        // Keep enough candidates that `num_beams` of them do not end, even when the best ones
        // all pick an eos token.
        let beams_to_keep = 2.max(1 + settings.eos.len()) * n;
        // Only the first beam is live at the start, so the beams do not all pick the same tokens.
        let mut running_scores = vec![PENALTY; n];
        running_scores[0] = 0.0;
        Ok(BeamSearch {
            beams_to_keep,
            running: vec![Hypothesis::default(); n],
            running_scores,
            slots: vec![
                Slot {
                    score: PENALTY,
                    finished: None,
                };
                n
            ],
            heuristic_unsatisfied: true,
            generated: 0,
            done: settings.budget == 0,
            settings,
        })
    }

    pub fn num_beams(&self) -> usize {
        self.settings.num_beams
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The running hypotheses, one per beam row.
    pub fn running(&self) -> &[Hypothesis] {
        &self.running
    }

    /// The finished hypotheses, best first (as many as `num_beams` once done).
    pub fn finished(&self) -> Vec<Finished> {
        self.slots
            .iter()
            .filter_map(|s| {
                s.finished.as_ref().map(|h| Finished {
                    hypothesis: h.clone(),
                    score: s.score,
                })
            })
            .collect()
    }

    /// One step: `scores[b]` are the processed log-probabilities of beam `b` (log-softmax of its
    /// logits, then the processors).
    pub fn step(&mut self, scores: &[&[f32]]) -> Result<BeamStep> {
        if self.done {
            return Ok(BeamStep::Done);
        }
        let n = self.settings.num_beams;
        if scores.len() != n {
            return Err(Error::Backend(format!(
                "beam search got {} score rows for {n} beams",
                scores.len()
            )));
        }
        let vocab = scores.first().map(|s| s.len()).unwrap_or(0);
        if vocab == 0 || scores.iter().any(|s| s.len() != vocab) {
            return Err(Error::Backend(
                "beam search got score rows of unequal or zero width".into(),
            ));
        }
        let k = self.beams_to_keep.min(n * vocab);

        // `_get_top_k_continuations`: the best `k` of `num_beams * vocab` accumulated scores.
        let candidates = top_k(scores, &self.running_scores, k);
        let last_step = self.generated + 1 >= self.settings.budget;
        let hits: Vec<bool> = candidates
            .iter()
            .map(|c| last_step || self.settings.eos.contains(&c.token))
            .collect();
        let lse: Vec<f32> = scores.iter().map(|s| super::log_sum_exp(s)).collect();
        let extend = |c: &Candidate, running: &[Hypothesis]| {
            let mut h = running[c.beam].clone();
            let s = scores[c.beam][c.token as usize];
            h.tokens.push(c.token);
            h.scores.push(s);
            h.logprobs.push(s - lse[c.beam]);
            h
        };

        // `_get_running_beams_for_next_iteration`: the best `num_beams` that did not end.
        let running_scores: Vec<f32> = candidates
            .iter()
            .zip(&hits)
            .map(|(c, &hit)| c.score + if hit { PENALTY } else { 0.0 })
            .collect();
        let next = top_indices(&running_scores, n);

        // `_update_finished_beams`: candidates among the first `num_beams` that ended compete
        // with the finished hypotheses, scored `sum / len ** length_penalty` (len counts eos).
        let denom = ((self.generated + 1) as f64).powf(self.settings.length_penalty as f64) as f32;
        let full = self.settings.early_stopping == EarlyStopping::True
            && self.slots.iter().all(|s| s.finished.is_some());
        let mut merged: Vec<f32> = self.slots.iter().map(|s| s.score).collect();
        for (i, c) in candidates.iter().enumerate() {
            let mut s = c.score / denom;
            if full {
                s += PENALTY;
            }
            if !self.heuristic_unsatisfied {
                s += PENALTY;
            }
            if !(hits[i] && i < n) {
                s += PENALTY;
            }
            merged.push(s);
        }
        let best = top_indices(&merged, n);
        let slots: Vec<Slot> = best
            .iter()
            .map(|&m| {
                if m < n {
                    self.slots[m].clone()
                } else {
                    let i = m - n;
                    Slot {
                        score: merged[m],
                        finished: (hits[i] && i < n).then(|| extend(&candidates[i], &self.running)),
                    }
                }
            })
            .collect();
        self.slots = slots;

        let parents: Vec<usize> = next.iter().map(|&i| candidates[i].beam).collect();
        let tokens: Vec<u32> = next.iter().map(|&i| candidates[i].token).collect();
        self.running = next
            .iter()
            .map(|&i| extend(&candidates[i], &self.running))
            .collect();
        self.running_scores = next.iter().map(|&i| running_scores[i]).collect();
        self.generated += 1;

        // `_check_early_stop_heuristic`: can the best running beam still beat the worst
        // finished hypothesis?
        let lp = self.settings.length_penalty;
        let best_len = if self.settings.early_stopping == EarlyStopping::Never && lp > 0.0 {
            self.settings.budget
        } else {
            self.generated
        };
        let best_possible = self.running_scores[0] / (best_len as f64).powf(lp as f64) as f32;
        let worst = self
            .slots
            .iter()
            .map(|s| s.score)
            .fold(f32::INFINITY, f32::min);
        let improvable = self.slots.iter().any(|s| {
            let w = if s.finished.is_some() { worst } else { PENALTY };
            best_possible > w
        });
        self.heuristic_unsatisfied &= improvable;

        // `_beam_search_has_unfinished_sequences`.
        let all_finished = self.slots.iter().all(|s| s.finished.is_some());
        let open_beam = !(all_finished && self.settings.early_stopping == EarlyStopping::True);
        let valid_continuations = !hits.iter().all(|&h| h);
        self.done = !(self.heuristic_unsatisfied && open_beam && valid_continuations);
        if self.done {
            return Ok(BeamStep::Done);
        }
        Ok(BeamStep::Continue { parents, tokens })
    }
}

/// The `k` best `running_scores[b] + scores[b][t]`, best first; ties go to the lower flat index
/// `b * vocab + t`, as `torch.topk` orders them on the CPU.
fn top_k(scores: &[&[f32]], running_scores: &[f32], k: usize) -> Vec<Candidate> {
    let mut best: Vec<Candidate> = Vec::with_capacity(k + 1);
    for (b, (row, &base)) in scores.iter().zip(running_scores).enumerate() {
        for (t, &s) in row.iter().enumerate() {
            let score = s + base;
            // Not better than the current k-th: skip (also skips NaN).
            if best.len() == k && !(best.last().is_some_and(|w| score > w.score)) {
                continue;
            }
            let at = best.partition_point(|c| c.score >= score);
            best.insert(
                at,
                Candidate {
                    beam: b,
                    token: t as u32,
                    score,
                },
            );
            best.truncate(k);
        }
    }
    best
}

/// Indices of the `k` largest values, best first; ties go to the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| {
        values[b]
            .partial_cmp(&values[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    order.truncate(k);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(num_beams: usize, eos: Vec<u32>, budget: usize) -> BeamSettings {
        BeamSettings {
            num_beams,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::False,
            eos,
            budget,
        }
    }

    fn log_softmax(v: &[f32]) -> Vec<f32> {
        let l = super::super::log_sum_exp(v);
        v.iter().map(|x| x - l).collect()
    }

    #[test]
    fn top_k_orders_ties_by_index() {
        let a = [0.0f32, 1.0, 1.0];
        let b = [1.0f32, 0.5, 0.0];
        let c = top_k(&[&a, &b], &[0.0, 0.0], 3);
        let got: Vec<(usize, u32)> = c.iter().map(|c| (c.beam, c.token)).collect();
        assert_eq!(got, vec![(0, 1), (0, 2), (1, 0)]);
    }

    #[test]
    fn first_step_takes_every_candidate_from_the_first_beam() {
        let row = log_softmax(&[1.0, 2.0, 3.0, 0.5]);
        let mut s = BeamSearch::new(settings(2, vec![], 5)).unwrap();
        match s.step(&[&row, &row]).unwrap() {
            BeamStep::Continue { parents, tokens } => {
                assert_eq!(parents, vec![0, 0]);
                assert_eq!(tokens, vec![2, 1]);
            }
            BeamStep::Done => panic!("finished too early"),
        }
    }

    #[test]
    fn eos_at_the_first_step_gives_an_empty_hypothesis_scored_by_length_one() {
        // Token 0 is eos and by far the best.
        let row = log_softmax(&[10.0, 0.0, 0.0, 0.0]);
        let mut s = BeamSearch::new(settings(2, vec![0], 1)).unwrap();
        assert_eq!(s.step(&[&row, &row]).unwrap(), BeamStep::Done);
        let f = s.finished();
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].hypothesis.tokens, vec![0]);
        assert!((f[0].score - row[0]).abs() < 1e-6);
    }

    #[test]
    fn a_budget_of_one_finishes_every_beam_at_once() {
        let row = log_softmax(&[1.0, 2.0, 3.0, 0.5]);
        let mut s = BeamSearch::new(settings(3, vec![], 1)).unwrap();
        assert_eq!(s.step(&[&row, &row, &row]).unwrap(), BeamStep::Done);
        let tokens: Vec<Vec<u32>> = s
            .finished()
            .iter()
            .map(|f| f.hypothesis.tokens.clone())
            .collect();
        assert_eq!(tokens, vec![vec![2], vec![1], vec![0]]);
    }

    #[test]
    fn removed_tokens_do_not_make_nan() {
        let mut row = log_softmax(&[1.0, 2.0, 3.0, 0.5]);
        row[2] = f32::MIN;
        let mut s = BeamSearch::new(settings(2, vec![], 3)).unwrap();
        for _ in 0..3 {
            let _ = s.step(&[&row, &row]).unwrap();
        }
        assert!(s.is_done());
        assert!(s.finished().iter().all(|f| f.score.is_finite()));
    }
}
