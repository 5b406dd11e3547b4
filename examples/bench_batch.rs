//! Tokens per second of batches of 1, 4 and 8 rows (greedy), and of beam search, on a real
//! model (SmolLM2-135M-Instruct by default). Prints figures; it is not a timed test.
//!
//! ```text
//! cargo run --release --example bench_batch -- [MODEL_DIR] [--variant q4] [--new-tokens N]
//! ```
//! `MODEL_DIR` defaults to `.realmodels/smollm2/tjs` (transformers.js layout). Each size runs
//! twice: the first run also compiles the plan of that batch size (tract fixes the batch size
//! in a plan), the second is the steady figure.

use std::path::PathBuf;
use std::time::Instant;

use onnx_generate::{Model, ModelFiles};
use serde_json::json;

const TEXTS: [&str; 8] = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "List three uses of copper:",
    "Translate to German: good morning",
    "Why is the sky blue? Explain it to a child in two sentences.",
    "Hello",
];

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".realmodels/smollm2/tjs");
    let mut variant = None;
    let mut new_tokens = 32u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--variant" => variant = args.next(),
            "--new-tokens" => new_tokens = args.next().ok_or("--new-tokens N")?.parse()?,
            _ => dir = PathBuf::from(a),
        }
    }
    let t = Instant::now();
    let model = Model::load(&ModelFiles::from_dir(&dir, variant.as_deref())?)?;
    println!(
        "model {} ({}): loaded in {:.2}s",
        dir.display(),
        variant.as_deref().unwrap_or("fp32"),
        t.elapsed().as_secs_f64()
    );
    let prompts: Vec<Vec<u32>> = TEXTS
        .iter()
        .map(|t| model.tokenizer.encode(t, true))
        .collect::<Result<_, _>>()?;
    // No eos: every row makes exactly `new_tokens` tokens.
    let greedy = json!({"max_new_tokens": new_tokens, "eos_token_id": null});
    println!("greedy, {new_tokens} new tokens per row, prompts of 1 to 19 tokens");
    println!("rows | first run s | steady s | prefill s | decode tok/s | total tok/s");
    for rows in [1usize, 4, 8] {
        let (first, _, _) = timed(&model, &prompts[..rows], &greedy)?;
        let (total, prefill, tokens) = timed(&model, &prompts[..rows], &greedy)?;
        let decode_tokens = tokens.saturating_sub(rows) as f64;
        println!(
            "{rows:4} | {first:11.2} | {total:8.2} | {prefill:9.2} | {:12.1} | {:11.1}",
            decode_tokens / (total - prefill),
            tokens as f64 / total
        );
    }
    let beams = json!({"max_new_tokens": new_tokens, "eos_token_id": null, "num_beams": 4,
        "early_stopping": true});
    println!("beam search, 4 beams ({new_tokens} new tokens)");
    for rows in [1usize, 2] {
        let (first, _, _) = timed(&model, &prompts[..rows], &beams)?;
        let (total, _, _) = timed(&model, &prompts[..rows], &beams)?;
        println!(
            "{rows} prompt(s) x 4 beams: first run {first:.2}s, steady {total:.2}s, {:.1} beam-tokens/s",
            (rows * 4) as f64 * new_tokens as f64 / total
        );
    }
    println!("plans compiled: {}", model.plans());
    Ok(())
}

/// `(wall seconds, seconds to the first token, tokens generated)`.
fn timed(
    model: &Model,
    prompts: &[Vec<u32>],
    options: &serde_json::Value,
) -> Result<(f64, f64, usize), Box<dyn std::error::Error>> {
    let options = options.as_object().cloned().unwrap_or_default();
    let t = Instant::now();
    let mut first = None;
    let out = model.generate(prompts, &options, |_| {
        first.get_or_insert_with(|| t.elapsed().as_secs_f64());
    })?;
    let total = t.elapsed().as_secs_f64();
    let tokens = out.sequences.iter().map(|s| s[0].token_ids.len()).sum();
    Ok((total, first.unwrap_or(total), tokens))
}
