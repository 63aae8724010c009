"""What the gateway (``router``) and the reference worker (``workers``) share, and nothing else.

Both processes must agree byte for byte on some things: the prompt tokens of a chat (the gateway predicts the
worker's cached tokens from them, DESIGN.md §7b) and the way a listening address that cannot be bound is reported.
That code lives here, so that neither package imports the other:

* ``common.tokenization``: tokenizers (byte-level, Hugging Face ``tokenizer.json``) and chat templates (ChatML
  default, Jinja), with per-message segments for incremental tokenization;
* ``common.listen``: TCP listening sockets bound before a server starts anything else, and one-line bind errors
  (HTTP ports and ZMQ endpoints);
* ``common.errors``: the errors those two raise;
* ``common.pd_protocol``: the prefill/decode handshakes the engines speak (vLLM ``kv_transfer_params``, SGLang
  bootstrap fields), as typed structs and pure body rewrites, so the gateway builds exactly what the worker reads.

What belongs here: pure, dependency-light code that both the gateway and the worker call with the same meaning.
What never does: anything that only one side uses, anything with process state (servers, event loops, sockets
kept open), and any import of ``router``, ``workers``, ``policies``, ``loadgen`` or ``kernels`` (``events`` only
for its error types). ``tests/test_architecture.py`` checks the import rules.
"""
