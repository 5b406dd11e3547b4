// Decoding a PCM WAV file to mono Float32Array samples in Node (the tests and the benchmark
// read tests/fixtures/whisper/beckett.wav; a page would use AudioContext.decodeAudioData).

/** `{ pcm: Float32Array, rate }` of a 16-bit PCM or 32-bit float WAV file (channels averaged). */
export function readWav(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const tag = (at) => String.fromCharCode(...bytes.subarray(at, at + 4));
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new Error("not a RIFF/WAVE file");
  let format = null;
  for (let at = 12; at + 8 <= bytes.length; ) {
    const id = tag(at);
    const len = view.getUint32(at + 4, true);
    const body = at + 8;
    if (id === "fmt ") {
      format = {
        code: view.getUint16(body, true),
        channels: view.getUint16(body + 2, true),
        rate: view.getUint32(body + 4, true),
        bits: view.getUint16(body + 14, true),
      };
    } else if (id === "data") {
      if (!format) throw new Error("WAVE data before its format");
      const { code, channels, rate, bits } = format;
      const width = bits / 8;
      const frames = Math.floor(Math.min(len, bytes.length - body) / (width * channels));
      const pcm = new Float32Array(frames);
      for (let i = 0; i < frames; i++) {
        let sum = 0;
        for (let c = 0; c < channels; c++) {
          const p = body + (i * channels + c) * width;
          if (code === 1 && bits === 16) sum += view.getInt16(p, true) / 32768;
          else if (code === 3 && bits === 32) sum += view.getFloat32(p, true);
          else throw new Error(`unsupported WAVE format ${code} with ${bits} bits`);
        }
        pcm[i] = sum / channels;
      }
      return { pcm, rate };
    }
    at = body + len + (len & 1);
  }
  throw new Error("the WAVE file has no data chunk");
}
