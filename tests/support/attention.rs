//! Attention fused a block of query rows at a time (`model::ops::attention`) against the ops it
//! replaces, run one after the other, bit for bit: shared by the unit tests of `attention.rs`
//! (natively) and tests/wasm_api.
#![allow(dead_code)]

use onnx_generate::model::ops::attention::fuse;
use onnx_generate::model::ops::binary::{Arith, BroadcastArith};
use onnx_generate::model::ops::matmul_runtime::RuntimeOp;
use onnx_generate::model::ops::nan_guard;
use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::logic::Iff;
use tract_onnx::tract_core::ops::math::is_nan;
use tract_onnx::tract_core::ops::nn::{Softmax, SoftmaxKind};

/// The mask added to the scores.
#[derive(Debug, Clone, Copy)]
enum Mask {
    /// `[1, 1, m, n]`: row `r` sees the past and the new positions up to its own, as a
    /// decoder's prompt; the first `.0` rows see nothing (their softmax is NaN).
    Causal(usize),
    /// Of the scores' shape, values and -inf, wired as `Add(mask, scores)`.
    Full,
    /// `[1, 1, 1, n]`: the first `.0` positions masked for every row (left padding).
    Columns(usize),
    /// `[3, .., m, n]`, a batch axis that widens the scores (the ops one after the other).
    Widening,
}

#[derive(Debug)]
struct Case {
    /// The batch and head axes of `Q`.
    lead: &'static [usize],
    /// `Q`'s heads per head of `K` and `V`.
    group: usize,
    m: usize,
    /// Positions per part of `K` and `V` (two: the cache's past and a step's new ones).
    parts: &'static [usize],
    d: usize,
    e: usize,
    trans_b: bool,
    mask: Option<Mask>,
    /// `Where(IsNaN(p), 0, p)` after the softmax.
    guard: bool,
}

const CASES: &[Case] = &[
    // Whisper's encoder: several blocks, no mask or guard.
    Case {
        lead: &[2],
        group: 1,
        m: 150,
        parts: &[1500],
        d: 64,
        e: 64,
        trans_b: true,
        mask: None,
        guard: false,
    },
    Case {
        lead: &[1, 2],
        group: 1,
        m: 70,
        parts: &[300],
        d: 12,
        e: 8,
        trans_b: false,
        mask: None,
        guard: false,
    },
    Case {
        lead: &[3],
        group: 1,
        m: 9,
        parts: &[40],
        d: 4,
        e: 4,
        trans_b: true,
        mask: None,
        guard: false,
    },
    // A decoder's prompt after a past (SmolLM2: grouped heads, the cache in two parts, the
    // causal mask, the guard), over several blocks, the first (and more rows) masked entirely.
    Case {
        lead: &[1, 6],
        group: 3,
        m: 150,
        parts: &[850, 150],
        d: 8,
        e: 12,
        trans_b: true,
        mask: Some(Mask::Causal(70)),
        guard: true,
    },
    // A first prompt: no past, a position count that is not a multiple of 4, two blocks (the
    // first sees 216 positions of 301, which its products leave out past that).
    Case {
        lead: &[1, 4],
        group: 2,
        m: 301,
        parts: &[0, 301],
        d: 64,
        e: 16,
        trans_b: true,
        mask: Some(Mask::Causal(0)),
        guard: true,
    },
    Case {
        lead: &[2, 4],
        group: 2,
        m: 9,
        parts: &[31],
        d: 4,
        e: 4,
        trans_b: true,
        mask: Some(Mask::Full),
        guard: true,
    },
    Case {
        lead: &[1, 2],
        group: 1,
        m: 70,
        parts: &[301],
        d: 12,
        e: 8,
        trans_b: false,
        mask: Some(Mask::Columns(5)),
        guard: false,
    },
    // The ops one after the other: a mask that widens the scores; fewer rows than a prompt's
    // (a decoding step, the cache in two parts); rows a prompt's fewest.
    Case {
        lead: &[1, 2],
        group: 1,
        m: 8,
        parts: &[20],
        d: 4,
        e: 4,
        trans_b: true,
        mask: Some(Mask::Widening),
        guard: true,
    },
    Case {
        lead: &[1, 6],
        group: 3,
        m: 1,
        parts: &[20, 1],
        d: 8,
        e: 8,
        trans_b: true,
        mask: Some(Mask::Causal(0)),
        guard: true,
    },
    Case {
        lead: &[1, 6],
        group: 3,
        m: 4,
        parts: &[20, 4],
        d: 8,
        e: 8,
        trans_b: true,
        mask: Some(Mask::Causal(0)),
        guard: true,
    },
];

impl Case {
    /// The model of the ops one after the other (its guard already `NanTo`).
    fn model(&self, next: &mut impl FnMut() -> f32) -> TypedModel {
        let (m, d, e) = (self.m, self.d, self.e);
        let n: usize = self.parts.iter().sum();
        let mut tensor = |shape: &[usize]| {
            let v: Vec<f32> = (0..shape.iter().product()).map(|_| next()).collect();
            Tensor::from_shape(shape, &v).unwrap()
        };
        let shape = |heads_by: usize, last2: [usize; 2]| {
            let mut s = [self.lead, &last2[..]].concat();
            s[self.lead.len() - 1] /= heads_by;
            s
        };
        let mut model = TypedModel::default();
        let q = model.add_const("q", tensor(&shape(1, [m, d]))).unwrap();
        let (mut keys, mut values) = (vec![], vec![]);
        for (i, &p) in self.parts.iter().enumerate() {
            let k = tensor(&shape(
                self.group,
                if self.trans_b { [p, d] } else { [d, p] },
            ));
            keys.push(model.add_const(format!("k{i}"), k).unwrap());
            let v = tensor(&shape(self.group, [p, e]));
            values.push(model.add_const(format!("v{i}"), v).unwrap());
        }
        let split_b = self.parts.len() > 1;
        let product = |trans_b| RuntimeOp {
            trans_b,
            group: self.group,
            split_b,
        };
        let inputs = [&[q][..], &keys].concat();
        let mut s = model
            .wire_node("qk", product(self.trans_b), &inputs)
            .unwrap()[0];
        let rank = self.lead.len() + 2;
        if let Some(mask) = self.mask {
            let past = self.parts[0] * split_b as usize;
            let masked = |r: usize, j: usize| match mask {
                Mask::Causal(rows) => r < rows || j > past + r,
                Mask::Columns(cols) => j < cols,
                Mask::Full | Mask::Widening => (r * 7 + j * 3).is_multiple_of(5),
            };
            let mut mshape = vec![1; rank];
            (mshape[rank - 2], mshape[rank - 1]) = (m, n);
            match mask {
                Mask::Full => mshape = shape(1, [m, n]),
                Mask::Columns(_) => mshape[rank - 2] = 1,
                Mask::Widening => mshape[0] = 3,
                Mask::Causal(_) => {}
            }
            let mut t = tensor(&mshape);
            let (rows, cols) = (mshape[rank - 2], mshape[rank - 1]);
            let mut plain = t.try_as_plain_ram_mut().unwrap();
            let values = plain.as_slice_mut::<f32>().unwrap();
            for (i, v) in values.iter_mut().enumerate() {
                let (r, j) = ((i / cols) % rows, i % cols);
                *v = if masked(r, j) {
                    f32::NEG_INFINITY
                } else if matches!(mask, Mask::Full | Mask::Widening) {
                    *v
                } else {
                    0.0
                };
            }
            let mask_in = model.add_const("mask", t).unwrap();
            let add = BroadcastArith(Arith::Add);
            let operands = match mask {
                Mask::Full => [mask_in, s],
                _ => [s, mask_in],
            };
            s = model.wire_node("masked", add, &operands).unwrap()[0];
        }
        let softmax = Softmax::new(tvec![rank - 1], None, SoftmaxKind::Softmax);
        let mut p = model.wire_node("softmax", softmax, &[s]).unwrap()[0];
        if self.guard {
            let nan = model.wire_node("isnan", is_nan(), &[p]).unwrap()[0];
            let zero = Tensor::from_shape(&vec![1; rank], &[0f32]).unwrap();
            let zero = model.add_const("zero", zero).unwrap();
            p = model.wire_node("guard", Iff, &[nan, zero, p]).unwrap()[0];
            assert_eq!(nan_guard::fuse(&mut model).unwrap(), 1, "{self:?}");
        }
        let inputs = [&[p][..], &values].concat();
        let y = model.wire_node("pv", product(false), &inputs).unwrap();
        model.select_output_outlets(&y).unwrap();
        model
    }
}

fn run(model: TypedModel) -> Vec<f32> {
    let out = model
        .into_runnable()
        .unwrap()
        .run(tvec!())
        .unwrap()
        .remove(0);
    out.try_as_plain_ram()
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

/// Every case, fused and not: the plan runs the fused op and no softmax, and its outputs are
/// the bits of the ops one after the other.
pub fn check_fused_attention() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) % 2001) as f32 / 1000.0 - 1.0
    };
    for case in CASES {
        let mut model = case.model(&mut next);
        let before = run(model.clone());
        assert_eq!(fuse(&mut model).unwrap(), 1, "{case:?}");
        let order = model.eval_order().unwrap();
        let ops: Vec<_> = order.iter().map(|&n| model.node(n).op.name()).collect();
        assert!(
            ops.iter()
                .all(|o| !["Softmax", "NanTo", "BroadcastArithAdd"].contains(&o.as_ref())),
            "{case:?}: {ops:?}"
        );
        let after = run(model);
        assert_eq!(before.len(), after.len(), "{case:?}");
        assert!(before.iter().all(|v| v.is_finite()), "{case:?}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&before), bits(&after), "{case:?}");
    }
}
