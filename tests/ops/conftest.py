"""The op tests' Triton mode is set before any test module loads a kernel: importing `triton_modes` sets
TRITON_INTERPRET under HYBRIDLM_TRITON_INTERPRET=1 (Triton reads it when a kernel is defined) and one fixed launch per
kernel instead of autotuning."""

import tests.ops.triton_modes  # noqa: F401
