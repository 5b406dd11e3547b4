"""Pillow's resizes of the VLM fixture images, the reference of src/vision/resize.rs.

Writes tests/fixtures/vlm/resize/NAME_WxH_FILTER.npy (uint8 HWC) and index.json. Run with a
Python that has Pillow 12 and numpy: python tests/tools/resize_reference.py
"""
import json
import pathlib

import numpy as np
from PIL import Image

root = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "vlm"
out = root / "resize"
out.mkdir(exist_ok=True)
filters = {"lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}
sizes = [(64, 64, "lanczos"), (32, 32, "lanczos"), (26, 64, "lanczos"), (32, 16, "bicubic"),
         (17, 9, "bicubic"), (50, 7, "bilinear")]
index = []
for name in ["noise_32x32", "gradient_24x40", "noise_20x30"]:
    image = np.load(root / "golden" / "images" / f"{name}.npy")
    for width, height, f in sizes:
        resized = np.array(Image.fromarray(image).resize((width, height), resample=filters[f]))
        file = f"{name}_{width}x{height}_{f}.npy"
        np.save(out / file, resized)
        index.append({"image": f"golden/images/{name}.npy", "width": width, "height": height,
                      "filter": f, "file": f"resize/{file}"})
(out / "index.json").write_text(json.dumps({"pillow": Image.__version__, "cases": index}, indent=1))
