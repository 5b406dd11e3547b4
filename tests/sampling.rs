//! Sampling with seeds, num_return_sequences, token log-probs and top_logprobs, stop strings,
//! custom processors and refused options, on the tiny llama fixture.

use std::path::PathBuf;

use onnx_generate::processors::{LogitsProcessor, RowContext};
use onnx_generate::{Error, FinishReason, Generation, Model, ModelFiles, Output, TokenEvent};
use serde_json::{json, Map, Value};

fn model() -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama");
    Model::load(&ModelFiles::from_dir(&dir, None).unwrap()).unwrap()
}

fn opts(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

const PROMPT: [u32; 6] = [1, 403, 377, 401, 317, 358];
const OTHER: [u32; 4] = [1, 503, 309, 306];

fn run(model: &Model, prompts: &[Vec<u32>], o: Value) -> (Output, Vec<TokenEvent>) {
    let mut events = vec![];
    let out = model
        .generate(prompts, &opts(o), |e| events.push(e.clone()))
        .unwrap();
    (out, events)
}

fn tokens(out: &Output, p: usize, s: usize) -> Vec<u32> {
    out.sequences[p][s].token_ids.clone()
}

#[test]
fn same_seed_same_tokens_other_seeds_differ() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    let o = |seed: u64| json!({"do_sample": true, "max_new_tokens": 24, "seed": seed, "eos_token_id": null});
    let a = tokens(&run(&m, &p, o(7)).0, 0, 0);
    let b = tokens(&run(&m, &p, o(7)).0, 0, 0);
    let c = tokens(&run(&m, &p, o(8)).0, 0, 0);
    assert_eq!(a.len(), 24);
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Sampling is not greedy: over a few seeds, some token differs from the greedy path.
    let greedy = tokens(
        &run(&m, &p, json!({"max_new_tokens": 24, "eos_token_id": null})).0,
        0,
        0,
    );
    assert!((0..4).any(|s| tokens(&run(&m, &p, o(s)).0, 0, 0) != greedy));
}

/// Sampling with `top_k` computes exactly only the logits that can pass it (upper bounds of
/// the others from the `lm_head`'s int8 copy); asking for scores computes every logit. The
/// seeded tokens are the same, with processors before `top_k` and warpers after it.
#[test]
fn sampling_on_bounds_gives_the_tokens_of_exact_logits() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    let configs = [
        json!({}),
        json!({"top_k": 5, "temperature": 0.7, "top_p": 0.9}),
        json!({"top_k": 20, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_p": 0.05}),
    ];
    for config in configs {
        for seed in 0..4 {
            let mut o = json!({"do_sample": true, "max_new_tokens": 24, "seed": seed,
                "eos_token_id": null});
            o.as_object_mut()
                .unwrap()
                .extend(config.as_object().unwrap().clone());
            let bounded = tokens(&run(&m, &p, o.clone()).0, 0, 0);
            o["output_scores"] = json!(true);
            let exact = tokens(&run(&m, &p, o).0, 0, 0);
            assert_eq!(bounded.len(), 24);
            assert_eq!(bounded, exact, "{config}, seed {seed}");
        }
    }
}

#[test]
fn seeds_per_row_and_num_return_sequences() {
    let m = model();
    let base = json!({"do_sample": true, "max_new_tokens": 16, "eos_token_id": null});
    let with = |extra: Value| {
        let mut o = base.as_object().unwrap().clone();
        o.extend(extra.as_object().unwrap().clone());
        Value::Object(o)
    };
    // One seed for two prompts: row 1 uses seed + 1; a list gives each row its seed.
    let (two, _) = run(
        &m,
        &[PROMPT.to_vec(), OTHER.to_vec()],
        with(json!({"seed": 5})),
    );
    let (listed, _) = run(
        &m,
        &[PROMPT.to_vec(), OTHER.to_vec()],
        with(json!({"seed": [5, 6]})),
    );
    assert_eq!(two, listed);
    // Three samples of one prompt: three sequences, not all equal, reproducible.
    let (three, events) = run(
        &m,
        &[PROMPT.to_vec()],
        with(json!({"seed": 11, "num_return_sequences": 3})),
    );
    assert_eq!(three.sequences.len(), 1);
    assert_eq!(three.sequences[0].len(), 3);
    assert!(events.iter().any(|e| e.row == 2));
    let seqs: Vec<_> = (0..3).map(|s| tokens(&three, 0, s)).collect();
    assert!(seqs[0] != seqs[1] || seqs[1] != seqs[2]);
    let (again, _) = run(
        &m,
        &[PROMPT.to_vec()],
        with(json!({"seed": 11, "num_return_sequences": 3})),
    );
    assert_eq!(three, again);
    // The wrong number of seeds is refused.
    let e = m
        .generate(
            &[PROMPT.to_vec()],
            &opts(with(json!({"seed": [1, 2, 3]}))),
            |_| {},
        )
        .unwrap_err();
    assert!(e.to_string().contains("seed"), "{e}");
}

#[test]
fn logprobs_only_when_asked_and_top_logprobs_sorted() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    let (plain, events) = run(&m, &p, json!({"max_new_tokens": 6}));
    assert!(events
        .iter()
        .all(|e| e.logprob.is_none() && e.top_logprobs.is_none()));
    assert!(plain.sequences[0][0].logprobs.is_none());
    assert!(plain.sequences[0][0].top_logprobs.is_none());

    let (out, events) = run(&m, &p, json!({"max_new_tokens": 6, "top_logprobs": 4}));
    for e in &events {
        let top = e.top_logprobs.as_ref().unwrap();
        assert_eq!(top.len(), 4);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0].0, e.token_id);
        assert!((top[0].1 - e.logprob.unwrap()).abs() < 1e-6);
        assert!(e.logprob.unwrap() <= 0.0);
    }
    assert_eq!(
        out.sequences[0][0].top_logprobs.as_ref().unwrap().len(),
        events.len()
    );

    // `token_logprobs` is `output_scores`: per-token log-probs in the output.
    let (out, events) = run(&m, &p, json!({"max_new_tokens": 6, "token_logprobs": true}));
    let lp = out.sequences[0][0].logprobs.clone().unwrap();
    assert_eq!(lp.len(), events.len());
    assert_eq!(
        lp,
        events
            .iter()
            .map(|e| e.logprob.unwrap())
            .collect::<Vec<_>>()
    );

    // Sampling: the chosen token's log-prob is that of the processed (top_k) distribution.
    let (_, events) = run(
        &m,
        &p,
        json!({"max_new_tokens": 6, "do_sample": true, "top_k": 3, "seed": 1, "top_logprobs": 5}),
    );
    for e in &events {
        let top = e.top_logprobs.as_ref().unwrap();
        assert!(top.len() <= 5 && top.len() >= 3, "{top:?}");
        assert!(top.iter().any(|t| t.0 == e.token_id));
        let total: f32 = top.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "top-3 mass {total}");
    }
}

#[test]
fn stop_strings_end_the_row_on_the_token_that_completes_them() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    let full = run(&m, &p, json!({"max_new_tokens": 16, "eos_token_id": null})).0;
    let ids = tokens(&full, 0, 0);
    // A stop string made of the text of tokens 3..5 stops at token 5 at the latest.
    let stop = m.tokenizer.decode(&ids[3..5]).unwrap();
    assert!(!stop.is_empty());
    let (out, events) = run(
        &m,
        &p,
        json!({"max_new_tokens": 16, "eos_token_id": null, "stop_strings": [stop.clone()]}),
    );
    let seq = &out.sequences[0][0];
    assert_eq!(seq.finish_reason, FinishReason::StopString);
    assert!(seq.token_ids.len() <= 5);
    assert_eq!(seq.token_ids, ids[..seq.token_ids.len()]);
    assert!(seq.text.contains(&stop), "{:?} lacks {stop:?}", seq.text);
    assert_eq!(
        events.last().unwrap().finished,
        Some(FinishReason::StopString)
    );
}

/// Bans the greedy choice of each step and counts its calls.
struct Ban(Vec<u32>, usize);

impl LogitsProcessor for Ban {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> onnx_generate::Result<()> {
        assert!(ctx.ids.len() >= ctx.prompt_len);
        for &t in &self.0 {
            scores[t as usize] = f32::NEG_INFINITY;
        }
        self.1 += 1;
        Ok(())
    }
}

#[test]
fn custom_processors_change_the_choice() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    let greedy = tokens(
        &run(&m, &p, json!({"max_new_tokens": 4, "eos_token_id": null})).0,
        0,
        0,
    );
    let o = opts(json!({"max_new_tokens": 4, "eos_token_id": null}));
    let mut g = Generation::new(&m, &p, &o, vec![Box::new(Ban(vec![greedy[0]], 0))]).unwrap();
    while !g.is_finished() {
        g.step(&m).unwrap();
    }
    let out = g.output(&m).unwrap();
    assert_ne!(out.sequences[0][0].token_ids[0], greedy[0]);
    assert!(!out.sequences[0][0].token_ids.contains(&greedy[0]));
}

#[test]
fn bad_options_are_refused_and_the_model_stays_usable() {
    let m = model();
    let p = vec![PROMPT.to_vec()];
    for (o, word) in [
        (
            json!({"do_sample": true, "temperature": 0.0}),
            "temperature",
        ),
        (
            json!({"do_sample": true, "temperature": -0.5}),
            "temperature",
        ),
        (json!({"do_sample": true, "top_p": 0.0}), "top_p"),
        (json!({"do_sample": true, "top_p": 1.2}), "top_p"),
        (json!({"top_k": -3}), "top_k"),
        (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
        (json!({"repetition_penalty": -1.0}), "repetition_penalty"),
        (json!({"bad_words_ids": [[5], [9999]]}), "bad_words_ids"),
        (json!({"suppress_tokens": [512]}), "suppress_tokens"),
        (json!({"num_return_sequences": 2}), "num_return_sequences"),
    ] {
        match m.generate(&p, &opts(o.clone()), |_| {}) {
            Err(Error::InvalidInput(msg)) => assert!(msg.contains(word), "{o}: {msg}"),
            other => panic!("{o}: expected an invalid-input error, got {other:?}"),
        }
    }
    let (out, _) = run(&m, &p, json!({"max_new_tokens": 3}));
    assert_eq!(out.sequences[0][0].token_ids.len(), 3);
}

/// The ids of seeded sampling requests, shared with the wasm tests (`tests/wasm_api`), which
/// assert the same ids in Node and in Chromium. `ONNX_GENERATE_WRITE_SEEDED=1 cargo test --test
/// sampling seeded` rewrites the `expected` ids of `tests/fixtures/seeded_sampling.json` from
/// this engine's native run.
#[test]
fn seeded_sampling_gives_the_fixture_ids() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/seeded_sampling.json");
    let mut fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let write = std::env::var_os("ONNX_GENERATE_WRITE_SEEDED").is_some();
    let m = model();
    let cases = fixture["cases"].as_array_mut().unwrap();
    assert!(cases.len() >= 4, "the fixture has {} cases", cases.len());
    for case in cases.iter_mut() {
        let id = case["id"].as_str().unwrap().to_string();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(case["prompts"].clone()).unwrap();
        let (out, _) = run(&m, &prompts, case["options"].clone());
        let got: Vec<Vec<Vec<u32>>> = out
            .sequences
            .iter()
            .map(|row| row.iter().map(|s| s.token_ids.clone()).collect())
            .collect();
        assert!(got.iter().flatten().all(|ids| !ids.is_empty()), "{id}");
        if write {
            case["expected"] = json!(got);
        } else {
            let want: Vec<Vec<Vec<u32>>> =
                serde_json::from_value(case["expected"].clone()).unwrap();
            assert_eq!(got, want, "{id}");
        }
    }
    if write {
        // One case per line, so that a change shows as the cases it touches.
        let lines: Vec<String> = cases.iter().map(|c| format!("    {c}")).collect();
        let text = format!(
            "{{\n  \"about\": {},\n  \"model\": \"llama\",\n  \"cases\": [\n{}\n  ]\n}}\n",
            fixture["about"],
            lines.join(",\n")
        );
        std::fs::write(&path, text).unwrap();
    }
}
