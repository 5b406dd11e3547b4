// The tiny llama test fixture, bundled into the Worker (wrangler's Data rule gives each file as an
// ArrayBuffer, the Text rule the chat template as a string). The fixture has no chat template of
// its own: SmolLM2's makes chat requests work. A real deployment loads its model from R2 or a URL
// instead (src/index.js) and can drop this import.
import model from "../../../tests/fixtures/models/llama/model.onnx";
import config from "../../../tests/fixtures/models/llama/config.json";
import generationConfig from "../../../tests/fixtures/models/llama/generation_config.json";
import tokenizer from "../../../tests/fixtures/models/llama/tokenizer.json";
import tokenizerConfig from "../../../tests/fixtures/models/llama/tokenizer_config.json";
import chatTemplate from "../../../tests/fixtures/chat/smollm2.jinja";

export const fixtureFiles = () => ({
  model,
  model_name: "model.onnx",
  config,
  generation_config: generationConfig,
  tokenizer,
  tokenizer_config: tokenizerConfig,
  chat_template: chatTemplate,
});
