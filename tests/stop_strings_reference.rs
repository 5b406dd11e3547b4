//! `stop_strings` against transformers' `StopStringCriteria` on the fixture tokenizers
//! (tests/fixtures/stop_strings_reference.json, written by
//! tests/tools/stop_strings_reference.py): after each token of random sequences, the same
//! decision to stop.

use std::path::PathBuf;

use onnx_generate::processors::stop_strings::{StopStrings, STATIC_PREFIX};
use onnx_generate::Tokenizer;
use serde_json::Value;

#[test]
fn stop_strings_decide_as_transformers() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("stop_strings_reference.json")).unwrap(),
    )
    .unwrap();
    let mut failures = vec![];
    let mut stops = 0;
    for case in data["cases"].as_array().unwrap() {
        let model = case["model"].as_str().unwrap();
        let bytes = std::fs::read(root.join("models").join(model).join("tokenizer.json")).unwrap();
        let tokenizer = Tokenizer::from_bytes(&bytes).unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let strings: Vec<String> = case["stop_strings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect();
        let prefix = tokenizer.encode(STATIC_PREFIX, false).unwrap();
        let criteria = StopStrings::new(&strings).unwrap().with_prefix(prefix);
        for (k, want) in case["stop_after"].as_array().unwrap().iter().enumerate() {
            let want = want.as_bool().unwrap();
            let got = criteria
                .matches(&ids[..k + 1], |t| tokenizer.decode_with_special_tokens(t))
                .unwrap();
            stops += want as usize;
            if got != want {
                failures.push(format!(
                    "{model} {ids:?}[..{}] {strings:?}: got {got}, expected {want}",
                    k + 1
                ));
            }
        }
    }
    assert!(stops > 50, "too few stops in the reference: {stops}");
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
