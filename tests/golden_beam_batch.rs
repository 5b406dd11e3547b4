//! Golden parity of beam search and batches: every case tagged `beam` or `batch` of the
//! decoder-only fixtures (token ids exact, sequence and transition scores within 1e-4), each
//! batch row equal to its prompt run alone, padding rows, and the errors of bad requests.

mod support;

use std::path::PathBuf;

use onnx_generate::{Error, FinishReason, Generation, Model, ModelFiles, Output};
use serde_json::{json, Map, Value};
use support::golden::{self, Outcome};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load(name: &str) -> Model {
    let dir = fixtures().join("models").join(name);
    Model::load(&ModelFiles::from_dir(&dir, None).unwrap()).unwrap()
}

/// Run every `beam` or `batch` case of `name`: none may fail or be skipped (the processors
/// of `beam4_repetition_penalty`, `beam4_min_new_tokens` and `batch_repetition_penalty` are
/// there).
fn run(name: &str) {
    let model = load(name);
    let golden = golden::load(&fixtures().join("golden").join(format!("{name}.json")));
    let mut ran = 0;
    let mut failures = vec![];
    for case in golden::cases(&golden)
        .iter()
        .filter(|c| golden::has_tag(c, "beam") || golden::has_tag(c, "batch"))
    {
        let result = golden::run_case(&model, case);
        ran += 1;
        if result.outcome != Outcome::Passed {
            failures.push(format!("{}: {:?}", result.id, result.outcome));
        }
    }
    assert!(ran > 0, "no beam or batch case in {name}");
    assert!(
        failures.is_empty(),
        "{name}: {} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn llama_append_beam_and_batch() {
    run("llama");
}

#[test]
fn gpt2_append_beam_and_batch() {
    run("gpt2");
}

#[test]
fn gpt2_nopos_grow_beam_and_batch() {
    run("gpt2-nopos");
}

#[test]
fn gpt2_merged_beam_and_batch() {
    run("gpt2-merged");
}

/// The onnxruntime-genai build (GroupQueryAttention, the `in_place` cache mode).
#[test]
fn llama_genai_in_place_beam_and_batch() {
    run("llama-genai");
}

/// The encoder-decoder: beams share the prompt's cross-attention cache, which moves only with
/// the rows of another prompt.
#[test]
fn t5_encoder_decoder_beam_and_batch() {
    run("t5");
}

fn options(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

fn generate(model: &Model, prompts: &[Vec<u32>], opts: &Map<String, Value>) -> Output {
    model.generate(prompts, opts, |_| {}).unwrap()
}

/// Prompts of different lengths (so, in `append` mode, rows that write at different offsets of
/// one cache) and one that is a prefix of another.
fn mixed_prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 200, 33, 9, 71, 300, 12, 44, 8, 101],
        vec![40, 2],
        vec![5, 17, 200, 33, 9],
        vec![7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2],
    ]
}

fn rows_equal_alone(name: &str, opts: Value) {
    let model = load(name);
    let opts = options(opts);
    let prompts = mixed_prompts();
    let batch = generate(&model, &prompts, &opts);
    for (p, prompt) in prompts.iter().enumerate() {
        let alone = generate(&model, std::slice::from_ref(prompt), &opts);
        assert_eq!(batch.sequences[p].len(), alone.sequences[0].len());
        assert_same(
            &batch.sequences[p],
            &alone.sequences[0],
            &format!("{name} prompt {p}"),
        );
    }
}

/// Same tokens and finish reasons; scores within 1e-4 (a different batch size changes the
/// order of sums in the matmuls).
fn assert_same(x: &[onnx_generate::Sequence], y: &[onnx_generate::Sequence], at: &str) {
    assert_eq!(x.len(), y.len(), "{at}");
    for (b, a) in x.iter().zip(y) {
        assert_eq!(b.token_ids, a.token_ids, "{at}");
        assert_eq!(b.finish_reason, a.finish_reason, "{at}");
        assert_eq!(b.text, a.text, "{at}");
        for (x, y) in [(&b.scores, &a.scores), (&b.logprobs, &a.logprobs)] {
            assert_eq!(x.is_some(), y.is_some(), "{at}");
            let (x, y) = (x.as_deref().unwrap_or(&[]), y.as_deref().unwrap_or(&[]));
            assert_eq!(x.len(), y.len(), "{at}");
            for (u, v) in x.iter().zip(y) {
                assert!((u - v).abs() < 1e-4, "{at}: {u} vs {v}");
            }
        }
        assert_eq!(
            b.sequence_score.is_some(),
            a.sequence_score.is_some(),
            "{at}"
        );
        if let (Some(u), Some(v)) = (b.sequence_score, a.sequence_score) {
            assert!((u - v).abs() < 1e-4, "{at}: {u} vs {v}");
        }
    }
}

#[test]
fn batch_rows_of_different_lengths_equal_each_prompt_alone() {
    let greedy = json!({"max_new_tokens": 9, "output_scores": true});
    let beams = json!({"max_new_tokens": 7, "num_beams": 3, "num_return_sequences": 2,
        "output_scores": true});
    for name in ["llama", "llama-genai", "gpt2", "gpt2-nopos", "gpt2-merged"] {
        rows_equal_alone(name, greedy.clone());
        rows_equal_alone(name, beams.clone());
    }
}

#[test]
fn batch_rows_with_their_own_eos_stop_on_their_own() {
    // Take an eos that one prompt emits early, so rows stop at different steps.
    let model = load("llama");
    let prompts = mixed_prompts();
    let plain = generate(&model, &prompts, &options(json!({"max_new_tokens": 8})));
    let eos = plain.sequences[1][0].token_ids[2];
    rows_equal_alone(
        "llama",
        json!({"max_new_tokens": 8, "eos_token_id": eos, "output_scores": true}),
    );
    let out = generate(
        &model,
        &prompts,
        &options(json!({"max_new_tokens": 8, "eos_token_id": eos})),
    );
    assert_eq!(out.sequences[1][0].finish_reason, FinishReason::Eos);
    assert_eq!(out.sequences[1][0].token_ids.len(), 2);
}

#[test]
fn empty_prompts_are_padding_rows_that_yield_nothing() {
    for name in ["llama", "gpt2-nopos"] {
        let model = load(name);
        let prompts = vec![vec![], vec![5, 17, 200, 33], vec![]];
        for opts in [
            json!({"max_new_tokens": 5}),
            json!({"max_new_tokens": 5, "num_beams": 2}),
        ] {
            let opts = options(opts);
            let mut rows = vec![];
            let out = model
                .generate(&prompts, &opts, |e| rows.push(e.row))
                .unwrap();
            let alone = generate(&model, &prompts[1..2], &opts);
            assert!(out.sequences[0][0].token_ids.is_empty());
            assert!(out.sequences[2][0].token_ids.is_empty());
            assert_same(&out.sequences[1], &alone.sequences[0], name);
            assert!(
                rows.iter().all(|&r| r == 1),
                "{name}: events of rows {rows:?}"
            );
        }
        // Only padding: nothing to generate from.
        let e = error_of(&model, &[vec![], vec![]], json!({"max_new_tokens": 5}));
        assert!(
            matches!(&e, Error::InvalidInput(m) if m.contains("empty")),
            "{e}"
        );
    }
}

#[test]
fn streamed_events_carry_the_row_index() {
    let model = load("gpt2");
    let prompts = mixed_prompts();
    let opts = options(json!({"max_new_tokens": 6}));
    let mut text = vec![String::new(); prompts.len()];
    let out = model
        .generate(&prompts, &opts, |e| text[e.row].push_str(&e.text))
        .unwrap();
    for (p, t) in text.iter().enumerate() {
        assert_eq!(t, &out.sequences[p][0].text);
    }
}

fn error_of(model: &Model, prompts: &[Vec<u32>], opts: Value) -> Error {
    match Generation::new(model, prompts, &options(opts), vec![]) {
        Ok(_) => panic!("the request was accepted"),
        Err(e) => e,
    }
}

#[test]
fn bad_beam_and_batch_requests_are_clear_errors() {
    let model = load("llama");
    let p = vec![vec![5u32, 17, 200]];
    let e = error_of(&model, &p, json!({"num_beams": 0}));
    assert!(
        matches!(&e, Error::InvalidInput(m) if m.contains("num_beams")),
        "{e}"
    );
    let e = error_of(
        &model,
        &p,
        json!({"num_beams": 2, "num_return_sequences": 3}),
    );
    assert!(
        matches!(&e, Error::InvalidInput(m) if m.contains("num_return_sequences")),
        "{e}"
    );
    let e = error_of(&model, &p, json!({"num_beams": 2, "do_sample": true}));
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("beam sampling")),
        "{e}"
    );
    let two = vec![vec![5u32, 17], vec![3u32]];
    let e = error_of(&model, &two, json!({"seed": [1, 2, 3]}));
    assert!(
        matches!(&e, Error::InvalidInput(m) if m.contains("seed")),
        "{e}"
    );
    let e = error_of(&model, &two, json!({"num_beams": 2, "eos_token_id": "x"}));
    assert!(matches!(&e, Error::InvalidInput(_)), "{e}");
    // The model stays usable after refused requests.
    let out = generate(
        &model,
        &p,
        &options(json!({"max_new_tokens": 3, "num_beams": 2})),
    );
    assert_eq!(out.sequences[0].len(), 1);
}

/// A row that stops early either sits the next steps out (no plan compiled yet for the smaller
/// batch) or leaves the batch (plan ready): the results are the same, and equal each prompt
/// run alone, in `append` and `grow` modes, greedy and beam.
#[test]
fn finished_rows_sit_out_or_leave_the_batch_with_the_same_result() {
    for name in ["llama", "gpt2-nopos"] {
        let prompts = vec![vec![5u32, 17, 200, 33], vec![40, 2, 9, 9], vec![7, 7, 7, 1]];
        let probe = load(name);
        let plain = generate(&probe, &prompts, &options(json!({"max_new_tokens": 8})));
        let eos = plain.sequences[1][0].token_ids[1];
        // For beams: eos tokens that end prompt 1's search at its first step (the first tokens
        // of its two best hypotheses), and not the others'.
        let beams = |eos: &[u32]| {
            json!({"max_new_tokens": 8, "eos_token_id": eos, "num_beams": 2,
                "early_stopping": true, "output_scores": true})
        };
        let free = generate(
            &probe,
            &prompts[1..2],
            &options(
                json!({"max_new_tokens": 1, "eos_token_id": null, "num_beams": 2,
                "num_return_sequences": 2}),
            ),
        );
        let beam_eos: Vec<u32> = free.sequences[0].iter().map(|s| s.token_ids[0]).collect();
        let steps: Vec<usize> = prompts
            .iter()
            .map(|p| {
                let opts = options(beams(&beam_eos));
                let mut g =
                    Generation::new(&probe, std::slice::from_ref(p), &opts, vec![]).unwrap();
                while !g.is_finished() {
                    g.step(&probe).unwrap();
                }
                g.steps()
            })
            .collect();
        assert!(
            steps[1] < steps[0] && steps[1] < steps[2],
            "{name}: steps {steps:?}"
        );
        for opts in [
            json!({"max_new_tokens": 8, "eos_token_id": eos, "output_scores": true}),
            beams(&beam_eos),
        ] {
            let opts = options(opts);
            // A fresh model: only the plans of 1 row and of the whole batch exist.
            let model = load(name);
            let sat_out = generate(&model, &prompts, &opts);
            let plans = model.plans();
            // Compile every smaller batch size, then run again: rows now leave the batch.
            for rows in 1..prompts.len() * 2 {
                let some: Vec<Vec<u32>> = (0..rows).map(|_| prompts[0].clone()).collect();
                generate(&model, &some, &options(json!({"max_new_tokens": 1})));
            }
            assert!(model.plans() > plans, "{name}: no plan was added");
            let left = generate(&model, &prompts, &opts);
            for (p, prompt) in prompts.iter().enumerate() {
                let at = format!("{name} prompt {p} {opts:?}");
                assert_same(&sat_out.sequences[p], &left.sequences[p], &at);
                let alone = generate(&model, std::slice::from_ref(prompt), &opts);
                assert_same(&left.sequences[p], &alone.sequences[0], &at);
            }
            if !opts.contains_key("num_beams") {
                assert_eq!(left.sequences[1][0].finish_reason, FinishReason::Eos);
            }
        }
    }
}

/// A prompt of up to 512 tokens runs in one step, as transformers runs it in one forward pass
/// (every step reads all the weights): greedy and beam search take as many steps after a
/// 200-token prompt as after a 1-token one, in each cache mode.
#[test]
fn a_prompt_runs_in_one_step() {
    for name in ["llama", "gpt2", "gpt2-nopos"] {
        let model = load(name);
        for opts in [
            json!({"max_new_tokens": 5, "eos_token_id": null}),
            json!({"max_new_tokens": 5, "eos_token_id": null, "num_beams": 2}),
        ] {
            let steps = |len: u32| {
                let prompt: Vec<u32> = (0..len).map(|i| 3 + i % 400).collect();
                let opts = options(opts.clone());
                let mut g = Generation::new(&model, &[prompt], &opts, vec![]).unwrap();
                while !g.is_finished() {
                    g.step(&model).unwrap();
                }
                g.steps()
            };
            let short = steps(1);
            assert_eq!([steps(37), steps(200)], [short; 2], "{name} {opts}");
        }
    }
}
