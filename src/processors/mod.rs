//! Logits processors: one trait, one chain built once per request in the order of
//! transformers 4.57's `GenerationMixin._get_logits_processor`:
//!
//! sequence_bias, encoder_repetition_penalty, repetition_penalty, no_repeat_ngram_size,
//! encoder_no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens, forced_bos_token_id,
//! forced_eos_token_id, exponential_decay_length_penalty, suppress_tokens, begin_suppress_tokens,
//! custom processors; then, only with `do_sample`: temperature, top_k, top_p, min_p, typical_p,
//! epsilon_cutoff, eta_cutoff; `renormalize_logits` last.
//!
//! Each processor changes one row's scores in place and sees what transformers' processors see
//! (`RowContext`): the prompt and the new tokens (for an encoder-decoder, the decoder sequence
//! starting with `decoder_start_token_id`), and the row's `max_length`.

pub mod bad_words;
pub mod forced;
pub mod lengths;
pub mod ngram;
pub mod penalties;
pub mod stop_strings;
pub mod suppress;
pub mod warpers;

use crate::config::GenerationConfig;
use crate::error::{invalid, Result};

/// What a processor may look at for one row.
#[derive(Debug, Clone, Copy)]
pub struct RowContext<'a> {
    /// Index of the row in the request.
    pub row: usize,
    /// The sequence the processors see: the prompt and the new tokens (for an encoder-decoder,
    /// the decoder sequence starting with `decoder_start_token_id`).
    pub ids: &'a [u32],
    /// Length of the prompt part of `ids` (transformers' `input_ids_seq_length`).
    pub prompt_len: usize,
    /// transformers' `max_length` of this row: prompt length + max new tokens.
    pub max_length: usize,
}

impl RowContext<'_> {
    /// transformers' `cur_len`: `input_ids.shape[-1]`.
    pub fn cur_len(&self) -> usize {
        self.ids.len()
    }

    pub fn new_tokens(&self) -> usize {
        self.ids.len().saturating_sub(self.prompt_len)
    }

    /// The prompt part of `ids` (for a decoder-only model, transformers' `inputs_tensor`, which
    /// the encoder processors read when there is no encoder).
    pub fn prompt(&self) -> &[u32] {
        &self.ids[..self.prompt_len.min(self.ids.len())]
    }
}

/// A logits processor: changes the scores of one row in place.
///
/// Custom processors implement this trait too; they run where transformers runs the
/// `logits_processor` list given to `generate()`: after the built-in processors and before the
/// sampling warpers.
pub trait LogitsProcessor {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()>;

    /// What the processor needs to turn upper bounds of the logits into upper bounds of its
    /// scores (greedy decoding computes exactly only the logits that can win:
    /// `decoder::Bounds`). The default, for processors that read every score (custom ones
    /// among them): every logit exact.
    fn on_bounds(&self, ctx: &RowContext) -> OnBounds {
        let _ = ctx;
        OnBounds::AllExact
    }
}

/// See [`LogitsProcessor::on_bounds`].
#[derive(Debug, Clone, PartialEq)]
pub enum OnBounds {
    /// Each token's new score is a non-decreasing function of its own score (given the
    /// context): a bound in gives a bound out, an exact score an exact one.
    Monotone,
    /// Every score stays as it is except those of these tokens, which must be exact.
    ExactAt(Vec<u32>),
    /// Every score must be exact.
    AllExact,
}

/// What the chain builder needs beyond the configuration.
#[derive(Debug, Clone, Default)]
pub struct ChainInputs {
    /// The encoder input ids of each prompt (encoder-decoder models), for
    /// `encoder_repetition_penalty` and `encoder_no_repeat_ngram_size`; row `r` reads those of
    /// prompt `r / rows_per_prompt(config)`. `None`: a decoder-only model, where transformers
    /// gives those processors the prompt (`inputs_tensor`), which the processors then read from
    /// `RowContext::prompt`.
    pub encoder_ids: Option<Vec<Vec<u32>>>,
    /// The encoder reads features, not token ids (Whisper): transformers then ignores the
    /// encoder processors (with a warning), and so does the chain.
    pub encoder_features: bool,
}

/// The processors of one request, in transformers' order.
#[derive(Default)]
pub struct Chain {
    processors: Vec<Box<dyn LogitsProcessor>>,
    /// Sampling with `top_k`: where the warper sits among `processors`, and its `k`.
    top_k: Option<(usize, usize)>,
}

impl Chain {
    /// Build the chain for `config` over a vocabulary of `vocab` tokens for a decoder-only model.
    /// `custom` processors go where transformers puts user processors: after the built-in
    /// processors and before the sampling warpers.
    pub fn build(
        config: &GenerationConfig,
        vocab: usize,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Chain> {
        Self::build_with(config, vocab, &ChainInputs::default(), custom)
    }

    /// `build`, with the encoder inputs of an encoder-decoder model.
    pub fn build_with(
        config: &GenerationConfig,
        vocab: usize,
        inputs: &ChainInputs,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Chain> {
        validate(config, vocab)?;
        let eos = config.eos_ids().to_vec();
        let mut p: Vec<Box<dyn LogitsProcessor>> = vec![];

        if let Some(bias) = &config.sequence_bias {
            p.push(Box::new(bad_words::SequenceBias::new(
                "sequence_bias",
                bias,
                vocab,
            )?));
        }
        let per_prompt = rows_per_prompt(config);
        if config.encoder_repetition_penalty != 1.0 && !inputs.encoder_features {
            p.push(Box::new(penalties::EncoderRepetitionPenalty::new(
                config.encoder_repetition_penalty,
                inputs.encoder_ids.clone(),
                per_prompt,
            )?));
        }
        if config.repetition_penalty != 1.0 {
            p.push(Box::new(penalties::RepetitionPenalty::new(
                config.repetition_penalty,
            )?));
        }
        if config.no_repeat_ngram_size > 0 {
            p.push(Box::new(ngram::NoRepeatNGram::new(
                config.no_repeat_ngram_size,
            )?));
        }
        if config.encoder_no_repeat_ngram_size > 0 && !inputs.encoder_features {
            p.push(Box::new(ngram::EncoderNoRepeatNGram::new(
                config.encoder_no_repeat_ngram_size,
                inputs.encoder_ids.clone(),
                per_prompt,
            )?));
        }
        if let Some(bad) = &config.bad_words_ids {
            p.push(Box::new(bad_words::SequenceBias::bad_words(
                bad, &eos, vocab,
            )?));
        }
        // `_prepare_generated_length`: `min_new_tokens` replaces `min_length` by
        // `min_new_tokens + input length`; both processors are then added (they agree).
        if !eos.is_empty() {
            if let Some(n) = config.min_new_tokens {
                if n > 0 {
                    p.push(Box::new(lengths::MinLength::new(
                        lengths::MinLengthFrom::PromptPlus(n),
                        eos.clone(),
                    )));
                    p.push(Box::new(lengths::MinNewTokens::new(n, eos.clone())));
                }
            } else if config.min_length > 0 {
                p.push(Box::new(lengths::MinLength::new(
                    lengths::MinLengthFrom::Fixed(config.min_length),
                    eos.clone(),
                )));
            }
        }
        if let Some(bos) = config.forced_bos_token_id {
            p.push(Box::new(forced::ForcedBos::new(bos)));
        }
        if let Some(ids) = &config.forced_eos_token_id {
            p.push(Box::new(forced::ForcedEos::new(ids.clone())));
        }
        if let Some((start, factor)) = config.exponential_decay_length_penalty {
            if eos.is_empty() {
                return invalid!(
                    "`exponential_decay_length_penalty` needs an `eos_token_id`, and none is set"
                );
            }
            p.push(Box::new(penalties::ExponentialDecayLengthPenalty::new(
                start,
                factor,
                eos.clone(),
            )));
        }
        if let Some(ids) = &config.suppress_tokens {
            p.push(Box::new(suppress::Suppress::new(ids, vocab)));
        }
        if let Some(ids) = &config.begin_suppress_tokens {
            // `_get_logits_processor`: with a forced BOS and a one-token input, the first
            // generated token is the BOS, so the suppression moves to the second one.
            p.push(Box::new(suppress::BeginSuppress::new(
                ids,
                config.forced_bos_token_id.is_some(),
            )));
        }
        p.extend(custom);

        let mut top_k = None;
        if config.do_sample {
            // `min_tokens_to_keep`: 1, or with beam sampling one more than the eos tokens.
            let keep = if config.num_beams > 1 {
                eos.len().max(1) + 1
            } else {
                1
            };
            if config.temperature != 1.0 {
                p.push(Box::new(warpers::Temperature::new(config.temperature)?));
            }
            if config.top_k != 0 {
                let warper = warpers::TopK::new(config.top_k, keep);
                top_k = Some((p.len(), warper.k()));
                p.push(Box::new(warper));
            }
            if config.top_p < 1.0 {
                p.push(Box::new(warpers::TopP::new(config.top_p, keep)?));
            }
            if let Some(min_p) = config.min_p {
                p.push(Box::new(warpers::MinP::new(min_p, keep)?));
            }
            if config.typical_p < 1.0 {
                p.push(Box::new(warpers::Typical::new(config.typical_p, keep)?));
            }
            if 0.0 < config.epsilon_cutoff && config.epsilon_cutoff < 1.0 {
                p.push(Box::new(warpers::Epsilon::new(config.epsilon_cutoff, keep)));
            }
            if 0.0 < config.eta_cutoff && config.eta_cutoff < 1.0 {
                p.push(Box::new(warpers::Eta::new(config.eta_cutoff, keep)));
            }
        }
        if config.renormalize_logits {
            p.push(Box::new(warpers::LogNormalize));
        }
        Ok(Chain {
            processors: p,
            top_k,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.processors.is_empty()
    }

    pub fn len(&self) -> usize {
        self.processors.len()
    }

    /// The `k` of the chain's `top_k` warper (sampling), if it has one.
    pub fn top_k(&self) -> Option<usize> {
        self.top_k.map(|(_, k)| k)
    }

    /// How many processors see upper bounds of the logits (`LogitsProcessor::on_bounds`):
    /// those before `top_k`, or all of a chain without it. `top_k` and the warpers after it
    /// see exact scores where it keeps them (`generate::bounded_top_k`).
    fn bounded(&self) -> usize {
        self.top_k.map_or(self.processors.len(), |(at, _)| at)
    }

    /// The logits that the processors before `top_k` (all, without it) need exact, given
    /// upper bounds of the others; `None`: every logit.
    pub fn exact_needed(&self, ctx: &RowContext) -> Option<Vec<u32>> {
        let mut tokens = vec![];
        for p in &self.processors[..self.bounded()] {
            match p.on_bounds(ctx) {
                OnBounds::Monotone => {}
                OnBounds::ExactAt(t) => tokens.extend(t),
                OnBounds::AllExact => return None,
            }
        }
        Some(tokens)
    }

    /// Apply every processor to one row's scores.
    pub fn apply(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        for p in &mut self.processors {
            p.process(ctx, scores)?;
        }
        Ok(())
    }

    /// The processors before `top_k` (every one, in a chain without it).
    pub fn apply_before_top_k(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let at = self.bounded();
        for p in &mut self.processors[..at] {
            p.process(ctx, scores)?;
        }
        Ok(())
    }

    /// `top_k`, given its cut `kth` (the k-th largest of `scores`, which the caller has
    /// computed: `warpers::kth_largest`), and the warpers after it (none, in a chain without
    /// `top_k`).
    pub fn apply_from_top_k(
        &mut self,
        ctx: &RowContext,
        scores: &mut [f32],
        kth: f32,
    ) -> Result<()> {
        let Some((at, _)) = self.top_k else {
            return Ok(());
        };
        warpers::top_k_cut(scores, kth);
        for p in &mut self.processors[at + 1..] {
            p.process(ctx, scores)?;
        }
        Ok(())
    }
}

/// Rows of a request per prompt: `RowContext::row` is `prompt * rows_per_prompt + i` (the beams
/// of beam search, the samples of `num_return_sequences`).
pub fn rows_per_prompt(config: &GenerationConfig) -> usize {
    if config.num_beams > 1 {
        config.num_beams
    } else if config.do_sample {
        config.num_return_sequences.max(1)
    } else {
        1
    }
}

/// The checks of transformers' `GenerationConfig.validate` and of the processor constructors,
/// phrased for this API. Sampling options are checked only with `do_sample` (transformers only
/// warns about them otherwise, and model files often carry them).
pub fn validate(config: &GenerationConfig, vocab: usize) -> Result<()> {
    if config.repetition_penalty.is_nan() || config.repetition_penalty <= 0.0 {
        return invalid!(
            "`repetition_penalty` must be a strictly positive number, got {}",
            config.repetition_penalty
        );
    }
    if config.encoder_repetition_penalty.is_nan() || config.encoder_repetition_penalty <= 0.0 {
        return invalid!(
            "`encoder_repetition_penalty` must be a strictly positive number, got {}",
            config.encoder_repetition_penalty
        );
    }
    if config.num_return_sequences > 1 && config.num_beams == 1 && !config.do_sample {
        return invalid!(
            "greedy search returns one sequence per prompt: `num_return_sequences` must be 1 \
             without sampling or beams, got {}",
            config.num_return_sequences
        );
    }
    check_ids(
        "bad_words_ids",
        config.bad_words_ids.iter().flatten().flatten(),
        vocab,
    )?;
    check_ids(
        "suppress_tokens",
        config.suppress_tokens.iter().flatten(),
        vocab,
    )?;
    check_ids(
        "begin_suppress_tokens",
        config.begin_suppress_tokens.iter().flatten(),
        vocab,
    )?;
    check_ids(
        "forced_bos_token_id",
        config.forced_bos_token_id.iter(),
        vocab,
    )?;
    check_ids(
        "forced_eos_token_id",
        config.forced_eos_token_id.iter().flatten(),
        vocab,
    )?;
    check_ids(
        "sequence_bias",
        config
            .sequence_bias
            .iter()
            .flatten()
            .flat_map(|(ids, _)| ids),
        vocab,
    )?;
    if let Some(bad) = &config.bad_words_ids {
        if bad.is_empty() {
            return invalid!("`bad_words_ids` must be a non-empty list of lists of token ids");
        }
    }
    if let Some(bias) = &config.sequence_bias {
        if bias.is_empty() || bias.iter().any(|(ids, _)| ids.is_empty()) {
            return invalid!(
                "`sequence_bias` must be a non-empty list of [non-empty token id list, bias]"
            );
        }
    }
    if config.do_sample {
        if config.temperature.is_nan() || config.temperature <= 0.0 {
            let hint = if config.temperature == 0.0 {
                " (for greedy decoding, set `do_sample` to false)"
            } else {
                ""
            };
            return invalid!(
                "`temperature` must be strictly positive when sampling, got {}{hint}",
                config.temperature
            );
        }
        if !(config.top_p > 0.0 && config.top_p <= 1.0) {
            return invalid!("`top_p` must be in (0, 1], got {}", config.top_p);
        }
        if let Some(min_p) = config.min_p {
            if !(0.0..=1.0).contains(&min_p) {
                return invalid!("`min_p` must be in [0, 1], got {min_p}");
            }
        }
        if !(config.typical_p > 0.0 && config.typical_p <= 1.0) {
            return invalid!("`typical_p` must be in (0, 1], got {}", config.typical_p);
        }
        for (name, v) in [
            ("epsilon_cutoff", config.epsilon_cutoff),
            ("eta_cutoff", config.eta_cutoff),
        ] {
            if !(0.0..1.0).contains(&v) {
                return invalid!("`{name}` must be in [0, 1) (0 turns it off), got {v}");
            }
        }
    }
    Ok(())
}

fn check_ids<'a>(name: &str, ids: impl Iterator<Item = &'a u32>, vocab: usize) -> Result<()> {
    let bad: Vec<u32> = ids.copied().filter(|&t| t as usize >= vocab).collect();
    if bad.is_empty() {
        Ok(())
    } else {
        invalid!("`{name}` has token ids outside the vocabulary (0..{vocab}): {bad:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(f: impl FnOnce(&mut GenerationConfig)) -> GenerationConfig {
        let mut c = GenerationConfig {
            eos_token_id: Some(vec![2]),
            ..GenerationConfig::default()
        };
        f(&mut c);
        c
    }

    fn err(c: GenerationConfig) -> String {
        match Chain::build(&c, 10, vec![]) {
            Ok(_) => panic!("expected an error for {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_values_are_refused_with_their_name() {
        let m = err(config(|c| {
            c.do_sample = true;
            c.temperature = 0.0;
        }));
        assert!(m.contains("temperature") && m.contains("do_sample"), "{m}");
        for t in [-1.0, f32::NAN] {
            let m = err(config(|c| {
                c.do_sample = true;
                c.temperature = t;
            }));
            assert!(m.contains("temperature"), "{m}");
        }
        for top_p in [0.0, -0.5, 1.5] {
            let m = err(config(|c| {
                c.do_sample = true;
                c.top_p = top_p;
            }));
            assert!(m.contains("top_p"), "{m}");
        }
        for penalty in [0.0, -1.0, f32::NAN] {
            let m = err(config(|c| c.repetition_penalty = penalty));
            assert!(m.contains("repetition_penalty"), "{m}");
            let m = err(config(|c| c.encoder_repetition_penalty = penalty));
            assert!(m.contains("encoder_repetition_penalty"), "{m}");
        }
        let m = err(config(|c| {
            c.bad_words_ids = Some(vec![vec![3], vec![4, 10]])
        }));
        assert!(m.contains("bad_words_ids") && m.contains("[10]"), "{m}");
        let m = err(config(|c| c.suppress_tokens = Some(vec![11])));
        assert!(m.contains("suppress_tokens") && m.contains("11"), "{m}");
        let m = err(config(|c| c.num_return_sequences = 2));
        assert!(m.contains("num_return_sequences"), "{m}");
    }

    #[test]
    fn sampling_options_are_ignored_without_sampling() {
        let c = config(|c| {
            c.temperature = 0.0;
            c.top_p = 0.5;
            c.top_k = 3;
        });
        assert!(Chain::build(&c, 10, vec![]).unwrap().is_empty());
    }

    #[test]
    fn negative_top_k_is_refused_by_the_options() {
        let mut c = GenerationConfig::default();
        let o = serde_json::json!({"top_k": -1});
        let m = c
            .apply_options(o.as_object().unwrap())
            .unwrap_err()
            .to_string();
        assert!(m.contains("top_k"), "{m}");
    }

    struct AddOne;
    impl LogitsProcessor for AddOne {
        fn process(&mut self, _: &RowContext, scores: &mut [f32]) -> Result<()> {
            scores.iter_mut().for_each(|s| *s += 1.0);
            Ok(())
        }
    }

    /// Custom processors run after suppress_tokens and before temperature.
    #[test]
    fn custom_processors_sit_before_the_warpers() {
        let c = config(|c| {
            c.suppress_tokens = Some(vec![0]);
            c.do_sample = true;
            c.top_k = 0;
            c.temperature = 2.0;
        });
        let mut chain = Chain::build(&c, 3, vec![Box::new(AddOne)]).unwrap();
        assert_eq!(chain.len(), 3);
        let mut s = vec![1.0, 2.0, 3.0];
        let ctx = RowContext {
            row: 0,
            ids: &[1],
            prompt_len: 1,
            max_length: 5,
        };
        chain.apply(&ctx, &mut s).unwrap();
        assert_eq!(s, vec![f32::NEG_INFINITY, 1.5, 2.0]);
    }
}
