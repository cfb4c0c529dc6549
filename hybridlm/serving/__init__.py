"""Serving: a continuous-batching engine with prefix caching of recurrent state, and an OpenAI-compatible server.

    from hybridlm.serving import Engine, SamplingParams
    engine = Engine("runs/demo/final", max_num_seqs=16)
    print(engine.generate(["def main("], SamplingParams(max_tokens=32))[0].text)

`engine.py` (the scheduler), `packed.py` (several requests' prefill pieces in one forward), `slots.py` (the running
rows' states), `prefix_cache.py` (state snapshots by prompt prefix), `text.py` (incremental detokenization, stop strings), `runner.py` (the engine on a thread of the server's process), `process.py` (the engine in a process of its own), `graphed.py` (decoding steps as CUDA graphs),
`server.py` (the HTTP API), `commands.py` (`hybridlm serve`).
"""

from __future__ import annotations

from hybridlm.lazy import lazy_exports

_EXPORTS = {
    "Engine": "hybridlm.serving.engine",
    "RequestOutput": "hybridlm.serving.engine",
    "SamplingParams": "hybridlm.serving.params",
    "PrefixCache": "hybridlm.serving.prefix_cache",
    "EngineRunner": "hybridlm.serving.runner",
    "EngineProcess": "hybridlm.serving.process",
    "build_app": "hybridlm.serving.server",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
