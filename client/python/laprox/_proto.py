"""The generated protobuf/gRPC modules (laprox/_gen, written at build time by
generate_stubs.py) and the conversions between them and laprox.types."""

from __future__ import annotations

from typing import Any

try:
    from ._gen import health_pb2, health_pb2_grpc, laprox_pb2, laprox_pb2_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "laprox: the generated gRPC modules (laprox._gen) are missing. Install the package "
        "with `pip install ./client/python`, or generate them in place with "
        "`python3 client/python/generate_stubs.py client/python/laprox/_gen`.") from e

from . import types as t
from .errors import invalid_argument

pb = laprox_pb2


def policy_to_proto(policy: t.Policy, message: Any) -> None:
    """Sets every option of `policy` that is not None on the Policy `message`."""
    for name in t.POLICY_FIELDS:
        value = getattr(policy, name)
        if value is None:
            continue
        enum_type = t.POLICY_ENUMS.get(name)
        try:
            if enum_type is not None:
                setattr(message, name, int(enum_type.parse(value)))
            elif name == "head_uniform_layers":
                setattr(message, name, bool(value))
            else:
                setattr(message, name, value)
        except (TypeError, ValueError) as e:
            raise invalid_argument(f"policy.{name} = {value!r}: {e}") from None
    for name, value in policy.extra.items():
        if name not in message.DESCRIPTOR.fields_by_name:
            raise invalid_argument(f"policy.extra: the Policy message has no field {name!r}")
        try:
            setattr(message, name, value)
        except (TypeError, ValueError, AttributeError) as e:
            raise invalid_argument(f"policy.{name} = {value!r}: {e}") from None


def _is_set(message: Any, field: Any) -> bool:
    if field.has_presence:
        return message.HasField(field.name)
    return bool(getattr(message, field.name))


def policy_from_proto(message: Any) -> t.Policy:
    """The Policy a message describes; unset fields are None, fields this client does not
    know go to `extra`."""
    values = {}
    extra = {}
    for field in message.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence or field.type == field.TYPE_ENUM:
            if not _is_set(message, field):
                continue  # not set (enum 0): None
        elif field.type == field.TYPE_MESSAGE or field.label == field.LABEL_REPEATED:
            continue
        value = getattr(message, name)
        if name in t.POLICY_ENUMS:
            try:
                value = t.POLICY_ENUMS[name](value)
            except ValueError:
                pass  # a value newer than this client: keep the number
        if name in t.POLICY_FIELDS:
            values[name] = value
        else:
            extra[name] = value
    return t.Policy(**values, extra=extra)
