"""What a redis+sentinel:// URL is and refuses, which link it opens, and how the sentinels are
asked (`gateway.sync.sentinel`): in turn, each within the timeout, the one that answered first
next time, every reply bounded; against loopback servers that play sentinels badly."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config.base import ConfigError
from gateway.config.sync import MAX_SENTINELS, HostPort, SyncConfig
from gateway.sync.link import open_link
from gateway.sync.redis_link import RedisLink
from gateway.sync.sentinel import MAX_REPLY_BYTES, SentinelError, SentinelRefused, Sentinels
from gateway.sync.sentinel_link import SentinelLink
from tests.e2e.harness import free_port
from tests.gateway.sync.sentinels import FakeSentinel

PRIMARY = HostPort("10.1.2.3", 6380)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h1:26379,h2:26379", "name the master the sentinels monitor after them"),
        ("redis+sentinel://h1:26379/", "name the master"),
        ("redis+sentinel://h1/mymaster/0", "one master name only.*not per database"),
        ("redis+sentinel://h1/mymaster?db=1", "one master name only"),
        ("redis+sentinel://:secret@h1/mymaster", r"sync\.auth, not in the URL"),
        ("redis+sentinel://h1,user:secret@h2/mymaster", r"sync\.auth, not in the URL"),
        ("redis+sentinel://h1/mymaster,nats://n:4222", "stands alone"),
        ("nats://n:4222,redis+sentinel://h1/mymaster", "stands alone"),
        ("redis://r:6379,redis+sentinel://h1/mymaster", "stands alone"),
        ("redis+sentinel://h1:99999/mymaster", "not a valid port in 'h1:99999'"),
        ("redis+sentinel://h1,,h2/mymaster", "no host in the sentinel ''"),
        ("redis+sentinel://h1,h1:26379/mymaster", "named twice"),
        ("redis+sentinel://" + ",".join(f"h{i}" for i in range(MAX_SENTINELS + 1)) + "/m", "at most 16"),
        ("sentinel://h1/mymaster", "should match pattern"),
    ],
)
def test_urls_refused_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(url=url)


def test_the_urls_it_takes() -> None:
    config = SyncConfig(url="redis+sentinel://s1:26380, s2 ,[::1]:5000/my-master.1")
    target = config.sentinel
    assert target is not None and config.broker == "redis" and not target.tls
    assert target.master == "my-master.1"
    assert target.sentinels == (HostPort("s1", 26380), HostPort("s2", 26379), HostPort("::1", 5000))
    assert config.urls == ["redis+sentinel://s1:26380, s2 ,[::1]:5000/my-master.1"]  # one URL
    tls = SyncConfig(url="rediss+sentinel://s1/m").sentinel
    assert tls is not None and tls.tls
    assert SyncConfig(url="redis://r:6379").sentinel is None


def test_sentinel_auth_goes_with_a_sentinel_url_only() -> None:
    with pytest.raises(ValueError, match="sentinel_auth is the sentinels' own password"):
        SyncConfig(url="redis://r:6379", sentinel_auth={"token_env": "X"})
    with pytest.raises(ValueError, match="set token_file or token_env, not both"):
        SyncConfig(url="redis+sentinel://s/m", sentinel_auth={"token_env": "X", "token_file": "/f"})


def test_the_link_a_sentinel_url_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    async def ignore(data: bytes) -> None:
        return None

    monkeypatch.setenv("S_PASSWORD", "sentinel-secret")
    config = SyncConfig(
        url="redis+sentinel://127.0.0.1:9/m", sentinel_auth={"user": "watcher", "password_env": "S_PASSWORD"}
    )
    link = open_link(config, "me", ignore)
    assert isinstance(link, SentinelLink) and link.sentinels.master == "m"
    assert link.sentinels._username == "watcher" and link.sentinels._password == "sentinel-secret"
    assert type(open_link(SyncConfig(url="redis://127.0.0.1:9"), "me", ignore)) is RedisLink
    monkeypatch.delenv("S_PASSWORD")
    with pytest.raises(
        ConfigError, match=r"sync\.sentinel_auth\.password_env: environment variable S_PASSWORD"
    ):
        open_link(config, "me", ignore)


async def test_each_sentinel_is_asked_in_turn_within_the_timeout_and_the_answer_is_checked() -> None:
    dead = HostPort("127.0.0.1", free_port())
    huge = b"*2\r\n$%d\r\n" % (MAX_REPLY_BYTES + 1) + b"x" * (MAX_REPLY_BYTES + 3)
    async with (
        FakeSentinel(None) as silent,
        FakeSentinel(huge) as flooding,
        FakeSentinel(b"*-1\r\n") as other_masters,
        FakeSentinel(b"*2\r\n$3\r\nabc\r\n$5\r\nhello\r\n") as nonsense,
        FakeSentinel(PRIMARY) as good,
    ):
        ports = [silent.port, flooding.port, other_masters.port, nonsense.port, good.port]
        order = [dead, *(HostPort("127.0.0.1", p) for p in ports)]
        sentinels = Sentinels(order, "m", timeout_s=0.3)
        # The silent one costs one timeout (0.3 s); one that held the question would hang here.
        assert await asyncio.wait_for(sentinels.master_address(), 10) == PRIMARY
        assert silent.questions == 1 and good.questions == 1
        # The one that answered is asked first next time, on the connection it answered on.
        assert await sentinels.master_address() == PRIMARY
        assert good.questions == 2 and silent.questions == 1
        good.answer = None  # now it is silent too: every failure is named
        with pytest.raises(SentinelError) as failure:
            await sentinels.master_address()
        text = str(failure.value)
        assert f"127.0.0.1:{dead.port}: " in text and "no answer in time" in text
        assert f"a reply string of {MAX_REPLY_BYTES + 1} bytes" in text
        assert "does not monitor a master named 'm'" in text
        assert "answered something other than an address" in text
        sentinels.close()


async def test_a_refusal_of_the_credentials_is_told_apart() -> None:
    async with (
        FakeSentinel(b"-NOAUTH Authentication required.\r\n") as needs_password,
        FakeSentinel(b"-WRONGPASS invalid username-password pair\r\n") as wrong,
    ):
        anonymous = Sentinels([HostPort("127.0.0.1", needs_password.port)], "m", timeout_s=1)
        with pytest.raises(SentinelRefused, match="NOAUTH"):
            await anonymous.master_address()
        given = Sentinels([HostPort("127.0.0.1", wrong.port)], "m", timeout_s=1, password="pw")
        with pytest.raises(SentinelRefused, match=r"sync\.sentinel_auth") as refusal:
            await given.master_address()
        assert "pw" not in str(refusal.value)
        # One that refuses and one that cannot be reached: not only a refusal.
        mixed = Sentinels(
            [HostPort("127.0.0.1", wrong.port), HostPort("127.0.0.1", free_port())], "m", timeout_s=1
        )
        with pytest.raises(SentinelError) as either:
            await mixed.master_address()
        assert not isinstance(either.value, SentinelRefused)
