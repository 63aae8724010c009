"""OpenAI request parsing and validation, and incremental detokenization with stop strings.

Requests are decoded with msgspec into typed structs; any decoding or validation failure becomes an
``InvalidRequestError`` (HTTP 400, OpenAI error JSON). Unknown request fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from common.errors import InvalidRequestError
from common.tokenization import Tokenizer

MAX_SEED = (1 << 63) - 1
T = TypeVar("T")


class StreamOptions(msgspec.Struct, frozen=True):
    """``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    n: int = 1
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregation handshake (``common.pd_protocol.KVTransferParams``)."""
    bootstrap_host: str | None = None
    """SGLang's disaggregation handshake (``common.pd_protocol.BootstrapRequest``), single prompt."""
    bootstrap_port: int | None = None
    bootstrap_room: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element list of strings."""

    prompt: str | list[Any]


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[Any]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into ``kind``.

    Raises:
        InvalidRequestError: malformed JSON or a field of the wrong type (the message names the field).
    """
    if not body:
        raise InvalidRequestError("request body is empty")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"malformed JSON: {exc}") from exc


def validate_sampling(req: SamplingFields) -> None:
    """Range checks shared by both endpoints.

    Raises:
        InvalidRequestError: ``n != 1``, a negative temperature, ``top_p`` outside (0, 1], a seed out of range,
            an empty ``cache_salt`` (refused as vLLM refuses it).
    """
    if req.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
    if req.cache_salt == "":
        raise InvalidRequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    if req.temperature is not None and req.temperature < 0:
        raise InvalidRequestError("temperature must be >= 0", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    if req.seed is not None and not -MAX_SEED <= req.seed <= MAX_SEED:
        raise InvalidRequestError("seed out of range", param="seed")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings.

    Raises:
        InvalidRequestError: an empty stop string or more than 4... no limit but empty strings are refused.
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in items):
        raise InvalidRequestError("stop strings must be non-empty", param="stop")
    return items


def error_body(message: str, err_type: str, param: str | None, code: str | int | None) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class IncrementalDetokenizer:
    """Turns sampled ids into text deltas, holding back partial UTF-8 and possible stop-string prefixes.

    Decoding follows vLLM's prefix/read offsets: the delta is ``decode(ids[prefix:]) - decode(ids[prefix:read])``
    and is released only when it does not end in U+FFFD (an incomplete character). With stop strings, the last
    ``max(len(stop)) - 1`` characters are held back until the request finishes; a stop string found truncates
    the text before it (the stop string is not included, as in OpenAI).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], is_final: bool) -> str:
        """Add tokens; returns the new text to send (possibly empty). Sets ``stopped`` when a stop string hit."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        if token_ids:
            prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
            new_text = self._tok.decode(self._ids[self._prefix :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta = new_text[len(prefix_text) :]
                start = max(0, len(self.text) - self._holdback)
                self.text += delta
                self._prefix, self._read = self._read, len(self._ids)
                for s in self._stop:
                    i = self.text.find(s, start)
                    if i >= 0:
                        self.text = self.text[:i]
                        self.stopped = True
                        is_final = True
        end = len(self.text) if is_final else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
