//! `stop_strings`: transformers' `StopStringCriteria`. A row stops when a stop string ends
//! inside its last token: the string may start in earlier tokens (even in the prompt) and the
//! last token may run past its end ("st" + "opper" matches "stop"), but a stop string that
//! lies wholly before the last token does not match (it would have matched earlier).
//!
//! transformers matches the "cleaned" strings of the tokens (`clean_tokenizer_vocab`: each token
//! decoded after the tokens of a fixed text, "abcdef", which is then cut off, so that a
//! SentencePiece token keeps its leading space). Here the last tokens are decoded the same way,
//! after the same fixed tokens (`with_prefix`).

use crate::error::{invalid, Result};

pub struct StopStrings {
    strings: Vec<String>,
    /// Tokens to decode before the last one: enough for the longest stop string.
    window: usize,
    /// Tokens decoded before the window, and the text that ends their decoding.
    prefix: Vec<u32>,
    prefix_text: String,
}

/// transformers' `static_prefix` of `clean_tokenizer_vocab`.
pub const STATIC_PREFIX: &str = "abcdef";

impl StopStrings {
    pub fn new(strings: &[String]) -> Result<Self> {
        if strings.is_empty() {
            return invalid!("`stop_strings` must not be an empty list");
        }
        if strings.iter().any(|s| s.is_empty()) {
            return invalid!("`stop_strings` must not contain an empty string");
        }
        let window = strings.iter().map(|s| s.chars().count()).max().unwrap_or(1);
        Ok(StopStrings {
            strings: strings.to_vec(),
            window,
            prefix: vec![],
            prefix_text: String::new(),
        })
    }

    /// Decode the tokens after `prefix` (the tokenizer's encoding of `STATIC_PREFIX` without
    /// special tokens) and cut the text up to the end of `STATIC_PREFIX`, as transformers'
    /// `clean_tokenizer_vocab` does.
    pub fn with_prefix(mut self, prefix: Vec<u32>) -> Self {
        self.prefix = prefix;
        self.prefix_text = STATIC_PREFIX.to_owned();
        self
    }

    fn text(&self, ids: &[u32], decode: &impl Fn(&[u32]) -> Result<String>) -> Result<String> {
        if self.prefix.is_empty() {
            return decode(ids);
        }
        let mut all = self.prefix.clone();
        all.extend_from_slice(ids);
        let text = decode(&all)?;
        Ok(match text.find(&self.prefix_text) {
            Some(at) => text[at + self.prefix_text.len()..].to_owned(),
            None => decode(ids)?,
        })
    }

    /// Whether a stop string ends inside the last token of `ids`. `decode` turns token ids into
    /// text (the tokenizer's decode).
    pub fn matches(&self, ids: &[u32], decode: impl Fn(&[u32]) -> Result<String>) -> Result<bool> {
        let Some(last) = ids.len().checked_sub(1) else {
            return Ok(false);
        };
        let start = last.saturating_sub(self.window);
        let before = self.text(&ids[start..last], &decode)?;
        let all = self.text(&ids[start..], &decode)?;
        // Where the last token's text begins in `all`.
        let last_start = before
            .bytes()
            .zip(all.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        Ok(self.strings.iter().any(|s| {
            all.match_indices(s.as_str())
                .any(|(at, m)| at + m.len() > last_start)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token i is the string `VOCAB[i]`.
    const VOCAB: [&str; 7] = ["st", "op", "opera", "las", "topper", "stop", "at"];

    fn decode(ids: &[u32]) -> Result<String> {
        Ok(ids.iter().map(|&i| VOCAB[i as usize]).collect())
    }

    fn hit(ids: &[u32]) -> bool {
        StopStrings::new(&["stop".to_string()])
            .unwrap()
            .matches(ids, decode)
            .unwrap()
    }

    #[test]
    fn prefix_tokens_are_decoded_and_cut() {
        // Tokens 7 and 8 decode to "abc" and "def"; a decoder that drops a leading space at
        // the start of the text keeps it after the prefix.
        let decode = |ids: &[u32]| -> Result<String> {
            let s: String = ids
                .iter()
                .map(|&i| match i {
                    7 => "abc",
                    8 => "def",
                    _ => " s",
                })
                .collect();
            Ok(s.strip_prefix(' ').unwrap_or(&s).to_owned())
        };
        let plain = StopStrings::new(&[" s".to_string()]).unwrap();
        assert!(!plain.matches(&[0], decode).unwrap());
        let prefixed = plain.with_prefix(vec![7, 8]);
        assert!(prefixed.matches(&[0], decode).unwrap());
    }

    #[test]
    fn matches_when_the_stop_string_overlaps_the_last_token() {
        assert!(hit(&[0, 1])); // st op
        assert!(hit(&[5])); // stop
        assert!(hit(&[0, 2])); // st opera
        assert!(hit(&[3, 4])); // las topper
        assert!(!hit(&[5, 6])); // stop at: ended before the last token
        assert!(!hit(&[0, 1, 6]));
        assert!(!hit(&[0]));
        assert!(!hit(&[]));
        assert!(StopStrings::new(&[String::new()]).is_err());
    }
}
