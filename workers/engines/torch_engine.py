"""The ``torch`` engine: a real Llama-shaped model over the paged KV pool, behind the engine seam.

Each step (``workers.engines.base``):

1. stores (GPU -> CPU) are issued on the transfer side stream: gather straight into the pinned CPU pool; the
   compute issued next waits for them (``KVTransfer.fence_compute``), so the KV manager may reuse the source
   blocks at once;
2. restores (CPU -> GPU) are issued on the same side stream: copy-engine transfers of runs of consecutive CPU
   blocks into a staging buffer + scatter into the GPU blocks the KV manager reserved, overlapped with this
   step's compute (the request that owns them is not scheduled until the job is reported finished);
3. prefill chunks and decodes run as one batch through the model (Triton kernels on CUDA, torch on the CPU), and
   each sequence that samples gets its next token;
4. copy jobs whose CUDA events have completed are reported (on the CPU, copies complete at once).

Sampling: greedy at temperature 0, else temperature + top-p from a generator seeded by ``(seed, position)``, so
outputs are deterministic per request whatever the batch.
"""

# torch.cuda.Event is unannotated in torch.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import torch

from workers.engines.base import BlockCopy, SamplingParams, ScheduledStep, StepResult
from workers.model.config import PRESETS, ModelConfig
from workers.model.kv_pool import KVTransfer, TransferMode, allocate_cpu_pool
from workers.model.llama import AttentionBackend, LlamaModel, PagedBatch, SeqSlice

logger = logging.getLogger(__name__)


class TorchEngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="kebab"):
    """Model and device of the torch engine."""

    preset: str = "tiny"
    """Model sizes when no weights folder is given: one of ``workers.model.config.PRESETS``."""
    weights: str | None = None
    """Folder with a Hugging Face Llama ``config.json`` and ``*.safetensors``; ``None``: random weights."""
    seed: int = 0
    """Seed of random weights."""
    device: str | None = None
    """``cuda``, ``cpu``, or ``None`` for CUDA when available."""
    dtype: str = "bfloat16"
    """Weights and KV dtype: ``bfloat16`` or ``float16``."""
    attention: AttentionBackend = "auto"
    """Attention backend of the model."""
    transfer_mode: TransferMode = "auto"
    """CPU-tier copies: ``auto`` (offload by a kernel writing pinned memory, restore staged through the copy
    engine), ``direct`` (kernels on pinned memory both ways) or ``staged`` (copy engine both ways)."""


@dataclass
class _Job:
    job_id: int
    event: torch.cuda.Event | None


class TorchEngine:
    """Runs scheduled steps on a :class:`LlamaModel` with a GPU pool and an optional pinned CPU pool.

    Args:
        model: the model (its device is the engine's).
        num_gpu_blocks: blocks of the GPU pool.
        num_cpu_blocks: blocks of the CPU pool (0: no CPU tier).
        block_size: tokens per block.
        attention: the model's attention backend.
        transfer_mode: how CPU-tier copies run.
    """

    name = "torch"

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        attention: AttentionBackend = "auto",
        transfer_mode: TransferMode = "auto",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.attention: AttentionBackend = attention
        self.gpu_pool = model.allocate_kv_pool(num_gpu_blocks, block_size)
        self.cpu_pool = allocate_cpu_pool(self.gpu_pool, num_cpu_blocks) if num_cpu_blocks else None
        self.transfer = KVTransfer(self.gpu_pool, mode=transfer_mode)
        self._stores: deque[_Job] = deque()
        self._restores: deque[_Job] = deque()

    def execute(self, step: ScheduledStep) -> StepResult:
        """Run one step (module docstring); ``duration_s`` is measured wall time."""
        start_s = time.perf_counter()
        if step.pool_stores or step.pool_restores:
            # their jobs would never be reported: fail the step rather than leave requests waiting forever
            raise RuntimeError("the torch engine does not run shared pool copies (WorkerConfig refuses a pool tier)")
        for copy in step.stores:
            self._stores.append(_Job(copy.job_id, self._copy(copy, to_cpu=True)))
        for copy in step.restores:
            self._restores.append(_Job(copy.job_id, self._copy(copy, to_cpu=False)))
        sampled: dict[str, int] = {}
        if step.prefills or step.decodes:
            self.transfer.fence_compute()
            sampled = self._compute(step)
        elif self._stores or self._restores:
            self._wait_for_one()
        return StepResult(
            sampled_token_ids=sampled,
            duration_s=time.perf_counter() - start_s,
            finished_store_job_ids=self._collect(self._stores),
            finished_restore_job_ids=self._collect(self._restores),
        )

    def has_pending_copies(self) -> bool:
        """Whether any store or restore job has not been reported yet."""
        return bool(self._stores or self._restores)

    def close(self) -> None:
        """Wait for copies in flight and drop the pools."""
        if self.gpu_pool.device.type == "cuda":
            torch.cuda.synchronize(self.gpu_pool.device)
        self._stores.clear()
        self._restores.clear()

    def _copy(self, copy: BlockCopy, *, to_cpu: bool) -> torch.cuda.Event | None:
        if self.cpu_pool is None:
            raise RuntimeError(f"copy job {copy.job_id} issued but the engine has no CPU pool")
        if to_cpu:
            return self.transfer.offload(copy.src_block_ids, self.cpu_pool, copy.dst_block_ids)
        return self.transfer.restore(copy.dst_block_ids, self.cpu_pool, copy.src_block_ids)

    def _compute(self, step: ScheduledStep) -> dict[str, int]:
        seqs: list[SeqSlice] = []
        tokens: list[int] = []
        samplers: list[tuple[int, str, SamplingParams, int]] = []  # (row, request id, params, position)
        for chunk in step.prefills:
            seqs.append(SeqSlice(chunk.block_ids, chunk.start_pos, len(chunk.token_ids)))
            tokens.extend(chunk.token_ids)
            if chunk.sample:
                position = chunk.start_pos + len(chunk.token_ids)
                samplers.append((len(seqs) - 1, chunk.request_id, chunk.sampling, position))
        for dec in step.decodes:
            seqs.append(SeqSlice(dec.block_ids, dec.position, 1))
            tokens.append(dec.token_id)
            samplers.append((len(seqs) - 1, dec.request_id, dec.sampling, dec.position + 1))
        device = self.model.device
        batch = PagedBatch.build(seqs, block_size=self.block_size, device=device)
        ids = torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True)
        logits = self.model.forward(ids, batch, self.gpu_pool, attention=self.attention).cpu()
        return {req: sample(logits[row], params, position) for row, req, params, position in samplers}

    def _collect(self, jobs: deque[_Job]) -> tuple[int, ...]:
        done = []
        while jobs and (jobs[0].event is None or jobs[0].event.query()):
            done.append(jobs.popleft().job_id)
        return tuple(done)

    def _wait_for_one(self) -> None:
        for jobs in (self._restores, self._stores):
            if jobs and jobs[0].event is not None:
                jobs[0].event.synchronize()
                return


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick a token from ``[vocab_size]`` float32 logits: argmax at temperature 0, else temperature + top-p with a
    generator seeded by ``(params.seed, position)``."""
    if params.temperature <= 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    gen = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (1 << 63))
    return int(torch.multinomial(probs, 1, generator=gen))


def build_torch_engine(
    config: TorchEngineConfig,
    *,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    block_size: int,
    min_vocab_size: int = 0,
) -> TorchEngine:
    """Build the model and pools from ``config``.

    Args:
        config: model and device.
        num_gpu_blocks: GPU pool size in blocks.
        num_cpu_blocks: CPU pool size in blocks (0: no CPU tier).
        block_size: tokens per block.
        min_vocab_size: random-weight models grow their vocabulary to cover the tokenizer's ids.

    Raises:
        ValueError: an unknown preset or dtype, or a weights folder that cannot be loaded.
    """
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    if config.dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {config.dtype!r}")
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if config.weights:
        model = LlamaModel.from_safetensors(config.weights, device=device, dtype=dtypes[config.dtype])
    else:
        if config.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {config.preset!r}")
        sizes: ModelConfig = PRESETS[config.preset]
        if sizes.vocab_size < min_vocab_size:
            sizes = msgspec.structs.replace(sizes, vocab_size=min_vocab_size)
        model = LlamaModel.random(sizes, seed=config.seed, device=device, dtype=dtypes[config.dtype])
    logger.info(
        "torch engine: %s on %s, %d GPU blocks, %d CPU blocks", config.preset, device, num_gpu_blocks, num_cpu_blocks
    )
    return TorchEngine(
        model,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=block_size,
        attention=config.attention,
        transfer_mode=config.transfer_mode,
    )
