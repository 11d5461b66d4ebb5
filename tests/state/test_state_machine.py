"""A stateful property test of the checked state: checked means valid, after any sequence.

Random sequences of builds, rebuilds on handed-out members, builds on overlapping views of
live index memory (a batch of one on the same storage, a COO on a prefix of an edge list),
transposes, values-only ops, index-building ops, any tensor (valid or not) into a kernel (the
guard refuses invalid data), builds on a second storage over the same memory
(``torch.from_numpy`` twice), tensors loaded from files that are then rewritten in place,
in-place writes through every alias safesparse hands out (also
through torch's aten accessors) or was given, ``del`` + ``gc.collect()`` and debug mode
on/off. After every step, for every live tensor: ``ss.is_checked(t)`` implies that torch's own
checker accepts clones of its current members.

Steps run torch kernels only on tensors the oracle says are valid (a kernel on invalid index
data may crash the process; that safesparse never lets such a tensor report checked is what
the invariant checks). CI runs a few hundred steps; ``HYPOTHESIS_PROFILE=thorough`` runs
20,000 (400 sequences of 50 steps).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.oracle import really_valid

import safesparse as ss
from safesparse.state import checked

SIZE = (4, 4)
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


DENSE = torch.tensor([[1.0, 0, 2, 0], [0, 0, 3, 0], [4, 5, 0, 0], [0, 0, 0, 6]])


class CheckedMeansValid(RuleBasedStateMachine):
    """Tensors and aliases live in plain lists (a hypothesis Bundle would keep every value
    alive, and ``drop`` must really free them)."""

    def __init__(self) -> None:
        super().__init__()
        ss.clear_cache()
        ss.set_debug(False)
        self.tmp = tempfile.mkdtemp(prefix="ss-state-machine-")
        self.files = 0
        self.live: list[torch.Tensor] = []  # SafeSparseTensors
        self.handles: list[torch.Tensor] = []  # index tensors given or handed out, and views

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        self.live.append(t)
        return t

    @initialize(layouts=st.lists(st.sampled_from(["csr", "csc", "coo", "bsr"]), min_size=3,
                                 max_size=3), checks=st.lists(st.booleans(), min_size=3,
                                                              max_size=3))
    def start(self, layouts: list[str], checks: list[bool]) -> None:
        for layout, check in zip(layouts, checks, strict=True):
            self.build(layout, check)

    @rule(data=st.data(), n=st.integers(1, 12))
    def twins(self, data: st.DataObject, n: int) -> None:
        """Unchecked twins on a tensor's members, dropped at once: exercises the pruning of
        watches (and the reuse of their owners' ids)."""
        t = self._pick(data)
        if t is None or t.layout == torch.sparse_coo or (ss.is_debug() and not really_valid(t)):
            return  # (debug mode validates every build, check_invariants=False included)
        c, p = checked.index_members(t)
        for _ in range(n):
            ss.sparse_compressed_tensor(c, p, t.values().detach(), t.shape, layout=t.layout,
                                        check_invariants=False)
        gc.collect()

    def _pick(self, data: st.DataObject) -> torch.Tensor | None:
        return data.draw(st.sampled_from(self.live)) if self.live else None

    # -- builds ----------------------------------------------------------------------------

    @rule(layout=st.sampled_from(["csr", "csc", "coo", "bsr"]), check=st.booleans())
    def build(self, layout: str, check: bool) -> None:
        if layout == "coo":
            idx = DENSE.nonzero().t().contiguous()
            values = DENSE[idx[0], idx[1]]
            t = ss.sparse_coo_tensor(idx, values, SIZE, check_invariants=check)
            self.handles.append(idx)
        else:
            ref = {"csr": DENSE.to_sparse_csr, "csc": DENSE.to_sparse_csc,
                   "bsr": lambda: DENSE.to_sparse_bsr((2, 2))}[layout]()
            c, p = checked.index_members(ref)
            c, p = c.clone(), p.clone()
            lay = ref.layout
            t = ss.sparse_compressed_tensor(c, p, ref.values().clone(), SIZE, layout=lay,
                                            check_invariants=check)
            self.handles += [c, p]
        assert ss.is_checked(t) == (check or ss.is_debug())  # debug validates every build
        self._keep(t)

    @rule(data=st.data(), check=st.booleans())
    def rebuild(self, data: st.DataObject, check: bool) -> None:
        t = self._pick(data)
        if t is None:
            return
        check = check or ss.is_debug()  # debug mode validates every build
        if t.layout == torch.sparse_coo:
            idx = t._indices()
            self.handles.append(idx)
            values = torch.ones(idx.shape[1])
            if check and not really_valid(t):
                try:
                    ss.sparse_coo_tensor(idx, values, t.shape)
                except ss.InvariantError:
                    return
                raise AssertionError("an invalid rebuild was accepted")
            out = ss.sparse_coo_tensor(idx, values, t.shape, check_invariants=check)
        else:
            c, p = checked.index_members(t)
            c, p = (t.crow_indices(), t.col_indices()) if t.layout in (
                torch.sparse_csr, torch.sparse_bsr) else (t.ccol_indices(), t.row_indices())
            self.handles += [c, p]
            values = t.values().detach().clone() + 1
            if check and not really_valid(t):
                try:
                    ss.sparse_compressed_tensor(c, p, values, t.shape, layout=t.layout)
                except ss.InvariantError:
                    return
                raise AssertionError("an invalid rebuild was accepted")
            out = ss.sparse_compressed_tensor(c, p, values, t.shape, layout=t.layout,
                                              check_invariants=check)
        self._keep(out)

    # -- ops -------------------------------------------------------------------------------

    @rule(data=st.data())
    def transpose(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is None:
            return
        if not really_valid(t):
            try:  # the guard (debug mode too) validates every input first
                t.mT  # noqa: B018
            except ss.InvariantError:
                return
            raise AssertionError("the guard let an invalid input through")
        self._keep(t.transpose(-2, -1) if t.layout == torch.sparse_coo else t.mT)

    @rule(data=st.data(), op=st.sampled_from(["mul", "sin", "clone", "double", "neg",
                                               "detach"]))
    def values_op(self, data: st.DataObject, op: str) -> None:
        t = self._pick(data)
        if t is None or not really_valid(t):
            return
        fn = {"mul": lambda x: x * 2, "sin": torch.sin, "clone": torch.clone,
              "double": lambda x: x.double(), "neg": lambda x: -x,
              "detach": lambda x: x.detach()}[op]
        self._keep(fn(t))

    @rule(data=st.data(), op=st.sampled_from(["coalesce", "to_coo", "to_csr", "add",
                                               "matmul", "add_plain"]))
    def index_op(self, data: st.DataObject, op: str) -> None:
        t = self._pick(data)
        if t is None or not really_valid(t) or (op == "matmul" and t.layout not in (
                torch.sparse_csr, torch.sparse_coo)):
            return
        if op in ("coalesce", "add_plain") and t.layout != torch.sparse_coo:
            return
        if op == "to_csr" and t.layout in (torch.sparse_bsr, torch.sparse_bsc):
            return
        if op in ("matmul", "to_csr") and t.dim() != 2:  # (a batch from overlapping_build)
            return
        if op == "add_plain":  # a plain operand, valid or not: validated first (the guard)
            bad = data.draw(st.booleans())
            idx = torch.tensor([[0], [10**9 if bad else 0]])
            plain = torch.sparse_coo_tensor(idx, torch.ones(1), SIZE, check_invariants=False)
            try:
                out = t + plain
            except ss.InvariantError:
                assert bad
                return
            assert not bad
            assert ss.is_checked(out)  # torch built its indices: validated
            self._keep(out)
            return
        fn = {"coalesce": lambda x: x.coalesce(), "to_coo": lambda x: x.to_sparse_coo(),
              "to_csr": lambda x: x.to_sparse_csr(), "add": lambda x: x + x,
              "matmul": lambda x: x @ x}[op]
        out = fn(t)
        assert not ss.is_checked(t) or ss.is_checked(out)
        self._keep(out)

    @rule(data=st.data())
    def inplace_values_op(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is not None and really_valid(t):
            t.mul_(2)

    @rule(data=st.data())
    def validate(self, data: st.DataObject) -> None:
        t = self._pick(data)
        if t is None:
            return
        if not really_valid(t):
            try:
                ss.validate(t)
            except ss.InvariantError:
                return
            raise AssertionError("validate accepted invalid index data")
        assert ss.is_checked(ss.validate(t))

    # -- aliases and writes ----------------------------------------------------------------

    @rule(data=st.data(), which=st.integers(0, 1))
    def hand_out(self, data: st.DataObject, which: int) -> None:
        t = self._pick(data)
        if t is None:
            return
        if t.layout == torch.sparse_coo:
            a = t.indices() if which and t.is_coalesced() else t._indices()
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            a = t.crow_indices() if which else t.col_indices()
        else:
            a = t.ccol_indices() if which else t.row_indices()
        self.handles.append(a)

    @rule(data=st.data(), which=st.integers(0, 1))
    def aten_hand_out(self, data: st.DataObject, which: int) -> None:
        """A member taken through torch's aten overloads (what decompositions call)."""
        t = self._pick(data)
        if t is None:
            return
        aten = torch.ops.aten
        if t.layout == torch.sparse_coo:
            a = aten.indices(t) if which and t.is_coalesced() else aten._indices(t)
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            a = aten.crow_indices(t) if which else aten.col_indices(t)
        else:
            a = aten.ccol_indices(t) if which else aten.row_indices(t)
        self.handles.append(a)

    @rule(data=st.data(), check=st.booleans(), k=st.integers(0, 6))
    def overlapping_build(self, data: st.DataObject, check: bool, k: int) -> None:
        """A tensor on another view of a live tensor's index memory: a batch of one on the
        same storage (two shapes), or a COO on a prefix of its indices (an edge list)."""
        t = self._pick(data)
        if t is None:
            return
        check = check or ss.is_debug()
        with torch._C.DisableTorchFunctionSubclass():
            members = checked.index_members(t)
            values = t.values() if t.layout != torch.sparse_coo else t._values()
        if t.layout == torch.sparse_coo:
            idx = members[0][:, :k]
            self.handles.append(idx)
            build = lambda: ss.sparse_coo_tensor(  # noqa: E731
                idx, values.detach()[:idx.shape[1]].clone(), t.shape, check_invariants=check)
        else:
            c, p = (m.unsqueeze(0) for m in members)
            self.handles += [c, p]
            build = lambda: ss.sparse_compressed_tensor(  # noqa: E731
                c, p, values.detach().unsqueeze(0).clone(), (1, *t.shape), layout=t.layout,
                check_invariants=check)
        try:
            out = build()
        except ss.InvariantError:
            assert check and not really_valid(t)
            return
        self._keep(out)

    @rule(data=st.data())
    def guarded_op(self, data: st.DataObject) -> None:
        """Any live tensor, valid or not, into a kernel: the guard refuses invalid data
        (a kernel reading it could crash the process)."""
        t = self._pick(data)
        if t is None:
            return
        valid = really_valid(t)
        try:
            t.to_dense()  # (any layout, batched too)
        except ss.InvariantError:
            assert not valid
            return
        assert valid and ss.is_checked(t)

    @rule(data=st.data())
    def view_of_alias(self, data: st.DataObject) -> None:
        if self.handles:
            self.handles.append(data.draw(st.sampled_from(self.handles))[..., :])

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """Write through any alias: one safesparse handed out, or an index tensor it was
        given (valid or not; no kernel reads it unless the oracle says it is valid)."""
        pool = [a for a in self.handles if a.numel()]
        if not pool:
            return
        a = data.draw(st.sampled_from(pool))
        pos = data.draw(st.integers(0, a.numel() - 1))
        value = data.draw(st.integers(-1, 6))
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), a.shape))
        a[where] = value

    @rule(data=st.data(), how=st.sampled_from(["shrink", "move", "refill", "empty"]))
    def assign_data(self, data: st.DataObject, how: str) -> None:
        """``.data =`` on an index tensor (one given to a factory, or handed out): it keeps its
        object and counter, while its shape, strides or memory change (``nn.Module._apply``
        does this). No tensor built on it may become checked and invalid."""
        pool = [a for a in self.handles if a.dim() >= 1 and a.shape[-1] and not a.is_inference()]
        if not pool:
            return
        a = data.draw(st.sampled_from(pool))
        if how == "shrink":
            a.data = a[..., :1]
        elif how == "move":
            a.data = a.clone()
        elif how == "refill":  # other memory, same shape, values that may be invalid
            a.data = torch.full_like(a, data.draw(st.integers(-1, 6)))
        else:  # emptied: its memory may be freed and reused by the next allocation
            a.data = a[..., :0].clone()
            a.data = torch.full((*a.shape[:-1], 3), 1, dtype=a.dtype)

    @rule(data=st.data(), which=st.integers(0, 1), shrink=st.booleans())
    def rebuild_after_assign(self, data: st.DataObject, which: int, shrink: bool) -> None:
        """A rebuild on members a checked tensor handed out, one of them changed by ``.data =``
        first: refused (the members are not the proven ones), or checked and valid."""
        t = self._pick(data)
        if t is None or t.layout == torch.sparse_coo:
            return
        members = list(checked.index_members(t))
        m = members[which]
        if not m.shape[-1]:
            return
        m.data = m[..., :1] if shrink else torch.full_like(m, 5)
        self.handles += members
        try:
            out = ss.sparse_compressed_tensor(*members, t.values().detach().clone(), t.shape,
                                              layout=t.layout)
        except ss.InvariantError:
            return
        self._keep(out)

    @rule(data=st.data(), check=st.booleans())
    def second_storage(self, data: st.DataObject, check: bool) -> None:
        """A tensor built on another storage over the same memory (``torch.from_numpy`` of a
        NumPy view, as a SciPy matrix's ``indices`` or a dataset's ``edge_index`` give): it
        shares one state with every tensor on that memory."""
        pool = [h for h in self.handles if h.dim() == 1 and h.numel() and h.is_contiguous()]
        t = self._pick(data)
        if t is None or t.layout == torch.sparse_coo or t.dim() != 2:
            return
        check = check or ss.is_debug()
        c, p = (checked.index_members(t))
        c2, p2 = torch.from_numpy(c.numpy()), torch.from_numpy(p.numpy())  # new storages
        assert c2.untyped_storage()._cdata != c.untyped_storage()._cdata
        if pool and data.draw(st.booleans()):
            h = data.draw(st.sampled_from(pool))
            if h.shape == p.shape and h.dtype == p.dtype:
                p2 = torch.from_numpy(h.numpy())
        self.handles += [c2, p2]
        try:
            out = ss.sparse_compressed_tensor(c2, p2, t.values().detach().clone(), t.shape,
                                              layout=t.layout, check_invariants=check)
        except ss.InvariantError:
            assert check
            return
        self._keep(out)

    @rule(data=st.data(), route=st.sampled_from(["mmap", "safetensors"]))
    def mapped_file(self, data: st.DataObject, route: str) -> None:
        """A tensor loaded from a file, which is then rewritten in place (a trainer saving to
        the same path): the loaded tensor keeps its own copy of its index members."""
        t = self._pick(data)
        if t is None or not really_valid(t) or t.dim() != 2:
            return
        plain = ss.unwrap(t).detach()
        # (a fresh path each time: torch.save truncates the file it writes, and the values of a
        # tensor loaded with mmap=True stay mapped, as in torch; reading them from a truncated
        # file is a bus error, whoever reads them)
        self.files += 1
        if route == "mmap":
            path = os.path.join(self.tmp, f"m{self.files}.pt")
            torch.save({"t": plain}, path)
            out = ss.load(path, mmap=True)["t"]
            torch.save({"t": plain * 0}, path)  # same sizes, other values
        else:
            from safesparse.safetensors import load_file, save_file
            path = os.path.join(self.tmp, f"m{self.files}.safetensors")
            save_file({"t": t}, path)
            out = load_file(path)["t"]
            with open(path, "r+b") as f:  # overwrite the file's bytes in place
                size = f.seek(0, 2)
                f.seek(max(0, size - 64))
                f.write(b"\x7f" * min(64, size))
        self._keep(out)

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """``del`` a tensor or an index tensor, then collect garbage."""
        if len(self.live) > 2 and data.draw(st.booleans()):
            self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        elif self.handles:
            self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        gc.collect()

    @rule(on=st.booleans())
    def debug(self, on: bool) -> None:
        ss.set_debug(on)

    # -- the invariant ---------------------------------------------------------------------

    @invariant()
    def checked_means_valid(self) -> None:
        for t in self.live:
            if ss.is_checked(t):
                assert really_valid(t), f"checked but invalid: {t!r}"

    def teardown(self) -> None:
        ss.set_debug(False)
        shutil.rmtree(self.tmp, ignore_errors=True)


CheckedMeansValid.TestCase.settings = settings(
    max_examples=400 if THOROUGH else 12,
    stateful_step_count=50 if THOROUGH else 30,
    deadline=None,
    derandomize=not THOROUGH,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_checked_means_valid = CheckedMeansValid.TestCase
