"""`export_gguf` read back with gguf's own reader: every tensor's name, shape, encoding and values (the muP
multipliers folded in as llama.cpp's falcon-h1 expects), the metadata, the tokenizer, the refusals and the atomic
write. The same files run in llama.cpp itself: test_llama_cpp.py."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from hybridlm.cli import main
from hybridlm.data.tokenizer import CHAT_TEMPLATE, without_generation_tags
from hybridlm.export.gguf import NO_MERGE, export_gguf
from hybridlm.models.config import HybridConfig
from hybridlm.models.model import HybridForCausalLM
from tests.export.helpers import BYTE_VOCAB, MULTIPLIERS, bpe_tokenizer, byte_tokenizer, checkpoint_dir, falcon_model

Q = gguf.GGMLQuantizationType
MATRIX_TYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


def expected_tensors(model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """What llama.cpp's falcon-h1 reads, written out by hand from our weights: GGUF name -> float32 tensor."""
    c = model.config
    s = {k: v.double() for k, v in model.state_dict().items()}
    m = MULTIPLIERS
    out = {
        "token_embd.weight": s["model.embed_tokens.weight"] * m["embedding_multiplier"],
        "output.weight": s["lm_head.weight"] * m["lm_head_multiplier"],
        "output_norm.weight": s["model.norm.weight"],
    }
    gn = c.mamba_n_groups * c.mamba_d_state
    for i in range(c.num_hidden_layers):
        w = lambda name: s[f"model.layers.{i}.{name}"]  # noqa: E731
        in_proj = w("ssm.in_proj.weight").clone()  # rows [z | x | B | C | dt]
        edges = np.cumsum([0, c.mamba_d_ssm, c.mamba_d_ssm, gn, gn, c.mamba_n_heads])
        for lo, hi, name in zip(edges[:-1], edges[1:], ("z", "x", "B", "C", "dt")):
            in_proj[lo:hi] *= m["ssm_in_multiplier"] * m[f"ssm_multiplier_{name}"]
        out |= {
            f"blk.{i}.attn_norm.weight": w("norm.weight"),
            f"blk.{i}.ffn_norm": w("mlp_norm.weight"),
            f"blk.{i}.attn_q.weight": w("attn.q_proj.weight") * m["attention_in_multiplier"],
            f"blk.{i}.attn_k.weight": w("attn.k_proj.weight") * (m["attention_in_multiplier"] * m["key_multiplier"]),
            f"blk.{i}.attn_v.weight": w("attn.v_proj.weight") * m["attention_in_multiplier"],
            f"blk.{i}.attn_output.weight": w("attn.o_proj.weight") * m["attention_out_multiplier"],
            f"blk.{i}.ssm_in.weight": in_proj,
            f"blk.{i}.ssm_conv1d.weight": w("ssm.conv.weight"),
            f"blk.{i}.ssm_conv1d.bias": w("ssm.conv.bias"),
            f"blk.{i}.ssm_dt.bias": w("ssm.dt_bias"),
            f"blk.{i}.ssm_a": -torch.exp(w("ssm.A_log"))[:, None],
            f"blk.{i}.ssm_d": w("ssm.D")[:, None],
            f"blk.{i}.ssm_norm.weight": w("ssm.norm.weight").view(c.mamba_n_groups, -1),
            f"blk.{i}.ssm_out.weight": w("ssm.out_proj.weight") * m["ssm_out_multiplier"],
            f"blk.{i}.ffn_gate.weight": w("mlp.gate_proj.weight") * m["mlp_multiplier_gate"],
            f"blk.{i}.ffn_gate.bias": w("mlp.gate_proj.bias") * m["mlp_multiplier_gate"],
            f"blk.{i}.ffn_up.weight": w("mlp.up_proj.weight"),
            f"blk.{i}.ffn_up.bias": w("mlp.up_proj.bias"),
            f"blk.{i}.ffn_down.weight": w("mlp.down_proj.weight") * m["mlp_multiplier_down"],
            f"blk.{i}.ffn_down.bias": w("mlp.down_proj.bias") * m["mlp_multiplier_down"],
        }
    return {name: value.float() for name, value in out.items()}


def expected_type(name: str, shape: tuple[int, ...], dtype: str) -> gguf.GGMLQuantizationType:
    """Matrices named *.weight take `dtype` (q8_0 only with rows of whole 32-value blocks, else f16); the rest f32."""
    if len(shape) < 2 or not name.endswith(".weight") or "norm" in name or "conv1d" in name:
        return Q.F32
    return Q.F16 if dtype == "q8_0" and shape[-1] % 32 else MATRIX_TYPE[dtype]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_every_tensor_read_back(tmp_path, tok_dir, dtype):
    model = falcon_model()
    expected = expected_tensors(model)
    reader = gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf", tokenizer=tok_dir, dtype=dtype))
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        want = expected[t.name].numpy()
        assert tuple(reversed(t.shape.tolist())) == want.shape, t.name  # GGUF's ne is the torch shape reversed
        assert t.tensor_type == expected_type(t.name, want.shape, dtype), t.name
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        if t.tensor_type == Q.F32:
            np.testing.assert_array_equal(got, want, err_msg=t.name)
        elif t.tensor_type == Q.F16:
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32), err_msg=t.name)
        elif t.tensor_type == Q.BF16:  # 8 significant bits: half an ulp is 2^-9 of the value
            np.testing.assert_allclose(got, want, rtol=2**-8, atol=0, err_msg=t.name)
        else:  # q8_0: per 32-value block, int8 steps d = max|block| / 127, d itself in f16 (127 steps of its error)
            d = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            error = np.abs(got - want).reshape(-1, 32)
            assert (error <= d * (0.5 + 127 * 2**-11)).all(), t.name


def test_metadata(tmp_path, tok_dir):
    model = falcon_model()
    c = model.config
    fields = gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf", tokenizer=tok_dir)).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    arch = "falcon-h1"
    expected = {
        "general.architecture": arch, "general.file_type": gguf.LlamaFileType.ALL_F32,
        f"{arch}.vocab_size": BYTE_VOCAB, f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": 32, f"{arch}.feed_forward_length": 40, f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": 8, f"{arch}.attention.value_length": 8,
        f"{arch}.ssm.conv_kernel": 4, f"{arch}.ssm.inner_size": 32, f"{arch}.ssm.state_size": 6,
        f"{arch}.ssm.time_step_rank": 4, f"{arch}.ssm.group_count": 2, f"{arch}.rope.freq_base": 1e4,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "falcon-h1", "tokenizer.ggml.merges": [NO_MERGE],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": without_generation_tags(CHAT_TEMPLATE),
    }
    assert {key: value(key) for key in expected} == expected
    # a chat_template.jinja beside the tokenizer (sft --chat-template writes one) is what transformers uses: so here
    shutil.copytree(tok_dir, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    own = gguf.GGUFReader(export_gguf(model, tmp_path / "own.gguf", tokenizer=tmp_path / "tok")).fields
    assert own["tokenizer.chat_template"].contents() == "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert value(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps, rel=1e-7)
    tokens, types = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == BYTE_VOCAB
    assert tokens[:4] == ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "Ā"]  # then byte 0 as GPT-2 spells it
    assert tokens[259:] == [f"[PAD{i}]" for i in range(259, BYTE_VOCAB)]
    assert types == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.UNUSED] * 41


def test_bpe_tokenizer(tmp_path):
    """Our trained BPE: its merges in order, specials as control tokens, the LaTeX tokens as user-defined text."""
    tok = bpe_tokenizer(tmp_path / "tok")
    model = falcon_model(vocab_size=tok.vocab_size)
    fields = gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf", tokenizer=tmp_path / "tok")).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    merges = [" ".join(pair) for pair in json.loads(tok.tokenizer.to_str())["model"]["merges"]]
    assert fields["tokenizer.ggml.merges"].contents() == merges and len(merges) == 300
    assert tokens == [tok.tokenizer.id_to_token(i) for i in range(tok.vocab_size)]
    frac = tok.tokenizer.token_to_id("\\frac")
    assert types[frac] == gguf.TokenType.USER_DEFINED and types[0] == types[tok.eos_id] == gguf.TokenType.CONTROL
    assert types[-1] == gguf.TokenType.NORMAL  # the last merge


@pytest.mark.parametrize("same", [True, False], ids=["same-multipliers", "own-multipliers"])
def test_tied_embeddings(tmp_path, tok_dir, same):
    """llama.cpp reads token_embd as the head when output.weight is absent: right only when the multipliers agree."""
    lm = MULTIPLIERS["embedding_multiplier"] if same else MULTIPLIERS["lm_head_multiplier"]
    model = falcon_model(tie_word_embeddings=True, lm_head_multiplier=lm)
    tensors = {t.name: t for t in gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf", tokenizer=tok_dir)).tensors}
    assert ("output.weight" in tensors) is not same
    if not same:
        want = (model.model.embed_tokens.weight.detach().double() * lm).float().numpy()
        np.testing.assert_array_equal(tensors["output.weight"].data, want)


def test_no_conv_bias_writes_zeros(tmp_path, tok_dir):
    model = falcon_model(mamba_conv_bias=False)
    tensors = {t.name: t for t in gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf", tokenizer=tok_dir)).tensors}
    assert not tensors["blk.1.ssm_conv1d.bias"].data.any() and tensors["blk.1.ssm_conv1d.bias"].data.shape == (56,)


@pytest.mark.parametrize("changes, field", [
    (dict(ssm_mixer="fast_weight"), "ssm_mixer"),
    (dict(attention_window=16), "attention_window"),
    (dict(block_arrangement="SAM"), "block_arrangement"),
    (dict(use_attention=False), "use_attention"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias"),
    (dict(projectors_bias=True), "projectors_bias"),
    (dict(mamba_norm_before_gate=True), "mamba_norm_before_gate"),
    (dict(time_step_limit=(0.0, 10.0)), "time_step_limit"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refused_models_name_the_field(tmp_path, tok_dir, changes, field):
    config = falcon_model().config.to_hybrid().replace(**changes)
    with pytest.raises(ValueError) as err:
        export_gguf(HybridForCausalLM(HybridConfig(**config.to_dict())), tmp_path / "m.gguf", tokenizer=tok_dir)
    assert field in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_existing_file_needs_overwrite(tmp_path, tok_dir):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        export_gguf(falcon_model(), out, tokenizer=tok_dir)
    assert out.read_bytes() == b"keep"
    export_gguf(falcon_model(), out, tokenizer=tok_dir, overwrite=True)
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "falcon-h1"


def test_failure_leaves_nothing(tmp_path, tok_dir, monkeypatch):
    """A write that fails part way leaves the old file as it was and no temporary file."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep")

    def fail(self, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(falcon_model(), out, tokenizer=tok_dir, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"] and out.read_bytes() == b"keep"


def test_command(tmp_path, tok_dir, capsys):
    """`hybridlm export gguf` on an official falcon_h1 dir; then its one-line refusals, exit status 1."""
    model_dir = checkpoint_dir(falcon_model(), tok_dir, tmp_path / "model", fmt="falcon_h1")
    out = tmp_path / "m.gguf"
    assert main(["export", "gguf", "--model", str(model_dir), "--out", str(out), "--dtype", "q8_0"]) == 0
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    capsys.readouterr()
    assert main(["export", "gguf", "--model", str(model_dir), "--out", str(out)]) == 1
    assert capsys.readouterr().err == f"hybridlm export gguf: {out} already exists; pass --overwrite to replace it\n"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    assert main(["export", "gguf", "--model", str(model_dir), "--out", str(folder), "--overwrite"]) == 1
    assert capsys.readouterr().err == (f"hybridlm export gguf: {folder} is a directory; give a file path for the "
                                       f"GGUF (e.g. {folder / 'model.gguf'})\n")
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]
    assert main(["export", "gguf", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "n.gguf")]) == 1
    assert capsys.readouterr().err == f"hybridlm export gguf: model directory {tmp_path / 'nope'} does not exist\n"
    (tmp_path / "chats.jsonl").write_text("{}\n")
    assert main(["export", "gguf", "--model", str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "n.gguf")]) == 1
    assert f"{tmp_path / 'chats.jsonl'} is a file; give the model directory" in capsys.readouterr().err
    fast = checkpoint_dir(falcon_model(ssm_mixer="fast_weight"), tok_dir, tmp_path / "fast")
    assert main(["export", "gguf", "--model", str(fast), "--out", str(tmp_path / "f.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ssm_mixer" in err and not (tmp_path / "f.gguf").exists()
