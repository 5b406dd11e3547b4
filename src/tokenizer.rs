//! Text in and out: the `tokenizers` crate over `tokenizer.json`, and incremental
//! detokenization for streaming (text deltas that concatenate to the final text, holding back
//! the bytes of a character split over several tokens).

use crate::error::{Error, Result};

/// A tokenizer whose model is BPE (`Tokenizer::from_bytes`).
type BpeTokenizer = tokenizers::TokenizerImpl<
    tokenizers::models::bpe::BPE,
    tokenizers::NormalizerWrapper,
    tokenizers::PreTokenizerWrapper,
    tokenizers::PostProcessorWrapper,
    tokenizers::DecoderWrapper,
>;

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer(vocab {})", self.vocab_size())
    }
}

impl Tokenizer {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        // A BPE model (most decoders') is read as a `TokenizerImpl<BPE, ..>`: serde then reads
        // the model's fields straight from the JSON. `tokenizers::Tokenizer` reads every model
        // through `ModelWrapper`'s untagged enum, which holds the whole model (vocabulary and
        // merges) in serde's `Content`, then in a `serde_json::Value`, before `BPE` reads it:
        // SmolLM2's tokenizer loaded in 316 ms in a Node profile that way, 207 ms this way. The
        // same `BPE` deserializer runs either way; other models (and a file that is no BPE)
        // take the general path.
        let inner = match serde_json::from_slice::<BpeTokenizer>(bytes) {
            Ok(bpe) => tokenizers::Tokenizer::from(bpe),
            Err(_) => tokenizers::Tokenizer::from_bytes(bytes)
                .map_err(|e| Error::Tokenizer(format!("tokenizer.json could not be read: {e}")))?,
        };
        Ok(Tokenizer { inner })
    }

    /// Vocabulary size including added tokens: every id the tokenizer can produce is below it.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encode text as transformers' tokenizer call does by default (`add_special_tokens=True`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("could not encode the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode as transformers' `decode(ids, skip_special_tokens=True)`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("could not decode tokens {ids:?}: {e}")))
    }

    /// Decode keeping special tokens (`skip_special_tokens=False`): the text stop strings are
    /// matched against, as transformers' `StopStringCriteria` sees special tokens' text too.
    pub fn decode_with_special_tokens(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(format!("could not decode tokens {ids:?}: {e}")))
    }

    /// Whether `id` is a byte-fallback token such as `<0xE6>`.
    pub fn is_byte_token(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| {
            let b = t.as_bytes();
            b.len() == 6
                && b.starts_with(b"<0x")
                && b[5] == b'>'
                && b[3..5].iter().all(u8::is_ascii_hexdigit)
        })
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// Turns a growing list of token ids into text deltas. The deltas, concatenated, equal the
/// decoding of all the ids: text is released only once the decoding of the ids so far extends
/// what was released and does not end in a replacement character (a UTF-8 character whose
/// bytes are split over several byte-fallback or byte-level tokens).
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    released: String,
    text: String,
}

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a token; returns the text that became certain (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.text = tokenizer.decode(&self.ids)?;
        // Hold back an incomplete character, and the run of byte-fallback tokens (`<0xE6>`):
        // the decoder turns the whole run into replacement characters when it ends invalid, so
        // its text is known only when the run ends.
        if self.text.ends_with('\u{FFFD}') || tokenizer.is_byte_token(id) {
            return Ok(String::new());
        }
        Ok(self.release())
    }

    /// The rest of the text, at the end of the sequence (a trailing incomplete character is
    /// released as the replacement character, as the full decoding has it).
    pub fn finish(&mut self) -> String {
        self.release()
    }

    /// The decoding of all ids pushed so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn release(&mut self) -> String {
        match self.text.strip_prefix(self.released.as_str()) {
            Some(rest) => {
                let delta = rest.to_owned();
                self.released.push_str(&delta);
                delta
            }
            // The decoding changed text already released (a tokenizer clean-up rule): hold
            // until it extends the released text again.
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(model: &str) -> Vec<u8> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
        std::fs::read(dir.join(model).join("tokenizer.json")).unwrap()
    }

    /// The BPE path gives the tokenizer the general path gives (compared as serialized), and
    /// a Unigram model takes the general path.
    #[test]
    fn bpe_tokenizers_load_as_the_general_path_does() {
        for model in ["llama", "gpt2", "whisper-tiny", "t5"] {
            let bytes = fixture(model);
            let bpe = serde_json::from_slice::<BpeTokenizer>(&bytes).is_ok();
            assert_eq!(bpe, model != "t5", "{model}");
            let general = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
            let loaded = Tokenizer::from_bytes(&bytes).unwrap();
            assert_eq!(
                loaded.inner.to_string(false).unwrap(),
                general.to_string(false).unwrap(),
                "{model}"
            );
            let text = "Hello, world! <s> 12 naïve";
            assert_eq!(
                loaded.encode(text, true).unwrap(),
                general.encode(text, true).unwrap().get_ids(),
                "{model}"
            );
        }
    }

    #[test]
    fn a_file_that_is_no_tokenizer_is_an_error() {
        let e = Tokenizer::from_bytes(br#"{"model": {"type": "BPE"}}"#).unwrap_err();
        assert!(
            e.to_string().contains("tokenizer.json could not be read"),
            "{e}"
        );
    }
}
