"""Fixtures: real retryd servers started from $RETRYD_BIN on loopback ports."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from support import CLIENT_TEST_CONFIG, VECTORS, Server, start_server, stop_server


@pytest.fixture(scope="session")
def vectors() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(VECTORS.read_text())
    return loaded


@pytest.fixture(scope="session")
def conformance_server(vectors: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from retryd import Client

    server = start_server(vectors["config"], tmp_path_factory.mktemp("conformance"))
    with Client(server.grpc, timeout=5, fallback=None) as admin:
        for upstream in vectors.get("disable_upstreams", []):
            admin.set_retries_enabled(upstream, False, "conformance vectors")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(CLIENT_TEST_CONFIG, tmp_path_factory.mktemp("retryd"))
    yield started
    stop_server(started)
