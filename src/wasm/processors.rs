//! Custom logits processors written in JavaScript: the `logits_processor` option of `generate`,
//! a list of functions `(tokenIds: Uint32Array, logits: Float32Array) => void | Float32Array`.
//! Each function is one core `LogitsProcessor`, so it runs where the core runs custom
//! processors (after `begin_suppress_tokens`, before the sampling warpers), once per row per
//! step.

use std::cell::RefCell;
use std::rc::Rc;

use js_sys::{Array, Float32Array, Function, Uint32Array};
use wasm_bindgen::{JsCast, JsValue};

use crate::error::{Error, Result};
use crate::processors::{LogitsProcessor, RowContext};

/// The option's name, as transformers' `generate(logits_processor=...)` names it.
pub const OPTION: &str = "logits_processor";

/// The exception a processor threw, kept for the `cause` of the request's error.
pub type Thrown = Rc<RefCell<Option<JsValue>>>;

/// One JavaScript function as a logits processor.
struct JsProcessor {
    index: usize,
    function: Function,
    thrown: Thrown,
}

impl LogitsProcessor for JsProcessor {
    fn process(&mut self, ctx: &RowContext, scores: &mut [f32]) -> Result<()> {
        let name = format!("`{OPTION}` {}", self.index);
        // Copies, not views of wasm memory: the function may keep them, and a view would be
        // detached if the function made the wasm memory grow.
        let ids = Uint32Array::from(ctx.ids);
        let logits = Float32Array::from(&*scores);
        let returned = match self.function.call2(&JsValue::UNDEFINED, &ids, &logits) {
            Ok(v) => v,
            Err(e) => {
                let message = thrown_message(&e);
                *self.thrown.borrow_mut() = Some(e);
                return Err(Error::InvalidInput(format!(
                    "{name} threw at row {} ({} tokens): {message}",
                    ctx.row,
                    ctx.ids.len()
                )));
            }
        };
        let (result, what) = if returned.is_undefined() || returned.is_null() {
            (logits, "left the logits array (edited in place) with")
        } else {
            match returned.dyn_into::<Float32Array>() {
                Ok(a) => (a, "returned a Float32Array of"),
                Err(v) => {
                    return Err(Error::InvalidInput(format!(
                        "{name} returned a {}; expected a Float32Array of length {}, or nothing \
                         to keep the edits made in place",
                        kind(&v),
                        scores.len()
                    )))
                }
            }
        };
        // A returned array of another length, or the in-place array detached by a transfer.
        if result.length() as usize != scores.len() {
            return Err(Error::InvalidInput(format!(
                "{name} {what} length {}; expected length {} (one score per token)",
                result.length(),
                scores.len()
            )));
        }
        result.copy_to(scores);
        Ok(())
    }
}

/// The processors of the option's value: a function or a list of functions (`undefined` or
/// `null`: none). `thrown` receives the exception of a processor that throws.
pub fn parse(value: &JsValue, thrown: &Thrown) -> Result<Vec<Box<dyn LogitsProcessor>>> {
    if value.is_undefined() || value.is_null() {
        return Ok(vec![]);
    }
    let functions: Vec<JsValue> = match value.dyn_ref::<Array>() {
        Some(list) => list.iter().collect(),
        None if value.is_function() => vec![value.clone()],
        None => {
            return Err(Error::InvalidInput(format!(
                "`{OPTION}` must be a list of functions (tokenIds, logits) => void | \
                 Float32Array, got a {}",
                kind(value)
            )))
        }
    };
    functions
        .into_iter()
        .enumerate()
        .map(|(index, f)| match f.dyn_into::<Function>() {
            Ok(function) => Ok(Box::new(JsProcessor {
                index,
                function,
                thrown: thrown.clone(),
            }) as Box<dyn LogitsProcessor>),
            Err(v) => Err(Error::InvalidInput(format!(
                "`{OPTION}` {index} must be a function (tokenIds, logits) => void | \
                 Float32Array, got a {}",
                kind(&v)
            ))),
        })
        .collect()
}

/// The message of a thrown value: an Error's `message`, or the value as a string.
fn thrown_message(e: &JsValue) -> String {
    match e.dyn_ref::<js_sys::Error>() {
        Some(error) => String::from(error.message()),
        None => e.as_string().unwrap_or_else(|| format!("{e:?}")),
    }
}

/// What a value is, for messages: `number`, `string`, `array`, `Int32Array`, `object`, ...
fn kind(v: &JsValue) -> String {
    if v.is_null() {
        return "null".into();
    }
    if Array::is_array(v) {
        return "plain array".into();
    }
    if v.is_object() && !v.is_function() {
        let name = js_sys::Reflect::get(v, &"constructor".into())
            .ok()
            .and_then(|c| js_sys::Reflect::get(&c, &"name".into()).ok())
            .and_then(|n| n.as_string());
        if let Some(name) = name.filter(|n| n != "Object") {
            return name;
        }
    }
    v.js_typeof().as_string().unwrap_or_default()
}
