"""The laprox.v1 and grpc.health.v1 messages and gRPC stubs, and the conversions between
them and laprox.types.

No generated code is involved: the message classes are built at import time from the
descriptor set laprox/_gen/descriptors.binpb (compiled from proto/ by generate_stubs.py at
build time), the stubs from its service descriptors. A descriptor set means the same to every
protobuf runtime whichever protoc wrote it, so the package runs on protobuf 4.21 (Debian 12)
to 7.x. The descriptors live in a private pool: another package's grpc.health.v1 in the
default pool (grpcio-health-checking's) cannot conflict with them.

The names are those of protoc's modules: `laprox_pb2` (alias `pb`) and `health_pb2` hold the
message classes, enum wrappers and enum values of their file (and DESCRIPTOR);
`laprox_pb2_grpc` and `health_pb2_grpc` hold, for each service S, `SStub(channel)`,
`SServicer` and `add_SServicer_to_server(servicer, server)`.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Any, Dict, Tuple

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

from . import types as t
from .errors import invalid_argument

# generate_stubs.DESCRIPTOR_SET and SERVICE_CONFIG, as the build installs them.
_DESCRIPTOR_SET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gen",
                               "descriptors.binpb")
_SERVICE_CONFIG = os.path.join(os.path.dirname(_DESCRIPTOR_SET), "service_config.json")


def _load(path: str) -> Tuple[Any, Dict[str, Tuple[bool, bool]]]:
    """A new descriptor pool holding the files of the descriptor set at `path`, and for each
    method (by full name) whether it streams requests and responses. The streaming flags are
    read from the protos: protobuf 4.21's upb MethodDescriptor has no client_streaming, and
    the pure-Python MethodDescriptor.CopyToProto fails on descriptors built in a pool."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError as e:  # pragma: no cover - depends on how the package was installed
        raise ImportError(
            f"laprox: the descriptor set {path} is missing. Install the package with "
            "`pip install ./client/python`, or compile it in place with "
            "`python3 client/python/generate_stubs.py client/python/laprox/_gen`.") from e
    pool = descriptor_pool.DescriptorPool()
    streaming = {}
    for file in descriptor_pb2.FileDescriptorSet.FromString(data).file:  # imports come first
        pool.AddSerializedFile(file.SerializeToString())
        for service in file.service:
            for method in service.method:
                name = ".".join(filter(None, (file.package, service.name, method.name)))
                streaming[name] = (method.client_streaming, method.server_streaming)
    return pool, streaming


_POOL, _STREAMING = _load(_DESCRIPTOR_SET)


def _read_service_config(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError as e:  # pragma: no cover - depends on how the package was installed
        raise ImportError(
            f"laprox: {path} is missing: reinstall the package (`pip install ./client/python`) "
            "or run `python3 client/python/generate_stubs.py client/python/laprox/_gen`.") from e


# The gRPC service config of every channel to laproxd (proto/laprox/v1/service_config.json:
# which calls the channel retries, and how), as JSON text.
SERVICE_CONFIG = _read_service_config(_SERVICE_CONFIG)
# protobuf 4.21 lacks GetMessageClass; its MessageFactory.GetPrototype is gone from later
# versions.
_message_class = getattr(message_factory, "GetMessageClass", None) or \
    message_factory.MessageFactory(_POOL).GetPrototype


def _messages(file_name: str) -> SimpleNamespace:
    """What protoc's <file>_pb2 module holds: DESCRIPTOR, the message classes, the enum
    wrappers and the enum values of the file."""
    file = _POOL.FindFileByName(file_name)
    module = SimpleNamespace(DESCRIPTOR=file)
    for name, message in file.message_types_by_name.items():
        setattr(module, name, _message_class(message))
    for name, enum in file.enum_types_by_name.items():
        setattr(module, name, enum_type_wrapper.EnumTypeWrapper(enum))
        for value in enum.values:
            setattr(module, value.name, value.number)
    return module


def _kind(method: Any) -> str:
    """The grpc call kind of `method`: unary_unary, unary_stream, stream_unary or
    stream_stream."""
    client, server = _STREAMING[method.full_name]
    return "%s_%s" % ("stream" if client else "unary", "stream" if server else "unary")


def _stub_class(service: Any) -> type:
    def __init__(self: Any, channel: grpc.Channel) -> None:
        for method in service.methods:
            setattr(self, method.name, getattr(channel, _kind(method))(
                f"/{service.full_name}/{method.name}",
                request_serializer=_message_class(method.input_type).SerializeToString,
                response_deserializer=_message_class(method.output_type).FromString))

    return type(service.name + "Stub", (), {
        "__init__": __init__,
        "__doc__": f"Client of {service.full_name}: one multi-callable per method."})


def _unimplemented(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
    context.set_code(grpc.StatusCode.UNIMPLEMENTED)
    context.set_details("Method not implemented!")
    raise NotImplementedError("Method not implemented!")


def _add_servicer_function(service: Any) -> Any:
    def add(servicer: Any, server: grpc.Server) -> None:
        handlers = {
            method.name: getattr(grpc, _kind(method) + "_rpc_method_handler")(
                getattr(servicer, method.name),
                request_deserializer=_message_class(method.input_type).FromString,
                response_serializer=_message_class(method.output_type).SerializeToString)
            for method in service.methods}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.full_name, handlers),))

    return add


def _services(file_name: str) -> SimpleNamespace:
    """What grpc_python_plugin's <file>_pb2_grpc module holds: for each service S of the file,
    SStub, SServicer (every method UNIMPLEMENTED) and add_SServicer_to_server."""
    module = SimpleNamespace()
    for service in _POOL.FindFileByName(file_name).services_by_name.values():
        setattr(module, service.name + "Stub", _stub_class(service))
        setattr(module, service.name + "Servicer", type(
            service.name + "Servicer", (), {m.name: _unimplemented for m in service.methods}))
        setattr(module, f"add_{service.name}Servicer_to_server", _add_servicer_function(service))
    return module


laprox_pb2 = _messages("laprox/v1/laprox.proto")
laprox_pb2_grpc = _services("laprox/v1/laprox.proto")
health_pb2 = _messages("grpc/health/v1/health.proto")
health_pb2_grpc = _services("grpc/health/v1/health.proto")
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
                if value:
                    warnings.warn("laprox: Policy.head_uniform_layers is deprecated; set "
                                  "plan_shape='layer_uniform' instead (the same plans)",
                                  DeprecationWarning, stacklevel=3)
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


def _is_repeated(field: Any) -> bool:
    # Recent runtimes have FieldDescriptor.is_repeated and protobuf 7 removed .label; older
    # ones have only .label.
    repeated = getattr(field, "is_repeated", None)
    return field.label == field.LABEL_REPEATED if repeated is None else repeated


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
        elif field.type == field.TYPE_MESSAGE or _is_repeated(field):
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
