"""The Open Inference Protocol v2 over gRPC (``inference.GRPCInferenceService``,
KServe's, with Triton's bidirectional ``ModelStreamInfer``) on ``--grpc-port``.

A translation, and nothing else: each ``ModelInferRequest`` is rewritten as the
REST door's inference request (a JSON head, and the raw contents after it as the
binary tensor extension's bytes) and read by ``wsinfer.http.oip``'s parser, so the
tensors, parameters, limits and refusals are that door's. Its turns run on the
HTTP door's peers (``counted.start``, ``counted.rejoin``) and answer with its
responses (``oip_routes.responses`` and ``whole``), written here as protobuf: a
``BYTES`` output as raw contents, each element its 4-byte length and its bytes,
which is what ``tritonclient``'s ``as_numpy`` reads. The API key is the
``authorization`` metadata, checked by ``Access.check`` as a request's headers.

Resuming a stream: a ``ModelStreamInfer`` request whose parameters name the
session (``wsinfer_session``, ``wsinfer_token``) and the events already received
(``wsinfer_received``) follows that session's latest turn after its N-th event,
the v2 stream's count. Every response's parameters carry those three (the count
once that response is received). The generated messages are
``grpc_predict_v2_pb2`` (from ``grpc_predict_v2.proto``, which says how).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from websockets.datastructures import Headers

from wsinfer import __version__
from wsinfer.access import Denied
from wsinfer.http import counted
from wsinfer.http.oip import BINARY_SIZE, OipError, OipRequest, OipTurn, parse_infer_request
from wsinfer.http.oip_routes import model_metadata, responses, served_model, unhealthy, whole
from wsinfer.preflight import StartupError

try:
    import grpc
    from grpc import aio

    from wsinfer import grpc_predict_v2_pb2 as pb
except ImportError as exc:  # an extra: only --grpc-port imports this module
    message = "--grpc-port needs grpcio and protobuf: pip install 'wsinfer-stream[grpc]'"
    raise StartupError(message) from exc

if TYPE_CHECKING:
    from wsinfer.http.host import RouteHost
    from wsinfer.http.peer import HttpPeer
    from wsinfer.services import FrontendServices

log = structlog.get_logger("wsinfer.grpc")

SERVICE = "inference.GRPCInferenceService"  # the protocol's name, whatever the proto package
# The request parameters that are the door's, not the turn's.
SESSION, TOKEN, RECEIVED = "wsinfer_session", "wsinfer_token", "wsinfer_received"
# Triton's client asks for a last response with no outputs; every stream here ends
# with the done's response (no text), marked final as Triton marks its own.
EMPTY_FINAL, FINAL = "triton_enable_empty_final_response", "triton_final_response"
OWN = frozenset({SESSION, TOKEN, RECEIVED, EMPTY_FINAL})
STREAM_BUFFER = 64  # responses held for a slow reader before its turns wait
# The REST door's statuses, as gRPC codes.
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def code_for(status: int) -> grpc.StatusCode:
    return CODES.get(status, grpc.StatusCode.INTERNAL)


# --- requests: protobuf to the REST door's body ---------------------------------------


def value_of(parameter: pb.InferParameter) -> Any:
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def set_value(parameter: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif value is not None:
        parameter.string_param = str(value)


@dataclass(frozen=True)
class Own:
    """The door's parameters of a request: whose session, and how far it was read."""

    session: str | None
    token: str | None
    received: int | None


def own_parameters(request: pb.ModelInferRequest) -> Own:
    values = {k: value_of(v) for k, v in request.parameters.items() if k in OWN}
    for name in (SESSION, TOKEN):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise OipError(400, f"{name} must be a string parameter")
    received = values.get(RECEIVED)
    if received is not None and (isinstance(received, bool) or not isinstance(received, int)):
        raise OipError(400, f"{RECEIVED} must be an integer parameter")
    if received is not None and received < 0:
        raise OipError(400, f"{RECEIVED} must be a non-negative integer")
    return Own(values.get(SESSION), values.get(TOKEN), received)


def as_body(request: pb.ModelInferRequest) -> tuple[bytes, str | None]:
    """The request as the REST door reads it: a JSON head, then raw contents as the
    binary tensor extension's bytes; the head's length when there are any."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise OipError(400, "raw_input_contents must hold one entry per input")
    head: dict[str, Any] = {
        "inputs": [_input(t, raw[i] if raw else None) for i, t in enumerate(request.inputs)]
    }
    if request.id:
        head["id"] = request.id
    parameters = {k: value_of(v) for k, v in request.parameters.items() if k not in OWN}
    if parameters:
        head["parameters"] = parameters
    if request.outputs:
        head["outputs"] = [_output(o) for o in request.outputs]
    encoded = json.dumps(head).encode()
    binary = b"".join(raw)
    return encoded + binary, (str(len(encoded)) if raw else None)


def _input(tensor: Any, raw: bytes | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype}
    entry["shape"] = list(tensor.shape)
    parameters = {k: value_of(v) for k, v in tensor.parameters.items()}
    contents = tensor.contents
    if any(
        len(getattr(contents, f.name))
        for f in contents.DESCRIPTOR.fields
        if f.name != "bytes_contents"
    ):
        raise OipError(400, f"{tensor.name}'s contents must be bytes_contents (a BYTES tensor)")
    if raw is not None:
        if contents.bytes_contents:
            raise OipError(400, "an input with raw_input_contents has no contents")
        parameters[BINARY_SIZE] = len(raw)
    else:
        try:
            entry["data"] = [element.decode() for element in contents.bytes_contents]
        except UnicodeDecodeError as exc:
            raise OipError(400, "an element is not UTF-8 text") from exc
    if parameters:
        entry["parameters"] = parameters
    return entry


def _output(output: Any) -> dict[str, Any]:
    parameters = {k: value_of(v) for k, v in output.parameters.items()}
    return {"name": output.name, **({"parameters": parameters} if parameters else {})}


# --- responses: the REST door's bodies as protobuf ------------------------------------


def as_response(body: dict[str, Any], extra: dict[str, Any]) -> pb.ModelInferResponse:
    """One of ``OipTurn``'s inference responses, its ``BYTES`` outputs as raw contents
    (each element: its 4-byte little-endian length, then its UTF-8 bytes)."""
    response = pb.ModelInferResponse(model_name=body["model_name"], id=body["id"])
    for key, value in {**body["parameters"], **extra}.items():
        set_value(response.parameters[key], value)
    for output in body["outputs"]:
        tensor = response.outputs.add(
            name=output["name"], datatype=output["datatype"], shape=output["shape"]
        )
        for key, value in output["parameters"].items():
            set_value(tensor.parameters[key], value)
        encoded = [text.encode() for text in output["data"]]
        response.raw_output_contents.append(
            b"".join(struct.pack("<I", len(e)) + e for e in encoded)
        )
    return response


def metadata_response(model: str) -> pb.ModelMetadataResponse:
    body = model_metadata(model)
    tensors = lambda entries: [  # noqa: E731
        pb.ModelMetadataResponse.TensorMetadata(
            name=t["name"], datatype=t["datatype"], shape=t["shape"]
        )
        for t in entries
    ]
    return pb.ModelMetadataResponse(
        name=body["name"],
        versions=body["versions"],
        platform=body["platform"],
        inputs=tensors(body["inputs"]),
        outputs=tensors(body["outputs"]),
    )


# --- the service ------------------------------------------------------------------------


class GrpcDoor:
    """The service's handlers, on the frontend's event loop and the HTTP door's peers."""

    def __init__(self, frontend: FrontendServices, app: RouteHost) -> None:
        self.frontend = frontend
        self.app = app
        self.server: aio.Server | None = None
        # The streams' tasks: the loop holds tasks weakly, and a stream's generator
        # that a cut finalizes must not take its cancelled tasks with it.
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; the port bound (``port`` 0: any free one)."""
        limit = self.frontend.config.max_frame_bytes  # the HTTP body limit
        server = aio.server(options=[("grpc.max_receive_message_length", limit)])
        server.add_generic_rpc_handlers((self._handlers(),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {address} for gRPC clients: {exc}") from None
        await server.start()
        self.server = server
        return bound

    async def stop(self) -> None:
        """Cut every call at once: a stream's client resumes by count, anywhere."""
        if self.server is not None:
            await self.server.stop(None)

    def _handlers(self) -> grpc.GenericRpcHandler:
        unary: dict[str, tuple[Callable[[Any, Headers], Awaitable[Any]], Any]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._answered(name, handler),
                request_deserializer=kind.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
            for name, (handler, kind) in unary.items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer,
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelStreamInferResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _answered(
        self, name: str, handler: Callable[[Any, Headers], Awaitable[Any]]
    ) -> Callable[[Any, aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        """``handler`` behind the API key; a refusal as the REST door's, in a gRPC code."""

        async def call(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            try:
                headers = self._authorized(context)
                return await handler(request, headers)
            except Denied as exc:
                self.frontend.refused(exc.code, path=f"grpc {name}")
                refused: counted.DoorError = OipError(exc.status, exc.message, exc.code)
            except Exception as exc:
                refused = counted.refusal(self.frontend, f"grpc {name}", exc, OipError)
            await context.abort(code_for(refused.status), refused.message)

        return call

    def _authorized(self, context: aio.ServicerContext[Any, Any]) -> Headers:
        """The call's metadata as a request's headers, checked as the HTTP door checks
        them: the API key is ``authorization: Bearer KEY``."""
        metadata: Iterable[tuple[str, Any]] = context.invocation_metadata() or ()
        headers = Headers([(k, v) for k, v in metadata if isinstance(v, str)])
        self.frontend.access.check(headers, "", needs_key=True)
        return headers

    # --- health and metadata ----------------------------------------------------------

    async def server_live(self, request: Any, headers: Headers) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, headers: Headers) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await unhealthy(self.frontend, headers) is None)

    async def model_ready(
        self, request: pb.ModelReadyRequest, headers: Headers
    ) -> pb.ModelReadyResponse:
        self._model(request.name, request.version)
        return pb.ModelReadyResponse(ready=await unhealthy(self.frontend, headers) is None)

    async def server_metadata(self, request: Any, headers: Headers) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="wsinfer", version=__version__, extensions=[])

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, headers: Headers
    ) -> pb.ModelMetadataResponse:
        return metadata_response(self._model(request.name, request.version))

    def _model(self, name: str, version: str) -> str:
        model = served_model(self.frontend, name)
        if version:
            raise OipError(404, f"model versions are not served (asked {version[:32]!r})")
        return model

    # --- turns ------------------------------------------------------------------------

    def _parse(self, request: pb.ModelInferRequest, own: Own) -> OipRequest:
        body, length = as_body(request)
        limits = self.frontend.config.limits
        return parse_infer_request(body, length, limits, own.session, own.token)

    async def model_infer(
        self, request: pb.ModelInferRequest, headers: Headers
    ) -> pb.ModelInferResponse:
        """One turn, answered whole."""
        model = self._model(request.model_name, request.model_version)
        own = own_parameters(request)
        if own.received is not None:
            raise OipError(400, f"a stream resumes ({RECEIVED}) on ModelStreamInfer only")
        ask = self._parse(request, own)
        peer, accepted = await counted.start(self.app, ask.generate)
        turn = OipTurn(model, accepted["session"], accepted["turn"], ask.id, ask.shape)
        try:
            body = await whole(peer, turn)
        finally:
            self.app.close_peer(peer)
        return as_response(body, {TOKEN: accepted["token"]})

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request a turn (or a resumed one) streamed on its own, its responses
        interleaved with the others' as they come; the call ends once the client has
        sent its last request and every turn has ended."""
        try:
            self._authorized(context)
        except Denied as exc:
            self.frontend.refused(exc.code, path="grpc ModelStreamInfer")
            await context.abort(code_for(exc.status), exc.message)
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(STREAM_BUFFER)
        turns: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in requests:
                    turns.add(self._task(self._streamed(request, out.put)))
                await asyncio.gather(*turns)
            except Exception as exc:  # the call broke under its requests: end it
                log.info("grpc stream ended", error=str(exc))
            await out.put(None)  # (not when cancelled: then no one reads it)

        reader = self._task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
        finally:  # the client went away: its turns go on unwatched, resumable
            for task in [reader, *turns]:
                task.cancel()

    def _task(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _streamed(
        self,
        request: pb.ModelInferRequest,
        put: Callable[[pb.ModelStreamInferResponse], Awaitable[None]],
    ) -> None:
        """One request of a stream: its turn's responses, or its refusal or failure as
        an ``error_message`` (the stream goes on, as Triton's does)."""
        head = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        try:
            error = await self._responses(request, put)
        except Exception as exc:
            error = counted.refusal(self.frontend, "grpc ModelStreamInfer", exc, OipError).message
        if error is not None:
            await put(pb.ModelStreamInferResponse(error_message=error, infer_response=head))

    async def _responses(
        self,
        request: pb.ModelInferRequest,
        put: Callable[[pb.ModelStreamInferResponse], Awaitable[None]],
    ) -> str | None:
        """The turn's responses, each with the door's parameters (the last marked
        final); the message of the failure that ended it, if one did."""
        peer, turn, token, count = await self._follow(request)
        names = {SESSION: turn.session, TOKEN: token}
        try:
            async for kind, number, body in responses(peer, turn, count):
                if kind == "error":
                    return str(body["error"])
                if kind in ("event", "done"):
                    extra = {**names, RECEIVED: number, **({FINAL: True} if kind == "done" else {})}
                    await put(pb.ModelStreamInferResponse(infer_response=as_response(body, extra)))
        finally:
            self.app.close_peer(peer)
        return None

    async def _follow(self, request: pb.ModelInferRequest) -> tuple[HttpPeer, OipTurn, str, int]:
        """A new turn (on a session named, its next one), or with ``wsinfer_received``
        the named session's latest turn after that many events."""
        model = self._model(request.model_name, request.model_version)
        own = own_parameters(request)
        if own.received is None:
            ask = self._parse(request, own)
            peer, accepted = await counted.start(self.app, ask.generate)
            turn = OipTurn(model, accepted["session"], accepted["turn"], ask.id, ask.shape)
            return peer, turn, accepted["token"], 0
        if not own.session or not own.token:
            raise OipError(400, f"a resume needs the {SESSION} and {TOKEN} parameters")
        # Inputs, if sent, are checked and give the responses their id and shape.
        checked = self._parse(request, Own(None, None, None)) if request.inputs else None
        peer, number = await counted.rejoin(
            self.app, own.session, own.token, own.received, OipError
        )
        request_id, shape = (checked.id, checked.shape) if checked else (request.id or None, [1])
        return peer, OipTurn(model, own.session, number, request_id, shape), own.token, own.received


async def serve_grpc(frontend: FrontendServices, app: RouteHost, host: str, port: int) -> GrpcDoor:
    """The door, listening (``server.py``'s one hook)."""
    door = GrpcDoor(frontend, app)
    bound = await door.start(host, port)
    log.info("grpc listening", host=host, port=bound)
    return door
