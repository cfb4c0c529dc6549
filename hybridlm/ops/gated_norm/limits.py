"""What the gated norm's Triton kernels take, importable without triton (the module that chooses a backend reads it)."""

MAX_GROUP = 4096  # the widest group the kernels take (ptxas, sm_90: the backward spills at 8192 even at 8 warps)
