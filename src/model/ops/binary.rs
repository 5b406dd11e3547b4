//! `BroadcastArith`: float32 `Add`, `Sub`, `Mul` and `Div` with numpy broadcasting, put in
//! place of the binary ops that tract's codegen leaves generic ([`replace_generic`]).
//!
//! tract turns a binary op into a fast kernel only when one operand is a scalar per row or a
//! whole aligned block (`OptBinByScalar`, `OptBinUnicast`); with symbolic shapes (the plans
//! compile with `sequence` and `past` unknown) most of a decoder's stay generic, and the
//! generic op calls a function per element. In SmolLM2 that is 421 ops a step: the residual
//! adds, the rotary embedding, the attention scale of the whole key cache, the mask added to
//! the scores. Here the two shapes are collapsed to the fewest axes, and each innermost run is
//! one loop that the compiler vectorizes. The arithmetic is the same IEEE operation on the same
//! pairs of values, so the results are bit-identical to tract's.

use tract_onnx::prelude::*;
use tract_onnx::tract_core::broadcast::multi_broadcast;
use tract_onnx::tract_core::internal::*;
use tract_onnx::tract_core::ops::binary::TypedBinOp;
use tract_onnx::tract_core::ops::math::{Add, Div, Mul, Sub};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arith {
    Add,
    Sub,
    Mul,
    Div,
}

impl Arith {
    /// The arithmetic of a tract binary op, when it is one of these four.
    fn of(op: &TypedBinOp) -> Option<Arith> {
        let mini = &op.0;
        if mini.is::<Add>() {
            Some(Arith::Add)
        } else if mini.is::<Sub>() {
            Some(Arith::Sub)
        } else if mini.is::<Mul>() {
            Some(Arith::Mul)
        } else if mini.is::<Div>() {
            Some(Arith::Div)
        } else {
            None
        }
    }
}

/// Replaces every generic f32 `Add`, `Sub`, `Mul` and `Div` of an optimized model by
/// [`BroadcastArith`] (same inputs, same output fact). Returns how many were replaced.
pub fn replace_generic(model: &mut TypedModel) -> TractResult<usize> {
    let mut replaced = 0;
    for id in 0..model.nodes().len() {
        let Some(arith) = model.node(id).op_as::<TypedBinOp>().and_then(|op| {
            let float_out = op.1.is_none_or(|dt| dt == f32::datum_type());
            Arith::of(op).filter(|_| float_out)
        }) else {
            continue;
        };
        let f32_inputs = {
            let facts = model.node_input_facts(id)?;
            facts.len() == 2
                && facts.iter().all(|f| f.datum_type == f32::datum_type())
                && facts[0].rank() == facts[1].rank()
        };
        if f32_inputs {
            model.node_mut(id).op = Box::new(BroadcastArith(arith));
            replaced += 1;
        }
    }
    Ok(replaced)
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BroadcastArith(pub Arith);

impl Op for BroadcastArith {
    fn name(&self) -> StaticName {
        format!("BroadcastArith{:?}", self.0).into()
    }
    op_as_typed_op!();
}

impl TypedOp for BroadcastArith {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        ensure!(inputs.len() == 2 && inputs[0].rank() == inputs[1].rank());
        let shape = multi_broadcast(&[inputs[0].shape.to_tvec(), inputs[1].shape.to_tvec()])?;
        Ok(tvec!(TypedFact::dt_shape(f32::datum_type(), shape)))
    }
    as_op!();
}

impl EvalOp for BroadcastArith {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let (a, b) = args_2!(inputs);
        let shape = broadcast(a.shape(), b.shape()).ok_or_else(|| {
            format_err!(
                "{:?}: shapes {:?} and {:?} do not broadcast",
                self.0,
                a.shape(),
                b.shape()
            )
        })?;
        let out = match self.0 {
            Arith::Add => apply(a, b, &shape, |x, y| x + y)?,
            Arith::Sub => apply(a, b, &shape, |x, y| x - y)?,
            Arith::Mul => apply(a, b, &shape, |x, y| x * y)?,
            Arith::Div => apply(a, b, &shape, |x, y| x / y)?,
        };
        Ok(tvec!(out.into_tvalue()))
    }
}

/// numpy's broadcast of two shapes of one rank; `None` where they do not broadcast.
fn broadcast(a: &[usize], b: &[usize]) -> Option<TVec<usize>> {
    if a.len() != b.len() {
        return None;
    }
    a.iter()
        .zip(b)
        .map(|(&x, &y)| match (x, y) {
            _ if x == y => Some(x),
            (1, _) => Some(y),
            (_, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// `f(a, b)` broadcast to `shape`: written into the buffer of an operand of that shape that
/// nothing else holds, else into a new one. (An operand held elsewhere, such as the residual
/// stream that a later add reads again, would be copied by `into_tensor` first: a pass more.)
fn apply(
    a: TValue,
    b: TValue,
    shape: &[usize],
    f: impl Fn(f32, f32) -> f32,
) -> TractResult<Tensor> {
    if shape.contains(&0) {
        return Tensor::zero::<f32>(shape);
    }
    let runs = Runs::new(shape, a.shape(), b.shape());
    if a.shape() == shape && a.is_exclusive() {
        let b = b.try_as_plain_ram()?;
        return in_place(a.into_tensor(), b.as_slice::<f32>()?, &runs, &f);
    }
    if b.shape() == shape && b.is_exclusive() {
        let a = a.try_as_plain_ram()?;
        return in_place(
            b.into_tensor(),
            a.as_slice::<f32>()?,
            &runs.swapped(),
            |c, o| f(o, c),
        );
    }
    let (a, b) = (a.try_as_plain_ram()?, b.try_as_plain_ram()?);
    let (a, bs) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    // SAFETY: every element is written below (the runs cover the output).
    let mut c = unsafe { Tensor::uninitialized::<f32>(shape)? };
    {
        let mut plain = c.try_as_plain_ram_mut()?;
        let cs = plain.as_slice_mut::<f32>()?;
        runs.each(|at_c, at_a, at_b| {
            let c = &mut cs[at_c..at_c + runs.len];
            let n = runs.len;
            match (runs.a_step, runs.b_step) {
                (1, 1) => {
                    let pairs = a[at_a..at_a + n].iter().zip(&bs[at_b..at_b + n]);
                    c.iter_mut()
                        .zip(pairs)
                        .for_each(|(c, (a, b))| *c = f(*a, *b));
                }
                (1, _) => {
                    let b = bs[at_b];
                    c.iter_mut()
                        .zip(&a[at_a..at_a + n])
                        .for_each(|(c, a)| *c = f(*a, b));
                }
                (_, 1) => {
                    let a = a[at_a];
                    c.iter_mut()
                        .zip(&bs[at_b..at_b + n])
                        .for_each(|(c, b)| *c = f(a, *b));
                }
                _ => c.fill(f(a[at_a], bs[at_b])),
            }
        });
    }
    Ok(c)
}

/// `c = f(c, other)` over `runs`, `c` having the output's shape: its values are consecutive
/// in each run and `other`'s step by `runs.b_step`.
fn in_place(
    mut c: Tensor,
    other: &[f32],
    runs: &Runs,
    f: impl Fn(f32, f32) -> f32,
) -> TractResult<Tensor> {
    {
        let mut plain = c.try_as_plain_ram_mut()?;
        let cs = plain.as_slice_mut::<f32>()?;
        runs.each(|at_c, _, at_o| {
            let c = &mut cs[at_c..at_c + runs.len];
            match runs.b_step {
                1 => c
                    .iter_mut()
                    .zip(&other[at_o..at_o + runs.len])
                    .for_each(|(c, o)| *c = f(*c, *o)),
                _ => {
                    let o = other[at_o];
                    c.iter_mut().for_each(|c| *c = f(*c, o));
                }
            }
        });
    }
    Ok(c)
}

/// The output of a broadcast as runs of `len` consecutive elements: in each run the elements
/// of `a` (and of `b`) are consecutive (`step` 1) or one repeated value (`step` 0). The outer
/// axes are the collapsed axes of the output, with the strides of `a` and `b` along them.
pub(super) struct Runs {
    pub(super) len: usize,
    a_step: usize,
    b_step: usize,
    /// Outer axes, outermost first: (size, stride in a, stride in b).
    outer: TVec<(usize, usize, usize)>,
}

impl Runs {
    pub(super) fn new(shape: &[usize], a: &[usize], b: &[usize]) -> Runs {
        let strides = |dims: &[usize]| {
            let mut s: TVec<usize> = tvec![0; dims.len()];
            let mut acc = 1;
            for i in (0..dims.len()).rev() {
                s[i] = if dims[i] == 1 { 0 } else { acc };
                acc *= dims[i];
            }
            s
        };
        let (sa, sb) = (strides(a), strides(b));
        // Innermost first, axes of size 1 left out, each merged into the one inside it when
        // both operands step through them as through one axis.
        let mut axes: TVec<(usize, usize, usize)> = tvec![];
        for i in (0..shape.len()).rev() {
            if shape[i] == 1 {
                continue;
            }
            match axes.last_mut() {
                Some((n, a, b)) if sa[i] == *a * *n && sb[i] == *b * *n => *n *= shape[i],
                _ => axes.push((shape[i], sa[i], sb[i])),
            }
        }
        let (len, a_step, b_step) = if axes.is_empty() {
            (1, 0, 0)
        } else {
            axes.remove(0)
        };
        axes.reverse();
        Runs {
            len,
            a_step,
            b_step,
            outer: axes,
        }
    }

    /// The runs with `a` and `b` exchanged.
    fn swapped(&self) -> Runs {
        Runs {
            len: self.len,
            a_step: self.b_step,
            b_step: self.a_step,
            outer: self.outer.iter().map(|&(n, a, b)| (n, b, a)).collect(),
        }
    }

    /// Calls `run(c, a, b)` with the offsets of each run, in the output's order.
    pub(super) fn each(&self, mut run: impl FnMut(usize, usize, usize)) {
        let count: usize = self.outer.iter().map(|(n, _, _)| n).product();
        let mut index: TVec<usize> = tvec![0; self.outer.len()];
        let (mut at_a, mut at_b) = (0usize, 0usize);
        for r in 0..count {
            run(r * self.len, at_a, at_b);
            // Next index, innermost outer axis first.
            for (i, &(n, sa, sb)) in self.outer.iter().enumerate().rev() {
                index[i] += 1;
                at_a += sa;
                at_b += sb;
                if index[i] < n {
                    break;
                }
                index[i] = 0;
                at_a -= sa * n;
                at_b -= sb * n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every broadcast pattern of a few shapes gives tract's generic op's values, bit for bit.
    #[test]
    fn matches_tract_generic_ops() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[2, 3, 4], &[2, 3, 4]),
            (&[1, 9, 1, 64], &[1, 1, 1, 64]),
            (&[1, 9, 5, 64], &[1, 1, 5, 64]),
            (&[1, 3, 3, 7, 8], &[1, 1, 1, 1, 1]),
            (&[1, 1, 576], &[1, 5, 576]),
            (&[1, 9, 5, 12], &[1, 1, 5, 12]),
            (&[2, 1, 3], &[1, 4, 1]),
            (&[1, 1], &[1, 1]),
            (&[3, 1, 2], &[3, 5, 2]),
            (&[4, 1], &[4, 6]),
            (&[1, 3, 0, 4], &[1, 1, 1, 4]),
        ];
        let value = |i: usize| ((i * 7919) % 113) as f32 / 17.0 - 3.0;
        let tensor = |shape: &[usize], salt: usize| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| value(i + salt) + 0.5).collect();
            Tensor::from_shape(shape, &data).unwrap()
        };
        for (sa, sb) in cases {
            for (a_shape, b_shape) in [(sa, sb), (sb, sa)] {
                for (arith, mini) in [
                    (
                        Arith::Add,
                        Box::new(Add) as Box<dyn tract_onnx::tract_core::ops::binary::BinMiniOp>,
                    ),
                    (Arith::Sub, Box::new(Sub)),
                    (Arith::Mul, Box::new(Mul)),
                    (Arith::Div, Box::new(Div)),
                ] {
                    let a = tensor(a_shape, 0);
                    let b = tensor(b_shape, 31);
                    let inputs = tvec![a.clone().into_tvalue(), b.clone().into_tvalue()];
                    let want = TypedBinOp(mini, None)
                        .eval(&EvalContext::out_of_plan(), inputs.clone())
                        .unwrap();
                    let want = want[0].try_as_plain_ram().unwrap();
                    let want = want.as_slice::<f32>().unwrap();
                    // Each operand held elsewhere or not: written in place into `a`, into
                    // `b`, or into a new buffer.
                    for held in 0..4 {
                        let inputs = tvec![a.clone().into_tvalue(), b.clone().into_tvalue()];
                        let _held: Vec<TValue> = (0..2)
                            .filter(|i| held & (1 << i) != 0)
                            .map(|i| inputs[i].clone())
                            .collect();
                        let got = BroadcastArith(arith)
                            .eval(&EvalContext::out_of_plan(), inputs)
                            .unwrap();
                        let case = format!("{arith:?} {a_shape:?} {b_shape:?} held {held}");
                        let shape = broadcast(a_shape, b_shape).unwrap();
                        assert_eq!(got[0].shape(), &shape[..], "{case}");
                        let got = got[0].try_as_plain_ram().unwrap();
                        let got = got.as_slice::<f32>().unwrap();
                        assert_eq!(got.len(), want.len(), "{case}");
                        let same = got
                            .iter()
                            .zip(want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{case}");
                    }
                }
            }
        }
    }
}
