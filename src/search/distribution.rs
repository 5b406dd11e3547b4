//! The processed next-token distribution: what `generate(do_sample=True, ...)` draws from after
//! a prompt and some generated tokens. Used to check the processors and warpers against
//! transformers without sampling, and by callers that want the probabilities themselves.

use serde_json::{Map, Value};

use crate::error::{invalid, Result};
use crate::model::Model;
use crate::processors::{Chain, RowContext};
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
        let ids: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return invalid!(
                "token id {t} at position {i} of the input is outside the vocabulary (0..{vocab})"
            );
        }
        let mut chain = Chain::build(&config, vocab, vec![])?;
        let budget = config.new_token_budget(prompt.len()).max(1);
        let mut state = self.decoder().start(1, ids.len() + 1)?;
        // Feed the tokens in power-of-two chunks, as the generation loop does.
        let mut fed = 0;
        let mut logits = None;
        while fed < ids.len() {
            let left = ids.len() - fed;
            let chunk = 1usize << (usize::BITS - 1 - left.leading_zeros());
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
            prompt_len: prompt.len(),
            max_length: prompt.len() + budget,
        };
        chain.apply(&ctx, &mut scores)?;
        let mut probs = vec![];
        softmax_into(&scores, &mut probs);
        Ok(probs)
    }
}
