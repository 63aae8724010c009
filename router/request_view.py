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
to encode; in one of the model's tokenizer threads the library encodes (in parallel slices cut at line starts) and
``ViewPlan.build`` hashes the blocks; only the cache writes it returns run on the loop.

Cached-token rule (vLLM ``KVCacheManager.get_computed_blocks``): the cache hit is capped at ``num_tokens - 1``
tokens so the last prompt token is always computed; in blocks, ``(num_tokens - 1) // block_size``. A full-prompt
hit therefore reports ``((n - 1) // block_size) * block_size`` cached tokens; ``cacheable_blocks`` is that cap.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from router.block_hash import Namespace, make_namespace
from router.config import ModelConfig
from router.errors import InvalidFieldError, InvalidJSONError
from router.prompt_state import (
    EMPTY_STATE,
    SEED_MASK,
    Commit,
    PrefixStateCache,
    PromptState,
    PromptView,
    ViewPlan,
    extend_state,
    with_opening_hash,
)
from router.text_prefix import TextCheckpoint, TextPrefixCache

logger = logging.getLogger(__name__)

__all__ = [
    "OFF_LOOP_CHARS", "PARSE_THREADS", "SLICE_CHARS", "ModelTokenizer", "ParsedRequest", "PrefixStateCache",
    "PromptView", "RequestKind", "ViewPlan", "parse_request",
]

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


OFF_LOOP_CHARS = 4096
"""A prompt with more text to tokenize than this (characters, about 1,000 tokens: 2-3 ms of encoding) is tokenized
in a worker thread: the ``tokenizers`` library's batch encoding releases the GIL while it encodes, so the event
loop keeps serving meanwhile (``view_async``); a following turn's new text is usually over it."""

TOKENIZE_THREADS = 2
"""Threads that tokenize long prompts: the library encodes on all cores by itself (``encode_batch``), so two keep
it busy, and few threads means few holders of the GIL for the event loop to wait behind."""

PARSE_THREADS = 1
"""Threads that decode long request bodies (``router.api.parse_request_async``; the gateway's ``parse_executor``).
msgspec holds the GIL through a whole decode, so a second thread decodes nothing in parallel; it only adds a holder
the event loop waits behind. When every waiting thread asks for the GIL, the loop is one of them and gets it in
turn: 32 bodies of 425 KB (1.1 ms each) decoded together held a 1 ms sleeper up to 40-60 ms late with 20 threads
(the default executor's on 16 cores), 12-45 ms with 6, 5-17 ms with one, which took as long to decode them all
(busy 2-core host, four runs each; the rest of that lateness is the host's other processes)."""

SLICE_CHARS = 16_384
"""Text longer than this is cut at line starts (``common.line_split``) into slices the library encodes in
parallel, when the tokenizer composes there: a multiple of the library's threads of them, each at most about this
long, so the threads finish together."""


def _num_encode_threads() -> int:
    """Threads the ``tokenizers`` library encodes a batch on (its ``RAYON_NUM_THREADS``, else the usable CPUs)."""
    configured = os.environ.get("RAYON_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ModelTokenizer:
    """Tokenizer, chat template, namespaces and prefix caches of one model."""

    def __init__(self, config: ModelConfig, *, max_cached_prefixes: int = 4096, text_anchor_chars: int = 2048):
        """Load the model's tokenizer and template exactly as the worker does.

        The prompt caches share ``config.prompt_cache_max_bytes`` (and ``prompt_cache_idle_max_bytes``, for idle
        entries): half for chat prefix states (``prefixes``), three eighths for text checkpoints (``texts``), one
        eighth for whole text prompts' states.

        Args:
            config: the model.
            max_cached_prefixes: chat prefix states kept (``PrefixStateCache``); a quarter as many text checkpoints
                and at most 256 whole-prompt states.
            text_anchor_chars: text prompts up to this length are tokenized whole; longer ones incrementally
                (``router.text_prefix``).

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
        budget, idle = config.prompt_cache_max_bytes, config.prompt_cache_idle_max_bytes
        idle_s = config.prompt_cache_idle_s
        self.prefixes = PrefixStateCache(max_cached_prefixes, budget // 2, idle_max_bytes=idle // 2, idle_s=idle_s)
        self.texts = TextPrefixCache(max_cached_prefixes // 4, budget * 3 // 8, text_anchor_chars,
                                     idle_max_bytes=idle * 3 // 8, idle_s=idle_s)
        self._prompts = PrefixStateCache(256, budget // 8, idle_max_bytes=idle // 8, idle_s=idle_s)
        self._num_encode_threads = _num_encode_threads()
        self._executor = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix=f"tokenize-{config.name}")
        """Long prompts are tokenized and hashed here (``view_async``); threads start on first use."""

    @property
    def num_cached_bytes(self) -> int:
        """Estimated bytes the prompt caches hold (at most ``config.prompt_cache_max_bytes``)."""
        return self.prefixes.num_bytes + self.texts.num_bytes + self._prompts.num_bytes

    def clear_caches(self) -> None:
        """Drop every cached prompt state and text checkpoint (the model's last worker went: nothing routes on
        them until one comes back, and their memory returns now)."""
        self.prefixes.clear()
        self.texts.clear()
        self._prompts.clear()
        self._namespaces.clear()

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
        """``[tokenizer.encode(t) for t in texts]``, in one batch call where the tokenizer offers it (in parallel,
        and without the character offsets the single ``encode`` computes: the same ids for 12-25% less CPU, a
        following turn's three segments of 6,300 characters 1.33 ms against 1.70 ms, a 25-character prompt no more,
        on a busy 2-core host)."""
        if self._encode_batch is not None and texts:
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
            if isinstance(plan, PromptView):
                return plan
            return plan.finish(self.encode_many(plan.texts))
        except TokenizerInvalidRequestError as exc:
            raise InvalidFieldError(exc.message, param=exc.param) from exc
        except ValueError as exc:
            raise InvalidFieldError(str(exc), param="prompt") from exc

    async def view_async(self, parsed: ParsedRequest, off_loop_chars: int = OFF_LOOP_CHARS, *,
                         plan_off_loop: bool = False) -> PromptView:
        """``view``, with the encoding in a worker thread when it has more than ``off_loop_chars`` characters
        (the first turn of a long conversation): the loop is held only for the lookups and the hashing; with
        ``plan_off_loop`` (a huge prompt) the lookups run in the thread too (their readers tolerate the loop's writes).

        Raises:
            InvalidFieldError: as ``view``.
        """
        try:
            if plan_off_loop:
                plan = await asyncio.get_running_loop().run_in_executor(self._executor, self.plan, parsed)
            else:
                plan = self.plan(parsed)
            if isinstance(plan, PromptView):  # known without tokenizing (a repeated prompt, token ids)
                return plan
            if plan.num_chars <= off_loop_chars:
                return plan.finish(self.encode_many(plan.texts))
            view, commit = await asyncio.get_running_loop().run_in_executor(self._executor, self._build_off_loop, plan)
            if commit is not None:
                commit()
            return view
        except TokenizerInvalidRequestError as exc:
            raise InvalidFieldError(exc.message, param=exc.param) from exc
        except ValueError as exc:
            raise InvalidFieldError(str(exc), param="prompt") from exc

    def _build_off_loop(self, plan: ViewPlan) -> tuple[PromptView, Commit]:
        # The batch call even for one text: the library's single ``encode`` keeps the GIL while it encodes.
        encode_batch = self._encode_batch
        return plan.build(encode_batch(plan.texts) if encode_batch is not None else self.encode_many(plan.texts))

    def _pieces(self, text: str, start: int = 0, end: int | None = None) -> list[str]:
        """``text[start:end]``, cut at line starts into ``SLICE_CHARS`` slices where the tokenizer composes."""
        stop = len(text) if end is None else end
        if stop <= start:
            return []
        num_chars = stop - start
        if num_chars <= SLICE_CHARS or not self.composes_at_line_starts:
            return [text[start:stop]]
        threads = self._num_encode_threads
        num_slices = threads * -(-num_chars // (threads * SLICE_CHARS))
        return [text[b:e] for b, e in line_start_slices(text, start, stop, -(-num_chars // num_slices))]

    def plan(self, parsed: ParsedRequest) -> ViewPlan | PromptView:
        """What ``parsed``'s prompt needs tokenized (``ViewPlan``; the caches are read now, written at ``finish``),
        or its ``PromptView`` when that is known without tokenizing (token ids, a prompt seen whole before).

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
        return PromptView(state.num_tokens, state.block_hashes, bs)

    def _text_plan(self, prompt: str, ns: Namespace) -> ViewPlan | PromptView:
        bs = self.block_size
        seed = hash((ns, bs)) & SEED_MASK
        texts = self.texts
        key = (texts.anchor(prompt, seed) if self.composes_at_line_starts and len(prompt) > texts.anchor_chars
               else None)
        found = texts.find(key, prompt) if key is not None else None
        full_key: int | None = None
        if found is None:
            # The same text again (a retry, a benchmark, a fleet-wide prompt) is one lookup, whatever the tokenizer;
            # a prompt that extends a checkpoint needs none (its rest since the checkpoint is short).
            full_key = xxhash.xxh3_64_intdigest(prompt.encode("utf-8", "surrogatepass"), seed)
            cached = self._prompts.get(full_key)
            if cached is not None:
                return PromptView(cached.num_tokens, cached.block_hashes, bs, len(cached.block_hashes))
        return self._text_plan_from(prompt, ns, key, found, full_key)

    def _text_plan_from(
        self, prompt: str, ns: Namespace, key: int | None, found: tuple[int, TextCheckpoint] | None,
        full_key: int | None,
    ) -> ViewPlan:
        """``_text_plan`` past its lookups: what to tokenize from the checkpoint ``found`` (bucket ``key``; none:
        from the start), remembering the whole prompt's state under ``full_key`` (none: not). Kept apart from the
        lookups, which a repeated prompt ends at, because its closures make every call of their function slower."""
        bs = self.block_size
        texts = self.texts
        prompts = self._prompts

        def remember(state: PromptState) -> Commit:
            return None if full_key is None else functools.partial(prompts.put, full_key, state)

        if key is None:
            def build_whole(ids: list[list[int]]) -> tuple[PromptView, Commit]:
                state = extend_state(EMPTY_STATE, ids[0], bs, ns)
                return PromptView(state.num_tokens, state.block_hashes, bs), remember(state)

            return ViewPlan([self._pieces(prompt)], build_whole)
        used_id, start_state = (found[0], found[1].state) if found is not None else (None, EMPTY_STATE)
        start = len(found[1].prefix) if found is not None else 0
        cut = last_line_start(prompt, max(start, texts.anchor_chars), len(prompt))
        num_reused = len(start_state.block_hashes)
        if cut < 0:
            def build_tail(ids: list[list[int]]) -> tuple[PromptView, Commit]:
                state = extend_state(start_state, ids[0], bs, ns)
                return PromptView(state.num_tokens, state.block_hashes, bs, num_reused), remember(state)

            return ViewPlan([self._pieces(prompt, start)], build_tail)

        def build_cut(ids: list[list[int]]) -> tuple[PromptView, Commit]:
            middle = extend_state(start_state, ids[0], bs, ns)
            checkpoint = TextCheckpoint(prompt[:cut], middle)
            state = extend_state(middle, ids[1], bs, ns)
            then = remember(state)

            def commit() -> None:
                texts.put(key, checkpoint, used_id)
                then() if then is not None else None

            return PromptView(state.num_tokens, state.block_hashes, bs, num_reused), commit

        return ViewPlan([self._pieces(prompt, start, cut), self._pieces(prompt, cut)], build_cut)

    def _chat_plan(self, messages: tuple[ChatMessage, ...], ns: Namespace, add_generation_prompt: bool) -> ViewPlan:
        # The message segments do not depend on add_generation_prompt (only the last segment does), so the
        # prefix states cached under them serve both renderings.
        rendered = self.template.render_segments(messages, add_generation_prompt)
        segments = rendered.segments
        bs = self.block_size
        if not rendered.is_incremental:
            def build_whole(ids: list[list[int]]) -> tuple[PromptView, Commit]:
                state = extend_state(EMPTY_STATE, ids[0], bs, ns)
                return PromptView(state.num_tokens, state.block_hashes, bs), None

            return ViewPlan([self._pieces(rendered.text)], build_whole)
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

        prefixes = self.prefixes

        def build(ids: list[list[int]]) -> tuple[PromptView, Commit]:
            state = start_state
            for i in range(start, num_messages):
                state = extend_state(state, ids[i - start], bs, ns)
                if i == opening_index:
                    state = with_opening_hash(state, ns)
            commit: Commit = None
            if num_messages and start < num_messages:
                # The state it continued from is its session's last one but for an edit of the last message.
                commit = functools.partial(prefixes.put, keys[num_messages - 1], state, keys[start - 1] if start
                                           else None)
            state = extend_state(state, ids[-1], bs, ns)
            return PromptView(state.num_tokens, state.block_hashes, bs, num_reused_blocks, state.opening_hash), commit

        return ViewPlan(groups, build)
