"""`HybridModel` / `HybridForCausalLM`: a stack of hybrid blocks as transformers `PreTrainedModel`s.

Notable features:
- Falcon-H1 blocks (attention and Mamba-2 heads side by side, `SA_M`), other arrangements and a
  pluggable SSM half (`ssm_mixer`), all described by one validated `HybridConfig`;
- muP forward multipliers: looked-up embeddings x `embedding_multiplier` (not `inputs_embeds`, as in
  transformers), logits x `lm_head_multiplier`,
  the block and mixer multipliers of Falcon-H1;
- packed documents without padding: `cu_seqlens` (B == 1) or `position_ids` restarting at 0; no
  token attends to, convolves over or carries state from another document, and the loss skips the
  targets that cross a boundary;
- left- or right-padded batches (`attention_mask`): the rows' tokens run as one packed row, so a pad
  position never enters attention, a conv or a recurrent state;
- the transformers / TRL / PEFT calling contract: `generation_config`, `GenerationMixin` (with our own
  `generate`), `use_cache`, `logits_to_keep`, `num_items_in_batch`, TRL's padding-free keys
  (`cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`), gradient checkpointing, `last_hidden_state` from the
  base model (TRL's fused LM head reads it);
- incremental decoding through `HybridCache` (KV + conv tail + SSM state per layer), left-padded
  prompt batches prefilled as packed sequences so that padding never enters a state; sampling and
  the decoding loop live in `hybridlm.models.generation` (public as `hybridlm.inference.generate`);
- registered with `AutoConfig` / `AutoModel` / `AutoModelForCausalLM` as model_type "hybridlm";
  `save_pretrained(dir, format="falcon_h1")` writes a checkpoint `FalconH1ForCausalLM` loads.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from hybridlm.layers.block import HybridBlock, set_mixers_recompute
from hybridlm.layers.cache import HybridCache
from hybridlm.layers.fast_weight import FastWeightMixer, initial_lam_bias
from hybridlm.layers.mamba2 import Mamba2Mixer
from hybridlm.models.config import HybridConfig
from hybridlm.models.configuration import HybridTransformersConfig, transformers_config
from hybridlm.models.falcon_h1 import save_falcon_h1
from hybridlm.models.generation import generate
from hybridlm.models.progress import transformers_progress_bars
from hybridlm.modules.boundaries import (
    has_restarts,
    left_padding_mask,
    local_positions,
    pack_rows,
    padding_mask,
    sequence_ids,
)
from hybridlm.modules.gated_norm import GatedRMSNorm
from hybridlm.modules.linear import is_plain
from hybridlm.modules.linear_cross_entropy import linear_cross_entropy
from hybridlm.modules.multiplier import scaled
from hybridlm.modules.norm import RMSNorm, add_and_norm
from hybridlm.modules.rotary import RotaryEmbedding
from hybridlm.modules.short_conv import ShortConvolution
from hybridlm.ops.utils import check_cu_seqlens, host_to_device

IGNORE_INDEX = -100


# Keywords transformers' and TRL's callers pass to every model forward that carry nothing for this model: no output
# changes with them (the decoding state is the explicit `cache`; outputs are always ModelOutputs). TRL's padding-free
# collator's `max_length_q/k` and `seq_idx` are derived here from the documents' offsets instead.
_IGNORED_KEYWORDS = ("use_cache", "return_dict", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class HybridModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None  # [B, T, D] after the final norm; zeros at pad positions
    cache: HybridCache | None = None


@dataclass
class HybridCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None  # mean next-token cross entropy over counted targets
    logits: torch.Tensor | None = None  # [B, T, V] (or the last `logits_to_keep` positions)
    cache: HybridCache | None = None


class HybridPreTrainedModel(PreTrainedModel):
    """Built from a `HybridConfig`; `self.config` is its transformers face (what transformers' machinery reads), and
    `self.config.to_hybrid()` gives the `HybridConfig` back."""

    config_class = HybridTransformersConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["HybridBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # per block, in HybridModel._run

    def __init__(self, config: HybridConfig | HybridTransformersConfig, *inputs, **kwargs) -> None:
        super().__init__(transformers_config(config, model=type(self).__name__), *inputs, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            bound = module.kernel_size**-0.5
            init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, Mamba2Mixer):
            init.ones_(module.D)
            if self.config.mamba_init == "mamba2":  # Mamba-2's reference init (HybridConfig.mamba_init)
                # (init.* leave loaded weights alone: the values are drawn aside, then copied through init.copy_)
                init.copy_(module.A_log, torch.log(torch.empty_like(module.A_log).uniform_(1.0, 16.0)))
                dt = torch.exp(torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
                init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            else:  # Falcon-H1's: A = -(1, 2, ..., H), dt_bias = 1
                heads = torch.arange(1, module.num_heads + 1, dtype=torch.float32, device=module.A_log.device)
                init.copy_(module.A_log, torch.log(heads))
                init.ones_(module.dt_bias)
        elif isinstance(module, FastWeightMixer) and module.gates == "context":
            # The mixer's gate init (hybridlm.layers.fast_weight): beta near 1, lam spread over the heads.
            init.zeros_(module.beta_bias)
            init.copy_(module.lam_bias, initial_lam_bias(module.num_heads).to(module.lam_bias.device))


class HybridModel(HybridPreTrainedModel):
    """Embeddings -> hybrid blocks -> final RMSNorm; returns hidden states [B, T, D]."""

    def __init__(self, config: HybridConfig | HybridTransformersConfig) -> None:
        super().__init__(config)
        hybrid = self.config.to_hybrid()
        self.embed_tokens = nn.Embedding(hybrid.vocab_size, hybrid.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(hybrid, i) for i in range(hybrid.num_hidden_layers))
        self.norm = RMSNorm(hybrid.hidden_size, eps=hybrid.rms_norm_eps)
        # Attention's RoPE tables, once per forward for every layer (the layers hold the same (head_dim, base)).
        self.rotary = RotaryEmbedding(hybrid.head_dim, base=hybrid.rope_theta) if hybrid.use_attention else None
        self.embedding_multiplier = hybrid.embedding_multiplier
        self.gradient_checkpointing = False  # set by transformers' gradient_checkpointing_enable()
        self.post_init()

    @property
    def gradient_checkpointing(self) -> bool:
        return self._gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        """transformers' gradient_checkpointing_enable() / _disable() set this. With every block recomputed in the
        backward, the SSM mixers' own recomputation of what feeds their scans (their `recompute`) would only run it
        a third time: enabling turns it off, disabling back to the mixers' default."""
        self._gradient_checkpointing = bool(enabled)
        set_mixers_recompute(self, "none" if enabled else "fast_weight")

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        **kwargs,
    ) -> HybridModelOutput:
        """-> `HybridModelOutput`: last_hidden_state [B, T, D] (and the `cache` passed in, advanced).

        inputs_embeds [B, T, D] replaces input_ids and enters the blocks as given: `embedding_multiplier` scales
        only the embeddings looked up here from input_ids (as in transformers' Falcon-H1), so the input
        equivalent to input_ids is `embed_tokens(input_ids) * embedding_multiplier`.
        attention_mask [B, T] (1 = token, 0 = padding) admits a left- or right-padded batch (each row one
        contiguous run of tokens): the rows' tokens run as one packed row (`cu_seqlens`), so no pad position
        enters attention, a conv or a recurrent state; a cache (left padding only: decoding continues at each
        row's end) then gets one row per prompt (`HybridCache.lengths`). Pad positions return zeros.
        cu_seq_lens_q / cu_seq_lens_k (equal; what TRL's and transformers' padding-free collators pass beside
        position_ids) are taken as `cu_seqlens`. `use_cache`, `return_dict`, `max_length_q/k`, `seq_idx` are
        accepted and change nothing; hidden states and attention weights of every layer are not returned.
        """
        unknown = sorted(set(kwargs) - set(_IGNORED_KEYWORDS))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unsupported keyword(s) {', '.join(unknown)}")
        if output_hidden_states or output_attentions:
            raise NotImplementedError("output_hidden_states / output_attentions are not supported: the model returns "
                                      "the last hidden state (HybridModel) or the logits (HybridForCausalLM)")
        cu_seqlens = _packed_offsets(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, D]")
        _check_inputs(input_ids, inputs_embeds, position_ids, self.embed_tokens.weight.shape)
        if inputs_embeds is None:
            h = scaled(self.embed_tokens(input_ids), self.embedding_multiplier)  # [B, T, D]
        else:
            h = inputs_embeds  # already scaled as the caller wants (docstring)
        keep = None
        if attention_mask is not None:
            # With a cache, decoding continues at each row's end: only left padding leaves the rows' ends aligned.
            keep = (left_padding_mask if cache is not None else padding_mask)(attention_mask, h.shape[:2])
        if keep is None:
            return HybridModelOutput(last_hidden_state=self._run(h, cu_seqlens, position_ids, cache), cache=cache)
        if cu_seqlens is not None or position_ids is not None:
            raise ValueError("a padded attention_mask cannot be combined with cu_seqlens or position_ids")
        lengths = keep.sum(1)  # [B] tokens per row
        offsets = F.pad(lengths.cumsum(0), (1, 0))  # [B + 1]
        packed = self._run(h[keep].unsqueeze(0), offsets, None, cache)  # [1, total, D]
        out = h.new_zeros(h.shape)
        out[keep] = packed[0]
        return HybridModelOutput(last_hidden_state=out, cache=cache)

    def _run(
        self,
        h: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: HybridCache | None,
    ) -> torch.Tensor:
        batch, length, width = h.shape
        packed_rows = None
        if cu_seqlens is not None:
            # The offsets stay on the host: every layer checks them there (on the device each check would be a
            # synchronization, several per layer) and copies what it needs without waiting.
            offsets = check_cu_seqlens(cu_seqlens, batch_size=batch, total_len=length)
            if cache is not None and position_ids is not None:
                # later tokens continue each document at its own length (`HybridCache.lengths`): other positions
                # here would rotate the cached keys against every later query's, silently
                raise ValueError("a packed prefill into a cache numbers each document from 0 itself; leave "
                                 "position_ids out")
            if cache is not None:
                position_ids = cache.packed_positions(offsets, length, h.device)  # [1, T]
            elif position_ids is None:
                position_ids = host_to_device(local_positions(offsets, length).unsqueeze(0), h.device)
            cu_seqlens = offsets
        elif position_ids is not None and has_restarts(position_ids):
            # Documents packed in rows, marked by position_ids restarting at 0: run as one packed row.
            if cache is not None:
                raise ValueError("a decoding cache cannot be combined with packed documents (position_ids restarts)")
            h, cu_seqlens, position_ids = pack_rows(h, position_ids)
            packed_rows = batch
        elif position_ids is None and cache is not None:
            position_ids = cache.positions(length, h.device)  # [1 or B, T]
        # Without a cache, absent position_ids stay None: attention numbers the tokens 0..T-1 itself.
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the model {len(self.layers)}")

        rotary = None
        if self.rotary is not None:
            positions = position_ids if position_ids is not None else torch.arange(length, device=h.device)[None]
            rotary = self.rotary(positions)  # (cos, sin) [B or 1, T, head_dim] float32
        seq_idx = None
        if cu_seqlens is not None and cache is None:
            # Each token's document, for the compiled blocks' mixers that take it (HybridBlock): made on the host,
            # copied once per forward.
            seq_idx = host_to_device(sequence_ids(cu_seqlens, h.shape[1]).unsqueeze(0), h.device)  # [1, T]
        # Gradient checkpointing recomputes each block in the backward pass; never with a cache, which the
        # recomputation would advance a second time.
        checkpointed = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        # Without a gradient (generation, evaluation) the blocks are chained with each one's last residual adds left
        # to the next block's norm (the last block's to the final norm), which takes them in its launch
        # (`HybridBlock.deferred`): the same values.
        chained = not torch.is_grad_enabled() and all(is_plain(layer, type(layer)) for layer in self.layers)
        pending = ()
        for i, layer in enumerate(self.layers):
            layer_cache = cache[i] if cache is not None else None
            # Document restarts are resolved above (packed into cu_seqlens, or there are none): the layers need not
            # look again (each look is a host synchronization, which also rules out CUDA-graph capture).
            options = dict(cu_seqlens=cu_seqlens, position_ids=position_ids, cache=layer_cache, restarts_resolved=True,
                           seq_idx=seq_idx, rotary=rotary)
            if chained:
                h, pending = layer.deferred(h, pending, **options)
                continue
            block = functools.partial(layer, **options)
            h = self._gradient_checkpointing_func(block, h) if checkpointed else block(h)
        h = add_and_norm(h, pending, self.norm)[1] if pending else self.norm(h)
        if packed_rows is not None:
            h = h.reshape(packed_rows, length, width)
        if cache is not None:
            if cu_seqlens is not None:
                cache.start_rows(cu_seqlens[1:] - cu_seqlens[:-1], device=h.device)  # one row per sequence
            else:
                cache.advance(length)
        return h


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    """`HybridModel` + LM head (optionally tied to the embeddings), next-token loss, cached generation.

    GenerationMixin makes it a generating model to transformers' machinery (a `generation_config`, saved beside the
    weights; PEFT's `prepare_inputs_for_generation`); `generate` itself is ours (`hybridlm.models.generation`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig | HybridTransformersConfig) -> None:
        super().__init__(config)
        hybrid = self.config.to_hybrid()
        self.model = HybridModel(self.config)
        self.lm_head = nn.Linear(hybrid.hidden_size, hybrid.vocab_size, bias=False)
        self.lm_head_multiplier = hybrid.lm_head_multiplier
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def new_cache(self) -> HybridCache:
        return HybridCache(len(self.model.layers))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        return_logits: bool = True,
        **kwargs,
    ) -> HybridCausalLMOutput:
        """labels [B, T] are the input ids (shifted here); IGNORE_INDEX (-100) targets are skipped, and so
        are the targets read at or pointing to pad positions of a padded `attention_mask` [B, T].
        The loss is the mean over the counted targets, or their sum / `num_items_in_batch` when given (transformers'
        Trainer passes the count of the whole accumulated batch, so that gradient accumulation averages per token).
        `inputs_embeds` [B, T, D] instead of input_ids are used as given, not scaled by `embedding_multiplier`
        (`HybridModel.forward`, which takes the other keywords: TRL's padding-free keys, `use_cache`, ...).
        `logits_to_keep=n > 0` computes logits for the last n positions only (decoding); a 1-D tensor of positions
        keeps those (transformers' convention).
        `shift_labels` [B, T'] instead of labels: the targets already aligned with the (kept) positions, position t
        scored against shift_labels[:, t], -100 skipped, nothing else masked (transformers' name; the trainer's
        labels). `return_logits=False` (with labels or shift_labels) computes the loss without holding the logits:
        the LM head and the cross entropy run together over row chunks (`linear_cross_entropy`: the same values,
        no [B, T, V] tensor kept for the backward), and `logits` is None."""
        if not isinstance(logits_to_keep, torch.Tensor) and logits_to_keep < 0:
            raise ValueError(f"logits_to_keep={logits_to_keep}: pass n > 0 for the last n positions' logits, 0 for "
                             "every position's, or a 1-D tensor of positions")
        keeps_some = isinstance(logits_to_keep, torch.Tensor) or logits_to_keep > 0
        if labels is not None and shift_labels is not None:
            raise ValueError("pass labels (the input ids, shifted here) or shift_labels (shifted already), not both")
        if labels is not None and keeps_some:
            raise ValueError("labels need the logits of every position; leave logits_to_keep at 0")
        if not return_logits and labels is None and shift_labels is None:
            raise ValueError("return_logits=False computes the loss without the logits: pass labels or shift_labels")
        hidden = self.model(
            input_ids, cu_seqlens, position_ids, cache, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            **kwargs,
        ).last_hidden_state
        cu_seqlens = _packed_offsets(cu_seqlens, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
        if isinstance(logits_to_keep, torch.Tensor):
            kept = hidden[:, logits_to_keep]
        else:
            kept = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        if shift_labels is not None:
            if tuple(shift_labels.shape) != tuple(kept.shape[:2]):
                raise ValueError(f"shift_labels {tuple(shift_labels.shape)} must have the kept positions' shape "
                                 f"{tuple(kept.shape[:2])} (position t is scored against shift_labels[:, t])")
            _check_in_vocabulary(shift_labels, self.config.vocab_size, "shift_labels", ignored=IGNORE_INDEX)
        if labels is not None:
            tokens = input_ids if input_ids is not None else inputs_embeds
            if tuple(labels.shape) != tuple(tokens.shape[:2]):
                raise ValueError(f"labels {tuple(labels.shape)} must have the inputs' shape [B, T] = "
                                 f"{list(tokens.shape[:2])}: they are the input ids, shifted here")
            _check_in_vocabulary(labels, self.config.vocab_size, "labels", ignored=IGNORE_INDEX)
            targets = _next_token_targets(labels, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                          attention_mask=attention_mask)  # [B, T-1]
            scored = kept[:, :-1]
        else:
            targets, scored = shift_labels, kept
        if not return_logits:
            total = self._linear_cross_entropy(scored, targets)
            return HybridCausalLMOutput(loss=_reduce(total, targets, num_items_in_batch), logits=None, cache=cache)
        logits = scaled(self.lm_head(kept), self.lm_head_multiplier)  # [B, T, V]
        loss = None
        if targets is not None:
            total = _summed_cross_entropy(logits[:, :-1] if labels is not None else logits, targets)
            loss = _reduce(total, targets, num_items_in_batch)
        return HybridCausalLMOutput(loss=loss, logits=logits, cache=cache)

    def _linear_cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross entropy of the LM head on hidden [B, T, D] against targets [B, T], chunked when the head is
        a plain bias-free Linear without hooks (an adapter wrapping it, e.g. PEFT's, or a hook computes the logits as
        it does: `is_plain`)."""
        head = self.lm_head
        if is_plain(head, nn.Linear) and head.bias is None:
            return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1),
                                        multiplier=self.lm_head_multiplier)
        return _summed_cross_entropy(scaled(head(hidden), self.lm_head_multiplier), targets)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_length: int | None = None,
        do_sample: bool | None = None,
        stopping_criteria=None,
        num_beams: int = 1,
        use_cache: bool = True,
        **options,
    ) -> torch.Tensor:
        """Cached decoding with transformers' calling conventions: prompt ids [B, T] -> [B, T + n].

        `options` are those of `hybridlm.inference.generate` (attention_mask for left-padded prompts,
        max_new_tokens (default 20), temperature, top_k, top_p, eos_token_id, pad_token_id, generator / seed, graph,
        prefill_chunk, stop), plus the transformers keywords that lm_eval's `generate_until` and typical callers pass:
        - max_length: prompt + new tokens (T counts the left padding); max_new_tokens = max_length - T. Giving both
          is an error unless they agree.
        - do_sample: False -> greedy whatever the temperature (as transformers); True -> sampling at `temperature`,
          1.0 when not given (temperature 0 with do_sample=True is refused, as transformers refuses it); not given:
          the temperature decides (0, the default, is greedy). temperature=None means not given, top_k=0 means no
          top-k filter (transformers' conventions; `hybridlm.inference.generate` wants None for both). Unlike
          transformers, no default top_k=50 is applied.
        - stopping_criteria: a transformers `StoppingCriteriaList` (lm_eval's stop strings) or any callable
          (input_ids, scores) -> bool or [B] bool tensor, called after every new token; rows it marks done get
          filler after their last token and decoding ends when every row is done (`generate`'s `stop`).
        - use_cache: accepted and ignored (decoding always uses the cache); num_beams: 1 only (no beam search).
        Any other keyword is a TypeError that lists these.

        Stopping at eos differs from `hybridlm.inference.generate`: here eos_token_id defaults to the model config's
        (`model.config.eos_token_id`, the id transformers writes into the generation config); pass eos_token_id=None
        to decode every requested token. The function's own default is None (never stop at an eos not asked for).
        Greedy by default. `model.generation_config` is saved and loaded for transformers' tools but not read here:
        give eos_token_id, max_new_tokens and sampling per call (or set model.config.eos_token_id)."""
        supported = [name for name, p in inspect.signature(generate).parameters.items() if p.kind == p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(supported))
        if unknown:
            raise TypeError(
                f"generate() got unsupported keyword(s) {', '.join(unknown)}; supported: "
                f"{', '.join(supported + ['max_length', 'do_sample', 'stopping_criteria', 'num_beams', 'use_cache'])}"
            )
        if options.get("output_logits"):
            raise ValueError("output_logits: this method returns the sequences only (as transformers does without "
                             "return_dict_in_generate); hybridlm.inference.generate(model, ids, output_logits=True) "
                             "returns them with the logits (.sequences, .logits)")
        if options.get("max_new_tokens", 0) is None:
            del options["max_new_tokens"]  # transformers' "not given"
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
            raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
        if num_beams > 1:
            raise NotImplementedError(f"beam search (num_beams={num_beams}) is not implemented: generation is greedy "
                                      "or sampled; pass num_beams=1")
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < input_ids.shape[-1]:
                raise ValueError(f"max_length counts the prompt's {input_ids.shape[-1]} tokens and the new ones, so it "
                                 f"must be an int >= {input_ids.shape[-1]}, got {max_length!r}; or pass max_new_tokens")
            new = max_length - input_ids.shape[-1]
            if options.get("max_new_tokens", new) != new:
                raise ValueError(f"max_length={max_length} (a prompt of {input_ids.shape[-1]} + {new} new tokens) and "
                                 f"max_new_tokens={options['max_new_tokens']} disagree; pass one of them")
            options["max_new_tokens"] = new
        if options.get("temperature", 0.0) is None:
            del options["temperature"]
        if type(options.get("top_k")) is int and options["top_k"] == 0:
            options["top_k"] = None  # transformers' "no top-k filter"
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"do_sample must be True, False or None, got {do_sample!r}")
        if do_sample is False:
            options["temperature"] = 0.0
        elif do_sample:
            options.setdefault("temperature", 1.0)
            if options["temperature"] == 0:
                raise ValueError("do_sample=True needs a temperature > 0 (1.0 when not given); for greedy decoding "
                                 "pass do_sample=False")
        if stopping_criteria is not None:
            if options.get("stop") is not None:
                raise ValueError("pass stopping_criteria or stop, not both")
            options["stop"] = stopping_criteria
        options.setdefault("eos_token_id", self.config.eos_token_id)
        return generate(self, input_ids, **options).sequences

    def save_pretrained(self, save_directory, *args, format: str = "hybridlm", **kwargs):  # noqa: A002
        """`format="hybridlm"` (default): our config + safetensors. `format="falcon_h1"`: an official
        `falcon_h1` checkpoint (needs ssm_mixer="mamba2", attention on, SA_M blocks, an MLP). Without transformers'
        progress bar."""
        if format == "falcon_h1":
            if args or kwargs:  # sharding, state_dict, push_to_hub, ...: not silently dropped
                names = ", ".join(([f"{len(args)} positional"] if args else []) + sorted(kwargs))
                raise ValueError(f"save_pretrained(format='falcon_h1') writes one unsharded checkpoint of the model's "
                                 f"own weights and takes no other arguments; got {names}: save without them, or in "
                                 "the default format")
            return save_falcon_h1(self, save_directory)
        if format != "hybridlm":
            raise ValueError(f"unknown checkpoint format {format!r}; choose 'hybridlm' or 'falcon_h1'")
        with transformers_progress_bars(False):
            return super().save_pretrained(save_directory, *args, **kwargs)


def _ids_checked_on_host(input_ids: torch.Tensor) -> bool:
    """Whether the ids' range is checked: on the CPU, where reading min and max waits for nothing, and not while
    compiling."""
    return input_ids.device.type == "cpu" and input_ids.numel() > 0 and not torch.compiler.is_compiling()


def _check_in_vocabulary(ids: torch.Tensor, vocab: int, name: str, *, ignored: int | None = None) -> None:
    """On the CPU (`_ids_checked_on_host`), refuse ids outside [0, vocab); `ignored`: a value skipped (the targets'
    IGNORE_INDEX)."""
    if not _ids_checked_on_host(ids):
        return
    if ignored is not None:
        ids = ids[ids != ignored]
    if not ids.numel():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        note = f" ({ignored} marks a position that is not scored)" if ignored is not None else ""
        raise ValueError(f"{name} hold ids outside the model's vocabulary [0, {vocab}): min {low}, max {high}{note}")


def _check_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    embedding_shape: tuple[int, int],
) -> None:
    """Refuse, naming what is wrong, input_ids that are not [B, T] integers (on the CPU, not compiling, also ids
    outside the vocabulary: on a GPU that check would wait for the device), inputs_embeds that are not [B, T, D], no
    positions (T = 0), and position_ids that are not [B or 1, T] or [T]. embedding_shape: the embedding table's
    [V, D]."""
    vocab, width = embedding_shape
    if input_ids is not None:
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            hint = " (one sequence: input_ids[None])" if input_ids.dim() == 1 else ""
            raise ValueError(f"input_ids must be integer token ids [B, T], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}{hint}")
        _check_in_vocabulary(input_ids, vocab, "input_ids")
        batch, length = input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(f"inputs_embeds must be [B, T, D] with D = hidden_size = {width}, got "
                             f"{list(inputs_embeds.shape)}")
        batch, length = inputs_embeds.shape[:2]
    if length == 0:  # (every mixer would have to agree on what an empty sequence returns; none is useful)
        raise ValueError(f"the inputs hold no positions ([B, T] = [{batch}, 0]); pass at least one token")
    if position_ids is not None and not (
        (position_ids.dim() == 1 and position_ids.shape[0] == length)
        or (position_ids.dim() == 2 and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == length)
    ):
        raise ValueError(f"position_ids must be [B or 1, T] or [T] with B, T = {batch}, {length}, got "
                         f"{list(position_ids.shape)}")


def _next_token_targets(
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The targets [B, T-1] of positions 0..T-2: labels[:, t + 1], -100 where labels has it, where the target
    belongs to the next packed document and where it is read at or points to a pad position."""
    batch, length = labels.shape
    targets = labels[:, 1:].clone()  # [B, T-1]
    if attention_mask is not None:
        keep = attention_mask.to(torch.bool)
        targets.masked_fill_(~(keep[:, :-1] & keep[:, 1:]), IGNORE_INDEX)  # no nonzero(): no wait
    if cu_seqlens is not None:
        offsets = check_cu_seqlens(cu_seqlens, batch_size=batch, total_len=length)  # on the host
        # Target t+1 starts a document. index_fill_ takes the value as a kernel argument: assigning a Python number
        # through indexing first copies it to the device as a tensor, a blocking copy.
        targets.index_fill_(1, host_to_device(offsets[1:-1] - 1, labels.device), IGNORE_INDEX)
    elif position_ids is not None:
        targets.masked_fill_(position_ids.expand(batch, length)[:, 1:] == 0, IGNORE_INDEX)
    return targets


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of logits [..., V] against targets [...], -100 skipped, in float32 at least (bf16 logits
    are upcast, float64 kept)."""
    flat = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _reduce(total: torch.Tensor, targets: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """The summed loss -> the mean over the scored targets (nan when none is), or the sum / `num_items_in_batch`."""
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _packed_offsets(
    cu_seqlens: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None, cu_seq_lens_k: torch.Tensor | None
) -> torch.Tensor | None:
    """The documents' offsets from `cu_seqlens` or its transformers spelling `cu_seq_lens_q` / `cu_seq_lens_k`
    (self-attention: the two are one list)."""
    given = [x for x in (cu_seq_lens_q, cu_seq_lens_k) if x is not None]
    if not given:
        return cu_seqlens
    if cu_seqlens is not None:
        raise ValueError("pass the documents' offsets once: cu_seqlens or cu_seq_lens_q / cu_seq_lens_k")
    if len(given) == 2 and not torch.equal(cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu()):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; this model has self-attention only, one list of "
                         "document offsets")
    return given[0]


AutoConfig.register("hybridlm", HybridTransformersConfig, exist_ok=True)
AutoModel.register(HybridTransformersConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridTransformersConfig, HybridForCausalLM, exist_ok=True)
