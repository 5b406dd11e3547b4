//! Golden parity for the onnxruntime-genai fixture (`llama-genai`: GroupQueryAttention with a
//! shared past/present buffer, the in_place cache mode). Every case runs; a case may be skipped
//! only for a processor or beam option the engine reports Unsupported (other branches add them);
//! every other case must pass with exact token ids.

mod support;

use std::path::PathBuf;

use onnx_generate::{Model, ModelFiles};
use support::golden::{self, Outcome};

#[test]
fn llama_genai_in_place_golden() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let model =
        Model::load(&ModelFiles::from_dir(&fixtures.join("models/llama-genai"), None).unwrap())
            .unwrap();
    assert_eq!(model.signature.cache_mode.name(), "in_place");
    let golden = golden::load(&fixtures.join("golden/llama-genai.json"));
    let (mut passed, mut skipped, mut failures) = (0, vec![], vec![]);
    let mut plain = 0;
    for case in golden::cases(&golden) {
        let result = golden::run_case(&model, &case);
        let is_plain = golden::has_tag(&case, "plain_greedy");
        plain += is_plain as usize;
        match result.outcome {
            Outcome::Passed => passed += 1,
            Outcome::Skipped(why) if !is_plain => skipped.push(format!("{}: {why}", result.id)),
            other => failures.push(format!("{}: {other:?}", result.id)),
        }
    }
    eprintln!(
        "llama-genai: {passed} passed, {} skipped (features other branches add):\n  {}",
        skipped.len(),
        skipped.join("\n  ")
    );
    assert!(plain > 0, "no plain greedy case in llama-genai.json");
    assert!(
        failures.is_empty(),
        "llama-genai: {} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
