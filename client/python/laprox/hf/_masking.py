"""laprox.hf: the attention function registered as "laprox" with transformers: it captures a
prefill's post-RoPE window queries, remembers recent decode queries, and masks evicted keys
(_State, the per-module state it reads); masked() and capture_window_queries() attach it."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from .. import types as t
from .._attention import SDPA_GQA, masked_attention
from ..errors import invalid_argument
from ._model import attention_modules

ATTENTION_NAME = "laprox"
DEFAULT_WINDOW_ROWS = 64  # query rows captured: the largest default window of any policy kind

_installed = False


def install() -> None:
    """Registers the "laprox" attention function and mask builder with transformers
    (idempotent). Called by Compressor and masked()."""
    global _installed
    if _installed:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _installed = True


class _State:
    """What the attention function reads on each module (attribute `_laprox_state`)."""

    def __init__(self, num_layers: int, num_kv_heads: int, num_heads: int,
                 planned: Optional[Sequence[int]] = None):
        self.num_layers = num_layers          # every layer of the model, indexed by layer_idx
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # The layers whose queries are captured and remembered (None: all); masks may cover
        # any layer (None where nothing is masked, e.g. a sliding-window layer).
        self.planned = None if planned is None else frozenset(planned)
        self.capture_rows = 0                 # > 0: keep that many query rows of a prefill
        self.captured: Dict[int, torch.Tensor] = {}
        self.prefix_bias: Optional[List[Optional[torch.Tensor]]] = None  # [B, H, 1, n] per layer
        # Per layer: whether any prefix position is evicted. A layer with nothing evicted (every
        # layer of an all-kept mask, or a compacted layer whose heads kept equal counts) needs
        # no mask when one query row attends to the whole cache (decoding).
        self.evicts: List[bool] = []
        self.compacted = False  # see set_masks
        # Per layer: the decode mask [B, H, 1, capacity] (prefix bias, then zeros for appended
        # tokens) in the queries' dtype and device, built once and sliced at every step.
        self._decode_bias: Dict[int, torch.Tensor] = {}
        # > 0 (decode re-plans): every forward after a prefill keeps the last that many query
        # rows of each layer in `recent` ([B, H, <= rows, d], post-RoPE).
        self.recent_rows = 0
        self.recent: Dict[int, torch.Tensor] = {}

    def set_masks(self, masks: Optional[Sequence[Any]], compacted: bool = False) -> None:
        """masks[l] for every model layer l: bool [B, Hkv, n] or [Hkv, n] (True = keep), or
        None (nothing masked in that layer); masks None clears them all. compacted: the masked
        layers hold the entries of a compacted cache, so a cache index is no token position and
        the model's causal mask (built from token positions) does not apply to them."""
        self._decode_bias = {}
        self.compacted = compacted and masks is not None
        if masks is None:
            self.prefix_bias = None
            self.evicts = []
            return
        if len(masks) != self.num_layers:
            raise invalid_argument(f"masks: {len(masks)} layers, the model has "
                                   f"{self.num_layers}")
        biases, evicts = [], []
        for l, m in enumerate(masks):
            if m is None:
                biases.append(None)
                evicts.append(False)
                continue
            m = torch.as_tensor(m, dtype=torch.bool)
            if m.dim() == 2:
                m = m.unsqueeze(0)
            if m.dim() != 3 or m.shape[1] != self.num_kv_heads:
                raise invalid_argument(f"masks[{l}]: expected [B, {self.num_kv_heads}, n], got "
                                       f"{tuple(m.shape)}")
            bias = torch.zeros(m.shape, dtype=torch.float32)
            bias.masked_fill_(~m, float("-inf"))
            biases.append(bias.repeat_interleave(self.group, dim=1).unsqueeze(2))
            evicts.append(not bool(m.all()))
        self.prefix_bias = biases
        self.evicts = evicts

    def remember(self, layer: int, query: torch.Tensor) -> None:
        """Keeps the last `recent_rows` query rows of `layer` ([B, H, q, d], post-RoPE)."""
        rows = query.detach()
        previous = self.recent.get(layer)
        if previous is not None:
            rows = torch.cat([previous, rows], dim=2)
        self.recent[layer] = rows[:, :, -self.recent_rows:].clone()

    def decode_bias(self, layer: int, query: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The additive mask [B, H, 1, kv_len] of one query row over `kv_len` keys: the layer's
        prefix bias, 0 for the tokens appended since. A view of a buffer built on the first
        call and rebuilt only when kv_len outgrows it (capacity doubles), so decoding step by
        step allocates nothing."""
        b = query.shape[0]
        prefix = self.prefix_bias[layer]
        n = prefix.shape[-1]
        if n > kv_len:
            raise invalid_argument(f"keep masks cover {n} positions but the cache holds "
                                   f"{kv_len}: was the cache cropped or compacted after the "
                                   "masks were set?")
        buf = self._decode_bias.get(layer)
        if buf is None or buf.shape[-1] < kv_len or buf.dtype != query.dtype or \
                buf.device != query.device:
            capacity = max(kv_len, n + 256, 2 * buf.shape[-1] if buf is not None else 0)
            buf = torch.zeros(prefix.shape[0], prefix.shape[1], 1, capacity,
                              dtype=query.dtype, device=query.device)
            buf[..., :n] = prefix
            self._decode_bias[layer] = buf
        if buf.shape[0] != b:
            if buf.shape[0] != 1:
                raise invalid_argument(f"keep masks are for batch {buf.shape[0]}, the call "
                                       f"has {b}")
            return buf[..., :kv_len].expand(b, -1, -1, -1)
        return buf[..., :kv_len]


def _sdpa_masked_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, dropout: float, scaling: Optional[float]):
    """masked_attention in the layout transformers' attention functions return ([B, q, H, d],
    no weights). transformers' own SDPA path repeats keys and values to every query head
    whenever a mask is given (a copy of the layer's cache per call); masked_attention does not."""
    out = masked_attention(query, key, value, mask, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
               scaling: Optional[float] = None, **kwargs: Any):
    """SDPA attention that captures prefill window queries and masks evicted keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    state: Optional[_State] = getattr(module, "_laprox_state", None)
    if state is not None:
        q_len, kv_len = query.shape[2], key.shape[2]
        layer = module.layer_idx
        prefill = q_len == kv_len and q_len > 1
        planned = state.planned is None or layer in state.planned
        if prefill:
            # A new sequence's prefill: it runs on the full cache; earlier masks are void.
            if state.capture_rows > 0 and planned:
                state.captured[layer] = query[:, :, -state.capture_rows:].detach().clone()
        elif state.recent_rows > 0 and planned:
            state.remember(layer, query)
        if not prefill and state.prefix_bias is not None and state.prefix_bias[layer] is not None:
            if q_len == 1 and attention_mask is None:
                # Decoding (the model's mask was skipped: no padding, one query row). A layer
                # with nothing evicted runs exactly like the full cache; the others take their
                # prebuilt bias, sliced to this step's length.
                if not state.evicts[layer]:
                    if state.prefix_bias[layer].shape[-1] > kv_len:
                        state.decode_bias(layer, query, kv_len)  # raises: the cache is short
                elif SDPA_GQA and query.device.type == "cpu":
                    return _sdpa_masked_gqa(query, key, value,
                                            state.decode_bias(layer, query, kv_len),
                                            dropout, scaling)
                else:
                    attention_mask = state.decode_bias(layer, query, kv_len)
            else:
                # A compacted layer's causal mask follows from its layout (the new tokens are
                # the last q_len entries), not from the model's, which indexes keys by position.
                attention_mask = _masked(None if state.compacted else attention_mask,
                                         state.prefix_bias[layer], query, kv_len)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _masked(attention_mask: Optional[torch.Tensor], prefix_bias: torch.Tensor,
            query: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The float mask [B, H, q, kv] = the model's mask (causal) + -inf at evicted keys."""
    b, _, q_len, _ = query.shape
    n = prefix_bias.shape[-1]
    if n > kv_len:
        raise invalid_argument(f"keep masks cover {n} positions but the cache holds {kv_len}: "
                               "was the cache cropped or compacted after the masks were set?")
    bias = prefix_bias.to(device=query.device, dtype=query.dtype)
    if bias.shape[0] != b:
        if bias.shape[0] != 1:
            raise invalid_argument(f"keep masks are for batch {bias.shape[0]}, the call has {b}")
        bias = bias.expand(b, -1, -1, -1)
    if kv_len > n:
        bias = torch.cat([bias, bias.new_zeros(b, bias.shape[1], 1, kv_len - n)], dim=-1)
    if attention_mask is not None and attention_mask.shape[-1] < kv_len:
        attention_mask = None  # built for a layer of another length (compacted cache)
    if attention_mask is None:
        if q_len > 1:  # causal: query row t sees keys j <= kv_len - q_len + t
            rows = torch.arange(q_len, device=query.device).unsqueeze(1)
            cols = torch.arange(kv_len, device=query.device).unsqueeze(0)
            causal = torch.zeros(q_len, kv_len, dtype=query.dtype, device=query.device)
            causal.masked_fill_(cols > rows + (kv_len - q_len), float("-inf"))
            return bias + causal
        return bias
    if attention_mask.dtype == torch.bool:
        base = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        base.masked_fill_(~attention_mask, float("-inf"))
    else:
        base = attention_mask.to(query.dtype)
    return base[..., -kv_len:] + bias


def _attach_state(model: Any, state: _State) -> List[Any]:
    modules = attention_modules(model)
    for module in modules:
        module._laprox_state = state
    return modules


@contextlib.contextmanager
def _attention_implementation(model: Any) -> Iterator[None]:
    install()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def masked(model: Any, masks: Sequence[Any]) -> Iterator[None]:
    """Within the block, attention ignores the evicted prefix positions of `masks` (one entry per
    model layer: bool [B, Hkv, n] or [Hkv, n], True = keep, or None for a layer left whole,
    e.g. a sliding-window layer; Compressor.masks has this form) for every call whose keys
    extend the prefix (decoding steps, teacher-forced continuations over a cache holding the n
    prefix tokens)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    g = t.ModelGeometry.from_hf_config(config)
    state = _State(g.num_layers, g.num_kv_heads, g.num_heads)
    state.set_masks(masks)
    modules = _attach_state(model, state)
    try:
        with _attention_implementation(model):
            yield
    finally:
        for module in modules:
            module.__dict__.pop("_laprox_state", None)


@contextlib.contextmanager
def capture_window_queries(model: Any, rows: int = DEFAULT_WINDOW_ROWS
                           ) -> Iterator[Dict[int, torch.Tensor]]:
    """Within the block, every prefill (a forward whose query length equals its key length)
    stores each layer's last `rows` post-RoPE queries, [B, H, rows, d], in the yielded dict
    under the layer index (a later prefill overwrites them)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    g = t.ModelGeometry.from_hf_config(config)
    state = _State(g.num_layers, g.num_kv_heads, g.num_heads)
    state.capture_rows = int(rows)
    modules = _attach_state(model, state)
    try:
        with _attention_implementation(model):
            yield state.captured
    finally:
        for module in modules:
            module.__dict__.pop("_laprox_state", None)
