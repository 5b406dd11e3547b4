//! The processed next-token distribution: what `generate(do_sample=True, ...)` draws from after
//! a prompt and some generated tokens. Used to check the processors and warpers against
//! transformers without sampling, and by callers that want the probabilities themselves.

use serde_json::{Map, Value};

use crate::error::{invalid, Result};
use crate::generate::PROMPT_CHUNK;
use crate::model::{EncoderInput, Model};
use crate::processors::{Chain, ChainInputs, RowContext};
use crate::search::softmax_into;

impl Model {
    /// The probabilities of the next token after `prompt` followed by `generated`, after every
    /// processor and warper of `options` (on top of the model's generation config), as
    /// `softmax` of the processed scores. `generated` counts as new tokens (for
    /// `min_new_tokens`, `max_length`, `begin_suppress_tokens`). Returns one probability per
    /// vocabulary entry.
    pub fn next_token_probabilities(
        &self,
        prompt: &[u32],
        generated: &[u32],
        options: &Map<String, Value>,
    ) -> Result<Vec<f32>> {
        let mut config = self.generation_config.clone();
        config.apply_options(options)?;
        let vocab = self.vocab_size();
        if prompt.is_empty() {
            return invalid!("the prompt is empty: a prompt needs at least one token");
        }
        let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        if let Some((i, &t)) = all.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return invalid!(
                "token id {t} at position {i} of the input is outside the vocabulary (0..{vocab})"
            );
        }
        // An encoder-decoder reads the prompt with its encoder; its decoder sequence starts
        // with `decoder_start_token_id`.
        let encoder = self
            .is_encoder_decoder()
            .then(|| EncoderInput::Ids(vec![prompt.to_vec()]));
        let inputs = ChainInputs {
            encoder_ids: self.is_encoder_decoder().then(|| vec![prompt.to_vec()]),
            encoder_features: false,
        };
        let mut chain = Chain::build_with(&config, vocab, &inputs, vec![])?;
        let (ids, prompt_len, budget) = match &encoder {
            Some(_) => {
                let start = config
                    .decoder_start_token_id
                    .or(self.decoder_start_token_id());
                let Some(start) = start else {
                    return invalid!("the encoder-decoder has no `decoder_start_token_id`");
                };
                let ids: Vec<u32> = std::iter::once(start)
                    .chain(generated.iter().copied())
                    .collect();
                (ids, 1, config.seq2seq_new_token_budget(1).max(1))
            }
            None => (
                all,
                prompt.len(),
                config.new_token_budget(prompt.len()).max(1),
            ),
        };
        // A vision-language decoder: index positions, and an error for image tokens (they
        // need image features, which this function does not take).
        let prompt_inputs = match (&self.vision, &encoder) {
            (Some(v), None) => Some(std::sync::Arc::new(crate::vision::PromptInputs::new(
                v,
                &[prompt.to_vec()],
                &Default::default(),
            )?)),
            _ => None,
        };
        let mut state = self.start_rows(
            1,
            ids.len() + 1,
            encoder.as_ref().map(|e| (e, &[0usize][..])),
            prompt_inputs.as_ref().map(|p| (p, &[0usize][..])),
        )?;
        // Feed the tokens in steps of up to `PROMPT_CHUNK`, as the generation loop does.
        let mut fed = 0;
        let mut logits = None;
        while fed < ids.len() {
            let chunk = (ids.len() - fed).min(PROMPT_CHUNK);
            logits = Some(state.step(&[&ids[fed..fed + chunk]])?);
            fed += chunk;
        }
        let Some(logits) = logits else {
            return invalid!("the input is empty");
        };
        let mut scores = logits.row(0).to_vec();
        let ctx = RowContext {
            row: 0,
            ids: &ids,
            prompt_len,
            max_length: prompt_len + budget,
        };
        chain.apply(&ctx, &mut scores)?;
        let mut probs = vec![];
        softmax_into(&scores, &mut probs);
        Ok(probs)
    }
}
