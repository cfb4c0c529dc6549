"""The head sizes the Triton kernels take, without torch: the model config derives its default head counts from
them (so that `backend="auto"` never leaves a default model on the torch paths), and the kernels' `limits.py`
modules check calls against them."""

FAST_WEIGHT_MAX_HEAD_DIM = 128  # K and V of the fast-weight kernels
SSD_MAX_HEAD_DIM = 128  # P: the SSD backward kernels hold a whole head's [chunk, P] block
SSD_MAX_D_STATE = 256  # N: looped over in blocks of 64
