"""Kernel tests run Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated; the kernels package imports its Triton
modules lazily, so setting it here (at collection, before any kernel test runs) is enough.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
