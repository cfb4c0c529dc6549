"""Device names as users type them (`--device cpu`, `cuda`, `cuda:1`, `cuda:0,cuda:1`), checked against this machine.

    parse_device("cuda:1")          # torch.device, or a ValueError that names the option and what torch sees
    parse_devices("cuda")           # every visible GPU: ["cuda:0", "cuda:1", ...]
"""

from __future__ import annotations

import torch


def parse_device(name: str) -> torch.device:
    """One device name -> a torch.device that exists here (ValueError otherwise: a malformed name, a GPU index
    past the visible ones, CUDA on a machine without it)."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name}: {err}") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s) here")
    return device


def parse_devices(text: str) -> list[str]:
    """"cuda" -> every visible GPU ("cuda:0", ...), "cpu", or an explicit list "cuda:0,cuda:1"."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    if names == ["cuda"]:
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no GPU")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for name in names:
        parse_device(name)
    return names
