//! Vision-language decoders (tests/fixtures/vlm: tiny Qwen2-VL and SmolVLM in the
//! transformers.js layout): every golden case with the stored image features and with the
//! features of the engine's own image processor and vision encoder; the M-RoPE positions, the
//! processors' pixel values and the encoder's features against the stored ones; bad input.

mod support;

use std::path::PathBuf;
use std::sync::OnceLock;

use onnx_generate::npy::NpyData;
use onnx_generate::vision::encoder::VisionProcessor;
use onnx_generate::vision::rope_index::rope_index;
use onnx_generate::vision::{Features, ImageInputs, PositionIds, RopeConfig};
use onnx_generate::{Error, Generation, Model, ModelFiles};
use serde_json::Value;
use support::golden::{self, GoldenDir, ImageSource, Outcome};

fn vlm() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm")
}

fn model(name: &str) -> &'static Model {
    static QWEN: OnceLock<Model> = OnceLock::new();
    static SMOL: OnceLock<Model> = OnceLock::new();
    let cell = if name == "qwen2-vl" { &QWEN } else { &SMOL };
    cell.get_or_init(|| {
        let files = ModelFiles::from_dir(&vlm().join("models").join(name), None).unwrap();
        Model::load(&files).unwrap()
    })
}

fn golden_file(name: &str) -> (PathBuf, Value) {
    let path = vlm().join("golden").join(format!("{name}.json"));
    let golden = golden::load(&path);
    (path, golden)
}

/// Every case of `name` passes with image features from `source`.
fn run_all(name: &str, source: ImageSource) {
    let (path, golden) = golden_file(name);
    let dir = GoldenDir::new(&path, &golden, source);
    let model = model(name);
    let cases = golden::cases(&golden);
    assert!(cases.len() >= 6, "{name}: only {} cases", cases.len());
    let mut failures = vec![];
    for case in &cases {
        let result = golden::run_case_in(model, case, Some(&dir));
        if result.outcome != Outcome::Passed {
            failures.push(format!("{}: {:?}", result.id, result.outcome));
        }
    }
    assert!(
        failures.is_empty(),
        "{name} ({source:?}): {} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn qwen2_vl_golden_with_stored_features() {
    run_all("qwen2-vl", ImageSource::Stored);
}

#[test]
fn smolvlm_golden_with_stored_features() {
    run_all("smolvlm", ImageSource::Stored);
}

#[test]
fn qwen2_vl_golden_with_engine_features() {
    run_all("qwen2-vl", ImageSource::Encoder);
}

#[test]
fn smolvlm_golden_with_engine_features() {
    run_all("smolvlm", ImageSource::Encoder);
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_u64())
        .map(|x| x as u32)
        .collect()
}

/// `get_rope_index` in Rust gives the stored positions and rope delta of every Qwen2-VL prompt.
#[test]
fn rope_index_matches_transformers() {
    let (_, golden) = golden_file("qwen2-vl");
    let config: Value =
        serde_json::from_slice(&std::fs::read(vlm().join("models/qwen2-vl/config.json")).unwrap())
            .unwrap();
    let rope = RopeConfig::from_config(&config).unwrap();
    let mut checked = 0;
    for case in golden::cases(&golden) {
        for p in case["prompts"].as_array().unwrap() {
            let grids: Vec<[usize; 3]> = p["image_grid_thw"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| {
                    let g = ids(g);
                    [g[0] as usize, g[1] as usize, g[2] as usize]
                })
                .collect();
            let (pos, used) = rope_index(&ids(&p["ids"]), &grids, &rope).unwrap();
            assert_eq!(used, grids.len());
            for a in 0..3 {
                let want: Vec<i64> = p["position_ids"][a]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect();
                assert_eq!(pos.axis(a), want.as_slice(), "{} axis {a}", case["id"]);
            }
            let delta = pos.data.iter().max().unwrap() + 1 - pos.len as i64;
            assert_eq!(delta, p["rope_delta"].as_i64().unwrap(), "{}", case["id"]);
            checked += 1;
        }
    }
    assert!(checked >= 7);
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The engine's image processors give the stored pixel values exactly: Qwen2-VL's fixture images
/// need no resize, and SmolVLM's Lanczos resizes are Pillow's byte for byte.
#[test]
fn image_processors_match_transformers() {
    for name in ["qwen2-vl", "smolvlm"] {
        let (path, golden) = golden_file(name);
        let dir = GoldenDir::new(&path, &golden, ImageSource::Encoder);
        let encoder = model(name).vision_encoder.as_ref().unwrap();
        let mut worst = 0f32;
        let mut exact = 0;
        let mut total = 0;
        for case in golden::cases(&golden) {
            let Ok(stored) = golden::array(&dir.dir, &case, "pixel_values") else {
                continue;
            };
            let shape = stored.shape.clone();
            let stored = stored.into_f32("pixel_values").unwrap();
            let overrides = case["request"]["processor_overrides"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let processor = encoder.processor_with(&overrides).unwrap();
            let prompts = case["prompts"].as_array().unwrap();
            let images = |p: &Value| -> Vec<_> {
                p["images"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| golden::image(&dir, n.as_str().unwrap()).unwrap())
                    .collect()
            };
            match &processor {
                VisionProcessor::Qwen2Vl(p) => {
                    let all: Vec<_> = prompts.iter().flat_map(images).collect();
                    let pixels = p.preprocess(&all).unwrap();
                    assert_eq!(vec![pixels.patches, pixels.patch_len], shape);
                    let d = max_diff(&pixels.data, &stored);
                    assert!(
                        d <= 1e-6,
                        "{name} {}: pixel values differ by {d}",
                        case["id"]
                    );
                    worst = worst.max(d);
                }
                VisionProcessor::Idefics3(p) => {
                    // [batch, max tiles, 3, s, s]: each prompt's tiles, then zero tiles.
                    let tile_len = shape[2] * shape[3] * shape[4];
                    for (b, prompt) in prompts.iter().enumerate() {
                        let tiles: Vec<f32> = images(prompt)
                            .iter()
                            .flat_map(|i| p.preprocess(i).unwrap().data)
                            .collect();
                        let at = b * shape[1] * tile_len;
                        let want = &stored[at..at + tiles.len()];
                        let d = max_diff(&tiles, want);
                        exact += tiles.iter().zip(want).filter(|(x, y)| x == y).count();
                        total += tiles.len();
                        worst = worst.max(d);
                        assert!(
                            d == 0.0,
                            "{name} {}: prompt {b} pixel values differ by {d}",
                            case["id"]
                        );
                        assert!(stored[at + tiles.len()..at + shape[1] * tile_len]
                            .iter()
                            .all(|&x| x == 0.0));
                    }
                }
            }
        }
        println!(
            "{name}: largest pixel value difference {worst:e}{}",
            if total > 0 {
                format!(", {exact} of {total} values equal")
            } else {
                String::new()
            }
        );
    }
}

/// `vision_encoder.onnx` on the stored pixel values gives the stored features (within 1e-4).
#[test]
fn vision_encoders_match_pytorch_features() {
    for name in ["qwen2-vl", "smolvlm"] {
        let (path, golden) = golden_file(name);
        let dir = GoldenDir::new(&path, &golden, ImageSource::Stored);
        let encoder = model(name).vision_encoder.as_ref().unwrap();
        let mut checked = 0;
        for case in golden::cases(&golden) {
            let Ok(pixels) = golden::array(&dir.dir, &case, "pixel_values") else {
                continue;
            };
            let want = golden::array(&dir.dir, &case, "image_features")
                .unwrap()
                .into_f32("image_features")
                .unwrap();
            let shape = pixels.shape.clone();
            let values = pixels.into_f32("pixel_values").unwrap();
            let got = match &encoder.processor {
                VisionProcessor::Qwen2Vl(_) => {
                    let grids: Vec<[usize; 3]> = case["prompts"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .flat_map(|p| p["image_grid_thw"].as_array().unwrap().clone())
                        .map(|g| {
                            let g = ids(&g);
                            [g[0] as usize, g[1] as usize, g[2] as usize]
                        })
                        .collect();
                    let pixels = onnx_generate::vision::qwen2_vl::Qwen2VlPixels {
                        data: values,
                        patches: shape[0],
                        patch_len: shape[1],
                        grids,
                    };
                    encoder.encode_patches(&pixels).unwrap()
                }
                VisionProcessor::Idefics3(_) => {
                    let mask = golden::array(&dir.dir, &case, "pixel_attention_mask").unwrap();
                    let NpyData::Bool(mask_values) = mask.data else {
                        panic!("pixel_attention_mask is not bool");
                    };
                    let values = tract_tensor(&shape, values);
                    let mask =
                        tract_onnx::prelude::Tensor::from_shape(&mask.shape, &mask_values).unwrap();
                    encoder.encode_tile_batch(values, mask).unwrap()
                }
            };
            let d = max_diff(&got.data, &want);
            assert!(d <= 1e-4, "{name} {}: features differ by {d}", case["id"]);
            checked += 1;
        }
        assert!(checked >= 5, "{name}: {checked} cases with pixel values");
    }
}

fn tract_tensor(shape: &[usize], values: Vec<f32>) -> tract_onnx::prelude::Tensor {
    tract_onnx::prelude::Tensor::from_shape(shape, &values).unwrap()
}

/// The first image case's prompt, its stored features and positions.
fn image_case(name: &str) -> (Vec<u32>, ImageInputs) {
    let (path, golden) = golden_file(name);
    let dir = GoldenDir::new(&path, &golden, ImageSource::Stored);
    let case = golden::cases(&golden)
        .into_iter()
        .find(|c| c["id"] == "greedy_1img")
        .unwrap();
    let inputs = golden::image_inputs(model(name), &case, &dir).unwrap();
    (ids(&case["prompts"][0]["ids"]), inputs)
}

fn options() -> serde_json::Map<String, Value> {
    serde_json::json!({"max_new_tokens": 4})
        .as_object()
        .cloned()
        .unwrap()
}

fn refused(model: &Model, prompts: &[Vec<u32>], inputs: &ImageInputs) -> String {
    match Generation::with_images(model, prompts, inputs, &options(), vec![]) {
        Err(Error::InvalidInput(m)) => m,
        Err(e) => panic!("expected an invalid-input error, got {e}"),
        Ok(_) => panic!("the request was accepted"),
    }
}

fn generate(model: &Model, prompts: &[Vec<u32>], inputs: &ImageInputs) -> Vec<u32> {
    let mut g = Generation::with_images(model, prompts, inputs, &options(), vec![]).unwrap();
    while !g.is_finished() {
        g.step(model).unwrap();
    }
    g.output(model).unwrap().sequences[0][0].token_ids.clone()
}

#[test]
fn bad_image_inputs_are_clear_errors_and_the_model_stays_usable() {
    for name in ["qwen2-vl", "smolvlm"] {
        let model = model(name);
        let (prompt, good) = image_case(name);
        let before = generate(model, std::slice::from_ref(&prompt), &good);
        let features = good.image_features.clone().unwrap();

        let m = refused(
            model,
            std::slice::from_ref(&prompt),
            &ImageInputs::default(),
        );
        assert!(
            m.contains("image tokens") && m.contains("no image_features"),
            "{m}"
        );

        let fewer = Features::new(features.rows - 1, 64, features.data[64..].to_vec()).unwrap();
        let inputs = ImageInputs {
            image_features: Some(fewer),
            ..good.clone()
        };
        let m = refused(model, std::slice::from_ref(&prompt), &inputs);
        let (n, k) = (features.rows, features.rows - 1);
        assert!(
            m.contains(&format!("{n} image tokens")) && m.contains(&format!("{k} rows")),
            "{m}"
        );

        let narrow = Features::new(
            features.rows,
            32,
            features.data[..features.rows * 32].to_vec(),
        )
        .unwrap();
        let inputs = ImageInputs {
            image_features: Some(narrow),
            ..good.clone()
        };
        let m = refused(model, std::slice::from_ref(&prompt), &inputs);
        assert!(m.contains("32") && m.contains("64"), "{m}");

        let axes = good.position_ids.as_ref().unwrap()[0].axes;
        let wrong_axes = if axes == 3 { 1 } else { 3 };
        let len = prompt.len();
        let bad =
            PositionIds::new(wrong_axes, len, (0..(wrong_axes * len) as i64).collect()).unwrap();
        let inputs = ImageInputs {
            position_ids: Some(vec![bad]),
            ..good.clone()
        };
        let m = refused(model, std::slice::from_ref(&prompt), &inputs);
        assert!(
            m.contains("position_ids") && m.contains(&format!("[{axes}, {len}]")),
            "{m}"
        );

        let short = PositionIds::new(axes, len - 1, vec![0; axes * (len - 1)]).unwrap();
        let inputs = ImageInputs {
            position_ids: Some(vec![short]),
            ..good.clone()
        };
        let m = refused(model, std::slice::from_ref(&prompt), &inputs);
        assert!(m.contains("position_ids"), "{m}");

        assert!(PositionIds::new(3, 4, vec![0; 11]).is_err());
        assert!(Features::new(2, 64, vec![0.0; 127]).is_err());

        let encoder = model.vision_encoder.as_ref().unwrap();
        let zero = onnx_generate::vision::resize::RgbImage {
            width: 0,
            height: 5,
            data: vec![],
        };
        let e = encoder.encode(&[zero]).unwrap_err();
        assert!(e.to_string().contains("0x5"), "{e}");

        // The features and (Qwen2-VL) the M-RoPE positions matter: zero features, or index
        // positions on the three axes, give other tokens.
        let zeros = Features::new(features.rows, 64, vec![0.0; features.rows * 64]).unwrap();
        let inputs = ImageInputs {
            image_features: Some(zeros),
            ..good.clone()
        };
        assert_ne!(
            generate(model, std::slice::from_ref(&prompt), &inputs),
            before
        );
        if axes == 3 {
            let index: Vec<i64> = (0..len as i64).cycle().take(3 * len).collect();
            let inputs = ImageInputs {
                position_ids: Some(vec![PositionIds::new(3, len, index).unwrap()]),
                ..good.clone()
            };
            assert_ne!(
                generate(model, std::slice::from_ref(&prompt), &inputs),
                before
            );
        }

        // More feature rows than image tokens are allowed; the model still answers as before.
        let mut more = features.clone();
        more.data.extend(vec![0.5; 64]);
        more.rows += 1;
        let inputs = ImageInputs {
            image_features: Some(more),
            ..good.clone()
        };
        assert_eq!(
            generate(model, std::slice::from_ref(&prompt), &inputs),
            before
        );
        assert_eq!(
            generate(model, std::slice::from_ref(&prompt), &good),
            before
        );
    }
}

/// `Model::image_prompts` expands each prompt's image placeholders as the processors do: the
/// golden prompts' texts with their images give the stored ids.
#[test]
fn image_prompts_match_the_processors() {
    for name in ["qwen2-vl", "smolvlm"] {
        let (path, golden) = golden_file(name);
        let dir = GoldenDir::new(&path, &golden, ImageSource::Encoder);
        let model = model(name);
        for case in golden::cases(&golden) {
            let overrides = case["request"]["processor_overrides"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let prompts = case["prompts"].as_array().unwrap();
            // The texts as the chat template writes them: one image token per image.
            let (texts, images): (Vec<String>, Vec<Vec<_>>) = prompts
                .iter()
                .map(|p| {
                    let images: Vec<_> = p["images"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|n| golden::image(&dir, n.as_str().unwrap()).unwrap())
                        .collect();
                    (p["text"].as_str().unwrap().to_owned(), images)
                })
                .unzip();
            let (ids_got, inputs) = model
                .image_prompts(&texts, &images, false, &overrides)
                .unwrap();
            for (p, prompt) in prompts.iter().enumerate() {
                assert_eq!(
                    ids_got[p],
                    ids(&prompt["ids"]),
                    "{name} {} prompt {p}",
                    case["id"]
                );
            }
            let total: usize = prompts
                .iter()
                .map(|p| p["num_image_tokens"].as_u64().unwrap() as usize)
                .sum();
            let rows = inputs.image_features.map(|f| f.rows).unwrap_or(0);
            assert_eq!(rows, total, "{name} {}", case["id"]);
        }
    }
}

/// `vision::resize` equals Pillow 12's `Image.resize` byte for byte (Lanczos, bicubic and
/// bilinear, up and down; reference from tests/tools/resize_reference.py).
#[test]
fn resize_matches_pillow() {
    use onnx_generate::vision::resize::{resize, Filter, RgbImage};
    let index: Value =
        serde_json::from_slice(&std::fs::read(vlm().join("resize/index.json")).unwrap()).unwrap();
    let load = |file: &str| -> RgbImage {
        let a = golden::read_npy(&vlm().join(file)).unwrap();
        let NpyData::U8(data) = a.data else {
            panic!("{file} is not uint8")
        };
        RgbImage::new(a.shape[1], a.shape[0], data).unwrap()
    };
    let cases = index["cases"].as_array().unwrap();
    assert!(cases.len() >= 18);
    for c in cases {
        let filter = match c["filter"].as_str().unwrap() {
            "lanczos" => Filter::Lanczos,
            "bicubic" => Filter::Bicubic,
            _ => Filter::Bilinear,
        };
        let (w, h) = (
            c["width"].as_u64().unwrap() as usize,
            c["height"].as_u64().unwrap() as usize,
        );
        let got = resize(&load(c["image"].as_str().unwrap()), w, h, filter).unwrap();
        assert_eq!(got, load(c["file"].as_str().unwrap()), "{c}");
    }
}

/// A text-only prompt beside an image prompt in one batch: each row gives
/// what its prompt gives alone (the golden `greedy_text_only` and `greedy_1img` expectations);
/// features belong to the image prompt although it comes second.
#[test]
fn text_only_row_beside_an_image_row() {
    for name in ["qwen2-vl", "smolvlm"] {
        let model = model(name);
        let (path, golden) = golden_file(name);
        let dir = GoldenDir::new(&path, &golden, ImageSource::Stored);
        let case = |id: &str| {
            golden::cases(&golden)
                .into_iter()
                .find(|c| c["id"] == id)
                .unwrap()
        };
        let (text, image) = (case("greedy_text_only"), case("greedy_1img"));
        let t = golden::image_inputs(model, &text, &dir).unwrap();
        let i = golden::image_inputs(model, &image, &dir).unwrap();
        let prompts = vec![
            ids(&text["prompts"][0]["ids"]),
            ids(&image["prompts"][0]["ids"]),
        ];
        let mut positions = t.position_ids.clone().unwrap();
        positions.extend(i.position_ids.clone().unwrap());
        let inputs = ImageInputs {
            image_features: i.image_features.clone(),
            position_ids: Some(positions),
            image_grid_thw: None,
        };
        let opts = serde_json::json!({"max_new_tokens": 16})
            .as_object()
            .cloned()
            .unwrap();
        let mut g = Generation::with_images(model, &prompts, &inputs, &opts, vec![]).unwrap();
        while !g.is_finished() {
            g.step(model).unwrap();
        }
        let out = g.output(model).unwrap();
        for (row, c) in [&text, &image].iter().enumerate() {
            assert_eq!(
                out.sequences[row][0].token_ids,
                ids(&c["expected"][0][0]["new_token_ids"]),
                "{name} row {row}"
            );
        }
    }
}
