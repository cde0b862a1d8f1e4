"""The messages and stubs laprox builds from its descriptor set (laprox/_proto.py) on whatever
protobuf and grpcio runtime this interpreter has: every method of both services is callable,
the streaming one included; the descriptors equal what laproxd serves through server
reflection (with grpcio-reflection installed); grpcio-health-checking's grpc.health.v1 in the
default descriptor pool lives beside laprox's own (with grpcio-health-checking installed).

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Runtime
        tests/python/protobuf_range.sh runs it on the oldest and newest supported runtimes.
"""

import unittest

import support

support.prepare_package()

import grpc  # noqa: E402
from google.protobuf import descriptor_pb2  # noqa: E402

import laprox  # noqa: E402
from laprox import _proto  # noqa: E402

SERVER = None  # the module's laproxd, started by setUpModule
setUpModule, tearDownModule = support.module_laproxd(globals())


def installed(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def without_json_names(file_proto):
    """`file_proto` without json_name: protoc's descriptor sets carry it, the descriptors
    compiled into C++ (which reflection serves) do not."""
    def strip(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            strip(message.nested_type)
    strip(file_proto.message_type)
    return file_proto


class RuntimeStubTest(unittest.TestCase):

    def setUp(self):
        self.channel = grpc.insecure_channel(SERVER.target)
        self.addCleanup(self.channel.close)

    def test_stubs_and_servicers_have_every_method(self):
        for module, grpc_module in ((_proto.laprox_pb2, _proto.laprox_pb2_grpc),
                                    (_proto.health_pb2, _proto.health_pb2_grpc)):
            for service in module.DESCRIPTOR.services_by_name.values():
                stub = getattr(grpc_module, service.name + "Stub")(self.channel)
                servicer = getattr(grpc_module, service.name + "Servicer")
                for method in service.methods:
                    self.assertTrue(callable(getattr(stub, method.name)), method.full_name)
                    self.assertTrue(callable(getattr(servicer, method.name)), method.full_name)

    def test_unary_calls_decode_responses(self):
        stub = _proto.laprox_pb2_grpc.LaproxStub(self.channel)
        info = stub.GetServerInfo(_proto.pb.GetServerInfoRequest(), timeout=10)
        self.assertIsInstance(info, _proto.pb.GetServerInfoResponse)
        self.assertEqual(info.backend, _proto.pb.BACKEND_KIND_CPU)

    def test_health_watch_streams_the_status(self):
        stub = _proto.health_pb2_grpc.HealthStub(self.channel)
        stream = stub.Watch(_proto.health_pb2.HealthCheckRequest(service=""), timeout=10)
        self.assertEqual(next(stream).status, _proto.health_pb2.HealthCheckResponse.SERVING)
        stream.cancel()


@unittest.skipUnless(installed("grpc_reflection"), "grpcio-reflection is not installed")
class RuntimeReflectionTest(unittest.TestCase):

    def test_served_descriptors_equal_the_packaged_ones(self):
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
            ProtoReflectionDescriptorDatabase
        with grpc.insecure_channel(SERVER.target) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            self.assertIn("laprox.v1.Laprox", list(database.get_services()))
            served = database.FindFileContainingSymbol("laprox.v1.Laprox")
        ours = descriptor_pb2.FileDescriptorProto()
        _proto.pb.DESCRIPTOR.CopyToProto(ours)
        self.assertEqual(served.name, "laprox/v1/laprox.proto")
        self.assertEqual(without_json_names(served), without_json_names(ours))


@unittest.skipUnless(installed("grpc_health"), "grpcio-health-checking is not installed")
class RuntimeHealthCheckingTest(unittest.TestCase):
    """grpcio-health-checking registers grpc.health.v1 in the default pool; laprox's private
    pool has its own, so both import and work in one process."""

    def test_both_health_modules_work(self):
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        self.assertIsNot(health_pb2.HealthCheckRequest, _proto.health_pb2.HealthCheckRequest)
        with grpc.insecure_channel(SERVER.target) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
        self.assertEqual(response.status, health_pb2.HealthCheckResponse.SERVING)
        with laprox.Client(SERVER.target) as client:
            self.assertTrue(client.health())


if __name__ == "__main__":
    unittest.main()
