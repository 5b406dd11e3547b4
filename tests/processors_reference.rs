//! The processor chain against transformers' own `_get_logits_processor` chain on random
//! scores (tests/fixtures/processors_reference.json, written by
//! tests/tools/processors_reference.py): every processor, including those the golden files of
//! the fixture models do not exercise (min_p, sequence_bias, forced_eos, exponential decay,
//! the encoder processors, beam-sampling `min_tokens_to_keep`). The same `-inf` entries, the
//! other scores within 1e-5 (relative above 1).

use std::path::PathBuf;

use onnx_generate::processors::{Chain, ChainInputs, RowContext};
use onnx_generate::GenerationConfig;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn chain_matches_transformers_on_random_scores() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/processors_reference.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let vocab = data["vocab"].as_u64().unwrap() as usize;
    let cases = data["cases"].as_array().unwrap();
    assert!(cases.len() >= 80);
    let mut failures = vec![];
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut options = case["options"].as_object().unwrap().clone();
        options.insert("eos_token_id".into(), case["eos_token_id"].clone());
        let mut config = GenerationConfig::default();
        config.apply_options(&options).unwrap();
        let inputs = ChainInputs {
            encoder_ids: case["encoder_ids"]
                .as_array()
                .map(|_| vec![ids(&case["encoder_ids"])]),
        };
        let mut chain = Chain::build_with(&config, vocab, &inputs, vec![]).unwrap();
        assert_eq!(
            chain.len(),
            case["processors"].as_array().unwrap().len(),
            "{name}: processors {}",
            case["processors"]
        );
        let seq = ids(&case["ids"]);
        let prompt_len = case["prompt_len"].as_u64().unwrap() as usize;
        let ctx = RowContext {
            row: 0,
            ids: &seq,
            prompt_len,
            max_length: prompt_len + config.max_new_tokens.unwrap_or(20),
        };
        let mut scores: Vec<f32> = case["scores"]
            .as_array()
            .unwrap()
            .iter()
            // JSON has no -inf: the fixture writes null.
            .map(|x| x.as_f64().map(|f| f as f32).unwrap_or(f32::NEG_INFINITY))
            .collect();
        chain.apply(&ctx, &mut scores).unwrap();
        for (t, (got, want)) in scores
            .iter()
            .zip(case["expected"].as_array().unwrap())
            .enumerate()
        {
            let ok = match want.as_f64() {
                None => *got == f32::NEG_INFINITY,
                Some(w) => (*got as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
            };
            if !ok {
                failures.push(format!("{name}: token {t}: got {got}, expected {want}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
