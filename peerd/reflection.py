"""gRPC server reflection under both service names: `grpc.reflection.v1alpha` and `grpc.reflection.v1`.

grpcio-reflection (1.85) ships only v1alpha, while current clients (grpcurl, Postman, grpc_cli) ask for v1 first and
get UNIMPLEMENTED. The two protocols are the same messages under another package, so v1 is served by the same
servicer: its descriptors are v1alpha's file renamed (so reflection can describe v1 itself), and its method decodes
and encodes the identical wire format with the v1alpha message classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME


def v1_file(pool: descriptor_pool.DescriptorPool | None = None) -> descriptor_pool.FileDescriptor:
    """The v1 reflection proto, registered in `pool` (default: the default pool) on first use."""
    pool = pool or descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()
    for msg in proto.message_type:
        for f in msg.field:
            if f.type_name.startswith(old):
                f.type_name = f".{V1_PACKAGE}." + f.type_name[len(old) :]
    for svc in proto.service:
        for m in svc.method:
            m.input_type = f".{V1_PACKAGE}." + m.input_type[len(old) :]
            m.output_type = f".{V1_PACKAGE}." + m.output_type[len(old) :]
    pool.Add(proto)
    return pool.FindFileByName(V1_FILE)


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection v1alpha and v1 on `server`, listing `service_names` and both reflection services."""
    v1_file()
    names = [*service_names, V1ALPHA_SERVICE, V1_SERVICE]
    servicer = reflection.aio.ReflectionServicer(names)
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler})
    server.add_generic_rpc_handlers((v1,))
