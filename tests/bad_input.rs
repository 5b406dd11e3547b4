//! Bad input gets an error that names the problem; nothing panics and the loaded model stays
//! usable afterwards.

use std::path::PathBuf;

use onnx_generate::{Error, Model, ModelFiles};
use serde_json::{json, Map, Value};

fn llama_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama")
}

fn llama_files() -> ModelFiles {
    ModelFiles::from_dir(&llama_dir(), None).unwrap()
}

fn options(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

/// The golden greedy tokens of `greedy_p1` (prompt "hello").
const HELLO: [u32; 4] = [1, 355, 459, 316];
const HELLO_EXPECTED: [u32; 12] = [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297];

fn assert_still_works(model: &Model) {
    let out = model
        .generate(
            &[HELLO.to_vec()],
            &options(json!({"max_new_tokens": 12})),
            |_| {},
        )
        .unwrap();
    assert_eq!(out.sequences[0][0].token_ids, HELLO_EXPECTED);
}

fn load_err(files: &ModelFiles) -> String {
    match Model::load(files) {
        Ok(_) => panic!("loading should fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn corrupt_onnx_bytes() {
    let mut files = llama_files();
    files.model = b"this is not an onnx file at all".to_vec();
    let m = load_err(&files);
    assert!(
        m.contains("model.onnx") && m.contains("not a valid ONNX"),
        "{m}"
    );
}

#[test]
fn truncated_onnx_bytes() {
    let mut files = llama_files();
    files.model.truncate(files.model.len() / 2);
    let m = load_err(&files);
    assert!(m.contains("model.onnx"), "{m}");
}

#[test]
fn empty_onnx_bytes() {
    let mut files = llama_files();
    files.model.clear();
    assert!(load_err(&files).contains("model.onnx is empty"));
}

#[test]
fn missing_external_data() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama-genai");
    let mut files = ModelFiles::from_dir(&dir, None).unwrap();
    files.external_data = None;
    let m = load_err(&files);
    assert!(m.contains("external data file `model.onnx.data`"), "{m}");
    files.external_data = Some(vec![0; 100]);
    let m = load_err(&files);
    assert!(m.contains("truncated or wrong external data"), "{m}");
}

#[test]
fn missing_required_file() {
    let dir = std::env::temp_dir().join(format!("onnx-generate-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(llama_dir().join("model.onnx"), dir.join("model.onnx")).unwrap();
    std::fs::copy(llama_dir().join("config.json"), dir.join("config.json")).unwrap();
    let e = ModelFiles::from_dir(&dir, None).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(e.contains("tokenizer.json is missing"), "{e}");
    let e = ModelFiles::from_dir(&llama_dir().join("nope"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a model folder"), "{e}");
    let e = ModelFiles::from_dir(&llama_dir(), Some("q4"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("model_q4.onnx"), "{e}");
}

#[test]
fn bad_json_files() {
    let mut files = llama_files();
    files.config = b"{not json".to_vec();
    assert!(load_err(&files).contains("config.json is not valid JSON"));
    let mut files = llama_files();
    files.tokenizer = b"{}".to_vec();
    assert!(load_err(&files).contains("tokenizer.json"));
    let mut files = llama_files();
    files.generation_config = Some(b"[1, 2]".to_vec());
    assert!(load_err(&files).contains("generation_config.json"));
}

#[test]
fn tokenizer_larger_than_the_logits() {
    let mut files = llama_files();
    let mut tok: Value = serde_json::from_slice(&files.tokenizer).unwrap();
    let added = tok["added_tokens"].as_array_mut().unwrap();
    for i in 0..10 {
        added.push(
            json!({"id": 600 + i, "content": format!("<extra_{i}>"), "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    files.tokenizer = serde_json::to_vec(&tok).unwrap();
    let m = load_err(&files);
    assert!(
        m.contains("logits are 512 wide") && m.contains("does not belong"),
        "{m}"
    );
}

#[test]
fn bad_requests_leave_the_model_usable() {
    let model = Model::load(&llama_files()).unwrap();
    let cases: Vec<(Vec<Vec<u32>>, Value, &str)> = vec![
        (vec![vec![]], json!({}), "prompt 0 is empty"),
        (vec![], json!({}), "no prompt"),
        (
            vec![vec![1, 9999]],
            json!({}),
            "token id 9999 at position 1 of prompt 0 is outside the vocabulary",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"max_new_tokens": 0}),
            "`max_new_tokens` must be at least 1",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"max_new_tokens": -3}),
            "`max_new_tokens` must be a non-negative integer",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"max_new_token": 3}),
            "unknown option `max_new_token`",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"eos_token_id": "two"}),
            "`eos_token_id`",
        ),
        // Found by `random_options_end_in_a_result_or_an_error`: 2^32 beams aborted on their
        // allocation; 1e300 was an infinite temperature.
        (
            vec![HELLO.to_vec()],
            json!({"num_beams": 4294967296u64}),
            "`num_beams` must be at most 1024",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"do_sample": true, "num_return_sequences": 1025}),
            "`num_return_sequences` must be at most 1024",
        ),
        (
            vec![HELLO.to_vec()],
            json!({"temperature": 1e300}),
            "`temperature` must be a finite number, got 1e+300",
        ),
    ];
    for (prompts, opts, expected) in cases {
        let err = model
            .generate(&prompts, &options(opts), |_| {})
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
        assert!(
            err.to_string().contains(expected),
            "{err} should contain {expected:?}"
        );
        assert_still_works(&model);
    }
}

#[test]
fn aborting_releases_the_request_and_the_model_goes_on() {
    let model = Model::load(&llama_files()).unwrap();
    let mut generation = onnx_generate::Generation::new(
        &model,
        &[HELLO.to_vec()],
        &options(json!({"max_new_tokens": 12})),
        vec![],
    )
    .unwrap();
    let first = generation.step(&model).unwrap();
    assert_eq!(first.len(), 1);
    generation.abort();
    assert!(generation.is_finished());
    let out = generation.output(&model).unwrap();
    assert_eq!(out.sequences[0][0].finish_reason.as_str(), "abort");
    assert_eq!(out.sequences[0][0].token_ids, &HELLO_EXPECTED[..1]);
    assert_still_works(&model);
}

#[test]
fn plans_do_not_grow_with_generation_length() {
    let model = Model::load(&llama_files()).unwrap();
    let before = model.plans();
    let out = model
        .generate(
            &[HELLO.to_vec()],
            &options(json!({"max_new_tokens": 200, "eos_token_id": null})),
            |_| {},
        )
        .unwrap();
    assert_eq!(out.sequences[0][0].token_ids.len(), 200);
    assert_eq!(before, 1);
    assert_eq!(
        model.plans(),
        1,
        "a 200-token generation must reuse the one plan"
    );
}

/// Requests with options drawn at random (one to three of the options the engine knows, each
/// with a value from a pool of odd ones: zero, negatives, huge numbers, wrong types, empty and
/// out-of-vocabulary lists) end in a result or an `InvalidInput` (or `Unsupported`) error,
/// never a panic, and the model generates the golden tokens after each error. Deterministic
/// draws (xorshift64 from a fixed seed), 1,500 (`OPTIONS_DRAWS=n` for more);
/// `OPTIONS_TRACE=1` prints each request first (an allocation failure aborts the process
/// without a message).
#[test]
fn random_options_end_in_a_result_or_an_error() {
    use onnx_generate::config::{OPTION_NAMES, UNSUPPORTED_NAMES};
    let names: Vec<&str> = OPTION_NAMES
        .iter()
        .chain(UNSUPPORTED_NAMES)
        .copied()
        .collect();
    let values = [
        json!(0),
        json!(1),
        json!(2),
        json!(3),
        json!(-1),
        json!(0.5),
        json!(1.5),
        json!(-0.5),
        json!(1e9),
        json!(1e300),
        json!(511),
        json!(512),
        json!(4294967296u64),
        json!(true),
        json!(false),
        json!(null),
        json!("never"),
        json!("x"),
        json!(""),
        json!([]),
        json!([[]]),
        json!([1, 2]),
        json!([[411, 403], [197]]),
        json!([[-1]]),
        json!([[600]]),
        json!([3, 1.5]),
        json!([1e9, 0.5]),
        json!({"411": 2.0}),
        json!({"x": 1.0}),
        json!([[[411], -5.0]]),
        json!(["hello", ""]),
        json!({}),
    ];
    let model = Model::load(&llama_files()).unwrap();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let (mut ok, mut errors) = (0, 0);
    let draws = std::env::var("OPTIONS_DRAWS").map_or(1500, |n| n.parse().unwrap());
    for _ in 0..draws {
        let mut opts = Map::new();
        opts.insert("max_new_tokens".into(), json!(4));
        for _ in 0..1 + next(3) {
            let name = names[next(names.len())];
            opts.insert(name.into(), values[next(values.len())].clone());
        }
        let described = Value::Object(opts.clone()).to_string();
        if std::env::var_os("OPTIONS_TRACE").is_some() {
            eprintln!("trying {described}");
        }
        // At most eight steps, then an abort: options may ask for billions of tokens.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let prompts = [HELLO.to_vec(), vec![7, 9]];
            let mut generation = onnx_generate::Generation::new(&model, &prompts, &opts, vec![])?;
            for _ in 0..8 {
                if generation.is_finished() {
                    break;
                }
                generation.step(&model)?;
            }
            generation.abort();
            generation.output(&model)
        }))
        .unwrap_or_else(|_| panic!("options {described} panicked"));
        match result {
            Ok(_) => ok += 1,
            Err(Error::InvalidInput(_) | Error::Unsupported(_)) => {
                errors += 1;
                assert_still_works(&model);
            }
            Err(e) => {
                panic!("options {described}: an error of the engine, not of the request: {e}")
            }
        }
    }
    eprintln!("{ok} results, {errors} errors");
    // Both outcomes are drawn often enough to mean something.
    assert!(ok > 50 && errors > 50, "{ok} results, {errors} errors");
}
