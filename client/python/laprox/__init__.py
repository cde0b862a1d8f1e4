"""laprox: Python client of laproxd, the LaProx KV-cache eviction sidecar.

    import laprox

    with laprox.Client("unix:/run/laprox/laproxd.sock") as client:
        print(client.info().version)
        model = client.register_model("my-model", laprox.ModelGeometry(
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576), o_proj)
        plan = client.compute_keep_plan(model, keys, values, window_queries, budget=128)
        plan.kept(layer, head)   # ascending kept positions
        plan.to_masks()          # bool [L, Hkv, n]

        # A paged KV cache read in place: a pool per layer in shared memory, vLLM's
        # FlashAttention layout [2, num_blocks, block_size, Hkv, d], one block table.
        pools = [client.shared_array((2, num_blocks, 16, 3, 64), "bf16") for _ in range(30)]
        kv = [laprox.PagedKV.vllm_flash_attn(pool, block_table, n) for pool in pools]
        plan = client.compute_keep_plan(model, [k for k, _ in kv], [v for _, v in kv],
                                        window_queries, budget=128, plan_shape="blocks_shared")
        plan.blocks.new_table(), plan.blocks.freed()

See client/python/README.md and proto/laprox/v1/laprox.proto (every option is documented there).
"""

from ._shm import SharedArray
from .client import DEFAULT_TARGET, Client, tls_credentials
from .errors import LaproxArgumentError, LaproxError, LaproxTypeError
from .paged import BlockTable, PagedKV, PagedTensor
from .types import (Allocation, BackendKind, BlockPlan, Budget, DeviceInfo, DType, GqaValue,
                    Indicator, KeepPlan, ModelGeometry, NumericMode, Outputs, PlanShape, Policy,
                    PolicyKind, PolicyPreset, Pooling, PoolTarget, RegionInfo, RegionKind,
                    RegionTensor, SequenceInputs, ServerInfo, ServerLimits, SharedRegion, Timing)

__version__ = "0.1.0"

__all__ = [
    "Allocation", "BackendKind", "BlockPlan", "BlockTable", "Budget", "Client", "DEFAULT_TARGET",
    "DType", "DeviceInfo", "GqaValue", "Indicator", "KeepPlan", "LaproxArgumentError", "LaproxError",
    "LaproxTypeError", "ModelGeometry",
    "NumericMode", "Outputs", "PagedKV", "PagedTensor", "PlanShape", "Policy", "PolicyKind",
    "PolicyPreset", "Pooling", "PoolTarget", "RegionInfo", "RegionKind", "RegionTensor",
    "SequenceInputs", "ServerInfo", "ServerLimits", "SharedArray", "SharedRegion", "Timing",
    "__version__", "tls_credentials",
]
