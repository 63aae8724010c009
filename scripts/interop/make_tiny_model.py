"""Build the tiny Llama the vLLM interop suite serves, entirely from local data (no downloads).

Usage (with the python of the vLLM virtualenv, which has ``torch``, ``transformers`` and ``tokenizers``)::

    python scripts/interop/make_tiny_model.py OUT_DIR            # the tiny Llama
    python scripts/interop/make_tiny_model.py --hybrid OUT_DIR   # a tiny Gemma-3-style hybrid (see below)

Writes to ``OUT_DIR``:

* ``tokenizer.json``: a byte-level BPE trained with ``tokenizers`` on the text below, ``VOCAB_SIZE`` ids, no
  post-processor (so ``add_special_tokens`` adds nothing: vLLM's completions and the gateway agree without BOS
  rules), special tokens ``SPECIAL_TOKENS``;
* ``tokenizer_config.json`` and ``chat_template.jinja`` (``PreTrainedTokenizerFast.save_pretrained``): a
  Llama-3-shaped template where every message ends with the special token ``<|eot_id|>``, so each message's text is
  tokenized on its own and per-message tokenization equals whole-prompt tokenization (what the gateway's
  incremental tokenizer relies on, see ``common/tokenization.py``);
* ``config.json`` + ``model.safetensors``: ``LlamaForCausalLM`` with hidden size 64 and 2 heads, so head_dim is 32
  (vLLM's CPU attention refuses head_dim 16), 2 layers, random weights from a fixed seed, bfloat16.

``--hybrid`` writes the same tokenizer with a ``Gemma3ForCausalLM`` instead: layer 0 sliding-window attention
(``HYBRID_SLIDING_WINDOW`` tokens), layer 1 full attention, the same sizes; vLLM's CPU build serves it with two
KV-cache groups. (No tiny Mamba / linear-attention hybrid starts on vLLM 0.32's CPU build; the reasons are in
``tests/interop/test_vllm_hybrid.py``.)

The output is deterministic for a given ``tokenizers``/``transformers``/``torch`` version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 512
"""Token ids, special tokens included."""
HIDDEN_SIZE = 64
NUM_ATTENTION_HEADS = 2
"""``HIDDEN_SIZE // NUM_ATTENTION_HEADS`` = 32 = head_dim, the smallest vLLM's CPU attention supports."""
NUM_HIDDEN_LAYERS = 2
INTERMEDIATE_SIZE = 128
MAX_POSITION_EMBEDDINGS = 2048
SEED = 1234

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

TRAINING_TEXT = """\
The router keeps a radix index of which worker holds which prefix on which tier. A request whose prompt starts
with blocks another request already computed can skip their prefill, so the gateway sends it to the worker that
still holds them. Agentic clients resend the same conversation every turn, a little longer each time: a system
prompt, tool definitions, the history of messages and tool results, then a few hundred new tokens.
Each block holds exactly block_size tokens; its hash chains the parent's hash with the block's token ids.
Workers publish BlockStored, BlockRemoved and AllBlocksCleared events over ZMQ, with a sequence number per batch.
When a worker restarts, its sequence starts over and the gateway clears everything it knew about that worker.
def route(request, snapshot):
    best = min(snapshot.workers, key=lambda w: w.queued_s + w.prefill_s(request) + w.restore_s(request))
    return best.worker_id
Tool result: 200 OK {"status": "ok", "items": [1, 2, 3], "elapsed_ms": 12.5}
User: please summarise the log above and list every failing test with its error message.
Assistant: three tests failed; the first times out after 30 s, the second asserts 64 == 32, the third is flaky.
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'"()[]{}<>/\\|@#$%^&*-_=+~`
"""


def build_tokenizer(out_dir: Path) -> int:
    """Train the byte-level BPE and save it with its config and chat template; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.save_pretrained(str(out_dir))
    if not (out_dir / "chat_template.jinja").is_file():  # older transformers keep it in tokenizer_config.json
        (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return int(tok.get_vocab_size(with_added_tokens=True))


def build_model(out_dir: Path, vocab_size: int) -> None:
    """Save a randomly initialised ``LlamaForCausalLM`` (bfloat16, safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from_id = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    ids = {t["content"]: t["id"] for t in from_id}
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_ATTENTION_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir))


HYBRID_SLIDING_WINDOW = 64
"""Tokens of the sliding window of the hybrid variant's layer 0 (``--hybrid``)."""


def build_hybrid_model(out_dir: Path, vocab_size: int) -> None:
    """Save a randomly initialised ``Gemma3ForCausalLM`` with one sliding-window layer (window
    ``HYBRID_SLIDING_WINDOW``) and one full-attention layer: vLLM serves it with two KV-cache groups (group 0 the
    sliding window, group 1 full attention)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from_id = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    ids = {t["content"]: t["id"] for t in from_id}
    torch.manual_seed(SEED)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=2,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_ATTENTION_HEADS,
        head_dim=HIDDEN_SIZE // NUM_ATTENTION_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        sliding_window=HYBRID_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out_dir))


def main(argv: list[str]) -> int:
    """Entry point: ``make_tiny_model.py [--hybrid] OUT_DIR``."""
    args = argv[1:]
    hybrid = "--hybrid" in args
    args = [a for a in args if a != "--hybrid"]
    if len(args) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out_dir)
    (build_hybrid_model if hybrid else build_model)(out_dir, vocab_size)
    print(f"tiny model in {out_dir}: vocab {vocab_size}, head_dim {HIDDEN_SIZE // NUM_ATTENTION_HEADS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
