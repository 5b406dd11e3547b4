//! The JavaScript API tests (tests/wasm_api) in Node: run by scripts/test-wasm.sh with
//! `wasm-bindgen-test-runner` as the cargo runner for wasm32.
#![cfg(target_arch = "wasm32")]

mod wasm_api;
