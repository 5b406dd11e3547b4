//! Vision-language decoders (Qwen2-VL, SmolVLM / Idefics3): the decoder reads `inputs_embeds`,
//! which the engine computes inside each decoder step with the model's `embed_tokens.onnx`; in
//! the prompt steps the embeddings of the image tokens are replaced by rows of
//! `image_features` (transformers' `masked_scatter`), and positions may be given per prompt
//! (M-RoPE's three axes for Qwen2-VL). The generation loop is the one of text models: chunks,
//! batches, beams and cache reordering do not know about images.
//!
//! * `PromptInputs`: a request's validated image features and positions, per prompt.
//! * `rope_index`: Qwen2-VL's positions from `image_grid_thw`.
//! * `resize`, `qwen2_vl`, `idefics3`: the image processors; `encoder`: `vision_encoder.onnx`.

pub mod encoder;
pub mod idefics3;
pub mod prompt;
pub mod qwen2_vl;
pub mod resize;
pub mod rope_index;

use crate::error::{invalid, Result};
pub use rope_index::RopeConfig;

/// Image features: `rows x hidden`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    pub rows: usize,
    pub hidden: usize,
    pub data: Vec<f32>,
}

impl Features {
    pub fn new(rows: usize, hidden: usize, data: Vec<f32>) -> Result<Features> {
        if data.len() != rows * hidden {
            return invalid!(
                "image_features has {} values; expected {rows} rows x {hidden} = {}",
                data.len(),
                rows * hidden
            );
        }
        Ok(Features { rows, hidden, data })
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.hidden..(r + 1) * self.hidden]
    }
}

/// The positions of one prompt: `axes x len`, axis-major (`axes` is 1 for a decoder whose
/// `position_ids` is `[batch, sequence]`, 3 for M-RoPE's `[3, batch, sequence]`).
#[derive(Debug, Clone, PartialEq)]
pub struct PositionIds {
    pub axes: usize,
    pub len: usize,
    pub data: Vec<i64>,
}

impl PositionIds {
    pub fn new(axes: usize, len: usize, data: Vec<i64>) -> Result<PositionIds> {
        if data.len() != axes * len {
            return invalid!(
                "position_ids has {} values; expected {axes} axes x {len} positions",
                data.len()
            );
        }
        Ok(PositionIds { axes, len, data })
    }

    pub fn axis(&self, a: usize) -> &[i64] {
        &self.data[a * self.len..(a + 1) * self.len]
    }
}

/// What a caller gives beside the prompts of a vision-language request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageInputs {
    /// The rows that replace the image tokens' embeddings: those of prompt 0's image tokens in
    /// order, then prompt 1's, ... (more rows than image tokens are allowed and unused).
    pub image_features: Option<Features>,
    /// One per prompt: its positions (1 or 3 axes, as the decoder's `position_ids`).
    pub position_ids: Option<Vec<PositionIds>>,
    /// Qwen2-VL: the patch grid `[t, h, w]` of each image of all prompts, in order; without
    /// `position_ids` the engine computes the M-RoPE positions from it (`get_rope_index`).
    pub image_grid_thw: Option<Vec<[usize; 3]>>,
}

/// What the engine knows of a vision-language model from its files.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// The image placeholder token (`image_token_id` / `image_token_index` of config.json).
    pub image_token_id: Option<u32>,
    /// Axes of the decoder's positions: 1 (`[batch, sequence]`) or 3 (M-RoPE).
    pub position_axes: usize,
    /// Width of the token embeddings.
    pub hidden: usize,
    /// Qwen2-VL's `get_rope_index` settings.
    pub rope: Option<RopeConfig>,
}

impl VisionConfig {
    pub fn image_token_id_of(config: &serde_json::Value) -> Option<u32> {
        ["image_token_id", "image_token_index"]
            .iter()
            .find_map(|k| config.get(k).and_then(|v| v.as_u64()))
            .map(|v| v as u32)
    }
}

/// One prompt's validated inputs.
#[derive(Debug, Clone, PartialEq)]
struct PromptRow {
    len: usize,
    /// For each prompt index: the row of `features` that replaces its embedding.
    feature_rows: Vec<Option<usize>>,
    /// Given or computed positions of the prompt (axis-major), `None`: the index.
    positions: Option<PositionIds>,
    /// Positions after the prompt are `index + delta` on every axis (transformers' rope delta).
    delta: i64,
}

/// A request's image features and positions, per prompt, checked against the prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptInputs {
    prompts: Vec<PromptRow>,
    features: Option<Features>,
    /// Axes of the decoder's positions.
    pub axes: usize,
}

impl PromptInputs {
    /// Check `inputs` against `prompts`: every image token needs a feature row (prompt `p`'s
    /// start after the rows of the prompts before it), features as wide as the embeddings,
    /// positions of the decoder's axes and the prompt's length.
    pub fn new(
        vision: &VisionConfig,
        prompts: &[Vec<u32>],
        inputs: &ImageInputs,
    ) -> Result<PromptInputs> {
        let image_tokens: Vec<usize> = prompts
            .iter()
            .map(|p| match vision.image_token_id {
                Some(id) => p.iter().filter(|&&t| t == id).count(),
                None => 0,
            })
            .collect();
        let total: usize = image_tokens.iter().sum();
        let features = inputs.image_features.clone();
        match &features {
            Some(f) if f.hidden != vision.hidden => {
                return invalid!(
                    "image_features rows have {} values; this model's embeddings have {}",
                    f.hidden,
                    vision.hidden
                );
            }
            Some(f) if f.rows < total => {
                return invalid!(
                    "the prompts have {total} image tokens but image_features has only {} rows",
                    f.rows
                );
            }
            None if total > 0 => {
                let p = image_tokens.iter().position(|&n| n > 0).unwrap_or(0);
                return invalid!(
                    "prompt {p} has {} image tokens (id {}) but no image_features were given",
                    image_tokens[p],
                    vision.image_token_id.unwrap_or(0)
                );
            }
            _ => {}
        }
        if let Some(given) = &inputs.position_ids {
            if given.len() != prompts.len() {
                return invalid!(
                    "position_ids has {} entries for {} prompts (one per prompt)",
                    given.len(),
                    prompts.len()
                );
            }
        }
        let mut rows = vec![];
        let mut first_feature = 0;
        let mut grids_used = 0;
        for (p, prompt) in prompts.iter().enumerate() {
            let mut feature_rows = vec![None; prompt.len()];
            let mut next = first_feature;
            for (i, &t) in prompt.iter().enumerate() {
                if Some(t) == vision.image_token_id {
                    feature_rows[i] = Some(next);
                    next += 1;
                }
            }
            first_feature = next;
            let positions = match (&inputs.position_ids, &inputs.image_grid_thw, &vision.rope) {
                (Some(given), _, _) => {
                    let pos = &given[p];
                    if pos.axes != vision.position_axes || pos.len != prompt.len() {
                        return invalid!(
                            "position_ids of prompt {p} is [{}, {}]; this decoder expects [{}, {}] \
                             (axes x prompt length)",
                            pos.axes,
                            pos.len,
                            vision.position_axes,
                            prompt.len()
                        );
                    }
                    Some(pos.clone())
                }
                (None, Some(grids), Some(rope)) if vision.position_axes == 3 => {
                    let (pos, used) =
                        rope_index::rope_index(prompt, &grids[grids_used.min(grids.len())..], rope)
                            .map_err(|e| prefix(e, p))?;
                    grids_used += used;
                    Some(pos)
                }
                _ => {
                    if vision.position_axes == 3 && image_tokens[p] > 0 {
                        return invalid!(
                            "prompt {p} has image tokens: an M-RoPE decoder needs position_ids or \
                             image_grid_thw for it"
                        );
                    }
                    None
                }
            };
            let delta = match &positions {
                Some(pos) if pos.len > 0 => {
                    pos.data.iter().copied().max().unwrap_or(0) + 1 - pos.len as i64
                }
                _ => 0,
            };
            rows.push(PromptRow {
                len: prompt.len(),
                feature_rows,
                positions,
                delta,
            });
        }
        Ok(PromptInputs {
            prompts: rows,
            features,
            axes: vision.position_axes,
        })
    }

    /// The feature row that replaces the embedding of index `i` of prompt `p` (prompt image
    /// tokens only; a generated image token keeps its embedding).
    pub fn feature(&self, p: usize, i: usize) -> Option<&[f32]> {
        let row = self
            .prompts
            .get(p)?
            .feature_rows
            .get(i)
            .copied()
            .flatten()?;
        self.features.as_ref().map(|f| f.row(row))
    }

    /// The position of index `i` of prompt `p` on `axis`: the given one inside the prompt,
    /// `i + delta` after it.
    pub fn position(&self, p: usize, axis: usize, i: usize) -> i64 {
        let Some(row) = self.prompts.get(p) else {
            return i as i64;
        };
        match &row.positions {
            Some(pos) if i < row.len => pos.data[axis.min(pos.axes - 1) * pos.len + i],
            _ => i as i64 + row.delta,
        }
    }

    /// Transformers' rope delta of prompt `p` (largest prompt position + 1 - prompt length).
    pub fn rope_delta(&self, p: usize) -> i64 {
        self.prompts.get(p).map(|r| r.delta).unwrap_or(0)
    }

    /// The positions of prompt `p` (`None`: index positions).
    pub fn prompt_positions(&self, p: usize) -> Option<&PositionIds> {
        self.prompts.get(p)?.positions.as_ref()
    }
}

fn prefix(e: crate::Error, p: usize) -> crate::Error {
    match e {
        crate::Error::InvalidInput(m) => crate::Error::InvalidInput(format!("prompt {p}: {m}")),
        other => other,
    }
}

/// The rows of a decoder state and the prompt each one continues (beams and samples of a prompt
/// share its inputs).
#[derive(Debug, Clone)]
pub struct RowInputs {
    pub inputs: std::sync::Arc<PromptInputs>,
    pub prompt_of: Vec<usize>,
}

impl RowInputs {
    /// After `DecoderState::reorder(parents)`: row `r` continues the prompt of `parents[r]`.
    pub fn reorder(&mut self, parents: &[usize]) {
        self.prompt_of = parents
            .iter()
            .map(|&p| self.prompt_of.get(p).copied().unwrap_or(0))
            .collect();
    }
}
