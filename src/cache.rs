//! The KV cache of one request in wasm linear memory.
//!
//! `append` mode keeps, for each layer, a key and a value buffer `[rows, kv_heads, capacity,
//! head_dim]` that is handed to the graph as its past (zero-copy: the graph sees the buffer
//! itself); the attention mask hides the free positions of each row. After a step the new
//! positions are copied from the graph's `present` outputs into each row's free positions, in
//! place. The buffer is reallocated only when a row outgrows it ([`GROWTH`] positions more).
//!
//! `grow` mode keeps the graph's `present` outputs as they are: their length is the exact
//! length of every row.

use std::sync::Arc;

use tract_onnx::prelude::*;

use crate::error::{backend, Error, Result};
use crate::model::signature::Dtype;

/// Positions a buffer grows by. An `append` graph attends over the whole buffer at every step
/// (its free positions masked), so the buffer stays within this many positions of the longest
/// row, at the price of one copy of the cache every `GROWTH` steps. Doubling the buffer
/// instead left up to half of it free: SmolLM2 q4 generating 400 tokens in Node took 16.6-17.5
/// s against 17.5-17.6 s and its wasm memory ended 13 MB smaller, when the graph still copied
/// the whole buffer at each step (before `matmul_runtime::past_where_it_lies`; since, the wasm
/// memory ends 6 MB smaller, and the time differs less than the machine's noise).
const GROWTH: usize = 32;

/// One layer's key or value cache tensor.
pub type CacheTensor = Arc<Tensor>;

/// Cache buffers of every layer, with the length of each row.
#[derive(Debug)]
pub struct KvCache {
    pub dtype: Dtype,
    pub heads: usize,
    pub head_dim: usize,
    /// Per layer, `(key, value)`.
    pub layers: Vec<(CacheTensor, CacheTensor)>,
    /// Valid positions of each row.
    pub lengths: Vec<usize>,
    /// Rows in transit during an in-place `reorder`: allocated once, reused at every step.
    scratch: Vec<u8>,
}

impl KvCache {
    /// Empty buffers of `capacity` positions for `rows` rows.
    pub fn new(
        layers: usize,
        rows: usize,
        heads: usize,
        capacity: usize,
        head_dim: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let make = || zeros(dtype, &[rows, heads, capacity, head_dim]).map(Arc::new);
        let layers = (0..layers)
            .map(|_| Ok((make()?, make()?)))
            .collect::<Result<_>>()?;
        Ok(KvCache {
            dtype,
            heads,
            head_dim,
            layers,
            lengths: vec![0; rows],
            scratch: vec![],
        })
    }

    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Positions each row can hold (axis 2 of the buffers).
    pub fn capacity(&self) -> usize {
        self.layers.first().map(|(k, _)| k.shape()[2]).unwrap_or(0)
    }

    /// Make room for `needed` positions per row: the next multiple of [`GROWTH`] positions
    /// when it grows.
    pub fn reserve(&mut self, needed: usize) -> Result<()> {
        let cap = self.capacity();
        if needed <= cap {
            return Ok(());
        }
        let new_cap = needed.next_multiple_of(GROWTH);
        for (k, v) in self.layers.iter_mut() {
            *k = Arc::new(resize_positions(k, new_cap, self.dtype)?);
            *v = Arc::new(resize_positions(v, new_cap, self.dtype)?);
        }
        Ok(())
    }

    /// For the key and the value, each `(present, from)`: copy positions `from..from +
    /// counts[r]` of `present` (shape `[rows, heads, P, dim]`) into row `r` at its length, for
    /// every row.
    pub fn append(
        &mut self,
        layer: usize,
        key: (&Tensor, usize),
        value: (&Tensor, usize),
        counts: &[usize],
    ) -> Result<()> {
        let (k, v) = &mut self.layers[layer];
        for (buf, (present, from)) in [(k, key), (v, value)] {
            let buf = Arc::get_mut(buf).ok_or_else(|| {
                Error::Backend("the KV cache is still borrowed by the graph".into())
            })?;
            match self.dtype {
                Dtype::F32 => copy_rows::<f32>(buf, present, from, &self.lengths, counts)?,
                Dtype::F16 => copy_rows::<f16>(buf, present, from, &self.lengths, counts)?,
            }
        }
        Ok(())
    }

    /// Advance row lengths after every layer was appended.
    pub fn advance(&mut self, counts: &[usize]) {
        for (l, c) in self.lengths.iter_mut().zip(counts) {
            *l += c;
        }
    }

    /// Row `r` becomes the old row `parents[r]`. With the same number of rows (a beam step)
    /// the rows are copied inside the existing buffers: only rows whose parent is another row
    /// move, through a scratch buffer kept between steps. A changing number of rows (expanding
    /// prompts to beams, dropping finished rows) gathers into new buffers.
    pub fn reorder(&mut self, parents: &[usize]) -> Result<()> {
        let rows = self.rows();
        if let Some(&bad) = parents.iter().find(|&&p| p >= rows) {
            return Err(Error::InvalidInput(format!(
                "reorder: parent row {bad} of {rows} rows"
            )));
        }
        let lengths: Vec<usize> = parents.iter().map(|&p| self.lengths[p]).collect();
        for (k, v) in self.layers.iter_mut() {
            reorder_tensor(k, parents, &mut self.scratch)?;
            reorder_tensor(v, parents, &mut self.scratch)?;
        }
        self.lengths = lengths;
        Ok(())
    }
}

/// Row `r` of `t` (axis 0) becomes the old row `parents[r]`, in place when `t` is not shared
/// and the number of rows is unchanged (through `scratch`, reused between calls), else by a
/// gather into a new tensor.
pub fn reorder_tensor(t: &mut Arc<Tensor>, parents: &[usize], scratch: &mut Vec<u8>) -> Result<()> {
    let rows = t.shape().first().copied().unwrap_or(0);
    if let Some(&bad) = parents.iter().find(|&&p| p >= rows) {
        return Err(Error::InvalidInput(format!(
            "reorder: parent row {bad} of {rows} rows"
        )));
    }
    if parents.len() == rows {
        let moves: Vec<(usize, usize)> = parents
            .iter()
            .enumerate()
            .filter(|&(r, &p)| r != p)
            .map(|(r, &p)| (r, p))
            .collect();
        if moves.is_empty() {
            return Ok(());
        }
        if let Some(t) = Arc::get_mut(t) {
            return move_rows(t, &moves, scratch);
        }
    }
    *t = Arc::new(gather_rows(t, parents)?);
    Ok(())
}

/// Row `to` of `t` (axis 0) becomes the old row `from`, for each `(to, from)` of `moves`.
fn move_rows(t: &mut Tensor, moves: &[(usize, usize)], scratch: &mut Vec<u8>) -> Result<()> {
    let rows = t.shape().first().copied().unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    let bytes = t.len() * t.datum_type().size_of() / rows;
    scratch.resize(moves.len() * bytes, 0);
    let data = t.as_bytes_mut();
    for (i, &(_, from)) in moves.iter().enumerate() {
        scratch[i * bytes..(i + 1) * bytes]
            .copy_from_slice(&data[from * bytes..(from + 1) * bytes]);
    }
    for (i, &(to, _)) in moves.iter().enumerate() {
        data[to * bytes..(to + 1) * bytes].copy_from_slice(&scratch[i * bytes..(i + 1) * bytes]);
    }
    Ok(())
}

pub fn zeros(dtype: Dtype, shape: &[usize]) -> Result<Tensor> {
    let dt = match dtype {
        Dtype::F32 => f32::datum_type(),
        Dtype::F16 => f16::datum_type(),
    };
    Tensor::zero_dt(dt, shape).map_err(backend)
}

fn copy_rows<T: Datum + Copy>(
    buf: &mut Tensor,
    present: &Tensor,
    from: usize,
    lengths: &[usize],
    counts: &[usize],
) -> Result<()> {
    let (rows, heads, cap, dim) = dims4(buf)?;
    let (prows, pheads, plen, pdim) = dims4(present)?;
    if prows != rows || pheads != heads || pdim != dim {
        return Err(Error::Backend(format!(
            "present shape {:?} does not match the cache {:?}",
            present.shape(),
            buf.shape()
        )));
    }
    let src = present
        .try_as_plain_ram()
        .map_err(backend)?
        .as_slice::<T>()
        .map_err(backend)?;
    let mut view = buf.try_as_plain_ram_mut().map_err(backend)?;
    let dst = view.as_slice_mut::<T>().map_err(backend)?;
    for r in 0..rows {
        let n = counts[r];
        if n == 0 {
            continue;
        }
        if lengths[r] + n > cap || from + n > plen {
            return Err(Error::Backend(format!(
                "cache row {r}: {} + {n} positions exceed capacity {cap}",
                lengths[r]
            )));
        }
        for h in 0..heads {
            let s = ((r * heads + h) * plen + from) * dim;
            let d = ((r * heads + h) * cap + lengths[r]) * dim;
            dst[d..d + n * dim].copy_from_slice(&src[s..s + n * dim]);
        }
    }
    Ok(())
}

fn dims4(t: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match t.shape() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        s => Err(Error::Backend(format!(
            "expected a 4-D cache tensor, got shape {s:?}"
        ))),
    }
}

/// A copy of `t` with axis 2 resized to `cap` (zero-filled beyond the old positions).
fn resize_positions(t: &Tensor, cap: usize, dtype: Dtype) -> Result<Tensor> {
    let (rows, heads, old, dim) = dims4(t)?;
    let mut out = zeros(dtype, &[rows, heads, cap, dim])?;
    let keep = old.min(cap);
    let bytes = t.datum_type().size_of();
    let src = t.as_bytes();
    let dst = out.as_bytes_mut();
    for rh in 0..rows * heads {
        let s = rh * old * dim * bytes;
        let d = rh * cap * dim * bytes;
        dst[d..d + keep * dim * bytes].copy_from_slice(&src[s..s + keep * dim * bytes]);
    }
    Ok(out)
}

/// Rows `parents` of `t` along axis 0.
pub fn gather_rows(t: &Tensor, parents: &[usize]) -> Result<Tensor> {
    let shape = t.shape().to_vec();
    let row_elems: usize = shape[1..].iter().product();
    let bytes = t.datum_type().size_of() * row_elems;
    let mut new_shape = shape.clone();
    new_shape[0] = parents.len();
    let mut out = Tensor::zero_dt(t.datum_type(), &new_shape).map_err(backend)?;
    let src = t.as_bytes();
    let dst = out.as_bytes_mut();
    for (r, &p) in parents.iter().enumerate() {
        dst[r * bytes..(r + 1) * bytes].copy_from_slice(&src[p * bytes..(p + 1) * bytes]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of `rows` rows whose every value is its row index.
    fn labelled(rows: usize) -> KvCache {
        let mut c = KvCache::new(2, rows, 2, 3, 4, Dtype::F32).unwrap();
        for (k, v) in c.layers.iter_mut() {
            for t in [k, v] {
                let t = Arc::get_mut(t).unwrap();
                let per = t.len() / rows;
                for (i, x) in t.as_bytes_mut().chunks_mut(4).enumerate() {
                    x.copy_from_slice(&((i / per) as f32).to_ne_bytes());
                }
            }
        }
        c.lengths = (0..rows).map(|r| r + 1).collect();
        c
    }

    fn row_labels(c: &KvCache) -> Vec<f32> {
        let t = &c.layers[1].1;
        let per = t.len() / c.rows();
        let b = t.as_bytes();
        (0..c.rows())
            .map(|r| {
                let at = (r * per + per - 1) * 4;
                f32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
            })
            .collect()
    }

    #[test]
    fn reorder_with_the_same_rows_copies_inside_the_buffers() {
        let mut c = labelled(4);
        let before = c.layers[0].0.as_bytes().as_ptr();
        // A swap, a copy and a row that stays.
        c.reorder(&[1, 0, 0, 3]).unwrap();
        assert_eq!(row_labels(&c), vec![1.0, 0.0, 0.0, 3.0]);
        assert_eq!(c.lengths, vec![2, 1, 1, 4]);
        assert_eq!(c.layers[0].0.as_bytes().as_ptr(), before);
        c.reorder(&[3, 3, 2, 1]).unwrap();
        assert_eq!(row_labels(&c), vec![3.0, 3.0, 0.0, 0.0]);
    }

    #[test]
    fn reorder_to_more_or_fewer_rows_gathers() {
        let mut c = labelled(2);
        c.reorder(&[0, 0, 0, 1, 1, 1]).unwrap();
        assert_eq!(row_labels(&c), vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        c.reorder(&[5, 0]).unwrap();
        assert_eq!(row_labels(&c), vec![1.0, 0.0]);
        assert_eq!(c.lengths, vec![2, 1]);
        assert!(c.reorder(&[2]).is_err());
    }
}
