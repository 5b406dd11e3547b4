//! How many parts of a weight the layers' decoding kernels (f16 rows, f32 panels) read side
//! by side: four ([`STREAMS`]), or one on machines where one stream decodes faster, as timed
//! on each decoder's first decoding steps.
//!
//! Four sequential reads at once keep more of memory's lines in flight than one, which the
//! kernels with much arithmetic per byte need where memory is slow: on a 2-core Intel Xeon
//! (10-13 GB/s inside wasm) SmolLM2's f16 layers took 18.1 ms with four streams and 38.7 with
//! one. Where memory is fast the same kernels are bound by their arithmetic, and four parts
//! side by side need four sets of sums, more than the sixteen simd registers of x86-64 hold
//! (the f32 panel kernel keeps 32): on a 2-core AMD EPYC (Zen 4, 22-31 GB/s) one stream
//! decoded fp32 SmolLM2 in 24.4-25.7 ms a token against 27.2-30.1, and int8 in 10.8-11.5
//! against 13.0-14.5 while its block kernel kept 32 (Node 20, alternating processes). The
//! kernels of `matmul_integer`'s blocks, which the int8 layers and the `lm_head`'s bound pass
//! (`lm_head`) read, keep their sums in eight registers and always read four blocks. The count
//! changes where the kernels read, not what they add: each row's or column's sum is added in
//! the same order either way, so tokens and scores do not depend on it.
//!
//! Each decoder chooses for itself between the two: its first decoding steps of one row take
//! them in turn; once each has [`SAMPLES`] timed steps (after [`WARM_UP`] rounds, while the
//! engine compiles the kernels' optimised code), one stream is kept where its median step is
//! [`MARGIN`] faster than four's, and four otherwise, for the decoder's life. Where no clock
//! advances during a step (a Cloudflare Worker's clock stands still between its I/O), four is
//! kept.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::linalg::STREAMS;

/// What a decoder's steps may read with, four streams first (kept unless one is clearly
/// faster).
const CANDIDATES: [usize; 2] = [STREAMS, 1];

/// Rounds of the candidates run before the timed ones.
const WARM_UP: usize = 2;
/// Timed steps of each candidate.
const SAMPLES: usize = 5;
/// A candidate is kept where its median step takes less than this share of four streams'.
const MARGIN: f64 = 0.95;
/// After two timed steps of each, a candidate is dropped where its fastest step takes more
/// than this share of four streams' slowest (on the Xeon above, twice as long).
const CLEARLY_SLOWER: f64 = 1.2;

/// The count the layers' decoding kernels read with during the step that runs now;
/// [`STREAMS`] outside [`Choice::decoding_step`] (prompts, batches, encoders: their kernels
/// read no weight side by side). One for the process, as the parts of a step's products run
/// on the threads of its team; steps of two decoders on two threads at once (natively) share
/// it, which can slow one of them, never change its sums.
static LAYERS: AtomicUsize = AtomicUsize::new(STREAMS);

/// Parts of a weight the layers' decoding kernels read side by side now: [`STREAMS`] or 1.
pub(crate) fn count() -> usize {
    LAYERS.load(Ordering::Relaxed)
}

fn set(reads: usize) {
    LAYERS.store(reads, Ordering::Relaxed);
}

/// A decoder's count, chosen on its first decoding steps (module docs).
#[derive(Debug, Default)]
pub(crate) struct Choice(Mutex<Tuner>);

impl Choice {
    /// Runs a decoding step of one row with this decoder's count, timed while it is being
    /// chosen.
    pub(crate) fn decoding_step<R>(&self, step: impl FnOnce() -> R) -> R {
        let (reads, timed) = {
            let mut tuner = self.lock();
            match tuner.chosen {
                Some(reads) => (reads, None),
                None => {
                    let c = tuner.next();
                    (CANDIDATES[c], Some(c))
                }
            }
        };
        set(reads);
        let start = if timed.is_some() { now_ms() } else { None };
        let result = step();
        if let Some(c) = timed {
            let elapsed = start.zip(now_ms()).map(|(a, b)| b - a);
            self.lock().record(c, elapsed);
        }
        set(CANDIDATES[0]);
        result
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tuner> {
        // A panic while the lock was held cannot leave the tuner inconsistent: go on with it.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

const N: usize = CANDIDATES.len();

/// The choice among [`CANDIDATES`], from timed steps of each.
#[derive(Debug, Default)]
struct Tuner {
    /// Steps handed out so far.
    steps: usize,
    /// Timed steps of each candidate (ms), at most `SAMPLES` each.
    times: [Vec<f64>; N],
    /// Candidates no longer tried (clearly slower).
    dropped: [bool; N],
    chosen: Option<usize>,
}

impl Tuner {
    /// The candidate for the next step while none is chosen: each in turn for the warm-up
    /// rounds, then the one left in with the fewest timed steps.
    fn next(&mut self) -> usize {
        let c = if self.steps < WARM_UP * N {
            self.steps % N
        } else {
            (0..N)
                .filter(|&c| !self.dropped[c])
                .min_by_key(|&c| self.times[c].len())
                .unwrap_or(0)
        };
        self.steps += 1;
        c
    }

    /// Records a step of candidate `c` that took `elapsed` ms (`None`: no clock), and chooses
    /// once the steps say enough.
    fn record(&mut self, c: usize, elapsed: Option<f64>) {
        if self.chosen.is_some() {
            return;
        }
        let elapsed = match elapsed {
            Some(ms) if ms > 0.0 && ms.is_finite() => ms,
            // No clock, or one that stood still through the step.
            _ => return self.chosen = Some(CANDIDATES[0]),
        };
        if self.steps <= WARM_UP * N {
            return;
        }
        if self.times[c].len() < SAMPLES {
            self.times[c].push(elapsed);
        }
        let four = &self.times[0];
        if four.len() >= 2 {
            let slowest_four = four.iter().copied().fold(0.0, f64::max);
            for d in 1..N {
                let times = &self.times[d];
                let fastest = times.iter().copied().fold(f64::INFINITY, f64::min);
                if times.len() >= 2 && fastest > CLEARLY_SLOWER * slowest_four {
                    self.dropped[d] = true;
                }
            }
        }
        let left: Vec<usize> = (0..N).filter(|&d| !self.dropped[d]).collect();
        if left == [0] {
            self.chosen = Some(CANDIDATES[0]);
        } else if left.iter().all(|&d| self.times[d].len() == SAMPLES) {
            let medians = self.times.each_ref().map(|t| median(t));
            let best = left
                .iter()
                .copied()
                .min_by(|&a, &b| medians[a].total_cmp(&medians[b]))
                .unwrap_or(0);
            let faster = medians[best] < MARGIN * medians[0];
            self.chosen = Some(CANDIDATES[if faster { best } else { 0 }]);
        }
    }
}

/// The median of `times`; infinite for none.
fn median(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
        .get(sorted.len() / 2)
        .copied()
        .unwrap_or(f64::INFINITY)
}

/// Milliseconds from some fixed moment: `performance.now()` in wasm (`None` where the global
/// object has none), `Instant` natively.
#[cfg(target_arch = "wasm32")]
fn now_ms() -> Option<f64> {
    use wasm_bindgen::JsCast;
    let performance = js_sys::Reflect::get(&js_sys::global(), &"performance".into()).ok()?;
    let now = js_sys::Reflect::get(&performance, &"now".into()).ok()?;
    let now: js_sys::Function = now.dyn_into().ok()?;
    now.call0(&performance).ok()?.as_f64()
}

#[cfg(not(target_arch = "wasm32"))]
fn now_ms() -> Option<f64> {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    Some(START.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOUR: usize = CANDIDATES[0];

    /// Feeds a tuner steps whose times `time(count)` gives until it chooses; returns the
    /// choice and the steps it took.
    fn run(mut time: impl FnMut(usize) -> Option<f64>) -> (usize, usize) {
        let mut tuner = Tuner::default();
        while tuner.chosen.is_none() {
            let c = tuner.next();
            tuner.record(c, time(CANDIDATES[c]));
            assert!(tuner.steps < 100, "no choice after 100 steps: {tuner:?}");
        }
        (tuner.chosen.unwrap(), tuner.steps)
    }

    /// A step's time: 10 ms with four streams, plus `one` ms with one.
    fn step(one: f64) -> impl FnMut(usize) -> Option<f64> {
        move |count| Some(10.0 + if count == 1 { one } else { 0.0 })
    }

    #[test]
    fn keeps_one_stream_where_it_is_faster() {
        let (reads, steps) = run(step(-1.0));
        assert_eq!(reads, 1);
        assert_eq!(steps, N * (WARM_UP + SAMPLES));
    }

    #[test]
    fn keeps_four_where_one_is_not_clearly_faster() {
        assert_eq!(run(step(-0.2)).0, FOUR);
        assert_eq!(run(step(0.5)).0, FOUR);
    }

    #[test]
    fn stops_early_where_one_is_clearly_slower() {
        let (reads, steps) = run(step(10.0));
        assert_eq!((reads, steps), (FOUR, N * (WARM_UP + 2)));
    }

    /// The first steps (the engine's code still compiling) do not count: one stream's warm-up
    /// steps were slow, its timed ones fast.
    #[test]
    fn warm_up_steps_are_not_timed() {
        let mut steps = 0;
        let (reads, _) = run(|count| {
            steps += 1;
            Some(if count == FOUR || steps <= N * WARM_UP {
                50.0
            } else {
                10.0
            })
        });
        assert_eq!(reads, 1);
    }

    /// The medians decide, not one odd step.
    #[test]
    fn an_outlier_does_not_decide() {
        let mut ones = 0;
        let (reads, _) = run(|count| {
            if count == 1 {
                ones += 1;
            }
            Some(match count {
                1 if ones == WARM_UP + 3 => 40.0,
                1 => 10.0,
                _ => 12.0,
            })
        });
        assert_eq!(reads, 1);
    }

    #[test]
    fn keeps_four_without_a_clock() {
        assert_eq!(run(|_| None), (FOUR, 1));
        // A clock that stands still through a step.
        assert_eq!(run(|_| Some(0.0)), (FOUR, 1));
    }

    /// A decoder's steps run with its count; others with four.
    #[test]
    fn steps_run_with_the_chosen_count() {
        let choice = Choice::default();
        choice.lock().chosen = Some(1);
        assert_eq!(choice.decoding_step(count), 1);
        assert_eq!(choice.lock().steps, 0);
        assert_eq!(count(), STREAMS);
        // While it is being chosen, each candidate in turn (steps that take time on the
        // clock).
        let fresh = Choice::default();
        let step = || {
            std::thread::sleep(std::time::Duration::from_millis(1));
            count()
        };
        assert_eq!([0, 1].map(|_| fresh.decoding_step(step)), CANDIDATES);
    }
}
