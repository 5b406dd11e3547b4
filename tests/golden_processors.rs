//! Golden parity of the logits processors and the sampling warpers: every case tagged
//! `processor` or `sampling` (beam cases aside) of the decoder-only fixtures passes, none
//! skipped: token ids exact, transition scores within 1e-4, sampling distributions within 1e-5
//! per probability with the exact support size.

mod support;

use std::path::PathBuf;

use onnx_generate::{Model, ModelFiles};
use support::golden::{self, Outcome};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn selected(case: &serde_json::Value) -> bool {
    (golden::has_tag(case, "processor") || golden::has_tag(case, "sampling"))
        && !golden::has_tag(case, "beam")
}

/// Run the selected cases of `name`; every one must pass (none skipped).
fn run(name: &str) {
    let dir = fixtures().join("models").join(name);
    let model = Model::load(&ModelFiles::from_dir(&dir, None).unwrap()).unwrap();
    let golden = golden::load(&fixtures().join("golden").join(format!("{name}.json")));
    let mut ran = 0;
    let mut kinds = std::collections::BTreeSet::new();
    let mut failures = vec![];
    for case in golden::cases(&golden).iter().filter(|c| selected(c)) {
        let result = golden::run_case(&model, case);
        ran += 1;
        kinds.insert(case["kind"].as_str().unwrap_or("?").to_owned());
        if result.outcome != Outcome::Passed {
            failures.push(format!("{}: {:?}", result.id, result.outcome));
        }
    }
    assert!(ran >= 20, "only {ran} cases selected in {name}");
    assert_eq!(kinds.len(), 2, "{name}: kinds {kinds:?}");
    assert!(
        failures.is_empty(),
        "{name}: {} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn llama_processors_and_sampling() {
    run("llama");
}

#[test]
fn gpt2_processors_and_sampling() {
    run("gpt2");
}

#[test]
fn gpt2_nopos_processors_and_sampling() {
    run("gpt2-nopos");
}

#[test]
fn gpt2_merged_processors_and_sampling() {
    run("gpt2-merged");
}
