"""`hybridlm export gguf`: a checkpoint directory (ours or falcon_h1) as one GGUF file for llama.cpp.

    hybridlm export gguf --model runs/demo/final --out demo.gguf
    hybridlm export gguf --model Falcon-H1-0.5B-Base --out falcon.gguf --dtype q8_0 --overwrite

Exit status: 0 written; 1 a model or tokenizer that GGUF falcon-h1 cannot hold (the message names the field), a
missing input, or an existing --out without --overwrite (nothing is written then).
"""

from __future__ import annotations

import argparse
import sys

from hybridlm.export import GGUF_DTYPES


def add_commands(subparsers) -> None:
    text = "write a model in another runtime's format (GGUF for llama.cpp)"
    ex = subparsers.add_parser("export", help=text, description=text)
    ex_sub = ex.add_subparsers(dest="export_command", metavar="FORMAT", required=True)
    text = "one GGUF file for llama.cpp's falcon-h1 (weights with the muP multipliers folded in, tokenizer)"
    p = ex_sub.add_parser("gguf", help=text, description=text)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (hybridlm or falcon_h1)")
    p.add_argument("--out", required=True, metavar="FILE", help="the .gguf file to write")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory holding tokenizer.json (default: the model directory)")
    p.add_argument("--dtype", default="f32", choices=GGUF_DTYPES,
                   help="weight matrices' encoding (default f32; vectors, norms and the SSM conv stay f32)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=_export_gguf)


def _export_gguf(args: argparse.Namespace) -> int:
    from hybridlm.export.gguf import export_gguf

    try:
        path = export_gguf(args.model, args.out, tokenizer=args.tokenizer, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, OSError) as err:
        print(f"hybridlm export gguf: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.dtype})")
    return 0
