//! `GenerationConfig`: the fields of transformers' `GenerationConfig` that this engine runs,
//! read from `generation_config.json` and overridden per request with the same snake_case
//! names. The model file is read leniently (fields the engine does not use are ignored);
//! request options are strict (an unknown name is an error that lists the valid ones).

use serde_json::{Map, Value};

use crate::error::{invalid, Error, Result};

/// transformers' `early_stopping`: `true`, `false` or `"never"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EarlyStopping {
    True,
    #[default]
    False,
    Never,
}

/// Generation settings with transformers 4.57's defaults (`GenerationConfig()`).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    pub max_length: usize,
    pub max_new_tokens: Option<usize>,
    pub min_length: usize,
    pub min_new_tokens: Option<usize>,
    pub early_stopping: EarlyStopping,
    pub do_sample: bool,
    pub num_beams: usize,
    pub num_return_sequences: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: Option<f32>,
    pub typical_p: f32,
    pub epsilon_cutoff: f32,
    pub eta_cutoff: f32,
    pub repetition_penalty: f32,
    pub encoder_repetition_penalty: f32,
    pub length_penalty: f32,
    pub no_repeat_ngram_size: usize,
    pub encoder_no_repeat_ngram_size: usize,
    pub bad_words_ids: Option<Vec<Vec<u32>>>,
    /// `sequence_bias` as a list of `(token ids, bias)`.
    pub sequence_bias: Option<Vec<(Vec<u32>, f32)>>,
    pub renormalize_logits: bool,
    pub forced_bos_token_id: Option<u32>,
    pub forced_eos_token_id: Option<Vec<u32>>,
    /// `(start_index, decay_factor)`.
    pub exponential_decay_length_penalty: Option<(usize, f32)>,
    pub suppress_tokens: Option<Vec<u32>>,
    pub begin_suppress_tokens: Option<Vec<u32>>,
    pub stop_strings: Option<Vec<String>>,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<Vec<u32>>,
    pub decoder_start_token_id: Option<u32>,
    /// Return the processed score (and its log-softmax) of every chosen token.
    pub output_scores: bool,
    /// With scores: also the N most likely alternatives of each step (OpenAI-style).
    pub top_logprobs: usize,
    /// Seeds of the sampling generators: one for all rows (row r uses `seed + r`), or one per row.
    pub seed: Option<Vec<u64>>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_length: 20,
            max_new_tokens: None,
            min_length: 0,
            min_new_tokens: None,
            early_stopping: EarlyStopping::False,
            do_sample: false,
            num_beams: 1,
            num_return_sequences: 1,
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            min_p: None,
            typical_p: 1.0,
            epsilon_cutoff: 0.0,
            eta_cutoff: 0.0,
            repetition_penalty: 1.0,
            encoder_repetition_penalty: 1.0,
            length_penalty: 1.0,
            no_repeat_ngram_size: 0,
            encoder_no_repeat_ngram_size: 0,
            bad_words_ids: None,
            sequence_bias: None,
            renormalize_logits: false,
            forced_bos_token_id: None,
            forced_eos_token_id: None,
            exponential_decay_length_penalty: None,
            suppress_tokens: None,
            begin_suppress_tokens: None,
            stop_strings: None,
            pad_token_id: None,
            bos_token_id: None,
            eos_token_id: None,
            decoder_start_token_id: None,
            output_scores: false,
            top_logprobs: 0,
            seed: None,
        }
    }
}

/// Every option name a request may set, in the order of the docs.
pub const OPTION_NAMES: &[&str] = &[
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "early_stopping",
    "do_sample",
    "num_beams",
    "num_return_sequences",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "renormalize_logits",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "stop_strings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "output_scores",
    "token_logprobs",
    "top_logprobs",
    "seed",
];

/// Fields of transformers' `GenerationConfig` that this engine does not implement. A request
/// that sets one of them to a value other than its default is refused, never silently ignored.
pub const UNSUPPORTED_NAMES: &[&str] = &[
    "num_beam_groups",
    "diversity_penalty",
    "penalty_alpha",
    "constraints",
    "force_words_ids",
    "guidance_scale",
    "watermarking_config",
    "token_healing",
    "prompt_lookup_num_tokens",
    "assistant_model",
    "max_time",
    "low_memory",
    "dola_layers",
    "cache_implementation",
];

/// Fields a model's `generation_config.json` carries that do not change what is generated
/// (bookkeeping, output switches, cache hints).
const IGNORED_IN_MODEL_FILE: &[&str] = &[
    "transformers_version",
    "_from_model_config",
    "use_cache",
    "return_dict_in_generate",
    "output_attentions",
    "output_hidden_states",
    "output_logits",
];

impl GenerationConfig {
    /// Read a model's `generation_config.json`. Fields the engine does not use are ignored (a
    /// model file carries many; Whisper's has `lang_to_id` and friends).
    pub fn from_model_json(bytes: &[u8]) -> Result<Self> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::Model(format!("generation_config.json is not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::Model(
                "generation_config.json is not a JSON object".into(),
            ));
        };
        let mut config = GenerationConfig::default();
        for (name, value) in &map {
            if OPTION_NAMES.contains(&name.as_str()) {
                config
                    .set(name, value)
                    .map_err(|e| Error::Model(format!("generation_config.json: {e}")))?;
            }
        }
        Ok(config)
    }

    /// Apply a request's options on top of this config. `null` resets a field to its default.
    /// Unknown names are errors that list the valid ones; fields of transformers this engine
    /// does not implement are errors when set to anything but their default.
    pub fn apply_options(&mut self, options: &Map<String, Value>) -> Result<()> {
        for (name, value) in options {
            if OPTION_NAMES.contains(&name.as_str()) {
                self.set(name, value)?;
            } else if UNSUPPORTED_NAMES.contains(&name.as_str()) {
                if !is_default_value(value) {
                    return Err(Error::Unsupported(format!(
                        "the option `{name}` is not supported by onnx-generate"
                    )));
                }
            } else if !IGNORED_IN_MODEL_FILE.contains(&name.as_str()) {
                return invalid!(
                    "unknown option `{name}`; valid options are: {}",
                    OPTION_NAMES.join(", ")
                );
            }
        }
        Ok(())
    }

    /// Set one field from its JSON value.
    fn set(&mut self, name: &str, v: &Value) -> Result<()> {
        let d = GenerationConfig::default();
        if v.is_null() {
            // `null` means "not set": the field takes transformers' default.
            match name {
                "max_length" => self.max_length = d.max_length,
                "max_new_tokens" => self.max_new_tokens = None,
                "min_length" => self.min_length = d.min_length,
                "min_new_tokens" => self.min_new_tokens = None,
                "early_stopping" => self.early_stopping = d.early_stopping,
                "do_sample" => self.do_sample = d.do_sample,
                "num_beams" => self.num_beams = d.num_beams,
                "num_return_sequences" => self.num_return_sequences = d.num_return_sequences,
                "temperature" => self.temperature = d.temperature,
                "top_k" => self.top_k = d.top_k,
                "top_p" => self.top_p = d.top_p,
                "min_p" => self.min_p = None,
                "typical_p" => self.typical_p = d.typical_p,
                "epsilon_cutoff" => self.epsilon_cutoff = d.epsilon_cutoff,
                "eta_cutoff" => self.eta_cutoff = d.eta_cutoff,
                "repetition_penalty" => self.repetition_penalty = d.repetition_penalty,
                "encoder_repetition_penalty" => {
                    self.encoder_repetition_penalty = d.encoder_repetition_penalty
                }
                "length_penalty" => self.length_penalty = d.length_penalty,
                "no_repeat_ngram_size" => self.no_repeat_ngram_size = 0,
                "encoder_no_repeat_ngram_size" => self.encoder_no_repeat_ngram_size = 0,
                "bad_words_ids" => self.bad_words_ids = None,
                "sequence_bias" => self.sequence_bias = None,
                "renormalize_logits" => self.renormalize_logits = false,
                "forced_bos_token_id" => self.forced_bos_token_id = None,
                "forced_eos_token_id" => self.forced_eos_token_id = None,
                "exponential_decay_length_penalty" => self.exponential_decay_length_penalty = None,
                "suppress_tokens" => self.suppress_tokens = None,
                "begin_suppress_tokens" => self.begin_suppress_tokens = None,
                "stop_strings" => self.stop_strings = None,
                "pad_token_id" => self.pad_token_id = None,
                "bos_token_id" => self.bos_token_id = None,
                "eos_token_id" => self.eos_token_id = None,
                "decoder_start_token_id" => self.decoder_start_token_id = None,
                "output_scores" | "token_logprobs" => self.output_scores = false,
                "top_logprobs" => self.top_logprobs = 0,
                "seed" => self.seed = None,
                _ => {}
            }
            return Ok(());
        }
        match name {
            "max_length" => self.max_length = count(name, v)?,
            "max_new_tokens" => {
                let n = count(name, v)?;
                if n == 0 {
                    return invalid!("`max_new_tokens` must be at least 1, got 0");
                }
                self.max_new_tokens = Some(n)
            }
            "min_length" => self.min_length = count(name, v)?,
            "min_new_tokens" => self.min_new_tokens = Some(count(name, v)?),
            "early_stopping" => {
                self.early_stopping = match v {
                    Value::Bool(true) => EarlyStopping::True,
                    Value::Bool(false) => EarlyStopping::False,
                    Value::String(s) if s == "never" => EarlyStopping::Never,
                    _ => {
                        return invalid!(
                            "`early_stopping` must be true, false or \"never\", got {v}"
                        )
                    }
                }
            }
            "do_sample" => self.do_sample = boolean(name, v)?,
            "num_beams" => self.num_beams = rows_per_prompt(name, v)?,
            "num_return_sequences" => self.num_return_sequences = rows_per_prompt(name, v)?,
            "temperature" => self.temperature = float(name, v)?,
            "top_k" => self.top_k = count(name, v)?,
            "top_p" => self.top_p = float(name, v)?,
            "min_p" => self.min_p = Some(float(name, v)?),
            "typical_p" => self.typical_p = float(name, v)?,
            "epsilon_cutoff" => self.epsilon_cutoff = float(name, v)?,
            "eta_cutoff" => self.eta_cutoff = float(name, v)?,
            "repetition_penalty" => self.repetition_penalty = float(name, v)?,
            "encoder_repetition_penalty" => self.encoder_repetition_penalty = float(name, v)?,
            "length_penalty" => self.length_penalty = float(name, v)?,
            "no_repeat_ngram_size" => self.no_repeat_ngram_size = count(name, v)?,
            "encoder_no_repeat_ngram_size" => self.encoder_no_repeat_ngram_size = count(name, v)?,
            "bad_words_ids" => self.bad_words_ids = Some(id_lists(name, v)?),
            "sequence_bias" => self.sequence_bias = Some(sequence_bias(v)?),
            "renormalize_logits" => self.renormalize_logits = boolean(name, v)?,
            "forced_bos_token_id" => self.forced_bos_token_id = Some(token_id(name, v)?),
            "forced_eos_token_id" => self.forced_eos_token_id = Some(id_or_ids(name, v)?),
            "exponential_decay_length_penalty" => {
                let pair = v.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "`exponential_decay_length_penalty` must be [start_index, decay_factor], got {v}"
                    ))
                })?;
                self.exponential_decay_length_penalty =
                    Some((count(name, &pair[0])?, float(name, &pair[1])?))
            }
            "suppress_tokens" => self.suppress_tokens = Some(ids(name, v)?),
            "begin_suppress_tokens" => self.begin_suppress_tokens = Some(ids(name, v)?),
            "stop_strings" => {
                self.stop_strings = Some(match v {
                    Value::String(s) => vec![s.clone()],
                    Value::Array(a) => a
                        .iter()
                        .map(|s| {
                            s.as_str().map(str::to_owned).ok_or_else(|| {
                                Error::InvalidInput(format!(
                                    "`stop_strings` must be a string or a list of strings, got {v}"
                                ))
                            })
                        })
                        .collect::<Result<_>>()?,
                    _ => {
                        return invalid!(
                            "`stop_strings` must be a string or a list of strings, got {v}"
                        )
                    }
                })
            }
            "pad_token_id" => self.pad_token_id = Some(token_id(name, v)?),
            "bos_token_id" => self.bos_token_id = Some(token_id(name, v)?),
            "eos_token_id" => self.eos_token_id = Some(id_or_ids(name, v)?),
            "decoder_start_token_id" => self.decoder_start_token_id = Some(token_id(name, v)?),
            "output_scores" | "token_logprobs" => self.output_scores = boolean(name, v)?,
            "top_logprobs" => self.top_logprobs = count(name, v)?,
            "seed" => {
                self.seed = Some(match v {
                    Value::Array(a) => a.iter().map(|s| seed(name, s)).collect::<Result<_>>()?,
                    _ => vec![seed(name, v)?],
                })
            }
            _ => return invalid!("unknown option `{name}`"),
        }
        Ok(())
    }

    /// The eos token ids (empty when the model has none).
    pub fn eos_ids(&self) -> &[u32] {
        self.eos_token_id.as_deref().unwrap_or(&[])
    }

    /// The largest number of new tokens for a prompt of `prompt_len` tokens, as transformers'
    /// `_prepare_generated_length` decides it for a decoder-only model: `max_new_tokens` when
    /// set, else `max_length` counts the prompt too (at least one new token is always allowed
    /// to be attempted only if `max_length` exceeds the prompt).
    pub fn new_token_budget(&self, prompt_len: usize) -> usize {
        match self.max_new_tokens {
            Some(n) => n,
            None => self.max_length.saturating_sub(prompt_len),
        }
    }
}

impl GenerationConfig {
    /// The largest number of new tokens of an encoder-decoder, as transformers' text2text and
    /// speech pipelines decide it: `max_new_tokens` when set, else 256 when `max_length` is
    /// transformers' default (20), else `max_length` minus the decoder prompt.
    pub fn seq2seq_new_token_budget(&self, decoder_prompt_len: usize) -> usize {
        match self.max_new_tokens {
            Some(n) => n,
            None if self.max_length == GenerationConfig::default().max_length => 256,
            None => self.max_length.saturating_sub(decoder_prompt_len),
        }
    }
}

fn is_default_value(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0) || n.as_f64() == Some(1.0),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

fn count(name: &str, v: &Value) -> Result<usize> {
    match v.as_u64() {
        Some(n) => usize::try_from(n)
            .map_err(|_| Error::InvalidInput(format!("`{name}` is too large: {v}"))),
        None if v.as_i64().is_some() => {
            invalid!("`{name}` must be a non-negative integer, got {v}")
        }
        None => invalid!("`{name}` must be an integer, got {v}"),
    }
}

/// The most rows of the decoder's batch that one prompt may become (`num_beams`,
/// `num_return_sequences`): each row has its own cache and logits, and a count past this is
/// a mistake that would end in an allocation failure, which aborts the wasm instance.
pub const MAX_ROWS_PER_PROMPT: usize = 1024;

fn rows_per_prompt(name: &str, v: &Value) -> Result<usize> {
    match count(name, v)? {
        0 => invalid!("`{name}` must be at least 1, got 0"),
        n if n > MAX_ROWS_PER_PROMPT => invalid!(
            "`{name}` must be at most {MAX_ROWS_PER_PROMPT} (rows of the decoder's batch per prompt), got {n}"
        ),
        n => Ok(n),
    }
}

fn float(name: &str, v: &Value) -> Result<f32> {
    match v.as_f64() {
        // Finite as f32 too: 1e300 is not a temperature.
        Some(x) if (x as f32).is_finite() => Ok(x as f32),
        _ => invalid!("`{name}` must be a finite number, got {v}"),
    }
}

fn boolean(name: &str, v: &Value) -> Result<bool> {
    v.as_bool()
        .ok_or_else(|| Error::InvalidInput(format!("`{name}` must be true or false, got {v}")))
}

fn seed(name: &str, v: &Value) -> Result<u64> {
    v.as_u64().ok_or_else(|| {
        Error::InvalidInput(format!(
            "`{name}` must be a non-negative integer or a list of them, got {v}"
        ))
    })
}

fn token_id(name: &str, v: &Value) -> Result<u32> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            Error::InvalidInput(format!(
                "`{name}` must be a token id (a non-negative integer), got {v}"
            ))
        })
}

fn ids(name: &str, v: &Value) -> Result<Vec<u32>> {
    match v {
        Value::Array(a) => a.iter().map(|x| token_id(name, x)).collect(),
        _ => invalid!("`{name}` must be a list of token ids, got {v}"),
    }
}

fn id_or_ids(name: &str, v: &Value) -> Result<Vec<u32>> {
    match v {
        Value::Array(_) => ids(name, v),
        _ => Ok(vec![token_id(name, v)?]),
    }
}

fn id_lists(name: &str, v: &Value) -> Result<Vec<Vec<u32>>> {
    match v {
        Value::Array(a) => a
            .iter()
            .map(|x| {
                let l = ids(name, x)?;
                if l.is_empty() {
                    return invalid!("`{name}` must not contain an empty list");
                }
                Ok(l)
            })
            .collect(),
        _ => invalid!("`{name}` must be a list of lists of token ids, got {v}"),
    }
}

/// `sequence_bias`: `[[ids, bias], ...]` (transformers' list form) or `{"1,2": bias}`.
fn sequence_bias(v: &Value) -> Result<Vec<(Vec<u32>, f32)>> {
    let name = "sequence_bias";
    match v {
        Value::Array(a) => a
            .iter()
            .map(|pair| match pair.as_array() {
                Some(p) if p.len() == 2 => Ok((ids(name, &p[0])?, float(name, &p[1])?)),
                _ => invalid!("`sequence_bias` entries must be [token ids, bias], got {pair}"),
            })
            .collect(),
        Value::Object(m) => m
            .iter()
            .map(|(k, b)| {
                let seq = k
                    .split(',')
                    .map(|t| t.trim().parse::<u32>())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|_| {
                        Error::InvalidInput(format!(
                            "`sequence_bias` keys must be comma-separated token ids, got {k:?}"
                        ))
                    })?;
                Ok((seq, float(name, b)?))
            })
            .collect(),
        _ => invalid!("`sequence_bias` must be a list of [token ids, bias], got {v}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn model_file_is_read_leniently() {
        let c = GenerationConfig::from_model_json(
            br#"{"eos_token_id": [2, 3], "pad_token_id": 0, "transformers_version": "4.57.6", "lang_to_id": {}}"#,
        )
        .unwrap();
        assert_eq!(c.eos_ids(), &[2, 3]);
        assert_eq!(c.pad_token_id, Some(0));
    }

    #[test]
    fn unknown_option_lists_valid_names() {
        let mut c = GenerationConfig::default();
        let e = c
            .apply_options(&opts(json!({"max_tokens_typo": 3})))
            .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("max_tokens_typo") && m.contains("max_new_tokens"),
            "{m}"
        );
    }

    #[test]
    fn bad_values_name_the_option() {
        let mut c = GenerationConfig::default();
        for (o, word) in [
            (json!({"max_new_tokens": -1}), "max_new_tokens"),
            (json!({"max_new_tokens": 0}), "max_new_tokens"),
            (json!({"top_p": "x"}), "top_p"),
            (json!({"early_stopping": "sometimes"}), "early_stopping"),
            (json!({"bad_words_ids": [[]]}), "bad_words_ids"),
            (json!({"penalty_alpha": 0.6}), "penalty_alpha"),
        ] {
            let m = c.apply_options(&opts(o)).unwrap_err().to_string();
            assert!(m.contains(word), "{m}");
        }
        assert_eq!(c, GenerationConfig::default());
    }

    #[test]
    fn overrides_and_null() {
        let mut c = GenerationConfig::default();
        c.apply_options(&opts(
            json!({"early_stopping": "never", "eos_token_id": 5, "seed": 7}),
        ))
        .unwrap();
        assert_eq!(c.early_stopping, EarlyStopping::Never);
        assert_eq!(c.eos_ids(), &[5]);
        assert_eq!(c.seed, Some(vec![7]));
        c.apply_options(&opts(json!({"eos_token_id": null})))
            .unwrap();
        assert_eq!(c.eos_ids(), &[] as &[u32]);
    }

    #[test]
    fn budget_follows_transformers() {
        let mut c = GenerationConfig::default();
        assert_eq!(c.new_token_budget(5), 15);
        assert_eq!(c.new_token_budget(25), 0);
        c.max_new_tokens = Some(7);
        assert_eq!(c.new_token_budget(25), 7);
    }
}
