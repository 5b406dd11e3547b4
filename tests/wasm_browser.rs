//! The JavaScript API tests (tests/wasm_api) in headless Chromium (chromedriver and
//! webdriver.json): run by scripts/test-wasm.sh, which fails when no test ran.
#![cfg(target_arch = "wasm32")]

wasm_bindgen_test::wasm_bindgen_test_configure!(run_in_browser);

mod wasm_api;
