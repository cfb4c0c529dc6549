"""Device names as users type them (`--device cpu`, `cuda`, `cuda:1`, `cuda:0,cuda:1`), checked against this machine.

    parse_device("cuda:1")          # torch.device, or a ValueError that names the option and what torch sees
    parse_devices("cuda")           # every visible GPU: ["cuda:0", "cuda:1", ...]
"""

from __future__ import annotations

import torch


def parse_device(name: str) -> torch.device:
    """One device name -> a torch.device that exists here (ValueError otherwise, naming what to give instead: a
    malformed name, a GPU index past the visible ones, CUDA on a machine without it, a device type torch has no
    device of here, e.g. meta)."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name}: {err}; give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s) here; {_visible_gpus()}")
    if device.type not in ("cpu", "cuda") and device.type != _accelerator_type():
        raise ValueError(f"--device {name}: torch has no {device.type} device here; give cpu, cuda or cuda:N")
    return device


def _visible_gpus() -> str:
    """What to give instead of a GPU that is not there."""
    count = torch.cuda.device_count()
    if count == 0:
        return "use --device cpu"
    return "use --device cuda:0" if count == 1 else f"use cuda:0 to cuda:{count - 1}, or cuda for all of them"


def _accelerator_type() -> str | None:
    """The type of the accelerator torch can use here besides CUDA (mps, xpu, ...), or None."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    current = accelerator.current_accelerator()
    return None if current is None else current.type


def parse_devices(text: str) -> list[str]:
    """"cuda" -> every visible GPU ("cuda:0", ...), "cpu", or an explicit list "cuda:0,cuda:1"."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names:
        raise ValueError(f"--device {text!r} names no device; give cpu, cuda or a list cuda:0,cuda:1")
    if names == ["cuda"]:
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no GPU; use --device cpu")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for name in names:
        parse_device(name)
    return names
