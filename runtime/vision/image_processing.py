"""Image preprocessing as transformers' Qwen2-VL image processor (PIL backend) does it, with Pillow + numpy.

decode -> RGB (transparency composited on white) -> smart_resize (both sides multiples of
patch x merge, pixel count within [min_pixels, max_pixels], aspect kept) -> PIL bicubic resize of the
uint8 image -> x / 255 (computed in float64, stored float32) -> (x - mean) / std -> patches
[gh * gw, C * T * P * P] in merge-block order, the frame repeated over the temporal patch.

Images are untrusted input: the decoder sees at most `max_source_pixels` (checked from the header
before any pixel is decoded) and every failure is an ImageError with a message for a 400.
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field

import numpy as np


class ImageError(ValueError):
    """An image that cannot be used (undecodable, too large, bad shape); the message says why."""


@dataclass
class ProcessorSettings:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])

    @classmethod
    def from_vision_config(cls, v: dict) -> "ProcessorSettings":
        return cls(int(v["patch_size"]), int(v["temporal_patch_size"]), int(v["spatial_merge_size"]),
                   int(v["min_pixels"]), int(v["max_pixels"]), list(v["image_mean"]), list(v["image_std"]))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass
class PreparedImage:
    """One image ready for the vision tower."""

    patches: np.ndarray  # [t * gh * gw, C * T * P * P] float32, merge-block order
    grid: tuple  # (t, gh, gw) in patches
    digest: str  # sha256 of the resized pixels + grid: the image's identity for prefix reuse
    source_size: tuple  # (width, height) as sent

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def num_tokens(self, merge: int) -> int:
        return self.num_patches // (merge * merge)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize, operation for operation."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, max_source_pixels: int):
    """Bytes -> RGB PIL image; the size is checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"cannot decode image: {e}") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")
    if w * h > max_source_pixels:
        raise ImageError(f"image is {w}x{h} = {w * h} pixels; the limit is {max_source_pixels} per image")
    try:
        img.load()
        return to_rgb(img)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"cannot decode image: {e}") from None


def to_rgb(img):
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def prepare_image(img, s: ProcessorSettings) -> PreparedImage:
    """An RGB PIL image -> patches in the vision tower's layout."""
    from PIL import Image

    src_w, src_h = img.size
    h, w = smart_resize(src_h, src_w, s.factor, s.min_pixels, s.max_pixels)
    resized = np.asarray(img.resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)
    digest = hashlib.sha256(resized.tobytes() + np.asarray([h, w], np.int64).tobytes()).hexdigest()
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)  # [C, H, W]
    mean = np.asarray(s.image_mean, np.float32)[:, None, None]
    std = np.asarray(s.image_std, np.float32)[:, None, None]
    patches, grid = patchify((x - mean) / std, s)
    return PreparedImage(patches, grid, digest, (src_w, src_h))


def patchify(x: np.ndarray, s: ProcessorSettings) -> tuple[np.ndarray, tuple]:
    """Normalised [C, H, W] (H, W multiples of patch x merge) -> ([gh * gw, C * T * P * P] float32, (1, gh, gw))."""
    c, p, m, t = x.shape[0], s.patch_size, s.merge_size, s.temporal_patch_size
    gh, gw = x.shape[1] // p, x.shape[2] // p
    blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t,) + blocks.shape[5:])
    return np.ascontiguousarray(frames.reshape(gh * gw, c * t * p * p), dtype=np.float32), (1, gh, gw)


def resized_pixels(width: int, height: int, s: ProcessorSettings) -> int:
    """Pixels an image of this size is resized to (what the vision tower will see)."""
    h, w = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
    return h * w
