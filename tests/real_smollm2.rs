//! Real-model test: SmolLM2-135M-Instruct fp32 answers the capital question greedily as
//! onnxruntime does. The model is built by `scripts/real-models.sh` into `.realmodels/` (or
//! the folder named by `ONNX_GENERATE_REAL_MODELS`); without it the test says so loudly and
//! passes.

use std::path::PathBuf;
use std::time::Instant;

use onnx_generate::{Model, ModelFiles};
use serde_json::Value;

fn real_models() -> Option<PathBuf> {
    let dir = std::env::var_os("ONNX_GENERATE_REAL_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".realmodels"));
    dir.join("smollm2/tjs/onnx/model.onnx")
        .is_file()
        .then_some(dir)
}

#[test]
fn smollm2_fp32_capital_of_france() {
    let Some(dir) = real_models() else {
        eprintln!("\n*** SKIPPED smollm2_fp32_capital_of_france: real models not found (run scripts/real-models.sh) ***\n");
        return;
    };
    let expected: Value =
        serde_json::from_str(include_str!("fixtures/real/smollm2_capital.json")).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        expected[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let t0 = Instant::now();
    let model =
        Model::load(&ModelFiles::from_dir(&dir.join("smollm2/tjs"), None).unwrap()).unwrap();
    let load = t0.elapsed();
    let options = serde_json::json!({"max_new_tokens": 32})
        .as_object()
        .cloned()
        .unwrap();
    let mut times = vec![];
    let t1 = Instant::now();
    let out = model
        .generate(&[ids("prompt_ids")], &options, |_| times.push(t1.elapsed()))
        .unwrap();
    let seq = &out.sequences[0][0];
    assert_eq!(seq.token_ids, ids("fp32_greedy_ids"));
    assert_eq!(
        seq.finish_reason.as_str(),
        expected["fp32_finish_reason"].as_str().unwrap()
    );
    assert!(
        seq.text.starts_with("The capital of France is Paris"),
        "{:?}",
        seq.text
    );
    let decode = times.last().unwrap().as_secs_f64() - times[0].as_secs_f64();
    eprintln!(
        "SmolLM2 fp32: load {load:.2?}, first token {:.2?}, decode {:.1} tokens/s, {} plan(s)",
        times[0],
        (times.len() - 1) as f64 / decode,
        model.plans()
    );
}
