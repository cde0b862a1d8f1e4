"""Plain Python types of the laprox API: enums, policy, budget, geometry, results.

The enums carry the wire numbers of proto/laprox/v1/laprox.proto (value 0, "not set", has no
member: a field left as None is not set and takes the server's default). Every place that takes
an enum also takes its name as a string, case-insensitive, with or without the proto prefix and
with "-" for "_": PolicyKind.SNAPKV, "snapkv", "POLICY_KIND_SNAPKV" and 3 are the same.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

from .errors import invalid_argument, wrong_type


class _WireEnum(enum.IntEnum):
    """An enum whose values are the proto's numbers."""

    @classmethod
    def parse(cls, value: Union["_WireEnum", str, int]) -> "_WireEnum":
        """The member for a member, a wire number or a (case-insensitive) name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            prefix = _PREFIXES[cls]
            if key.startswith(prefix):
                key = key[len(prefix):]
            try:
                return cls[key]
            except KeyError:
                pass
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            try:
                return cls(int(value))
            except ValueError:
                pass
        names = ", ".join(m.name.lower() for m in cls)
        raise invalid_argument(f"{cls.__name__} {value!r} is not one of {names}")


class DType(_WireEnum):
    """Element type of a tensor on the wire."""
    F32 = 1
    F16 = 2
    BF16 = 3

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 4 if self is DType.F32 else 2


class BackendKind(_WireEnum):
    CPU = 1
    CUDA = 2


class RegionKind(_WireEnum):
    SHM = 1
    CUDA_IPC = 2


class PolicyKind(_WireEnum):
    """The eviction method: LaProx or a kvpress baseline (laprox.proto PolicyKind)."""
    LAPROX = 1
    STREAMING_LLM = 2
    SNAPKV = 3
    PYRAMIDKV = 4
    ADAKV = 5
    CRITICALKV = 6
    CRITICAL_ADAKV = 7
    CAKE = 8


class NumericMode(_WireEnum):
    EXACT = 1
    KVPRESS_COMPAT = 2


class Allocation(_WireEnum):
    GLOBAL_NORMALIZED = 1
    GLOBAL_RAW = 2
    PER_LAYER = 3
    UNIFORM = 4


class Indicator(_WireEnum):
    ATTENTION_X_PROJECTED_VALUE = 1
    ATTENTION_X_VALUE = 2
    ATTENTION = 3


class GqaValue(_WireEnum):
    MEAN_HEAD_NORM = 1
    SUMMED_PROJECTION = 2
    MEAN_HEAD_PRODUCT = 3
    EXACT_BLOCK = 4


class Pooling(_WireEnum):
    AVG = 1
    MAX = 2
    NONE = 3
    AVG_PEAK = 4   # max(x_i, AVG(x)_i): AVG that never averages an isolated peak away


class PoolTarget(_WireEnum):
    """Where pooling applies: the attention side (pool(c) * r) or the score (pool(c * r))."""
    ATTENTION = 1
    SCORE = 2


class PolicyPreset(_WireEnum):
    """A named set of options filling the fields left unset (PAPER: the paper's reading)."""
    DEFAULT = 1
    PAPER = 2


class PlanShape(_WireEnum):
    """The shape of keep-set a plan has (laprox.proto PlanShape): per (layer, head), one count
    per layer, or whole blocks shared by every layer (vLLM's block table) or per layer."""
    RAGGED = 1
    LAYER_UNIFORM = 2
    BLOCKS_SHARED = 3
    BLOCKS_PER_LAYER = 4


# The proto name of each enum and the prefix of its values.
_PREFIXES = {
    DType: "DTYPE_",
    BackendKind: "BACKEND_KIND_",
    RegionKind: "REGION_KIND_",
    PolicyKind: "POLICY_KIND_",
    NumericMode: "NUMERIC_MODE_",
    Allocation: "ALLOCATION_",
    Indicator: "INDICATOR_",
    GqaValue: "GQA_VALUE_",
    Pooling: "POOLING_",
    PoolTarget: "POOL_TARGET_",
    PolicyPreset: "POLICY_PRESET_",
    PlanShape: "PLAN_SHAPE_",
}

EnumLike = Union[_WireEnum, str, int]


@dataclass
class Policy:
    """Every option of the eviction policy (laprox.proto message Policy).

    None means "not set": the server applies the policy kind's default (the proto documents
    each one; KeepPlan.effective_policy shows what was applied). LAPROX's defaults, chosen on
    bench/quality's dev grid and joint endpoint: gqa_value MEAN_HEAD_PRODUCT (MEAN_HEAD_NORM with
    indicator ATTENTION or ATTENTION_X_VALUE), AVG_PEAK pooling of the per-token score over 31
    tokens (max of a token's own score and the average), window 32; preset="paper" is the
    paper's literal method. Enum fields take a member, a name
    ("snapkv", "per_layer", "avg") or a wire number.

    `extra` maps proto field names to values for Policy fields newer than this client; they are
    set on the message as given.
    """
    kind: Optional[EnumLike] = None            # PolicyKind; not set: LAPROX
    allocation: Optional[EnumLike] = None      # Allocation (LAPROX)
    indicator: Optional[EnumLike] = None       # Indicator (LAPROX)
    gqa_value: Optional[EnumLike] = None       # GqaValue (LAPROX; defaults above)
    window: Optional[int] = None               # observation window w
    pooling: Optional[EnumLike] = None         # Pooling
    pool_kernel: Optional[int] = None          # odd (31 for LAPROX, 5 for the baselines)
    sinks: Optional[int] = None
    min_per_head: Optional[int] = None
    head_uniform_layers: Optional[bool] = None  # deprecated: plan_shape="layer_uniform"
    max_layer_share: Optional[float] = None    # LAPROX global allocations: per-layer cap, >= 1
    pool_target: Optional[EnumLike] = None     # PoolTarget (LAPROX)
    preset: Optional[EnumLike] = None          # PolicyPreset (LAPROX): fills unset fields
    plan_shape: Optional[EnumLike] = None      # PlanShape; not set: RAGGED
    block_size: Optional[int] = None           # block shapes; not set: the keys' block table's
    numeric_mode: Optional[EnumLike] = None    # NumericMode (baselines)
    pyramid_beta: Optional[float] = None       # PYRAMIDKV
    alpha_safeguard: Optional[float] = None    # ADAKV, CRITICAL_ADAKV
    epsilon: Optional[float] = None            # CRITICALKV, CRITICAL_ADAKV
    first_stage_ratio: Optional[float] = None  # CRITICALKV, CRITICAL_ADAKV
    cake_tau1: Optional[float] = None          # CAKE
    cake_tau2: Optional[float] = None          # CAKE
    cake_gamma: Optional[float] = None         # CAKE
    extra: Dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> "Policy":
        """A copy with `changes` applied (unknown names: LaproxError INVALID_ARGUMENT)."""
        unknown = set(changes) - set(POLICY_FIELDS)
        if unknown:
            raise invalid_argument(f"unknown policy option(s) {sorted(unknown)}; known: "
                                   f"{', '.join(POLICY_FIELDS)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, policy: Union["Policy", str, EnumLike, Mapping[str, Any], None] = None,
           **options: Any) -> "Policy":
        """A Policy from a Policy, a kind ("snapkv"), a mapping of options or None, with
        `options` applied on top."""
        if policy is None:
            base = cls()
        elif isinstance(policy, Policy):
            base = policy
        elif isinstance(policy, Mapping):
            base = cls().replace(**dict(policy))
        else:
            base = cls(kind=PolicyKind.parse(policy))
        return base.replace(**options) if options else base


# Policy options by name (everything but `extra`) and the enum type of the enum-valued ones.
POLICY_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Policy)
                                       if f.name != "extra")
POLICY_ENUMS = {
    "kind": PolicyKind,
    "allocation": Allocation,
    "indicator": Indicator,
    "gqa_value": GqaValue,
    "pooling": Pooling,
    "pool_target": PoolTarget,
    "preset": PolicyPreset,
    "plan_shape": PlanShape,
    "numeric_mode": NumericMode,
}


@dataclass(frozen=True)
class Budget:
    """How many tokens to keep: exactly one of the two.

    tokens_per_head: B, the average kept tokens per KV head (window and sinks included).
    compression_ratio: the fraction to evict, in [0, 1); B = int((1 - cr) * n).

    Wherever a budget is taken, an int means tokens_per_head and a float compression_ratio.
    """
    tokens_per_head: Optional[int] = None
    compression_ratio: Optional[float] = None

    @classmethod
    def of(cls, budget: Union["Budget", int, float, None]) -> Optional["Budget"]:
        if budget is None or isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool):
            raise invalid_argument(f"budget {budget!r}: give an int (tokens per head) or a "
                                   "float (compression ratio)")
        if isinstance(budget, (int, np.integer)):
            return cls(tokens_per_head=int(budget))
        if isinstance(budget, (float, np.floating)):
            return cls(compression_ratio=float(budget))
        raise wrong_type(f"budget {budget!r}: expected Budget, int or float")


@dataclass(frozen=True)
class Outputs:
    """Which outputs ComputeKeepMask returns (counts, offsets, layer sums always)."""
    positions: bool = True   # kept positions (KeepPlan.positions / kept())
    bitmask: bool = False    # packed keep bitmask (KeepPlan.bitmask)
    scores: bool = False     # per-token competing scores (KeepPlan.scores)

    @classmethod
    def of(cls, outputs: Union["Outputs", Mapping[str, bool], Iterable[str], None]) -> "Outputs":
        """From an Outputs, a mapping {"bitmask": True}, or names ("positions", "bitmask",
        "scores"); names select exactly those outputs."""
        if outputs is None:
            return cls()
        if isinstance(outputs, Outputs):
            return outputs
        if isinstance(outputs, Mapping):
            unknown = set(outputs) - {"positions", "bitmask", "scores"}
            if unknown:
                raise invalid_argument(f"unknown outputs {sorted(unknown)}")
            return cls(**{k: bool(v) for k, v in outputs.items()})
        names = set(outputs)
        unknown = names - {"positions", "bitmask", "scores"}
        if unknown:
            raise invalid_argument(f"unknown outputs {sorted(unknown)}")
        return cls(positions="positions" in names, bitmask="bitmask" in names,
                   scores="scores" in names)


# What laproxd accepts as a model name (service/core: at most 128 bytes of these characters).
MODEL_NAME_MAX = 128
_MODEL_NAME_REFUSED = re.compile(r"[^A-Za-z0-9._/:-]")


def model_name(text: str) -> str:
    """A model name laproxd accepts, made from any text (a model path, a served name): every
    character outside [A-Za-z0-9._/:-] becomes "_" and only the last 128 are kept (a path ends
    in the model's own name). The integrations name their models with it: laprox.hf,
    laprox.vllm."""
    return _MODEL_NAME_REFUSED.sub("_", str(text))[-MODEL_NAME_MAX:]


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a decoder-only transformer (laprox.proto ModelGeometry).

    softmax_scale 0 means the default 1 / sqrt(head_dim).
    """
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    softmax_scale: float = 0.0

    @classmethod
    def of(cls, geometry: Union["ModelGeometry", Mapping[str, Any]]) -> "ModelGeometry":
        if isinstance(geometry, ModelGeometry):
            return geometry
        if isinstance(geometry, Mapping):
            try:
                return cls(**dict(geometry))
            except TypeError as e:
                raise invalid_argument(f"geometry: {e}") from None
        raise wrong_type(f"geometry: expected ModelGeometry or a mapping, got "
                         f"{type(geometry).__name__}")

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelGeometry":
        """From a Hugging Face transformers config (Llama, Mistral, Qwen2, ... attributes
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, head_dim)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(num_layers=int(config.num_hidden_layers), num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=int(head_dim),
                   hidden_size=int(config.hidden_size))


@dataclass(frozen=True)
class RegionTensor:
    """A tensor already in a region registered with Client.register_shm_region (or by other
    means): sent as a reference, never copied. Strides are in elements; None: contiguous."""
    region_id: int
    byte_offset: int
    dtype: EnumLike
    shape: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]] = None


class SequenceInputs:
    """The inputs of one sequence of Client.compute_keep_plans: exactly compute_keep_plan's
    arguments but model_id and timeout (see there), e.g.

        laprox.SequenceInputs(keys, values, window_queries, budget=128, window=16)

    A mapping with the same names ({"keys": ..., "values": ..., "budget": 128, "window": 16})
    is taken wherever a SequenceInputs is; names that are not arguments are policy options.
    Nothing is checked here: compute_keep_plans checks each sequence and names it in errors.
    """

    def __init__(self, keys: Any, values: Any, window_queries: Any = None,
                 window_attention: Any = None, window_lse: Any = None, *,
                 policy: Union["Policy", str, Mapping[str, Any], None] = None,
                 budget: Union["Budget", int, float, None] = None,
                 outputs: Union["Outputs", Mapping[str, bool], Iterable[str], None] = None,
                 dtype: Optional[str] = None, cache_positions: Any = None,
                 **policy_options: Any):
        self.keys = keys
        self.values = values
        self.window_queries = window_queries
        self.window_attention = window_attention
        self.window_lse = window_lse
        self.policy = policy
        self.budget = budget
        self.outputs = outputs
        self.dtype = dtype
        self.cache_positions = cache_positions
        self.policy_options: Dict[str, Any] = dict(policy_options)

    @classmethod
    def of(cls, value: Union["SequenceInputs", Mapping[str, Any]]) -> "SequenceInputs":
        """A SequenceInputs as given, or one from a mapping of its arguments."""
        if isinstance(value, SequenceInputs):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(**dict(value))
            except TypeError as e:
                raise invalid_argument(str(e).replace("SequenceInputs.__init__()",
                                                      "sequence")) from None
        raise wrong_type(f"expected laprox.SequenceInputs or a mapping of "
                         f"compute_keep_plan's arguments, got {type(value).__name__}")

    def __repr__(self) -> str:
        return (f"SequenceInputs(budget={self.budget!r}, policy={self.policy!r}, "
                f"policy_options={self.policy_options!r})")


@dataclass(frozen=True)
class DeviceInfo:
    uuid: str
    name: str
    ordinal: int
    total_memory_bytes: int
    compute_capability: Tuple[int, int]
    active: bool


@dataclass(frozen=True)
class ServerLimits:
    """laproxd's limits (laprox.proto ServerLimits); 0: not reported by this server."""
    max_regions: int
    max_models: int
    max_request_bytes: int
    max_response_bytes: int
    max_tokens: int
    max_window: int
    max_pool_kernel: int
    max_tokens_per_head: int
    max_request_memory_bytes: int = 0
    max_model_memory_bytes: int = 0
    max_batch_sequences: int = 0     # sequences per compute_keep_plans call
    max_request_work: int = 0        # work units one call may do (flops + bytes read)
    heavy_request_work: int = 0      # calls above it run on laproxd's heavy workers


@dataclass(frozen=True)
class ServerInfo:
    """What GetServerInfo answers."""
    version: str
    backend: str                    # "cpu" or "cuda"
    description: str                # one line, for logs only
    devices: Tuple[DeviceInfo, ...]
    limits: ServerLimits
    supported_policies: Tuple[PolicyKind, ...]
    supported_dtypes: Tuple[DType, ...]
    supported_region_kinds: Tuple[RegionKind, ...]


@dataclass(frozen=True)
class RegionInfo:
    """One registered region as ListRegions reports it."""
    region_id: int
    kind: RegionKind
    name: str
    device_uuid: str
    offset: int
    byte_size: int
    writable: bool
    in_flight_requests: int
    draining: bool


@dataclass(frozen=True)
class SharedRegion:
    """The client's own shared-memory staging region (Client.staging_region)."""
    name: str        # as /dev/shm lists it
    region_id: int
    byte_size: int
    registrations: int  # how many times this client has registered a staging region


@dataclass(frozen=True)
class Timing:
    """Wall time of the server's stages of one ComputeKeepMask call, in seconds."""
    queue_seconds: float
    validate_seconds: float
    score_seconds: float
    select_seconds: float
    respond_seconds: float
    total_seconds: float


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """The blocks a block-shaped plan keeps (laprox.proto BlockPlan). A unit is the whole
    model (BLOCKS_SHARED: 1 unit) or one layer (BLOCKS_PER_LAYER: L units); every (layer, KV
    head) of a unit keeps every position of the unit's kept blocks.

    Arrays (read-only views): offsets int64 [units + 1] into kept_blocks and new_block_table;
    kept_blocks int32, ascending per unit; block_scores float64 [units, num_blocks] or None
    (+inf: blocks holding window or sink positions); with paged keys, new_block_table int32
    (the physical ids of the kept blocks, offsets as kept_blocks), freed_block_ids int32 and
    freed_offsets int64 [units + 1]; None otherwise.
    """
    block_size: int
    num_blocks: int
    offsets: np.ndarray
    kept_blocks: np.ndarray
    block_scores: Optional[np.ndarray]
    new_block_table: Optional[np.ndarray]
    freed_block_ids: Optional[np.ndarray]
    freed_offsets: Optional[np.ndarray]

    @property
    def units(self) -> int:
        return len(self.offsets) - 1

    def kept(self, unit: int = 0) -> np.ndarray:
        """Kept logical block indices of `unit` (a layer with BLOCKS_PER_LAYER), ascending."""
        self._check(unit)
        return self.kept_blocks[self.offsets[unit]:self.offsets[unit + 1]]

    def new_table(self, unit: int = 0) -> np.ndarray:
        """The unit's new block table: the physical ids of its kept blocks, in order."""
        self._check(unit)
        if self.new_block_table is None:
            raise ValueError("the keys were not paged: the plan has no physical block ids")
        return self.new_block_table[self.offsets[unit]:self.offsets[unit + 1]]

    def freed(self, unit: int = 0) -> np.ndarray:
        """The physical ids of the unit's evicted blocks, in logical order."""
        self._check(unit)
        if self.freed_block_ids is None or self.freed_offsets is None:
            raise ValueError("the keys were not paged: the plan has no physical block ids")
        return self.freed_block_ids[self.freed_offsets[unit]:self.freed_offsets[unit + 1]]

    def _check(self, unit: int) -> None:
        if not 0 <= unit < self.units:
            raise IndexError(f"unit {unit} outside [0, {self.units})")


@dataclass(frozen=True, eq=False)
class KeepPlan:
    """The keep-plan of one prefill: which positions each (layer, KV head) keeps.

    A decode re-plan's plan (compute_keep_plan(..., cache_positions=...)) keeps the entries of
    the cache it was sent: positions (and kept()) are their token positions, while counts,
    bitmask, scores and to_masks() index the entries, as kept_entries() does; n is the longest
    layer's entries and cache_positions the positions that were sent, per layer [Hkv, n_l].

    Arrays:
        counts     int32 [L, Hkv]: kept tokens per (layer, KV head), window and sinks included.
        offsets    int64 [L * Hkv + 1]: positions[offsets[i]:offsets[i + 1]] belong to
                   i = layer * Hkv + head.
        positions  int32 [sum(counts)], ascending per (layer, head), or None when not requested.
        bitmask    uint8 [L, Hkv, ceil(n / 8)], packed as the proto sends it (bit i % 8, LSB
                   first, of byte i / 8 is position i), or None when not requested; to_masks()
                   unpacks it.
        scores     float32 [L, Hkv, n], or None when not requested (+inf for sinks/window).
        layer_sums float64 [L].
    blocks: the BlockPlan of a block-shaped plan (plan_shape BLOCKS_SHARED / BLOCKS_PER_LAYER),
    else None.
    The arrays are read-only views of the response bytes where possible.
    """
    num_layers: int
    num_kv_heads: int
    n: int
    counts: np.ndarray
    offsets: np.ndarray
    positions: Optional[np.ndarray]
    bitmask: Optional[np.ndarray]
    scores: Optional[np.ndarray]
    layer_sums: np.ndarray
    window: int
    sinks: int
    quota: int
    selected_total: int
    tokens_per_head: int
    effective_policy: Policy
    timing: Timing
    blocks: Optional[BlockPlan] = None
    cache_positions: Optional[List[np.ndarray]] = None

    def kept(self, layer: int, head: int) -> np.ndarray:
        """Kept positions of (layer, KV head), ascending, int32 (a decode re-plan's: the kept
        entries' token positions)."""
        if not (0 <= layer < self.num_layers and 0 <= head < self.num_kv_heads):
            raise IndexError(f"(layer, head) = ({layer}, {head}) outside "
                             f"[{self.num_layers}, {self.num_kv_heads}]")
        i = layer * self.num_kv_heads + head
        if self.positions is None:
            entries = np.flatnonzero(self._unpacked()[layer, head]).astype(np.int32)
            if self.cache_positions is None:
                return entries
            return self.cache_positions[layer][head][entries].astype(np.int32)
        return self.positions[self.offsets[i]:self.offsets[i + 1]]

    def kept_entries(self, layer: int, head: int) -> np.ndarray:
        """The kept entries of (layer, KV head) as indices into the cache that was sent,
        ascending, int64: a decode re-plan's entries; a prefill plan's positions."""
        kept = self.kept(layer, head)
        if self.cache_positions is None:
            return kept.astype(np.int64)
        return np.searchsorted(self.cache_positions[layer][head], kept).astype(np.int64)

    def layer_entries(self, layer: int) -> np.ndarray:
        """The kept entries of every head of `layer` with one count per head, int64 [Hkv, c]
        (c: the layer's largest count), ascending: a head that keeps fewer also keeps its most
        recent evicted entries. The shape an engine compacts a LAYER_UNIFORM plan to (its
        heads' counts differ by at most one), each padded slot a real entry, attended as it
        is."""
        heads = [self.kept_entries(layer, g) for g in range(self.num_kv_heads)]
        n = self.n if self.cache_positions is None else self.cache_positions[layer].shape[1]
        width = max(h.size for h in heads)
        rows = []
        for kept in heads:
            if kept.size < width:
                evicted = np.setdiff1d(np.arange(n), kept)
                kept = np.sort(np.concatenate([kept, evicted[kept.size - width:]]))
            rows.append(kept)
        return np.stack(rows).astype(np.int64)

    def kept_positions(self) -> List[List[np.ndarray]]:
        """kept(l, g) for every layer l and head g, as [L][Hkv] arrays."""
        return [[self.kept(l, g) for g in range(self.num_kv_heads)]
                for l in range(self.num_layers)]

    def to_masks(self) -> np.ndarray:
        """The keep masks, bool [L, Hkv, n] (True: keep); masks[l] is layer l's [Hkv, n]."""
        if self.positions is not None:
            L, Hkv, n = self.num_layers, self.num_kv_heads, self.n
            base = np.repeat(np.arange(L * Hkv, dtype=np.int64) * n,
                             self.counts.reshape(-1).astype(np.int64))
            entries = self.positions if self.cache_positions is None else np.concatenate(
                [self.kept_entries(l, g) for l in range(L) for g in range(Hkv)])
            mask = np.zeros(L * Hkv * n, dtype=bool)
            mask[base + entries] = True
            return mask.reshape(L, Hkv, n)
        return self._unpacked()

    def _unpacked(self) -> np.ndarray:
        if self.bitmask is None:
            raise ValueError("the plan has neither positions nor a bitmask: request one "
                             "(outputs=Outputs(positions=True) or bitmask=True)")
        return np.unpackbits(self.bitmask, axis=2, bitorder="little")[:, :, :self.n].astype(bool)
