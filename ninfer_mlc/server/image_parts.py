"""Image content of chat requests: OpenAI `image_url` parts and Anthropic `image` blocks -> ImageRef.

Parsing only records where each image comes from (inline bytes, or an http(s) URL) and leaves the
chat template's marker in the message text at the image's place; fetching and decoding happen in
server/vision.py under the server's limits.
"""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any, Optional

from .errors import bad_request

# what Qwen3.5's chat template renders for an image item (one placeholder; expanded per patch later)
VISION_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp", "image/bmp", "image/tiff"}


@dataclass
class ImageRef:
    param: str  # request field it came from (for error messages)
    data: Optional[bytes] = None  # inline bytes
    url: Optional[str] = None  # http(s) URL to fetch


def _b64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: image data is not valid base64", param=param) from None


def image_from_url(url: Any, param: str) -> ImageRef:
    """A data: URL (decoded now) or an http(s) URL (fetched later)."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param} must be a non-empty string", param=param)
    if url.startswith("data:"):
        m = _DATA_URL.fullmatch(url)
        if m is None:
            raise bad_request(f"{param}: only base64 data URLs are supported", param=param)
        if m.group("type") and m.group("type").lower() not in MEDIA_TYPES:
            raise bad_request(f"{param}: media type {m.group('type')!r} is not an image type", param=param)
        return ImageRef(param, data=_b64(m.group("data"), param))
    if url.startswith(("http://", "https://")):
        return ImageRef(param, url=url)
    raise bad_request(f"{param}: image URLs must be data:, http:// or https://", param=param)


def openai_image_part(part: dict, param: str) -> ImageRef:
    """{"type": "image_url", "image_url": {"url": ...}} (or the bare-string form, or Responses-style input_image)."""
    ptype = part.get("type")
    field = part.get("image_url")
    if isinstance(field, dict):
        return image_from_url(field.get("url"), f"{param}.image_url.url")
    if isinstance(field, str):
        return image_from_url(field, f"{param}.image_url")
    if ptype == "input_image" and isinstance(part.get("file_id"), str):
        raise bad_request(f"{param}: file_id images are not supported; send a data or http(s) URL", param=param)
    raise bad_request(f"{param}.image_url must be an object with a url", param=f"{param}.image_url")


def anthropic_image_block(block: dict, param: str) -> ImageRef:
    """{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}."""
    src = block.get("source")
    p = f"{param}.source"
    if not isinstance(src, dict):
        raise bad_request(f"{p} must be an object", param=p)
    kind = src.get("type")
    if kind == "base64":
        mt = src.get("media_type")
        if not isinstance(mt, str) or mt.lower() not in MEDIA_TYPES:
            raise bad_request(f"{p}.media_type must be one of {sorted(MEDIA_TYPES)}", param=f"{p}.media_type")
        if not isinstance(src.get("data"), str):
            raise bad_request(f"{p}.data must be a base64 string", param=f"{p}.data")
        return ImageRef(param, data=_b64(src["data"], f"{p}.data"))
    if kind == "url":
        return image_from_url(src.get("url"), f"{p}.url")
    raise bad_request(f"{p}.type must be 'base64' or 'url', got {kind!r}", param=f"{p}.type")
