"""Cut points where a tokenizer's output composes: ``encode(a + b) == encode(a) + encode(b)``.

A **line start** of a text ``t`` is an offset ``b`` with ``t[b - 2]`` not whitespace, ``t[b - 1] == "\\n"`` and
``t[b]`` not whitespace. For the tokenizers accepted by ``composes_at_line_starts``, encoding composes at every
line start, so a long prompt can be tokenized piece by piece (its new text only, or in parallel slices) and the
ids are exactly those of one whole encoding.

Why it holds (HF ``tokenizers``, the pipeline is normalizer → added-token split → pre-tokenizer → model per
pre-token; the model never merges across pre-tokens):

* no normalizer (so offsets and text are unchanged);
* no added token whose text contains ``"\\n"`` or that strips whitespace around it (``lstrip``/``rstrip``), so the
  added-token split can neither straddle the cut nor reach across it;
* the pre-tokenizer is byte-level with one of the known regexes below (GPT-2's, Llama-3's, Qwen-2's) and adds no
  prefix space. In each regex no alternative matches ``"\\n"`` followed by a non-whitespace character (the
  whitespace alternatives match whitespace only, the letter and punctuation alternatives exclude ``\\r\\n`` or put
  them last), and every character starts some alternative, so the left-to-right scan has a match boundary at the
  line start and the scan from there depends only on ``t[b:]``. The matches that end at the cut read at most
  one character past it, through ``\\s+(?!\\S)``: with a non-whitespace character both before and after the
  ``"\\n"``, that alternative gives the same single ``"\\n"`` whether the text goes on or ends there.

``ByteTokenizer`` composes at every offset outside a special token, so at every line start when no special token
contains ``"\\n"``. Anything else (a normalizer, a metaspace pre-tokenizer that prepends ``"▁"``, an unknown
regex) is refused, and callers tokenize whole prompts.
"""

from __future__ import annotations

from typing import Any

from common.tokenization import ByteTokenizer, HFTokenizer, Tokenizer

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The byte-level pre-tokenizer's built-in regex (``ByteLevel(use_regex=True)``), GPT-2's."""

KNOWN_SPLIT_PATTERNS = frozenset({
    # Llama-3 (tokenizer.json of meta-llama/Meta-Llama-3-8B), also GPT-4's cl100k pattern.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    # Qwen-2 (single digits).
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    GPT2_PATTERN,
})
"""Split regexes for which a line start is always a pre-token boundary (module docstring)."""


def _is_byte_level(node: Any, *, use_regex: bool) -> bool:
    return (isinstance(node, dict) and node.get("type") == "ByteLevel" and not node.get("add_prefix_space", False)
            and bool(node.get("use_regex", True)) == use_regex)


def _pre_tokenizer_composes(node: Any) -> bool:
    if _is_byte_level(node, use_regex=True):
        return True
    if not isinstance(node, dict) or node.get("type") != "Sequence":
        return False
    steps = node.get("pretokenizers")
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    if not isinstance(split, dict) or split.get("type") != "Split":
        return False
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    return (regex in KNOWN_SPLIT_PATTERNS and split.get("behavior") == "Isolated" and not split.get("invert", False)
            and _is_byte_level(byte_level, use_regex=False))


def composes_at_line_starts(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer.encode`` composes at every line start (module docstring); ``False`` when unsure."""
    if isinstance(tokenizer, ByteTokenizer):
        return not any("\n" in s for s in tokenizer.special_tokens)
    if not isinstance(tokenizer, HFTokenizer):
        return False
    doc = tokenizer.definition()
    if doc.get("normalizer") is not None:
        return False
    for added in doc.get("added_tokens") or ():
        if "\n" in str(added.get("content", "")) or added.get("lstrip") or added.get("rstrip"):
            return False
    return _pre_tokenizer_composes(doc.get("pre_tokenizer"))


def is_line_start(text: str, offset: int) -> bool:
    """``text[offset - 2]`` and ``text[offset]`` are not whitespace and ``text[offset - 1]`` is ``"\\n"``."""
    return (2 <= offset < len(text) and text[offset - 1] == "\n" and not text[offset].isspace()
            and not text[offset - 2].isspace())


def last_line_start(text: str, start: int, end: int) -> int:
    """The largest line start ``b`` of ``text`` with ``start < b <= end``, or ``-1``; O(``end - b``)."""
    end = min(end, len(text) - 1)
    newline = text.rfind("\n", start, end)
    while newline >= 0 and newline + 1 > start:
        if is_line_start(text, newline + 1):
            return newline + 1
        newline = text.rfind("\n", start, newline)
    return -1


def line_start_slices(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at line starts into slices of about ``max_chars`` (more where no line start is near).

    Returns:
        Consecutive ``(begin, stop)`` offsets covering ``[start, end)``; one slice when it is short.
    """
    slices: list[tuple[int, int]] = []
    begin = start
    while end - begin > max_chars:
        cut = last_line_start(text, begin, begin + max_chars)
        if cut < 0:
            cut = text.find("\n", begin + max_chars, end)
            while cut >= 0 and not is_line_start(text, cut + 1):
                cut = text.find("\n", cut + 1, end)
            if cut < 0 or cut + 1 >= end:
                break
            cut += 1
        slices.append((begin, cut))
        begin = cut
    slices.append((begin, end))
    return slices
