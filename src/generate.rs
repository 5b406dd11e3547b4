//! The generation loop: prompts in power-of-two steps, then one token per step for each row,
//! with the processors of the request, until every row stops. A `Generation` is a state
//! machine advanced one step at a time (`step`), so a caller can yield to its event loop
//! between steps and drop it to abort; `Model` stays untouched.

use serde_json::{Map, Value};

use crate::config::GenerationConfig;
use crate::decoder::DecoderState;
use crate::error::{invalid, Error, Result};
use crate::model::Model;
use crate::processors::stop_strings::StopStrings;
use crate::processors::{Chain, LogitsProcessor, RowContext};
use crate::search;
use crate::search::sampling::Sampler;
use crate::tokenizer::TextStream;

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced an eos token.
    Eos,
    /// It reached its maximum length.
    Length,
    /// The caller stopped the request.
    Abort,
    /// A stop string (`stop_strings`) ended in its last token (which is kept).
    StopString,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::StopString => "stop_string",
        }
    }
}

/// One new token of one row, as it is produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The row it belongs to: the prompt index, or with `num_return_sequences = n` when
    /// sampling, `prompt * n + sequence`.
    pub row: usize,
    pub token_id: u32,
    /// The new text: the deltas of a row concatenate to its final text. Empty for an eos token
    /// and while a character is split over several tokens.
    pub text: String,
    /// Set on the last event of the row.
    pub finished: Option<FinishReason>,
    /// With `output_scores` (or `top_logprobs`): log-softmax of the processed scores at this
    /// token.
    pub logprob: Option<f32>,
    /// With `top_logprobs: N`: the N most likely tokens of the processed distribution and their
    /// log-probabilities, most likely first.
    pub top_logprobs: Option<Vec<(u32, f32)>>,
}

/// A finished sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    /// New token ids, without the prompt and without the eos token.
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// With `output_scores`: the processed score of each chosen token (eos step included).
    pub scores: Option<Vec<f32>>,
    /// With `output_scores`: `compute_transition_scores(..., normalize_logits=True)`.
    pub logprobs: Option<Vec<f32>>,
    /// Beam search: the hypothesis score `sum(scores) / length ** length_penalty`.
    pub sequence_score: Option<f32>,
    /// With `top_logprobs: N`: for each step, the N most likely tokens and their log-probs.
    pub top_logprobs: Option<Vec<Vec<(u32, f32)>>>,
}

/// The result of a request: `sequences[prompt][returned sequence]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub sequences: Vec<Vec<Sequence>>,
}

/// Per-row state.
struct Row {
    /// Prompt and new tokens.
    ids: Vec<u32>,
    prompt_len: usize,
    /// Tokens of `ids` already in the cache.
    fed: usize,
    /// Maximum number of new tokens.
    budget: usize,
    finish: Option<FinishReason>,
    stream: TextStream,
    scores: Vec<f32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
}

impl Row {
    fn new_tokens(&self) -> &[u32] {
        &self.ids[self.prompt_len..]
    }
}

/// Rows that share one decoder state (all rows, or in `grow` mode the rows of one prompt
/// length); `active[i]` is the request row held in state row `i`.
struct Group {
    rows: Vec<usize>,
    state: Option<Box<dyn DecoderState>>,
    active: Vec<usize>,
}

/// A request in progress.
pub struct Generation {
    config: GenerationConfig,
    chain: Chain,
    /// With `do_sample`: one seeded generator per row.
    sampler: Option<Sampler>,
    stop_strings: Option<StopStrings>,
    /// Rows per prompt (`num_return_sequences` when sampling, else 1).
    per_prompt: usize,
    rows: Vec<Row>,
    groups: Vec<Group>,
    steps: usize,
}

impl Generation {
    /// Prepare a request: validate prompts and options, build the processor chain.
    pub fn new(
        model: &Model,
        prompts: &[Vec<u32>],
        options: &Map<String, Value>,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        let mut config = model.generation_config.clone();
        config.apply_options(options)?;
        Self::with_config(model, prompts, config, custom)
    }

    pub fn with_config(
        model: &Model,
        prompts: &[Vec<u32>],
        config: GenerationConfig,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        if prompts.is_empty() {
            return invalid!("no prompt was given");
        }
        if config.num_beams > 1 {
            return Err(Error::Unsupported(
                "beam search (num_beams > 1) is not implemented yet".into(),
            ));
        }
        if config.num_return_sequences > config.num_beams && !config.do_sample {
            return invalid!(
                "`num_return_sequences` ({}) must not exceed `num_beams` ({}) without sampling",
                config.num_return_sequences,
                config.num_beams
            );
        }
        let vocab = model.vocab_size();
        for (r, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return invalid!("prompt {r} is empty: a prompt needs at least one token");
            }
            if let Some((i, &t)) = p.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return invalid!(
                    "token id {t} at position {i} of prompt {r} is outside the vocabulary (0..{vocab})"
                );
            }
        }
        let chain = Chain::build(&config, vocab, custom)?;
        // Sampling with `num_return_sequences`: each prompt is repeated, as transformers'
        // `_expand_inputs_for_generation` does (row `p * n + i` is sequence `i` of prompt `p`).
        let per_prompt = match config.do_sample && config.num_beams == 1 {
            true => config.num_return_sequences,
            false => 1,
        };
        let prompts: Vec<Vec<u32>> = prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), per_prompt))
            .collect();
        let sampler = match config.do_sample {
            true => Some(Sampler::new(config.seed.as_deref(), prompts.len())?),
            false => None,
        };
        let stop_strings = match &config.stop_strings {
            Some(s) => Some(
                StopStrings::new(s)?.with_prefix(
                    model
                        .tokenizer
                        .encode(crate::processors::stop_strings::STATIC_PREFIX, false)?,
                ),
            ),
            None => None,
        };
        let rows: Vec<Row> = prompts
            .iter()
            .map(|p| Row {
                ids: p.clone(),
                prompt_len: p.len(),
                fed: 0,
                // transformers stops on `cur_len >= max_length` after each new token, so a row
                // whose prompt already reaches `max_length` still gets one token.
                budget: config.new_token_budget(p.len()).max(1),
                finish: None,
                stream: TextStream::new(),
                scores: vec![],
                logprobs: vec![],
                top_logprobs: vec![],
            })
            .collect();
        let groups = group_rows(model, &rows);
        Ok(Generation {
            config,
            chain,
            sampler,
            stop_strings,
            per_prompt,
            rows,
            groups,
            steps: 0,
        })
    }

    /// The effective configuration of this request.
    pub fn config(&self) -> &GenerationConfig {
        &self.config
    }

    /// Whether every row has stopped.
    pub fn is_finished(&self) -> bool {
        self.rows.iter().all(|r| r.finish.is_some())
    }

    /// Decoder steps run so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Run one decoder step and return the tokens it produced.
    pub fn step(&mut self, model: &Model) -> Result<Vec<TokenEvent>> {
        let Some(g) = self
            .groups
            .iter()
            .position(|g| g.active.iter().any(|&r| self.rows[r].finish.is_none()))
        else {
            return Ok(vec![]);
        };
        if self.groups[g].state.is_none() {
            let capacity = self.groups[g]
                .rows
                .iter()
                .map(|&r| self.rows[r].prompt_len + self.rows[r].budget)
                .max()
                .unwrap_or(1);
            let rows = self.groups[g].rows.len();
            self.groups[g].state = Some(model.decoder().start(rows, capacity)?);
        }
        let group = &mut self.groups[g];
        let state = group
            .state
            .as_mut()
            .ok_or_else(|| Error::Backend("no decoder state".into()))?;

        // The tokens of this step: each row's pending tokens, prompts in power-of-two chunks.
        let pending: Vec<usize> = group
            .active
            .iter()
            .map(|&r| {
                let row = &self.rows[r];
                if row.finish.is_some() {
                    0
                } else {
                    row.ids.len() - row.fed
                }
            })
            .collect();
        let most = pending.iter().copied().max().unwrap_or(0);
        let chunk = if most == 0 {
            0
        } else {
            1usize << (usize::BITS - 1 - most.leading_zeros())
        };
        let tokens: Vec<&[u32]> = group
            .active
            .iter()
            .zip(&pending)
            .map(|(&r, &p)| {
                let row = &self.rows[r];
                &row.ids[row.fed..row.fed + p.min(chunk)]
            })
            .collect();
        let logits = state.step(&tokens)?;
        self.steps += 1;

        let mut events = vec![];
        for (i, &r) in group.active.iter().enumerate() {
            let row = &mut self.rows[r];
            row.fed += pending[i].min(chunk);
            if row.finish.is_some() || row.fed < row.ids.len() {
                continue;
            }
            // The row's last token is in the cache: choose the next one.
            let mut scores = logits.row(i).to_vec();
            let ctx = RowContext {
                row: r,
                ids: &row.ids,
                prompt_len: row.prompt_len,
                max_length: row.prompt_len + row.budget,
            };
            self.chain.apply(&ctx, &mut scores)?;
            let token = match self.sampler.as_mut() {
                Some(sampler) => sampler.sample(r, &scores)?,
                None => search::argmax(&scores),
            };
            // Scores and log-probs only when asked for.
            let want_logprobs = self.config.output_scores || self.config.top_logprobs > 0;
            let mut logprob = None;
            let mut top = None;
            if want_logprobs {
                let lp = search::log_softmax_at(&scores, token as usize);
                row.scores.push(scores[token as usize]);
                row.logprobs.push(lp);
                logprob = Some(lp);
            }
            if self.config.top_logprobs > 0 {
                let t = search::top_logprobs(&scores, self.config.top_logprobs);
                row.top_logprobs.push(t.clone());
                top = Some(t);
            }
            let is_eos = self.config.eos_ids().contains(&token);
            let mut text = String::new();
            if is_eos {
                row.finish = Some(FinishReason::Eos);
            } else {
                row.ids.push(token);
                text = row.stream.push(&model.tokenizer, token)?;
                let stop = match &self.stop_strings {
                    Some(s) => s.matches(&row.ids, |ids| {
                        model.tokenizer.decode_with_special_tokens(ids)
                    })?,
                    None => false,
                };
                if stop {
                    row.finish = Some(FinishReason::StopString);
                } else if row.new_tokens().len() >= row.budget {
                    row.finish = Some(FinishReason::Length);
                }
            }
            if row.finish.is_some() {
                text.push_str(&row.stream.finish());
            }
            events.push(TokenEvent {
                row: r,
                token_id: token,
                text,
                finished: row.finish,
                logprob,
                top_logprobs: top,
            });
        }

        // Rows that stopped leave the batch, so they cost no more work.
        let keep: Vec<usize> = (0..group.active.len())
            .filter(|&i| self.rows[group.active[i]].finish.is_none())
            .collect();
        if !keep.is_empty() && keep.len() < group.active.len() {
            state.reorder(&keep)?;
            group.active = keep.iter().map(|&i| group.active[i]).collect();
        } else if keep.is_empty() {
            group.state = None;
            group.active.clear();
        }
        Ok(events)
    }

    /// Stop every unfinished row (the caller aborted); the cache is released.
    pub fn abort(&mut self) {
        for row in self.rows.iter_mut().filter(|r| r.finish.is_none()) {
            row.finish = Some(FinishReason::Abort);
        }
        for g in self.groups.iter_mut() {
            g.state = None;
            g.active.clear();
        }
    }

    /// The result, once finished (or aborted).
    pub fn output(&self, model: &Model) -> Result<Output> {
        let sequences = self
            .rows
            .chunks(self.per_prompt.max(1))
            .map(|rows| rows.iter().map(|row| self.sequence(model, row)).collect())
            .collect::<Result<_>>()?;
        Ok(Output { sequences })
    }

    fn sequence(&self, model: &Model, row: &Row) -> Result<Sequence> {
        let ids = row.new_tokens().to_vec();
        Ok(Sequence {
            text: model.tokenizer.decode(&ids)?,
            token_ids: ids,
            finish_reason: row.finish.unwrap_or(FinishReason::Abort),
            scores: self.config.output_scores.then(|| row.scores.clone()),
            logprobs: self.config.output_scores.then(|| row.logprobs.clone()),
            sequence_score: None,
            top_logprobs: (self.config.top_logprobs > 0).then(|| row.top_logprobs.clone()),
        })
    }
}

/// One group of all rows, or in `grow` mode one group per prompt length.
fn group_rows(model: &Model, rows: &[Row]) -> Vec<Group> {
    let make = |rows: Vec<usize>| Group {
        active: rows.clone(),
        rows,
        state: None,
    };
    if model.signature.cache_mode != crate::model::signature::CacheMode::Grow {
        return vec![make((0..rows.len()).collect())];
    }
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.prompt_len).collect();
    lengths.sort_unstable();
    lengths.dedup();
    lengths
        .into_iter()
        .map(|len| {
            make(
                (0..rows.len())
                    .filter(|&r| rows[r].prompt_len == len)
                    .collect(),
            )
        })
        .collect()
}

impl Model {
    /// Generate for token-id prompts, calling `on_token` for each new token.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        options: &Map<String, Value>,
        mut on_token: impl FnMut(&TokenEvent),
    ) -> Result<Output> {
        let mut generation = Generation::new(self, prompts, options, vec![])?;
        while !generation.is_finished() {
            for event in generation.step(self)? {
                on_token(&event);
            }
        }
        generation.output(self)
    }

    /// Generate from text: the prompt is encoded as transformers' tokenizer call does
    /// (`add_special_tokens=True`).
    pub fn generate_text(
        &self,
        prompt: &str,
        options: &Map<String, Value>,
        on_token: impl FnMut(&TokenEvent),
    ) -> Result<Output> {
        let ids = self.tokenizer.encode(prompt, true)?;
        self.generate(&[ids], options, on_token)
    }
}
