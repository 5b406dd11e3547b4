//! Runs the cases of a golden file (format: tests/fixtures/README.md) against a loaded model.
//! Shared by the integration tests and `examples/golden.rs`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use onnx_generate::npy::{NpyArray, NpyData};
use onnx_generate::vision::resize::RgbImage;
use onnx_generate::vision::{Features, ImageInputs, PositionIds};
use onnx_generate::{Error, Generation, Model};
use serde_json::Value;

/// Tolerance on scores (transition scores, sequence scores).
pub const SCORE_TOLERANCE: f32 = 1e-4;

/// Tolerance on each probability of a `sampling_distribution` case.
pub const PROBABILITY_TOLERANCE: f32 = 1e-5;

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Passed,
    /// What differed.
    Failed(String),
    /// The feature the engine lacks.
    Skipped(String),
}

#[derive(Debug, Clone)]
pub struct CaseResult {
    pub id: String,
    pub outcome: Outcome,
}

/// Load a golden file.
pub fn load(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// The cases of a golden file.
pub fn cases(golden: &Value) -> Vec<Value> {
    golden["cases"].as_array().cloned().unwrap_or_default()
}

/// Whether the case has `tag`.
pub fn has_tag(case: &Value, tag: &str) -> bool {
    case["tags"]
        .as_array()
        .is_some_and(|t| t.iter().any(|x| x == tag))
}

/// Where the image features of a vision-language case come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageSource {
    /// The case's stored `image_features` and the prompts' stored `position_ids`.
    Stored,
    /// The engine's preprocessing and `vision_encoder.onnx` on the raw images, and positions
    /// computed by the engine (Qwen2-VL's `get_rope_index` from the image grids).
    Encoder,
}

/// A golden file's folder (array paths are relative to it) and its `images` table.
#[derive(Debug, Clone)]
pub struct GoldenDir {
    pub dir: PathBuf,
    pub images: Value,
    pub source: ImageSource,
}

impl GoldenDir {
    pub fn new(golden_file: &Path, golden: &Value, source: ImageSource) -> GoldenDir {
        GoldenDir {
            dir: golden_file.parent().unwrap_or(Path::new(".")).to_path_buf(),
            images: golden["images"].clone(),
            source,
        }
    }
}

/// Read an array of a case (`arrays.NAME`), relative to the golden file's folder.
pub fn array(dir: &Path, case: &Value, name: &str) -> Result<NpyArray, String> {
    let file = case["arrays"][name]["file"]
        .as_str()
        .ok_or_else(|| format!("the case has no array `{name}`"))?;
    read_npy(&dir.join(file))
}

pub fn read_npy(path: &Path) -> Result<NpyArray, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    NpyArray::parse(&bytes, &path.display().to_string()).map_err(|e| e.to_string())
}

/// A raw image of the golden file (`images.NAME`: uint8 HWC RGB).
pub fn image(golden: &GoldenDir, name: &str) -> Result<RgbImage, String> {
    let file = golden.images[name]["file"]
        .as_str()
        .ok_or_else(|| format!("no image `{name}` in the golden file"))?;
    let a = read_npy(&golden.dir.join(file))?;
    let (NpyData::U8(data), [h, w, 3]) = (a.data, a.shape.as_slice()) else {
        return Err(format!("image {name} is not uint8 [h, w, 3]"));
    };
    RgbImage::new(*w, *h, data).map_err(|e| e.to_string())
}

/// The image inputs of a vision-language case.
pub fn image_inputs(
    model: &Model,
    case: &Value,
    golden: &GoldenDir,
) -> Result<ImageInputs, String> {
    let vision = model
        .vision
        .as_ref()
        .ok_or("the model is not a vision-language decoder")?;
    let prompts = case["prompts"].as_array().cloned().unwrap_or_default();
    match golden.source {
        ImageSource::Stored => {
            let a = array(&golden.dir, case, "image_features")?;
            let [rows, hidden] = a.shape[..] else {
                return Err(format!("image_features has shape {:?}", a.shape));
            };
            let data = a.into_f32("image_features").map_err(|e| e.to_string())?;
            let features = Features::new(rows, hidden, data).map_err(|e| e.to_string())?;
            let mut positions = vec![];
            for p in &prompts {
                let axes: Vec<Vec<i64>> = match &p["position_ids"] {
                    Value::Array(a) if a.first().is_some_and(|x| x.is_array()) => a
                        .iter()
                        .map(|x| {
                            x.as_array()
                                .into_iter()
                                .flatten()
                                .filter_map(|v| v.as_i64())
                                .collect()
                        })
                        .collect(),
                    Value::Array(a) => vec![a.iter().filter_map(|v| v.as_i64()).collect()],
                    _ => return Err("a prompt has no position_ids".into()),
                };
                let len = axes.first().map(|a| a.len()).unwrap_or(0);
                positions.push(
                    PositionIds::new(axes.len(), len, axes.concat()).map_err(|e| e.to_string())?,
                );
            }
            Ok(ImageInputs {
                image_features: Some(features),
                position_ids: Some(positions),
                image_grid_thw: None,
            })
        }
        ImageSource::Encoder => {
            let encoder = model
                .vision_encoder
                .as_ref()
                .ok_or("the model has no vision_encoder.onnx")?;
            let mut images = vec![];
            for p in &prompts {
                for name in p["images"].as_array().into_iter().flatten() {
                    images.push(image(golden, name.as_str().unwrap_or("?"))?);
                }
            }
            if images.is_empty() {
                return Ok(ImageInputs {
                    image_features: Some(
                        Features::new(0, vision.hidden, vec![]).map_err(|e| e.to_string())?,
                    ),
                    ..Default::default()
                });
            }
            let overrides = case["request"]["processor_overrides"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let processor = encoder
                .processor_with(&overrides)
                .map_err(|e| e.to_string())?;
            let encoded = encoder
                .encode_with(&images, &processor)
                .map_err(|e| e.to_string())?;
            Ok(ImageInputs {
                image_features: Some(encoded.features),
                position_ids: None,
                image_grid_thw: (!encoded.grids.is_empty()).then_some(encoded.grids),
            })
        }
    }
}

/// Run one case.
pub fn run_case(model: &Model, case: &Value) -> CaseResult {
    run_case_in(model, case, None)
}

/// Run one case; `golden` gives the folder and image source of vision-language cases (those
/// with `arrays`).
pub fn run_case_in(model: &Model, case: &Value, golden: Option<&GoldenDir>) -> CaseResult {
    let id = case["id"].as_str().unwrap_or("?").to_owned();
    let images = match (case.get("arrays"), golden) {
        (Some(_), Some(g)) => match image_inputs(model, case, g) {
            Ok(i) => i,
            Err(e) => {
                return CaseResult {
                    id,
                    outcome: Outcome::Failed(format!("image inputs: {e}")),
                }
            }
        },
        (Some(_), None) => {
            return CaseResult {
                id,
                outcome: Outcome::Failed("a vision-language case needs its golden folder".into()),
            }
        }
        _ => ImageInputs::default(),
    };
    let outcome = match case["kind"].as_str() {
        Some("generate") => run_generate(model, case, &images),
        Some("sampling_distribution") => run_distribution(model, case),
        Some(kind) => Outcome::Skipped(format!("case kind `{kind}`")),
        None => Outcome::Failed("the case has no kind".into()),
    };
    CaseResult { id, outcome }
}

fn prompts(case: &Value) -> Vec<Vec<u32>> {
    case["prompts"]
        .as_array()
        .map(|ps| ps.iter().map(|p| ids(&p["ids"])).collect())
        .unwrap_or_default()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn floats(v: &Value) -> Option<Vec<f32>> {
    v.as_array().map(|a| {
        a.iter()
            .filter_map(|x| x.as_f64())
            .map(|x| x as f32)
            .collect()
    })
}

fn run_generate(model: &Model, case: &Value, images: &ImageInputs) -> Outcome {
    let mut options = case["generation_kwargs"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let want_scores = case["request"]["output_scores"].as_bool().unwrap_or(false);
    if want_scores {
        options.insert("output_scores".into(), true.into());
    }
    let prompts = prompts(case);
    let mut generation = match Generation::with_images(model, &prompts, images, &options, vec![]) {
        Ok(g) => g,
        Err(Error::Unsupported(m)) => return Outcome::Skipped(m),
        Err(e) => return Outcome::Failed(format!("error: {e}")),
    };
    let mut events = vec![];
    while !generation.is_finished() {
        match generation.step(model) {
            Ok(e) => events.extend(e),
            Err(Error::Unsupported(m)) => return Outcome::Skipped(m),
            Err(e) => return Outcome::Failed(format!("error: {e}")),
        }
    }
    let output = match generation.output(model) {
        Ok(o) => o,
        Err(e) => return Outcome::Failed(format!("error: {e}")),
    };
    let expected = case["expected"].as_array().cloned().unwrap_or_default();
    if expected.len() != output.sequences.len() {
        return Outcome::Failed(format!(
            "{} prompts expected, got {}",
            expected.len(),
            output.sequences.len()
        ));
    }
    let mut problems = vec![];
    for (p, (want_seqs, got_seqs)) in expected.iter().zip(&output.sequences).enumerate() {
        let want_seqs = want_seqs.as_array().cloned().unwrap_or_default();
        if want_seqs.len() != got_seqs.len() {
            problems.push(format!(
                "prompt {p}: {} sequences expected, got {}",
                want_seqs.len(),
                got_seqs.len()
            ));
            continue;
        }
        for (s, (want, got)) in want_seqs.iter().zip(got_seqs).enumerate() {
            let at = format!("prompt {p} sequence {s}");
            let want_ids = ids(&want["new_token_ids"]);
            if want_ids != got.token_ids {
                problems.push(format!(
                    "{at}: expected ids {want_ids:?}, got {:?}",
                    got.token_ids
                ));
                continue;
            }
            let reason = want["finish_reason"].as_str().unwrap_or("");
            if reason != got.finish_reason.as_str() {
                problems.push(format!(
                    "{at}: expected finish {reason}, got {}",
                    got.finish_reason.as_str()
                ));
            }
            if let Some(text) = want["text"].as_str() {
                if text != got.text {
                    problems.push(format!("{at}: expected text {text:?}, got {:?}", got.text));
                }
            }
            for (key, got_scores) in [
                ("transition_scores", &got.scores),
                ("transition_scores_normalized", &got.logprobs),
            ] {
                let Some(want_scores) = floats(&want[key]) else {
                    continue;
                };
                match got_scores {
                    None => problems.push(format!("{at}: no {key} returned")),
                    Some(g) => {
                        if let Some(msg) = compare_scores(&want_scores, g) {
                            problems.push(format!("{at}: {key} {msg}"));
                        }
                    }
                }
            }
            if let Some(want_score) = want["sequence_score"].as_f64() {
                match got.sequence_score {
                    Some(g) if (g - want_score as f32).abs() <= SCORE_TOLERANCE => {}
                    g => problems.push(format!(
                        "{at}: expected sequence_score {want_score}, got {g:?}"
                    )),
                }
            }
        }
    }
    // The stream of events: per row, deltas concatenate to the text, `finished` on the last.
    for (p, seqs) in output.sequences.iter().enumerate() {
        if seqs.len() != 1 {
            continue;
        }
        let row: Vec<_> = events.iter().filter(|e| e.row == p).collect();
        let text: String = row.iter().map(|e| e.text.as_str()).collect();
        if text != seqs[0].text {
            problems.push(format!(
                "prompt {p}: streamed text {text:?} != final text {:?}",
                seqs[0].text
            ));
        }
        if row.last().map(|e| e.finished.is_some()) != Some(true)
            || row.iter().rev().skip(1).any(|e| e.finished.is_some())
        {
            problems.push(format!(
                "prompt {p}: `finished` is not set on the last event only"
            ));
        }
    }
    if problems.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Failed(problems.join("; "))
    }
}

/// `sampling_distribution`: at step k the input is the prompt and `continuation_ids[..k]`; the
/// probabilities after every processor and warper must match `steps[k].top` within
/// `PROBABILITY_TOLERANCE`, and the number of non-zero probabilities `support_size` exactly.
fn run_distribution(model: &Model, case: &Value) -> Outcome {
    let options = case["generation_kwargs"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let prompts = prompts(case);
    let [prompt] = prompts.as_slice() else {
        return Outcome::Failed(format!("one prompt expected, got {}", prompts.len()));
    };
    let continuation = ids(&case["continuation_ids"]);
    let steps = case["steps"].as_array().cloned().unwrap_or_default();
    if steps.is_empty() {
        return Outcome::Failed("the case has no steps".into());
    }
    let mut problems = vec![];
    for (k, step) in steps.iter().enumerate() {
        let prefix = ids(&step["generated_prefix_ids"]);
        if continuation.get(..k) != Some(prefix.as_slice()) {
            return Outcome::Failed(format!(
                "step {k}: prefix {prefix:?} is not the continuation"
            ));
        }
        let probs = match model.next_token_probabilities(prompt, &prefix, &options) {
            Ok(p) => p,
            Err(Error::Unsupported(m)) => return Outcome::Skipped(m),
            Err(e) => return Outcome::Failed(format!("step {k}: error: {e}")),
        };
        let support = probs.iter().filter(|&&p| p > 0.0).count();
        let want_support = step["support_size"].as_u64().unwrap_or(0) as usize;
        if support != want_support {
            problems.push(format!(
                "step {k}: support size {support}, expected {want_support}"
            ));
        }
        for pair in step["top"].as_array().into_iter().flatten() {
            let (Some(t), Some(want)) = (pair[0].as_u64(), pair[1].as_f64()) else {
                return Outcome::Failed(format!("step {k}: bad top entry {pair}"));
            };
            let got = probs.get(t as usize).copied().unwrap_or(f32::NAN);
            let diff = (got - want as f32).abs();
            if diff.is_nan() || diff > PROBABILITY_TOLERANCE {
                problems.push(format!(
                    "step {k}: token {t} probability {got}, expected {want} (diff {diff})"
                ));
            }
        }
    }
    if problems.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Failed(problems.join("; "))
    }
}

fn compare_scores(want: &[f32], got: &[f32]) -> Option<String> {
    if want.len() != got.len() {
        return Some(format!("length {} expected, got {}", want.len(), got.len()));
    }
    let worst = want
        .iter()
        .zip(got)
        .map(|(w, g)| (w - g).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |a, (i, d)| if d > a.1 || d.is_nan() { (i, d) } else { a },
        );
    (worst.1 > SCORE_TOLERANCE || worst.1.is_nan()).then(|| {
        format!(
            "differ by {} at step {} (expected {}, got {})",
            worst.1, worst.0, want[worst.0], got[worst.0]
        )
    })
}
