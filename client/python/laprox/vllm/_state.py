"""What laprox.vllm's hooks share: the plugin's configuration (Config, from the environment),
the sequences it follows (prefilling, decoding under a plan, being compacted) and the one
_State of this process (STATE), with its rate-limited warning."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..client import PLAN_DEADLINE_S
from ..types import model_name
from . import _compact, _metrics

logger = logging.getLogger("laprox.vllm")

LOG_INTERVAL = 60.0  # seconds between two warnings about laproxd
REGISTER_DEADLINE_S = 30.0  # default deadline of a registration call (Config.register_deadline)
MAX_PLANS = 1024  # plans kept for plans(), newest last
# The compacting plugin's cap on a layer's share of the model-wide selection
# (Policy.max_layer_share): bench/quality/LAYERSHARE.md and LAYERCAP.md (SmolLM2-135M, 4K
# tokens) found the longest layer at up to 1.9x the mean uncapped, 1.23x at 1.25, and no
# significant quality cost against the uncapped LAYER_UNIFORM plan.
COMPACT_LAYER_SHARE = 1.25
# The compacting plugin's plan options (LAYER_UNIFORM, which compaction applies, with the cap
# above) and, for kind LAPROX, its scoring: the one bench/quality's joint endpoint chose for
# this shape (ENDPOINT.md, JOINT.md: SmolLM2-135M, 120 retrieval prompts, 36 held-out
# documents): AVG pooling with position 0 always kept (sinks 1). laproxd's own default, AVG_PEAK,
# won at the RAGGED shape but lost retrieval at this one (B = 64 and 128).
COMPACT_POLICY: Dict[str, Any] = {"plan_shape": "layer_uniform",
                                  "max_layer_share": COMPACT_LAYER_SHARE}
COMPACT_LAPROX_SCORING: Dict[str, Any] = {"pooling": "avg", "sinks": 1}  # LAPROX only
_LAYER = re.compile(r"layers\.(\d+)\.")



@dataclass(frozen=True)
class Config:
    """The plugin's settings (module docstring of laprox.vllm)."""
    target: str
    budget: Any = 128
    policy: Dict[str, Any] = field(default_factory=dict)
    window: int = 32
    model_name: str = ""
    # Seconds a step waits for its plans: the deadline of a ComputeKeepPlans call is
    # plan_deadline(prompt tokens of the call, deadline).
    deadline: float = PLAN_DEADLINE_S
    # Seconds for each registration call (made off the steps), and the longest the engine's
    # start-up waits for the first registration.
    register_deadline: float = REGISTER_DEADLINE_S
    # "compact": a planned sequence's evicted entries leave the cache and its blocks go back to
    # vLLM (LAYER_UNIFORM plans; _compact); "mask": they stay and decode leaves them out.
    mode: str = "compact"
    # N > 0 (compact mode, a budget in tokens): a compacted sequence is re-planned and compacted
    # again whenever the mean over layers of its entries per head reaches budget + N, so that a
    # long generation stays within it (DESIGN.md, section 7). 0: planned once, after the prefill.
    decode_buffer: int = 0
    # When a planned sequence is compacted (compact mode): "always", at once after its prefill
    # (it decodes masked until the order is carried out); "pressure", only once vLLM's pool has
    # fewer free blocks than its requests need (_compact.relieve), the fewest sequences that
    # cover the shortfall; until then it decodes with its full cache.
    trigger: str = "always"
    # With the pressure trigger and a budget in tokens: budgets above `budget` (ascending) a
    # sequence is also planned at after its prefill, so that relieving the pool can compact a
    # sequence no deeper than the shortfall needs (_compact.choose). (): the budget only.
    pressure_budgets: Tuple[int, ...] = ()
    # With the pressure trigger: a sequence whose prompt has at least this many tokens is
    # compacted at once, as `always` would (its decode is where compaction pays even with room:
    # bench/RESULTS.md, "Long contexts, with room"). 0: none is.
    long_prompt: int = 0

    @property
    def budgets(self) -> Tuple[Any, ...]:
        """The budgets a sequence is planned at: the floor, then pressure_budgets."""
        return (self.budget,) + self.pressure_budgets

    @property
    def compacts(self) -> bool:
        return self.mode == "compact"

    @property
    def deferred(self) -> bool:
        """Whether planned sequences wait for the pool to run short (LAPROX_VLLM_TRIGGER)."""
        return self.compacts and self.trigger == "pressure"

    @property
    def layer_uniform(self) -> bool:
        shape = str(self.plan_policy().get("plan_shape", "")).lower()
        return shape in ("layer_uniform", "plan_shape_layer_uniform")

    def plan_policy(self) -> Dict[str, Any]:
        """The policy options sent: compaction applies LAYER_UNIFORM plans, and no layer keeps
        more than COMPACT_LAYER_SHARE times the mean layer (the engine holds blocks for the
        longest layer), with COMPACT_POLICY's scoring; an option LAPROX_VLLM_POLICY sets wins,
        and one it sets to null is left unset (laproxd's default)."""
        policy = dict(self.policy)
        if self.compacts:
            kind = str(policy.get("kind") or "laprox").lower().replace("policy_kind_", "")
            scoring = COMPACT_LAPROX_SCORING if kind == "laprox" else {}
            policy = {**COMPACT_POLICY, **scoring, **policy}
        return {key: value for key, value in policy.items() if value is not None}

    @staticmethod
    def from_env() -> "Config":
        budget_text = os.environ.get("LAPROX_VLLM_BUDGET", "128")
        budget = float(budget_text) if "." in budget_text else int(budget_text)
        policy = json.loads(os.environ.get("LAPROX_VLLM_POLICY", "{}"))
        if not isinstance(policy, dict):
            raise ValueError("LAPROX_VLLM_POLICY must be a JSON object of policy options")
        mode = os.environ.get("LAPROX_VLLM_MODE", "compact")
        if mode not in ("compact", "mask"):
            raise ValueError(f"LAPROX_VLLM_MODE must be compact or mask, not {mode!r}")
        shape = str(policy.get("plan_shape", "layer_uniform")).lower()
        if mode == "compact" and shape not in ("layer_uniform", "plan_shape_layer_uniform"):
            logger.warning("laprox: LAPROX_VLLM_POLICY asks for plan_shape %s; compaction "
                           "applies layer_uniform plans only, so the plugin masks instead",
                           policy["plan_shape"])
            mode = "mask"
        decode_buffer = int(os.environ.get("LAPROX_VLLM_DECODE_BUFFER", "0"))
        if decode_buffer < 0:
            raise ValueError(f"LAPROX_VLLM_DECODE_BUFFER must be >= 0, not {decode_buffer}")
        if decode_buffer and (mode != "compact" or not isinstance(budget, int)):
            logger.warning("laprox: LAPROX_VLLM_DECODE_BUFFER needs compact mode and a budget in "
                           "tokens per head; sequences are planned once, after the prefill")
            decode_buffer = 0
        trigger = os.environ.get("LAPROX_VLLM_TRIGGER", "always")
        if trigger not in ("always", "pressure"):
            raise ValueError(f"LAPROX_VLLM_TRIGGER must be always or pressure, not {trigger!r}")
        if trigger == "pressure" and mode != "compact":
            logger.warning("laprox: LAPROX_VLLM_TRIGGER=pressure needs compact mode (masking "
                           "frees no block); every planned sequence decodes masked")
            trigger = "always"
        pressure_budgets = _pressure_budgets(budget, trigger)
        long_prompt = int(os.environ.get("LAPROX_VLLM_LONG_PROMPT", "0"))
        if long_prompt < 0:
            raise ValueError(f"LAPROX_VLLM_LONG_PROMPT must be >= 0, not {long_prompt}")
        if long_prompt and trigger != "pressure":
            logger.warning("laprox: LAPROX_VLLM_LONG_PROMPT needs LAPROX_VLLM_TRIGGER=pressure "
                           "(with always every planned sequence is compacted at once)")
            long_prompt = 0
        return Config(target=os.environ["LAPROX_VLLM_TARGET"], budget=budget, policy=policy,
                      mode=mode, decode_buffer=decode_buffer, trigger=trigger,
                      pressure_budgets=pressure_budgets, long_prompt=long_prompt,
                      window=int(os.environ.get("LAPROX_VLLM_WINDOW", "32")),
                      model_name=os.environ.get("LAPROX_VLLM_MODEL", ""),
                      deadline=_seconds("LAPROX_VLLM_DEADLINE_SECONDS", PLAN_DEADLINE_S),
                      register_deadline=_seconds("LAPROX_VLLM_REGISTER_DEADLINE_SECONDS",
                                                 REGISTER_DEADLINE_S))


def _pressure_budgets(budget: Any, trigger: str) -> Tuple[int, ...]:
    """LAPROX_VLLM_PRESSURE_BUDGETS: comma-separated budgets in tokens per head above
    LAPROX_VLLM_BUDGET (the floor), for the pressure trigger with a budget in tokens."""
    text = os.environ.get("LAPROX_VLLM_PRESSURE_BUDGETS", "").strip()
    if not text:
        return ()
    try:
        budgets = sorted({int(b) for b in text.split(",")})
    except ValueError:
        raise ValueError(f"LAPROX_VLLM_PRESSURE_BUDGETS must be budgets in tokens per head, "
                         f"comma-separated, not {text!r}") from None
    if trigger != "pressure" or not isinstance(budget, int):
        logger.warning("laprox: LAPROX_VLLM_PRESSURE_BUDGETS needs LAPROX_VLLM_TRIGGER=pressure "
                       "and LAPROX_VLLM_BUDGET in tokens per head; sequences are planned at "
                       "the budget only")
        return ()
    if budgets[0] <= budget:
        raise ValueError(f"LAPROX_VLLM_PRESSURE_BUDGETS must be above LAPROX_VLLM_BUDGET "
                         f"({budget}, the floor), not {text!r}")
    return tuple(budgets)


def _seconds(variable: str, default: float) -> float:
    seconds = float(os.environ.get(variable, default))
    if not seconds > 0:
        raise ValueError(f"{variable} must be a number of seconds > 0, not {seconds}")
    return seconds


@dataclass(frozen=True)
class _Link:
    """A client of laproxd through which the KV pool and the model are registered."""
    client: Any
    region_id: int
    model_id: int


@dataclass
class _Prefill:
    """A sequence being prefilled: its window queries so far and where it lies."""
    prompt_len: int
    queries: np.ndarray                   # [L, H, w, d] float32, rows of the last w positions
    block_ids: Optional[np.ndarray] = None
    computed: int = 0                     # positions in the cache after the last prefill step
    generation: int = 0                   # the request's generation (_compact.current)


@dataclass
class _Compressed:
    """A sequence decoding under its plan: kept[l] [Hkv, prompt_len] says which prompt
    entries take part in attention; the kept keys and values of each layer are gathered from
    the cache once, at the first decode step that needs them ([Hkv, c, d], heads padded to the
    largest count c, `valid` [Hkv, c] marking real entries)."""
    prompt_len: int
    kept: np.ndarray
    block_ids: np.ndarray
    layers: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)
    generation: int = 0


class _State:
    def __init__(self) -> None:
        self.config: Optional[Config] = None
        self.segment: Any = None              # the shared-memory object behind the KV cache
        self.pool_base: int = 0               # its data pointer
        # Set by the connector thread once the pool and the model are registered; the steps
        # only read it, and drop it (connector.give_back) when a call fails.
        self.link: Optional[_Link] = None
        self.connector: Optional["_Connector"] = None
        self.model_name = ""
        self.model_path = ""
        self.geometry: Any = None             # of the planned layers (num_layers: theirs)
        # Whether vLLM made laprox's KV connector in this process (connector.LaproxConnector),
        # and whether the engine was told it has none.
        self.connector_configured = False
        self.unconfigured_warned = False
        # This step's Channel from the scheduler (connector.handle_preemptions), the model
        # runner (seen in _update_states) and the attention layers by name.
        self.channel: Any = None
        self.runner: Any = None
        self.context: Dict[str, Any] = {}
        # The KV cache group laprox plans and compacts (its only full-attention one; the other
        # groups, sliding-window ones, are left to vLLM), its layers' names in model order and
        # their numbers in the model, and each name's index among them (_compacted_group).
        self.group = 0
        self.layer_names: List[str] = []
        self.layer_ids: List[int] = []
        self.planned: Dict[str, int] = {}
        # This step's prefill rows: batch index -> (request id, first position, count).
        self.step: Dict[int, Tuple[str, int, int]] = {}
        self.prefills: Dict[str, _Prefill] = {}
        # Sequences decoding under a plan, and this step's decode rows of them: batch index ->
        # (request id, first position, count).
        self.compressed: Dict[str, "_Compressed"] = {}
        self.decode_rows: Dict[int, Tuple[str, int, int]] = {}
        # Compaction (_compact): plans waiting for the scheduler's order, the requests reported
        # ready on the next ModelRunnerOutput, the compacted requests, and this step's rows of
        # them.
        self.pending: Dict[str, _compact.Pending] = {}
        self.ready: Dict[str, _compact.Ready] = {}
        self.compacted: Dict[str, _compact.Compacted] = {}
        self.shift: Optional[_compact.Shift] = None
        # This step's compacted rows: (request id, index of its first token in the step, count,
        # its first token's position).
        self.shift_rows: List[Tuple[str, int, int, int]] = []
        # The fence (_compact.current): each request's generation, as the scheduler sends it
        # with the first step of each (connector.Channel).
        self.generations: Dict[str, int] = {}
        self.plans: "OrderedDict[str, Any]" = OrderedDict()  # the last MAX_PLANS requests
        self.metrics = _metrics.Metrics()
        # Seconds of this step's capture and masked decode, observed at its end (after_forward).
        self.step_seconds: Dict[str, float] = {"capture": 0.0, "apply": 0.0}
        self.last_warning = 0.0
        self.warning_lock = threading.Lock()  # the steps and the connector thread warn

    def name_model(self, served_name: str) -> None:
        """Names the model (LAPROX_VLLM_MODEL, or vLLM's served name) and puts this process's
        counters in the metrics directory under that name: called where the model runner loads
        the model and where the scheduler starts, which may be processes of their own."""
        self.model_name = model_name(self.config.model_name or served_name)
        self.metrics = _metrics.attach(self.metrics, self.model_name)

    def warn(self, message: str, sequences: int = 1) -> None:
        """Counts `sequences` sequences that keep their full cache (or a failed set-up step: 1;
        a failed registration: 0, its sequences are counted when they miss their plan) and
        logs the message at most once per LOG_INTERVAL. Only the engine's thread counts (the
        connector thread passes 0): the counters are not atomic."""
        if sequences:
            self.metrics.failures += sequences
        with self.warning_lock:
            now = time.monotonic()
            if now - self.last_warning < LOG_INTERVAL:
                return
            self.last_warning = now
        logger.warning("laprox: %s; the sequence keeps its full KV cache (failures so far: "
                       "%d)", message, self.metrics.failures)


STATE = _State()


def _wire_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
