//! `stop_strings`: transformers' `StopStringCriteria`. A row stops when a stop string ends
//! inside its last token: the string may start in earlier tokens (even in the prompt) and the
//! last token may run past its end ("st" + "opper" matches "stop"), but a stop string that
//! lies wholly before the last token does not match (it would have matched earlier).
//!
//! transformers matches the cleaned vocabulary strings of the tokens; here the text is the
//! tokenizer's decoding of the last tokens, which is the same text for the usual tokenizers.

use crate::error::{invalid, Result};

pub struct StopStrings {
    strings: Vec<String>,
    /// Tokens to decode before the last one: enough for the longest stop string.
    window: usize,
}

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
        })
    }

    /// Whether a stop string ends inside the last token of `ids`. `decode` turns token ids into
    /// text (the tokenizer's decode).
    pub fn matches(&self, ids: &[u32], decode: impl Fn(&[u32]) -> Result<String>) -> Result<bool> {
        let Some(last) = ids.len().checked_sub(1) else {
            return Ok(false);
        };
        let start = last.saturating_sub(self.window);
        let before = decode(&ids[start..last])?;
        let all = decode(&ids[start..])?;
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
