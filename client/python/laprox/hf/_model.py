"""laprox.hf: the model as laproxd sees it: its attention modules, the layers laprox plans (the
full-attention ones), their geometry, and registering them (o_proj) with laproxd."""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch

from .. import types as t
from ..errors import invalid_argument


def attention_modules(model: Any) -> List[Any]:
    """The self-attention modules of the decoder layers, in layer order."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and hasattr(module, "o_proj") and hasattr(module, "q_proj"):
            found[int(idx)] = module
    if not found:
        raise invalid_argument(f"{type(model).__name__}: no attention modules with q_proj, "
                               "o_proj and layer_idx (not a Llama-architecture model?)")
    return [found[i] for i in sorted(found)]


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", model)
    return getattr(config, "get_text_config", lambda: config)()


def planned_layers(model: Any) -> List[int]:
    """The model layers laprox plans, in order: those whose cache holds the whole prompt.

    A sliding-window layer never holds more than its window, so it draws nothing from the
    budget and is neither planned, masked nor compacted: plan layer i (and geometry()'s layer
    i, and register_model()'s o_proj i) is model layer planned_layers(model)[i]. The layer
    kinds come from config.layer_types ("full_attention" is planned; "sliding_attention",
    "chunked_attention" and any other kind are not), else from each attention module's
    `sliding_window` attribute (None or absent: planned). Llama-architecture models without
    sliding layers get every layer, [0, 1, ..., L - 1]. INVALID_ARGUMENT when no layer is a
    full-attention layer."""
    modules = attention_modules(model)
    kinds = getattr(_text_config(model), "layer_types", None)
    if kinds is not None and len(kinds) >= len(modules):
        layers = [int(m.layer_idx) for m in modules if kinds[int(m.layer_idx)] == "full_attention"]
    else:
        layers = [int(m.layer_idx) for m in modules
                  if getattr(m, "sliding_window", None) is None]
    if not layers:
        raise invalid_argument(f"{type(model).__name__}: no full-attention layer (layer kinds "
                               f"{kinds}): every layer holds a sliding window, nothing to plan")
    return layers


def geometry(model: Any) -> t.ModelGeometry:
    """The geometry laproxd plans with: L = the planned layers (planned_layers(): the
    full-attention layers), H, Hkv, d, D from the config; the softmax scale from the attention
    modules (their `scaling`, e.g. Gemma 3's query_pre_attn_scalar ** -0.5; 0, the default,
    when it is 1/sqrt(d))."""
    g = t.ModelGeometry.from_hf_config(_text_config(model))
    layers = planned_layers(model)
    scale = 0.0
    try:
        module_scale = float(attention_modules(model)[layers[0]].scaling)
        if not math.isclose(module_scale, g.head_dim ** -0.5, rel_tol=1e-6):
            scale = module_scale
    except (AttributeError, TypeError, ValueError):
        pass
    return t.ModelGeometry(len(layers), g.num_heads, g.num_kv_heads, g.head_dim,
                           g.hidden_size, scale)


def register_model(client: Any, model: Any, name: Optional[str] = None,
                   prepare_cross_grams: bool = False) -> int:
    """Registers with laproxd the model made of the planned layers (planned_layers(): the
    full-attention layers), their geometry and o_proj.weight in order; returns the model id.
    CPU weights go as fp32 numpy (bf16/fp16 as they are); CUDA weights by IPC."""
    device_ok = _server_reads_device(client)
    modules = attention_modules(model)
    weights = [_host(modules[l].o_proj.weight.detach(), device_ok)
               for l in planned_layers(model)]
    if name is None:
        name = t.model_name(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return client.register_model(name, geometry(model), weights,
                                 prepare_cross_grams=prepare_cross_grams)


def _server_reads_device(client: Any) -> bool:
    """Whether laproxd can read CUDA tensors (its CUDA backend); a CPU server gets host copies."""
    try:
        return client.info().backend == "cuda"
    except Exception:  # a client without info() (tests) or an old server: stay on the host
        return False


def _host(x: torch.Tensor, device_ok: bool = False) -> Any:
    """What the client sends: numpy for CPU tensors (fp32/fp16; bf16 widened); CUDA tensors as
    they are when the server reads device memory, else copied to the host."""
    if x.device.type != "cpu":
        if device_ok:
            return x.contiguous()
        x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()
