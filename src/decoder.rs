//! The seam between the generation loop and a backend: a step takes the new tokens of each row
//! and returns the logits of each row's last new token; the cache lives behind it.

use crate::error::Result;

/// The logits of the last new token of each row, `rows x vocab`, row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.vocab..(r + 1) * self.vocab]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.vocab..(r + 1) * self.vocab]
    }
}

/// A compiled decoder, shared by every request on the model.
pub trait Decoder {
    /// Width of the logits.
    fn vocab_size(&self) -> usize;
    /// A fresh cache for `rows` rows, sized for `capacity` positions per row (a hint: it grows).
    fn start(&self, rows: usize, capacity: usize) -> Result<Box<dyn DecoderState>>;
}

/// The per-request state of a decoder: the KV cache of every row.
pub trait DecoderState {
    /// Run one step: `tokens[r]` are the new tokens of row `r` (empty: the row sits this step
    /// out; its cache is untouched and its logits row is unspecified). Returns one logits row
    /// per cache row: that of the row's last new token.
    fn step(&mut self, tokens: &[&[u32]]) -> Result<Logits>;
    /// Row `r` of the cache becomes a copy of the old row `parents[r]` (beam reordering, batch
    /// expansion or compaction: the number of rows may change).
    fn reorder(&mut self, parents: &[usize]) -> Result<()>;
    /// Number of cached positions of each row.
    fn lengths(&self) -> &[usize];
    /// Whether a step of `rows` rows runs without compiling anything new. tract compiles one
    /// plan per batch size (seconds for a real model, against a fraction of a second per step),
    /// so the loop drops finished rows from the batch only into sizes that are ready.
    fn is_ready_for(&self, rows: usize) -> bool {
        let _ = rows;
        true
    }
    /// Whether rows whose lengths differ may run in one step (false: `grow` mode, where rows of
    /// one step must have equal lengths and equal numbers of new tokens).
    fn rows_may_differ(&self) -> bool;
}
