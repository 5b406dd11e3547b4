//! The JavaScript API in real runtimes, shared by `tests/wasm_node.rs` (Node) and
//! `tests/wasm_browser.rs` (headless Chromium, `run_in_browser`); scripts/test-wasm.sh runs
//! both and fails when either runs no test. Golden greedy cases of `llama` and `gpt2` go through
//! `Model.load` / `model.generate` with JavaScript values, checking token ids and the stream of
//! `on_token` events; then streaming, abort, errors and recovery.
use js_sys::{Array, Function, Object, Promise, Reflect, Uint8Array, JSON};
use onnx_generate::wasm::{load_model, JsModel};
use serde_json::Value;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;
use wasm_bindgen_test::*;

struct Fixture {
    model: &'static [u8],
    config: &'static [u8],
    generation_config: &'static [u8],
    tokenizer: &'static [u8],
    golden: &'static str,
}

macro_rules! fixture {
    ($name:literal) => {
        Fixture {
            model: include_bytes!(concat!("../fixtures/models/", $name, "/model.onnx")),
            config: include_bytes!(concat!("../fixtures/models/", $name, "/config.json")),
            generation_config: include_bytes!(concat!(
                "../fixtures/models/",
                $name,
                "/generation_config.json"
            )),
            tokenizer: include_bytes!(concat!("../fixtures/models/", $name, "/tokenizer.json")),
            golden: include_str!(concat!("../fixtures/golden/", $name, ".json")),
        }
    };
}

fn llama() -> Fixture {
    fixture!("llama")
}

fn gpt2() -> Fixture {
    fixture!("gpt2")
}

fn js(v: &Value) -> JsValue {
    JSON::parse(&v.to_string()).unwrap()
}

fn get(o: &JsValue, k: &str) -> JsValue {
    Reflect::get(o, &k.into()).unwrap()
}

fn set(o: &JsValue, k: &str, v: &JsValue) {
    Reflect::set(o, &k.into(), v).unwrap();
}

fn bytes(b: &[u8]) -> JsValue {
    Uint8Array::from(b).into()
}

fn files(f: &Fixture) -> JsValue {
    let o: JsValue = Object::new().into();
    set(&o, "model", &bytes(f.model));
    set(&o, "config", &bytes(f.config));
    set(&o, "generation_config", &bytes(f.generation_config));
    set(&o, "tokenizer", &bytes(f.tokenizer));
    o
}

async fn load(f: &Fixture) -> JsModel {
    load_model(files(f), JsValue::UNDEFINED).await.unwrap()
}

async fn await_promise(p: Promise) -> Result<JsValue, JsValue> {
    JsFuture::from(p).await
}

fn ids_of(v: &JsValue) -> Vec<u32> {
    Array::from(v)
        .iter()
        .map(|x| x.as_f64().unwrap() as u32)
        .collect()
}

fn error_message(e: &JsValue) -> String {
    assert!(e.is_instance_of::<js_sys::Error>(), "not an Error: {e:?}");
    get(e, "message").as_string().unwrap()
}

/// Collects `on_token` events into a JS array.
fn collector() -> (Array, Function) {
    let events = Array::new();
    let push = Function::new_with_args("event", "this.push(event)").bind0(&events);
    (events, push)
}

/// Checks one golden case's events and result: the ids, order, count, `finished` on the last
/// event of each row only, and deltas that concatenate to the text.
fn check_events(case_id: &str, events: &Array, result: &JsValue, expected: &[Value]) {
    let sequences = Array::from(&get(result, "sequences"));
    assert_eq!(sequences.length() as usize, expected.len(), "{case_id}");
    for (row, exp) in expected.iter().enumerate() {
        let exp = &exp[0];
        let seq = Array::from(&sequences.get(row as u32)).get(0);
        let want: Vec<u32> = serde_json::from_value(exp["new_token_ids"].clone()).unwrap();
        assert_eq!(ids_of(&get(&seq, "token_ids")), want, "{case_id} row {row}");
        let reason = exp["finish_reason"].as_str().unwrap();
        assert_eq!(
            get(&seq, "finish_reason").as_string().unwrap(),
            reason,
            "{case_id}"
        );
        let row_events: Vec<JsValue> = events
            .iter()
            .filter(|e| get(e, "row").as_f64() == Some(row as f64))
            .collect();
        let count = want.len() + usize::from(reason == "eos");
        assert_eq!(row_events.len(), count, "{case_id} row {row}: event count");
        let mut text = String::new();
        for (i, e) in row_events.iter().enumerate() {
            let last = i + 1 == row_events.len();
            assert_eq!(
                get(e, "finished").as_bool(),
                Some(last),
                "{case_id} event {i}"
            );
            if i < want.len() {
                assert_eq!(
                    get(e, "token_id").as_f64(),
                    Some(want[i] as f64),
                    "{case_id}"
                );
            }
            text.push_str(&get(e, "text").as_string().unwrap());
        }
        if let Some(last) = row_events.last() {
            assert_eq!(get(last, "finish_reason").as_string().unwrap(), reason);
        }
        assert_eq!(
            text,
            get(&seq, "text").as_string().unwrap(),
            "{case_id}: deltas"
        );
    }
}

/// Runs the `plain_greedy` cases of a golden file through `model.generate` with token ids.
async fn golden_greedy(f: Fixture) {
    let model = load(&f).await;
    let golden: Value = serde_json::from_str(f.golden).unwrap();
    let mut ran = 0;
    for case in golden["cases"].as_array().unwrap() {
        let tags = case["tags"].as_array().unwrap();
        if !tags.iter().any(|t| t == "plain_greedy") || case["kind"] != "generate" {
            continue;
        }
        let id = case["id"].as_str().unwrap();
        let prompts = case["prompts"].as_array().unwrap();
        let input = if prompts.len() == 1 {
            js(&prompts[0]["ids"])
        } else {
            js(&Value::Array(
                prompts.iter().map(|p| p["ids"].clone()).collect(),
            ))
        };
        let options = js(&case["generation_kwargs"]);
        let (events, push) = collector();
        set(&options, "on_token", &push);
        let result = await_promise(model.generate(input, options)).await;
        let result = match result {
            Ok(r) => r,
            Err(e) => panic!("{id}: {}", error_message(&e)),
        };
        let expected = case["expected"].as_array().unwrap();
        check_events(id, &events, &result, expected);
        ran += 1;
    }
    assert!(ran >= 3, "only {ran} golden cases ran");
}

#[wasm_bindgen_test]
async fn llama_golden_greedy_through_js_api() {
    golden_greedy(llama()).await;
}

#[wasm_bindgen_test]
async fn gpt2_golden_greedy_through_js_api() {
    golden_greedy(gpt2()).await;
}

#[wasm_bindgen_test]
async fn text_input_and_load_progress() {
    let f = llama();
    let progress = Array::new();
    let push = Function::new_with_args("p", "this.push(p)").bind0(&progress);
    let options: JsValue = Object::new().into();
    set(&options, "on_progress", &push);
    let model = load_model(files(&f), options).await.unwrap();
    // Every file reported, the last report of each complete.
    for file in ["model", "config", "generation_config", "tokenizer"] {
        let last = progress
            .iter()
            .rfind(|p| get(p, "file").as_string().as_deref() == Some(file))
            .unwrap_or_else(|| panic!("no progress for {file}"));
        assert_eq!(get(&last, "loaded").as_f64(), get(&last, "total").as_f64());
    }
    // The golden case greedy_p1 from text: "hello" encodes to its ids.
    let result = await_promise(model.generate(
        "hello".into(),
        js(&serde_json::json!({"max_new_tokens": 12})),
    ))
    .await
    .unwrap();
    assert_eq!(
        ids_of(&get(&result, "token_ids")),
        [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297]
    );
    assert_eq!(get(&result, "finish_reason").as_string().unwrap(), "length");
    assert_eq!(model.encode("hello", None).unwrap(), [1, 355, 459, 316]);
}

#[wasm_bindgen_test]
async fn chat_input_uses_the_template() {
    let f = llama();
    let fs = files(&f);
    set(
        &fs,
        "chat_template",
        &"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}".into(),
    );
    let model = load_model(fs, JsValue::UNDEFINED).await.unwrap();
    let messages = js(&serde_json::json!([{"role": "user", "content": "hello"}]));
    let text = model.apply_chat_template(messages.clone(), None).unwrap();
    assert_eq!(text, "user: hello\nassistant:");
    let opts = serde_json::json!({"max_new_tokens": 5});
    let chat = await_promise(model.generate(messages, js(&opts)))
        .await
        .unwrap();
    let ids = model.encode(&text, Some(false)).unwrap();
    let direct = await_promise(model.generate(js(&serde_json::json!(ids)), js(&opts)))
        .await
        .unwrap();
    assert_eq!(
        ids_of(&get(&chat, "token_ids")),
        ids_of(&get(&direct, "token_ids"))
    );
    // Without a template, chat input is an error naming it.
    let plain = load(&f).await;
    let e = await_promise(plain.generate(
        js(&serde_json::json!([{"role": "user", "content": "x"}])),
        JsValue::UNDEFINED,
    ))
    .await
    .unwrap_err();
    assert!(error_message(&e).contains("chat template"));
}

#[wasm_bindgen_test]
async fn abort_resolves_with_abort_and_the_model_recovers() {
    let f = llama();
    let model = load(&f).await;
    let controller = web_abort_controller();
    let signal = get(&controller, "signal");
    // Abort from the first token event: generation stops after that step.
    let abort = Function::new_with_args("e", "if (e.row === 0) this.abort()").bind0(&controller);
    let options = js(&serde_json::json!({"max_new_tokens": 12}));
    set(&options, "signal", &signal);
    set(&options, "on_token", &abort);
    let r = await_promise(model.generate(js(&serde_json::json!([1, 355, 459, 316])), options))
        .await
        .unwrap();
    assert_eq!(get(&r, "finish_reason").as_string().unwrap(), "abort");
    assert_eq!(ids_of(&get(&r, "token_ids")), [411]);
    // Then the same model generates the golden tokens.
    let r = await_promise(model.generate(
        js(&serde_json::json!([1, 355, 459, 316])),
        js(&serde_json::json!({"max_new_tokens": 12})),
    ))
    .await
    .unwrap();
    assert_eq!(ids_of(&get(&r, "token_ids"))[..3], [411, 403, 197]);
}

fn web_abort_controller() -> JsValue {
    let ctor = get(&js_sys::global(), "AbortController");
    Reflect::construct(ctor.unchecked_ref::<Function>(), &Array::new()).unwrap()
}

#[wasm_bindgen_test]
async fn bad_input_rejects_with_named_errors_and_the_model_recovers() {
    let f = llama();
    let model = load(&f).await;
    let prompt = js(&serde_json::json!([1, 355, 459, 316]));
    let cases: Vec<(JsValue, JsValue, &str)> = vec![
        (
            prompt.clone(),
            js(&serde_json::json!({"max_new_token": 3})),
            "unknown option `max_new_token`; valid options are:",
        ),
        (
            prompt.clone(),
            js(&serde_json::json!({"max_new_tokens": -1})),
            "max_new_tokens",
        ),
        (
            prompt.clone(),
            js(&serde_json::json!({"max_new_tokens": "many"})),
            "max_new_tokens",
        ),
        (
            prompt.clone(),
            js(&serde_json::json!({"temperature": true})),
            "temperature",
        ),
        (
            js(&serde_json::json!([1, 9999])),
            JsValue::UNDEFINED,
            "9999",
        ),
        (
            js(&serde_json::json!([1, -2])),
            JsValue::UNDEFINED,
            "position 1",
        ),
        (JsValue::from_f64(3.0), JsValue::UNDEFINED, "input must be"),
        (js(&serde_json::json!([])), JsValue::UNDEFINED, "empty"),
        (
            prompt.clone(),
            JsValue::from_str("fast"),
            "options must be an object",
        ),
    ];
    // The invalid values of transformers' `GenerationConfig.validate`.
    let mut cases = cases;
    for (options, needle) in [
        (
            serde_json::json!({"do_sample": true, "temperature": 0}),
            "`temperature` must be strictly positive",
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": -0.5}),
            "`temperature` must be strictly positive",
        ),
        (
            serde_json::json!({"do_sample": true, "top_p": 0}),
            "`top_p` must be in (0, 1]",
        ),
        (
            serde_json::json!({"do_sample": true, "top_p": 1.5}),
            "`top_p` must be in (0, 1]",
        ),
        (
            serde_json::json!({"top_k": -1}),
            "`top_k` must be a non-negative integer",
        ),
        (
            serde_json::json!({"repetition_penalty": 0}),
            "`repetition_penalty` must be a strictly positive",
        ),
        (
            serde_json::json!({"repetition_penalty": -1}),
            "`repetition_penalty` must be a strictly positive",
        ),
        (
            serde_json::json!({"bad_words_ids": [[5], [7, 512]]}),
            "`bad_words_ids` has token ids outside the vocabulary (0..512): [512]",
        ),
        (
            serde_json::json!({"suppress_tokens": [3, 9999]}),
            "`suppress_tokens` has token ids outside the vocabulary (0..512): [9999]",
        ),
        (
            serde_json::json!({"logits_processor": 5}),
            "`logits_processor` must be a list of functions",
        ),
        (
            serde_json::json!({"logits_processor": ["x"]}),
            "`logits_processor` 0 must be a function",
        ),
    ] {
        cases.push((prompt.clone(), js(&options), needle));
    }
    for (input, options, needle) in cases {
        let e = await_promise(model.generate(input, options))
            .await
            .unwrap_err();
        let msg = error_message(&e);
        assert!(msg.contains(needle), "{msg:?} should name {needle:?}");
    }
    // A throwing on_token rejects with its exception.
    let options = js(&serde_json::json!({"max_new_tokens": 3}));
    set(
        &options,
        "on_token",
        &Function::new_with_args("e", "throw new Error('callback broke')"),
    );
    let e = await_promise(model.generate(prompt.clone(), options))
        .await
        .unwrap_err();
    assert!(error_message(&e).contains("callback broke"));
    // The model still generates correctly.
    let r = await_promise(model.generate(prompt, js(&serde_json::json!({"max_new_tokens": 12}))))
        .await
        .unwrap();
    assert_eq!(
        ids_of(&get(&r, "token_ids")),
        [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297]
    );
}

#[wasm_bindgen_test]
async fn bad_model_files_reject_with_named_errors() {
    let f = llama();
    let wrong = files(&f);
    set(&wrong, "model", &bytes(b"not an onnx file"));
    let e = load_model(wrong, JsValue::UNDEFINED).await.err().unwrap();
    assert!(
        error_message(&e).contains("model.onnx"),
        "{}",
        error_message(&e)
    );
    let missing = files(&f);
    Reflect::delete_property(missing.unchecked_ref::<Object>(), &"tokenizer".into()).unwrap();
    let e = load_model(missing, JsValue::UNDEFINED).await.err().unwrap();
    assert!(error_message(&e).contains("tokenizer"));
    let unknown = files(&f);
    set(&unknown, "weights", &bytes(b"x"));
    let e = load_model(unknown, JsValue::UNDEFINED).await.err().unwrap();
    assert!(error_message(&e).contains("unknown model file `weights`"));
    let typo = files(&f);
    set(&typo, "config", &JsValue::from_f64(4.0));
    let e = load_model(typo, JsValue::UNDEFINED).await.err().unwrap();
    assert!(error_message(&e).contains("config"));
    // The tokenizer of another model: a vocabulary that does not fit is refused.
    let t5 = files(&f);
    set(
        &t5,
        "tokenizer",
        &bytes(include_bytes!("../fixtures/models/t5/tokenizer.json")),
    );
    if let Err(e) = load_model(t5, JsValue::UNDEFINED).await {
        assert!(error_message(&e).contains("tokenizer"));
    }
}

#[wasm_bindgen_test]
async fn stream_iterates_the_events() {
    let f = llama();
    let model = load(&f).await;
    let it = model.stream(
        js(&serde_json::json!([1, 355, 459, 316])),
        js(&serde_json::json!({"max_new_tokens": 12})),
    );
    let next: Function = get(&it, "next").dyn_into().unwrap();
    let mut ids = vec![];
    loop {
        let step: Promise = next.call0(&it).unwrap().dyn_into().unwrap();
        let r = JsFuture::from(step).await.unwrap();
        if get(&r, "done").as_bool() == Some(true) {
            break;
        }
        ids.push(get(&get(&r, "value"), "token_id").as_f64().unwrap() as u32);
    }
    assert_eq!(
        ids,
        [411, 403, 197, 128, 502, 495, 348, 1, 89, 233, 171, 297]
    );
}

/// The seeded sampling requests of `tests/fixtures/seeded_sampling.json` give the ids the
/// native engine gave (`tests/sampling.rs` asserts the same file natively).
#[wasm_bindgen_test]
async fn seeded_sampling_gives_the_native_ids() {
    let fixture: Value =
        serde_json::from_str(include_str!("../fixtures/seeded_sampling.json")).unwrap();
    let model = load(&llama()).await;
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let id = case["id"].as_str().unwrap();
        let result =
            match await_promise(model.generate(js(&case["prompts"]), js(&case["options"]))).await {
                Ok(r) => r,
                Err(e) => panic!("{id}: {}", error_message(&e)),
            };
        let got: Vec<Vec<Vec<u32>>> = Array::from(&get(&result, "sequences"))
            .iter()
            .map(|row| {
                Array::from(&row)
                    .iter()
                    .map(|s| ids_of(&get(&s, "token_ids")))
                    .collect()
            })
            .collect();
        let want: Vec<Vec<Vec<u32>>> = serde_json::from_value(case["expected"].clone()).unwrap();
        assert_eq!(got, want, "{id}");
    }
}

/// A JavaScript logits processor that sets a token's score to -Infinity gives the result of
/// `suppress_tokens` with that token, when sampling too; it runs once per row per step and
/// sees each row's prompt and new tokens.
#[wasm_bindgen_test]
async fn js_logits_processor_bans_a_token_like_suppress_tokens() {
    let model = load(&llama()).await;
    let prompts = serde_json::json!([[1, 355, 459, 316], [1, 503, 309, 306]]);
    let base = serde_json::json!({"max_new_tokens": 8, "eos_token_id": null, "do_sample": true,
        "seed": 4, "top_k": 10});
    let ids_of_rows = |r: &JsValue| -> Vec<Vec<u32>> {
        Array::from(&get(r, "sequences"))
            .iter()
            .map(|row| ids_of(&get(&Array::from(&row).get(0), "token_ids")))
            .collect()
    };
    // The token to ban: the first token of row 0 without the ban.
    let plain = await_promise(model.generate(js(&prompts), js(&base)))
        .await
        .unwrap();
    let banned = ids_of_rows(&plain)[0][0];
    let calls = Array::new();
    let ban = Function::new_with_args(
        "ids, logits",
        &format!("this.push(Array.from(ids)); logits[{banned}] = -Infinity;"),
    )
    .bind0(&calls);
    let options = js(&base);
    set(&options, "logits_processor", &Array::of1(&ban));
    let custom = await_promise(model.generate(js(&prompts), options))
        .await
        .unwrap();
    let mut suppress = base.clone();
    suppress["suppress_tokens"] = serde_json::json!([banned]);
    let suppressed = await_promise(model.generate(js(&prompts), js(&suppress)))
        .await
        .unwrap();
    let rows = ids_of_rows(&custom);
    assert!(rows.iter().flatten().all(|&t| t != banned), "{rows:?}");
    assert_eq!(rows, ids_of_rows(&suppressed));
    // Two rows, eight steps: sixteen calls, each with its row's prompt and tokens so far.
    assert_eq!(calls.length(), 16);
    for call in calls.iter() {
        let ids = ids_of(&call);
        let (row, prompt) = if ids[1] == 355 {
            (0, [1u32, 355, 459, 316])
        } else {
            (1, [1u32, 503, 309, 306])
        };
        assert_eq!(ids[..4], prompt);
        assert_eq!(ids[4..], rows[row][..ids.len() - 4]);
    }
}

/// `search::argmax` (two simd128 passes in wasm) gives the scalar loop's index: the first of
/// equal maxima (-0 and +0 among them), NaN anywhere (first, last, in a tail), infinities,
/// all `-inf`, lengths around the passes' chunks of 16.
#[wasm_bindgen_test]
fn argmax_is_the_scalar_loop() {
    use onnx_generate::search::argmax;
    fn scalar(scores: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &s) in scores.iter().enumerate() {
            if s > scores[best] {
                best = i;
            }
        }
        best as u32
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        3.5,
        -3.5,
    ];
    let mut rows = vec![vec![f32::NEG_INFINITY; 40], vec![f32::NAN; 33]];
    for len in [1usize, 15, 16, 17, 31, 32, 47, 48, 49, 64, 100, 49_152] {
        for case in 0..24 {
            let mut row: Vec<f32> = (0..len)
                .map(|_| match next() % 8 {
                    // Few distinct values, so that maxima repeat.
                    0..=5 => (next() % 7) as f32 - 3.0,
                    _ => specials[(next() % specials.len() as u64) as usize],
                })
                .collect();
            if case % 4 == 0 {
                row.iter_mut().for_each(|s| *s = s.abs().min(2.0) - 5.0);
            }
            if case % 6 == 1 {
                row[len - 1] = 9.0;
            }
            rows.push(row);
        }
    }
    for row in &rows {
        let bits: Vec<u32> = row.iter().take(20).map(|s| s.to_bits()).collect();
        assert_eq!(
            argmax(row),
            scalar(row),
            "{} scores from {bits:x?}",
            row.len()
        );
    }
}

/// The simd128 f32 decoding kernel of weights in panels (`model::ops::linalg::dot_panels`,
/// four panels read side by side) gives each panel's `dot_panel` sums bit for bit, within
/// rounding of the exact sums; `k` with and without a tail past the last eight values.
#[wasm_bindgen_test]
fn dot_panels_are_each_panels_sums() {
    use onnx_generate::model::ops::linalg::{dot_panel, dot_panels};
    for k in [4usize, 8, 12, 36, 576] {
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        // Four panels of four rows, each row's values 4i..4i + 4 at 16 (i / 4) + 4 r.
        let rows: Vec<Vec<f32>> = (0..16)
            .map(|r| {
                (0..k)
                    .map(|i| (((r * 31 + i * 53) % 101) as f32 - 50.0) / 64.0)
                    .collect()
            })
            .collect();
        let panels: Vec<Vec<f32>> = (0..4)
            .map(|p| {
                let mut panel = vec![0f32; 4 * k];
                for r in 0..4 {
                    for i in 0..k {
                        panel[(i / 4) * 16 + r * 4 + i % 4] = rows[4 * p + r][i];
                    }
                }
                panel
            })
            .collect();
        let got = dot_panels(&x, [0, 1, 2, 3].map(|p| &panels[p][..]));
        for p in 0..4 {
            let one = dot_panel(&x, &panels[p]);
            assert_eq!(
                got[p].map(f32::to_bits),
                one.map(f32::to_bits),
                "k={k} panel {p}"
            );
            for r in 0..4 {
                let exact: f64 = (0..k)
                    .map(|i| x[i] as f64 * rows[4 * p + r][i] as f64)
                    .sum();
                assert!(
                    (got[p][r] as f64 - exact).abs() < 1e-3,
                    "k={k} panel {p} row {r}"
                );
            }
        }
    }
}

/// The simd128 kernel of a prompt's attention scores (`model::ops::linalg::matmul_panels8`):
/// each output the sum over `k` in order, `acc + a * b` from zero, bit for bit (within the
/// rounding bound of that sum in the relaxed SIMD build, whose multiply-adds may be fused), and
/// in both builds the same bits whatever rows and columns are computed with it: one to nine
/// rows, all the columns at once and in ranges of eight (the threads' split), the last panel
/// full and not.
#[wasm_bindgen_test]
fn matmul_panels8_sums_each_output_in_order() {
    use onnx_generate::model::ops::linalg::{matmul_panels8, panels8_from_rows, panels8_len};
    let value = |i: usize, m: usize| ((i * m % 89) as f32 - 44.0) / 13.0;
    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
    for (rows, k, n) in [
        (9usize, 64usize, 37usize),
        (4, 5, 8),
        (6, 33, 19),
        (1, 7, 3),
    ] {
        let a: Vec<f32> = (0..rows * k).map(|i| value(i, 29)).collect();
        // `B` given as its `[n, k]` transpose, as the keys are.
        let keys: Vec<f32> = (0..n * k).map(|i| value(i, 41) * 0.31).collect();
        let mut panels = vec![f32::NAN; panels8_len(k, n)];
        panels8_from_rows(&keys, k, n, &mut panels);
        let mut whole = vec![0f32; rows * n];
        matmul_panels8(&a, rows, k, &panels, n, 0..n, &mut whole);
        for r in 0..rows {
            for j in 0..n {
                let got = whole[r * n + j];
                let mut acc = 0f32;
                for i in 0..k {
                    acc += a[r * k + i] * keys[j * k + i];
                }
                let at = format!("rows {rows} k {k} n {n}: output {r}, {j}");
                if cfg!(target_feature = "relaxed-simd") {
                    let (exact, size) = (0..k).fold((0f64, 0f64), |(e, s), i| {
                        let p = a[r * k + i] as f64 * keys[j * k + i] as f64;
                        (e + p, s + p.abs())
                    });
                    let bound = (k + 1) as f64 * f32::EPSILON as f64 * size;
                    assert!(
                        (got as f64 - exact).abs() <= bound,
                        "{at}: {got} against {exact}"
                    );
                } else {
                    assert_eq!(got.to_bits(), acc.to_bits(), "{at}: {got} against {acc}");
                }
            }
        }
        // Each row alone, and the columns in ranges of eight.
        for r in 0..rows {
            let mut one = vec![0f32; n];
            matmul_panels8(&a[r * k..(r + 1) * k], 1, k, &panels, n, 0..n, &mut one);
            let want = &whole[r * n..(r + 1) * n];
            assert_eq!(
                bits(&one),
                bits(want),
                "rows {rows} k {k} n {n}: row {r} alone"
            );
        }
        for start in (0..n).step_by(8) {
            let cols = start..(start + 8).min(n);
            let mut block = vec![0f32; rows * cols.len()];
            matmul_panels8(&a, rows, k, &panels, n, cols.clone(), &mut block);
            for r in 0..rows {
                let want = &whole[r * n + cols.start..r * n + cols.end];
                let got = &block[r * cols.len()..(r + 1) * cols.len()];
                assert_eq!(
                    bits(got),
                    bits(want),
                    "rows {rows} k {k} n {n}: columns {cols:?}"
                );
            }
        }
    }
}

/// The simd128 f16 kernels (`model::ops::linalg`, used by float16 models) against the f32
/// kernels on the converted weights; row and column tails included, and the rows that
/// `matvec_f16_nk` reads side by side (`STREAMS`) with rows left over. Without relaxed SIMD
/// the dot products are the portable kernel's sums bit for bit (eight sums, added in order).
/// And four rows widened into a panel of f32 (a prompt's), an odd count of quads included.
#[wasm_bindgen_test]
fn f16_kernels_match_the_f32_kernels() {
    use onnx_generate::model::ops::linalg::{
        axpy_rows, axpy_rows_f16, f16_panel_to_f32, matvec_f16_nk, panel_index, PANEL,
    };
    for (k, n) in [(7usize, 13usize), (32, 24), (64, 40), (37, 9), (36, 4)] {
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let w: Vec<u16> = (0..k * n)
            .map(|i| half::f16::from_f32(((i * 53 % 101) as f32 - 50.0) / 64.0).to_bits())
            .collect();
        let w32: Vec<f32> = w
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect();
        if k.is_multiple_of(4) {
            let mut panel = vec![0f32; PANEL * k];
            f16_panel_to_f32(&w[..PANEL * k], k, &mut panel);
            for j in 0..PANEL {
                for i in 0..k {
                    let got = panel[panel_index(j, i, PANEL, k)];
                    assert_eq!(got, w32[j * k + i], "f16_panel_to_f32 k={k} ({j}, {i})");
                }
            }
        }
        let mut want = vec![0.25f32; n];
        axpy_rows(&x, &w32, n, &mut want);
        let mut got = vec![0.25f32; n];
        axpy_rows_f16(&x, &w, n, &mut got);
        assert_eq!(got, want, "axpy_rows_f16 k={k} n={n}");
        let mut got = vec![0f32; n];
        matvec_f16_nk(&x, &w, &mut got);
        for (j, g) in got.iter().enumerate() {
            let want: f64 = (0..k).map(|i| x[i] as f64 * w32[j * k + i] as f64).sum();
            assert!(
                (*g as f64 - want).abs() < 1e-4,
                "matvec_f16_nk k={k} n={n} j={j}: {g} vs {want}"
            );
            if cfg!(not(target_feature = "relaxed-simd")) {
                let row = &w32[j * k..(j + 1) * k];
                let mut acc = [0f32; 8];
                for (xs, ws) in x.chunks_exact(8).zip(row.chunks_exact(8)) {
                    for i in 0..8 {
                        acc[i] += xs[i] * ws[i];
                    }
                }
                let mut sum: f32 = acc.iter().sum();
                for i in k / 8 * 8..k {
                    sum += x[i] * row[i];
                }
                assert_eq!(
                    g.to_bits(),
                    sum.to_bits(),
                    "matvec_f16_nk k={k} n={n} j={j}"
                );
            }
        }
    }
}

/// The simd128 int8 kernels of `MatMulInteger` (`model::ops::matmul_integer`) give the exact
/// integer sums: signed and unsigned weights, K odd or not a multiple of four (the rows the
/// one-row kernel leaves to the portable one), N not a multiple of 16 (and over 64 columns, the
/// prompt kernel's group), one row (decoding) to thirteen (a prompt: passes of four rows and
/// every shorter last pass); the weight as it lies and, where the shape fits, in blocks (20
/// blocks of four columns for N = 80: five groups of four read side by side). The last shape holds the extremes only (`A - a_zero`
/// of -255 and 255, weight bytes 0x80, 0x7f and 0xff read signed and unsigned): the largest
/// products and sums a kernel must hold.
#[wasm_bindgen_test]
fn int8_kernel_is_exact() {
    use onnx_generate::model::ops::matmul_integer::{
        fits_blocks, matmul, to_blocks, Bytes, Layout,
    };
    for (k, n, extremes) in [
        (7usize, 5usize, false),
        (33, 37, false),
        (64, 48, false),
        (70, 32, false),
        (33, 90, false),
        (8, 80, false),
        (576, 64, false),
        (1536, 32, true),
        (96, 144, true),
    ] {
        let w: Vec<u8> = (0..k * n)
            .map(|i| match extremes {
                false => (i * 73 % 256) as u8,
                true => [0x80, 0x7f, 0xff][i / 7 % 3],
            })
            .collect();
        let layouts = |signed: bool| {
            let mut layouts = vec![(Layout::Rows, w.clone())];
            if fits_blocks(k, n) {
                let mut in_blocks = vec![0u8; k * n];
                to_blocks(&w, k, n, signed, &mut in_blocks);
                layouts.push((Layout::Blocks, in_blocks));
            }
            layouts
        };
        for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13] {
            let a: Vec<i16> = (0..rows * k)
                .map(|i| match extremes {
                    false => (i * 97 % 511) as i16 - 255,
                    true => [255, -255][(i / 5 + i / 3) % 2],
                })
                .collect();
            for is_signed in [true, false] {
                let want: Vec<i32> = (0..rows * n)
                    .map(|i| {
                        let (r, j) = (i / n, i % n);
                        (0..k)
                            .map(|kk| {
                                let b = w[kk * n + j];
                                let b = if is_signed { b as i8 as i32 } else { b as i32 };
                                a[r * k + kk] as i32 * b
                            })
                            .sum()
                    })
                    .collect();
                for (layout, w) in layouts(is_signed) {
                    let signed: Vec<i8> = w.iter().map(|&b| b as i8).collect();
                    let bytes = if is_signed {
                        Bytes::I8(&signed)
                    } else {
                        Bytes::U8(&w)
                    };
                    let mut got = vec![0i32; rows * n];
                    matmul(&a, rows, bytes, k, n, layout, &mut got);
                    assert_eq!(
                        got, want,
                        "k={k} n={n} rows={rows} signed={is_signed} {layout:?}"
                    );
                }
            }
        }
    }
}

#[path = "../support/nbits.rs"]
mod nbits;

/// The simd128 4-bit decode kernel of `MatMulNBits` (16-bit row, integer dot products) within
/// the rounding bound of the row (tests/support/nbits.rs; natively tests/nbits_decode.rs).
#[wasm_bindgen_test]
fn q4_decode_kernel_is_within_the_rounding_bound() {
    nbits::check_q4_decode();
}

/// The simd128 dequantization of `MatMulNBits` prompts (4 and 8 bits) within the rounding
/// bound of the dequantized weights' sums (tests/support/nbits.rs; natively
/// tests/nbits_decode.rs).
#[wasm_bindgen_test]
fn nbits_prompt_kernel_is_within_the_rounding_bound() {
    nbits::check_prompt();
}

/// The simd128 kernels of 4-bit weights in lanes (decoding, the prompt's widening) give the
/// outputs of the weights as they lie (tests/support/nbits.rs; natively tests/nbits_decode.rs).
#[wasm_bindgen_test]
fn nbits_weights_in_lanes_give_the_same_outputs() {
    nbits::check_lanes();
}

/// The f32 kernels of the relaxed SIMD build (`f32x4.relaxed_madd` for each multiply and add,
/// fused or not as the engine chooses) within the rounding bound of their sums: the two-row
/// prompt kernel on rows and on panels, the one-row panel kernel (decoding) and the f16 one.
/// Compiled into the relaxed build's tests only; scripts/test-wasm.sh runs them in Node with
/// relaxed SIMD and fails unless this test ran.
#[cfg(target_feature = "relaxed-simd")]
#[wasm_bindgen_test]
fn relaxed_simd_kernels_are_within_the_rounding_bound() {
    use onnx_generate::model::ops::linalg::{
        dot4x2, dot4x2_panel, dot_panel, matvec_f16_nk, transpose_panels,
    };
    for k in [4usize, 12, 36, 576] {
        let value = |i: usize, m: usize| ((i * m % 97) as f32 - 48.0) / 17.0;
        let x0: Vec<f32> = (0..k).map(|i| value(i, 31)).collect();
        let x1: Vec<f32> = (0..k).map(|i| value(i, 43) * 1e-3).collect();
        // `[4, k]` rows, and the same matrix as `[k, 4]` for the panel layout.
        let w: Vec<f32> = (0..4 * k).map(|i| value(i, 53) * 0.37).collect();
        let w_kn: Vec<f32> = (0..k * 4).map(|i| w[(i % 4) * k + i / 4]).collect();
        let mut panel = vec![0f32; 4 * k];
        transpose_panels(&w_kn, k, 4, &mut panel);
        let w16: Vec<u16> = w
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let w16_f32: Vec<f32> = w16
            .iter()
            .map(|&h| half::f16::from_bits(h).to_f32())
            .collect();
        // Each sum of k products, within k + 1 roundings of the sum of their magnitudes.
        let check = |what: &str, got: f32, x: &[f32], w: &[f32]| {
            let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let size: f64 = x
                .iter()
                .zip(w)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let bound = (k + 1) as f64 * f32::EPSILON as f64 * size;
            assert!(
                (got as f64 - exact).abs() <= bound,
                "{what} k={k}: {got} against {exact} (bound {bound})"
            );
        };
        let row = |c: usize| &w[c * k..(c + 1) * k];
        let [on_rows0, on_rows1] = dot4x2(&x0, &x1, &w);
        let [on_panel0, on_panel1] = dot4x2_panel(&x0, &x1, &panel);
        let one_row = dot_panel(&x0, &panel);
        let mut f16 = vec![0f32; 4];
        matvec_f16_nk(&x0, &w16, &mut f16);
        for c in 0..4 {
            check("dot4x2 row 0", on_rows0[c], &x0, row(c));
            check("dot4x2 row 1", on_rows1[c], &x1, row(c));
            check("dot4x2_panel row 0", on_panel0[c], &x0, row(c));
            check("dot4x2_panel row 1", on_panel1[c], &x1, row(c));
            check("dot_panel", one_row[c], &x0, row(c));
            check("matvec_f16_nk", f16[c], &x0, &w16_f32[c * k..(c + 1) * k]);
        }
    }
}

#[path = "../support/attention.rs"]
mod attention;

/// Attention fused a block of query rows at a time (`model::ops::attention`) against the ops it
/// replaces, one after the other (`tests/support/attention.rs`): bit for bit, as natively.
#[wasm_bindgen_test]
fn fused_attention_gives_the_bits_of_the_ops() {
    attention::check_fused_attention();
}

#[path = "../support/lm_head.rs"]
mod lm_head;

/// The bounds of greedy decoding's `lm_head` with the simd128 int8 kernel: at least each
/// logit, close above it, and each logit one at a time bit for bit the full product's
/// (tests/support/lm_head.rs; natively tests/lm_head_bounds.rs).
#[wasm_bindgen_test]
fn lm_head_bounds_hold_with_the_simd128_kernel() {
    lm_head::check_bounds();
}
