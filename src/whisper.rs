//! Speech to text with Whisper: log-mel features of each 30 s window, the decoder prompt
//! `<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>` (as transformers' Whisper
//! `generate` builds it from `forced_decoder_ids`, `lang_to_id` and `task_to_id`), then the
//! generation loop with the model's `suppress_tokens` and `begin_suppress_tokens`.

use serde_json::{Map, Value};

use crate::audio::FeatureExtractor;
use crate::error::{invalid, Error, Result};
use crate::generate::{FinishReason, Generation, Sequence, TokenEvent};
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
    /// The sequence of each finished window.
    done: Vec<Sequence>,
    /// Window of each event row (events carry the window index as `row`).
    current: usize,
    aborted: bool,
}

/// A finished (or aborted) transcription.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscriptionOutput {
    /// The text of every window, concatenated.
    pub text: String,
    /// The token ids of every window, concatenated (without the prompts and eos tokens).
    pub token_ids: Vec<u32>,
    /// Why the last window stopped (`Abort` when the transcription was stopped).
    pub finish_reason: FinishReason,
    /// The sequence of each transcribed window, in order.
    pub windows: Vec<Sequence>,
}

impl Model {
    /// Start transcribing `pcm` (mono samples in [-1, 1]) recorded at `sampling_rate` Hz; audio at
    /// another rate than the model's (`preprocessor_config.json`, 16 kHz for Whisper) is
    /// resampled to it first. Empty audio and samples that are not finite are errors.
    pub fn transcribe(
        &self,
        pcm: &[f32],
        sampling_rate: usize,
        options: TranscribeOptions,
    ) -> Result<Transcription> {
        if !self.encoder_takes_features() {
            return invalid!("this model does not take audio (its encoder has no input_features)");
        }
        let features = self.feature_extractor()?;
        if pcm.is_empty() {
            return invalid!("the audio is empty (no samples)");
        }
        if let Some(i) = pcm.iter().position(|x| !x.is_finite()) {
            return invalid!(
                "audio sample {i} is {} (samples must be finite numbers, normally in [-1, 1])",
                pcm[i]
            );
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
            done: vec![],
            current: 0,
            aborted: false,
        })
    }

    /// The feature extractor of `preprocessor_config.json` (Whisper's defaults without one).
    fn feature_extractor(&self) -> Result<FeatureExtractor> {
        match &self.preprocessor_config {
            Some(c) => FeatureExtractor::from_config(c),
            None => FeatureExtractor::whisper(80),
        }
    }

    /// The sample rate the model hears (16000 Hz for Whisper): audio at another rate is
    /// resampled to it.
    pub fn sampling_rate(&self) -> Result<usize> {
        Ok(self.feature_extractor()?.sampling_rate)
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
            // The encoder runs once per window (language detection and generation share it).
            let input = model.encode(&EncoderInput::Features {
                shape: vec![self.features.feature_size, self.features.frames()],
                rows: vec![mel],
            })?;
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
            self.finish_window(model)?;
        }
        Ok(events)
    }

    /// Keep the sequence of the current window and drop its generation.
    fn finish_window(&mut self, model: &Model) -> Result<()> {
        if let Some(generation) = self.generation.take() {
            let out = generation.output(model)?;
            if let Some(seq) = out
                .sequences
                .into_iter()
                .next()
                .and_then(|s| s.into_iter().next())
            {
                self.done.push(seq);
            }
        }
        Ok(())
    }

    /// Stop transcribing: the current window keeps its tokens so far (finish reason `abort`)
    /// and later windows are skipped.
    pub fn abort(&mut self, model: &Model) -> Result<()> {
        if let Some(g) = self.generation.as_mut() {
            g.abort();
        }
        self.next_window = self.windows.len();
        self.aborted = true;
        self.finish_window(model)
    }

    /// The result so far (the whole transcription once finished).
    pub fn output(&self) -> TranscriptionOutput {
        let finish_reason = match self.done.last() {
            Some(s) if self.is_finished() && !self.aborted => s.finish_reason,
            _ => FinishReason::Abort,
        };
        TranscriptionOutput {
            text: self.done.iter().map(|s| s.text.as_str()).collect(),
            token_ids: self
                .done
                .iter()
                .flat_map(|s| s.token_ids.iter().copied())
                .collect(),
            finish_reason,
            windows: self.done.clone(),
        }
    }

    /// Transcribe to the end, calling `on_token` for each token.
    pub fn run(
        mut self,
        model: &Model,
        mut on_token: impl FnMut(&TokenEvent),
    ) -> Result<TranscriptionOutput> {
        while !self.is_finished() {
            for e in self.step(model)? {
                on_token(&e);
            }
        }
        Ok(self.output())
    }
}
