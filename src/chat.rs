//! Chat templates: render `[{role, content}, ...]` with a model's Jinja chat template as
//! transformers' `apply_chat_template` does (4.57, `utils/chat_template_utils.py`):
//! `trim_blocks` and `lstrip_blocks` on, loop controls, `raise_exception`, a `tojson` that
//! writes as Python's `json.dumps(ensure_ascii=False)`, the special tokens of
//! `tokenizer_config.json` as variables, and `add_generation_prompt`. The rendered text is then
//! tokenized without adding special tokens (the template writes them).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use crate::error::{invalid, Error, Result};

/// A compiled chat template with the special-token variables it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({:?})", self.special_tokens)
    }
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compile a template; `special_tokens` are variables such as `("bos_token", "<s>")`.
    pub fn new(source: &str, special_tokens: Vec<(String, String)>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| Error::Model(format!("the chat template does not compile: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            special_tokens,
        })
    }

    /// The template of a model folder: `chat_template.jinja` when present (as transformers
    /// 4.57 prefers it), else the `chat_template` field of `tokenizer_config.json` (a string,
    /// or a list of `{name, template}` of which `default` is used). The special tokens come
    /// from `tokenizer_config.json`. `Ok(None)`: the model has no chat template.
    pub fn from_files(
        chat_template_jinja: Option<&[u8]>,
        tokenizer_config: Option<&[u8]>,
    ) -> Result<Option<ChatTemplate>> {
        let config: Json = match tokenizer_config {
            Some(bytes) => serde_json::from_slice(bytes).map_err(|e| {
                Error::Model(format!("tokenizer_config.json is not valid JSON: {e}"))
            })?,
            None => Json::Null,
        };
        let source = match chat_template_jinja {
            Some(bytes) => Some(
                std::str::from_utf8(bytes)
                    .map_err(|e| {
                        Error::Model(format!("chat_template.jinja is not UTF-8 text: {e}"))
                    })?
                    .to_owned(),
            ),
            None => template_of_config(&config)?,
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let special_tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .iter()
            .filter_map(|name| {
                let v = config.get(name)?;
                let text = v
                    .as_str()
                    .or_else(|| v.get("content").and_then(Json::as_str))?;
                Some((name.to_string(), text.to_owned()))
            })
            .collect();
        ChatTemplate::new(&source, special_tokens).map(Some)
    }

    /// Render a conversation given as JSON text: a list of messages, each an object with at
    /// least `role` and `content` (key order is kept, as Python's dicts keep it).
    pub fn render_json(&self, messages_json: &str, add_generation_prompt: bool) -> Result<String> {
        let messages: Value = serde_json::from_str(messages_json)
            .map_err(|e| Error::InvalidInput(format!("chat messages are not valid JSON: {e}")))?;
        self.render(messages, add_generation_prompt)
    }

    /// Render `(role, content)` messages.
    pub fn render_pairs(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let list: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                Value::from_iter([
                    ("role", Value::from(*role)),
                    ("content", Value::from(*content)),
                ])
            })
            .collect();
        self.render(Value::from(list), add_generation_prompt)
    }

    fn render(&self, messages: Value, add_generation_prompt: bool) -> Result<String> {
        check_messages(&messages)?;
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::Model(format!("the chat template is missing: {e}")))?;
        let mut ctx: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages".into(), messages));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        template
            .render(Value::from_iter(ctx))
            .map_err(|e| Error::InvalidInput(format!("the chat template failed: {e:#}")))
    }
}

/// The `chat_template` field of `tokenizer_config.json`.
fn template_of_config(config: &Json) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let named = |name: &str| {
                list.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == name)
                        .then(|| t.get("template")?.as_str().map(str::to_owned))?
                })
            };
            Ok(named("default"))
        }
        Some(other) => Err(Error::Model(format!(
            "tokenizer_config.json: `chat_template` must be a string or a list of \
             {{name, template}}, got {other}"
        ))),
    }
}

/// Messages must be a list of objects with a string `role` and a `content`.
fn check_messages(messages: &Value) -> Result<()> {
    if messages.kind() != ValueKind::Seq {
        return invalid!("chat messages must be a list of {{role, content}} objects");
    }
    let len = messages.len().unwrap_or(0);
    if len == 0 {
        return invalid!("the chat has no message");
    }
    for i in 0..len {
        let m = messages.get_item_by_index(i).unwrap_or_default();
        if m.kind() != ValueKind::Map {
            return invalid!(
                "chat message {i} must be an object with `role` and `content`, got {m}"
            );
        }
        let role = m.get_attr("role").unwrap_or_default();
        if role.kind() != ValueKind::String {
            return invalid!("chat message {i} needs a string `role`, got {role}");
        }
        if m.get_attr("content").map_or(true, |c| c.is_undefined()) {
            return invalid!("chat message {i} has no `content`");
        }
    }
    Ok(())
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(out)
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    // Python's separators: ", " and ": " without indent; "," and newlines with it.
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => write_json_string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json_string(&key.to_string(), out);
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize {v}"),
            ))
        }
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/chat")
            .join(name)
    }

    /// Renders the conversations of a golden file (written by transformers'
    /// `apply_chat_template`, see `make_chat_golden.py`) and compares the text.
    fn check_golden(golden: &str) {
        let g: Json = serde_json::from_slice(&std::fs::read(fixture(golden)).unwrap()).unwrap();
        let source = std::fs::read_to_string(fixture(g["template"].as_str().unwrap())).unwrap();
        let tokens = ["bos_token", "eos_token"]
            .iter()
            .map(|k| (k.to_string(), g[k].as_str().unwrap().to_string()))
            .collect();
        let t = ChatTemplate::new(&source, tokens).unwrap();
        let cases = g["cases"].as_array().unwrap();
        assert!(!cases.is_empty());
        for case in cases {
            let messages = serde_json::to_string(&case["messages"]).unwrap();
            let add = case["add_generation_prompt"].as_bool().unwrap();
            let text = t.render_json(&messages, add).unwrap();
            assert_eq!(
                text,
                case["text"].as_str().unwrap(),
                "{golden}: {messages} {add}"
            );
        }
    }

    #[test]
    fn smollm2_template_matches_transformers() {
        check_golden("smollm2.json");
    }

    #[test]
    fn template_features_match_transformers() {
        check_golden("features.json");
    }

    #[test]
    fn smollm2_chat_ids_match_transformers() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".realmodels/smollm2/tjs");
        let Ok(tokenizer) = std::fs::read(dir.join("tokenizer.json")) else {
            eprintln!("SKIPPED smollm2_chat_ids_match_transformers: .realmodels/smollm2 is absent");
            return;
        };
        let tokenizer = crate::Tokenizer::from_bytes(&tokenizer).unwrap();
        let t = ChatTemplate::from_files(
            Some(&std::fs::read(dir.join("chat_template.jinja")).unwrap()),
            Some(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()),
        )
        .unwrap()
        .unwrap();
        let g: Json =
            serde_json::from_slice(&std::fs::read(fixture("smollm2.json")).unwrap()).unwrap();
        for case in g["cases"].as_array().unwrap() {
            let messages = serde_json::to_string(&case["messages"]).unwrap();
            let text = t
                .render_json(&messages, case["add_generation_prompt"].as_bool().unwrap())
                .unwrap();
            let ids = tokenizer.encode(&text, false).unwrap();
            let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(ids, expected);
        }
    }

    #[test]
    fn template_from_tokenizer_config_and_errors() {
        let config = br#"{"bos_token": {"content": "<s>"}, "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}]}"#;
        let t = ChatTemplate::from_files(None, Some(config))
            .unwrap()
            .unwrap();
        assert_eq!(t.render_pairs(&[("user", "hi")], true).unwrap(), "<s>hi");
        assert!(ChatTemplate::from_files(None, Some(b"{}"))
            .unwrap()
            .is_none());
        let e = t.render_json(r#"[{"content": "x"}]"#, true).unwrap_err();
        assert!(e.to_string().contains("`role`"), "{e}");
        let e = t.render_json("[]", true).unwrap_err();
        assert!(e.to_string().contains("no message"), "{e}");
        let raising = ChatTemplate::new("{{ raise_exception('no system role') }}", vec![]).unwrap();
        let e = raising.render_pairs(&[("user", "hi")], true).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        let e = ChatTemplate::new("{% for %}", vec![]).unwrap_err();
        assert!(e.to_string().contains("chat template"), "{e}");
    }
}
