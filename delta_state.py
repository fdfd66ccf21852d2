"""State across tokens: what a Delta model carries from one token to the next, derived from its config in one place.

Most variants carry nothing but transformers' key-value cache. Three settings carry more (docs/variants.md,
docs/delta_net.md): a TC read (`delta_state_read="temporal_conv"`) convolves over the last `delta_conv_size` states
at every read, EC (`delta_embed_expand="conv"`) over the last embeddings, and the DeltaNet mixer
(`token_mixer="delta_net"`) keeps a recurrent state per layer. `state_plan(config)` lists them; everything that asks
reads it: the config's `delta_temporal`, the cache a model builds or accepts, `generate`'s cache, compile and
assisted-decoding rules (`delta_model.py`, through `state_cache_class`), the refusal under a serving engine's
Transformers backend (below), and ddl-hf's native vLLM route (`ddl_hf/vllm_plugin.py`, `ddl_hf/vllm_models.py`).
Also here: where that state restarts in packed rows (`packed_document_starts`).

Self-contained Hub custom-code file: it imports only torch and its sibling `delta_compat.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import check_installed_versions  # noqa: F401

#: The window of EC's convolution of the embedding, and of the read-out's TC read before the final norm.
EMBED_WINDOW = "embed"
READ_OUT_WINDOW = "read_out"


def block_windows(layer: int) -> tuple[str, str]:
    """The windows of a block's two TC reads: before its attention and before its MLP."""
    return f"{layer}.attn", f"{layer}.mlp"


class StateWindow(NamedTuple):
    """One temporal convolution's window: its last `delta_conv_size - 1` inputs, per sequence.

    `key`: the name its read passes (`block_windows`, `EMBED_WINDOW`, `READ_OUT_WINDOW`), under which a cache keeps
    it; `kind`: `"read"` (a TC read of the state) or `"expand"` (EC, of the embedding); `layer`: the layer it belongs
    to (EC: the first, the read-out: the last), whose index names it where state is filed by layer (vLLM).
    """

    key: str
    kind: str
    layer: int


@dataclass(frozen=True)
class StatePlan:
    """Every piece of state a model carries across tokens (`state_plan`).

    `windows`: the temporal convolutions' windows (EC's first, then two TC reads per layer and the read-out's);
    `recurrent`: DeltaNet's recurrent state per layer (and its short convolution's window); `settings`: the config
    settings that carry them, as the errors name them. An empty plan carries nothing beyond the key-value cache.
    """

    windows: tuple[StateWindow, ...] = ()
    recurrent: bool = False
    settings: tuple[str, ...] = ()

    @property
    def across_tokens(self) -> bool:
        """Whether anything beyond the key-value cache carries over: a cache must keep it between decoding steps."""
        return bool(self.windows) or self.recurrent


def state_plan(config) -> StatePlan:
    """The state `config` carries across tokens: TC's and EC's windows, DeltaNet's recurrent state."""
    windows, settings = [], []
    if config.delta_state_read == "temporal_conv":
        settings.append("delta_state_read='temporal_conv' (TC)")
    if config.delta_embed_expand == "conv":
        settings.append("delta_embed_expand='conv' (EC)")
        windows.append(StateWindow(EMBED_WINDOW, "expand", 0))
    if config.delta_state_read == "temporal_conv":
        layers = config.num_hidden_layers
        windows += [StateWindow(key, "read", i) for i in range(layers) for key in block_windows(i)]
        windows.append(StateWindow(READ_OUT_WINDOW, "read", layers - 1))
    recurrent = getattr(config, "token_mixer", "attention") == "delta_net"
    if recurrent:
        settings.append("token_mixer='delta_net' (DeltaNet)")
    return StatePlan(tuple(windows), recurrent, tuple(settings))


def packed_document_starts(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    shape: tuple[int, int],
    past_seen_tokens: int,
) -> torch.Tensor | None:
    """Where documents start in packed rows, `[B, T]` bool, for what runs over tokens (the DeltaNet mixer's state and
    short convolution, the TC / EC convolutions of the residual state); None when nothing can start.

    Packed / padding-free batches (trl `packing=True`, `DataCollatorWithFlattening`) put several documents in one
    row: a document starts where the caller's `position_ids` restart at 0, and at every `cu_seq_lens` boundary
    (cumulative lengths over the flattened batch, as flash-attention kwargs). A cache that already holds tokens
    cannot be continued by a new document (its state belongs to the previous one): refused, on the device.
    """
    if position_ids is None and cu_seq_lens is None:
        return None
    # A static cache's length is a tensor once it holds tokens (compiled decoding): checked on the device, not read.
    on_device = isinstance(past_seen_tokens, torch.Tensor)
    if cu_seq_lens is not None and (on_device or past_seen_tokens):
        raise ValueError(
            f"Packed input (cu_seq_lens) cannot continue a cache that already holds {past_seen_tokens} tokens, whose "
            "recurrent state / convolution windows belong to the previous document. Run packed rows without a cache."
        )
    device = (position_ids if cu_seq_lens is None else cu_seq_lens).device
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts = starts | (position_ids == 0)
    if cu_seq_lens is not None:
        # Every boundary but the last marks a start; one slot past the end takes those beyond the tokens.
        numel = starts.numel()
        boundaries = cu_seq_lens[:-1].long().clamp(0, numel)
        marks = torch.zeros(numel + 1, dtype=torch.int32, device=device).index_add_(
            0, boundaries, torch.ones_like(boundaries, dtype=torch.int32)
        )
        starts = starts | (marks[:numel] > 0).view(shape)
    if on_device or past_seen_tokens:
        torch._assert_async(
            ~(starts.any() & (past_seen_tokens > 0)) if on_device else ~starts.any(),
            "Packed input (position_ids restarting at 0) cannot continue a cache that already holds "
            f"{'its' if on_device else past_seen_tokens} tokens, whose recurrent state / convolution windows belong to "
            "the previous document. Run packed rows without a cache (or with an empty one).",
        )
        if not on_device:
            return None  # nothing starts: the usual decoding path
    return starts


#: `config._attn_implementation` under the serving engines' Transformers backends, which run the model with every
#: scheduled sequence packed into one row and no cache, so nothing carries over from one decoding step to the next
#: (vLLM: "vllm", "vllm_mla"; SGLang: "sglang", the same contract, not tested here). docs/serving.md.
SERVING_ENGINES = {"vllm": "vLLM", "vllm_mla": "vLLM", "sglang": "SGLang"}


def refuse_state_across_tokens_in_serving_engines(config) -> None:
    """One ValueError, while the engine builds the model, for a variant with state across tokens under a serving
    engine's Transformers backend: its tokens would differ from `generate`'s without an error. Nothing elsewhere."""
    engine = SERVING_ENGINES.get(getattr(config, "_attn_implementation", None))
    plan = state_plan(config)
    if engine is None or not plan.across_tokens:
        return
    name = type(config).__name__.removesuffix("Config")
    # TC and EC windows are served by ddl-hf's native vLLM models; the DeltaNet mixer by transformers only.
    route = (
        "Install ddl-hf where vLLM runs (pip install 'ddl-hf[vllm]'): its plugin serves this model natively, with "
        "these states kept per sequence (leave model_impl at its default, not 'transformers'). Or serve it with "
        if engine == "vLLM" and not plan.recurrent
        else "Serve this model with "
    )
    raise ValueError(
        f"{name} with {' and '.join(plan.settings)} carries state across tokens, which {engine}'s Transformers backend "
        "does not keep between decoding steps (it runs the model without a cache), so its tokens would differ from "
        f"generate's: refused. {route}transformers (generate, pipeline), or serve a variant without state across "
        "tokens (delta_state_read='linear' or 'channel_conv', delta_embed_expand='repeat', token_mixer='attention'); "
        "see ddl-hf's docs/serving.md."
    )


__all__ = [
    "EMBED_WINDOW",
    "READ_OUT_WINDOW",
    "SERVING_ENGINES",
    "StatePlan",
    "StateWindow",
    "block_windows",
    "packed_document_starts",
    "refuse_state_across_tokens_in_serving_engines",
    "state_plan",
]
