"""Asking a Ray port a question over gRPC, with a deadline: is it Ray's, and where is its job API.

    python -m grpo_pipeline --model tiny --device npu --backend verl --ray-address head-node:6379   # not Ray: refused

A port that accepts a TCP connection may still not be Ray's (a proxy answering HTTP/2 404, another
service): `ray.init` retries against it for a minute and ends in tracebacks. One call that only Ray
answers settles it before anything starts: the GCS's cluster id for `host:port`, the Ray client
server's ping for `ray://`. The channels are Ray's own (its TLS and token settings); no Ray process
or Ray core client starts here, so nothing is left connected to the cluster afterwards (a Ray core
client left connected to a head that dies aborts its process a minute later).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, NamedTuple

# One call to a GCS is answered in milliseconds; a loaded head, in well under this.
ANSWER_TIMEOUT_S = 10.0


class Answer(NamedTuple):
    kind: Literal["ray", "token", "other"]  # Ray; Ray asking for a token; not Ray
    detail: str = ""  # what it answered instead


def ask_ray(target: str, client_server: bool = False, timeout_s: float = ANSWER_TIMEOUT_S) -> Answer:
    """Whether `target` (host:port) answers as Ray: the GCS's cluster id (the call every Ray client makes
    first), or with `client_server` (a ray:// address) the Ray client server's ping."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    try:
        with _channel(target) as channel:
            if client_server:
                ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout_s)
            else:
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:  # Ray with token auth, and no (or another) token here
            return Answer("token")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Answer("other", f"it gave no answer within {timeout_s:.0f} s")
        said = (exc.details() or "").partition("\n")[0][:200]
        return Answer("other", f"it answered {code.name} ({said})")
    return Answer("ray")


def dashboard_address(target: str, timeout_s: float = ANSWER_TIMEOUT_S) -> str | None:
    """The job API's (dashboard's) host:port as the GCS at `target` records it; None when it runs no dashboard."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    request = gcs_service_pb2.InternalKVGetRequest(key=b"dashboard", namespace=b"dashboard")
    with _channel(target) as channel:
        reply = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel).InternalKVGet(request, timeout=timeout_s)
    return reply.value.decode() if reply.value else None


@contextmanager
def _channel(target: str) -> Iterator:
    """Ray's own gRPC channel to `target` (TLS and token auth as Ray is configured here), closed after use."""
    from ray._private.grpc_utils import init_grpc_channel

    channel = init_grpc_channel(target)
    try:
        yield channel
    finally:
        channel.close()
