"""Sizes of a Llama-shaped decoder, and the presets used by tests, the CPU demo and the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import msgspec

Positive = Annotated[int, msgspec.Meta(gt=0)]


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """A Llama-shaped decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied or tied head."""

    vocab_size: Positive
    """Token ids are in ``[0, vocab_size)``."""
    hidden_size: Positive
    """Width of the residual stream."""
    num_layers: Positive
    """Decoder layers."""
    num_heads: Positive
    """Query heads."""
    num_kv_heads: Positive
    """Key/value heads; divides ``num_heads``."""
    head_size: Positive
    """Elements per head."""
    intermediate_size: Positive
    """Width of the SwiGLU MLP."""
    rope_theta: float = 500_000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num-heads {self.num_heads} is not a multiple of num-kv-heads {self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head-size must be even for RoPE, got {self.head_size}")

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        """Read a Hugging Face Llama ``config.json``.

        Raises:
            ValueError: the file is missing, or asks for RoPE scaling, which this model does not implement.
        """
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if raw.get("rope_scaling"):
            raise ValueError(f"{path}: rope_scaling {raw['rope_scaling']!r} is not supported")
        num_heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads", num_heads)),
            head_size=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rope_theta=float(raw.get("rope_theta", 10_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_size=16,
    intermediate_size=128,
)
"""CPU tests and the CPU demo: a few hundred thousand parameters."""

LLAMA3_8B = ModelConfig(
    vocab_size=128_256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_size=128,
    intermediate_size=14_336,
)
"""Llama-3-8B's shape (random weights in benchmarks)."""

PRESETS = {"tiny": TINY, "llama3-8b": LLAMA3_8B}
