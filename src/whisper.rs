//! Speech to text with Whisper: log-mel features of each 30 s window, the decoder prompt
//! `<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>` (as transformers' Whisper
//! `generate` builds it from `forced_decoder_ids`, `lang_to_id` and `task_to_id`), then the
//! generation loop with the model's `suppress_tokens` and `begin_suppress_tokens`.

use serde_json::{Map, Value};

use crate::audio::FeatureExtractor;
use crate::error::{invalid, Error, Result};
use crate::generate::{Generation, TokenEvent};
use crate::model::{EncoderInput, Model};

/// What to transcribe and how.
#[derive(Debug, Clone, Default)]
pub struct TranscribeOptions {
    /// A language code (`"en"`) or token (`"<|en|>"`); `None` detects it from the audio.
    pub language: Option<String>,
    /// `"transcribe"` (default) or `"translate"` (to English).
    pub task: Option<String>,
    /// Generation options on top of the model's generation config.
    pub generation: Map<String, Value>,
}

/// A transcription in progress: the windows of the audio, one `Generation` at a time.
pub struct Transcription {
    features: FeatureExtractor,
    windows: Vec<Vec<f32>>,
    next_window: usize,
    prompt: Vec<u32>,
    generation: Option<Generation>,
    options: TranscribeOptions,
    language_fixed: bool,
    /// Text of the finished windows.
    text: String,
    /// Window of each event row (events carry the window index as `row`).
    current: usize,
}

impl Model {
    /// Start transcribing `pcm` (mono samples in [-1, 1]) recorded at `sampling_rate` Hz; audio at
    /// another rate than the model's is resampled.
    pub fn transcribe(
        &self,
        pcm: &[f32],
        sampling_rate: usize,
        options: TranscribeOptions,
    ) -> Result<Transcription> {
        if !self.encoder_takes_features() {
            return invalid!("this model does not take audio (its encoder has no input_features)");
        }
        let features = match &self.preprocessor_config {
            Some(c) => FeatureExtractor::from_config(c)?,
            None => FeatureExtractor::whisper(80)?,
        };
        if pcm.is_empty() {
            return invalid!("the audio is empty");
        }
        let pcm = crate::audio::resample(pcm, sampling_rate, features.sampling_rate)?;
        let windows: Vec<Vec<f32>> = pcm
            .chunks(features.n_samples)
            .map(<[f32]>::to_vec)
            .collect();
        let language = match options.language.as_deref() {
            Some(l) => Some(self.special_token(&language_token(l), "language")?),
            None => None,
        };
        let task = options.task.as_deref().unwrap_or("transcribe");
        if task != "transcribe" && task != "translate" {
            return invalid!("`task` must be \"transcribe\" or \"translate\", got {task:?}");
        }
        let start = self.decoder_start_token_id().ok_or_else(|| {
            Error::Model("the model has no `decoder_start_token_id` (<|startoftranscript|>)".into())
        })?;
        let mut prompt = vec![start];
        prompt.extend(language);
        prompt.push(self.special_token(&format!("<|{task}|>"), "task")?);
        prompt.push(self.special_token("<|notimestamps|>", "no_timestamps")?);
        Ok(Transcription {
            features,
            windows,
            next_window: 0,
            language_fixed: options.language.is_some(),
            prompt,
            generation: None,
            options,
            text: String::new(),
            current: 0,
        })
    }

    fn special_token(&self, token: &str, what: &str) -> Result<u32> {
        self.tokenizer.token_to_id(token).ok_or_else(|| {
            Error::InvalidInput(format!(
                "unknown {what} {token:?}: the tokenizer has no such token"
            ))
        })
    }

    /// The language tokens (`<|en|>`, ...) of a multilingual Whisper tokenizer.
    fn language_tokens(&self) -> Vec<u32> {
        (0..self.vocab_size() as u32)
            .filter(|&id| {
                self.tokenizer.id_to_token(id).is_some_and(|t| {
                    let inner = t.strip_prefix("<|").and_then(|t| t.strip_suffix("|>"));
                    inner.is_some_and(|c| {
                        (2..=3).contains(&c.len()) && c.chars().all(|ch| ch.is_ascii_lowercase())
                            || c == "haw"
                            || c == "yue"
                    })
                })
            })
            .collect()
    }
}

fn language_token(language: &str) -> String {
    if language.starts_with("<|") {
        language.to_owned()
    } else {
        format!("<|{}|>", language.to_ascii_lowercase())
    }
}

impl Transcription {
    /// Whether every window is transcribed.
    pub fn is_finished(&self) -> bool {
        self.generation.is_none() && self.next_window >= self.windows.len()
    }

    /// Run one decoder step; events carry the window index as `row`.
    pub fn step(&mut self, model: &Model) -> Result<Vec<TokenEvent>> {
        if self.generation.is_none() {
            let Some(window) = self.windows.get(self.next_window) else {
                return Ok(vec![]);
            };
            let mel = self.features.features(window)?;
            let input = EncoderInput::Features {
                shape: vec![self.features.feature_size, self.features.frames()],
                rows: vec![mel],
            };
            let mut prompt = self.prompt.clone();
            if !self.language_fixed {
                // transformers' `detect_language`: the most likely language token after
                // <|startoftranscript|>.
                let languages = model.language_tokens();
                if !languages.is_empty() {
                    let mut state = model.start(1, 2, Some((&input, &[0])))?;
                    let logits = state.step(&[&prompt[..1]])?;
                    let row = logits.row(0);
                    let best = languages
                        .iter()
                        .copied()
                        .max_by(|&a, &b| row[a as usize].total_cmp(&row[b as usize]));
                    if let Some(language) = best {
                        prompt.insert(1, language);
                    }
                }
            }
            let mut config = model.generation_config.clone();
            config.apply_options(&self.options.generation)?;
            self.current = self.next_window;
            self.next_window += 1;
            self.generation = Some(Generation::with_config(
                model,
                Some(input),
                &[prompt],
                config,
                vec![],
            )?);
        }
        let Some(generation) = self.generation.as_mut() else {
            return Ok(vec![]);
        };
        let mut events = generation.step(model)?;
        for e in events.iter_mut() {
            e.row = self.current;
        }
        if generation.is_finished() {
            let out = generation.output(model)?;
            if let Some(seq) = out.sequences.first().and_then(|s| s.first()) {
                self.text.push_str(&seq.text);
            }
            self.generation = None;
        }
        Ok(events)
    }

    /// Stop transcribing.
    pub fn abort(&mut self) {
        if let Some(g) = self.generation.as_mut() {
            g.abort();
        }
        self.generation = None;
        self.next_window = self.windows.len();
    }

    /// The text of the windows transcribed so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Transcribe to the end, calling `on_token` for each token.
    pub fn run(mut self, model: &Model, mut on_token: impl FnMut(&TokenEvent)) -> Result<String> {
        while !self.is_finished() {
            for e in self.step(model)? {
                on_token(&e);
            }
        }
        Ok(self.text)
    }
}
