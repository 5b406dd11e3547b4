//! The contrib ops tract-onnx already provides, checked against onnxruntime like the ops of this
//! module: `SimplifiedLayerNormalization`, `SkipSimplifiedLayerNormalization`,
//! `SkipLayerNormalization`, `RotaryEmbedding` (com.microsoft, interleaved or not) and the
//! `DynamicQuantizeLinear` (`dynamic_quantize`) -> `MatMulInteger` path of dynamically quantized
//! (int8) exports.
//! Also the standard `DFT`, whose FFTs run on `crates/rustfft`, the stand-in for rustfft that
//! `Cargo.toml` patches in.

#[cfg(test)]
mod tests {
    use super::super::testing::check;

    #[test]
    fn simplified_layer_norm() {
        check("simplified_layer_norm");
    }

    #[test]
    fn skip_simplified_layer_norm() {
        check("skip_simplified_layer_norm");
    }

    #[test]
    fn skip_layer_norm() {
        check("skip_layer_norm");
    }

    #[test]
    fn rotary_embedding_interleaved0() {
        check("rotary_embedding_interleaved0");
    }

    #[test]
    fn rotary_embedding_interleaved1() {
        check("rotary_embedding_interleaved1");
    }

    #[test]
    fn dynamic_quantize_matmul_integer() {
        check("dynamic_quantize_matmul_integer");
    }

    #[test]
    fn dft_on_the_rustfft_stand_in() {
        check("dft_8_complex");
        check("dft_12_complex_inverse");
        check("dft_10_real");
    }
}
