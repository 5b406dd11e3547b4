//! Logits processors: one trait, one chain built once per request in the order of
//! transformers 4.57's `_get_logits_processor`.

use crate::config::GenerationConfig;
use crate::error::{Error, Result};

/// What a processor may look at for one row.
#[derive(Debug, Clone, Copy)]
pub struct RowContext<'a> {
    /// Index of the row in the request.
    pub row: usize,
    /// The sequence the processors see: the prompt and the new tokens (for an encoder-decoder,
    /// the decoder sequence starting with `decoder_start_token_id`).
    pub ids: &'a [u32],
    /// Length of the prompt part of `ids`.
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
        self.ids.len() - self.prompt_len
    }
}

/// A logits processor: changes the scores of one row in place.
pub trait LogitsProcessor {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()>;
}

/// The processors of one request, in transformers' order.
#[derive(Default)]
pub struct Chain {
    processors: Vec<Box<dyn LogitsProcessor>>,
}

impl Chain {
    /// Build the chain for `config` over a vocabulary of `vocab` tokens. `custom` processors go
    /// where transformers puts user processors: after the built-in processors and before the
    /// sampling warpers.
    pub fn build(
        config: &GenerationConfig,
        vocab: usize,
        custom: Vec<Box<dyn LogitsProcessor>>,
    ) -> Result<Chain> {
        let _ = vocab;
        let d = GenerationConfig::default();
        let unsupported = [
            (
                "repetition_penalty",
                config.repetition_penalty != d.repetition_penalty,
            ),
            ("no_repeat_ngram_size", config.no_repeat_ngram_size != 0),
            ("bad_words_ids", config.bad_words_ids.is_some()),
            ("min_length", config.min_length != 0),
            ("min_new_tokens", config.min_new_tokens.is_some()),
            ("forced_bos_token_id", config.forced_bos_token_id.is_some()),
            ("forced_eos_token_id", config.forced_eos_token_id.is_some()),
            ("suppress_tokens", config.suppress_tokens.is_some()),
            (
                "begin_suppress_tokens",
                config.begin_suppress_tokens.is_some(),
            ),
            ("sequence_bias", config.sequence_bias.is_some()),
            (
                "exponential_decay_length_penalty",
                config.exponential_decay_length_penalty.is_some(),
            ),
            (
                "encoder_repetition_penalty",
                config.encoder_repetition_penalty != 1.0,
            ),
            (
                "encoder_no_repeat_ngram_size",
                config.encoder_no_repeat_ngram_size != 0,
            ),
            ("stop_strings", config.stop_strings.is_some()),
            ("renormalize_logits", config.renormalize_logits),
            ("do_sample", config.do_sample),
        ];
        if let Some((name, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(Error::Unsupported(format!(
                "the option `{name}` is not implemented yet"
            )));
        }
        Ok(Chain { processors: custom })
    }

    pub fn is_empty(&self) -> bool {
        self.processors.is_empty()
    }

    /// Apply every processor to one row's scores.
    pub fn apply(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        for p in self.processors.iter_mut() {
            p.process(ctx, scores)?;
        }
        Ok(())
    }
}
