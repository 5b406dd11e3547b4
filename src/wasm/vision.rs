//! Images in the JavaScript API: `generate(input, {image_features, position_ids,
//! image_grid_thw})` for prompts whose image tokens are already expanded, and chat messages
//! whose content parts `{type: "image", image}` carry an `ImageData`, an `ImageBitmap` or `{data, width, height}`
//! (RGBA bytes): the images go through the model's image processor and vision encoder and the
//! chat template places the image tokens.

use js_sys::{Array, Object, Reflect, Uint8Array};
use wasm_bindgen::prelude::*;

use crate::vision::resize::RgbImage;
use crate::vision::{Features, ImageInputs, PositionIds};

use super::{describe, get, image_pixels, invalid, js_error, prompts_of, render_chat, Loaded};

/// Request options that are image inputs, not generation_config.json fields.
pub(super) const OPTION_NAMES: &[&str] = &[
    "image_features",
    "position_ids",
    "image_grid_thw",
    "processor_options",
];

/// The prompts of `input` and the image inputs of the request.
pub(super) fn prompts_and_images(
    inner: &Loaded,
    input: &JsValue,
    options: &JsValue,
) -> Result<(Vec<Vec<u32>>, ImageInputs), JsValue> {
    if let Some(messages) = chat_with_images(input)? {
        let (stripped, images) = messages;
        let text = render_chat(inner, &stripped, true)?;
        let overrides = match get(options, "processor_options") {
            v if v.is_undefined() || v.is_null() => serde_json::Map::new(),
            v => json_object(&v, "processor_options")?,
        };
        return inner
            .model
            .image_prompts(&[text], &[images], false, &overrides)
            .map_err(js_error);
    }
    let prompts = prompts_of(inner, input)?;
    Ok((prompts, image_inputs(options)?))
}

fn json_object(
    v: &JsValue,
    name: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, JsValue> {
    let text = js_sys::JSON::stringify(v)?.as_string().unwrap_or_default();
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(invalid(format!(
            "`{name}` must be an object, got {}",
            describe(v)
        ))),
    }
}

/// Chat messages with image parts: the messages with each part's `image` removed (the template
/// only needs `{type: "image"}`), and the images in order. `None`: not chat, or no images.
fn chat_with_images(input: &JsValue) -> Result<Option<(JsValue, Vec<RgbImage>)>, JsValue> {
    let Some(list) = input.dyn_ref::<Array>() else {
        return Ok(None);
    };
    let first = list.get(0);
    if !first.is_object() || Array::is_array(&first) {
        return Ok(None);
    }
    let mut images = vec![];
    let out = Array::new();
    for (m, message) in list.iter().enumerate() {
        let content = get(&message, "content");
        let Some(parts) = content.dyn_ref::<Array>() else {
            out.push(&message);
            continue;
        };
        let new_parts = Array::new();
        for (i, part) in parts.iter().enumerate() {
            let is_image = get(&part, "type").as_string().as_deref() == Some("image");
            let image = get(&part, "image");
            if is_image && !image.is_undefined() {
                images.push(rgb_image(&image).map_err(|e| {
                    invalid(format!("message {m}, content part {i}: {}", message_of(&e)))
                })?);
                let copy = Object::new();
                Reflect::set(&copy, &"type".into(), &"image".into())?;
                new_parts.push(&copy);
            } else {
                new_parts.push(&part);
            }
        }
        let copy = Object::assign(&Object::new(), message.unchecked_ref());
        Reflect::set(&copy, &"content".into(), &new_parts)?;
        out.push(&copy);
    }
    Ok((!images.is_empty()).then(|| (out.into(), images)))
}

fn message_of(e: &JsValue) -> String {
    get(e, "message").as_string().unwrap_or_else(|| describe(e))
}

/// An `ImageData`, an `ImageBitmap` (read back through an OffscreenCanvas) or `{data, width,
/// height}` with RGBA bytes (or RGB bytes, 3 per pixel).
fn rgb_image(v: &JsValue) -> Result<RgbImage, JsValue> {
    let v = &image_pixels(v)?;
    let width = get(v, "width").as_f64();
    let height = get(v, "height").as_f64();
    let data = get(v, "data");
    let (Some(width), Some(height)) = (width, height) else {
        return Err(invalid(format!(
            "an image must be an ImageData, an ImageBitmap or {{data, width, height}} with RGBA \
             bytes, got {}",
            describe(v)
        )));
    };
    if !(width >= 0.0 && height >= 0.0 && width.fract() == 0.0 && height.fract() == 0.0) {
        return Err(invalid(format!("an image of {width}x{height} pixels")));
    }
    let (w, h) = (width as usize, height as usize);
    if w == 0 || h == 0 {
        return Err(invalid(format!(
            "an image of {w}x{h} pixels: width and height must be positive"
        )));
    }
    if !data.is_object() {
        return Err(invalid(format!(
            "an image's `data` must be bytes (Uint8Array or Uint8ClampedArray), got {}",
            describe(&data)
        )));
    }
    let bytes = Uint8Array::new(&data).to_vec();
    if bytes.len() == w * h * 3 {
        return RgbImage::new(w, h, bytes).map_err(js_error);
    }
    RgbImage::from_rgba(w, h, &bytes).map_err(js_error)
}

/// `image_features` (a `{data, dims: [rows, hidden]}` tensor, e.g. transformers.js', or a list
/// of rows), `position_ids` (one entry per prompt: a list of positions, or 3 lists for M-RoPE)
/// and `image_grid_thw` (`[t, h, w]` per image).
pub(super) fn image_inputs(options: &JsValue) -> Result<ImageInputs, JsValue> {
    if options.is_undefined() || options.is_null() {
        return Ok(ImageInputs::default());
    }
    let mut inputs = ImageInputs::default();
    let features = get(options, "image_features");
    if !(features.is_undefined() || features.is_null()) {
        inputs.image_features = Some(features_of(&features)?);
    }
    let positions = get(options, "position_ids");
    if !(positions.is_undefined() || positions.is_null()) {
        let Some(list) = positions.dyn_ref::<Array>() else {
            return Err(invalid(format!(
                "`position_ids` must be a list with one entry per prompt, got {}",
                describe(&positions)
            )));
        };
        let mut all = vec![];
        for (p, entry) in list.iter().enumerate() {
            let axes: Vec<Vec<i64>> = match entry.dyn_ref::<Array>() {
                Some(a) if Array::is_array(&a.get(0)) => a
                    .iter()
                    .map(|axis| numbers(&axis, &format!("position_ids[{p}]")))
                    .collect::<Result<_, _>>()?,
                Some(_) => vec![numbers(&entry, &format!("position_ids[{p}]"))?],
                None => {
                    return Err(invalid(format!(
                        "position_ids[{p}] must be a list of positions (or 3 lists), got {}",
                        describe(&entry)
                    )))
                }
            };
            let len = axes.first().map(|a| a.len()).unwrap_or(0);
            if axes.iter().any(|a| a.len() != len) {
                return Err(invalid(format!(
                    "position_ids[{p}]: its axes have different lengths"
                )));
            }
            all.push(PositionIds::new(axes.len(), len, axes.concat()).map_err(js_error)?);
        }
        inputs.position_ids = Some(all);
    }
    let grids = get(options, "image_grid_thw");
    if !(grids.is_undefined() || grids.is_null()) {
        let Some(list) = grids.dyn_ref::<Array>() else {
            return Err(invalid(format!(
                "`image_grid_thw` must be a list of [t, h, w], got {}",
                describe(&grids)
            )));
        };
        let mut all = vec![];
        for (i, g) in list.iter().enumerate() {
            let v = numbers(&g, &format!("image_grid_thw[{i}]"))?;
            let [t, h, w] = v[..] else {
                return Err(invalid(format!("image_grid_thw[{i}] must be [t, h, w]")));
            };
            if t < 0 || h < 0 || w < 0 {
                return Err(invalid(format!("image_grid_thw[{i}] must be non-negative")));
            }
            all.push([t as usize, h as usize, w as usize]);
        }
        inputs.image_grid_thw = Some(all);
    }
    Ok(inputs)
}

fn numbers(v: &JsValue, name: &str) -> Result<Vec<i64>, JsValue> {
    let Some(a) = v.dyn_ref::<Array>() else {
        return Err(invalid(format!(
            "{name} must be a list of integers, got {}",
            describe(v)
        )));
    };
    a.iter()
        .enumerate()
        .map(|(i, x)| match x.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(f as i64),
            _ => Err(invalid(format!(
                "{name}[{i}] must be an integer, got {}",
                describe(&x)
            ))),
        })
        .collect()
}

fn features_of(v: &JsValue) -> Result<Features, JsValue> {
    if let Some(rows) = v.dyn_ref::<Array>() {
        let rows: Vec<JsValue> = rows.iter().collect();
        let hidden = rows
            .first()
            .and_then(|r| r.dyn_ref::<Array>().map(|a| a.length() as usize))
            .unwrap_or(0);
        let mut data = Vec::with_capacity(rows.len() * hidden);
        for (r, row) in rows.iter().enumerate() {
            let Some(a) = row.dyn_ref::<Array>() else {
                return Err(invalid(format!(
                    "image_features[{r}] must be a list of numbers"
                )));
            };
            if a.length() as usize != hidden {
                return Err(invalid(format!(
                    "image_features[{r}] has {} values; row 0 has {hidden}",
                    a.length()
                )));
            }
            for x in a.iter() {
                data.push(
                    x.as_f64()
                        .ok_or_else(|| invalid(format!("image_features[{r}] must hold numbers")))?
                        as f32,
                );
            }
        }
        return Features::new(rows.len(), hidden, data).map_err(js_error);
    }
    let data = get(v, "data");
    let dims = get(v, "dims");
    let dims: Vec<i64> = numbers(&dims, "image_features.dims").map_err(|_| {
        invalid(format!(
            "`image_features` must be a tensor {{data: Float32Array, dims: [rows, hidden]}} or a \
             list of rows, got {}",
            describe(v)
        ))
    })?;
    // [rows, hidden], or SmolVLM's [tiles, tokens per tile, hidden].
    let (Some(&hidden), true) = (dims.last(), dims.len() >= 2) else {
        return Err(invalid(format!(
            "image_features.dims must be [rows, hidden], got {dims:?}"
        )));
    };
    let rows: i64 = dims[..dims.len() - 1].iter().product();
    let Some(array) = data.dyn_ref::<js_sys::Float32Array>() else {
        return Err(invalid(format!(
            "image_features.data must be a Float32Array, got {}",
            describe(&data)
        )));
    };
    Features::new(rows.max(0) as usize, hidden.max(0) as usize, array.to_vec()).map_err(js_error)
}
