"""muP coordinate check: do activations stay O(1) across widths when the multipliers are transferred?

    result = coordinate_check((64, 128, 256, 512), base_width=128, steps=6)
    write_report(result, "runs/mup")          # mup_check.json + mup_check.png

For each width d, a hybrid model of the `tiny` preset's shape scaled to hidden_size d (head dims fixed at
64, so attention heads, SSM heads, SSM and MLP widths grow with d) gets the forward multipliers tuned at
`base_width` (all 1 there) transferred with `training.optim.scale_multipliers` (d / base_width to the
exponents of `MUP_WIDTH_EXPONENTS`), the same AdamW lr for every width (the role groups of
`training.optim`, no weight decay) and the same fixed batch of token ids; it takes `steps` updates. Before
every update, forward hooks record the RMS of what each layer type adds to the residual stream, with its
output multiplier applied, combined over layers (root mean square):

    embedding   embed_tokens(ids) x embedding_multiplier
    attention   attn(...) x attention_out_multiplier          ssm   ssm(...) x ssm_out_multiplier
    mlp         mlp(...)                                        block the residual stream after each block
    logits      lm_head(h) x lm_head_multiplier

Two views: `rms` (the activation itself) and `delta_rms` (its change since step 0, on the same batch):
what muP makes width-independent is the effect of the *updates*. The init std is width-independent here
(see `training.optim`), so at step 0 a hidden layer's output shrinks like (base/d)^(1/2) (the MLP's like
(base/d)^(3/2), its two matrices share one multiplier) while the residual stream is carried by the
embeddings; after a few updates the update term dominates and every curve flattens. With
`scale=False` (multipliers left at 1: standard parametrization with a width-independent Adam lr) the
update term grows with d instead, which is what the check exists to catch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from hybridlm.fileio import save_figure_atomic, write_atomic

LAYER_TYPES = ("embedding", "attention", "ssm", "mlp", "block", "logits")
HEAD_DIM = 64


def width_config(width: int, base_width: int, *, layers: int = 2, vocab_size: int = 256, scale: bool = True):
    """The `tiny` preset's shape at hidden_size `width` (fixed 64-dim heads), multipliers transferred."""
    from hybridlm.models.presets import get_preset
    from hybridlm.training.optim import scale_multipliers

    if width % HEAD_DIM:
        raise ValueError(f"widths must be multiples of {HEAD_DIM} (the head dim), got {width}")
    config = get_preset(
        "tiny", hidden_size=width, num_attention_heads=width // HEAD_DIM, num_key_value_heads=1, head_dim=HEAD_DIM,
        mamba_d_ssm=2 * width, mamba_n_heads=2 * width // HEAD_DIM, mamba_d_head=HEAD_DIM,
        intermediate_size=5 * width // 2, num_hidden_layers=layers, vocab_size=vocab_size,
    )
    if scale:
        names = config.multiplier_names()
        config = config.replace(**scale_multipliers({n: getattr(config, n) for n in names}, base_width, width))
    return config


class _Recorder:
    """Forward hooks that keep the mean square of each layer type's contribution, summed over layers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.sums: dict[str, list[float]] = {}
        self.handles = []
        inner = model.model
        self._hook(inner.embed_tokens, "embedding", lambda: inner.embedding_multiplier)
        self._hook(model.lm_head, "logits", lambda: model.lm_head_multiplier)
        for block in inner.layers:
            self._hook(block, "block", lambda: 1.0)
            if block.attn is not None:
                self._hook(block.attn, "attention", lambda b=block: b.attn_out_multiplier)
            if block.ssm is not None:
                self._hook(block.ssm, "ssm", lambda b=block: b.ssm_out_multiplier)
            if block.mlp is not None:
                self._hook(block.mlp, "mlp", lambda: 1.0)

    def _hook(self, module: torch.nn.Module, kind: str, multiplier) -> None:
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.sums.setdefault(kind, []).append(out.detach().float() * multiplier())

        self.handles.append(module.register_forward_hook(hook))

    def take(self) -> dict[str, list[torch.Tensor]]:
        out, self.sums = self.sums, {}
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _rms(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).mean()) for t in tensors) / len(tensors))


def coordinate_check(
    widths=(64, 128, 256, 512),
    *,
    base_width: int = 128,
    steps: int = 6,
    lr: float = 1e-2,
    batch: int = 8,
    seq_len: int = 64,
    layers: int = 2,
    seed: int = 0,
    scale: bool = True,
) -> dict[str, Any]:
    """Activation RMS per layer type, per width, at steps 0..steps (see the module docstring)."""
    from hybridlm.models.model import HybridForCausalLM
    from hybridlm.training.optim import build_param_groups

    widths = sorted(int(w) for w in widths)
    vocab = 256
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    rms: dict[str, dict[str, list[float]]] = {k: {} for k in LAYER_TYPES}
    delta: dict[str, dict[str, list[float]]] = {k: {} for k in LAYER_TYPES}
    losses: dict[str, list[float]] = {}
    multipliers: dict[str, dict[str, float]] = {}
    for width in widths:
        torch.manual_seed(seed)
        config = width_config(width, base_width, layers=layers, vocab_size=vocab, scale=scale)
        multipliers[str(width)] = {n: getattr(config, n) for n in config.multiplier_names()}
        model = HybridForCausalLM(config)
        optimizer = torch.optim.AdamW(build_param_groups(model.named_parameters(), lr=lr, weight_decay=0.0),
                                      betas=(0.9, 0.95))
        recorder = _Recorder(model)
        first: dict[str, list[torch.Tensor]] = {}
        losses[str(width)] = []
        for step in range(steps + 1):
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            seen = recorder.take()
            if step == 0:
                first = seen
            for kind, tensors in seen.items():
                rms[kind].setdefault(str(width), []).append(_rms(tensors))
                delta[kind].setdefault(str(width), []).append(_rms([t - f for t, f in zip(tensors, first[kind])]))
            losses[str(width)].append(float(loss.detach()))
            if step < steps:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        recorder.remove()
    return {
        "widths": widths, "base_width": base_width, "steps": steps, "lr": lr, "batch": batch, "seq_len": seq_len,
        "layers": layers, "seed": seed, "scale": scale, "multipliers": multipliers,
        "rms": {k: v for k, v in rms.items() if v}, "delta_rms": {k: v for k, v in delta.items() if v},
        "loss": losses,
    }


def spread(result: dict[str, Any], view: str = "delta_rms", *, step: int | None = None) -> dict[str, float]:
    """Per layer type: the largest factor by which a width's RMS differs from the base width's
    (max over widths of max(r / r_base, r_base / r)) at `step` (default: the last)."""
    base = str(result["base_width"])
    at = result["steps"] if step is None else step
    out = {}
    for kind, by_width in result[view].items():
        ref = by_width[base][at]
        factors = [max(v[at] / ref, ref / v[at]) for v in by_width.values() if ref > 0 and v[at] > 0]
        out[kind] = max(factors) if factors else math.inf
    return out


def write_report(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """`mup_check.json` (the result plus the spreads) and `mup_check.png` (RMS against width, one panel per
    layer type, one line per step; top row the activations, bottom row their change since step 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(result, spread={"rms": spread(result, "rms"), "delta_rms": spread(result, "delta_rms")})
    json_path = out_dir / "mup_check.json"
    write_atomic(json_path, (json.dumps(report, indent=1) + "\n").encode("utf-8"))

    kinds = list(result["rms"])
    widths = result["widths"]
    fig, axes = plt.subplots(2, len(kinds), figsize=(3.0 * len(kinds), 6.0), squeeze=False)
    colors = plt.cm.viridis([i / max(1, result["steps"]) for i in range(result["steps"] + 1)])
    for row, view in enumerate(("rms", "delta_rms")):
        for col, kind in enumerate(kinds):
            ax = axes[row][col]
            for step in range(result["steps"] + 1):
                if view == "delta_rms" and step == 0:
                    continue
                ax.plot(widths, [result[view][kind][str(w)][step] for w in widths], "o-", color=colors[step],
                        label=f"step {step}", markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{kind}" + (" (change)" if view == "delta_rms" else ""))
            ax.set_xlabel("width")
            if col == 0:
                ax.set_ylabel("RMS" if view == "rms" else "RMS of change since step 0")
    axes[0][0].legend(fontsize=6)
    mode = "muP multipliers" if result["scale"] else "multipliers NOT scaled"
    fig.suptitle(f"coordinate check ({mode}, base width {result['base_width']}, lr {result['lr']:g})")
    fig.tight_layout()
    png_path = out_dir / "mup_check.png"
    try:
        save_figure_atomic(fig, png_path, dpi=100)  # a crash mid-write keeps the previous report's image
    finally:
        plt.close(fig)
    return json_path, png_path
