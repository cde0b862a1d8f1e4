"""laprox: Python client of laproxd, the LaProx KV-cache eviction sidecar.

    import laprox

    with laprox.Client("unix:/run/laprox/laproxd.sock") as client:
        print(client.info().version)
        model = client.register_model("my-model", laprox.ModelGeometry(
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576), o_proj)
        plan = client.compute_keep_plan(model, keys, values, window_queries, budget=128)
        plan.kept(layer, head)   # ascending kept positions
        plan.to_masks()          # bool [L, Hkv, n]

See client/python/README.md and proto/laprox/v1/laprox.proto (every option is documented there).
"""

from .client import DEFAULT_TARGET, Client, tls_credentials
from .errors import LaproxError
from .types import (Allocation, BackendKind, BlockPlan, Budget, DeviceInfo, DType, GqaValue,
                    Indicator, KeepPlan, ModelGeometry, NumericMode, Outputs, PlanShape, Policy,
                    PolicyKind, PolicyPreset, Pooling, PoolTarget, RegionInfo, RegionKind,
                    RegionTensor, ServerInfo, ServerLimits, SharedRegion, Timing)

__version__ = "0.1.0"

__all__ = [
    "Allocation", "BackendKind", "BlockPlan", "Budget", "Client", "DEFAULT_TARGET", "DType", "DeviceInfo",
    "GqaValue", "Indicator", "KeepPlan", "LaproxError", "ModelGeometry", "NumericMode",
    "Outputs", "PlanShape", "Policy", "PolicyKind", "PolicyPreset", "Pooling", "PoolTarget", "RegionInfo",
    "RegionKind", "RegionTensor", "ServerInfo", "ServerLimits", "SharedRegion", "Timing",
    "__version__", "tls_credentials",
]
