"""Where laproxd listens by default: laprox.DEFAULT_TARGET.

One rule for laproxd (--socket=auto), the C++ client (laprox::client::DefaultTarget) and this
package, written in proto/endpoint/laprox/v1/endpoint.h; tests/python/test_default_target.py runs the
three on it."""

from __future__ import annotations

import os


def default_target() -> str:
    """Where `laproxd` listens when started without --socket:
    unix:$XDG_RUNTIME_DIR/laprox/laproxd.sock for a user other than root whose XDG_RUNTIME_DIR
    is an absolute path (its trailing slashes dropped), else unix:/run/laprox/laproxd.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.geteuid() != 0 and runtime.startswith("/"):
        return f"unix:{runtime.rstrip('/')}/laprox/laproxd.sock"
    return "unix:/run/laprox/laproxd.sock"


DEFAULT_TARGET = default_target()
