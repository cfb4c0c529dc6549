"""What the RMS normalization's Triton kernels take, importable without triton (the module that chooses a backend reads
it)."""

MAX_DIM = 4096  # the widest row the kernels take (the gated norm's bound: one row's float32 block per program)
