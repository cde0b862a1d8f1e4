"""The laprox package's exceptions: LaproxError for what laproxd answered (and what stops a call
on this side: shared memory that cannot be allocated, nothing listening), and two subclasses for
mistakes found here before anything is sent, which are also ValueError / TypeError so that code
written for Python's conventions catches them."""

from __future__ import annotations

import errno as _errno

import grpc


class LaproxError(Exception):
    """An error from laproxd or from this client, with a gRPC status code.

    Server errors carry the code and message the server answered (for example NOT_FOUND for an
    unknown model, INVALID_ARGUMENT for a bad budget, naming the field). Errors found on this
    side use the code the server would have used: RESOURCE_EXHAUSTED when shared memory cannot
    be allocated, UNAVAILABLE when nothing listens at the target; a bad argument (an unsupported
    dtype, a tensor of the wrong rank, a block id past the pool) is a LaproxArgumentError (also a
    ValueError) and an argument of the wrong type a LaproxTypeError (also a TypeError).

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


class LaproxArgumentError(LaproxError, ValueError):
    """A bad argument, found before anything was sent: a ValueError (code INVALID_ARGUMENT, or
    OUT_OF_RANGE for an index past its end, as laproxd would answer)."""


class LaproxTypeError(LaproxError, TypeError):
    """An argument of the wrong type, found before anything was sent: a TypeError (code
    INVALID_ARGUMENT)."""


def from_rpc_error(error: grpc.RpcError) -> LaproxError:
    """The client's one seam: a gRPC error becomes a LaproxError with the same code/message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return LaproxError(code or grpc.StatusCode.UNKNOWN, details or "")


def invalid_argument(message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
                     ) -> LaproxArgumentError:
    """A local mistake in an argument's value (raise it)."""
    return LaproxArgumentError(code, message)


def wrong_type(message: str) -> LaproxTypeError:
    """A local mistake in an argument's type (raise it)."""
    return LaproxTypeError(grpc.StatusCode.INVALID_ARGUMENT, message)


def from_os_error(what: str, error: OSError) -> LaproxError:
    """Shared-memory failures: out of space/memory is RESOURCE_EXHAUSTED, anything else
    INTERNAL."""
    exhausted = error.errno in (_errno.ENOSPC, _errno.ENOMEM, _errno.EFBIG, _errno.EMFILE)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if exhausted else grpc.StatusCode.INTERNAL
    return LaproxError(code, f"{what}: {error}")
