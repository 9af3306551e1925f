"""`POST /v1/audio/transcriptions`: multipart form in, a deterministic transcript out.

The text is cut from the seeded answer text at an offset chosen by a digest of the audio bytes
(one token per 256 bytes, 8 to 448 tokens), so the same file always gives the same transcript.
Usage reports the audio's duration in whole seconds: from the header of a WAV file, else
estimated as 16 kHz 16-bit mono. Cheap: no engine time. Formats `json` (default), `text` and
`verbose_json`.
"""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
import io
import math
import wave
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from loadtest.emulator.config import EmulatorConfig
from loadtest.emulator.errors import ApiError
from loadtest.emulator.protocol import check_model
from loadtest.emulator.web import json_response, read_body, worker_of
from loadtest.emulator.worker import EmulatedWorker

router = APIRouter()
MAX_AUDIO_BYTES = 25 * 1024 * 1024  # vLLM's default VLLM_MAX_AUDIO_CLIP_FILESIZE_MB
_FORMATS = ("json", "text", "verbose_json")
_ASSUMED_BYTES_PER_S = 32_000  # 16 kHz, 16-bit, mono


@dataclass(frozen=True, slots=True)
class Form:
    """The fields of a multipart form: text fields, and the `file` part's bytes."""

    fields: dict[str, str]
    file: bytes | None


def parse_form(content_type: str, raw: bytes) -> Form:
    """Parse `multipart/form-data` with the standard library's MIME parser."""
    if not content_type.startswith("multipart/form-data"):
        raise ApiError.bad_request("the request must be multipart/form-data")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not msg.is_multipart():
        raise ApiError.bad_request("malformed multipart body")
    fields: dict[str, str] = {}
    file: bytes | None = None
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(payload, bytes):
            continue
        if name == "file":
            file = payload
        else:
            fields[name] = payload.decode("utf-8", errors="replace")
    return Form(fields, file)


def duration_s(audio: bytes) -> float:
    """The length of a WAV file from its header; other formats are estimated from their size."""
    try:
        with wave.open(io.BytesIO(audio)) as wav:
            frames: int = wav.getnframes()
            rate: int = wav.getframerate()
            return frames / float(rate)
    except (wave.Error, EOFError, ZeroDivisionError):
        return len(audio) / _ASSUMED_BYTES_PER_S


def transcript(w: EmulatedWorker, audio: bytes) -> str:
    """A deterministic text for `audio`."""
    n_tokens = max(8, min(448, len(audio) // 256))
    digest = np.frombuffer(hashlib.blake2b(audio, digest_size=16).digest(), dtype=np.uint8).astype(np.int64)
    return w.answers.text_answer(digest, n_tokens).text.strip()


def _model(form: Form, cfg: EmulatorConfig) -> str:
    return check_model({"model": form.fields["model"]} if "model" in form.fields else {}, cfg)


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    raw = await read_body(request, MAX_AUDIO_BYTES)
    form = parse_form(request.headers.get("content-type", ""), raw)
    w = worker_of(request)
    _model(form, w.cfg)
    if not form.file:
        raise ApiError.bad_request("file is required (the audio file, as a form part)", "file")
    fmt = form.fields.get("response_format", "json")
    if fmt not in _FORMATS:
        raise ApiError.bad_request(f"response_format must be one of {', '.join(_FORMATS)}", "response_format")
    if form.fields.get("stream", "false").lower() == "true":
        raise ApiError.bad_request("streamed transcription is not supported by the emulated worker", "stream")
    text = transcript(w, form.file)
    seconds = duration_s(form.file)
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "verbose_json":
        language = form.fields.get("language", "en")
        segment = {
            "id": 0, "seek": 0, "start": 0.0, "end": round(seconds, 3), "text": text, "tokens": [],
            "temperature": 0.0, "avg_logprob": -0.1, "compression_ratio": 1.0, "no_speech_prob": 0.0,
        }  # fmt: skip
        return json_response(
            {
                "duration": f"{seconds:.3f}",
                "language": language,
                "text": text,
                "segments": [segment],
                "words": None,
            }
        )
    return json_response({"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}})
