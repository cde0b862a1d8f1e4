"""The one exception type of the laprox package."""

from __future__ import annotations

import errno as _errno

import grpc


class LaproxError(Exception):
    """An error from laproxd or from this client, with a gRPC status code.

    Server errors carry the code and message the server answered (for example NOT_FOUND for an
    unknown model, INVALID_ARGUMENT for a bad budget, naming the field). Errors found on this
    side use the code the server would have used: INVALID_ARGUMENT for inputs the client cannot
    send (an unsupported dtype, a tensor of the wrong rank), RESOURCE_EXHAUSTED when shared
    memory cannot be allocated, UNAVAILABLE when nothing listens at the target.

    Attributes:
        code: the grpc.StatusCode.
        message: the human-readable message (without the code).
    """

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        return (type(self), (self.code, self.message))


def from_rpc_error(error: grpc.RpcError) -> LaproxError:
    """The client's one seam: a gRPC error becomes a LaproxError with the same code/message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return LaproxError(code or grpc.StatusCode.UNKNOWN, details or "")


def invalid_argument(message: str) -> LaproxError:
    return LaproxError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_os_error(what: str, error: OSError) -> LaproxError:
    """Shared-memory failures: out of space/memory is RESOURCE_EXHAUSTED, anything else
    INTERNAL."""
    exhausted = error.errno in (_errno.ENOSPC, _errno.ENOMEM, _errno.EFBIG, _errno.EMFILE)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.INTERNAL
    return LaproxError(code, f"{what}: {error}")
