//! `MatMulNBits` decoding with the 16-bit row (the portable kernel; tests/wasm_api runs the same
//! check on the simd128 kernel).

#[path = "support/nbits.rs"]
mod nbits;

#[test]
fn q4_decode_is_within_the_rounding_bound() {
    nbits::check_q4_decode();
}
