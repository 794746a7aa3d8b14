"""Kernel tests run on a GPU when there is one and through Triton's interpreter otherwise.

The interpreter is chosen by TRITON_INTERPRET=1, which Triton reads when a kernel is defined, so it is
set here, before any test module imports a kernel module. Without Triton the kernel tests skip (each
imports it with pytest.importorskip); the pure-PyTorch reference tests run everywhere.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    # The interpreter converts 1-element arrays to Python scalars in a way numpy deprecates.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")
