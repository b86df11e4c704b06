"""Host collectives as a one-instance job (no mpiexec, no MPI), and the pure parts of the agreement."""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import sys
import threading

import numpy as np
import pytest

import popdist_py
from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py import agreement, deadline, failsafe

pytestmark = pytest.mark.skipif(
    any(k.startswith(("PMI_", "OMPI_COMM_WORLD")) for k in os.environ),
    reason="run without mpiexec: these tests are about the one-instance job",
)


@pytest.fixture(autouse=True)
def _no_popdist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("POPDIST_"):
            monkeypatch.delenv(name)


def test_one_instance_collectives_return_copies_without_mpi() -> None:
    x = np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]
    for op in ("sum", "mean", "min", "max", "prod"):
        out = popdist_py.allreduce(x, op=op)
        assert out.dtype == np.int16 and np.array_equal(out, x) and not np.shares_memory(out, x)
    gathered = popdist_py.allgather(x)
    assert gathered.shape == (1, 2, 2) and np.array_equal(gathered[0], x)
    b = popdist_py.broadcast(x, root=0)
    assert np.array_equal(b, x) and not np.shares_memory(b, x)
    popdist_py.barrier()
    popdist_py.synchronize()
    popdist_py.init()
    assert popdist_py.execute_on_instances({0}, lambda a, b=1: a + b, 1, b=2) == 3
    assert "mpi4py.MPI" not in sys.modules or not popdist_py.isBackendInitialized()


def test_one_instance_argument_errors() -> None:
    with pytest.raises(ValueError, match="invalid instance indices \\[1\\]: valid instances are 0"):
        popdist_py.execute_on_instances({0, 1}, print)
    with pytest.raises(ValueError, match="root=1 is not a valid instance: valid instances are 0"):
        popdist_py.broadcast(np.ones(1), root=1)
    with pytest.raises(TypeError, match=r"expected a numpy array, got float 1\.0"):
        popdist_py.allreduce(1.0)
    with pytest.raises(ValueError, match="op='MEDIAN' is not valid"):
        popdist_py.allreduce(np.ones(1), op="MEDIAN")
    with pytest.raises(TypeError, match="complex"):
        popdist_py.allreduce(np.ones(1, dtype=complex), op="max")


def test_collective_timeout_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COLLECTIVE_TIMEOUT, raising=False)
    assert deadline.collective_timeout() == deadline.DEFAULT_TIMEOUT == 600
    assert deadline.collective_timeout(2) == 2.0
    assert deadline.collective_timeout(0.25) == 0.25  # under a second is still a timeout
    monkeypatch.setenv(COLLECTIVE_TIMEOUT, " 1.5 ")
    assert deadline.collective_timeout() == 1.5
    assert deadline.collective_timeout(3) == 3.0
    monkeypatch.setenv(COLLECTIVE_TIMEOUT, "inf")
    assert math.isinf(deadline.collective_timeout())
    for bad in ("abc", "0", "-2", "nan"):
        monkeypatch.setenv(COLLECTIVE_TIMEOUT, bad)
        with pytest.raises(ValueError, match=f"POPDIST_COLLECTIVE_TIMEOUT='{bad}'"):
            deadline.collective_timeout()
    for wrong in (0, -1.0, "x", True, float("nan")):
        with pytest.raises(ValueError, match="timeout="):
            deadline.collective_timeout(wrong)  # type: ignore[arg-type]  # a caller's wrong type, refused


def test_mismatch_messages() -> None:
    d = lambda r: f"instance {r}"  # noqa: E731
    message = agreement.mismatch_message(
        "allreduce", [0, 1, 2], [("allreduce", ("sum", (3, 4), "f")), ("allreduce", ("sum", (4,), "f")),
                                 ("allreduce", ("sum", (3, 4), "f"))], d, ("op", "shape", "dtype"))
    assert message == ("allreduce: shapes differ between instances: "
                       "instance 0 (3, 4), instance 1 (4,), instance 2 (3, 4)")
    message = agreement.mismatch_message("x", [0, 3], [("x", (1,)), ("x", (1, 2))], d, ("a",))
    assert message == "x: signatures differ between instances: instance 0 (1,), instance 3 (1, 2)"
    # A field's note follows it when it differs, and only then.
    message = agreement.mismatch_message("x", [0, 1], [("x", (1, 7)), ("x", (2, 7))], d, ("a", "b"),
                                         {"a": "why a", "b": "why b"})
    assert message == "x: as differ between instances: instance 0 1, instance 1 2 (why a)"


def test_mismatch_messages_name_each_field_that_differs() -> None:
    d = lambda r: f"replica {r}"  # noqa: E731
    # Different collectives: listed per instance, even when two of three agree.
    message = agreement.mismatch_message("x", [0, 1, 2], [("allreduce", ()), ("allreduce", ()), ("broadcast", ())],
                                         d, None)
    assert message == ("x: instances are in different collectives: replica 0 allreduce, replica 1 allreduce, "
                       "replica 2 broadcast")
    # Mappings with the same keys: each differing field, plural once, strings shown as they are.
    message = agreement.mismatch_message(
        "x", [4, 5], [("x", {"shape": (2,), "dtype": "int8", "groups": 1}),
                      ("x", {"shape": (2,), "dtype": "int16", "groups": 2})], d, None)
    assert message == ("x: dtypes differ between instances: replica 4 int8, replica 5 int16; "
                       "groups differ between instances: replica 4 1, replica 5 2")
    # Values other than strings are shown by their repr.
    message = agreement.mismatch_message("x", [0, 1], [("x", {"dtype": np.dtype("float32")}),
                                                       ("x", {"dtype": np.dtype("int8")})], d, None)
    assert message == "x: dtypes differ between instances: replica 0 dtype('float32'), replica 1 dtype('int8')"
    # Mappings with other keys cannot be compared field by field.
    message = agreement.mismatch_message("x", [0, 1], [("x", {"a": 1}), ("x", {"b": 1})], d, None)
    assert message == "x: signatures differ between instances: replica 0 {'a': 1}, replica 1 {'b': 1}"


def test_encoding_is_fixed_size_and_round_trips() -> None:
    small = agreement.encode_signature("allreduce", ("sum", (3, 4), "float32"))
    large = agreement.encode_signature("allreduce", ("x" * 5000,))
    assert len(small) == len(large) == agreement.SLOT
    assert agreement.decode_signature(bytes(small)) == ("allreduce", ("sum", (3, 4), "float32"))
    what, opaque = agreement.decode_signature(bytes(large))
    assert what == "allreduce" and "..." in opaque and "#" in opaque
    assert repr((opaque,)) == f"({opaque},)"  # shown inside other values as it is, without quotes
    assert agreement.encode_signature("a", ("x" * 5000,)) != agreement.encode_signature("a", ("x" * 4999 + "y",))


def slot(payload: bytes) -> bytes:
    """One signature as it travels: the payload's length (4 bytes, little-endian), the payload, zeros."""
    return len(payload).to_bytes(4, "little") + payload + bytes(agreement.SLOT - 4 - len(payload))


def test_a_signature_travels_as_its_length_then_its_pickle() -> None:
    """Every instance encodes with the same pickle protocol, whatever its Python's default, so that
    equal signatures are equal bytes and agree without being decoded."""
    signature = ("sum", (3, 4), "float32")
    assert bytes(agreement.encode_signature("allreduce", signature)) == slot(
        pickle.dumps(("allreduce", signature), protocol=5))


def test_a_payload_that_just_fits_is_sent_whole_and_one_byte_more_is_shortened() -> None:
    sizes = {len(pickle.dumps(("x", ("y" * n,)), protocol=5)): n for n in range(agreement.SLOT)}
    fits = "y" * sizes[agreement.SLOT - 4]  # a payload of exactly the slot's room
    assert agreement.decode_signature(bytes(agreement.encode_signature("x", (fits,)))) == ("x", (fits,))
    longer = (fits + "y",)
    assert bytes(agreement.encode_signature("x", longer)) == shortened("x", repr(longer))


def shortened(what: str, text: str) -> bytes:
    """The slot of a signature too long to send whole, whose repr is ``text``: its head and tail
    (SLOT // 5 characters each, all of it when that is no longer) and a 16-byte digest of all of it."""
    keep = agreement.SLOT // 5
    short = text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return slot(pickle.dumps((what[:keep], agreement.Opaque(f"{short} #{digest}")), protocol=5))


def test_a_long_signature_is_sent_as_its_head_tail_and_digest() -> None:
    signature = (("x" * 300 + "y" * 300),)
    encoded = bytes(agreement.encode_signature("w" * 300, signature))
    assert encoded == shortened("w" * 300, repr(signature))
    keep = agreement.SLOT // 5
    what, opaque = agreement.decode_signature(encoded)
    assert what == "w" * keep and opaque.startswith(repr(signature)[:keep] + "...")


class Unpicklable:
    """A signature value that cannot be pickled (a local object), with a repr of a chosen length."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return "u" * self.length


@pytest.mark.parametrize("length", [10, 2 * (agreement.SLOT // 5), 2 * (agreement.SLOT // 5) + 1])
def test_a_signature_that_cannot_be_pickled_is_sent_as_its_repr(length: int) -> None:
    """Whole while the repr is at most twice the head's length; cut to head and tail beyond."""
    value = Unpicklable(length)
    encoded = bytes(agreement.encode_signature("x", value))
    assert encoded == shortened("x", "u" * length)


def test_exit_status_follows_python() -> None:
    assert [failsafe.exit_status(c) for c in (None, 0, 3, 256 + 4, -1, True, "message")] == [0, 0, 3, 4, 255, 1, 1]
