//! The encoder processors on the t5 fixture against transformers' `generate()`
//! (tests/fixtures/encoder_processors_reference.json, written by
//! tests/tools/encoder_processors_reference.py): each prompt alone and all prompts in one
//! batch, where each row reads its own encoder input.

use std::path::PathBuf;

use onnx_generate::{Model, ModelFiles};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn t5_encoder_processors_match_transformers() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let model = Model::load(&ModelFiles::from_dir(&root.join("models/t5"), None).unwrap()).unwrap();
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("encoder_processors_reference.json")).unwrap(),
    )
    .unwrap();
    let cases = data["cases"].as_array().unwrap();
    let mut failures = vec![];
    // Alone.
    for case in cases {
        let options = case["options"].as_object().unwrap();
        let out = model
            .generate(&[ids(&case["prompt"])], options, |_| {})
            .unwrap();
        let seq = &out.sequences[0][0];
        if seq.token_ids != ids(&case["new_token_ids"])
            || seq.finish_reason.as_str() != case["finish_reason"].as_str().unwrap()
        {
            failures.push(format!(
                "{} {}: got {:?} ({:?}), expected {} ({})",
                case["options"],
                case["prompt"],
                seq.token_ids,
                seq.finish_reason,
                case["new_token_ids"],
                case["finish_reason"]
            ));
        }
    }
    // Batched by option set: row r reads prompt r's encoder input.
    for group in cases.chunk_by(|a, b| a["options"] == b["options"]) {
        let prompts: Vec<Vec<u32>> = group.iter().map(|c| ids(&c["prompt"])).collect();
        let options = group[0]["options"].as_object().unwrap();
        let out = model.generate(&prompts, options, |_| {}).unwrap();
        for (case, seqs) in group.iter().zip(&out.sequences) {
            if seqs[0].token_ids != ids(&case["new_token_ids"]) {
                failures.push(format!(
                    "batch {} {}: got {:?}, expected {}",
                    case["options"], case["prompt"], seqs[0].token_ids, case["new_token_ids"]
                ));
            }
        }
    }
    // The processors matter here: without them prompt 2 continues otherwise.
    let plain = model
        .generate(
            &[ids(&cases[2]["prompt"])],
            serde_json::json!({"max_new_tokens": 10})
                .as_object()
                .unwrap(),
            |_| {},
        )
        .unwrap();
    assert_ne!(
        plain.sequences[0][0].token_ids,
        ids(&cases[2]["new_token_ids"])
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
