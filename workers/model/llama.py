"""A Llama-shaped decoder whose attention reads and writes the paged KV pool.

Each layer: ``x + attn(rms_norm(x))``, then ``x + mlp(rms_norm(x))``; attention is grouped-query with RoPE
(Llama's half-split rotation), the MLP is SwiGLU. Per step, the K/V of the new tokens are written into their slots
of the pool (``slot = block_id * block_size + offset``), then attention reads every token of the sequence from
the pool through its block table. Attention backends:

- ``"triton"``: the paged kernels of :mod:`kernels.paged_attention` (CUDA; decode kernel when every sequence
  brings one token, prefill kernel otherwise);
- ``"torch"``: the torch references of :mod:`kernels.reference` (any device; the CPU path);
- ``"sdpa"``: torch's fused ``scaled_dot_product_attention`` on the step's own contiguous K/V; valid only for
  sequences computed from scratch (benchmarks time recompute with it);
- ``"auto"``: ``"triton"`` on CUDA, ``"torch"`` elsewhere.

Weights are random from a seed (:meth:`LlamaModel.random`) or read from a folder of Hugging Face Llama
``*.safetensors`` (:meth:`LlamaModel.from_safetensors`). Inference only: no autograd state is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from workers.model.config import ModelConfig
from workers.model.kv_pool import allocate_gpu_pool

AttentionBackend = Literal["auto", "triton", "torch", "sdpa"]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step.

    Attributes:
        block_ids: the sequence's block table, covering at least ``start_pos + num_new_tokens`` tokens.
        start_pos: tokens whose KV is already in the pool (cached or computed in earlier steps).
        num_new_tokens: tokens computed this step, at positions ``start_pos ..``.
    """

    block_ids: Sequence[int]
    start_pos: int
    num_new_tokens: int


@dataclass(frozen=True)
class PagedBatch:
    """Token-level metadata of one forward step over the paged pool (all tensors on the model's device).

    Attributes:
        positions: ``[num_tokens]`` int64 position of each new token.
        slot_mapping: ``[num_tokens]`` int64 pool slot (``block_id * block_size + offset``) of each new token.
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32, rows padded with 0.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 cumulative new-token counts.
        seq_lens: ``[num_seqs]`` int32 tokens per sequence after this step.
        last_token_index: ``[num_seqs]`` int64 index in ``[0, num_tokens)`` of each sequence's last new token.
        max_q_len: most new tokens of one sequence.
        max_seq_len: longest sequence after this step, in tokens.
        is_from_scratch: no sequence has cached tokens (``"sdpa"`` attention is valid).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    last_token_index: torch.Tensor
    max_q_len: int
    max_seq_len: int
    is_from_scratch: bool

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.max_q_len == 1

    @classmethod
    def build(cls, seqs: Sequence[SeqSlice], *, block_size: int, device: torch.device) -> PagedBatch:
        """Build the metadata on the host and move it to ``device``.

        Raises:
            ValueError: no sequences, a sequence with no new tokens, or a block table too short for its tokens.
        """
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        max_blocks = max(len(s.block_ids) for s in seqs)
        table = torch.zeros((len(seqs), max_blocks), dtype=torch.int32)
        for row, s in enumerate(seqs):
            end = s.start_pos + s.num_new_tokens
            if s.num_new_tokens <= 0:
                raise ValueError(f"sequence {row} has no new tokens")
            if len(s.block_ids) * block_size < end:
                raise ValueError(f"sequence {row}: {len(s.block_ids)} blocks cannot hold {end} tokens")
            table[row, : len(s.block_ids)] = torch.tensor(list(s.block_ids), dtype=torch.int32)
            for pos in range(s.start_pos, end):
                positions.append(pos)
                slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
            cu.append(cu[-1] + s.num_new_tokens)
        seq_lens = [s.start_pos + s.num_new_tokens for s in seqs]
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_table=table.to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            last_token_index=torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1,
            max_q_len=max(s.num_new_tokens for s in seqs),
            max_seq_len=max(seq_lens),
            is_from_scratch=all(s.start_pos == 0 for s in seqs),
        )

    @classmethod
    def prefill_from_scratch(cls, num_tokens: int, *, block_size: int, device: torch.device) -> PagedBatch:
        """One sequence of ``num_tokens`` new tokens in blocks ``0, 1, ..`` (benchmarks)."""
        num_blocks = -(-num_tokens // block_size)
        return cls.build([SeqSlice(tuple(range(num_blocks)), 0, num_tokens)], block_size=block_size, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, returned in ``x.dtype``. ``x``: ``[num_tokens, hidden_size]``."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's RoPE (half-split rotation). ``x``: ``[num_tokens, heads, head_size]``; ``cos``/``sin``:
    ``[num_tokens, 1, head_size / 2]`` float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaModel:
    """Llama-shaped decoder over a paged KV pool; weights fused per layer (``qkv``, ``gate_up``).

    Args:
        config: sizes.
        weights: fused weights as produced by :meth:`random` or :meth:`from_safetensors`.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights
        embed = weights["embed"]
        self.device = embed.device
        self.dtype = embed.dtype
        inv = torch.arange(0, config.head_size, 2, dtype=torch.float64, device=self.device) / config.head_size
        self.inv_freq = (1.0 / (config.rope_theta**inv)).float()

    @classmethod
    def random(cls, config: ModelConfig, *, seed: int, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        """Random weights (normal, std 0.02; norms 1), a deterministic function of ``seed`` and the device type."""
        gen = torch.Generator(device=device).manual_seed(seed)
        c = config
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_size

        def normal(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

        weights = {
            "embed": normal(c.vocab_size, c.hidden_size),
            "norm": torch.ones(c.hidden_size, dtype=dtype, device=device),
        }
        weights["lm_head"] = weights["embed"] if c.tie_word_embeddings else normal(c.vocab_size, c.hidden_size)
        for layer in range(c.num_layers):
            weights[f"{layer}.qkv"] = normal(qkv_rows, c.hidden_size)
            weights[f"{layer}.o"] = normal(c.hidden_size, c.num_heads * c.head_size)
            weights[f"{layer}.gate_up"] = normal(2 * c.intermediate_size, c.hidden_size)
            weights[f"{layer}.down"] = normal(c.hidden_size, c.intermediate_size)
            weights[f"{layer}.attn_norm"] = torch.ones(c.hidden_size, dtype=dtype, device=device)
            weights[f"{layer}.mlp_norm"] = torch.ones(c.hidden_size, dtype=dtype, device=device)
        return cls(config, weights)

    @classmethod
    def from_safetensors(cls, folder: str | Path, *, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        """Load a Hugging Face Llama checkpoint (``config.json`` and ``*.safetensors``) from ``folder``.

        Raises:
            ValueError: no ``*.safetensors`` files, or a tensor the model needs is missing.
        """
        from safetensors.torch import load_file

        config = ModelConfig.from_hf_folder(folder)
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {folder}")
        raw: dict[str, torch.Tensor] = {}
        for file in files:
            raw.update(load_file(str(file)))

        def get(name: str) -> torch.Tensor:
            try:
                return raw[name].to(device=device, dtype=dtype)
            except KeyError as exc:
                raise ValueError(f"{folder}: tensor {name} is missing") from exc

        weights = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
        tied = config.tie_word_embeddings or "lm_head.weight" not in raw
        weights["lm_head"] = weights["embed"] if tied else get("lm_head.weight")
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            weights[f"{layer}.qkv"] = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], dim=0)
            weights[f"{layer}.o"] = get(p + "self_attn.o_proj.weight")
            weights[f"{layer}.gate_up"] = torch.cat([get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")], dim=0)
            weights[f"{layer}.down"] = get(p + "mlp.down_proj.weight")
            weights[f"{layer}.attn_norm"] = get(p + "input_layernorm.weight")
            weights[f"{layer}.mlp_norm"] = get(p + "post_attention_layernorm.weight")
        return cls(config, weights)

    def allocate_kv_pool(self, num_blocks: int, block_size: int = 16) -> torch.Tensor:
        """A zeroed pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` on the model's device."""
        c = self.config
        return allocate_gpu_pool(
            num_layers=c.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_size,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        batch: PagedBatch,
        kv_pool: torch.Tensor,
        *,
        attention: AttentionBackend = "auto",
        last_token_logits: bool = True,
    ) -> torch.Tensor:
        """Run one step: write the new tokens' KV into the pool and return logits.

        Args:
            token_ids: ``[num_tokens]`` new tokens of all sequences, packed in ``batch`` order.
            batch: positions, slots and block tables of the step.
            kv_pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``, written in place.
            attention: backend (module docstring).
            last_token_logits: return logits of each sequence's last new token only.

        Returns:
            float32 logits, ``[num_seqs, vocab_size]`` (or ``[num_tokens, vocab_size]``).

        Raises:
            ValueError: ``"sdpa"`` on a batch with cached tokens, or a token count that differs from ``batch``.
        """
        if token_ids.shape[0] != batch.positions.shape[0]:
            raise ValueError(f"{token_ids.shape[0]} tokens for a batch of {batch.positions.shape[0]}")
        backend = attention
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if backend == "sdpa" and not batch.is_from_scratch:
            raise ValueError("sdpa attention sees only the step's own tokens: every sequence must start at 0")
        c, w = self.config, self.weights
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x = w["embed"][token_ids]
        q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        for layer in range(c.num_layers):
            h = rms_norm(x, w[f"{layer}.attn_norm"], c.rms_norm_eps)
            q, k, v = torch.split(F.linear(h, w[f"{layer}.qkv"]), [q_size, kv_size, kv_size], dim=-1)
            q = rotary(q.reshape(-1, c.num_heads, c.head_size), cos, sin)
            k = rotary(k.reshape(-1, c.num_kv_heads, c.head_size), cos, sin)
            v = v.reshape(-1, c.num_kv_heads, c.head_size)
            k_cache, v_cache = kv_pool[layer, 0], kv_pool[layer, 1]
            k_cache.view(-1, c.num_kv_heads, c.head_size).index_copy_(0, batch.slot_mapping, k)
            v_cache.view(-1, c.num_kv_heads, c.head_size).index_copy_(0, batch.slot_mapping, v)
            o = self._attention(backend, q, k, v, k_cache, v_cache, batch)
            x = x + F.linear(o.reshape(-1, q_size), w[f"{layer}.o"])
            h = rms_norm(x, w[f"{layer}.mlp_norm"], c.rms_norm_eps)
            gate, up = F.linear(h, w[f"{layer}.gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[f"{layer}.down"])
        if last_token_logits:
            x = x[batch.last_token_index]
        return F.linear(rms_norm(x, w["norm"], c.rms_norm_eps), w["lm_head"]).float()

    def _attention(
        self,
        backend: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        scale = self.config.head_size**-0.5
        if backend == "triton":
            from kernels.paged_attention import paged_decode_attention, paged_prefill_attention

            if batch.is_decode:
                return paged_decode_attention(
                    q, k_cache, v_cache, batch.block_table, batch.seq_lens, scale, max_seq_len=batch.max_seq_len
                )
            return paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                batch.block_table,
                batch.cu_seqlens_q,
                batch.seq_lens,
                scale,
                max_q_len=batch.max_q_len,
            )
        if backend == "torch":
            from kernels.reference import paged_prefill_attention_ref

            return paged_prefill_attention_ref(
                q, k_cache, v_cache, batch.block_table, batch.cu_seqlens_q, batch.seq_lens, scale
            )
        if backend == "sdpa":
            out = torch.empty_like(q)
            cu = batch.cu_seqlens_q.tolist()
            for start, end in zip(cu[:-1], cu[1:], strict=True):
                # [1, heads, tokens, head_size]: the fused backends need a batch dimension.
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None],
                    k[start:end].transpose(0, 1)[None],
                    v[start:end].transpose(0, 1)[None],
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                out[start:end] = o[0].transpose(0, 1)
            return out
        raise ValueError(f"unknown attention backend {backend!r}")
