"""Tokenizers and chat templates shared by the reference worker and the gateway.

The gateway must produce exactly the worker's prompt tokens (the honesty check in DESIGN.md §7b compares the
cached tokens it predicts with the ones the worker reports), so both import this module and call the same
functions: ``load_tokenizer`` / ``load_chat_template`` to build, then ``encode_chat`` (or ``render_segments`` +
``encode_segments`` for incremental work) for chat and ``encode_prompt`` for completions.

Tokenizers:

* ``ByteTokenizer`` (default, no files): one token per UTF-8 byte (ids 0..255) plus special tokens (ids 256..).
  A special token's text (e.g. ``<|im_start|>``) anywhere in the input becomes its single id.
* ``HFTokenizer``: a ``tokenizer.json`` through the ``tokenizers`` library, encoded with
  ``add_special_tokens=False`` (the chat template writes BOS itself, as ``apply_chat_template`` does).

Chat templates:

* ``DefaultChatTemplate``: ChatML-shaped text, one segment per message::

      <|im_start|>{role}\\n{content}<|im_end|>\\n        (per message)
      <|im_start|>assistant\\n                          (generation prompt)

* ``JinjaChatTemplate``: the ``chat_template`` string of ``tokenizer_config.json`` or a ``chat_template.jinja``
  file, rendered with ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``.

Incremental tokenization (segments):

``render_segments(messages)`` returns one text segment per message plus a final generation-prompt segment, such
that ``"".join(segments)`` is exactly the full rendering and segment ``i`` depends only on ``messages[: i + 1]``.
A gateway can therefore cache the tokens of each segment keyed by the message prefix and only tokenize the new
messages of each turn. **The token ids of a chat are defined as the concatenation of the per-segment token
ids** (``encode_segments``); the worker tokenizes chats this way too, so gateway and worker always agree.

When per-segment tokenization equals whole-prompt tokenization (``tokenizer.encode("".join(segments))``):

* ``ByteTokenizer`` + ``DefaultChatTemplate``: always. Every default segment ends with ``"\\n"``, which no
  special token contains, so no special token can straddle a segment boundary, and bytes are encoded
  independently.
* ``ByteTokenizer`` + Jinja: whenever no special token's text straddles a segment boundary.
* ``HFTokenizer``: whenever each boundary falls next to a special (added) token, because added tokens are split
  out before the BPE pre-tokenizer runs (true of Llama-3's ``<|eot_id|>``, ChatML's ``<|im_end|>`` followed by a
  newline is *not* guaranteed: a BPE may merge ``"\\n"`` with the next text). ``segments_match_whole(...)``
  checks it for a concrete chat; ``check_template(...)`` runs it on a probe conversation at startup and the
  worker logs a warning when it fails (the agreement with the gateway still holds, since both use segments).

Jinja segmentation: segment ``i`` is ``render(messages[: i + 1]) - render(messages[: i])`` (string difference,
no generation prompt) and the last segment is ``render(messages, True) - render(messages, False)``. Templates
whose earlier text depends on later messages (e.g. ones that strip reasoning from past assistant turns, or that
raise unless the last message is a user's) break the prefix property; then the whole rendering becomes a single
segment (correct, just not incremental), and ``RenderedChat.is_incremental`` is False.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.sandbox
import msgspec

from common.errors import InvalidRequestError, TokenizerLoadError

logger = logging.getLogger(__name__)

NUM_BYTE_TOKENS = 256
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Special tokens of the byte tokenizer, ids 256, 257, ... in this order."""


class Tokenizer(Protocol):
    """What the worker and the gateway need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (ids are ``0 .. vocab_size - 1``)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, or ``None`` if the tokenizer has none."""
        ...

    @property
    def bos_token(self) -> str:
        """Text of the beginning-of-sequence token (``""`` if none)."""
        ...

    @property
    def eos_token(self) -> str:
        """Text of the end-of-sequence token (``""`` if none)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special token texts included, no BOS/EOS added."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; special tokens are dropped, invalid UTF-8 replaced."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255) plus special tokens (ids 256.. in ``special_tokens`` order).

    Encoding is a pure function of the text and is homomorphic over concatenation except where a special
    token's text straddles the join. Needs no files.
    """

    def __init__(self, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS) -> None:
        """Build the tokenizer.

        Args:
            special_tokens: texts of special tokens, given ids 256, 257, ... in order. The first two are BOS and
                EOS.

        Raises:
            ValueError: an empty or repeated special token.
        """
        if len(set(special_tokens)) != len(special_tokens) or any(not s for s in special_tokens):
            raise ValueError("special tokens must be distinct and non-empty")
        self._special_ids = {text: NUM_BYTE_TOKENS + i for i, text in enumerate(special_tokens)}
        self._special_texts = {i: text for text, i in self._special_ids.items()}
        self._specials = tuple(special_tokens)
        ordered = sorted(special_tokens, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(re.escape(s) for s in ordered) + ")") if ordered else None

    @property
    def vocab_size(self) -> int:
        """256 byte ids plus the special tokens."""
        return NUM_BYTE_TOKENS + len(self._specials)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the second special token (``<|eos|>`` by default)."""
        return NUM_BYTE_TOKENS + 1 if len(self._specials) > 1 else None

    @property
    def bos_token(self) -> str:
        """Text of the first special token."""
        return self._specials[0] if self._specials else ""

    @property
    def eos_token(self) -> str:
        """Text of the second special token."""
        return self._specials[1] if len(self._specials) > 1 else ""

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, with special token texts mapped to their single ids."""
        if self._split_re is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for i, part in enumerate(self._split_re.split(text)):
            if i % 2:
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Texts of the special tokens, in id order."""
        return self._specials

    def decode(self, token_ids: Sequence[int]) -> str:
        """Bytes back to text; special ids and out-of-range ids are dropped."""
        return bytes(t for t in token_ids if 0 <= t < NUM_BYTE_TOKENS).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_token: str = "", eos_token: str = "") -> None:
        """Load ``path``.

        Args:
            path: a ``tokenizer.json`` file.
            bos_token: BOS text (from ``tokenizer_config.json``), given to chat templates.
            eos_token: EOS text; its id ends generation.

        Raises:
            TokenizerLoadError: the file is missing or not a tokenizer.
        """
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception subclass
            raise TokenizerLoadError(f"cannot load tokenizer {path}: {exc}") from exc
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._eos_id = self._tok.token_to_id(eos_token) if eos_token else None

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        """Id of ``eos_token``, if it is in the vocabulary."""
        return self._eos_id

    @property
    def bos_token(self) -> str:
        """BOS text from the config."""
        return self._bos_token

    @property
    def eos_token(self) -> str:
        """EOS text from the config."""
        return self._eos_token

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without added BOS/EOS (added-token texts in ``text`` are recognized)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, encoded in parallel by the library (which releases the GIL meanwhile;
        without character offsets where the library offers that, ``encode_batch_fast``: the same ids). Each
        ``ids`` read is a new list already (not copied again: 0.3 ms of the GIL per 60K ids)."""
        encode = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def definition(self) -> dict[str, Any]:
        """The tokenizer's ``tokenizer.json`` document (normalizer, pre-tokenizer, model, added tokens)."""
        return dict(json.loads(self._tok.to_str()))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat message after normalization: content parts joined into a string.

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``tool``...
        content: the text (list-of-parts content has its ``text`` parts concatenated).
    """

    role: str
    content: str


def normalize_messages(raw: object) -> list[ChatMessage]:
    """Validate OpenAI-style ``messages`` and normalize their content to strings.

    Args:
        raw: the decoded JSON value of ``messages``.

    Returns:
        The messages in order.

    Raises:
        InvalidRequestError: not a non-empty list of ``{"role": str, "content": str | [parts] | null}`` objects.
    """
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("'messages' must be a non-empty array", param="messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string", param="messages")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts: list[str] = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}", param="messages"
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise InvalidRequestError(f"messages[{i}].content must be a string or an array", param="messages")
        out.append(ChatMessage(role=role, content=text))
    return out


class RenderedChat(msgspec.Struct, frozen=True):
    """A chat rendered as text segments.

    Attributes:
        segments: one per message, then the generation prompt (``len(messages) + 1`` items) when incremental;
            a single segment (the whole text) otherwise.
        is_incremental: segment ``i`` depends only on ``messages[: i + 1]``.
    """

    segments: tuple[str, ...]
    is_incremental: bool

    @property
    def text(self) -> str:
        """The full prompt text."""
        return "".join(self.segments)


class ChatTemplate(Protocol):
    """Turns messages into prompt text segments."""

    def render_segments(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> RenderedChat:
        """Render ``messages``; see the module docstring for the segment contract."""
        ...


class DefaultChatTemplate:
    """The built-in ChatML-shaped template (see module docstring); always incremental."""

    def render_segments(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> RenderedChat:
        """One ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``."""
        segs = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
        segs.append("<|im_start|>assistant\n" if add_generation_prompt else "")
        return RenderedChat(segments=tuple(segs), is_incremental=True)


class JinjaChatTemplate:
    """A Hugging Face style Jinja chat template, rendered in a sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        """Compile ``source``.

        Args:
            source: the Jinja template text.
            bos_token: value of ``bos_token`` in the template.
            eos_token: value of ``eos_token`` in the template.

        Raises:
            TokenizerLoadError: the template does not compile.
        """
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TokenizerLoadError(f"bad chat template: {exc}") from exc
        self._bos_token = bos_token
        self._eos_token = eos_token

    def _render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
        )

    def render_segments(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> RenderedChat:
        """Segments by string difference of prefix renderings (module docstring); falls back to one segment.

        Raises:
            InvalidRequestError: the template raises for these messages.
        """
        try:
            full = self._render(messages, add_generation_prompt)
            segs: list[str] = []
            prev = ""
            ok = True
            for i in range(1, len(messages) + 1):
                try:
                    cur = self._render(messages[:i], False)
                except jinja2.TemplateError:
                    ok = False
                    break
                if not cur.startswith(prev):
                    ok = False
                    break
                segs.append(cur[len(prev) :])
                prev = cur
            if ok and full.startswith(prev):
                segs.append(full[len(prev) :])
                return RenderedChat(segments=tuple(segs), is_incremental=True)
            return RenderedChat(segments=(full,), is_incremental=False)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc


def encode_segments(tokenizer: Tokenizer, segments: Iterable[str]) -> list[int]:
    """The chat token ids: the concatenation of each segment's ids (module docstring)."""
    ids: list[int] = []
    for seg in segments:
        if seg:
            ids.extend(tokenizer.encode(seg))
    return ids


def encode_chat(
    tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Prompt token ids for ``messages``, exactly as the worker computes them."""
    return encode_segments(tokenizer, template.render_segments(messages, add_generation_prompt).segments)


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Prompt token ids for a completions ``prompt``: a string is encoded, a list of ids is taken as is.

    Raises:
        InvalidRequestError: ids out of the vocabulary.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids = list(prompt)
    vocab = tokenizer.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise InvalidRequestError(f"token id {t} out of range [0, {vocab})", param="prompt")
    return ids


def segments_match_whole(tokenizer: Tokenizer, rendered: RenderedChat) -> bool:
    """True when per-segment tokenization equals tokenizing the joined text (module docstring)."""
    return encode_segments(tokenizer, rendered.segments) == tokenizer.encode(rendered.text)


PROBE_MESSAGES: tuple[ChatMessage, ...] = (
    ChatMessage("system", "You are a helpful assistant."),
    ChatMessage("user", "Hello there! How are you?"),
    ChatMessage("assistant", "I am fine, thanks.\nAnd you?"),
    ChatMessage("user", "Great. Tell me a story."),
)


def check_template(tokenizer: Tokenizer, template: ChatTemplate) -> bool:
    """Whether ``template`` is incremental and per-segment tokenization equals whole-prompt tokenization on a
    probe conversation; logs a warning when not."""
    rendered = template.render_segments(PROBE_MESSAGES, True)
    ok = rendered.is_incremental and segments_match_whole(tokenizer, rendered)
    if not ok:
        logger.warning(
            "chat template is%s incremental; per-segment tokens %s whole-prompt tokens on the probe chat",
            "" if rendered.is_incremental else " not",
            "differ from" if rendered.is_incremental else "are",
        )
    return ok


def _token_text(value: Any) -> str:
    """``bos_token`` / ``eos_token`` in ``tokenizer_config.json`` may be a string or ``{"content": str}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_tokenizer(path: str | Path | None) -> tuple[Tokenizer, ChatTemplate]:
    """Build the tokenizer and chat template a worker (or the gateway, for that worker's model) uses.

    Args:
        path: ``None`` for the byte tokenizer and the default template; a ``tokenizer.json`` file; or a
            directory holding ``tokenizer.json`` and optionally ``tokenizer_config.json`` (``chat_template``,
            ``bos_token``, ``eos_token``) and ``chat_template.jinja`` (which wins over the config's template).

    Returns:
        ``(tokenizer, template)``; the default template when no Jinja template is found.

    Raises:
        TokenizerLoadError: missing files, unreadable JSON, or a template that does not compile.
    """
    if path is None:
        return ByteTokenizer(), DefaultChatTemplate()
    p = Path(path)
    directory = p if p.is_dir() else p.parent
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    if not tok_file.is_file():
        raise TokenizerLoadError(f"no tokenizer.json at {tok_file}")
    config: dict[str, Any] = {}
    cfg_file = directory / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot read {cfg_file}: {exc}") from exc
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    tokenizer = HFTokenizer(tok_file, bos_token=bos, eos_token=eos)
    source: str | None = None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    template: ChatTemplate = JinjaChatTemplate(source, bos, eos) if source else DefaultChatTemplate()
    return tokenizer, template
