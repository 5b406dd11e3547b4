//! How many parts of a weight the decoding kernels read side by side: four ([`STREAMS`]), or
//! one on machines where one stream decodes faster, as timed on each decoder's first decoding
//! steps.
//!
//! Four sequential reads at once keep more of memory's lines in flight than one, which the
//! kernels with much arithmetic per byte need where memory is slow: on a 2-core Intel Xeon
//! (10-13 GB/s inside wasm) SmolLM2's f16 layers took 18.1 ms with four streams and 38.7 with
//! one. Where memory is fast the same kernels are bound by their arithmetic, and four parts
//! side by side need four sets of sums, more than the sixteen simd registers of x86-64 hold
//! (the f32 panel kernel keeps 32, the int8 block kernel 32): on a 2-core AMD EPYC (Zen 4,
//! 22-31 GB/s) one stream decoded fp32 SmolLM2 in 24.4-25.7 ms a token against 27.2-30.1
//! and int8 in 10.8-11.5 against 13.0-14.5 (Node 20, alternating processes). The count
//! changes where the kernels read, not what they add: each row's or column's sum is added in
//! the same order either way, so tokens and scores do not depend on it.
//!
//! Each decoder chooses for itself (fp16 SmolLM2 decoded faster with four streams on the same
//! EPYC: its kernel keeps eight sums): its first decoding steps of one row alternate between
//! the two counts; once each has [`SAMPLES`] timed steps (after [`WARM_UP`] steps each, while
//! the engine compiles the kernels' optimised code), one is kept where its median step is
//! [`MARGIN`] faster than four's, and four otherwise, for the decoder's life. Where no clock
//! advances during a step (a Cloudflare Worker's clock stands still between its I/O), four is
//! kept.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::linalg::STREAMS;

/// Steps of each count run before the timed ones.
const WARM_UP: usize = 2;
/// Timed steps of each count.
const SAMPLES: usize = 5;
/// One stream is kept where its median step takes less than this share of four's.
const MARGIN: f64 = 0.95;
/// After two timed steps of each, four is kept at once where one stream's fastest step takes
/// more than this share of four's slowest (on the Xeon above, twice as long).
const CLEARLY_SLOWER: f64 = 1.2;

/// The count the decoding kernels read during the step that runs now; [`STREAMS`] outside
/// [`Choice::decoding_step`] (prompts, batches, encoders: their kernels read no weight side
/// by side). One for the process, as the parts of a step's products run on the threads of
/// its team; steps of two decoders on two threads at once (natively) share it, which can
/// slow one of them, never change its sums.
static COUNT: AtomicUsize = AtomicUsize::new(STREAMS);

/// Parts of a weight the decoding kernels read side by side now: [`STREAMS`] or 1.
pub(crate) fn count() -> usize {
    COUNT.load(Ordering::Relaxed)
}

/// A decoder's count, chosen on its first decoding steps (module docs).
#[derive(Debug, Default)]
pub(crate) struct Choice(Mutex<Tuner>);

impl Choice {
    /// Runs a decoding step of one row with this decoder's count, timed while it is being
    /// chosen.
    pub(crate) fn decoding_step<R>(&self, step: impl FnOnce() -> R) -> R {
        let (count, timed) = {
            let mut tuner = self.lock();
            match tuner.chosen {
                Some(count) => (count, false),
                None => (tuner.next(), true),
            }
        };
        COUNT.store(count, Ordering::Relaxed);
        let start = if timed { now_ms() } else { None };
        let result = step();
        if timed {
            let elapsed = start.zip(now_ms()).map(|(a, b)| b - a);
            self.lock().record(count, elapsed);
        }
        COUNT.store(STREAMS, Ordering::Relaxed);
        result
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tuner> {
        // A panic while the lock was held cannot leave the tuner inconsistent: go on with it.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The choice between four streams and one, from timed steps of each.
#[derive(Debug, Default)]
struct Tuner {
    /// Steps handed out so far.
    steps: usize,
    /// Timed steps of four streams, then of one (ms), at most `SAMPLES` each.
    times: [Vec<f64>; 2],
    chosen: Option<usize>,
}

impl Tuner {
    /// The count for the next step while none is chosen: four and one in turn.
    fn next(&mut self) -> usize {
        self.steps += 1;
        if self.steps % 2 == 1 {
            STREAMS
        } else {
            1
        }
    }

    /// Records a step of `count` streams that took `elapsed` ms (`None`: no clock), and
    /// chooses once the steps say enough.
    fn record(&mut self, count: usize, elapsed: Option<f64>) {
        if self.chosen.is_some() {
            return;
        }
        let elapsed = match elapsed {
            Some(ms) if ms > 0.0 && ms.is_finite() => ms,
            // No clock, or one that stood still through the step.
            _ => return self.chosen = Some(STREAMS),
        };
        // Steps are handed out in pairs: the first 2 WARM_UP are not timed.
        if self.steps <= 2 * WARM_UP {
            return;
        }
        let times = &mut self.times[usize::from(count == 1)];
        if times.len() < SAMPLES {
            times.push(elapsed);
        }
        let [four, one] = &self.times;
        if four.len() >= 2 && one.len() >= 2 {
            let fastest_one = one.iter().copied().fold(f64::INFINITY, f64::min);
            let slowest_four = four.iter().copied().fold(0.0, f64::max);
            if fastest_one > CLEARLY_SLOWER * slowest_four {
                self.chosen = Some(STREAMS);
                return;
            }
        }
        if four.len() == SAMPLES && one.len() == SAMPLES {
            let faster = median(one) < MARGIN * median(four);
            self.chosen = Some(if faster { 1 } else { STREAMS });
        }
    }
}

fn median(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
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

    /// Feeds `tuner` steps whose times `time(count)` gives until it chooses; returns the
    /// choice and the steps it took.
    fn run(mut time: impl FnMut(usize) -> Option<f64>) -> (usize, usize) {
        let mut tuner = Tuner::default();
        while tuner.chosen.is_none() {
            let count = tuner.next();
            tuner.record(count, time(count));
            assert!(tuner.steps < 100, "no choice after 100 steps: {tuner:?}");
        }
        (tuner.chosen.unwrap(), tuner.steps)
    }

    #[test]
    fn keeps_one_stream_where_it_is_faster() {
        let (count, steps) = run(|c| Some(if c == 1 { 10.0 } else { 12.0 }));
        assert_eq!((count, steps), (1, 2 * (WARM_UP + SAMPLES)));
    }

    #[test]
    fn keeps_four_where_one_is_not_clearly_faster() {
        assert_eq!(run(|c| Some(if c == 1 { 9.8 } else { 10.0 })).0, STREAMS);
        assert_eq!(run(|c| Some(if c == 1 { 10.5 } else { 10.0 })).0, STREAMS);
    }

    #[test]
    fn stops_early_where_one_is_clearly_slower() {
        let (count, steps) = run(|c| Some(if c == 1 { 20.0 } else { 10.0 }));
        assert_eq!((count, steps), (STREAMS, 2 * (WARM_UP + 2)));
    }

    /// The first steps (the engine's code still compiling) do not count: one stream's warm-up
    /// steps were slow, its timed ones fast.
    #[test]
    fn warm_up_steps_are_not_timed() {
        let mut step = 0;
        let (count, _) = run(|c| {
            step += 1;
            Some(if c == 4 || step <= 2 * WARM_UP {
                50.0
            } else {
                10.0
            })
        });
        assert_eq!(count, 1);
    }

    /// The medians decide, not one odd step.
    #[test]
    fn an_outlier_does_not_decide() {
        let mut ones = 0;
        let (count, _) = run(|c| {
            if c == 1 {
                ones += 1;
            }
            Some(match c {
                1 if ones == WARM_UP + 3 => 40.0,
                1 => 10.0,
                _ => 12.0,
            })
        });
        assert_eq!(count, 1);
    }

    #[test]
    fn keeps_four_without_a_clock() {
        assert_eq!(run(|_| None), (STREAMS, 1));
        // A clock that stands still through a step.
        assert_eq!(run(|_| Some(0.0)), (STREAMS, 1));
    }

    /// A decoder's steps run with its count; others with four.
    #[test]
    fn steps_run_with_the_chosen_count() {
        let choice = Choice::default();
        choice.lock().chosen = Some(1);
        assert_eq!(choice.decoding_step(count), 1);
        assert_eq!(choice.lock().steps, 0);
        assert_eq!(count(), STREAMS);
        // While it is being chosen, four and one in turn (steps that take time on the clock).
        let fresh = Choice::default();
        let step = || {
            std::thread::sleep(std::time::Duration::from_millis(1));
            count()
        };
        assert_eq!([0, 1].map(|_| fresh.decoding_step(step)), [STREAMS, 1]);
    }
}
