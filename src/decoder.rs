//! The seam between the generation loop and a backend: a step takes the new tokens of each row
//! and returns the logits of each row's last new token; the cache lives behind it.

use std::sync::Arc;

use crate::error::Result;

/// The logits of the last new token of each row, `rows x vocab`, row-major.
///
/// With `bounds` (greedy decoding and sampling with `top_k`, `DecoderState::bound_logits`),
/// some rows hold upper bounds of their logits instead, exact only where `is_exact` says: the
/// loop makes exact only the logits that can win or pass `top_k` (`generate.rs`).
#[derive(Debug, Clone, Default)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
    pub bounds: Option<Bounds>,
}

/// The last layer of a decoder, computing one row's logits from its input (the hidden state):
/// exactly the values of the decoder's full logits.
pub trait Head {
    /// Logit `j` of `hidden`.
    fn logit(&self, hidden: &[f32], j: usize) -> Result<f32>;
    /// Logit `tokens[i]` of `hidden` into `out[i]`, each the value of [`Head::logit`].
    fn some_logits(&self, hidden: &[f32], tokens: &[u32], out: &mut [f32]) -> Result<()> {
        for (&j, out) in tokens.iter().zip(out) {
            *out = self.logit(hidden, j as usize)?;
        }
        Ok(())
    }
    /// Every logit of `hidden` into `out` (`vocab` values).
    fn logits(&self, hidden: &[f32], out: &mut [f32]) -> Result<()>;
}

/// The rows of a `Logits` that hold upper bounds, and what makes their logits exact.
#[derive(Clone)]
pub struct Bounds {
    pub head: Arc<dyn Head>,
    /// Per row: `None` for exact logits; else its hidden state and the tokens whose logit is
    /// exact (the others are upper bounds).
    pub rows: Vec<Option<BoundRow>>,
}

#[derive(Debug, Clone)]
pub struct BoundRow {
    pub hidden: Vec<f32>,
    /// Per token: whether its logit is exact.
    exact: Vec<bool>,
}

impl BoundRow {
    /// A row of `vocab` upper bounds, none exact yet, of the logits of `hidden`.
    pub fn new(hidden: Vec<f32>, vocab: usize) -> BoundRow {
        BoundRow {
            hidden,
            exact: vec![false; vocab],
        }
    }
}

impl std::fmt::Debug for Bounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounds").field("rows", &self.rows).finish()
    }
}

impl Logits {
    /// Exact logits.
    pub fn exact(rows: usize, vocab: usize, data: Vec<f32>) -> Logits {
        Logits {
            rows,
            vocab,
            data,
            bounds: None,
        }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.vocab..(r + 1) * self.vocab]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.vocab..(r + 1) * self.vocab]
    }

    fn bound_row(&self, r: usize) -> Option<&BoundRow> {
        self.bounds.as_ref()?.rows.get(r)?.as_ref()
    }

    /// Whether row `r` holds upper bounds (some of its logits are not exact).
    pub fn is_bounded(&self, r: usize) -> bool {
        self.bound_row(r).is_some()
    }

    /// Whether logit `j` of row `r` is exact.
    pub fn is_exact(&self, r: usize, j: u32) -> bool {
        self.bound_row(r)
            .is_none_or(|b| b.exact.get(j as usize).copied().unwrap_or(false))
    }

    /// Make the logits `tokens` of row `r` exact.
    pub fn make_exact(&mut self, r: usize, tokens: &[u32]) -> Result<()> {
        let vocab = self.vocab;
        let Some(bounds) = self.bounds.as_mut() else {
            return Ok(());
        };
        let Some(Some(row)) = bounds.rows.get_mut(r) else {
            return Ok(());
        };
        let mut todo: Vec<u32> = vec![];
        for &j in tokens {
            if row.exact.get(j as usize) == Some(&false) {
                row.exact[j as usize] = true;
                todo.push(j);
            }
        }
        let mut values = vec![0f32; todo.len()];
        let done = bounds.head.some_logits(&row.hidden, &todo, &mut values);
        for (&j, v) in todo.iter().zip(values) {
            match done {
                Ok(()) => self.data[r * vocab + j as usize] = v,
                Err(_) => row.exact[j as usize] = false,
            }
        }
        done
    }

    /// Make every logit of row `r` exact.
    pub fn make_row_exact(&mut self, r: usize) -> Result<()> {
        let vocab = self.vocab;
        let Some(bounds) = self.bounds.as_mut() else {
            return Ok(());
        };
        if let Some(slot) = bounds.rows.get_mut(r) {
            if let Some(row) = slot.take() {
                bounds
                    .head
                    .logits(&row.hidden, &mut self.data[r * vocab..(r + 1) * vocab])?;
            }
        }
        Ok(())
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
    /// Greedy decoding, or sampling with `top_k`: from now on, a step may return upper bounds of a
    /// row's logits where that reads fewer bytes (`Logits::bounds`). The default returns exact
    /// logits.
    fn bound_logits(&mut self, on: bool) {
        let _ = on;
    }
    /// Whether rows whose lengths differ may run in one step (false: `grow` mode, where rows of
    /// one step must have equal lengths and equal numbers of new tokens).
    fn rows_may_differ(&self) -> bool;
}
