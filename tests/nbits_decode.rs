//! `MatMulNBits` decoding with the 16-bit row and prompts through dequantized weights (the
//! portable kernels; tests/wasm_api runs the same checks on the simd128 kernels).

#[path = "support/nbits.rs"]
mod nbits;

#[test]
fn q4_decode_is_within_the_rounding_bound() {
    nbits::check_q4_decode();
}

#[test]
fn prompt_is_within_the_rounding_bound() {
    nbits::check_prompt();
}

#[test]
fn weights_in_lanes_give_the_same_outputs() {
    nbits::check_lanes();
}
