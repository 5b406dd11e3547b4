//! Decode speed and memory of SmolLM2-135M-Instruct in its shipped variants (native; the wasm
//! numbers come from the wasm build, see README).
//!
//! ```text
//! cargo run --release --example bench_decode -- [MODELS_DIR] [--variant NAME] [--long]
//! ```
//! `MODELS_DIR` holds `smollm2/tjs` and `smollm2/genai_int4_cpu` (default: `.realmodels`, or
//! `$ONNX_GENERATE_REAL_MODELS`). Variants: `fp32` (tjs model.onnx), `fp16`, `q4` (MatMulNBits),
//! `int8` (MatMulInteger), `genai_int4` (GroupQueryAttention, in_place cache). Without
//! `--variant` each runs in its own process (so peak RSS is its own) and one line per variant
//! is printed: load time, prompt time, decode tokens/s over 64 greedy tokens, peak RSS. With
//! `--long`, also ms/token of single-token steps at 64 and at 1024 cached positions.

use std::path::{Path, PathBuf};
use std::time::Instant;

use onnx_generate::{Model, ModelFiles};

const VARIANTS: [&str; 5] = ["fp32", "fp16", "q4", "int8", "genai_int4"];

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn run() -> Res<()> {
    let mut root = std::env::var_os("ONNX_GENERATE_REAL_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".realmodels"));
    let mut variant = None;
    let mut long = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--variant" => variant = args.next(),
            "--long" => long = true,
            _ => root = PathBuf::from(a),
        }
    }
    match variant {
        Some(v) => bench(&root, &v, long),
        None => {
            let exe = std::env::current_exe()?;
            for v in VARIANTS {
                let mut cmd = std::process::Command::new(&exe);
                cmd.arg(&root).arg("--variant").arg(v);
                if long {
                    cmd.arg("--long");
                }
                let status = cmd.status()?;
                if !status.success() {
                    println!("{v}: failed ({status})");
                }
            }
            Ok(())
        }
    }
}

fn files(root: &Path, variant: &str) -> Res<ModelFiles> {
    let tjs = root.join("smollm2/tjs");
    let read = |p: PathBuf| std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()));
    Ok(match variant {
        "genai_int4" => {
            let dir = root.join("smollm2/genai_int4_cpu");
            ModelFiles {
                model_name: "model.onnx".into(),
                model: read(dir.join("model.onnx"))?,
                external_data: Some(read(dir.join("model.onnx.data"))?),
                config: read(tjs.join("config.json"))?,
                generation_config: Some(read(tjs.join("generation_config.json"))?),
                tokenizer: read(tjs.join("tokenizer.json"))?,
                ..Default::default()
            }
        }
        "fp32" => ModelFiles::from_dir(&tjs, None)?,
        "fp16" => ModelFiles::from_dir(&tjs, Some("fp16"))?,
        "q4" => ModelFiles::from_dir(&tjs, Some("q4"))?,
        "int8" => ModelFiles::from_dir(&tjs, Some("quantized"))?,
        v => return Err(format!("unknown variant {v} (one of {VARIANTS:?})").into()),
    })
}

fn bench(root: &Path, variant: &str, long: bool) -> Res<()> {
    let t = Instant::now();
    let model = Model::load_owned(files(root, variant)?)?;
    let load = t.elapsed().as_secs_f64();
    let prompt = model.tokenizer.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        false,
    )?;
    let mut state = model.start(1, 2048, None)?;
    let t = Instant::now();
    let logits = state.step(&[&prompt])?;
    let prefill = t.elapsed().as_secs_f64();
    let mut token = argmax(logits.row(0));
    let n = 64;
    let t = Instant::now();
    for _ in 0..n {
        let logits = state.step(&[&[token]])?;
        token = argmax(logits.row(0));
    }
    let decode = t.elapsed().as_secs_f64();
    let mut line = format!(
        "{variant:<11} load {load:6.2}s  prompt({} tok) {:7.1}ms  decode {:6.1} tok/s ({:6.1} ms/tok)",
        prompt.len(),
        prefill * 1e3,
        n as f64 / decode,
        decode * 1e3 / n as f64
    );
    if long {
        // ms/token of single steps at 64 and 1024 cached positions (the cache filled by
        // prompt-sized chunks of a repeated text).
        let mut state = model.start(1, 1100, None)?;
        let filler: Vec<u32> = prompt.iter().cycle().take(64).copied().collect();
        state.step(&[&filler])?;
        let at64 = time_steps(&mut *state, 8)?;
        let chunk: Vec<u32> = prompt.iter().cycle().take(240).copied().collect();
        while state.lengths()[0] + 240 <= 1024 {
            state.step(&[&chunk])?;
        }
        let rest = 1024 - state.lengths()[0];
        if rest > 0 {
            state.step(&[&chunk[..rest]])?;
        }
        let at1024 = time_steps(&mut *state, 8)?;
        line += &format!("  ms/tok @64 {at64:6.2}  @1024 {at1024:6.2}");
    }
    line += &format!("  peak RSS {:.0} MiB", peak_rss_mib());
    println!("{line}");
    Ok(())
}

fn time_steps(state: &mut dyn onnx_generate::DecoderState, n: usize) -> Res<f64> {
    let t = Instant::now();
    let mut token = 504;
    for _ in 0..n {
        let logits = state.step(&[&[token]])?;
        token = argmax(logits.row(0));
    }
    Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// VmHWM of this process (Linux), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}
