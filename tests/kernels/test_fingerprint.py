"""``safesparse.kernels.native.fingerprint`` (csrc/fingerprint.h): what the eager plans of
``safesparse.nn`` compare before they read a copy of a layer's values. Claims: it depends on the
bytes only (not the tensor, its dtype or its alignment), and a change of any one word, of the
tail bytes past the last 64-byte run, of signs in pairs, or an exchange of two words, changes it."""

from __future__ import annotations

import pytest
import torch

from safesparse.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels")


def fp(t: torch.Tensor) -> int:
    return native.fingerprint(t)


@pytest.mark.parametrize("n", [0, 1, 3, 15, 16, 17, 63, 64, 65, 1000, 4099])
def test_every_word_and_byte_counts(n: int) -> None:
    torch.manual_seed(n)
    t = torch.randn(n)
    base = fp(t)
    assert fp(t.clone()) == base  # (the bytes, not the object)
    for i in range(n):
        u = t.clone()
        u.view(torch.int32)[i] ^= 1 << (i % 32)
        assert fp(u) != base, i
    b = torch.randint(0, 256, (n * 4 + 3,), dtype=torch.uint8)
    for i in range(b.numel()):  # (the bytes past the last whole run of 16 words too)
        c = b.clone()
        c[i] ^= 0x80
        assert fp(c) != fp(b), i


def test_structured_changes() -> None:
    torch.manual_seed(0)
    t = torch.randn(4096)
    base = fp(t)
    for change in (lambda u: u.neg_(), lambda u: u.mul_(2), lambda u: u.add_(1e-30),
                   lambda u: u[::2].neg_(), lambda u: u[[5, 5 + 32]].neg_(),
                   lambda u: u.copy_(u.flip(0)), lambda u: u.zero_()):
        u = t.clone()
        change(u)
        if not torch.equal(u, t):
            assert fp(u) != base
    u = t.clone()
    u[7], u[7 + 16 * 4] = t[7 + 16 * 4], t[7]  # (two words of one lane exchanged)
    assert fp(u) != base
    u = t.clone()
    u[[1, 33]] = -u[[1, 33]]  # (two sign flips in one lane)
    assert fp(u) != base


def test_bytes_not_alignment_or_dtype() -> None:
    raw = torch.randint(0, 256, (4 * 257 + 2,), dtype=torch.uint8)
    shifted = torch.empty(raw.numel() + 2, dtype=torch.uint8)[2:]  # (2-byte aligned)
    shifted.copy_(raw)
    assert shifted.data_ptr() % 4 == 2
    assert fp(shifted) == fp(raw)
    assert fp(raw[:1028].view(torch.float32)) == fp(raw[:1028])
    half = torch.randn(300, dtype=torch.bfloat16)
    assert fp(half) == fp(half.view(torch.int16))


def test_without_the_library_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLibrary:
        native = False

        def describe(self) -> str:
            return "torch ops (no library here)"

    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "status", NoLibrary)
    with pytest.raises(RuntimeError, match="no native library, so no fingerprint: torch ops"):
        native.fingerprint(torch.ones(4))
