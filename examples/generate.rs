//! Stream tokens to the terminal from a model folder.
//!
//! ```text
//! cargo run --release --example generate -- [MODEL_DIR] [--variant q4] [--prompt TEXT]
//!     [--chat] [--max-new-tokens N] [--options JSON]
//! ```
//! Without a folder it uses the tiny `llama` fixture that ships in the repository.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use onnx_generate::{Model, ModelFiles};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama");
    let mut variant = None;
    let mut prompt = String::from("The quick brown fox");
    let mut chat = false;
    let mut options = serde_json::Map::new();
    options.insert("max_new_tokens".into(), 32.into());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--variant" => variant = Some(value()?),
            "--prompt" => prompt = value()?,
            "--chat" => chat = true,
            "--max-new-tokens" => {
                options.insert("max_new_tokens".into(), value()?.parse::<u64>()?.into());
            }
            "--options" => {
                let extra: serde_json::Value = serde_json::from_str(&value()?)?;
                for (k, v) in extra.as_object().ok_or("--options takes a JSON object")? {
                    options.insert(k.clone(), v.clone());
                }
            }
            "-h" | "--help" => {
                println!("usage: generate [MODEL_DIR] [--variant V] [--prompt TEXT] [--chat] [--max-new-tokens N] [--options JSON]");
                return Ok(());
            }
            _ => dir = PathBuf::from(a),
        }
    }
    let t0 = Instant::now();
    let files = ModelFiles::from_dir(&dir, variant.as_deref())?;
    let model = Model::load(&files)?;
    drop(files);
    eprintln!(
        "loaded {} in {:.2?} (cache mode {})",
        dir.display(),
        t0.elapsed(),
        model.signature.cache_mode.name()
    );
    let text = if chat {
        format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    } else {
        prompt
    };
    let ids = model.tokenizer.encode(&text, !chat)?;
    let mut first: Option<Instant> = None;
    let mut count = 0usize;
    let t1 = Instant::now();
    let out = model.generate(std::slice::from_ref(&ids), &options, |event| {
        first.get_or_insert_with(Instant::now);
        count += 1;
        print!("{}", event.text);
        let _ = std::io::stdout().flush();
    })?;
    println!();
    let total = t1.elapsed();
    let ttft = first.map(|f| f - t1).unwrap_or_default();
    let decode = total - ttft;
    eprintln!(
        "{} prompt tokens, {count} new tokens ({}); first token after {:.2?}; decode {:.1} tokens/s",
        ids.len(),
        out.sequences[0][0].finish_reason.as_str(),
        ttft,
        (count.saturating_sub(1)) as f64 / decode.as_secs_f64()
    );
    Ok(())
}
