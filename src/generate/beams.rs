//! The beam-search path of `Generation` (`num_beams > 1`): each prompt is prefilled once (one
//! cache row), then expanded to its `num_beams` rows with `DecoderState::reorder`; each step
//! feeds one token per beam row, runs `search::beam::BeamSearch` per prompt on the processed
//! log-softmax scores, and moves every row's cache to its parent beam (in place). Prompts whose
//! search is over leave the batch. In `grow` mode the prompts of each length run as one group,
//! the groups one after the other.

use crate::config::GenerationConfig;
use crate::decoder::DecoderState;
use crate::error::{Error, Result};
use crate::model::{EncoderInput, Model};
use crate::processors::{Chain, RowContext};
use crate::search::beam::{BeamSearch, BeamSettings, BeamStep, Finished, Hypothesis};
use crate::search::log_sum_exp;
use crate::tokenizer::TextStream;
use crate::vision::PromptInputs;

use super::{FinishReason, Sequence, TokenEvent, PROMPT_CHUNK};

/// One prompt of a beam request.
struct Prompt {
    ids: Vec<u32>,
    /// Prompt tokens already in the cache.
    fed: usize,
    /// Maximum number of new tokens.
    budget: usize,
    search: BeamSearch,
    /// The logits of the prompt's last token, held until its group is expanded to beams.
    first_logits: Option<Vec<f32>>,
    /// Set once the search is over (or the request was aborted).
    finish: Option<FinishReason>,
}

/// Prompts that share one decoder state.
struct Group {
    prompts: Vec<usize>,
    state: Option<Box<dyn DecoderState>>,
    /// Prompts held in the state, in row order: one row each before expansion, `num_beams`
    /// rows each after.
    active: Vec<usize>,
    expanded: bool,
    /// The token each row takes at the next step (after expansion).
    next: Vec<u32>,
}

/// The state of a beam request.
pub(super) struct BeamRun {
    num_beams: usize,
    /// Encoder-decoder models: the encoder's input (row `p` is prompt `p`).
    encoder: Option<EncoderInput>,
    /// Vision-language decoders: each prompt's image features and positions.
    prompt_inputs: Option<std::sync::Arc<PromptInputs>>,
    prompts: Vec<Prompt>,
    groups: Vec<Group>,
}

impl BeamRun {
    pub(super) fn new(
        model: &Model,
        encoder: Option<EncoderInput>,
        prompt_inputs: Option<std::sync::Arc<PromptInputs>>,
        prompts: &[Vec<u32>],
        config: &GenerationConfig,
    ) -> Result<BeamRun> {
        let num_beams = config.num_beams;
        let prompts: Vec<Prompt> = prompts
            .iter()
            .map(|p| {
                let budget = match encoder {
                    Some(_) => config.seq2seq_new_token_budget(p.len()),
                    None => config.new_token_budget(p.len()),
                }
                .max(1);
                Ok(Prompt {
                    ids: p.clone(),
                    fed: 0,
                    budget,
                    search: BeamSearch::new(BeamSettings {
                        num_beams,
                        length_penalty: config.length_penalty,
                        early_stopping: config.early_stopping,
                        eos: config.eos_ids().to_vec(),
                        budget,
                    })?,
                    first_logits: None,
                    // An empty prompt is a padding row: it yields nothing.
                    finish: p.is_empty().then_some(FinishReason::Length),
                })
            })
            .collect::<Result<_>>()?;
        let lengths: Vec<usize> = prompts.iter().map(|p| p.ids.len()).collect();
        let groups = super::group_by_length(model, &lengths)
            .into_iter()
            .map(|rows| Group {
                active: rows.clone(),
                prompts: rows,
                state: None,
                expanded: false,
                next: vec![],
            })
            .collect();
        Ok(BeamRun {
            num_beams,
            encoder,
            prompt_inputs,
            prompts,
            groups,
        })
    }

    pub(super) fn is_finished(&self) -> bool {
        self.prompts.iter().all(|p| p.finish.is_some())
    }

    /// Run one decoder step; events are those of prompts whose search ended.
    pub(super) fn step(
        &mut self,
        model: &Model,
        config: &GenerationConfig,
        chain: &mut Chain,
    ) -> Result<Vec<TokenEvent>> {
        let prompts = &mut self.prompts;
        let Some(g) = self
            .groups
            .iter()
            .position(|g| g.active.iter().any(|&p| prompts[p].finish.is_none()))
        else {
            return Ok(vec![]);
        };
        let group = &mut self.groups[g];
        if group.state.is_none() {
            let capacity = group
                .prompts
                .iter()
                .map(|&p| prompts[p].ids.len() + prompts[p].budget)
                .max()
                .unwrap_or(1);
            let encoder = self.encoder.as_ref().map(|e| (e, group.active.as_slice()));
            let inputs = self
                .prompt_inputs
                .as_ref()
                .map(|p| (p, group.active.as_slice()));
            group.state = Some(model.start_rows(group.active.len(), capacity, encoder, inputs)?);
        }
        let state = group
            .state
            .as_mut()
            .ok_or_else(|| Error::Backend("no decoder state".into()))?;
        let n = self.num_beams;
        let vocab = model.vocab_size();

        // Scores of each row, and the beam step of each active prompt.
        let mut row_scores: Vec<Vec<f32>> = vec![];
        if !group.expanded {
            // Prefill: each prompt's pending tokens, at most `PROMPT_CHUNK`, one row per prompt.
            let pending: Vec<usize> = group
                .active
                .iter()
                .map(|&p| prompts[p].ids.len() - prompts[p].fed)
                .collect();
            let most = pending.iter().copied().max().unwrap_or(0);
            let chunk = most.min(PROMPT_CHUNK);
            let tokens: Vec<&[u32]> = group
                .active
                .iter()
                .zip(&pending)
                .map(|(&p, &k)| {
                    let pr = &prompts[p];
                    &pr.ids[pr.fed..pr.fed + k.min(chunk)]
                })
                .collect();
            let logits = state.step(&tokens)?;
            for (i, &p) in group.active.iter().enumerate() {
                let pr = &mut prompts[p];
                pr.fed += pending[i].min(chunk);
                if pr.fed == pr.ids.len() && pr.first_logits.is_none() {
                    pr.first_logits = Some(logits.row(i).to_vec());
                }
            }
            if group
                .active
                .iter()
                .any(|&p| prompts[p].first_logits.is_none())
            {
                return Ok(vec![]);
            }
            // Every beam of a prompt starts from the prompt's logits (transformers runs the
            // expanded prompt, so they are the same).
            for &p in &group.active {
                let first = prompts[p].first_logits.take().unwrap_or_default();
                row_scores.extend(std::iter::repeat_n(first, n));
            }
        } else {
            // Prompts whose search is over but that are still in the batch sit the step out
            // (`grow` mode, where rows keep equal lengths: they take a throwaway token).
            let may_differ = state.rows_may_differ();
            let tokens: Vec<&[u32]> = group
                .next
                .chunks(1)
                .enumerate()
                .map(|(r, t)| {
                    let done = prompts[group.active[r / n]].finish.is_some();
                    if done && may_differ {
                        &[][..]
                    } else {
                        t
                    }
                })
                .collect();
            let logits = state.step(&tokens)?;
            row_scores = (0..logits.rows).map(|r| logits.row(r).to_vec()).collect();
        }
        if row_scores.len() != group.active.len() * n {
            return Err(Error::Backend(format!(
                "a step returned {} rows of logits for {} beam rows",
                row_scores.len(),
                group.active.len() * n
            )));
        }
        let mut events = vec![];
        // Per active prompt: its parents (local beam indices) and next tokens, or `None` when
        // its search is over.
        let mut steps: Vec<Option<(Vec<usize>, Vec<u32>)>> = vec![];
        for (i, &p) in group.active.iter().enumerate() {
            let pr = &mut prompts[p];
            if pr.finish.is_some() {
                steps.push(None);
                continue;
            }
            let beams = &mut row_scores[i * n..(i + 1) * n];
            for (b, scores) in beams.iter_mut().enumerate() {
                if scores.len() != vocab {
                    return Err(Error::Backend(format!(
                        "a step returned {} logits for a vocabulary of {vocab}",
                        scores.len()
                    )));
                }
                // transformers: `log_softmax(logits)`, then the processors.
                let lse = log_sum_exp(scores);
                scores.iter_mut().for_each(|s| *s -= lse);
                if !chain.is_empty() {
                    let mut ids = pr.ids.clone();
                    ids.extend(&pr.search.running()[b].tokens);
                    let ctx = RowContext {
                        row: p * n + b,
                        ids: &ids,
                        prompt_len: pr.ids.len(),
                        max_length: pr.ids.len() + pr.budget,
                    };
                    chain.apply(&ctx, scores)?;
                }
                // Removed tokens: the smallest finite f32, never -inf arithmetic.
                scores.iter_mut().for_each(|s| {
                    if s.is_nan() || *s == f32::NEG_INFINITY {
                        *s = f32::MIN;
                    }
                });
            }
            let refs: Vec<&[f32]> = beams.iter().map(|s| s.as_slice()).collect();
            match pr.search.step(&refs)? {
                BeamStep::Continue { parents, tokens } => steps.push(Some((parents, tokens))),
                BeamStep::Done => {
                    let best = pr.search.finished().into_iter().next();
                    pr.finish = Some(best.as_ref().map_or(FinishReason::Length, |f| {
                        finish_reason(&f.hypothesis, config)
                    }));
                    if let Some(best) = best {
                        events.extend(stream_events(model, config, p, &best.hypothesis)?);
                    }
                    steps.push(None);
                }
            }
        }

        let live = steps.iter().filter(|s| s.is_some()).count();
        if live == 0 {
            group.state = None;
            group.active.clear();
            return Ok(events);
        }
        // Prompts whose search is over leave the batch when the smaller batch is ready to run
        // (see `Generation::step`), and always at the expansion to beams (a new size anyway).
        let compact = !group.expanded || state.is_ready_for(live * n);
        let mut parents = vec![];
        let mut next = vec![];
        let mut active = vec![];
        for (i, (&p, s)) in group.active.iter().zip(&steps).enumerate() {
            // Before expansion, row `i` of the cache holds prompt `i`; after, rows
            // `i*n..(i+1)*n`.
            match s {
                Some((local, tokens)) if group.expanded => {
                    parents.extend(local.iter().map(|&b| i * n + b));
                    next.extend(tokens);
                }
                Some((_, tokens)) => {
                    parents.extend(std::iter::repeat_n(i, n));
                    next.extend(tokens);
                }
                None if compact => continue,
                None => {
                    parents.extend(i * n..(i + 1) * n);
                    next.extend(&group.next[i * n..(i + 1) * n]);
                }
            }
            active.push(p);
        }
        // Each row takes the cache of its parent beam: in place when the number of rows is
        // unchanged, else (expansion, or prompts that ended leaving) a gather.
        state.reorder(&parents)?;
        group.active = active;
        group.next = next;
        group.expanded = true;
        Ok(events)
    }

    pub(super) fn abort(&mut self) {
        for p in self.prompts.iter_mut().filter(|p| p.finish.is_none()) {
            p.finish = Some(FinishReason::Abort);
        }
        for g in self.groups.iter_mut() {
            g.state = None;
            g.active.clear();
        }
    }

    /// `sequences[prompt]`: the best `num_return_sequences` hypotheses, best first.
    pub(super) fn output(
        &self,
        model: &Model,
        config: &GenerationConfig,
    ) -> Result<Vec<Vec<Sequence>>> {
        let want = config.num_return_sequences;
        self.prompts
            .iter()
            .map(|pr| {
                if pr.ids.is_empty() {
                    return Ok((0..want).map(|_| empty_sequence(config)).collect());
                }
                let finished: Vec<Finished> = if pr.finish == Some(FinishReason::Abort) {
                    pr.search
                        .running()
                        .iter()
                        .map(|h| Finished {
                            hypothesis: h.clone(),
                            score: f32::NAN,
                        })
                        .collect()
                } else {
                    pr.search.finished()
                };
                finished
                    .into_iter()
                    .take(want)
                    .map(|f| {
                        let aborted = f.score.is_nan();
                        let reason = if aborted {
                            FinishReason::Abort
                        } else {
                            finish_reason(&f.hypothesis, config)
                        };
                        let mut ids = f.hypothesis.tokens.clone();
                        if reason == FinishReason::Eos {
                            ids.pop();
                        }
                        Ok(Sequence {
                            text: model.tokenizer.decode(&ids)?,
                            token_ids: ids,
                            finish_reason: reason,
                            scores: config.output_scores.then(|| f.hypothesis.scores.clone()),
                            logprobs: config.output_scores.then(|| f.hypothesis.logprobs.clone()),
                            sequence_score: (!aborted).then_some(f.score),
                            // Beam search ranks hypotheses, not single tokens: no alternatives.
                            top_logprobs: None,
                        })
                    })
                    .collect()
            })
            .collect()
    }
}

fn empty_sequence(config: &GenerationConfig) -> Sequence {
    Sequence {
        token_ids: vec![],
        text: String::new(),
        finish_reason: FinishReason::Length,
        scores: config.output_scores.then(Vec::new),
        logprobs: config.output_scores.then(Vec::new),
        sequence_score: None,
        top_logprobs: None,
    }
}

/// `Eos` when the hypothesis ends with an eos token, else `Length`.
fn finish_reason(h: &Hypothesis, config: &GenerationConfig) -> FinishReason {
    match h.tokens.last() {
        Some(t) if config.eos_ids().contains(t) => FinishReason::Eos,
        _ => FinishReason::Length,
    }
}

/// The events of a prompt's best hypothesis, sent when its search ends (beams change until
/// then): text deltas that concatenate to its text, `finished` on the last.
fn stream_events(
    model: &Model,
    config: &GenerationConfig,
    prompt: usize,
    h: &Hypothesis,
) -> Result<Vec<TokenEvent>> {
    let reason = finish_reason(h, config);
    let mut stream = TextStream::new();
    let mut events = vec![];
    let last = h.tokens.len().saturating_sub(1);
    for (i, &t) in h.tokens.iter().enumerate() {
        let mut text = if i == last && reason == FinishReason::Eos {
            String::new()
        } else {
            stream.push(&model.tokenizer, t)?
        };
        if i == last {
            text.push_str(&stream.finish());
        }
        events.push(TokenEvent {
            row: prompt,
            token_id: t,
            text,
            finished: (i == last).then_some(reason),
            logprob: config
                .output_scores
                .then(|| h.logprobs.get(i).copied())
                .flatten(),
            top_logprobs: None,
        });
    }
    Ok(events)
}
