//! Splitting a matmul's output columns across threads (the `threads` feature: rayon's global
//! pool, in wasm the workers of `initThreadPool`). Every output value is computed by the same
//! code on the same inputs whichever thread runs it, so the results are bit-identical to one
//! thread. Without the feature, or for small products, the kernel runs once over every column,
//! in place.
//!
//! The calling thread computes the first range itself and the pool's workers the others
//! (`rayon::in_place_scope`): in a browser the page's thread may not sleep, so while it waits
//! for the pool it spins (rayon's `web_spin_lock`); working instead, `initThreadPool(1)` already
//! gives two threads of work on two cores. (For the same reason tract-linalg's rayon executor
//! (`multithread-mm`, `RayonGlobal`), which hands each whole product to the pool and spins
//! meanwhile, is not used: fp32 SmolLM2 decoded at 0.6x the one-thread speed with it in
//! Chromium. tract's remaining matmuls (an encoder's products of runtime operands) stay on one
//! thread.)

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Multiply-accumulates below which a product runs on one thread by default: waking the pool
/// costs more (tens of microseconds in wasm) than it saves.
pub const MIN_PARALLEL_MACS: usize = 1 << 18;

static THRESHOLD: AtomicUsize = AtomicUsize::new(MIN_PARALLEL_MACS);

/// Sets the multiply-accumulates from which a product is split across the threads (default
/// [`MIN_PARALLEL_MACS`]; 0 splits every product, as the tests of the threads build do).
pub fn set_threshold(macs: usize) {
    THRESHOLD.store(macs, Ordering::Relaxed);
}

/// Threads that compute a product: the pool's workers and the calling thread, unless it is one
/// of them (1 without the `threads` feature). In wasm without `initThreadPool`, rayon's global
/// pool is the calling thread alone: 1.
pub fn threads() -> usize {
    #[cfg(feature = "threads")]
    {
        let pool = rayon::current_num_threads();
        if rayon::current_thread_index().is_some() {
            pool
        } else {
            pool + 1
        }
    }
    #[cfg(not(feature = "threads"))]
    {
        1
    }
}

/// Column ranges of `0..n`, one per part, each a multiple of `align` long but the last.
pub fn ranges(n: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let units = n.div_ceil(align);
    let parts = parts.clamp(1, units.max(1));
    let per = units.div_ceil(parts) * align;
    (0..n)
        .step_by(per.max(1))
        .map(|s| s..(s + per).min(n))
        .collect()
}

/// Fills `out` (`[rows, n]`, zeroed: f32 sums, or `matmul_integer`'s int32 sums) with
/// `kernel(cols, block)`, where `block` is `[rows, cols.len()]` (zeroed) and receives columns
/// `cols` of the output. The columns are split in
/// `parts` ranges (multiples of `align` columns, so that kernels grouping `align` columns
/// compute each column the same way whatever the split) run in parallel; one part runs the
/// kernel on `out` itself.
pub fn by_columns<T, F>(out: &mut [T], rows: usize, n: usize, align: usize, parts: usize, kernel: F)
where
    T: Copy + Default + Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    debug_assert_eq!(out.len(), rows * n);
    let ranges = ranges(n, parts, align);
    if ranges.len() <= 1 {
        kernel(0..n, out);
        return;
    }
    run_parts(out, rows, n, &ranges, &kernel);
}

/// The number of parts for a product of `macs` multiply-accumulates: [`threads`], or 1 below
/// the threshold ([`set_threshold`]).
pub fn parts_for(macs: usize) -> usize {
    if macs < THRESHOLD.load(Ordering::Relaxed) {
        1
    } else {
        threads()
    }
}

/// `f` of each range of `ranges(n, parts, align)`, in order: with the `threads` feature the
/// ranges run in parallel (the calling thread runs the first), without it one after the other.
pub fn map_ranges<R, F>(n: usize, parts: usize, align: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(Range<usize>) -> R + Sync,
{
    let ranges = ranges(n, parts, align);
    #[cfg(feature = "threads")]
    if ranges.len() > 1 {
        let mut results: Vec<Option<R>> = ranges.iter().map(|_| None).collect();
        let f = &f;
        rayon::in_place_scope(|scope| {
            let mut parts = ranges.iter().zip(results.iter_mut());
            let first = parts.next();
            for (range, result) in parts {
                scope.spawn(move |_| *result = Some(f(range.clone())));
            }
            if let Some((range, result)) = first {
                *result = Some(f(range.clone()));
            }
        });
        // The scope returns once every part has run: each result is there.
        return results.into_iter().flatten().collect();
    }
    ranges.into_iter().map(f).collect()
}

#[cfg(feature = "threads")]
fn run_parts<T, F>(out: &mut [T], rows: usize, n: usize, ranges: &[Range<usize>], kernel: &F)
where
    T: Copy + Default + Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    if rows == 1 {
        // One row: each range is a contiguous piece of `out`.
        let mut pieces = Vec::with_capacity(ranges.len());
        let mut rest = out;
        for r in ranges {
            let (piece, tail) = rest.split_at_mut(r.len());
            pieces.push((r.clone(), piece));
            rest = tail;
        }
        let mut pieces = pieces.into_iter();
        let first = pieces.next();
        rayon::in_place_scope(|scope| {
            for (cols, piece) in pieces {
                scope.spawn(move |_| kernel(cols, piece));
            }
            if let Some((cols, piece)) = first {
                kernel(cols, piece);
            }
        });
        return;
    }
    let mut blocks: Vec<Vec<T>> = ranges
        .iter()
        .map(|c| vec![T::default(); rows * c.len()])
        .collect();
    rayon::in_place_scope(|scope| {
        let mut parts = ranges.iter().zip(blocks.iter_mut());
        let first = parts.next();
        for (cols, block) in parts {
            scope.spawn(move |_| kernel(cols.clone(), block));
        }
        if let Some((cols, block)) = first {
            kernel(cols.clone(), block);
        }
    });
    place(out, n, ranges, &blocks);
}

/// Copies each block (`[rows, cols.len()]`) into its columns of `out` (`[rows, n]`).
fn place<T: Copy>(out: &mut [T], n: usize, ranges: &[Range<usize>], blocks: &[Vec<T>]) {
    for (cols, block) in ranges.iter().zip(blocks) {
        for (r, src) in block.chunks_exact(cols.len()).enumerate() {
            out[r * n + cols.start..r * n + cols.end].copy_from_slice(src);
        }
    }
}

/// Without the `threads` feature the parts run one after the other (the same split, for tests).
#[cfg(not(feature = "threads"))]
fn run_parts<T, F>(out: &mut [T], rows: usize, n: usize, ranges: &[Range<usize>], kernel: &F)
where
    T: Copy + Default + Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    let blocks: Vec<Vec<T>> = ranges
        .iter()
        .map(|cols| {
            let mut block = vec![T::default(); rows * cols.len()];
            kernel(cols.clone(), &mut block);
            block
        })
        .collect();
    place(out, n, ranges, &blocks);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_columns_in_aligned_parts() {
        assert_eq!(ranges(10, 2, 4), vec![0..8, 8..10]);
        assert_eq!(ranges(16, 2, 4), vec![0..8, 8..16]);
        assert_eq!(ranges(3, 4, 4), vec![0..3]);
        assert_eq!(ranges(9, 3, 1), vec![0..3, 3..6, 6..9]);
        assert_eq!(ranges(7, 1, 4), vec![0..7]);
    }

    #[test]
    fn map_ranges_keeps_the_order_of_the_ranges() {
        for parts in 1..5 {
            let got = map_ranges(10, parts, 4, |r| (r.start, r.end));
            let want: Vec<_> = ranges(10, parts, 4)
                .iter()
                .map(|r| (r.start, r.end))
                .collect();
            assert_eq!(got, want, "{parts} parts");
        }
    }

    #[test]
    fn by_columns_places_every_block() {
        let (rows, n) = (3, 10);
        let kernel = |cols: Range<usize>, block: &mut [f32]| {
            let w = cols.len();
            for r in 0..rows {
                for (c, col) in cols.clone().enumerate() {
                    block[r * w + c] = (r * 100 + col) as f32;
                }
            }
        };
        let want: Vec<f32> = (0..rows * n)
            .map(|i| ((i / n) * 100 + i % n) as f32)
            .collect();
        for parts in 1..5 {
            let mut out = vec![0f32; rows * n];
            by_columns(&mut out, rows, n, 4, parts, kernel);
            assert_eq!(out, want, "{parts} parts");
        }
    }
}
