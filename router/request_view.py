"""The request path's view of a request: parse once, tokenize incrementally, hash blocks incrementally.

``RequestParser.parse(kind, body)`` decodes only the fields routing needs (msgspec, unknown fields skipped) and
validates them, raising ``RequestError`` subclasses for every bad input. ``ModelTokenizer.view(parsed)`` turns
a parsed request into a ``PromptView``: the number of prompt tokens and the chained block hashes
(``router.block_hash``), computed with the worker's own tokenizer and chat template (``common.tokenization``)
so the gateway's tokens equal the worker's.

Incremental chat tokenization. ``render_segments`` gives one text segment per message (segment ``i`` depends only
on ``messages[: i + 1]``) plus a generation-prompt segment. A conversation's prefix state after message ``i``::

    key_i   = xxh3_64(utf8(segment_i), seed=key_{i-1})           (key_{-1}: the namespace and block size)
    state_i = (num_tokens, block_hashes[full blocks], tail tokens < block_size)

is kept in a bounded LRU (``PrefixStateCache``). A new turn finds its longest cached message prefix, tokenizes
only the segments after it, and hashes only the blocks after the cached chain (continuing from its last hash).
So turn ``k`` of a conversation costs O(new tokens) plus O(num blocks) pointer copies, not O(prompt).

Incremental text prompts (``/v1/completions``): ``router.text_prefix`` keeps checkpoints of earlier prompts cut at
line starts, where the tokenizer's encoding composes (``common.line_split``); a prompt that extends one is
tokenized from there only. A tokenizer that does not compose there gets its whole prompts tokenized (an exact
repeat is served from a cache of whole prompts).

Long text is tokenized off the event loop (``ModelTokenizer.view_async``): ``plan`` reads the caches and says what
to encode, the library encodes in a worker thread (in parallel slices cut at line starts), ``ViewPlan.finish``
hashes and writes the caches on the loop.

Cached-token rule (vLLM ``KVCacheManager.get_computed_blocks``): the cache hit is capped at ``num_tokens - 1``
tokens so the last prompt token is always computed; in blocks, ``(num_tokens - 1) // block_size``. A full-prompt
hit therefore reports ``((n - 1) // block_size) * block_size`` cached tokens; ``cacheable_blocks`` is that cap.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import xxhash

from common.errors import InvalidRequestError as TokenizerInvalidRequestError
from common.errors import TokenizerLoadError
from common.line_split import composes_at_line_starts, last_line_start, line_start_slices
from common.tokenization import (
    ChatMessage,
    ChatTemplate,
    JinjaChatTemplate,
    Tokenizer,
    encode_prompt,
    load_tokenizer,
)
from router.block_hash import BlockHash, Namespace, make_namespace
from router.config import ModelConfig
from router.errors import InvalidFieldError, InvalidJSONError
from router.prompt_state import EMPTY_STATE, SEED_MASK, PromptState, extend_state, with_opening_hash
from router.text_prefix import TextCheckpoint, TextPrefixCache

logger = logging.getLogger(__name__)

RequestKind = Literal["completions", "chat"]


class _TextPart(msgspec.Struct, frozen=True, gc=False):
    type: str
    text: str | None = None


class _Message(msgspec.Struct, frozen=True, gc=False):
    role: str
    content: str | list[_TextPart] | None = None


class _ChatBody(msgspec.Struct, frozen=True, gc=False):
    model: str
    messages: list[_Message]
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None
    cache_salt: str | None = None
    add_generation_prompt: bool = True
    n: int | None = None


class _CompletionBody(msgspec.Struct, frozen=True, gc=False):
    model: str
    prompt: str | list[Any]
    stream: bool = False
    max_tokens: int | None = None
    user: str | None = None
    cache_salt: str | None = None
    n: int | None = None


class ParsedRequest(msgspec.Struct, frozen=True, gc=False):
    """The routing fields of a completions or chat request.

    Attributes:
        kind: ``completions`` or ``chat``.
        model: requested model name.
        is_stream: ``stream`` is true.
        max_tokens: ``max_tokens`` / ``max_completion_tokens``, or ``None``.
        user: the body's ``user``.
        cache_salt: vLLM's ``cache_salt``.
        messages: chat messages (content normalized to text), empty for completions.
        prompt: completions prompt: text or token ids; ``None`` for chat.
        add_generation_prompt: chat: the template appends the assistant's generation prompt (the body's
            ``add_generation_prompt``, true by default as in vLLM); always true for completions.
    """

    kind: RequestKind
    model: str
    is_stream: bool
    max_tokens: int | None
    user: str | None
    cache_salt: str | None
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    add_generation_prompt: bool = True


_chat_decoder = msgspec.json.Decoder(_ChatBody)
_completion_decoder = msgspec.json.Decoder(_CompletionBody)


_MISSING_FIELD = "Object missing required field `"


def _field_of(message: str) -> str | None:
    """The top-level field a msgspec validation message is about: ``... - at `$.messages[0].role``` ->
    ``messages``; ``Object missing required field `model``` (a field missing at the top level) -> ``model``."""
    marker = "- at `$."
    start = message.find(marker)
    if start < 0:
        if message.startswith(_MISSING_FIELD):
            return message[len(_MISSING_FIELD) :].split("`", 1)[0] or None
        return None
    path = message[start + len(marker) :].rstrip("`")
    for sep in ".[":
        path = path.split(sep, 1)[0]
    return path or None


def parse_request(kind: RequestKind, body: bytes) -> ParsedRequest:
    """Decode and validate the routing fields of a request body.

    Args:
        kind: which endpoint received it.
        body: the raw JSON body.

    Returns:
        The parsed request.

    Raises:
        InvalidJSONError: not JSON, not an object, or nested deeper than msgspec decodes (it raises
            ``RecursionError`` at the interpreter's recursion limit, about 1,000 levels, even inside a field
            that is skipped).
        InvalidFieldError: a missing field (``param`` names it), a wrong type, an empty prompt or messages, a
            bad ``max_tokens``, ``n`` other than 1.
    """
    try:
        if kind == "chat":
            chat = _chat_decoder.decode(body)
            return _from_chat(chat)
        completion = _completion_decoder.decode(body)
        return _from_completion(completion)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Expected `object`") and "- at `$." not in text:
            raise InvalidJSONError("the request body must be a JSON object") from exc
        raise InvalidFieldError(text, param=_field_of(text)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidJSONError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidJSONError("the request body is not valid JSON: it nests too deeply") from exc


def _check_max_tokens(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise InvalidFieldError(f"'{name}' must be >= 1, got {value}", param=name)


def _check_n(n: int | None) -> None:
    """One choice per request: the cached tokens of ``n`` sampled choices sharing a prompt are not predictable."""
    if n is not None and n != 1:
        raise InvalidFieldError(f"only n=1 is supported, got n={n}", param="n")


def _from_chat(chat: _ChatBody) -> ParsedRequest:
    if not chat.messages:
        raise InvalidFieldError("'messages' must be a non-empty array", param="messages")
    _check_n(chat.n)
    messages: list[ChatMessage] = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidFieldError(f"messages[{i}].role must be a non-empty string", param="messages")
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidFieldError(
                        f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}", param="messages"
                    )
                parts.append(part.text)
            text = "".join(parts)
        messages.append(ChatMessage(m.role, text))
    max_tokens = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    _check_max_tokens(chat.max_tokens, "max_tokens")
    _check_max_tokens(chat.max_completion_tokens, "max_completion_tokens")
    return ParsedRequest(
        "chat", chat.model, chat.stream, max_tokens, chat.user, chat.cache_salt, messages=tuple(messages),
        add_generation_prompt=chat.add_generation_prompt,
    )


def _from_completion(body: _CompletionBody) -> ParsedRequest:
    prompt: str | tuple[int, ...]
    _check_n(body.n)
    raw = body.prompt
    if isinstance(raw, str):
        if not raw:
            raise InvalidFieldError("'prompt' must not be empty", param="prompt")
        prompt = raw
    else:
        if not raw:
            raise InvalidFieldError("'prompt' must not be empty", param="prompt")
        if len(raw) == 1 and isinstance(raw[0], str):
            if not raw[0]:
                raise InvalidFieldError("'prompt' must not be empty", param="prompt")
            _check_max_tokens(body.max_tokens, "max_tokens")
            return ParsedRequest("completions", body.model, body.stream, body.max_tokens, body.user,
                                 body.cache_salt, prompt=raw[0])
        if len(raw) == 1 and isinstance(raw[0], list):
            raw = raw[0]  # one prompt of token ids; its items are checked below
        if not raw or not all(type(t) is int and t >= 0 for t in raw):
            raise InvalidFieldError(
                "'prompt' must be a string, an array of token ids, or an array with one of those", param="prompt"
            )
        prompt = tuple(raw)
    _check_max_tokens(body.max_tokens, "max_tokens")
    return ParsedRequest(
        "completions", body.model, body.stream, body.max_tokens, body.user, body.cache_salt, prompt=prompt
    )


class PrefixStateCache:
    """Bounded LRU of conversation prefix states (see module docstring).

    Eviction: least recently used first, until the entry count is at most ``max_entries`` and the total number of
    cached block hashes is at most ``max_blocks``.
    """

    def __init__(self, max_entries: int = 4096, max_blocks: int = 4_000_000) -> None:
        self._entries: OrderedDict[int, PromptState] = OrderedDict()
        self._max_entries = max_entries
        self._max_blocks = max_blocks
        self._num_blocks = 0
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: int) -> PromptState | None:
        state = self._entries.get(key)
        if state is not None:
            self._entries.move_to_end(key)
        return state

    def put(self, key: int, state: PromptState) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._num_blocks -= len(old.block_hashes)
        self._entries[key] = state
        self._num_blocks += len(state.block_hashes)
        while self._entries and (len(self._entries) > self._max_entries or self._num_blocks > self._max_blocks):
            _, evicted = self._entries.popitem(last=False)
            self._num_blocks -= len(evicted.block_hashes)

    def __len__(self) -> int:
        return len(self._entries)


class PromptView(msgspec.Struct, frozen=True, gc=False):
    """The routing view of one prompt.

    Attributes:
        num_tokens: prompt tokens.
        block_hashes: chained hashes of the full blocks.
        block_size: tokens per block.
        num_reused_blocks: blocks taken from the prefix cache (not re-hashed) this time.
        opening_hash: identity of a chat's opening (``PromptState.opening_hash``); ``None`` for completions.
    """

    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    block_size: int
    num_reused_blocks: int = 0
    opening_hash: int | None = None

    @property
    def num_cacheable_blocks(self) -> int:
        """Most blocks a worker can serve from cache: ``(num_tokens - 1) // block_size`` (vLLM's rule)."""
        return max(0, (self.num_tokens - 1) // self.block_size)


OFF_LOOP_CHARS = 32_768
"""A prompt with more text to tokenize than this (characters) is tokenized in a worker thread: the ``tokenizers``
library releases the GIL while it encodes, so the event loop keeps serving meanwhile (``view_async``)."""

SLICE_CHARS = 16_384
"""Text longer than this is cut at line starts (``common.line_split``) into slices the library encodes in
parallel, when the tokenizer composes there."""


def _joined(parts: list[list[int]]) -> list[int]:
    if len(parts) == 1:
        return parts[0]
    out: list[int] = []
    for p in parts:
        out.extend(p)
    return out


class ViewPlan:
    """What one prompt still needs tokenized, and how its ids fold into the ``PromptView``.

    Attributes:
        texts: the texts to encode, in order (slices of groups, see ``finish``).
        num_chars: their total length in characters.
    """

    __slots__ = ("_finish", "_group_sizes", "num_chars", "texts")

    def __init__(self, groups: list[list[str]], finish: Callable[[list[list[int]]], PromptView]) -> None:
        self.texts = [t for g in groups for t in g]
        self.num_chars = sum(len(t) for t in self.texts)
        self._group_sizes = [len(g) for g in groups]
        self._finish = finish

    def finish(self, ids: Sequence[list[int]]) -> PromptView:
        """The view, from ``ids[i] = encode(texts[i])``; the slices of each group are joined first."""
        grouped: list[list[int]] = []
        i = 0
        for n in self._group_sizes:
            grouped.append(_joined(list(ids[i: i + n])) if n else [])
            i += n
        return self._finish(grouped)


class ModelTokenizer:
    """Tokenizer, chat template, namespaces and prefix caches of one model."""

    def __init__(self, config: ModelConfig, *, max_cached_prefixes: int = 4096, max_cached_blocks: int = 4_000_000,
                 text_anchor_chars: int = 2048, max_cached_text_chars: int = 64_000_000):
        """Load the model's tokenizer and template exactly as the worker does.

        Args:
            config: the model.
            max_cached_prefixes: chat prefix states kept (``PrefixStateCache``).
            max_cached_blocks: block hashes kept in them.
            text_anchor_chars: text prompts up to this length are tokenized whole; longer ones incrementally
                (``router.text_prefix``).
            max_cached_text_chars: characters kept in text checkpoints.

        Raises:
            ConfigError: the tokenizer or template cannot be loaded.
        """
        from router.errors import ConfigError

        try:
            tokenizer, template = load_tokenizer(config.tokenizer_path)
            if config.chat_template is not None:
                with open(config.chat_template, encoding="utf-8") as f:
                    template = JinjaChatTemplate(f.read(), tokenizer.bos_token, tokenizer.eos_token)
        except (TokenizerLoadError, OSError) as exc:
            raise ConfigError(f"models[{config.name}]: {exc}") from exc
        self.config = config
        self.block_size = config.block_size
        self.tokenizer: Tokenizer = tokenizer
        self.template: ChatTemplate = template
        self.composes_at_line_starts = composes_at_line_starts(tokenizer)
        """Text may be tokenized in pieces cut at line starts (``common.line_split``)."""
        self._encode_batch: Callable[[Sequence[str]], list[list[int]]] | None = getattr(tokenizer, "encode_batch",
                                                                                         None)
        self._namespaces: dict[tuple[str | None, str | None], Namespace] = {}
        self._base_namespace = make_namespace(None, None)
        """The namespace of the base model without a cache salt (most requests)."""
        self.prefixes = PrefixStateCache(max_cached_prefixes, max_cached_blocks)
        self.texts = TextPrefixCache(max_cached_prefixes // 4, max_cached_text_chars, text_anchor_chars)
        self._prompts = PrefixStateCache(256, max_cached_blocks // 4)

    def namespace(self, model: str, cache_salt: str | None) -> Namespace:
        """Chain seed for a request: LoRA adapter (when ``model`` names one) and cache salt."""
        lora = model if model != self.config.name and model in self.config.lora_adapters else None
        salt = cache_salt if self.config.honor_cache_salt else None
        key = (lora, salt)
        ns = self._namespaces.get(key)
        if ns is None:
            if len(self._namespaces) > 65536:
                self._namespaces.clear()
            ns = self._namespaces[key] = make_namespace(lora, salt)
        return ns

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``[tokenizer.encode(t) for t in texts]``, in parallel where the tokenizer offers it and the texts are
        long enough to pay for the library's threads (more than ``SLICE_CHARS`` in all)."""
        if self._encode_batch is not None and len(texts) > 1 and sum(map(len, texts)) > SLICE_CHARS:
            return self._encode_batch(texts)
        encode = self.tokenizer.encode
        return [encode(t) for t in texts]

    def view(self, parsed: ParsedRequest) -> PromptView:
        """Tokenize and hash ``parsed``'s prompt, reusing cached prefixes.

        Raises:
            InvalidFieldError: the template or tokenizer refuses the input (e.g. token ids out of range), or
                ``cache_salt`` is ``""`` while ``honor_cache_salt`` is on (vLLM refuses an empty salt with a 400,
                so no worker ever caches under it).
        """
        try:
            plan = self.plan(parsed)
            return plan.finish(self.encode_many(plan.texts) if plan.texts else [])
        except TokenizerInvalidRequestError as exc:
            raise InvalidFieldError(exc.message, param=exc.param) from exc
        except ValueError as exc:
            raise InvalidFieldError(str(exc), param="prompt") from exc

    async def view_async(self, parsed: ParsedRequest, off_loop_chars: int = OFF_LOOP_CHARS) -> PromptView:
        """``view``, with the encoding in a worker thread when it has more than ``off_loop_chars`` characters
        (the first turn of a long conversation): the loop is held only for the lookups and the hashing.

        Raises:
            InvalidFieldError: as ``view``.
        """
        try:
            plan = self.plan(parsed)
            if plan.num_chars > off_loop_chars:
                ids = await asyncio.get_running_loop().run_in_executor(None, self.encode_many, plan.texts)
            else:
                ids = self.encode_many(plan.texts) if plan.texts else []
            return plan.finish(ids)
        except TokenizerInvalidRequestError as exc:
            raise InvalidFieldError(exc.message, param=exc.param) from exc
        except ValueError as exc:
            raise InvalidFieldError(str(exc), param="prompt") from exc

    def _pieces(self, text: str, start: int = 0, end: int | None = None) -> list[str]:
        """``text[start:end]``, cut at line starts into ``SLICE_CHARS`` slices where the tokenizer composes."""
        stop = len(text) if end is None else end
        if stop <= start:
            return []
        if stop - start <= SLICE_CHARS or not self.composes_at_line_starts:
            return [text[start:stop]]
        return [text[b:e] for b, e in line_start_slices(text, start, stop, SLICE_CHARS)]

    def plan(self, parsed: ParsedRequest) -> ViewPlan:
        """What ``parsed``'s prompt needs tokenized (``ViewPlan``); the caches are read now, written at ``finish``.

        Raises:
            InvalidFieldError: an empty ``cache_salt`` (see ``view``).
            InvalidRequestError, ValueError: token ids out of range (``view`` translates them).
        """
        if parsed.cache_salt is None and parsed.model == self.config.name:
            ns = self._base_namespace
        else:
            if parsed.cache_salt == "" and self.config.honor_cache_salt:
                raise InvalidFieldError("Parameter 'cache_salt' must be a non-empty string if provided.",
                                        param="cache_salt")
            ns = self.namespace(parsed.model, parsed.cache_salt)
        bs = self.block_size
        if parsed.kind == "chat":
            return self._chat_plan(parsed.messages, ns, parsed.add_generation_prompt)
        prompt = parsed.prompt
        assert prompt is not None  # parse_request guarantees it for completions
        if isinstance(prompt, str):
            return self._text_plan(prompt, ns)
        ids = encode_prompt(self.tokenizer, prompt)
        state = extend_state(EMPTY_STATE, ids, bs, ns)
        view = PromptView(state.num_tokens, state.block_hashes, bs)
        return ViewPlan([], lambda _: view)

    def _text_plan(self, prompt: str, ns: Namespace) -> ViewPlan:
        bs = self.block_size
        seed = hash((ns, bs)) & SEED_MASK
        # The same text again (a retry, a benchmark, a fleet-wide prompt) is one lookup, whatever the tokenizer.
        full_key = xxhash.xxh3_64_intdigest(prompt.encode("utf-8", "surrogatepass"), seed)
        cached = self._prompts.get(full_key)
        if cached is not None:
            view = PromptView(cached.num_tokens, cached.block_hashes, bs, len(cached.block_hashes))
            return ViewPlan([], lambda _: view)
        if not self.composes_at_line_starts:
            def finish_whole(ids: list[list[int]]) -> PromptView:
                state = extend_state(EMPTY_STATE, ids[0], bs, ns)
                self._prompts.put(full_key, state)
                return PromptView(state.num_tokens, state.block_hashes, bs)

            return ViewPlan([[prompt]], finish_whole)
        texts = self.texts
        key = texts.anchor(prompt, seed)
        found = texts.find(key, prompt) if key is not None else None
        used_id, start_state = (found[0], found[1].state) if found is not None else (None, EMPTY_STATE)
        start = len(found[1].prefix) if found is not None else 0
        cut = last_line_start(prompt, max(start, texts.anchor_chars), len(prompt)) if key is not None else -1
        num_reused = len(start_state.block_hashes)
        if cut < 0:
            def finish_tail(ids: list[list[int]]) -> PromptView:
                state = extend_state(start_state, ids[0], bs, ns)
                self._prompts.put(full_key, state)
                return PromptView(state.num_tokens, state.block_hashes, bs, num_reused)

            return ViewPlan([self._pieces(prompt, start)], finish_tail)

        def finish_cut(ids: list[list[int]]) -> PromptView:
            assert key is not None
            middle = extend_state(start_state, ids[0], bs, ns)
            texts.put(key, TextCheckpoint(prompt[:cut], middle), used_id)
            state = extend_state(middle, ids[1], bs, ns)
            self._prompts.put(full_key, state)
            return PromptView(state.num_tokens, state.block_hashes, bs, num_reused)

        return ViewPlan([self._pieces(prompt, start, cut), self._pieces(prompt, cut)], finish_cut)

    def _chat_plan(self, messages: tuple[ChatMessage, ...], ns: Namespace, add_generation_prompt: bool) -> ViewPlan:
        # The message segments do not depend on add_generation_prompt (only the last segment does), so the
        # prefix states cached under them serve both renderings.
        rendered = self.template.render_segments(messages, add_generation_prompt)
        segments = rendered.segments
        bs = self.block_size
        if not rendered.is_incremental:
            def finish_whole(ids: list[list[int]]) -> PromptView:
                state = extend_state(EMPTY_STATE, ids[0], bs, ns)
                return PromptView(state.num_tokens, state.block_hashes, bs)

            return ViewPlan([self._pieces(rendered.text)], finish_whole)
        num_messages = len(segments) - 1
        keys: list[int] = []
        key = hash((ns, bs)) & SEED_MASK
        for i in range(num_messages):
            key = xxhash.xxh3_64_intdigest(segments[i].encode("utf-8", "surrogatepass"), key)
            keys.append(key)
        start = 0
        start_state = EMPTY_STATE
        for i in range(num_messages - 1, -1, -1):
            cached = self.prefixes.get(keys[i])
            if cached is not None:
                start_state, start = cached, i + 1
                break
        num_reused_blocks = len(start_state.block_hashes)
        if start:
            self.prefixes.num_hits += 1
        else:
            self.prefixes.num_misses += 1
        opening_index = 1 if num_messages >= 2 and messages[0].role == "system" else 0
        groups = [self._pieces(segments[i]) for i in range(start, num_messages)]
        groups.append(self._pieces(segments[-1]))

        def finish(ids: list[list[int]]) -> PromptView:
            state = start_state
            for i in range(start, num_messages):
                state = extend_state(state, ids[i - start], bs, ns)
                if i == opening_index:
                    state = with_opening_hash(state, ns)
            if num_messages and start < num_messages:
                self.prefixes.put(keys[num_messages - 1], state)
            state = extend_state(state, ids[-1], bs, ns)
            return PromptView(state.num_tokens, state.block_hashes, bs, num_reused_blocks, state.opening_hash)

        return ViewPlan(groups, finish)
