//! The part of rustfft 6's API that tract calls (`FftPlanner::plan_fft*`, `Fft::process`,
//! `FftNum`, `FftDirection` and the `num_complex` / `num_traits` re-exports), with rustfft's
//! conventions: no normalisation in either direction, the forward transform
//! `X[k] = sum_j x[j] e^(-2 pi i j k / n)`, the inverse with `e^(+2 pi i j k / n)`.
//!
//! Lengths that are powers of two run an iterative radix-2 FFT (`n log n`), every other length a
//! direct DFT (`n^2`, from a table of the `n` twiddles).

use std::fmt::Debug;
use std::sync::Arc;

pub use num_complex;
pub use num_traits;

use num_complex::Complex;
use num_traits::{FromPrimitive, Signed, Zero};

/// The element types an FFT computes in (rustfft's bounds, so the same types qualify).
pub trait FftNum: Copy + FromPrimitive + Signed + Sync + Send + Debug + 'static {}

impl<T> FftNum for T where T: Copy + FromPrimitive + Signed + Sync + Send + Debug + 'static {}

/// A forward or an inverse transform.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum FftDirection {
    Forward,
    Inverse,
}

impl FftDirection {
    /// The other direction.
    pub fn opposite_direction(&self) -> FftDirection {
        match self {
            FftDirection::Forward => FftDirection::Inverse,
            FftDirection::Inverse => FftDirection::Forward,
        }
    }
}

/// The length an FFT was planned for.
pub trait Length {
    fn len(&self) -> usize;
}

/// The direction an FFT was planned for.
pub trait Direction {
    fn fft_direction(&self) -> FftDirection;
}

/// An FFT of one length and direction, applied in place.
pub trait Fft<T: FftNum>: Length + Direction + Sync + Send {
    /// Transforms each chunk of `self.len()` values of `buffer` in place.
    ///
    /// Panics, as rustfft's does, when `buffer.len()` is not a multiple of `self.len()`.
    fn process(&self, buffer: &mut [Complex<T>]) {
        let mut scratch = vec![Complex::zero(); self.get_inplace_scratch_len()];
        self.process_with_scratch(buffer, &mut scratch);
    }

    /// `process` with the caller's scratch space (at least `get_inplace_scratch_len()` values).
    fn process_with_scratch(&self, buffer: &mut [Complex<T>], scratch: &mut [Complex<T>]);

    /// The scratch `process_with_scratch` needs.
    fn get_inplace_scratch_len(&self) -> usize;
}

/// Plans FFTs (rustfft's planner caches its plans; these are cheap to build).
pub struct FftPlanner<T: FftNum> {
    _element: std::marker::PhantomData<T>,
}

impl<T: FftNum> Default for FftPlanner<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: FftNum> FftPlanner<T> {
    pub fn new() -> Self {
        FftPlanner {
            _element: std::marker::PhantomData,
        }
    }

    /// An FFT of `len` values in `direction`.
    pub fn plan_fft(&mut self, len: usize, direction: FftDirection) -> Arc<dyn Fft<T>> {
        Arc::new(Plan::new(len, direction))
    }

    pub fn plan_fft_forward(&mut self, len: usize) -> Arc<dyn Fft<T>> {
        self.plan_fft(len, FftDirection::Forward)
    }

    pub fn plan_fft_inverse(&mut self, len: usize) -> Arc<dyn Fft<T>> {
        self.plan_fft(len, FftDirection::Inverse)
    }
}

/// `twiddles[k] = e^(-+2 pi i k / len)` (the sign of the direction), computed in f64.
struct Plan<T> {
    len: usize,
    direction: FftDirection,
    twiddles: Vec<Complex<T>>,
}

impl<T: FftNum> Plan<T> {
    fn new(len: usize, direction: FftDirection) -> Self {
        let sign = match direction {
            FftDirection::Forward => -1.0,
            FftDirection::Inverse => 1.0,
        };
        let twiddles = (0..len)
            .map(|k| {
                let angle = sign * 2.0 * std::f64::consts::PI * k as f64 / len as f64;
                let part = |v: f64| T::from_f64(v).unwrap_or_else(T::zero);
                Complex::new(part(angle.cos()), part(angle.sin()))
            })
            .collect();
        Plan {
            len,
            direction,
            twiddles,
        }
    }

    /// In-place iterative radix-2 FFT of `x` (a power-of-two length): bit-reversed order, then
    /// butterflies of growing size.
    fn radix2(&self, x: &mut [Complex<T>]) {
        let n = x.len();
        if n < 2 {
            return;
        }
        let bits = n.trailing_zeros();
        for i in 0..n {
            let j = i.reverse_bits() >> (usize::BITS - bits);
            if i < j {
                x.swap(i, j);
            }
        }
        let mut half = 1;
        while half < n {
            let step = n / (2 * half);
            for start in (0..n).step_by(2 * half) {
                for k in 0..half {
                    let t = x[start + k + half] * self.twiddles[k * step];
                    let u = x[start + k];
                    x[start + k] = u + t;
                    x[start + k + half] = u - t;
                }
            }
            half *= 2;
        }
    }

    /// Direct DFT of `x` into `out`.
    fn direct(&self, x: &[Complex<T>], out: &mut [Complex<T>]) {
        let n = x.len();
        for (k, o) in out.iter_mut().enumerate() {
            let mut sum = Complex::zero();
            let mut index = 0;
            for v in x {
                sum = sum + *v * self.twiddles[index];
                index += k;
                if index >= n {
                    index -= n;
                }
            }
            *o = sum;
        }
    }
}

impl<T: FftNum> Length for Plan<T> {
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: FftNum> Direction for Plan<T> {
    fn fft_direction(&self) -> FftDirection {
        self.direction
    }
}

impl<T: FftNum> Fft<T> for Plan<T> {
    fn process_with_scratch(&self, buffer: &mut [Complex<T>], scratch: &mut [Complex<T>]) {
        if self.len == 0 {
            return;
        }
        assert!(
            buffer.len() % self.len == 0,
            "FFT of length {}: a buffer of {} values is not whole transforms",
            self.len,
            buffer.len()
        );
        for chunk in buffer.chunks_exact_mut(self.len) {
            if self.len.is_power_of_two() {
                self.radix2(chunk);
            } else {
                let out = &mut scratch[..self.len];
                self.direct(chunk, out);
                chunk.copy_from_slice(out);
            }
        }
    }

    fn get_inplace_scratch_len(&self) -> usize {
        if self.len.is_power_of_two() {
            0
        } else {
            self.len
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DFT's definition, in f64.
    fn reference(x: &[Complex<f64>], inverse: bool) -> Vec<Complex<f64>> {
        let n = x.len();
        let sign = if inverse { 1.0 } else { -1.0 };
        (0..n)
            .map(|k| {
                x.iter().enumerate().fold(Complex::zero(), |sum, (j, v)| {
                    let angle = sign * 2.0 * std::f64::consts::PI * (j * k) as f64 / n as f64;
                    sum + v * Complex::new(angle.cos(), angle.sin())
                })
            })
            .collect()
    }

    fn signal(n: usize) -> Vec<Complex<f64>> {
        (0..n)
            .map(|i| {
                Complex::new(
                    (i as f64 * 0.7).sin() + 0.1 * i as f64,
                    (i as f64 * 1.3).cos(),
                )
            })
            .collect()
    }

    #[test]
    fn every_length_matches_the_definition_in_both_directions() {
        for n in (1..=70).chain([128, 400, 512, 1000]) {
            for direction in [FftDirection::Forward, FftDirection::Inverse] {
                let x = signal(n);
                let want = reference(&x, direction == FftDirection::Inverse);
                let fft = FftPlanner::<f64>::new().plan_fft(n, direction);
                let mut got = x.clone();
                fft.process(&mut got);
                let scale = want.iter().map(|v| v.norm()).fold(1.0, f64::max);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).norm() <= 1e-12 * scale,
                        "n {n} {direction:?} bin {k}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn f32_buffers_of_several_transforms_and_the_round_trip() {
        let n = 12;
        let x: Vec<Complex<f32>> = signal(3 * n)
            .iter()
            .map(|v| Complex::new(v.re as f32, v.im as f32))
            .collect();
        let mut y = x.clone();
        FftPlanner::<f32>::new().plan_fft_forward(n).process(&mut y);
        for (c, chunk) in y.chunks(n).enumerate() {
            let want = reference(
                &x[c * n..(c + 1) * n]
                    .iter()
                    .map(|v| Complex::new(v.re as f64, v.im as f64))
                    .collect::<Vec<_>>(),
                false,
            );
            for (g, w) in chunk.iter().zip(&want) {
                assert!((Complex::new(g.re as f64, g.im as f64) - w).norm() < 1e-4);
            }
        }
        FftPlanner::<f32>::new().plan_fft_inverse(n).process(&mut y);
        for (back, orig) in y.iter().zip(&x) {
            assert!((back / n as f32 - orig).norm() < 1e-5);
        }
    }
}
