//! Golden parity: every greedy case of the decoder-only fixtures, token ids exact and scores
//! within 1e-4, across the three cache modes, the merged decoder and an encoder-decoder (T5)
//! with its merged and its split decoders.

mod support;

use std::path::PathBuf;

use onnx_generate::model::DecoderLayout;
use onnx_generate::{Model, ModelFiles};
use support::golden::{self, Outcome};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Run the cases of `name` selected by `select`; every one must pass (none skipped).
fn run(name: &str, select: impl Fn(&serde_json::Value) -> bool) {
    run_with(name, DecoderLayout::Auto, select)
}

fn run_with(name: &str, layout: DecoderLayout, select: impl Fn(&serde_json::Value) -> bool) {
    let dir = fixtures().join("models").join(name);
    let model = Model::load(&ModelFiles::from_dir_with(&dir, None, layout).unwrap()).unwrap();
    let golden = golden::load(&fixtures().join("golden").join(format!("{name}.json")));
    let mut ran = 0;
    let mut failures = vec![];
    for case in golden::cases(&golden).iter().filter(|c| select(c)) {
        let result = golden::run_case(&model, case);
        ran += 1;
        if result.outcome != Outcome::Passed {
            failures.push(format!("{}: {:?}", result.id, result.outcome));
        }
    }
    assert!(ran > 0, "no case selected in {name}");
    assert!(
        failures.is_empty(),
        "{name}: {} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Greedy cases without sampling, beams or processors.
fn plain_greedy(case: &serde_json::Value) -> bool {
    golden::has_tag(case, "plain_greedy")
}

#[test]
fn llama_append_greedy() {
    run("llama", plain_greedy);
}

#[test]
fn gpt2_append_greedy() {
    run("gpt2", plain_greedy);
}

#[test]
fn gpt2_nopos_grow_greedy() {
    run("gpt2-nopos", plain_greedy);
}

#[test]
fn gpt2_merged_greedy() {
    run("gpt2-merged", plain_greedy);
}

#[test]
fn t5_merged_decoder_greedy() {
    run("t5", plain_greedy);
}

#[test]
fn t5_split_decoders_greedy() {
    run_with("t5", DecoderLayout::Split, plain_greedy);
}
