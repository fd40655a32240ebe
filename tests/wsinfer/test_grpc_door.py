"""The Open Inference Protocol v2 over gRPC on a real ``wsinfer serve --grpc-port``
(the fake model), driven by ``tritonclient.grpc``: health, readiness, metadata,
``infer`` with a BYTES input, and ``start_stream`` / ``async_stream_infer``
streaming, a stream cut and resumed by count over this door and over the REST
one; the API key as ``authorization`` metadata. Then, without sockets: the
messages against Triton's own generated ones, and the committed ``_pb2`` modules
against what their ``.proto`` compiles to."""

from __future__ import annotations

import importlib.metadata
import queue
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as triton_pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.ports import free_ports  # noqa: E402
from tests.stack import Stack, start_serve, stop_serve  # noqa: E402
from wsinfer import grpc_door  # noqa: E402
from wsinfer import grpc_predict_v2_pb2 as pb  # noqa: E402
from wsinfer.cli import _frontend_config, build_parser  # noqa: E402
from wsinfer.http.oip import OipError, parse_infer_request  # noqa: E402
from wsinfer.messages import Limits  # noqa: E402

KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}
RATE = 200  # tokens a second: a 60-token turn streams for 0.3 s, long enough to cut
PROMPT = "Once upon a time"
MODEL = "wsinfer"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(HTTP port, gRPC port) of one ``wsinfer serve``."""
    state: Path = tmp_path_factory.mktemp("serve")
    (grpc_port,) = free_ports(1)
    flags = ("--model", f"fake:{RATE}", "--api-key", KEY, "--grpc-port", str(grpc_port))
    process, port = start_serve(state, *flags)
    yield port, grpc_port
    assert stop_serve(process) == 0


@pytest.fixture
def client(ports: tuple[int, int]) -> Iterator[Any]:
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{ports[1]}")
    yield triton
    triton.close()


def prompt_input(prompt: str = PROMPT) -> Any:
    tensor = grpcclient.InferInput("prompt", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return tensor


def parameters_of(result: Any) -> dict[str, Any]:
    response = result.get_response()
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.parameters.items()}


def text_of(result: Any) -> str:
    return "".join(t.decode() for t in result.as_numpy("text_output").reshape(-1))


class Stream:
    """``start_stream``'s callback results, read back in order."""

    def __init__(self, client: Any, headers: dict[str, str]) -> None:
        self.client = client
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(
            lambda result, error: self.results.put((result, error)), headers=headers
        )

    def next(self) -> tuple[Any, Any]:
        return self.results.get(timeout=30)

    def until_final(self) -> list[Any]:
        out = []
        while True:
            result, error = self.next()
            assert error is None, error
            out.append(result)
            if parameters_of(result).get("triton_final_response"):
                return out


# --- tritonclient.grpc ------------------------------------------------------------------


@pytest.mark.slow
def test_health_metadata_and_the_key(client: Any) -> None:
    assert client.is_server_live(headers=dict(AUTH)) and client.is_server_ready(headers=dict(AUTH))
    assert client.is_model_ready(MODEL, headers=dict(AUTH))
    with pytest.raises(InferenceServerException, match="not found"):
        client.is_model_ready("gpt-4", headers=dict(AUTH))
    metadata = client.get_model_metadata(MODEL, headers=dict(AUTH), as_json=True)
    assert metadata["name"] == MODEL and metadata["platform"] == "wsinfer"
    assert {t["name"] for t in metadata["inputs"]} == {"messages", "prompt", "text_input"}
    assert metadata["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": ["-1"]}]
    server = client.get_server_metadata(headers=dict(AUTH), as_json=True)
    assert server["name"] == "wsinfer" and server["version"]
    with pytest.raises(InferenceServerException) as unserved:  # Triton's, not KServe's
        client.get_model_config(MODEL, headers=dict(AUTH))
    assert unserved.value.status() == "StatusCode.UNIMPLEMENTED"
    with pytest.raises(InferenceServerException, match="API key") as refused:
        client.is_server_live()
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException, match="API key"):
        client.is_server_live(headers={"authorization": "Bearer nope"})


@pytest.mark.slow
def test_infer_with_a_bytes_input_is_the_rest_doors_turn(
    client: Any, ports: tuple[int, int]
) -> None:
    parameters = {"max_tokens": 12, "temperature": 0}
    result = client.infer(MODEL, [prompt_input()], parameters=parameters, headers=dict(AUTH))
    text = text_of(result)
    names = parameters_of(result)
    assert text and names["finish_reason"] == "length" and names["completion_tokens"] == 12
    assert names["wsinfer_turn"] == 1 and names["wsinfer_token"]

    tensor = {"name": "prompt", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}
    rest: dict[str, Any] = {"inputs": [tensor], "parameters": parameters}
    answer = httpx.post(
        f"http://127.0.0.1:{ports[0]}/v2/models/{MODEL}/infer",
        json=rest,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert answer.json()["outputs"][0]["data"] == [text]  # greedy: the same turn's text

    # The session's next turn, named by the parameters the answer gave.
    more = {**parameters, "wsinfer_session": names["wsinfer_session"]}
    more["wsinfer_token"] = names["wsinfer_token"]
    second = client.infer(MODEL, [prompt_input(" and")], parameters=more, headers=dict(AUTH))
    assert parameters_of(second)["wsinfer_turn"] == 2

    with pytest.raises(InferenceServerException, match="temperature") as refused:
        client.infer(MODEL, [prompt_input()], parameters={"temperature": -1}, headers=dict(AUTH))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="not found"):
        client.infer("gpt-4", [prompt_input()], headers=dict(AUTH))
    with pytest.raises(InferenceServerException) as too_big:  # the HTTP body's limit
        client.infer(MODEL, [prompt_input("x" * (1 << 20))], headers=dict(AUTH))
    assert too_big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


@pytest.mark.slow
def test_a_stream_cut_resumes_by_count_here_and_over_rest(
    client: Any, ports: tuple[int, int]
) -> None:
    parameters = {"max_tokens": 60, "temperature": 0}
    whole = text_of(
        client.infer(MODEL, [prompt_input()], parameters=parameters, headers=dict(AUTH))
    )

    stream = Stream(client, dict(AUTH))
    client.async_stream_infer(MODEL, [prompt_input()], request_id="a", parameters=parameters)
    results = stream.until_final()
    assert all(r.get_response().id == "a" for r in results)
    assert "".join(text_of(r) for r in results) == whole
    assert [parameters_of(r)["wsinfer_received"] for r in results[:-1]] == list(
        range(1, len(results))
    )
    # A refused request is an error on the stream, which goes on.
    client.async_stream_infer(MODEL, [prompt_input()], parameters={"top_k": -1})
    result, error = stream.next()
    assert result is None and "top_k" in str(error)
    client.stop_stream()

    # Cut after 5 responses, then resume on a new stream by the count received.
    stream = Stream(client, dict(AUTH))
    client.async_stream_infer(MODEL, [prompt_input()], parameters=parameters)
    first = [stream.next()[0] for _ in range(5)]
    client.stop_stream(cancel_requests=True)
    names = parameters_of(first[-1])
    session, token = names["wsinfer_session"], names["wsinfer_token"]
    resume = {"wsinfer_session": session, "wsinfer_token": token, "wsinfer_received": 5}
    stream = Stream(client, dict(AUTH))
    client.async_stream_infer(MODEL, [], parameters=resume)
    rest = stream.until_final()
    client.stop_stream()
    assert "".join(text_of(r) for r in first + rest) == whole
    assert parameters_of(rest[0])["wsinfer_received"] == 6
    print(f"grpc resume: {len(first)} responses before the cut, {len(rest)} after")

    # The same count resumes the same turn over the REST door.
    headers = {"Authorization": f"Bearer {KEY}", "X-Wsinfer-Session": session}
    headers |= {"X-Wsinfer-Token": token, "Last-Event-ID": "5"}
    url = f"http://127.0.0.1:{ports[0]}/v2/models/{MODEL}/generate_stream"
    raw = httpx.post(url, headers=headers, timeout=30).text
    texts = re.findall(r'"data": \["((?:[^"\\]|\\.)*)"\]', raw)
    assert "".join(text_of(r) for r in first) + "".join(texts) == whole

    bad = Stream(client, dict(AUTH))
    client.async_stream_infer(MODEL, [], parameters={"wsinfer_received": 1})
    result, error = bad.next()
    assert result is None and "wsinfer_session" in str(error)
    client.stop_stream()


@pytest.mark.slow
def test_wsinfer_frontend_serves_it_too(stack: Stack) -> None:
    """``wsinfer frontend --grpc-port``: live at once, not ready until an engine is."""
    (grpc_port,) = free_ports(1)
    stack.start_frontend("--grpc-port", str(grpc_port))
    triton = grpcclient.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
    try:
        assert triton.is_server_live() and not triton.is_server_ready()
        assert not triton.is_model_ready(MODEL)
    finally:
        triton.close()


# --- the messages, without sockets ------------------------------------------------------


def test_the_flag_reaches_the_frontend_and_is_off_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for command in ("serve", "frontend"):
        args = build_parser().parse_args([command, "--grpc-port", "9001"])
        assert _frontend_config(args, "redis://x").grpc_port == 9001
        assert _frontend_config(build_parser().parse_args([command]), "").grpc_port is None
    monkeypatch.setenv("WSINFER_GRPC_PORT", "9002")
    assert _frontend_config(build_parser().parse_args(["frontend"]), "").grpc_port == 9002


def test_tritonclients_request_reads_as_the_rest_doors() -> None:
    request = triton_pb.ModelInferRequest(model_name=MODEL, id="r1")
    request.inputs.add(name="prompt", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(PROMPT).to_bytes(4, "little") + PROMPT.encode())
    request.parameters["max_tokens"].int64_param = 7
    request.parameters["temperature"].double_param = 0.5
    request.parameters["wsinfer_received"].int64_param = 3
    ours = pb.ModelInferRequest.FromString(request.SerializeToString())
    assert grpc_door.own_parameters(ours).received == 3
    body, length = grpc_door.as_body(ours)
    ask = parse_infer_request(body, length, Limits(), None, None)
    assert ask.generate.prompt == PROMPT and ask.id == "r1" and ask.shape == [1]
    assert ask.generate.params.max_new_tokens == 7 and ask.generate.params.temperature == 0.5

    listed = pb.ModelInferRequest(model_name=MODEL)
    listed.inputs.add(name="prompt", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        PROMPT.encode()
    )
    assert parse_infer_request(*grpc_door.as_body(listed), Limits(), None, None).generate.prompt
    for broken in (
        pb.ModelInferRequest(raw_input_contents=[b"x"]),  # raw contents with no input
        pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="prompt")]),
    ):
        with pytest.raises(OipError):
            body, length = grpc_door.as_body(broken)
            parse_infer_request(body, length, Limits(), None, None)


def test_responses_read_as_tritonclient_reads_them() -> None:
    body = {
        "model_name": MODEL,
        "id": "s-1",
        "parameters": {"wsinfer_session": "s", "wsinfer_turn": 1, "wsinfer_seq": 2},
        "outputs": [
            {
                "name": "text_output",
                "shape": [1],
                "datatype": "BYTES",
                "parameters": {"content_type": "str"},
                "data": ["héllo"],
            }
        ],
    }
    ours = grpc_door.as_response(body, {"wsinfer_received": 1, "triton_final_response": True})
    theirs = triton_pb.ModelInferResponse.FromString(ours.SerializeToString())
    result = grpcclient.InferResult(theirs)
    assert result.as_numpy("text_output").tolist() == ["héllo".encode()]
    assert theirs.parameters["wsinfer_seq"].int64_param == 2
    assert theirs.parameters["triton_final_response"].bool_param
    assert grpc_door.code_for(429).name == "RESOURCE_EXHAUSTED"
    assert grpc_door.code_for(500).name == "INTERNAL"


def test_the_generated_modules_are_current(tmp_path: Path) -> None:
    """``grpc_predict_v2_pb2`` is what the ``.proto`` compiles to: exactly, with the
    grpcio-tools its header names; the same descriptor, with another."""
    pytest.importorskip("grpc_tools")
    proto = ROOT / "wsinfer" / "grpc_predict_v2.proto"
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto.parent}"]
    command += [f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", str(proto)]
    subprocess.run(command, check=True)
    named = re.search(r"grpcio-tools\s+(\S+)", proto.read_text())
    assert named is not None, "the .proto's header names the grpcio-tools that compiled it"
    if importlib.metadata.version("grpcio-tools") == named.group(1):
        for name in ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2.pyi"):
            assert (tmp_path / name).read_text() == (proto.parent / name).read_text(), name
    else:
        fresh = (tmp_path / "grpc_predict_v2_pb2.py").read_text()
        serialized = re.search(r"AddSerializedFile\((b'.*')\)", fresh)
        assert serialized is not None
        assert eval(serialized.group(1)) == pb.DESCRIPTOR.serialized_pb  # noqa: S307
