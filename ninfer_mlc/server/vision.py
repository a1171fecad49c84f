"""Images of a chat request -> the engine's media payload, under the server's limits.

Per request: at most `max_images` images; each fetched (http(s): one total deadline, a byte limit,
redirects only to http(s)) or taken inline, at most `max_image_bytes` and `max_image_pixels` as
sent (checked from the header before decoding); the pixels the vision tower will see (after
smart_resize) summed over the request at most `max_request_pixels`. Beyond any limit: a 400 that
says which. Decoding and preprocessing run off the event loop; with the tower on the CPU
(--vision-cpu) the embeddings are computed here too, before the request queues, so the engine
thread never waits for a ViT on host cores (on the GPU the engine runs it at prefill time).
"""
from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

from starlette.concurrency import run_in_threadpool

from ..runtime.vision.image_processing import ImageError, decode_image, prepare_image, resized_pixels
from ..runtime.vision.media import MediaInput, build_media
from ..runtime.vision.mrope import MediaLayoutError
from .errors import bad_request
from .image_parts import ImageRef


@dataclass
class VisionLimits:
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 50_000_000  # per image as sent (decoded size)
    max_request_pixels: int = 1 << 25  # per request, after resizing (what the vision tower computes)
    fetch_timeout_s: float = 10.0


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.startswith(("http://", "https://")):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_url(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET url with one deadline for the whole transfer and a byte limit (blocking)."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    req = urllib.request.Request(url, headers={"User-Agent": "ninfer-mlc", "Accept": "image/*"})
    with opener.open(req, timeout=timeout_s) as resp:
        length = resp.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise ImageError(f"image is {int(length)} bytes; the limit is {max_bytes}")
        chunks: list[bytes] = []
        total = 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fetching the image took longer than {timeout_s:g}s")
            chunk = resp.read(1 << 16)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise ImageError(f"image is larger than the limit of {max_bytes} bytes")
            chunks.append(chunk)


class VisionService:
    """What the HTTP layer needs for images: the encoder (runtime/vision_encoder.py), limits, counters."""

    def __init__(self, encoder, tokenizer, limits: Optional[VisionLimits] = None):
        self.encoder = encoder
        self.settings = encoder.settings
        self.limits = limits or VisionLimits()
        c = encoder.config
        self.pad_id = int(c["image_token_id"])
        for text, tid in (("<|vision_start|>", c["vision_start_token_id"]), ("<|image_pad|>", c["image_token_id"]),
                          ("<|vision_end|>", c["vision_end_token_id"])):
            if tokenizer.token_to_id(text) != int(tid):
                raise ValueError(f"tokenizer maps {text} to {tokenizer.token_to_id(text)}, the model expects {tid}")

    async def _bytes(self, ref: ImageRef) -> bytes:
        lim = self.limits
        if ref.data is not None:
            if len(ref.data) > lim.max_image_bytes:
                raise bad_request(f"{ref.param}: image is {len(ref.data)} bytes; the limit is {lim.max_image_bytes}",
                                  param=ref.param)
            return ref.data
        assert ref.url is not None  # an ImageRef holds either inline data or a URL (image_parts.py)
        t0 = time.perf_counter()
        try:
            data = await run_in_threadpool(fetch_url, ref.url, lim.max_image_bytes, lim.fetch_timeout_s)
        except ImageError as e:
            raise bad_request(f"{ref.param}: {e}", param=ref.param) from None
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise bad_request(f"{ref.param}: cannot fetch image {ref.url!r}: {reason}", param=ref.param) from None
        self.encoder.note(fetch_ms_total=(time.perf_counter() - t0) * 1000)
        return data

    def _prepare(self, blobs: list[tuple[ImageRef, bytes]]):
        lim, total, out = self.limits, 0, []
        for ref, data in blobs:
            try:
                img = decode_image(data, lim.max_image_pixels)
                total += resized_pixels(img.size[0], img.size[1], self.settings)
                if total > lim.max_request_pixels:
                    raise ImageError(f"the request's images come to {total} pixels after resizing; the limit is "
                                     f"{lim.max_request_pixels} per request")
                out.append(prepare_image(img, self.settings))
            except ImageError as e:
                raise bad_request(f"{ref.param}: {e}", param=ref.param) from None
        return out

    async def media_for(self, prompt_ids: list[int], refs: list[ImageRef], encode: bool = True
                        ) -> tuple[list[int], MediaInput]:
        """(prompt ids with one placeholder per merged patch, the engine's media payload).
        encode=False: layout only (token counting), no embeddings and no request counters."""
        if len(refs) > self.limits.max_images:
            self.encoder.note(requests_rejected=1)
            raise bad_request(f"{len(refs)} images in one request; the limit is {self.limits.max_images}",
                              param="messages")
        try:
            blobs = list(zip(refs, await asyncio.gather(*(self._bytes(r) for r in refs))))
            t0 = time.perf_counter()
            images = await run_in_threadpool(self._prepare, blobs)
            ids, media = build_media(prompt_ids, images, self.pad_id, self.settings.merge_size)
        except MediaLayoutError as e:
            self.encoder.note(requests_rejected=1)
            raise bad_request(str(e), param="messages") from None
        except Exception:
            self.encoder.note(requests_rejected=1)
            raise
        self.encoder.note(preprocess_ms_total=(time.perf_counter() - t0) * 1000)
        if encode and self.encoder.device_kind == "cpu":  # --vision-cpu: the ViT runs here, not on the engine thread
            await run_in_threadpool(media.ensure_embeddings, self.encoder)
        if encode:
            self.encoder.note(requests_with_images=1, images=len(images), image_tokens=media.num_image_tokens)
        return ids, media


def vision_service(opts, engine) -> Optional[VisionService]:
    """The server's image handling (opts: server/options.py VisionOptions) for an engine whose runner has
    a vision encoder (else None: a text-only model, or EngineConfig.vision off)."""
    encoder = engine.runner.vision
    if encoder is None:
        return None
    limits = VisionLimits(
        max_images=opts.max_images_per_request,
        max_image_bytes=int(opts.max_image_mib * (1 << 20)),
        max_image_pixels=opts.max_image_pixels,
        max_request_pixels=opts.max_request_image_pixels,
        fetch_timeout_s=opts.image_fetch_timeout)
    for name, v in limits.__dict__.items():
        if v <= 0:
            raise ValueError(f"vision limit {name} must be positive, got {v}")
    return VisionService(encoder, engine.tok, limits)
