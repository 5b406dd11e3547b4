//! SmolVLM / Idefics3's image processor (transformers 4.57 `SmolVLMImageProcessor`, PIL-based):
//! the longest edge resized to `size.longest_edge` (the other edge keeping the aspect ratio,
//! rounded up to even), then with image splitting both edges to multiples of the tile size
//! (`max_image_size.longest_edge`) and the image cut into tiles, row by row, plus the whole image
//! resized to one tile (the global tile); without splitting the image becomes one square tile.
//! Every resize is Pillow's with `resample` (Lanczos by default).

use serde_json::Value;

use crate::error::{invalid, Result};

use super::qwen2_vl::{normalise, triple, usize_of};
use super::resize::{resize, Filter, RgbImage};

/// transformers' `MAX_IMAGE_SIZE` of this processor.
const MAX_IMAGE_SIZE: usize = 4096;

/// The settings of `preprocessor_config.json` (and `image_seq_len` of processor_config.json).
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Processor {
    pub do_resize: bool,
    pub longest_edge: usize,
    pub do_image_splitting: bool,
    /// Tile size (`max_image_size.longest_edge`).
    pub tile: usize,
    pub resample: Filter,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// One image as tiles: `rows x cols` crops (0 x 0 without splitting) then the global tile.
#[derive(Debug, Clone, PartialEq)]
pub struct Tiles {
    pub rows: usize,
    pub cols: usize,
    /// `[count, 3, tile, tile]`, row-major (channels first).
    pub data: Vec<f32>,
    pub count: usize,
    pub tile: usize,
}

impl Idefics3Processor {
    pub fn from_config(pre: &Value) -> Result<Idefics3Processor> {
        let flag = |k: &str| pre.get(k).and_then(|v| v.as_bool()).unwrap_or(true);
        let size = pre.get("size").cloned().unwrap_or(Value::Null);
        let max = pre.get("max_image_size").cloned().unwrap_or(Value::Null);
        Ok(Idefics3Processor {
            do_resize: flag("do_resize"),
            longest_edge: usize_of(&size, "longest_edge").unwrap_or(4 * 364),
            do_image_splitting: flag("do_image_splitting"),
            tile: usize_of(&max, "longest_edge").unwrap_or(364),
            resample: Filter::from_pil(pre.get("resample").and_then(|v| v.as_u64()).unwrap_or(1))?,
            do_rescale: flag("do_rescale"),
            rescale_factor: pre
                .get("rescale_factor")
                .and_then(|v| v.as_f64())
                .unwrap_or(1.0 / 255.0),
            do_normalize: flag("do_normalize"),
            mean: triple(pre, "image_mean", [0.5; 3])?,
            std: triple(pre, "image_std", [0.5; 3])?,
        })
    }

    /// The size after `resize` to `longest_edge`: `_resize_output_size_rescale_to_max_len`
    /// then `_resize_output_size_scale_below_upper_bound`.
    fn longest_edge_size(&self, height: usize, width: usize) -> (usize, usize) {
        let aspect = width as f64 / height as f64;
        let (mut h, mut w);
        if width >= height {
            w = self.longest_edge;
            h = (w as f64 / aspect) as usize;
            if h % 2 != 0 {
                h += 1;
            }
        } else {
            h = self.longest_edge;
            w = (h as f64 * aspect) as usize;
            if w % 2 != 0 {
                w += 1;
            }
        }
        h = h.max(1);
        w = w.max(1);
        let aspect = w as f64 / h as f64;
        if w >= h && w > MAX_IMAGE_SIZE {
            w = MAX_IMAGE_SIZE;
            h = (w as f64 / aspect) as usize;
        } else if h > w && h > MAX_IMAGE_SIZE {
            h = MAX_IMAGE_SIZE;
            w = (h as f64 * aspect) as usize;
        }
        (h.max(1), w.max(1))
    }

    /// `resize_for_vision_encoder`: both edges to multiples of the tile size.
    fn tile_multiple_size(&self, height: usize, width: usize) -> (usize, usize) {
        let t = self.tile;
        let aspect = width as f64 / height as f64;
        let up = |x: usize| x.div_ceil(t) * t;
        if width >= height {
            let w = up(width);
            let h = (w as f64 / aspect) as usize;
            (up(h), w)
        } else {
            let h = up(height);
            let w = (h as f64 * aspect) as usize;
            (h, up(w))
        }
    }

    /// The tiles of one image.
    pub fn preprocess(&self, image: &RgbImage) -> Result<Tiles> {
        if image.width == 0 || image.height == 0 {
            return invalid!(
                "an image of {}x{} pixels: width and height must be positive",
                image.width,
                image.height
            );
        }
        let t = self.tile;
        let mut img = image.clone();
        if self.do_resize {
            let (h, w) = self.longest_edge_size(img.height, img.width);
            img = resize(&img, w, h, self.resample)?;
        }
        let mut frames = vec![];
        let (mut rows, mut cols) = (0, 0);
        if self.do_image_splitting {
            let (h, w) = self.tile_multiple_size(img.height, img.width);
            img = resize(&img, w, h, self.resample)?;
            if img.height > t || img.width > t {
                rows = img.height.div_ceil(t);
                cols = img.width.div_ceil(t);
                let (th, tw) = (img.height.div_ceil(rows), img.width.div_ceil(cols));
                for r in 0..rows {
                    for c in 0..cols {
                        let (x0, y0) = (c * tw, r * th);
                        let (x1, y1) = ((x0 + tw).min(img.width), (y0 + th).min(img.height));
                        frames.push(img.crop(x0, y0, x1, y1));
                    }
                }
                img = resize(&img, t, t, self.resample)?;
            }
            frames.push(img);
        } else {
            frames.push(resize(&img, t, t, self.resample)?);
        }
        // Tiles smaller than the tile size are padded with zeros at the bottom and right (the
        // batch's pixel_attention_mask hides them); the multiples above make every tile full.
        let mut data = vec![0f32; frames.len() * 3 * t * t];
        for (f, frame) in frames.iter().enumerate() {
            let pixels = normalise(
                frame,
                self.do_rescale,
                self.rescale_factor,
                self.do_normalize,
                self.mean,
                self.std,
            );
            for y in 0..frame.height.min(t) {
                for x in 0..frame.width.min(t) {
                    for c in 0..3 {
                        data[((f * 3 + c) * t + y) * t + x] = pixels[(y * frame.width + x) * 3 + c];
                    }
                }
            }
        }
        Ok(Tiles {
            rows,
            cols,
            count: frames.len(),
            data,
            tile: t,
        })
    }
}

/// The processor's text for one image (`<image>` in the prompt): each tile's
/// `<fake_token_around_image><row_R_col_C>` and `image_seq_len` image tokens, a newline after
/// each row of tiles, then `\n<fake_token_around_image><global-img>`, the global tile's image
/// tokens and a closing `<fake_token_around_image>` (transformers' `get_image_prompt_string`).
pub fn image_prompt(rows: usize, cols: usize, image_seq_len: usize, image_token: &str) -> String {
    let fake = "<fake_token_around_image>";
    let tokens = image_token.repeat(image_seq_len);
    let global = format!("{fake}<global-img>{tokens}{fake}");
    if rows == 0 && cols == 0 {
        return global;
    }
    let mut out = String::new();
    for r in 0..rows {
        for c in 0..cols {
            out.push_str(&format!("{fake}<row_{}_col_{}>{tokens}", r + 1, c + 1));
        }
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&global);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_processor() {
        let p = Idefics3Processor::from_config(&serde_json::json!({
            "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}
        }))
        .unwrap();
        assert_eq!(p.longest_edge_size(24, 40), (38, 64));
        assert_eq!(p.tile_multiple_size(38, 64), (64, 64));
        assert_eq!(p.longest_edge_size(40, 16), (64, 26));
        assert_eq!(p.tile_multiple_size(64, 26), (64, 32));
    }
}
