"""Suite-wide setup that must happen before any test module is imported.

Triton chooses its CPU interpreter when a kernel is *defined* (at import of its module), and several folders
(``tests/gpu``, ``tests/kernels``, ``tests/workers``) import ``kernels.*``; so on a machine without CUDA the
interpreter is switched on here, in the root conftest, which pytest loads before collecting any folder.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("torch") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
