//! Qwen2-VL's multimodal rotary positions (M-RoPE): three position axes (temporal, height,
//! width). Text tokens advance all three together; the tokens of an image take the positions of
//! its merged patch grid, offset by the text before it. Matches transformers 4.57
//! `Qwen2VLModel.get_rope_index` for images (one prompt, no padding).

use crate::error::{invalid, Error, Result};

use super::PositionIds;

/// The token ids and sizes `get_rope_index` reads from config.json.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub image_token_id: u32,
    pub video_token_id: Option<u32>,
    pub vision_start_token_id: u32,
    pub spatial_merge_size: usize,
}

impl RopeConfig {
    /// From a Qwen2-VL style config.json (`vision_start_token_id`, `image_token_id`,
    /// `vision_config.spatial_merge_size`); `None` when the model has no M-RoPE vision tokens.
    pub fn from_config(config: &serde_json::Value) -> Option<RopeConfig> {
        let id = |k: &str| config.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        Some(RopeConfig {
            image_token_id: id("image_token_id").or_else(|| id("image_token_index"))?,
            video_token_id: id("video_token_id"),
            vision_start_token_id: id("vision_start_token_id")?,
            spatial_merge_size: config
                .get("vision_config")
                .and_then(|v| v.get("spatial_merge_size"))
                .and_then(|v| v.as_u64())
                .unwrap_or(2) as usize,
        })
    }
}

/// The `[3][len]` positions of one prompt whose images have the patch grids `grids` (`[t, h, w]`
/// each, in patches before merging, as `image_grid_thw`), and the number of grids it used.
/// Images are those `vision_start` tokens followed by an image token; each image's tokens are
/// the `t * h/m * w/m` tokens from the next image token on.
pub fn rope_index(
    ids: &[u32],
    grids: &[[usize; 3]],
    config: &RopeConfig,
) -> Result<(PositionIds, usize)> {
    let m = config.spatial_merge_size.max(1);
    let images = ids
        .windows(2)
        .filter(|w| w[0] == config.vision_start_token_id && w[1] == config.image_token_id)
        .count();
    if let Some(video) = config.video_token_id {
        if ids
            .windows(2)
            .any(|w| w[0] == config.vision_start_token_id && w[1] == video)
        {
            return Err(Error::Unsupported(
                "video tokens in a prompt (only images are supported)".into(),
            ));
        }
    }
    if images > grids.len() {
        return invalid!(
            "the prompt has {images} images (vision_start followed by an image token) but only {} \
             image_grid_thw entries are left for it",
            grids.len()
        );
    }
    let mut axes: [Vec<i64>; 3] = [vec![], vec![], vec![]];
    let mut next = 0i64; // the position after the largest so far
    let mut start = 0usize;
    for (g, grid) in grids.iter().take(images).enumerate() {
        let Some(at) = ids[start..]
            .iter()
            .position(|&t| t == config.image_token_id)
            .map(|i| i + start)
        else {
            return invalid!("image {g} of the prompt has no image token");
        };
        let [t, h, w] = *grid;
        if h % m != 0 || w % m != 0 || t == 0 || h == 0 || w == 0 {
            return invalid!(
                "image_grid_thw {grid:?} of image {g}: height and width must be positive \
                 multiples of spatial_merge_size {m}"
            );
        }
        let (gh, gw) = (h / m, w / m);
        let tokens = t * gh * gw;
        if at + tokens > ids.len()
            || ids[at..at + tokens]
                .iter()
                .any(|&x| x != config.image_token_id)
        {
            return invalid!(
                "image {g} of the prompt has grid {grid:?} ({tokens} image tokens after merging) \
                 but the prompt has fewer consecutive image tokens at position {at}"
            );
        }
        for i in 0..(at - start) as i64 {
            for axis in axes.iter_mut() {
                axis.push(next + i);
            }
        }
        let base = next + (at - start) as i64;
        let mut largest = base - 1;
        for ti in 0..t {
            for hi in 0..gh {
                for wi in 0..gw {
                    let p = [ti as i64 + base, hi as i64 + base, wi as i64 + base];
                    for (axis, v) in axes.iter_mut().zip(p) {
                        axis.push(v);
                        largest = largest.max(v);
                    }
                }
            }
        }
        next = largest + 1;
        start = at + tokens;
    }
    for i in 0..(ids.len() - start) as i64 {
        for axis in axes.iter_mut() {
            axis.push(next + i);
        }
    }
    let data: Vec<i64> = axes.concat();
    Ok((
        PositionIds {
            axes: 3,
            len: ids.len(),
            data,
        },
        images,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RopeConfig {
        RopeConfig {
            image_token_id: 5,
            video_token_id: Some(6),
            vision_start_token_id: 3,
            spatial_merge_size: 2,
        }
    }

    /// transformers' docstring example for an image: text positions continue after the largest
    /// position of the image.
    #[test]
    fn image_then_text() {
        let ids = [9, 3, 5, 5, 5, 5, 5, 5, 4, 9];
        let (p, used) = rope_index(&ids, &[[1, 4, 6]], &config()).unwrap();
        assert_eq!(used, 1);
        assert_eq!(p.axis(0), &[0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(p.axis(1), &[0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(p.axis(2), &[0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn text_only_and_bad_grids() {
        let (p, used) = rope_index(&[1, 2, 3], &[], &config()).unwrap();
        assert_eq!((p.axis(2), used), (&[0i64, 1, 2][..], 0));
        assert!(rope_index(&[3, 5, 4], &[], &config()).is_err());
        assert!(rope_index(&[3, 5, 4], &[[1, 4, 4]], &config()).is_err());
        assert!(rope_index(&[3, 5, 4], &[[1, 3, 2]], &config()).is_err());
        assert!(rope_index(&[3, 6, 4], &[], &config()).is_err());
    }
}
