"""A Llama-3-shaped byte-level BPE trained locally with ``tokenizers``: Llama-3's pre-tokenizer (its split regex,
then byte-level without a prefix space), no normalizer, Llama-3's special tokens; the vocabulary size is asked for
(Llama-3's is 128,256) and reached as far as the corpus allows.

``build_bpe(path, corpus, vocab_size)`` writes ``tokenizer.json``; ``llama3_shaped_tokenizer(cache_dir)`` trains one
on this repository's sources and documents and the Python standard library's sources once, kept under
``cache_dir``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from common.line_split import KNOWN_SPLIT_PATTERNS

LLAMA3_PATTERN = next(p for p in KNOWN_SPLIT_PATTERNS if r"\p{N}{1,3}" in p)
"""Llama-3's pre-tokenizer regex (``tokenizer.json`` of meta-llama/Meta-Llama-3-8B)."""

LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>")
LLAMA3_VOCAB_SIZE = 128_256


def build_bpe(path: Path, corpus: Iterable[str], vocab_size: int = LLAMA3_VOCAB_SIZE) -> int:
    """Train the BPE on ``corpus`` and write it to ``path``; returns the vocabulary size reached."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(LLAMA3_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return int(tok.get_vocab_size(with_added_tokens=True))


def repository_corpus(root: Path) -> list[str]:
    """The texts of this repository's Python sources and Markdown documents."""
    texts = []
    for pattern in ("**/*.py", "**/*.md"):
        for p in sorted(root.glob(pattern)):
            if ".venv" in p.parts or ".cache" in p.parts or "site-packages" in p.parts:
                continue
            try:
                texts.append(p.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
    return texts


def llama3_shaped_tokenizer(cache_dir: Path, vocab_size: int = LLAMA3_VOCAB_SIZE) -> Path:
    """The ``tokenizer.json`` under ``cache_dir``, trained on the repository first if it is not there yet."""
    path = cache_dir / f"bpe-llama3-shaped-{vocab_size}" / "tokenizer.json"
    if not path.exists():
        import os

        # This repository, then the Python standard library's sources: enough text for a large vocabulary.
        corpus = repository_corpus(Path(__file__).resolve().parent.parent)
        corpus += repository_corpus(Path(os.__file__).parent)
        build_bpe(path, corpus, vocab_size)
    return path
