//! The bounds of greedy decoding's `lm_head` (the portable int8 kernel; tests/wasm_api runs the
//! same checks on the simd128 one).

#[path = "support/lm_head.rs"]
mod lm_head;

#[test]
fn bounds_hold_and_logits_are_the_plans() {
    lm_head::check_bounds();
}
