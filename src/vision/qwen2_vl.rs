//! Qwen2-VL's image processor (transformers 4.57 `Qwen2VLImageProcessor`, the PIL-based one):
//! `smart_resize` to multiples of `patch_size * merge_size` within `[min_pixels, max_pixels]`,
//! Pillow resampling, rescale and normalise, the image repeated `temporal_patch_size` times, and
//! the patches flattened in merge-group order: one row per patch, `[grid_t, grid_h/m, grid_w/m,
//! m, m]` over rows and `[channel, temporal, patch_y, patch_x]` along a row.

use serde_json::Value;

use crate::error::{invalid, Result};

use super::resize::{resize, Filter, RgbImage};

/// The settings of `preprocessor_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlProcessor {
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub do_resize: bool,
    pub resample: Filter,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// The processor's output for a list of images.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlPixels {
    /// `[patches, 3 * temporal_patch_size * patch_size^2]`, row-major.
    pub data: Vec<f32>,
    pub patches: usize,
    pub patch_len: usize,
    /// `image_grid_thw`: `[t, h, w]` in patches, per image.
    pub grids: Vec<[usize; 3]>,
}

impl Qwen2VlPixels {
    /// The number of image tokens of image `i` (merged patch groups).
    pub fn image_tokens(&self, i: usize, merge_size: usize) -> usize {
        let [t, h, w] = self.grids[i];
        t * h * w / (merge_size * merge_size)
    }
}

pub(crate) fn usize_of(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize)
}

pub(crate) fn triple(v: &Value, key: &str, default: [f32; 3]) -> Result<[f32; 3]> {
    match v.get(key) {
        None => Ok(default),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(0.0) as f32;
            Ok([x; 3])
        }
        Some(Value::Array(a)) if a.len() == 3 => {
            let f = |i: usize| a[i].as_f64().unwrap_or(0.0) as f32;
            Ok([f(0), f(1), f(2)])
        }
        Some(other) => invalid!("preprocessor_config.json: `{key}` is {other}; expected 3 numbers"),
    }
}

impl Qwen2VlProcessor {
    pub fn from_config(pre: &Value) -> Result<Qwen2VlProcessor> {
        let size = pre.get("size").cloned().unwrap_or(Value::Null);
        let min_pixels = usize_of(pre, "min_pixels")
            .or_else(|| usize_of(&size, "shortest_edge"))
            .unwrap_or(56 * 56);
        let max_pixels = usize_of(pre, "max_pixels")
            .or_else(|| usize_of(&size, "longest_edge"))
            .unwrap_or(28 * 28 * 1280);
        let flag = |k: &str| pre.get(k).and_then(|v| v.as_bool()).unwrap_or(true);
        Ok(Qwen2VlProcessor {
            patch_size: usize_of(pre, "patch_size").unwrap_or(14),
            merge_size: usize_of(pre, "merge_size").unwrap_or(2),
            temporal_patch_size: usize_of(pre, "temporal_patch_size").unwrap_or(2),
            min_pixels,
            max_pixels,
            do_resize: flag("do_resize"),
            resample: Filter::from_pil(pre.get("resample").and_then(|v| v.as_u64()).unwrap_or(3))?,
            do_rescale: flag("do_rescale"),
            rescale_factor: pre
                .get("rescale_factor")
                .and_then(|v| v.as_f64())
                .unwrap_or(1.0 / 255.0),
            do_normalize: flag("do_normalize"),
            mean: triple(pre, "image_mean", [0.481_454_66, 0.457_827_5, 0.408_210_73])?,
            std: triple(pre, "image_std", [0.268_629_54, 0.261_302_6, 0.275_777_1])?,
        })
    }

    /// transformers' `smart_resize(height, width, factor, min_pixels, max_pixels)`.
    pub fn smart_resize(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (h, w) = (height as f64, width as f64);
        if height == 0 || width == 0 {
            return invalid!(
                "an image of {width}x{height} pixels: width and height must be positive"
            );
        }
        if h.max(w) / h.min(w) > 200.0 {
            return invalid!(
                "an image of {width}x{height}: the aspect ratio must be smaller than 200"
            );
        }
        // Python's round() rounds halves to even.
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if h_bar * w_bar > self.max_pixels as f64 {
            let beta = ((h * w) / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// Process `images` (each alone, as the processor does) and concatenate their patches.
    pub fn preprocess(&self, images: &[RgbImage]) -> Result<Qwen2VlPixels> {
        let (ps, m, tp) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let patch_len = 3 * tp * ps * ps;
        let mut data = vec![];
        let mut grids = vec![];
        for image in images {
            let image = if self.do_resize {
                let (h, w) = self.smart_resize(image.height, image.width)?;
                resize(image, w, h, self.resample)?
            } else {
                image.clone()
            };
            let (h, w) = (image.height, image.width);
            if h % (ps * m) != 0 || w % (ps * m) != 0 {
                return invalid!(
                    "an image of {w}x{h} is not a multiple of patch_size x merge_size = {}",
                    ps * m
                );
            }
            let pixels = self.normalise(&image);
            let (gh, gw) = (h / ps, w / ps);
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for mh in 0..m {
                        for mw in 0..m {
                            let (y0, x0) = ((bh * m + mh) * ps, (bw * m + mw) * ps);
                            for c in 0..3 {
                                // The image repeated over the temporal patch.
                                for _ in 0..tp {
                                    for py in 0..ps {
                                        for px in 0..ps {
                                            data.push(pixels[((y0 + py) * w + x0 + px) * 3 + c]);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            grids.push([1, gh, gw]);
        }
        Ok(Qwen2VlPixels {
            patches: data.len() / patch_len,
            data,
            patch_len,
            grids,
        })
    }

    /// Rescale and normalise (HWC): `(x * factor)` in f64 cast to f32, then `(x - mean) / std`
    /// in f32, as transformers' `rescale` and `normalize`.
    fn normalise(&self, image: &RgbImage) -> Vec<f32> {
        normalise(
            image,
            self.do_rescale,
            self.rescale_factor,
            self.do_normalize,
            self.mean,
            self.std,
        )
    }
}

pub(crate) fn normalise(
    image: &RgbImage,
    do_rescale: bool,
    factor: f64,
    do_normalize: bool,
    mean: [f32; 3],
    std: [f32; 3],
) -> Vec<f32> {
    image
        .data
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let x = if do_rescale {
                (v as f64 * factor) as f32
            } else {
                v as f32
            };
            if do_normalize {
                (x - mean[i % 3]) / std[i % 3]
            } else {
                x
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor() -> Qwen2VlProcessor {
        Qwen2VlProcessor::from_config(&serde_json::json!({
            "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
            "min_pixels": 64, "max_pixels": 4096
        }))
        .unwrap()
    }

    #[test]
    fn smart_resize_rounds_halves_to_even_and_bounds_the_area() {
        let p = processor();
        assert_eq!(p.smart_resize(20, 30).unwrap(), (16, 32));
        assert_eq!(p.smart_resize(32, 32).unwrap(), (32, 32));
        assert_eq!(p.smart_resize(200, 200).unwrap(), (64, 64));
        assert_eq!(p.smart_resize(2, 2).unwrap(), (8, 8));
        assert!(p.smart_resize(0, 2).is_err());
        assert!(p.smart_resize(1, 400).is_err());
    }
}
