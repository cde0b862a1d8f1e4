"""Reaching laproxd without making the engine wait: the connector thread that connects,
registers the KV pool and the model (whose o_proj weights it reads from the checkpoint's files)
and, after a failure, registers them again once laproxd answers."""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ._state import STATE, _Link

RETRY_INTERVAL = 10.0  # seconds between two attempts to register with laproxd
PROBE_INTERVAL = 1.0  # seconds between two checks of a laproxd that let a plan call time out


# The codes after which the registrations may be gone (laproxd restarted, or reclaimed them):
# the client (its channel and staging region too) is replaced and everything registered again.
_RECONNECT_CODES = ("NOT_FOUND", "UNAVAILABLE", "FAILED_PRECONDITION")


def _code(error: BaseException) -> str:
    return getattr(getattr(error, "code", None), "name", "")


def _close(client: Any, link: Optional["_Link"] = None) -> None:
    """Closes `client`, after unregistering `link`'s model and region (laproxd may still hold
    them); best effort on a server that may be gone, each call within the client's timeout
    (Config.deadline)."""
    calls = [] if link is None else [(client.unregister_model, link.model_id),
                                     (client.unregister_region, link.region_id)]
    for call, argument in calls:
        try:
            call(argument)
        except Exception as e:  # noqa: BLE001
            if _code(e) in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
                break
    try:
        client.close()
    except Exception:  # noqa: BLE001
        pass


class _Connector:
    """Registers the KV pool and the model with laproxd on a thread of its own, so that no
    engine step waits on laproxd, nor on the disk (o_proj is read from the checkpoint), and
    publishes the result as STATE.link; a step that finds no link lets its sequences go
    uncompressed (counted: not_ready). Every call has a deadline: the registrations
    Config.register_deadline, the other calls of the link's client Config.deadline.

    A step whose plan call fails hands the link back (give_back):
      - after a timeout (laproxd stopped or overloaded) the thread asks laproxd's health
        every PROBE_INTERVAL and publishes the same link again once it answers;
      - after a code of _RECONNECT_CODES (laproxd restarted, or reclaimed the registrations)
        it closes that client and registers everything again through a new one;
    while registering fails it tries again every RETRY_INTERVAL (and warns, rate-limited)."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._returned: List[Tuple[_Link, bool]] = []  # (link, stale), from give_back
        self._thread: Optional[threading.Thread] = None
        self.attempted = threading.Event()  # set after the first registration attempt

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="laprox-connect",
                                            daemon=True)
            self._thread.start()

    def give_back(self, link: _Link, stale: bool) -> None:
        """From a step that dropped STATE.link: `link`'s call timed out (stale False: checked,
        then published again) or its registrations may be gone (stale True: replaced)."""
        with self._lock:
            self._returned.append((link, stale))
        self._wake.set()

    def _run(self) -> None:
        checking: Optional[_Link] = None  # a link whose plan call timed out
        while True:
            self._wake.clear()
            with self._lock:
                returned, self._returned = self._returned, []
            for link, stale in returned:
                if stale:
                    _close(link.client, link)
                else:
                    checking = link
            delay = None  # wait for give_back
            if STATE.link is None and checking is not None:
                answered = self._check(checking)
                if answered:
                    STATE.link, checking = checking, None
                elif answered is None:
                    delay = PROBE_INTERVAL
                else:
                    _close(checking.client, checking)
                    checking = None
            if STATE.link is None and checking is None:
                try:
                    STATE.link = _register()
                except Exception as e:  # noqa: BLE001 - the engine goes on uncompressed
                    STATE.warn(f"cannot register the KV pool and the model with laproxd ({e})",
                               0)
                    delay = RETRY_INTERVAL
            self.attempted.set()
            self._wake.wait(delay)

    @staticmethod
    def _check(link: _Link) -> Optional[bool]:
        """True when laproxd answers its health check (SERVING), None when it still does not
        answer in time (or is not serving), False when the call fails otherwise."""
        try:
            return True if link.client.health() else None
        except Exception as e:  # noqa: BLE001
            return None if _code(e) == "DEADLINE_EXCEEDED" else False


def _register() -> _Link:
    """A new client with the KV pool and the model registered (the connector thread)."""
    import laprox

    config = STATE.config
    client = laprox.Client(config.target, timeout=config.deadline)
    try:
        region_id = client.register_shm_region(STATE.segment.name, STATE.segment.size,
                                               timeout=config.register_deadline)
        # Read only once laproxd answered: a laproxd that is down costs no disk reads.
        o_proj = _o_proj(STATE.model_path, STATE.layer_ids)
        model_id = client.register_model(STATE.model_name, STATE.geometry, o_proj,
                                         timeout=config.register_deadline)
    except BaseException:
        _close(client)
        raise
    return _Link(client, region_id, model_id)


def _start_connector() -> None:
    """Starts the connector thread once the KV pool and the geometry are known, and waits
    for its first attempt at most Config.register_deadline (the engine is starting up: no
    step runs yet), so that the first requests find the registrations made."""
    if STATE.connector is not None or STATE.segment is None or STATE.geometry is None:
        return
    STATE.connector = _Connector()
    STATE.connector.start()
    if not STATE.connector.attempted.wait(STATE.config.register_deadline):
        STATE.warn(f"laproxd did not take the registrations within "
                   f"{STATE.config.register_deadline:g} s; the engine starts without them and "
                   f"compresses once they are made", 0)



def _o_proj(model_path: str, layers: List[int]) -> List[np.ndarray]:
    """The o_proj.weight [D, H * d] of each of `layers` (the planned ones, by their number in
    the model) as fp32, read from the checkpoint's safetensors (vLLM's CPU backend may repack
    the loaded weight for its GEMM and drop the original)."""
    import glob

    from safetensors import safe_open

    if not os.path.isdir(model_path):
        from huggingface_hub import snapshot_download

        model_path = snapshot_download(model_path, allow_patterns=["*.safetensors"])
    found: Dict[int, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                match = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", name)
                if match:
                    found[int(match.group(1))] = f.get_tensor(name).float().numpy()
    missing = sorted(set(layers) - set(found))
    if missing:
        raise ValueError(f"no o_proj.weight of layers {missing} in {model_path}")
    return [found[l] for l in layers]

