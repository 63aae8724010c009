"""Prompt text from block ids, with exactly the trace's token counts in the target tokenizer.

Every (namespace, id) pair becomes a deterministic stream of tokens; a block of ``n`` tokens is the stream's
first ``n`` tokens, and a prompt is its blocks' texts joined in order. Hence:

* equal ids give equal text, and a partial block's text is a prefix of the full block's text, so two prompts
  whose ids agree on a prefix agree on exactly that text prefix;
* the first token of a block is drawn from the id's digest (BLAKE2b of ``"<namespace>\\0<id>"``), so different
  ids differ from their first token except with probability ``1 / alphabet size`` (1/64 byte-level, 1/#words
  for a ``tokenizer.json``), and even then differ within the next few tokens (64-bit digests per token group);
* the token count of a prompt is the sum of its blocks' counts: the text is built from units that the tokenizer
  never merges across (see below), and ``PromptBuilder`` can check every prompt by encoding it.

Tokenizers:

* byte-level (the default, ``common.tokenization.ByteTokenizer``): one token per UTF-8 byte; blocks are drawn
  from 64 ASCII letters, digits, ``-`` and ``_`` (none of which starts a special token such as ``<|eos|>``).
* ``tokenizer.json`` (``tokenizers`` library): blocks are sequences of vocabulary words of the form
  ``" " + ascii letters`` that encode to a single id on their own. Pre-tokenizers of byte-level BPE models
  (GPT-2, Llama-3, Qwen) split text before each space, so such words never merge with their neighbours. The
  builder checks every prompt's length by encoding it (``add_special_tokens=False``, as the worker encodes a
  completions prompt) and raises ``PromptError`` if the tokenizer does not behave.

The load generator uses the **completions** API with this prompt string: a chat template would add tokens
around the text (and a role header per turn) that the trace does not account for.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from loadgen.errors import PromptError
from loadgen.traces import TraceRequest

logger = logging.getLogger(__name__)

BYTE_ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
"""The 64 characters byte-level block text is drawn from (one token each)."""

_BYTE_TABLE = bytes(BYTE_ALPHABET[i % 64] for i in range(256))
_DIGEST_BYTES = 64
_MAX_WORDS = 4096
_MIN_WORDS = 64


def block_digest(namespace: str, block_id: int, counter: int) -> bytes:
    """64 pseudo-random bytes for ``(namespace, block_id)``: BLAKE2b-512 of ``"<ns>\\0<id>\\0<counter>"``."""
    return hashlib.blake2b(f"{namespace}\0{block_id}\0{counter}".encode(), digest_size=_DIGEST_BYTES).digest()


class ByteLevelText:
    """Block text for a one-token-per-byte tokenizer."""

    name = "byte-level"

    def text(self, namespace: str, block_id: int, num_tokens: int) -> str:
        """``num_tokens`` ASCII characters (= tokens) for the block; a prefix of any longer call's result."""
        chunks = []
        for counter in range((num_tokens + _DIGEST_BYTES - 1) // _DIGEST_BYTES):
            chunks.append(block_digest(namespace, block_id, counter).translate(_BYTE_TABLE))
        return b"".join(chunks)[:num_tokens].decode("ascii")

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text``: its UTF-8 byte count."""
        return len(text.encode("utf-8"))


class VocabWordText:
    """Block text for a ``tokenizer.json``: one vocabulary word per token (module docstring).

    Raises:
        PromptError: the file cannot be loaded, or it has fewer than 64 usable words.
    """

    name = "tokenizer.json"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise PromptError(f"cannot load tokenizer {path}: {exc}") from exc
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        words: list[str] = []
        for token_id in sorted(vocab.values()):
            text = self._tokenizer.decode([token_id])
            body = text[1:]
            if not (text.startswith(" ") and 2 <= len(body) <= 12 and body.isascii() and body.isalpha()):
                continue
            if self._tokenizer.encode(text, add_special_tokens=False).ids != [token_id]:
                continue
            words.append(text)
            if len(words) >= _MAX_WORDS:
                break
        if len(words) < _MIN_WORDS:
            raise PromptError(
                f"tokenizer {path} has {len(words)} single-token ' word' entries, need {_MIN_WORDS}: "
                "only byte-level BPE tokenizers (GPT-2, Llama-3, Qwen style) are supported"
            )
        self._words = words
        logger.info("tokenizer %s: %d single-token words for prompt text", path, len(words))

    def text(self, namespace: str, block_id: int, num_tokens: int) -> str:
        """``num_tokens`` words for the block; a prefix of any longer call's result."""
        words = self._words
        out: list[str] = []
        counter = 0
        while len(out) < num_tokens:
            digest = block_digest(namespace, block_id, counter)
            for j in range(0, _DIGEST_BYTES, 2):
                out.append(words[int.from_bytes(digest[j : j + 2], "little") % len(words)])
            counter += 1
        return "".join(out[:num_tokens])

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as the worker counts a completions prompt (no special tokens added)."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


class PromptBuilder:
    """Builds prompt strings for trace requests, caching full block texts (LRU, ``cache_size`` blocks).

    Args:
        tokenizer_path: a ``tokenizer.json``, or ``None`` for byte-level.
        verify: encode every prompt and raise ``PromptError`` when its length differs from the trace's (always on
            for a ``tokenizer.json``; byte-level text is ASCII, so there it is exact by construction).
        cache_size: full blocks kept in memory.

    Raises:
        PromptError: as ``VocabWordText``.
    """

    def __init__(self, tokenizer_path: str | Path | None = None, *, verify: bool = False, cache_size: int = 65536):
        self.source: ByteLevelText | VocabWordText = (
            ByteLevelText() if tokenizer_path is None else VocabWordText(tokenizer_path)
        )
        self._verify = verify or tokenizer_path is not None
        self._cache: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._cache_size = cache_size

    def _block(self, namespace: str, block_id: int, num_tokens: int, block_size: int) -> str:
        full = max(num_tokens, block_size)
        key = (namespace, block_id, full)
        text = self._cache.get(key)
        if text is None:
            text = self.source.text(namespace, block_id, full)
            self._cache[key] = text
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if num_tokens == full:
            return text
        if isinstance(self.source, ByteLevelText):
            return text[:num_tokens]
        return self.source.text(namespace, block_id, num_tokens)

    def block_token_counts(self, request: TraceRequest) -> list[int]:
        """Tokens of each block of ``request``'s prompt: ``block_size`` each, the last one taking the rest.

        A trace may list one block more or fewer than ``ceil(tokens / block_size)`` (kv-cache-tester: ±1):
        blocks past the prompt's end get 0 tokens and the last listed block absorbs any excess.
        """
        counts: list[int] = []
        remaining = request.num_prompt_tokens
        for i in range(len(request.hash_ids)):
            n = remaining if i == len(request.hash_ids) - 1 else min(request.block_size, remaining)
            counts.append(n)
            remaining -= n
        return counts

    def prompt(self, request: TraceRequest) -> str:
        """The prompt string of ``request`` (``num_prompt_tokens`` tokens in the target tokenizer).

        Raises:
            PromptError: the request has no blocks, or verification found a different token count.
        """
        if not request.hash_ids:
            raise PromptError("a request without hash_ids has no prompt")
        parts = [
            self._block(request.namespace, block_id, n, request.block_size)
            for block_id, n in zip(request.hash_ids, self.block_token_counts(request), strict=True)
            if n > 0
        ]
        text = "".join(parts)
        if self._verify:
            num_tokens = self.source.count_tokens(text)
            if num_tokens != request.num_prompt_tokens:
                raise PromptError(
                    f"prompt encodes to {num_tokens} tokens in {self.source.name}, expected {request.num_prompt_tokens}"
                )
        return text


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading equal elements of ``a`` and ``b`` (test and report helper)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
