//! Speech input for Whisper: PCM decoding helpers and the log-mel front end of transformers'
//! `WhisperFeatureExtractor` (periodic Hann window, reflect-padded STFT, Slaney mel filters,
//! `log10`, dynamic range of 8, `(x + 4) / 4`), so a page can transcribe raw audio.

use crate::error::{invalid, Result};
use crate::model::ops::linalg::{axpy_rows, dot};

/// Settings of `WhisperFeatureExtractor` (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureExtractor {
    pub feature_size: usize,
    pub sampling_rate: usize,
    pub hop_length: usize,
    pub n_fft: usize,
    /// Samples of one window (`chunk_length * sampling_rate`).
    pub n_samples: usize,
    /// `feature_size x (n_fft / 2 + 1)` Slaney mel filters.
    filters: Vec<f32>,
    /// Periodic Hann window.
    window: Vec<f32>,
    /// The DFT as a matrix `[n_fft, 2 * bins]`: row `i` holds `cos(2 pi k i / n_fft)` for the
    /// bins `k`, then `sin`.
    dft: Vec<f32>,
}

impl FeatureExtractor {
    /// Whisper's defaults (80 mel bins, 16 kHz, hop 160, n_fft 400, 30 s chunks).
    pub fn whisper(feature_size: usize) -> Result<Self> {
        Self::new(feature_size, 16000, 160, 400, 30)
    }

    /// From `preprocessor_config.json` (fields missing there take Whisper's defaults).
    pub fn from_config(config: &serde_json::Value) -> Result<Self> {
        let get = |k: &str, d: usize| {
            config
                .get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .unwrap_or(d)
        };
        Self::new(
            get("feature_size", 80),
            get("sampling_rate", 16000),
            get("hop_length", 160),
            get("n_fft", 400),
            get("chunk_length", 30),
        )
    }

    pub fn new(
        feature_size: usize,
        sampling_rate: usize,
        hop_length: usize,
        n_fft: usize,
        chunk_length: usize,
    ) -> Result<Self> {
        if feature_size == 0 || sampling_rate == 0 || hop_length == 0 || n_fft < 2 {
            return invalid!(
                "feature extractor settings must be positive (feature_size {feature_size}, \
                 sampling_rate {sampling_rate}, hop_length {hop_length}, n_fft {n_fft})"
            );
        }
        let bins = n_fft / 2 + 1;
        let filters = mel_filters(feature_size, bins, sampling_rate as f64);
        // torch.hann_window(n_fft), periodic.
        let window = (0..n_fft)
            .map(|i| {
                (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n_fft as f64).cos()) as f32
            })
            .collect();
        let mut dft = vec![0.0; n_fft * 2 * bins];
        for (i, row) in dft.chunks_exact_mut(2 * bins).enumerate() {
            for k in 0..bins {
                let a = 2.0 * std::f64::consts::PI * ((k * i) % n_fft) as f64 / n_fft as f64;
                row[k] = a.cos() as f32;
                row[bins + k] = a.sin() as f32;
            }
        }
        Ok(FeatureExtractor {
            feature_size,
            sampling_rate,
            hop_length,
            n_fft,
            n_samples: chunk_length * sampling_rate,
            filters,
            window,
            dft,
        })
    }

    /// Frames of one window: `n_samples / hop_length` (3000 for Whisper).
    pub fn frames(&self) -> usize {
        self.n_samples / self.hop_length
    }

    /// Log-mel features `[feature_size, frames]` (row-major) of one window of audio at
    /// `sampling_rate`: shorter audio is padded with zeros, longer audio is cut.
    pub fn features(&self, pcm: &[f32]) -> Result<Vec<f32>> {
        if let Some(i) = pcm.iter().position(|x| !x.is_finite()) {
            return invalid!("audio sample {i} is {} (expected a finite number)", pcm[i]);
        }
        let n = self.n_samples;
        let mut audio = vec![0.0f32; n];
        let take = pcm.len().min(n);
        audio[..take].copy_from_slice(&pcm[..take]);
        // torch.stft(center=True, pad_mode="reflect").
        let pad = self.n_fft / 2;
        let mut padded = Vec::with_capacity(n + 2 * pad);
        padded.extend((1..=pad).rev().map(|i| audio[i.min(n - 1)]));
        padded.extend_from_slice(&audio);
        padded.extend((0..pad).map(|i| audio[n - 2 - i.min(n - 2)]));
        let bins = self.n_fft / 2 + 1;
        let frames = self.frames();
        let mut power = vec![0.0f32; bins];
        let mut frame = vec![0.0f32; self.n_fft];
        let mut spectrum = vec![0.0f32; 2 * bins];
        let mut mel = vec![0.0f32; self.feature_size * frames];
        // The STFT has frames + 1 columns; transformers drops the last one.
        for t in 0..frames {
            let start = t * self.hop_length;
            for (i, f) in frame.iter_mut().enumerate() {
                *f = padded[start + i] * self.window[i];
            }
            // The DFT of the frame as a vector-matrix product (a vectorized kernel: the
            // scalar sums it replaced took a tenth of a Whisper transcription in wasm).
            spectrum.fill(0.0);
            axpy_rows(&frame, &self.dft, 2 * bins, &mut spectrum);
            let (re, im) = spectrum.split_at(bins);
            for ((p, re), im) in power.iter_mut().zip(re).zip(im) {
                *p = re * re + im * im;
            }
            for m in 0..self.feature_size {
                let f = &self.filters[m * bins..(m + 1) * bins];
                mel[m * frames + t] = dot(f, &power).max(1e-10).log10();
            }
        }
        let max = mel.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in mel.iter_mut() {
            *v = (v.max(max - 8.0) + 4.0) / 4.0;
        }
        Ok(mel)
    }
}

/// Slaney-scale mel filters with Slaney normalisation, as transformers' `mel_filter_bank(...,
/// norm="slaney", mel_scale="slaney")` over `[0, 8000]` Hz: `filters[m * bins + k]`.
fn mel_filters(mels: usize, bins: usize, sampling_rate: f64) -> Vec<f32> {
    let (min, max) = (hertz_to_mel(0.0), hertz_to_mel(8000.0));
    let filter_freqs: Vec<f64> = (0..mels + 2)
        .map(|i| mel_to_hertz(min + (max - min) * i as f64 / (mels + 1) as f64))
        .collect();
    let nyquist = (sampling_rate as usize / 2) as f64;
    let fft_freqs: Vec<f64> = (0..bins)
        .map(|k| nyquist * k as f64 / (bins - 1) as f64)
        .collect();
    let mut filters = vec![0.0f32; mels * bins];
    for m in 0..mels {
        let enorm = 2.0 / (filter_freqs[m + 2] - filter_freqs[m]);
        for (k, &f) in fft_freqs.iter().enumerate() {
            let down = (f - filter_freqs[m]) / (filter_freqs[m + 1] - filter_freqs[m]);
            let up = (filter_freqs[m + 2] - f) / (filter_freqs[m + 2] - filter_freqs[m + 1]);
            filters[m * bins + k] = (down.min(up).max(0.0) * enorm) as f32;
        }
    }
    filters
}

const MIN_LOG_HERTZ: f64 = 1000.0;
const MIN_LOG_MEL: f64 = 15.0;

fn logstep() -> f64 {
    27.0 / 6.4f64.ln()
}

fn hertz_to_mel(f: f64) -> f64 {
    if f >= MIN_LOG_HERTZ {
        MIN_LOG_MEL + (f / MIN_LOG_HERTZ).ln() * logstep()
    } else {
        3.0 * f / 200.0
    }
}

fn mel_to_hertz(m: f64) -> f64 {
    if m >= MIN_LOG_MEL {
        MIN_LOG_HERTZ * ((m - MIN_LOG_MEL) / logstep()).exp()
    } else {
        200.0 * m / 3.0
    }
}

/// Linear resampling of `pcm` from `from` Hz to `to` Hz (for audio recorded at another rate).
pub fn resample(pcm: &[f32], from: usize, to: usize) -> Result<Vec<f32>> {
    if from == 0 || to == 0 {
        return invalid!("sample rates must be positive, got {from} Hz -> {to} Hz");
    }
    if from == to || pcm.is_empty() {
        return Ok(pcm.to_vec());
    }
    let out_len = (pcm.len() as u64 * to as u64 / from as u64) as usize;
    Ok((0..out_len)
        .map(|i| {
            let x = i as f64 * from as f64 / to as f64;
            let j = x.floor() as usize;
            let frac = (x - j as f64) as f32;
            let a = pcm[j.min(pcm.len() - 1)];
            let b = pcm[(j + 1).min(pcm.len() - 1)];
            a + (b - a) * frac
        })
        .collect())
}

/// Decode a PCM WAV file (8, 16, 24 or 32-bit integer, or 32-bit float; mono or the mean of
/// its channels) to `(samples in [-1, 1], sample rate)`.
pub fn read_wav(bytes: &[u8]) -> Result<(Vec<f32>, usize)> {
    if bytes.len() < 12 || &bytes[0..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return invalid!("the audio is not a RIFF/WAVE file");
    }
    let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
    let u32_at =
        |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let mut at = 12;
    let mut format = None;
    while at + 8 <= bytes.len() {
        let id = &bytes[at..at + 4];
        let len = u32_at(at + 4) as usize;
        let body = at + 8;
        let end = body.saturating_add(len).min(bytes.len());
        if id == b"fmt " && end >= body + 16 {
            format = Some((
                u16_at(body),
                u16_at(body + 2) as usize,
                u32_at(body + 4) as usize,
                u16_at(body + 14),
            ));
        } else if id == b"data" {
            let Some((tag, channels, rate, bits)) = format else {
                return invalid!("the WAVE file has its data before its format");
            };
            if channels == 0 {
                return invalid!("the WAVE file has 0 channels");
            }
            let data = &bytes[body..end];
            let width = (bits / 8) as usize;
            let sample = |c: &[u8]| -> Option<f32> {
                Some(match (tag, bits) {
                    (1, 8) => (c[0] as f32 - 128.0) / 128.0,
                    (1, 16) => i16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0,
                    (1, 24) => (i32::from_le_bytes([0, c[0], c[1], c[2]]) >> 8) as f32 / 8388608.0,
                    (1, 32) => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32 / 2147483648.0,
                    (3, 32) => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                    _ => return None,
                })
            };
            if width == 0 || sample(&[0; 4]).is_none() {
                return invalid!("unsupported WAVE sample format {tag} with {bits} bits");
            }
            let frame = width * channels;
            let pcm = data
                .chunks_exact(frame)
                .map(|f| {
                    let sum: f32 = f.chunks_exact(width).filter_map(sample).sum();
                    sum / channels as f32
                })
                .collect();
            return Ok((pcm, rate));
        }
        at = body.saturating_add(len + (len & 1));
    }
    invalid!("the WAVE file has no data chunk")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mel_scale_round_trips() {
        for f in [0.0, 300.0, 1000.0, 4000.0, 8000.0] {
            assert!((mel_to_hertz(hertz_to_mel(f)) - f).abs() < 1e-6);
        }
    }

    #[test]
    fn silence_gives_the_floor() {
        let fe = FeatureExtractor::whisper(80).unwrap();
        let f = fe.features(&[0.0; 1600]).unwrap();
        assert_eq!(f.len(), 80 * 3000);
        // log10(1e-10) = -10, clamped to max - 8 = -10: (-10 + 4) / 4.
        assert!(f.iter().all(|&v| (v + 1.5).abs() < 1e-6));
    }

    #[test]
    fn bad_audio_is_an_error() {
        let fe = FeatureExtractor::whisper(80).unwrap();
        let e = fe.features(&[0.0, f32::NAN]).unwrap_err().to_string();
        assert!(e.contains("audio sample 1 is NaN"), "{e}");
        assert!(read_wav(b"not a wav").is_err());
        assert!(resample(&[1.0], 0, 16000).is_err());
    }

    #[test]
    fn resampling_keeps_duration() {
        let pcm = vec![0.5; 48000];
        let out = resample(&pcm, 48000, 16000).unwrap();
        assert_eq!(out.len(), 16000);
        assert!(out.iter().all(|&x| (x - 0.5).abs() < 1e-6));
    }
}
