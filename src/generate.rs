//! The generation loop: prompts in steps of up to `PROMPT_CHUNK` tokens, then one token per
//! step for each row, with the processors of the request, until every row stops. A
//! `Generation` is a state machine advanced one step at a time (`step`), so a caller can yield
//! to its event loop between steps and drop it to abort; `Model` stays untouched.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::config::GenerationConfig;
use crate::decoder::{DecoderState, Logits};
use crate::error::{invalid, Error, Result};
use crate::model::{EncoderInput, Model};
use crate::processors::stop_strings::StopStrings;
use crate::processors::{warpers, Chain, ChainInputs, LogitsProcessor, RowContext};
use crate::search;
use crate::search::sampling::Sampler;
use crate::tokenizer::TextStream;
use crate::vision::{ImageInputs, PromptInputs};

mod beams;

/// The most tokens of a row's prompt that one step runs. transformers' `generate()` runs a
/// prompt in one forward pass; so does this loop up to this length. Every step reads all the
/// weights: fp32 SmolLM2's 37-token chat prompt in one step instead of three (32 + 4 + 1, the
/// power-of-two chunks of earlier versions) gave the first token after 260 instead of 348 ms
/// in Node (305 instead of 397 in a fresh process). Longer prompts run this many tokens a step,
/// which bounds a step's attention scores (`[heads, chunk, past + chunk]`) and activations.
/// Dynamically quantized (int8) exports quantize each step's tokens with one scale, so for them
/// the steps change the logits, as they would in transformers.
pub(crate) const PROMPT_CHUNK: usize = 512;

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
    /// Encoder-decoder models: what the encoder reads (row `r` is prompt `r`).
    encoder: Option<EncoderInput>,
    /// Vision-language decoders: each prompt's image features and positions.
    prompt_inputs: Option<Arc<PromptInputs>>,
    chain: Chain,
    /// With `do_sample`: one seeded generator per row.
    sampler: Option<Sampler>,
    stop_strings: Option<StopStrings>,
    /// Rows per prompt (`num_return_sequences` when sampling, else 1).
    per_prompt: usize,
    rows: Vec<Row>,
    groups: Vec<Group>,
    steps: usize,
    /// Beam search (`num_beams > 1`) runs its own path; `rows` and `groups` are then unused.
    beams: Option<beams::BeamRun>,
}

impl Generation {
    /// Prepare a request: validate prompts and options, build the processor chain. For an
    /// encoder-decoder the prompts are the encoder's input and each decoder sequence starts
    /// with `decoder_start_token_id`.
    pub fn new(
        model: &Model,
        prompts: &[Vec<u32>],
        options: &Map<String, Value>,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        Self::with_images(model, prompts, &ImageInputs::default(), options, custom)
    }

    /// `new` for a vision-language decoder: `images` gives the features that replace the
    /// prompts' image tokens and, optionally, the positions of each prompt (see
    /// `crate::vision`).
    pub fn with_images(
        model: &Model,
        prompts: &[Vec<u32>],
        images: &ImageInputs,
        options: &Map<String, Value>,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        let mut config = model.generation_config.clone();
        config.apply_options(options)?;
        if model.is_encoder_decoder() {
            if *images != ImageInputs::default() {
                return Err(Error::Unsupported(
                    "image inputs for an encoder-decoder model".into(),
                ));
            }
            let start = config
                .decoder_start_token_id
                .or(model.decoder_start_token_id())
                .ok_or_else(|| {
                    Error::Model("the encoder-decoder has no `decoder_start_token_id`".into())
                })?;
            if let Some(r) = prompts.iter().position(|p| p.is_empty()) {
                return invalid!("prompt {r} is empty: a prompt needs at least one token");
            }
            let vocab = model.vocab_size();
            for (r, p) in prompts.iter().enumerate() {
                if let Some((i, &t)) = p.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                    return invalid!(
                        "token id {t} at position {i} of prompt {r} is outside the vocabulary (0..{vocab})"
                    );
                }
            }
            let decoder_prompts = vec![vec![start]; prompts.len()];
            let encoder = EncoderInput::Ids(prompts.to_vec());
            return Self::with_config(model, Some(encoder), &decoder_prompts, config, custom);
        }
        Self::build(model, None, prompts, images, config, custom)
    }

    /// Prepare a request with the decoder prompts given; `encoder` is the encoder's input of an
    /// encoder-decoder (one row per prompt), `None` for a decoder-only model.
    pub fn with_config(
        model: &Model,
        encoder: Option<EncoderInput>,
        prompts: &[Vec<u32>],
        config: GenerationConfig,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        Self::build(
            model,
            encoder,
            prompts,
            &ImageInputs::default(),
            config,
            custom,
        )
    }

    fn build(
        model: &Model,
        encoder: Option<EncoderInput>,
        prompts: &[Vec<u32>],
        images: &ImageInputs,
        config: GenerationConfig,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Generation> {
        if let Some(e) = &encoder {
            if e.rows() != prompts.len() {
                return invalid!(
                    "{} encoder inputs for {} decoder prompts",
                    e.rows(),
                    prompts.len()
                );
            }
        }
        if prompts.is_empty() {
            return invalid!("no prompt was given");
        }
        if config.num_beams > 1 && config.do_sample {
            return Err(Error::Unsupported(
                "beam sampling (`do_sample` with `num_beams` > 1) is not supported: use \
                 `num_beams` > 1 without sampling, or sampling with `num_beams` 1"
                    .into(),
            ));
        }
        if config.num_return_sequences > config.num_beams && !config.do_sample {
            return invalid!(
                "`num_return_sequences` ({}) must not exceed `num_beams` ({}) without sampling",
                config.num_return_sequences,
                config.num_beams
            );
        }
        if let Some(seeds) = &config.seed {
            // One seed for all rows, or one per row (sampling with `num_return_sequences = n`
            // runs `n` rows per prompt).
            let per_prompt = if config.do_sample && config.num_beams == 1 {
                config.num_return_sequences
            } else {
                1
            };
            let rows = prompts.len() * per_prompt;
            if seeds.len() != 1 && seeds.len() != rows {
                return invalid!(
                    "`seed` must be one seed or one per row ({rows}), got {} seeds",
                    seeds.len()
                );
            }
        }
        if prompts.iter().all(|p| p.is_empty()) {
            return invalid!(
                "prompt 0 is empty: a prompt needs at least one token (an empty prompt is a \
                 padding row, allowed only beside a non-empty prompt)"
            );
        }
        let vocab = model.vocab_size();
        for (r, p) in prompts.iter().enumerate() {
            if let Some((i, &t)) = p.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return invalid!(
                    "token id {t} at position {i} of prompt {r} is outside the vocabulary (0..{vocab})"
                );
            }
        }
        let prompt_inputs = match &model.vision {
            Some(vision) if encoder.is_none() => {
                Some(Arc::new(PromptInputs::new(vision, prompts, images)?))
            }
            _ if *images != ImageInputs::default() => {
                return Err(Error::Unsupported(
                    "image features or position_ids for a model that is not a vision-language \
                     decoder (its decoder reads input_ids)"
                        .into(),
                ));
            }
            _ => None,
        };
        let inputs = ChainInputs {
            encoder_ids: match &encoder {
                Some(EncoderInput::Ids(ids)) => Some(ids.clone()),
                _ => None,
            },
            encoder_features: encoder.as_ref().is_some_and(EncoderInput::is_features),
        };
        let chain = Chain::build_with(&config, vocab, &inputs, custom)?;
        if config.num_beams > 1 {
            let beams = Some(beams::BeamRun::new(
                model,
                encoder.clone(),
                prompt_inputs.clone(),
                prompts,
                &config,
            )?);
            return Ok(Generation {
                config,
                encoder,
                prompt_inputs,
                chain,
                sampler: None,
                stop_strings: None,
                per_prompt: 1,
                rows: vec![],
                groups: vec![],
                steps: 0,
                beams,
            });
        }
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
                budget: if encoder.is_some() {
                    config.seq2seq_new_token_budget(p.len())
                } else {
                    config.new_token_budget(p.len())
                }
                .max(1),
                // An empty prompt is a padding row: it yields no token.
                finish: p.is_empty().then_some(FinishReason::Length),
                stream: TextStream::new(),
                scores: vec![],
                logprobs: vec![],
                top_logprobs: vec![],
            })
            .collect();
        let groups = group_rows(model, &rows);
        Ok(Generation {
            config,
            encoder,
            prompt_inputs,
            chain,
            sampler,
            stop_strings,
            per_prompt,
            rows,
            groups,
            steps: 0,
            beams: None,
        })
    }

    /// The effective configuration of this request.
    pub fn config(&self) -> &GenerationConfig {
        &self.config
    }

    /// Whether every row has stopped.
    pub fn is_finished(&self) -> bool {
        if let Some(b) = &self.beams {
            return b.is_finished();
        }
        self.rows.iter().all(|r| r.finish.is_some())
    }

    /// Decoder steps run so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Run one decoder step and return the tokens it produced.
    pub fn step(&mut self, model: &Model) -> Result<Vec<TokenEvent>> {
        if let Some(b) = &mut self.beams {
            if b.is_finished() {
                return Ok(vec![]);
            }
            self.steps += 1;
            return b.step(model, &self.config, &mut self.chain);
        }
        let Some(g) = self
            .groups
            .iter()
            .position(|g| g.active.iter().any(|&r| self.rows[r].finish.is_none()))
        else {
            return Ok(vec![]);
        };
        let want_logprobs = self.config.output_scores || self.config.top_logprobs > 0;
        if self.groups[g].state.is_none() {
            let capacity = self.groups[g]
                .rows
                .iter()
                .map(|&r| self.rows[r].prompt_len + self.rows[r].budget)
                .max()
                .unwrap_or(1);
            // The encoder row of each row: its prompt.
            let rows_of: Vec<usize> = self.groups[g]
                .rows
                .iter()
                .map(|r| r / self.per_prompt.max(1))
                .collect();
            let encoder = self.encoder.as_ref().map(|e| (e, rows_of.as_slice()));
            let prompts = self.prompt_inputs.as_ref().map(|p| (p, rows_of.as_slice()));
            let mut state = model.start_rows(rows_of.len(), capacity, encoder, prompts)?;
            // Greedy decoding, and sampling with `top_k`, without scores read bounds of the
            // logits where they are cheaper.
            let bounded = self.sampler.is_none() || self.chain.top_k().is_some();
            state.bound_logits(bounded && !want_logprobs);
            self.groups[g].state = Some(state);
        }
        let group = &mut self.groups[g];
        let state = group
            .state
            .as_mut()
            .ok_or_else(|| Error::Backend("no decoder state".into()))?;

        // The tokens of this step: each row's pending tokens, at most `PROMPT_CHUNK`.
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
        let chunk = most.min(PROMPT_CHUNK);
        let may_differ = state.rows_may_differ();
        let tokens: Vec<&[u32]> = group
            .active
            .iter()
            .zip(&pending)
            .map(|(&r, &p)| {
                let row = &self.rows[r];
                if row.finish.is_some() && !may_differ && chunk > 0 {
                    // `grow` mode: a finished row still in the batch takes a throwaway token,
                    // so that the rows keep equal lengths.
                    &row.ids[row.ids.len() - 1..]
                } else {
                    &row.ids[row.fed..row.fed + p.min(chunk)]
                }
            })
            .collect();
        let mut logits = state.step(&tokens)?;
        self.steps += 1;

        let mut events = vec![];
        for (i, &r) in group.active.iter().enumerate() {
            let row = &mut self.rows[r];
            row.fed += pending[i].min(chunk);
            if row.finish.is_some() || row.fed < row.ids.len() {
                continue;
            }
            // The row's last token is in the cache: choose the next one.
            let ctx = RowContext {
                row: r,
                ids: &row.ids,
                prompt_len: row.prompt_len,
                max_length: row.prompt_len + row.budget,
            };
            let mut logprob = None;
            let mut top = None;
            let token = if logits.is_bounded(i) && !want_logprobs {
                match self.sampler.as_mut() {
                    None => bounded_argmax(&mut logits, i, &ctx, &mut self.chain)?,
                    Some(sampler) => {
                        let scores = bounded_top_k(&mut logits, i, &ctx, &mut self.chain)?;
                        sampler.sample(r, &scores)?
                    }
                }
            } else {
                logits.make_row_exact(i)?;
                let mut scores = logits.row(i).to_vec();
                self.chain.apply(&ctx, &mut scores)?;
                let token = match self.sampler.as_mut() {
                    Some(sampler) => sampler.sample(r, &scores)?,
                    None => search::argmax(&scores),
                };
                // Scores and log-probs only when asked for.
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
                token
            };
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

        // Rows that stopped leave the batch, so they cost no more work, when the backend can
        // run the smaller batch without compiling a plan for it (which costs more than it
        // saves: see `examples/bench_batch.rs`); otherwise they sit the next steps out.
        let keep: Vec<usize> = (0..group.active.len())
            .filter(|&i| self.rows[group.active[i]].finish.is_none())
            .collect();
        if !keep.is_empty() && keep.len() < group.active.len() && state.is_ready_for(keep.len()) {
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
        if let Some(b) = &mut self.beams {
            b.abort();
        }
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
        if let Some(b) = &self.beams {
            return Ok(Output {
                sequences: b.output(model, &self.config)?,
            });
        }
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

/// The most logits that `bounded_argmax` makes exact one at a time before it computes the
/// whole row (bounds that rarely separate the winner, as a model's could).
const MAX_REFINED: usize = 64;

/// Greedy decoding's token for row `i` of `logits`, a row of upper bounds of the logits
/// (`Logits::bounds`): the token of the exact logits, ties included. The chain runs on the
/// bounds, which its processors map to bounds of their scores once the logits they need are
/// exact (`LogitsProcessor::on_bounds`); while the winner's score is only a bound, its logit is
/// made exact and the chain runs again. An exact winner's score is then at least every
/// token's exact score, and more than that of every token before it, so `argmax` (the first
/// largest, as `torch.argmax`) gives the same token on the exact scores.
fn bounded_argmax(
    logits: &mut Logits,
    i: usize,
    ctx: &RowContext,
    chain: &mut Chain,
) -> Result<u32> {
    match chain.exact_needed(ctx) {
        Some(tokens) => logits.make_exact(i, &tokens)?,
        None => logits.make_row_exact(i)?,
    }
    let mut scores = Vec::with_capacity(logits.vocab);
    let mut refined = 0;
    loop {
        if refined == MAX_REFINED {
            logits.make_row_exact(i)?;
        }
        scores.clear();
        scores.extend_from_slice(logits.row(i));
        chain.apply(ctx, &mut scores)?;
        let token = search::argmax(&scores);
        if logits.is_exact(i, token) {
            return Ok(token);
        }
        logits.make_exact(i, &[token])?;
        refined += 1;
    }
}

/// How many logits `bounded_top_k` may make exact one by one before it computes the whole row
/// instead: this many, or an eighth of a larger vocabulary.
const MAX_REFINED_TOP_K: usize = 1024;

/// Sampling's scores for row `i` of `logits`, a row of upper bounds of the logits, with a
/// chain that has `top_k` (`Chain::top_k`; without it the row is made exact): the scores of the
/// exact logits, bit for bit. The processors before `top_k` map bounds to bounds of their
/// scores (as in `bounded_argmax`). Once every token whose score reaches the k-th largest is
/// exact, that k-th largest is the exact scores' k-th largest too (the exact scores of the
/// others are below their bounds, so below it), and transformers' `TopKLogitsWarper` (scores
/// below `torch.topk(scores, k)[0][..., -1]` become `-inf`) keeps the same tokens with the same
/// scores: the warpers after it then see the exact row's values.
fn bounded_top_k(
    logits: &mut Logits,
    i: usize,
    ctx: &RowContext,
    chain: &mut Chain,
) -> Result<Vec<f32>> {
    let Some(k) = chain.top_k() else {
        logits.make_row_exact(i)?;
        let mut scores = logits.row(i).to_vec();
        chain.apply(ctx, &mut scores)?;
        return Ok(scores);
    };
    let vocab = logits.vocab;
    let k = k.clamp(1, vocab.max(1));
    // How many logits of the row were made exact, at most (a row of bounds starts with none).
    let needed = match chain.exact_needed(ctx) {
        Some(tokens) => {
            logits.make_exact(i, &tokens)?;
            tokens.len()
        }
        None => {
            logits.make_row_exact(i)?;
            0
        }
    };
    let most = (vocab / 8).max(MAX_REFINED_TOP_K);
    let mut scores = Vec::with_capacity(vocab);
    let mut buf = vec![];
    let (mut wider, mut refined) = (k, 0);
    loop {
        scores.clear();
        scores.extend_from_slice(logits.row(i));
        chain.apply_before_top_k(ctx, &mut scores)?;
        // `top_k` keeps at least k scores: with fewer exact logits, some of those it keeps are
        // surely not exact (the first round, mostly), and the cut waits for the next round.
        let mut nan_cut = false;
        if !logits.is_bounded(i) || needed + refined >= k {
            let kth = warpers::kth_largest(&scores, k, &mut buf);
            let missing = (0..vocab)
                .any(|j| warpers::top_k_keeps(scores[j], kth) && !logits.is_exact(i, j as u32));
            if !missing {
                chain.apply_from_top_k(ctx, &mut scores, kth)?;
                return Ok(scores);
            }
            nan_cut = kth.is_nan();
        }
        // Each round costs passes over the row and each logit one dot product, so each round
        // makes exact the tokens that reach the `wider`-th largest score, four times more each
        // time: 4k, then 16k (SmolLM2 with k = 50 needs 100-200).
        wider = (wider * 4).min(vocab);
        let reach = warpers::kth_largest(&scores, wider, &mut buf);
        let tokens: Vec<u32> = (0..vocab as u32)
            .filter(|&j| warpers::top_k_keeps(scores[j as usize], reach) && !logits.is_exact(i, j))
            .collect();
        refined += tokens.len();
        // A NaN cut keeps every score (and `tokens` could miss some): the whole row; so too if
        // no token were left to make exact (the counts above rule it out: a guard).
        if nan_cut || refined > most || tokens.is_empty() {
            logits.make_row_exact(i)?;
        } else {
            logits.make_exact(i, &tokens)?;
        }
    }
}

/// One group of all rows, or in `grow` mode one group per prompt length.
fn group_rows(model: &Model, rows: &[Row]) -> Vec<Group> {
    let lengths: Vec<usize> = rows.iter().map(|r| r.prompt_len).collect();
    group_by_length(model, &lengths)
        .into_iter()
        .map(|rows| Group {
            active: rows.clone(),
            rows,
            state: None,
        })
        .collect()
}

/// The rows that share a decoder state: all non-empty prompts, or in `grow` mode (where the
/// rows of a step must have equal lengths) the prompts of each length, shortest first. Empty
/// prompts are padding rows and run in no group.
fn group_by_length(model: &Model, lengths: &[usize]) -> Vec<Vec<usize>> {
    let real = |len: usize| {
        (0..lengths.len()).filter(move |&r| lengths[r] > 0 && (len == 0 || lengths[r] == len))
    };
    if model.signature.cache_mode != crate::model::signature::CacheMode::Grow {
        let all: Vec<usize> = real(0).collect();
        return if all.is_empty() { vec![] } else { vec![all] };
    }
    let mut distinct: Vec<usize> = lengths.iter().copied().filter(|&l| l > 0).collect();
    distinct.sort_unstable();
    distinct.dedup();
    distinct
        .into_iter()
        .map(|len| real(len).collect())
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::GenerationConfig;
    use crate::decoder::{BoundRow, Bounds, Head};

    /// A head whose exact logits are given.
    struct Exact(Vec<f32>);

    impl Head for Exact {
        fn logit(&self, _: &[f32], j: usize) -> Result<f32> {
            Ok(self.0[j])
        }
        fn logits(&self, _: &[f32], out: &mut [f32]) -> Result<()> {
            out.copy_from_slice(&self.0);
            Ok(())
        }
    }

    /// Uniform draws in [0, 1) of a fixed sequence (xorshift).
    fn uniform() -> impl FnMut() -> f32 {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Exact logits in quarter steps (so that ties are common), and one row of upper bounds of
    /// them, from exact to far above, whose head gives the exact ones.
    fn bounded_logits(vocab: usize, next: &mut impl FnMut() -> f32) -> (Vec<f32>, Logits) {
        let exact: Vec<f32> = (0..vocab)
            .map(|_| (next() * 16.0).floor() / 4.0 - 2.0)
            .collect();
        let bounds: Vec<f32> = exact
            .iter()
            .map(|&e| match (next() * 3.0) as u32 {
                0 => e,
                1 => e + next() * 0.5,
                _ => e + next() * 4.0,
            })
            .collect();
        let logits = Logits {
            rows: 1,
            vocab,
            data: bounds,
            bounds: Some(Bounds {
                head: Arc::new(Exact(exact.clone())),
                rows: vec![Some(BoundRow::new(vec![], vocab))],
            }),
        };
        (exact, logits)
    }

    /// The chain of `config`, with `Shift` as a custom processor when `custom`.
    fn chain_of(config: &GenerationConfig, vocab: usize, custom: bool) -> Chain {
        let extra: Vec<Box<dyn LogitsProcessor>> = match custom {
            true => vec![Box::new(Shift)],
            false => vec![],
        };
        Chain::build(config, vocab, extra).unwrap()
    }

    /// Reads every score: the chain then needs every logit exact.
    struct Shift;

    impl LogitsProcessor for Shift {
        fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            scores.iter_mut().for_each(|s| *s -= max);
            Ok(())
        }
    }

    /// Greedy decoding on upper bounds of the logits gives the token of the exact logits,
    /// with each kind of processor (monotone, needing some logits exact, needing all), on
    /// logits with ties and bounds from exact to far above.
    #[test]
    fn bounded_argmax_is_the_exact_argmax() {
        let vocab = 40;
        let configs: Vec<GenerationConfig> = vec![
            GenerationConfig::default(),
            GenerationConfig {
                repetition_penalty: 1.3,
                ..Default::default()
            },
            GenerationConfig {
                repetition_penalty: 0.6,
                no_repeat_ngram_size: 2,
                ..Default::default()
            },
            GenerationConfig {
                eos_token_id: Some(vec![2, 5]),
                exponential_decay_length_penalty: Some((0, 4.0)),
                min_new_tokens: Some(1),
                ..Default::default()
            },
            GenerationConfig {
                eos_token_id: Some(vec![2]),
                sequence_bias: Some(vec![(vec![7], 2.5), (vec![9, 8], -1.0)]),
                suppress_tokens: Some(vec![1, 3]),
                ..Default::default()
            },
            GenerationConfig {
                eos_token_id: Some(vec![2]),
                bad_words_ids: Some(vec![vec![6], vec![11, 4]]),
                encoder_repetition_penalty: 1.5,
                encoder_no_repeat_ngram_size: 2,
                ..Default::default()
            },
            GenerationConfig {
                eos_token_id: Some(vec![2]),
                forced_eos_token_id: Some(vec![2]),
                ..Default::default()
            },
            GenerationConfig {
                begin_suppress_tokens: Some(vec![0, 5]),
                ..Default::default()
            },
            GenerationConfig {
                renormalize_logits: true,
                ..Default::default()
            },
        ];
        let ids: Vec<u32> = vec![4, 9, 7, 8, 9, 11, 30];
        // Forced EOS acts at the last token (`max_length` 8), begin-suppress at the first
        // (`prompt_len` 7).
        let ctx = |c: usize| RowContext {
            row: 0,
            ids: &ids,
            prompt_len: if c == 7 { 7 } else { 3 },
            max_length: if c == 6 { 8 } else { 20 },
        };
        let mut next = uniform();
        let mut refined = 0;
        for (c, config) in configs.iter().enumerate() {
            for custom in [false, true] {
                for trial in 0..200 {
                    let (exact, mut logits) = bounded_logits(vocab, &mut next);
                    let ctx = ctx(c);
                    let mut chain = chain_of(config, vocab, custom);
                    let mut scores = exact.clone();
                    chain.apply(&ctx, &mut scores).unwrap();
                    let want = search::argmax(&scores);
                    let mut chain = chain_of(config, vocab, custom);
                    let got = bounded_argmax(&mut logits, 0, &ctx, &mut chain).unwrap();
                    assert_eq!(got, want, "config {c}, custom {custom}, trial {trial}");
                    if logits.is_bounded(0) {
                        refined += 1;
                    }
                }
            }
        }
        // The rows of the chains without a processor that reads every score kept bounds.
        assert_eq!(refined, 8 * 200, "rows that kept bounds");
    }

    /// Sampling's scores from upper bounds of the logits are the exact logits' scores bit for
    /// bit, with `top_k` from 1 to beyond the vocabulary (ties at its cut are common), each
    /// warper after it and processors before it; a chain without `top_k`, or with a processor
    /// that reads every score, makes the row exact.
    #[test]
    fn bounded_top_k_gives_the_exact_scores() {
        let vocab = 40;
        let sample = |top_k| GenerationConfig {
            do_sample: true,
            top_k,
            ..Default::default()
        };
        let configs: Vec<GenerationConfig> = vec![
            sample(1),
            GenerationConfig {
                temperature: 0.7,
                ..sample(5)
            },
            GenerationConfig {
                top_p: 0.9,
                repetition_penalty: 1.3,
                ..sample(12)
            },
            sample(40),
            sample(100),
            GenerationConfig {
                temperature: 1.6,
                min_p: Some(0.1),
                typical_p: 0.8,
                epsilon_cutoff: 0.05,
                eta_cutoff: 0.01,
                renormalize_logits: true,
                ..sample(8)
            },
            GenerationConfig {
                eos_token_id: Some(vec![2, 5]),
                exponential_decay_length_penalty: Some((0, 4.0)),
                min_new_tokens: Some(1),
                no_repeat_ngram_size: 2,
                suppress_tokens: Some(vec![1, 3]),
                ..sample(6)
            },
            GenerationConfig {
                top_p: 0.8,
                ..sample(0)
            },
        ];
        let ids: Vec<u32> = vec![4, 9, 7, 8, 9, 11, 30];
        let ctx = RowContext {
            row: 0,
            ids: &ids,
            prompt_len: 3,
            max_length: 20,
        };
        let mut next = uniform();
        let mut kept_bounds = 0;
        for (c, config) in configs.iter().enumerate() {
            for custom in [false, true] {
                for trial in 0..200 {
                    let (exact, mut logits) = bounded_logits(vocab, &mut next);
                    let mut chain = chain_of(config, vocab, custom);
                    let mut want = exact.clone();
                    chain.apply(&ctx, &mut want).unwrap();
                    let mut chain = chain_of(config, vocab, custom);
                    let got = bounded_top_k(&mut logits, 0, &ctx, &mut chain).unwrap();
                    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "config {c}, custom {custom}, {trial}"
                    );
                    if logits.is_bounded(0) {
                        kept_bounds += 1;
                    }
                }
            }
        }
        // The chains with `top_k` and without a processor that reads every score.
        assert_eq!(kept_bounds, 7 * 200, "rows that kept bounds");
    }
}
