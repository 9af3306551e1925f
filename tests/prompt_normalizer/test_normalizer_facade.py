from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import KeyIdentity


def _body(user: str) -> dict[str, object]:
    system = {"role": "system", "content": "s" * 400}
    return {"messages": [system, {"role": "user", "content": user}]}


def test_shared_prefix_shares_leading_keys_and_identity_separates() -> None:
    norm = Normalizer(NormalizerConfig(), secret=b"k")
    ident = KeyIdentity(model_id="m", namespace="t1")
    a = norm.canonicalize("chat", _body("hello"), ident)
    b = norm.canonicalize("chat", _body("other question"), ident)
    assert a.block_keys and a.block_keys[0] == b.block_keys[0]
    c = norm.canonicalize("chat", _body("hello"), KeyIdentity(model_id="m", namespace="t2"))
    assert not set(a.block_keys) & set(c.block_keys)
