"""What the training tests share: tiny runs of the demo corpus (configs, `--set` arguments, a directory snapshot),
and small modules with the parameter names of hybridlm's models (no model import)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridlm.training.config import TrainConfig, load_config


def small_config(demo_dir: Path, out: Path, *overrides: str) -> TrainConfig:
    """Tiny preset, 2 x 32-token rows per micro-batch, 8 updates, no samples / bar / periodic eval or saves."""
    return load_config(None, [
        f"data.demo_dir={demo_dir}", f"train.out_dir={out}", "data.demo_max_bytes=400000",
        "data.demo_heldout_every=4", "batch.micro_batch=2", "batch.seq_len=32", "train.steps=8",
        "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.samples=0", "train.progress=false",
        "schedule.warmup=2", "optim.lr=3e-3", *overrides,
    ])


def cli_sets(demo_dir: Path, *overrides: str) -> list[str]:
    """`--set` arguments for a tiny demo run through the CLI (as small_config, without the out dir)."""
    sets = [f"data.demo_dir={demo_dir}", "data.demo_max_bytes=400000", "data.demo_heldout_every=4",
            "batch.micro_batch=2", "batch.seq_len=32", "train.samples=0", "train.progress=false",
            "train.eval_every=0", "schedule.warmup=1", *overrides]
    return [a for s in sets for a in ("--set", s)]


def snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under a run directory (demo data aside): content and modification time."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file() and "demo_data" not in p.parts}


class ToyNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyConv(nn.Module):
    """Depthwise causal conv with a [channels, kernel] weight, like hybridlm.modules.short_conv."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, kernel) * 0.3)
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        kernel = self.weight.shape[1]
        padded = nn.functional.pad(x.transpose(1, 2), (kernel - 1, 0))
        out = nn.functional.conv1d(padded, self.weight.unsqueeze(1), self.bias, groups=x.shape[-1])
        return out.transpose(1, 2)


class ToyMamba(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * width, bias=False)
        self.conv = ToyConv(width, 3, bias=True)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = ToyNorm(width)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        heads = self.D.shape[0]
        scale = (torch.sigmoid(self.dt_bias) * torch.exp(-self.A_log.exp()) + self.D).repeat_interleave(
            x.shape[-1] // heads
        )
        return self.out_proj(self.norm(torch.nn.functional.silu(self.conv(xs)) * scale) * torch.sigmoid(z))


class ToyFastWeight(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 2 * width, bias=False)
        self.conv = ToyConv(width, 3, bias=False)
        self.beta_bias = nn.Parameter(torch.zeros(heads))
        self.lam_bias = nn.Parameter(torch.zeros(heads))
        self.norm = ToyNorm(width)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        gain = (torch.sigmoid(self.beta_bias) + torch.sigmoid(self.lam_bias)).mean()
        return self.out_proj(self.norm(self.conv(xs) * gain) * torch.sigmoid(z))


class ToyAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=True)
        self.k_proj = nn.Linear(width, width, bias=True)
        self.v_proj = nn.Linear(width, width, bias=True)
        self.o_proj = nn.Linear(width, width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class ToyMLP(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(self.up_proj(x) * nn.functional.silu(self.gate_proj(x))))


class ToyBlock(nn.Module):
    def __init__(self, width: int, fast_weight: bool) -> None:
        super().__init__()
        self.norm = ToyNorm(width)
        self.ssm = ToyFastWeight(width) if fast_weight else ToyMamba(width)
        self.attn = ToyAttention(width)
        self.mlp_norm = ToyNorm(width)
        self.mlp = ToyMLP(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        h = x + self.ssm(n) + self.attn(n)
        return h + self.mlp(self.mlp_norm(h))


class ToyBackbone(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([ToyBlock(width, fast_weight=False), ToyBlock(width, fast_weight=True)])
        self.norm = ToyNorm(width)


class ToyLM(nn.Module):
    """`model.embed_tokens`, `model.layers.{0,1}.{norm,ssm,attn,mlp_norm,mlp}`, `model.norm`, `lm_head`."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.model = ToyBackbone(vocab, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V]
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))


# The role every ToyLM parameter must get from the default classifier.
EXPECTED_ROLES: dict[str, str] = {"model.embed_tokens.weight": "embedding", "lm_head.weight": "unembedding",
                                  "model.norm.weight": "final_norm"}
for _i in (0, 1):
    _p = f"model.layers.{_i}."
    EXPECTED_ROLES.update({
        _p + "norm.weight": "mixer_norm",
        _p + "mlp_norm.weight": "mlp_norm",
        _p + "ssm.in_proj.weight": "ssm_in",
        _p + "ssm.conv.weight": "conv",
        _p + "ssm.norm.weight": "ssm_norm",
        _p + "ssm.out_proj.weight": "ssm_out",
        _p + "mlp.gate_proj.weight": "mlp_gate",
        _p + "mlp.up_proj.weight": "mlp_up",
        _p + "mlp.down_proj.weight": "mlp_down",
        _p + "attn.o_proj.weight": "attn_out",
        _p + "attn.o_proj.bias": "bias",
    })
    for _name in ("q_proj", "k_proj", "v_proj"):
        EXPECTED_ROLES[_p + f"attn.{_name}.weight"] = "attn_in"
        EXPECTED_ROLES[_p + f"attn.{_name}.bias"] = "bias"
EXPECTED_ROLES.update({
    "model.layers.0.ssm.conv.bias": "conv",
    "model.layers.0.ssm.dt_bias": "dt_bias",
    "model.layers.0.ssm.A_log": "A_log",
    "model.layers.0.ssm.D": "D",
    "model.layers.1.ssm.beta_bias": "fw_bias",
    "model.layers.1.ssm.lam_bias": "fw_bias",
})
