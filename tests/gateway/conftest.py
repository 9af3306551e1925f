from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from tests.gateway.fake_kube_api import FakeKubeApi
from tests.gateway.fake_upstream import Handler, Server
from tests.prompt_normalizer.tiny_model import build_tiny_model
from tests.support.processes import running_emulator


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory for pools in tokenizer mode (`request_rig`)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        state = Server(0)

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            state.connections += 1
            try:
                await handler(reader, writer, state.connections)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()
                state.closed.set()

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        servers.append(server)
        state.port = server.sockets[0].getsockname()[1]
        return state

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    """A watched policy file, `round_robin` to start with (`test_policy_watch.write` edits it)."""
    from tests.gateway.test_policy_watch import write

    p = tmp_path / "policy.yaml"
    write(p, "policy: round_robin\nseed: 1\n")
    return p


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    """An emulated vLLM worker serving model `m` on 127.0.0.1, shared by a module's tests: its URL."""
    with running_emulator("--host", "127.0.0.1", "--model", "m") as url:
        yield url


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApi]:
    """A fake Kubernetes API server on loopback (token `tok-1`), for the discovery tests; lists it
    holds back (`hold_lists`) are let go before it stops."""
    api = FakeKubeApi(token="tok-1")
    await api.start()
    yield api
    api.release_lists()
    await api.stop()
