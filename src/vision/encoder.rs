//! `vision_encoder.onnx` of the transformers.js layout, with the image processor of its model:
//!
//! * Qwen2-VL: `pixel_values [patches, 3 * t * p * p]`, `grid_thw [images, 3]` ->
//!   `image_features [image tokens, hidden]`;
//! * SmolVLM / Idefics3: `pixel_values [batch, tiles, 3, s, s]`, `pixel_attention_mask [batch,
//!   tiles, s, s]` -> `image_features [real tiles, tokens per tile, hidden]`.
//!
//! The graphs compute shapes from the data (patch grids, non-empty tiles), so each call compiles
//! the graph for its input shapes with the grid as a constant (a request runs the encoder once).

use serde_json::Value;
use tract_onnx::prelude::*;

use crate::error::{backend, in_file, invalid, Error, Result};
use crate::model::onnx::Decoded;
use crate::model::ops::parallel;
use crate::model::tract_decoder::GraphTemplate;

use super::idefics3::{Idefics3Processor, Tiles};
use super::qwen2_vl::{Qwen2VlPixels, Qwen2VlProcessor};
use super::resize::RgbImage;
use super::Features;

/// Which image processor and encoder inputs a model has.
#[derive(Debug, Clone, PartialEq)]
pub enum VisionProcessor {
    Qwen2Vl(Qwen2VlProcessor),
    Idefics3(Idefics3Processor),
}

/// A loaded vision encoder.
#[derive(Debug)]
pub struct VisionEncoder {
    /// The graph, read into tract again for each request's input shapes.
    template: GraphTemplate,
    /// Input index of `pixel_values` and of the second input (`grid_thw` or
    /// `pixel_attention_mask`).
    pixels: usize,
    second: usize,
    pub processor: VisionProcessor,
    /// `preprocessor_config.json`, for requests that override some of its settings.
    preprocessor: Value,
    /// SmolVLM: image tokens per tile (`(image_size / patch_size)^2 / scale_factor^2`).
    pub tokens_per_tile: usize,
}

/// The features of a request's images, in order, and what the prompt needs to place them.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedImages {
    pub features: Features,
    /// Image tokens of each image.
    pub tokens: Vec<usize>,
    /// Qwen2-VL: `image_grid_thw` of each image.
    pub grids: Vec<[usize; 3]>,
    /// SmolVLM: the `(rows, cols)` of tiles of each image (`(0, 0)`: not split).
    pub tiles: Vec<(usize, usize)>,
}

impl VisionEncoder {
    /// The encoder of a decoded `vision_encoder.onnx`: its large initializers become tensors
    /// one at a time (their data kept apart while it streamed in, or converted from the
    /// protobuf, each one's bytes freed before the next), so the load holds its weights once.
    pub fn new(
        decoded: Decoded,
        config: &Value,
        preprocessor: Option<&Value>,
    ) -> Result<VisionEncoder> {
        let in_file = in_file("vision_encoder.onnx");
        let template = GraphTemplate::of(decoded).map_err(&in_file)?;
        // Read once now: a graph tract cannot read fails the load, and its inputs are named.
        let parsed = template.parse().map_err(in_file)?;
        let names: Vec<String> = parsed
            .input_outlets()
            .map_err(backend)?
            .iter()
            .map(|o| parsed.node(o.node).name.clone())
            .collect();
        drop(parsed);
        let at = |n: &str| names.iter().position(|x| x == n);
        let pre = preprocessor.ok_or_else(|| {
            Error::Model("vision_encoder.onnx needs preprocessor_config.json beside it".into())
        })?;
        let pixels = at("pixel_values").ok_or_else(|| {
            Error::Model(format!(
                "vision_encoder.onnx has no `pixel_values` input (its inputs: {names:?})"
            ))
        })?;
        let (second, processor) = if let Some(g) = at("grid_thw") {
            (
                g,
                VisionProcessor::Qwen2Vl(Qwen2VlProcessor::from_config(pre)?),
            )
        } else if let Some(m) = at("pixel_attention_mask") {
            (
                m,
                VisionProcessor::Idefics3(Idefics3Processor::from_config(pre)?),
            )
        } else {
            return Err(Error::Unsupported(format!(
                "a vision encoder with inputs {names:?} (supported: Qwen2-VL's pixel_values + \
                 grid_thw, SmolVLM / Idefics3's pixel_values + pixel_attention_mask)"
            )));
        };
        if names.len() != 2 {
            return Err(Error::Unsupported(format!(
                "a vision encoder with inputs {names:?}"
            )));
        }
        let vision = config.get("vision_config").cloned().unwrap_or(Value::Null);
        let num = |v: &Value, k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
        let tokens_per_tile = match (
            &processor,
            num(&vision, "image_size"),
            num(&vision, "patch_size"),
        ) {
            (VisionProcessor::Idefics3(_), Some(size), Some(patch)) if patch > 0 => {
                let scale = num(config, "scale_factor").unwrap_or(1).max(1);
                (size / patch) * (size / patch) / (scale * scale)
            }
            _ => 0,
        };
        Ok(VisionEncoder {
            template,
            pixels,
            second,
            processor,
            preprocessor: pre.clone(),
            tokens_per_tile,
        })
    }

    /// Compile the graph for these inputs (the second input's values are fixed in the plan:
    /// the graph derives shapes from them) and run it.
    fn run(&self, pixels: Tensor, second: Tensor) -> Result<Tensor> {
        let mut model = self.template.parse()?;
        model
            .set_input_fact(
                self.pixels,
                InferenceFact::dt_shape(f32::datum_type(), pixels.shape()),
            )
            .map_err(backend)?;
        model
            .set_input_fact(self.second, InferenceFact::from(second.clone()))
            .map_err(backend)?;
        let plan = model
            .into_optimized()
            .and_then(|m| m.into_runnable())
            .map_err(|e| {
                Error::Model(format!("tract cannot compile vision_encoder.onnx: {e:?}"))
            })?;
        let mut inputs: TVec<TValue> = tvec![];
        for ix in 0..2 {
            inputs.push(if ix == self.pixels {
                pixels.clone().into()
            } else {
                second.clone().into()
            });
        }
        let mut out =
            parallel::team(parallel::Step::Other, || plan.run(inputs)).map_err(backend)?;
        let out = out.remove(0).into_tensor();
        Ok(out.cast_to::<f32>().map_err(backend)?.into_owned())
    }

    /// Qwen2-VL: the features of processed patches (`pixels.grids` images).
    pub fn encode_patches(&self, pixels: &Qwen2VlPixels) -> Result<Features> {
        let values = Tensor::from_shape(&[pixels.patches, pixels.patch_len], &pixels.data)
            .map_err(backend)?;
        let grid: Vec<i64> = pixels.grids.iter().flatten().map(|&x| x as i64).collect();
        let grid = Tensor::from_shape(&[pixels.grids.len(), 3], &grid).map_err(backend)?;
        let out = self.run(values, grid)?;
        features_of(out)
    }

    /// SmolVLM: the features of the tiles of one or more images (`[count, 3, s, s]` each).
    pub fn encode_tiles(&self, tiles: &[Tiles]) -> Result<Features> {
        let count: usize = tiles.iter().map(|t| t.count).sum();
        let Some(size) = tiles.first().map(|t| t.tile) else {
            return invalid!("no image tiles to encode");
        };
        let data: Vec<f32> = tiles.iter().flat_map(|t| t.data.iter().copied()).collect();
        let values = Tensor::from_shape(&[1, count, 3, size, size], &data).map_err(backend)?;
        let mask = Tensor::from_shape(&[1, count, size, size], &vec![true; count * size * size])
            .map_err(backend)?;
        features_of(self.run(values, mask)?)
    }

    /// The pixel values and mask as the golden files store them, for SmolVLM's encoder.
    pub fn encode_tile_batch(&self, values: Tensor, mask: Tensor) -> Result<Features> {
        features_of(self.run(values, mask)?)
    }

    /// The image processor with some settings of preprocessor_config.json replaced (as the
    /// keyword arguments of a processor call, e.g. `do_image_splitting: false`).
    pub fn processor_with(
        &self,
        overrides: &serde_json::Map<String, Value>,
    ) -> Result<VisionProcessor> {
        if overrides.is_empty() {
            return Ok(self.processor.clone());
        }
        let mut pre = self.preprocessor.clone();
        if let Some(obj) = pre.as_object_mut() {
            for (k, v) in overrides {
                obj.insert(k.clone(), v.clone());
            }
        }
        Ok(match &self.processor {
            VisionProcessor::Qwen2Vl(_) => {
                VisionProcessor::Qwen2Vl(Qwen2VlProcessor::from_config(&pre)?)
            }
            VisionProcessor::Idefics3(_) => {
                VisionProcessor::Idefics3(Idefics3Processor::from_config(&pre)?)
            }
        })
    }

    /// Preprocess and encode the images of a request, in order.
    pub fn encode(&self, images: &[RgbImage]) -> Result<EncodedImages> {
        self.encode_with(images, &self.processor)
    }

    /// `encode` with another processor (`processor_with`).
    pub fn encode_with(
        &self,
        images: &[RgbImage],
        processor: &VisionProcessor,
    ) -> Result<EncodedImages> {
        if images.is_empty() {
            return invalid!("no images to encode");
        }
        match processor {
            VisionProcessor::Qwen2Vl(p) => {
                let pixels = p.preprocess(images)?;
                let features = self.encode_patches(&pixels)?;
                let tokens: Vec<usize> = (0..pixels.grids.len())
                    .map(|i| pixels.image_tokens(i, p.merge_size))
                    .collect();
                check_rows(&features, tokens.iter().sum())?;
                Ok(EncodedImages {
                    features,
                    tokens,
                    grids: pixels.grids,
                    tiles: vec![],
                })
            }
            VisionProcessor::Idefics3(p) => {
                let tiles = images
                    .iter()
                    .map(|i| p.preprocess(i))
                    .collect::<Result<Vec<_>>>()?;
                let features = self.encode_tiles(&tiles)?;
                let count: usize = tiles.iter().map(|t| t.count).sum();
                let per_tile = features.rows / count.max(1);
                Ok(EncodedImages {
                    features,
                    tokens: tiles.iter().map(|t| t.count * per_tile).collect(),
                    grids: vec![],
                    tiles: tiles.iter().map(|t| (t.rows, t.cols)).collect(),
                })
            }
        }
    }
}

fn check_rows(features: &Features, expected: usize) -> Result<()> {
    if features.rows != expected {
        return Err(Error::Model(format!(
            "vision_encoder.onnx returned {} feature rows; the images have {expected} tokens",
            features.rows
        )));
    }
    Ok(())
}

/// `[tokens, hidden]` or `[tiles, tokens, hidden]` as rows of features.
fn features_of(out: Tensor) -> Result<Features> {
    let shape = out.shape().to_vec();
    let hidden = *shape.last().unwrap_or(&0);
    if shape.len() < 2 || hidden == 0 {
        return Err(Error::Model(format!(
            "vision_encoder.onnx returned shape {shape:?}; expected [..., hidden]"
        )));
    }
    let data = out
        .try_as_plain_ram()
        .map_err(backend)?
        .as_slice::<f32>()
        .map_err(backend)?
        .to_vec();
    Features::new(data.len() / hidden, hidden, data)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::onnx::{self, StreamDecoder};

    fn fixture(name: &str, file: &str) -> Vec<u8> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm/models");
        std::fs::read(dir.join(name).join(file)).unwrap()
    }

    fn json(name: &str, file: &str) -> Value {
        serde_json::from_slice(&fixture(name, file)).unwrap()
    }

    /// The encoder decoded as it streams in (as the package reads `vision_encoder.onnx`), its
    /// large initializers kept apart, gives the same features to the bit as the encoder decoded
    /// whole, whose large initializers are converted from the protobuf: with the threshold of
    /// the package (one of the fixtures' initializers, Qwen2-VL's) and with 1 KB (most of them).
    #[test]
    fn an_encoder_streamed_in_gives_the_features_of_one_decoded_whole() {
        for name in ["qwen2-vl", "smolvlm"] {
            let bytes = fixture(name, "onnx/vision_encoder.onnx");
            let (config, pre) = (
                json(name, "config.json"),
                json(name, "preprocessor_config.json"),
            );
            let image = RgbImage::new(
                40,
                24,
                (0..40 * 24 * 3).map(|i| (i * 37 % 251) as u8).collect(),
            )
            .unwrap();
            let features = |decoded| {
                let encoder = VisionEncoder::new(decoded, &config, Some(&pre)).unwrap();
                encoder
                    .encode(std::slice::from_ref(&image))
                    .unwrap()
                    .features
            };
            let whole = features(Decoded {
                proto: onnx::decode(&bytes, None, "vision_encoder.onnx").unwrap(),
                apart: onnx::Apart::new(),
            });
            assert!(!whole.data.is_empty(), "{name}");
            for large in [crate::model::ops::LARGE_INITIALIZER as u64, 1024] {
                let mut stream = StreamDecoder::new_apart("vision_encoder.onnx").with_large(large);
                for chunk in bytes.chunks(4096) {
                    stream.feed(chunk).unwrap();
                }
                let streamed = stream.finish().unwrap();
                let streamed = onnx::prepare(streamed, None, "vision_encoder.onnx").unwrap();
                let apart = streamed.apart.len();
                assert!(large > 1024 || apart >= 10, "{name}: {apart} apart");
                let got = features(streamed);
                assert_eq!((got.rows, got.hidden), (whole.rows, whole.hidden), "{name}");
                let bits = |f: &Features| f.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&whole),
                    "{name}, initializers of {large} bytes apart"
                );
            }
        }
    }
}
