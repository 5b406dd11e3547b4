// A small typed program over the package's declarations; `tsc --noEmit -p js-tests` checks it.
import init, {
  Model,
  type GenerateOptions,
  type GenerateResult,
  type TokenEvent,
  type LoadProgress,
  type ChatMessage,
  type LogitsProcessor,
  type TranscribeOptions,
  type TranscribeResult,
} from "onnx-generate";

// A processor may also return a new array of the same length.
const noRepeatLast: LogitsProcessor = (tokenIds, logits) => {
  const out = Float32Array.from(logits);
  out[tokenIds[tokenIds.length - 1]] = -Infinity;
  return out;
};

export async function demo(base: string, signal: AbortSignal): Promise<string> {
  await init();
  const model: Model = await Model.fromUrl(base, {
    on_progress: (p: LoadProgress) => console.log(p.file, p.loaded, p.total ?? "?"),
  });
  const options: GenerateOptions = {
    max_new_tokens: 32,
    do_sample: true,
    temperature: 0.7,
    top_k: 50,
    top_p: 0.9,
    seed: 42,
    signal,
    logits_processor: [
      (tokenIds: Uint32Array, logits: Float32Array): void => {
        if (tokenIds.length > 40) logits[0] = -Infinity;
      },
      noRepeatLast,
    ],
    on_token: (e: TokenEvent) => {
      if (e.finished) console.log(e.row, e.finish_reason);
    },
  };
  const chat: ChatMessage[] = [{ role: "user", content: "Hello!" }];
  const result: GenerateResult = await model.generate(chat, options);
  const ids: number[] = result.token_ids;
  for await (const event of model.stream("Once upon a time", { max_new_tokens: 8 })) {
    const delta: string = event.text;
    console.log(delta, event.token_id);
  }
  const body = new Response(model.readable([1, 2, 3], { max_new_tokens: 4 }));
  console.log(await body.text(), ids.length, model.vocabSize, model.hasChatTemplate);
  model.free();
  return result.text + result.finish_reason;
}

export async function transcribe(base: string, pcm: Float32Array, rate: number): Promise<string> {
  const whisper: Model = await Model.fromUrl(base);
  const options: TranscribeOptions = {
    language: "en",
    task: "transcribe",
    sampling_rate: rate,
    max_new_tokens: 64,
    on_token: (e: TokenEvent) => console.log(e.row, e.text),
  };
  const result: TranscribeResult = await whisper.transcribe(pcm, options);
  const windows: number = result.sequences.length;
  whisper.free();
  return `${result.text} (${windows} windows, ${result.finish_reason})`;
}
