"""Both exception trees follow contract.ERROR_CLASSES: a code's family (the
request's fault or the service's) and whether a retry may help are said once."""

from __future__ import annotations

import pytest

from wsinfer import errors as server
from wsinfer.clients import errors as client
from wsinfer.contract import ERROR_CLASSES, ErrorCode, ErrorFault

SERVER_FAMILIES = {ErrorFault.REQUEST: server.ClientError, ErrorFault.SERVICE: server.ServerError}
CLIENT_FAMILIES = {ErrorFault.REQUEST: client.RequestError, ErrorFault.SERVICE: client.ServerError}


def _server_classes() -> dict[ErrorCode, type[server.WsinferError]]:
    found = [c for c in vars(server).values() if isinstance(c, type)]
    classes = [c for c in found if issubclass(c, server.WsinferError) and "code" in vars(c)]
    return {c.code: c for c in classes if c is not server.StoreUnavailable}


def test_every_code_has_a_class_on_both_sides() -> None:
    assert set(ERROR_CLASSES) == set(ErrorCode)
    assert set(_server_classes()) == set(ErrorCode)
    assert {client.error_from_wire({"code": c.value}).code for c in ErrorCode} == {
        c.value for c in ErrorCode
    }


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_sits_in_its_family_and_says_whether_to_retry(code: ErrorCode) -> None:
    kind = ERROR_CLASSES[code]
    raised_here = _server_classes()[code]("x")
    raised_there = client.error_from_wire({"code": code.value, "message": "x"})
    assert isinstance(raised_here, SERVER_FAMILIES[kind.fault])
    assert isinstance(raised_there, CLIENT_FAMILIES[kind.fault])
    assert raised_here.retryable is raised_there.retryable is kind.retryable
    assert raised_there.fault is kind.fault


def test_overloaded_is_the_services_doing_on_both_sides() -> None:
    # Once a ClientError on the server and a ServerError in the client.
    assert issubclass(server.Overloaded, server.ServerError)
    assert issubclass(client.Overloaded, client.ServerError)


def test_a_class_in_the_wrong_family_fails_when_it_is_defined() -> None:
    with pytest.raises(TypeError, match="overloaded is the service's fault"):

        class Wrong(server.ClientError):
            code = ErrorCode.OVERLOADED

    with pytest.raises(TypeError, match="not_found is the request's fault"):

        class AlsoWrong(client.ServerError):
            code = ErrorCode.NOT_FOUND.value


def test_the_clients_own_codes() -> None:
    assert client.ConnectionLost().retryable is True  # the turn may still run
    assert client.ClientClosed().retryable is False
    assert client.ConnectionLost().fault is None
    assert client.error_from_wire({"code": "from_a_newer_server"}).retryable is False
