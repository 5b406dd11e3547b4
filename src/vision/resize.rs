//! Image resizing as Pillow's `Image.resize` does it for 8-bit RGB images, which transformers'
//! image processors call: a separable convolution (horizontal pass, then vertical), filters
//! stretched by the scale when shrinking (antialiasing), coefficients normalised and rounded to
//! 22-bit fixed point, each pass rounded and clamped to 8 bits. A same-size resize is a copy.

use crate::error::{invalid, Result};

/// An 8-bit RGB image, `height x width x 3`, row-major (HWC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl RgbImage {
    /// An image from HWC RGB bytes.
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Result<RgbImage> {
        if width == 0 || height == 0 {
            return invalid!(
                "an image of {width}x{height} pixels: width and height must be positive"
            );
        }
        if data.len() != width * height * 3 {
            return invalid!(
                "an RGB image of {width}x{height} needs {} bytes, got {}",
                width * height * 3,
                data.len()
            );
        }
        Ok(RgbImage {
            width,
            height,
            data,
        })
    }

    /// From RGBA bytes (a canvas' `ImageData`): alpha is composited over white, as
    /// transformers' `convert_to_rgb` does.
    pub fn from_rgba(width: usize, height: usize, rgba: &[u8]) -> Result<RgbImage> {
        if rgba.len() != width * height * 4 {
            return invalid!(
                "an RGBA image of {width}x{height} needs {} bytes, got {}",
                width * height * 4,
                rgba.len()
            );
        }
        let data = rgba
            .chunks_exact(4)
            .flat_map(|p| {
                let a = p[3] as u32;
                // Pillow's alpha_composite over an opaque white background.
                let over = |c: u8| ((c as u32 * a + 255 * (255 - a) + 127) / 255) as u8;
                [over(p[0]), over(p[1]), over(p[2])]
            })
            .collect();
        RgbImage::new(width, height, data)
    }

    /// The pixels of the rectangle `[x0, x1) x [y0, y1)`.
    pub fn crop(&self, x0: usize, y0: usize, x1: usize, y1: usize) -> RgbImage {
        let mut data = Vec::with_capacity((x1 - x0) * (y1 - y0) * 3);
        for y in y0..y1 {
            data.extend_from_slice(
                &self.data[(y * self.width + x0) * 3..(y * self.width + x1) * 3],
            );
        }
        RgbImage {
            width: x1 - x0,
            height: y1 - y0,
            data,
        }
    }
}

/// Pillow's resampling filters (the `resample` numbers of preprocessor_config.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Nearest,
    Lanczos,
    Bilinear,
    Bicubic,
}

impl Filter {
    /// `PIL.Image.Resampling`: 0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic.
    pub fn from_pil(n: u64) -> Result<Filter> {
        match n {
            0 => Ok(Filter::Nearest),
            1 => Ok(Filter::Lanczos),
            2 => Ok(Filter::Bilinear),
            3 => Ok(Filter::Bicubic),
            _ => Err(crate::Error::Unsupported(format!(
                "resample {n} (supported: 0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic)"
            ))),
        }
    }

    fn support(self) -> f64 {
        match self {
            Filter::Nearest => 0.5,
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Nearest => {
                if (-0.5..0.5).contains(&x) {
                    1.0
                } else {
                    0.0
                }
            }
            Filter::Bilinear => (1.0 - x.abs()).max(0.0),
            Filter::Bicubic => {
                let a = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        1.0
    } else {
        let x = x * std::f64::consts::PI;
        x.sin() / x
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For each output pixel along one axis: the first input pixel and the fixed-point weights.
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // Truncation toward zero, as C's (int) cast.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = (((center + support + 0.5) as i64).min(in_size as i64) as usize).max(xmin);
            let mut w: Vec<f64> = (xmin..xmax)
                .map(|x| filter.weight((x as f64 - center + 0.5) / filter_scale))
                .collect();
            let total: f64 = w.iter().sum();
            if total != 0.0 {
                w.iter_mut().for_each(|k| *k /= total);
            }
            let fixed = w
                .iter()
                .map(|&k| {
                    let v = k * (1u32 << PRECISION_BITS) as f64;
                    (if k < 0.0 { v - 0.5 } else { v + 0.5 }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resize to `width x height` as Pillow's `Image.resize(size, resample)`.
pub fn resize(image: &RgbImage, width: usize, height: usize, filter: Filter) -> Result<RgbImage> {
    if width == 0 || height == 0 {
        return invalid!("cannot resize an image to {width}x{height}");
    }
    if width == image.width && height == image.height {
        return Ok(image.clone());
    }
    if filter == Filter::Nearest {
        return Ok(nearest(image, width, height));
    }
    let mut img = image.clone();
    if width != img.width {
        let coeffs = coefficients(img.width, width, filter);
        let mut out = vec![0u8; img.height * width * 3];
        for y in 0..img.height {
            let row = &img.data[y * img.width * 3..(y + 1) * img.width * 3];
            for (x, (start, k)) in coeffs.iter().enumerate() {
                for c in 0..3 {
                    let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                    for (i, &w) in k.iter().enumerate() {
                        acc += row[(start + i) * 3 + c] as i64 * w as i64;
                    }
                    out[(y * width + x) * 3 + c] = clip8(acc);
                }
            }
        }
        img = RgbImage {
            width,
            height: img.height,
            data: out,
        };
    }
    if height != img.height {
        let coeffs = coefficients(img.height, height, filter);
        let mut out = vec![0u8; height * img.width * 3];
        for (y, (start, k)) in coeffs.iter().enumerate() {
            for x in 0..img.width * 3 {
                let mut acc: i64 = 1 << (PRECISION_BITS - 1);
                for (i, &w) in k.iter().enumerate() {
                    acc += img.data[(start + i) * img.width * 3 + x] as i64 * w as i64;
                }
                out[y * img.width * 3 + x] = clip8(acc);
            }
        }
        img = RgbImage {
            width: img.width,
            height,
            data: out,
        };
    }
    Ok(img)
}

/// Pillow's nearest-neighbour resize: the source pixel under each output pixel's centre.
fn nearest(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        let sy = (((y as f64 + 0.5) * image.height as f64 / height as f64) as usize)
            .min(image.height - 1);
        for x in 0..width {
            let sx = (((x as f64 + 0.5) * image.width as f64 / width as f64) as usize)
                .min(image.width - 1);
            let at = (sy * image.width + sx) * 3;
            data.extend_from_slice(&image.data[at..at + 3]);
        }
    }
    RgbImage {
        width,
        height,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy_and_constant_images_stay_constant() {
        let img = RgbImage::new(3, 2, (0..18).map(|x| x as u8 * 10).collect()).unwrap();
        assert_eq!(resize(&img, 3, 2, Filter::Lanczos).unwrap(), img);
        let flat = RgbImage::new(5, 7, vec![77; 105]).unwrap();
        for f in [
            Filter::Lanczos,
            Filter::Bicubic,
            Filter::Bilinear,
            Filter::Nearest,
        ] {
            let out = resize(&flat, 9, 4, f).unwrap();
            assert!(out.data.iter().all(|&v| v == 77), "{f:?}");
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(RgbImage::new(0, 4, vec![]).is_err());
        assert!(RgbImage::new(2, 2, vec![0; 11]).is_err());
        let img = RgbImage::new(2, 2, vec![0; 12]).unwrap();
        assert!(resize(&img, 0, 3, Filter::Bicubic).is_err());
    }
}
