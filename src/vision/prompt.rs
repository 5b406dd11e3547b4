//! Text prompts with images, as the models' processors build them: the images are processed and
//! encoded, each image placeholder of the text (the image token, one per image, as the chat
//! templates write it) is expanded to the image's tokens, and the text is tokenized.

use crate::error::{invalid, Error, Result};
use crate::model::Model;

use super::encoder::VisionProcessor;
use super::idefics3::image_prompt;
use super::resize::RgbImage;
use super::ImageInputs;

impl Model {
    /// The token ids of `texts` and the image inputs for `images[p]`, the images of text `p`
    /// in order (one image token in the text per image). Images go through the model's image
    /// processor (with `overrides` of preprocessor_config.json settings) and
    /// `vision_encoder.onnx`; Qwen2-VL prompts get their M-RoPE positions from the image grids.
    pub fn image_prompts(
        &self,
        texts: &[String],
        images: &[Vec<RgbImage>],
        add_special_tokens: bool,
        overrides: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(Vec<Vec<u32>>, ImageInputs)> {
        let vision = self.vision.as_ref().ok_or_else(|| {
            Error::Unsupported("images for a model that is not a vision-language decoder".into())
        })?;
        if texts.len() != images.len() {
            return invalid!(
                "{} prompts but image lists for {}",
                texts.len(),
                images.len()
            );
        }
        let token = vision
            .image_token_id
            .and_then(|id| self.tokenizer.id_to_token(id))
            .ok_or_else(|| Error::Model("the model has no image token".into()))?;
        let all: Vec<RgbImage> = images.iter().flatten().cloned().collect();
        let encoded = match (all.is_empty(), &self.vision_encoder) {
            (true, _) => None,
            (false, None) => {
                return Err(Error::Model(
                    "images were given but the model folder has no vision_encoder.onnx".into(),
                ))
            }
            (false, Some(encoder)) => {
                let processor = encoder.processor_with(overrides)?;
                Some((
                    encoder.encode_with(&all, &processor)?,
                    processor,
                    encoder.tokens_per_tile,
                ))
            }
        };
        let mut prompts = vec![];
        let mut next_image = 0;
        for (p, text) in texts.iter().enumerate() {
            let parts: Vec<&str> = text.split(token.as_str()).collect();
            let count = parts.len() - 1;
            if count != images[p].len() {
                return invalid!(
                    "prompt {p} has {count} image tokens {token} for {} images",
                    images[p].len()
                );
            }
            let mut expanded = parts[0].to_owned();
            for part in &parts[1..] {
                let Some((enc, processor, per_tile)) = &encoded else {
                    return invalid!("prompt {p} has an image token but no image");
                };
                match processor {
                    VisionProcessor::Qwen2Vl(_) => {
                        expanded.push_str(&token.repeat(enc.tokens[next_image]));
                    }
                    VisionProcessor::Idefics3(_) => {
                        let (rows, cols) = enc.tiles[next_image];
                        expanded.push_str(&image_prompt(rows, cols, *per_tile, &token));
                    }
                }
                expanded.push_str(part);
                next_image += 1;
            }
            prompts.push(self.tokenizer.encode(&expanded, add_special_tokens)?);
        }
        let inputs = match encoded {
            None => ImageInputs::default(),
            Some((enc, _, _)) => ImageInputs {
                image_features: Some(enc.features),
                position_ids: None,
                image_grid_thw: (!enc.grids.is_empty()).then_some(enc.grids),
            },
        };
        Ok((prompts, inputs))
    }
}
