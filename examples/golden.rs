//! Run every case of a golden file against a model and report the differences.
//!
//! ```text
//! cargo run --release --example golden -- --model DIR --cases FILE.json [--variant q4] [--only ID]
//! ```
//! Prints one line per failing or skipped case and ends with `N passed, M failed, K skipped`;
//! exits non-zero on any failure. `--model` takes the flat layout of the fixtures or the
//! transformers.js layout (ONNX files under `DIR/onnx/`); `--split` runs an encoder-decoder with
//! `decoder_model.onnx` + `decoder_with_past_model.onnx` instead of the merged decoder.
//! Vision-language golden files (cases with `arrays`, read from `.npy` files relative to the
//! JSON file's folder) use the stored image features, or with `--images encoder` the features
//! of the engine's image processor and `vision_encoder.onnx` on the raw images.

#[path = "../tests/support/golden.rs"]
mod golden;

use std::path::PathBuf;

use golden::{GoldenDir, ImageSource, Outcome};
use onnx_generate::model::DecoderLayout;
use onnx_generate::{Model, ModelFiles};

const USAGE: &str =
    "usage: golden --model DIR --cases FILE.json [--variant V] [--only ID] [--split] \
                     [--images stored|encoder]";

fn main() {
    let mut model_dir = None;
    let mut cases_file = None;
    let mut variant = None;
    let mut only = None;
    let mut layout = DecoderLayout::Auto;
    let mut source = ImageSource::Stored;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model_dir = args.next().map(PathBuf::from),
            "--cases" => cases_file = args.next().map(PathBuf::from),
            "--variant" => variant = args.next(),
            "--only" => only = args.next(),
            "--split" => layout = DecoderLayout::Split,
            "--images" => {
                source = match args.next().as_deref() {
                    Some("stored") => ImageSource::Stored,
                    Some("encoder") => ImageSource::Encoder,
                    _ => {
                        eprintln!("--images takes `stored` or `encoder`");
                        std::process::exit(2);
                    }
                }
            }
            _ => {
                eprintln!("{USAGE}");
                std::process::exit(2);
            }
        }
    }
    let (Some(model_dir), Some(cases_file)) = (model_dir, cases_file) else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let model = ModelFiles::from_dir_with(&model_dir, variant.as_deref(), layout)
        .and_then(|f| Model::load(&f));
    let model = match model {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let golden = golden::load(&cases_file);
    let dir = GoldenDir::new(&cases_file, &golden, source);
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for case in golden::cases(&golden) {
        if only.as_deref().is_some_and(|o| case["id"] != o) {
            continue;
        }
        let result = golden::run_case_in(&model, &case, Some(&dir));
        match result.outcome {
            Outcome::Passed => passed += 1,
            Outcome::Failed(why) => {
                failed += 1;
                println!("FAILED {}: {why}", result.id);
            }
            Outcome::Skipped(why) => {
                skipped += 1;
                println!("skipped {}: {why}", result.id);
            }
        }
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    if failed > 0 {
        std::process::exit(1);
    }
}
