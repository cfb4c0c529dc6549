"""Export for other runtimes: GGUF for llama.cpp (`gguf.py`; the field-by-field mapping: README.md here).

    from hybridlm.export.gguf import export_gguf
    export_gguf("runs/demo/final", "demo.gguf", dtype="q8_0")

Official `falcon_h1` checkpoints are written by `hybridlm.models.falcon_h1` (`save_pretrained(format="falcon_h1")`).
Nothing heavy is imported here, so `hybridlm --help` stays cheap.
"""

# The tensor encodings `export_gguf` writes (argparse's choices read them without importing torch).
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
