"""The native block kernels (``csrc/blockprod.c``): loading, the path in use, and the calls.

The library is a plain shared object built by ``pip install .`` when a C compiler is at hand
(``setup.py``: an optional build that never fails the install) and loaded here with ctypes; it
has no torch headers, so one build serves every torch version. Its micro-kernels exist per
instruction set (AVX-512F, AVX2 + FMA) and are chosen at load from what the CPU has; bfloat16
products of block layouts run in bfloat16 where the CPU has AVX512_BF16 (``csrc/kern_bf16.h``,
:func:`reads_bf16`; the end of this module).

:func:`status` says whether the native path runs and why not: no library (no compiler at
install, a non-x86 machine), a CPU without AVX2 + FMA, or ``SAFESPARSE_NATIVE=0`` in the
environment. Where it does not run, :mod:`safesparse.kernels.blocks` computes with torch ops
(the same results; the tests compare both paths against a float64 reference).

Threads: one parallel region per product with ``torch.get_num_threads()`` threads, on the
OpenMP runtime torch itself loaded (found in ``/proc/self/maps``; its ``GOMP_parallel`` is
handed to the library, which links against no runtime, so the process keeps one thread pool).
In a child started by ``fork()`` the products run on the calling thread only (GNU OpenMP
hangs in a forked child whose parent used its pool). Tasks are taken from a shared counter, and
when a region's helper thread arrives after most of the work is done (its core busy with
another process), the following regions run on the calling thread alone for a while (64
regions, doubling while it repeats): on a busy machine two threads cost about what one does,
never a wait for a descheduled thread at every region. Environment: ``SAFESPARSE_NATIVE=0``
forces the torch-op kernels; ``SAFESPARSE_NATIVE_ISA=avx2`` limits the instruction set (for
measurements).

Nothing here validates: the callers hand in members that safesparse proved. But that memory
stays writable after its proof (a racing in-place write), so the library checks every index as
it reads it against the bounds given here from the tensors' shapes: a bad one stops the product
with :class:`IndexDataError` naming the array, the position and the value, never a read or a
write out of bounds.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base.forking import in_forked_child
from ..base.layouts import BLOCK_LAYOUTS, ROW_LAYOUTS
from .pattern import IndexDataError, Matrix, by_rows, compute_dtype, coordinates, index_fault
from .pattern import long as _long

__all__ = ["IndexDataError", "Status", "available", "disabled", "library_path", "product",
           "region_stats", "status", "usable", "values_grad"]

T = torch.Tensor
_HERE = Path(__file__).resolve().parent
#: The library's file name (setup.py's ``NATIVE_FILE``).
LIB_FILE = "_blockprod.native.so"
#: The interface version these bindings are written for (csrc/blockprod.h's SS_ABI_VERSION;
#: tests/kernels/test_interface.py checks both, and every binding, against the header).
_ABI = 6
#: torch dtype -> the library's dtype code, read from the library (``ss_dtype_names``) at load
_DTYPES: dict[torch.dtype, int] = {}
_ISA_NAMES = {0: "none", 1: "avx2+fma", 2: "avx512f"}
_OPENMP_NAMES = ("libgomp", "libiomp5", "libomp")

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_int = ctypes.c_int


@dataclass(frozen=True)
class Status:
    """Which kernels run on CPU: ``native`` True with the instruction set in ``isa``, or the
    torch-op kernels with the reason in ``reason``."""

    native: bool
    reason: str
    isa: str
    library: str | None
    openmp: str | None

    def describe(self) -> str:
        if self.native:
            pool = (f"threads on torch's OpenMP runtime ({self.openmp})" if self.openmp
                    else "one thread (no OpenMP runtime found in the process)")
            return f"native ({self.isa}; {pool}; {self.library})"
        return f"torch ops ({self.reason})"


_lib: Any = None
_status: Status | None = None
_forced_off = False

#: The library's return codes (csrc/blockprod.c): no kernels for these operands, out of
#: memory, a bad index read.
_E_NOKERNEL, _E_NOMEM, _E_INDEX = -1, -2, -3
#: (the code of "no kernel for these operands", for callers of the packed entries)
E_NOKERNEL = _E_NOKERNEL


def _raise_fault(names: dict[int, str]) -> None:
    """Turn the calling thread's last fault (``ss_last_error``) into :class:`IndexDataError`;
    ``names`` maps the library's array codes to what the caller handed in."""
    out = (ctypes.c_int64 * 4)()
    _lib.ss_last_error(out)
    member, pos, value, bound = (int(v) for v in out)
    what = names.get(member, f"index array {member}")
    rule = (f"row pointers rise from 0 to at most {bound}" if member == 1
            else f"must lie in [0, {bound})")
    raise index_fault(what, pos, value, f"{rule}; read by the native kernel")


#: what the arrays of ss_product / ss_values_grad are, for the messages
_PRODUCT_NAMES = {1: "the compressed indices (crow / ccol)", 2: "the plain indices (col / row)",
                  3: "the stored order"}
_BY_PLAIN_NAMES = {1: "the pointers derived from the plain indices",
                   2: "the compressed indices (crow / ccol, as read per block)",
                   3: "the stored order derived from the plain indices"}
_VG_NAMES = {4: "the block rows of the stored blocks", 5: "the block columns of the stored blocks"}


def library_path() -> Path | None:
    """The built library next to this module (``_blockprod.native.so``: a dot in the stem, so
    that nothing takes it for a Python module), if any."""
    path = _HERE / LIB_FILE
    return path if path.exists() else None


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime torch loaded, from this process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                name = os.path.basename(path)
                if path.startswith("/") and name.startswith(_OPENMP_NAMES):
                    return path
    except OSError:
        return None
    return None


def _bind(lib: Any) -> None:
    """The ctypes signatures of the library's entry points (csrc/blockprod.h)."""
    lib.ss_abi_version.restype = _int
    lib.ss_abi_version.argtypes = []
    lib.ss_fingerprint.restype = ctypes.c_uint64
    lib.ss_fingerprint.argtypes = [_ptr, _i64]
    lib.ss_dtype_names.restype = ctypes.c_char_p
    lib.ss_dtype_names.argtypes = []
    lib.ss_isa.restype = _int
    lib.ss_isa.argtypes = []
    lib.ss_cpu_isa.argtypes = []
    lib.ss_cpu_isa.restype = _int
    lib.ss_select_isa.restype = _int
    lib.ss_select_isa.argtypes = [_int]
    lib.ss_set_runtime.restype = _int
    lib.ss_set_runtime.argtypes = [_ptr, _ptr]
    lib.ss_product.restype = _int
    lib.ss_product.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                               _ptr, _int, _i64, _i64, _i64, _i64,
                               _ptr, _int, _i64, _i64, _ptr, _int]
    lib.ss_product_packed.restype = _int
    lib.ss_product_packed.argtypes = [_ptr]
    lib.ss_product_packed_rounded.restype = _int
    lib.ss_product_packed_rounded.argtypes = [_ptr]
    lib.ss_linear_backward_packed.restype = _int
    lib.ss_linear_backward_packed.argtypes = [_ptr]
    lib.ss_bf16_supported.restype = _int
    lib.ss_bf16_supported.argtypes = []
    lib.ss_product_bf16.restype = _int
    lib.ss_product_bf16.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr,
                                    _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
                                    _ptr, _i64, _i64, _ptr, _int]
    lib.ss_values_grad_bf16.restype = _int
    lib.ss_values_grad_bf16.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr,
                                        _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _int]
    # (the same with the output's dtype code before the threads: float32 unrounded sums)
    lib.ss_product_bf16_to.restype = _int
    lib.ss_product_bf16_to.argtypes = [*lib.ss_product_bf16.argtypes[:18], _int,
                                       *lib.ss_product_bf16.argtypes[18:]]
    lib.ss_values_grad_bf16_to.restype = _int
    lib.ss_values_grad_bf16_to.argtypes = [*lib.ss_values_grad_bf16.argtypes[:15], _int, _int]
    lib.ss_colsum_bf16.restype = _int
    lib.ss_colsum_bf16.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _int, _int]
    lib.ss_values_grad.restype = _int
    lib.ss_values_grad.argtypes = [_i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                                   _ptr, _i64, _i64, _i64, _int, _ptr, _int]
    lib.ss_last_error.restype = None
    lib.ss_last_error.argtypes = [_ptr]
    lib.ss_convert.restype = _int
    lib.ss_convert.argtypes = [_ptr, _int, _ptr, _int, _i64]
    lib.ss_region_stats.restype = None
    lib.ss_region_stats.argtypes = [_ptr]
    lib.ss_reset_backoff.restype = None
    lib.ss_reset_backoff.argtypes = []


def _dtype_codes(lib: Any) -> dict[torch.dtype, int]:
    """torch dtype -> code, from the names the library lists in code order."""
    names = lib.ss_dtype_names().decode().split()
    return {getattr(torch, name): code for code, name in enumerate(names)}


def _load() -> Status:
    global _lib
    if os.environ.get("SAFESPARSE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return Status(False, "SAFESPARSE_NATIVE=0 in the environment", "none", None, None)
    path = library_path()
    if path is None:
        return Status(False, "the native library was not built (no C compiler at install, "
                             "or not an x86-64 build); `pip install .` with gcc or clang "
                             "builds it", "none", None, None)
    try:
        lib = ctypes.CDLL(str(path))
        lib.ss_abi_version.restype = _int
        if lib.ss_abi_version() != _ABI:
            return Status(False, f"{path.name} is from another safesparse version (rebuild: "
                                 "`pip install .`)", "none", str(path), None)
        _bind(lib)
        _DTYPES.update(_dtype_codes(lib))
    except (OSError, AttributeError) as exc:
        return Status(False, f"{path.name} could not be loaded: {exc}", "none", str(path), None)
    want = os.environ.get("SAFESPARSE_NATIVE_ISA", "").strip().lower()
    isa = lib.ss_select_isa({"avx2": 1, "avx512": 2, "avx512f": 2}.get(want, -1))
    if isa == 0:
        return Status(False, "this CPU has no AVX2 + FMA (the native micro-kernels need it)",
                      "none", str(path), None)
    runtime = _openmp_runtime()
    if runtime is not None:
        try:
            # RTLD_NOLOAD: the runtime torch already mapped, never a second one
            omp = ctypes.CDLL(runtime, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            par = ctypes.cast(omp.GOMP_parallel, _ptr).value
            tnum = ctypes.cast(omp.omp_get_thread_num, _ptr).value
            if not lib.ss_set_runtime(par, tnum):
                runtime = None
        except (OSError, AttributeError):
            runtime = None
    _lib = lib
    return Status(True, "", _ISA_NAMES.get(isa, str(isa)), str(path), runtime)


def status() -> Status:
    """The kernels in use (loads the library on first call)."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def available() -> bool:
    """Whether products on CPU run natively now."""
    return not _forced_off and status().native


def forced_off() -> bool:
    """Whether :func:`disabled` is in force (the eager plans of ``safesparse.nn``, which call
    the library directly, ask at every call)."""
    return _forced_off


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block, the torch-op kernels run (for tests and measurements; also in place
    of the eager plans of ``safesparse.nn``: :func:`forced_off`)."""
    global _forced_off
    saved = _forced_off
    _forced_off = True
    try:
        yield
    finally:
        _forced_off = saved


def region_stats() -> tuple[int, int]:
    """(parallel regions opened so far, the region up to which products run on the calling
    thread): the second above the first means the busy-machine back-off fired."""
    out = (ctypes.c_int64 * 2)()
    if available():
        _lib.ss_region_stats(out)
    return int(out[0]), int(out[1])


def _threads() -> int:
    return 1 if in_forked_child() else max(1, torch.get_num_threads())


def usable(*tensors: T) -> bool:
    """Whether the native kernels take these operands (CPU, a supported dtype)."""
    if not available():
        return False
    return all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors)


# ---------------------------------------------------------------------------------------------
# Pattern data (index data only; cached with the proof when the caller has a cache)


def _cached(cache: dict[Hashable, Any] | None, key: Hashable, make: Any) -> Any:
    if cache is None:
        return make()
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
    return hit


def _value_strides(layout: torch.layout, values: T) -> tuple[int, int, int]:
    if layout in BLOCK_LAYOUTS:
        return values.stride(0), values.stride(1), values.stride(2)
    return values.stride(0), 0, 0


@dataclass
class _Rows:
    crow: T
    col: T
    order: T | None
    r: int
    c: int
    sp: int
    sa: int
    sb: int


def _rowwise(m: Matrix, transposed: bool, cache: dict[Hashable, Any] | None) -> _Rows:
    """``M = A`` (or ``A.T``) read by block rows, over ``m.values`` (any strides)."""
    rs, cs = m.r, m.c
    sp, s1, s2 = _value_strides(m.layout, m.values)
    if (m.layout in ROW_LAYOUTS) != transposed:  # (not m.row_major: one call less per product)
        crow, col = _cached(cache, ("native", "long"),
                            lambda: (_long(m.compressed), _long(m.plain)))
        order = None
    else:
        n_plain = m.n_plain
        crow, col, order = _cached(cache, ("native", "by_plain", n_plain),
                                   lambda: by_rows(m.compressed, m.plain, n_plain))
    if not transposed:
        return _Rows(crow, col, order, rs, cs, sp, s1, s2)  # M's blocks are A's
    return _Rows(crow, col, order, cs, rs, sp, s2, s1)      # A's blocks, transposed


def _outer(m: Matrix, cache: dict[Hashable, Any] | None) -> tuple[T, T]:
    """Block row and block column of each stored block, in stored order."""
    # (keyed by the orientation: the same members may be proven for a CSR and a CSC matrix)
    pair: tuple[T, T] = _cached(cache, ("native", "outer", m.row_major),
                                lambda: coordinates(m, m.compressed, _long(m.plain)))
    return pair


def _ptr_of(t: T | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------------------------
# Products


def product(a: Matrix, transposed: bool, x: T, xk: int, xn: int, n: int, y: T, yi: int,
            yn: int, bias: T | None = None,
            cache: dict[Hashable, Any] | None = None, rounded: bool = False) -> bool:
    """``Y = M @ X (+ bias)`` for ``M = A`` (or ``A.T``), ``X[k, n] = x[k * xk + n * xn]``,
    ``Y[row, n] = y[row * yi + n * yn]`` (``y`` fresh, written whole); False when the library
    refused (the caller computes with torch ops). ``rounded`` (a bfloat16 ``x``, a float32
    ``y``): ``y`` holds the bfloat16 result widened (the bits of its cast to float32), computed
    by the bfloat16 kernels only (False where they do not run it)."""
    layout, values, n_rows, n_cols = a.layout, a.values, a.n_rows, a.n_cols
    rows = _rowwise(a, transposed, cache)
    # bounds from the shapes (never from index data): n_br, nnzb, n_in
    n_br = (n_cols // rows.r if transposed else n_rows // rows.r)
    nnzb = min(rows.col.numel(), int(values.shape[0]))
    if rows.crow.numel() != n_br + 1:
        raise IndexDataError(f"the compressed indices hold {rows.crow.numel()} entries where "
                             f"{n_br + 1} are needed: the index data changed after it was "
                             "validated")
    if x.dtype == torch.bfloat16 and layout in BLOCK_LAYOUTS:
        if _product_bf16(rows, values, n_rows if transposed else n_cols, x, xk, xn, n, y, yi,
                         yn, bias, rounded):
            return True
        if rounded:
            return False
        if yi == 1:
            x = _widened(x)  # no bfloat16 kernels here: the float32 route
    work = compute_dtype(x.dtype)
    vals = values if values.dtype == work else values.to(work)
    if vals is not values:
        rows.sp, rows.sa, rows.sb = _value_strides(layout, vals)
        if transposed:
            rows.sa, rows.sb = rows.sb, rows.sa
    b = None if bias is None else bias.to(work).contiguous()
    n_in = n_rows if transposed else n_cols
    rc = _lib.ss_product(n_br, rows.r, rows.c, nnzb, rows.crow.data_ptr(),
                         rows.col.data_ptr(), _ptr_of(rows.order), vals.data_ptr(), rows.sp,
                         rows.sa, rows.sb, x.data_ptr(), _DTYPES[x.dtype], xk, xn, n_in, n,
                         y.data_ptr(), _DTYPES[y.dtype], yi, yn, _ptr_of(b), _threads())
    if rc == _E_INDEX:
        _raise_fault(_PRODUCT_NAMES if rows.order is None else _BY_PLAIN_NAMES)
    return bool(rc == 0)


def values_grad(a: Matrix, l_: T, li: int, ln: int, r_: T, ri: int, rn: int, n: int,
                dtype: torch.dtype, cache: dict[Hashable, Any] | None = None,
                rounded: bool = False) -> T | None:
    """Per stored block p at (i, j): ``G_p[a, b] = sum_n L[i r + a, n] R[j c + b, n]`` in the
    values' shape and ``dtype``; ``L[row, n] = l_[row * li + n * ln]``, likewise ``R``;
    operands in float32 / float64 (their common dtype), or bfloat16 (``dtype`` float32: the
    bfloat16 kernel's float32 sums, unrounded; with ``rounded``, the bfloat16 result widened,
    by the bfloat16 kernels only). None when the library refused this operand layout."""
    r, c, values_shape = a.r, a.c, a.values.shape
    rows, cols = _outer(a, cache)
    nnzb = int(values_shape[0])
    if rows.numel() != nnzb or cols.numel() != nnzb:
        raise IndexDataError(f"the pattern holds {cols.numel()} stored blocks where the values "
                             f"hold {nnzb}: the index data changed after it was validated")
    if l_.dtype == torch.bfloat16:
        got = _values_grad_bf16(rows, cols, r, c, l_, li, ln, r_, ri, rn, n, values_shape,
                                dtype, rounded)
        if got is not None:
            return got.to(dtype)
        if rounded:
            return None
        l_, r_ = _widened(l_), _widened(r_)  # the float32 route
    g = torch.empty((nnzb, r, c), dtype=l_.dtype)
    rc = _lib.ss_values_grad(nnzb, r, c, l_.shape[0], r_.shape[0], rows.data_ptr(),
                             cols.data_ptr(), l_.data_ptr(), li, ln, r_.data_ptr(), ri, rn, n,
                             _DTYPES[l_.dtype], g.data_ptr(), _threads())
    if rc == _E_INDEX:
        _raise_fault(_VG_NAMES)
    if rc != 0:
        return None
    return g.view(values_shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# One product's arguments, packed once (the eager fast path of safesparse.nn: nn/eager.py)

#: The slots of :func:`pack_product`'s array that change per call (``ss_product``'s order):
#: the operand's data pointer, its stride between batch columns (``xk`` or ``xn``: see
#: :func:`pack_product`), the batch size, the output's data pointer and its stride.
SLOT_X, SLOT_N, SLOT_Y, SLOT_XK, SLOT_YI, SLOT_THREADS = 11, 16, 17, 13, 19, 22
PackedArgs = ctypes.Array[ctypes.c_int64]


def pack_product(a: Matrix, batch_major: bool, x_dtype: torch.dtype, y_dtype: torch.dtype,
                 bias: T | None = None, cache: dict[Hashable, Any] | None = None
                 ) -> tuple[PackedArgs, tuple[T, ...]] | None:
    """The arguments :func:`product` would pass for ``Y = A @ X (+ bias)`` (``A`` not
    transposed), packed for ``ss_product_packed``, and the tensors whose memory they point to
    (the caller keeps them alive while it uses the array); None where the native path does not
    run. ``batch_major``: ``X`` (N, n_cols) and ``Y`` (N, n_rows), contiguous (a layer's
    ``x @ W.T``); else ``X`` (n_cols, N) and ``Y`` (n_rows, N), contiguous (``A @ x``). The
    caller writes :data:`SLOT_X`, :data:`SLOT_N`, :data:`SLOT_Y` (and, not batch-major,
    :data:`SLOT_XK` and :data:`SLOT_YI`: N) per call; ``x_dtype`` is the operand's dtype as the
    kernel reads it (float32 / float64; bfloat16 where :func:`reads_bf16` says so: the product
    then runs in bfloat16 and ``y_dtype`` is bfloat16, or float32: the float32 sums
    unrounded), ``y_dtype`` the output's.
    Values and bias of another dtype are converted here, once (as :func:`product` does per
    call)."""
    layout, values, n_rows, n_cols = a.layout, a.values, a.n_rows, a.n_cols
    bf16 = x_dtype == torch.bfloat16
    if (not available() or y_dtype not in _DTYPES
            or (bf16 and (y_dtype not in _BF16_OUT or not reads_bf16(x_dtype, layout)))
            or (not bf16 and x_dtype not in (torch.float32, torch.float64))):
        return None
    rows = _rowwise(a, False, cache)
    work = x_dtype if bf16 else compute_dtype(x_dtype)
    vals = values if values.dtype == work else values.to(work)
    if vals is not values:
        rows.sp, rows.sa, rows.sb = _value_strides(layout, vals)
    b = None if bias is None else bias.to(work).contiguous()
    xk, xn, yi, yn = (1, n_cols, 1, n_rows) if batch_major else (0, 1, 0, 1)
    # bounds from the shapes (never from index data), as product() passes them
    n_br = n_rows // rows.r
    nnzb = min(rows.col.numel(), int(values.shape[0]))
    if rows.crow.numel() != n_br + 1:
        return None
    # (slot 23: the values' dtype; bfloat16 runs ss_product_bf16 on the same slots)
    args = (ctypes.c_int64 * 24)(
        n_br, rows.r, rows.c, nnzb, rows.crow.data_ptr(), rows.col.data_ptr(),
        _ptr_of(rows.order) or 0, vals.data_ptr(), rows.sp, rows.sa, rows.sb, 0,
        _DTYPES[x_dtype], xk, xn, n_cols, 0, 0, _DTYPES[y_dtype], yi, yn, _ptr_of(b) or 0,
        _threads(), _DTYPES[work])
    keep = tuple(t for t in (rows.crow, rows.col, rows.order, vals, b) if t is not None)
    return args, keep


#: The values' slots of :func:`pack_product`'s array (their address and strides)
_SLOT_VALS, _SLOT_SP, _SLOT_SA, _SLOT_SB = 7, 8, 9, 10
#: Batches from which :func:`prepacked` arrays pay (smaller ones take the small-batch tiles,
#: which read a block's rows in place: ``SS_SMALL_N`` in csrc/blockprod.c, 15; from 16 rows the
#: batch-major tiles, which on a pre-packed array skip their per-call packing)
PREPACKED_FROM = 16
#: The largest values :func:`prepacked` copies (bytes): the copy doubles the values' memory
PREPACKED_MAX_BYTES = 16 << 20


def prepacked(args: PackedArgs, values: T) -> tuple[PackedArgs, T] | None:
    """A copy of the float32 / float64 batch-major :func:`pack_product` array ``args`` that
    reads a transposed copy of ``values`` (the array's values: each block's columns
    contiguous, the layout the batch-major kernels otherwise pack a block row's blocks into at
    every call, or the whole matrix once per call over several row tiles), and that copy; None
    where it would not pay or does not apply (blocks read in that layout already, small
    blocks, other operands, values over :data:`PREPACKED_MAX_BYTES`). The caller keeps the
    copy current: it is the values at the time of this call."""
    r, c = int(args[1]), int(args[2])
    if (values.dim() != 3 or values.dtype not in (torch.float32, torch.float64)
            or _DTYPES.get(values.dtype) != args[23] or args[12] != args[23]
            or args[13] != 1 or args[19] != 1 or r < 8 or c < 1
            or tuple(values.shape[1:]) != (r, c) or values.data_ptr() != args[_SLOT_VALS]
            or (args[_SLOT_SP], args[_SLOT_SA], args[_SLOT_SB]) != values.stride()
            or args[_SLOT_SA] == 1
            or values.numel() * values.element_size() > PREPACKED_MAX_BYTES):
        return None
    copy = values.transpose(1, 2).contiguous()  # (blocks, c, r): M_p[a, b] at p r c + b r + a
    out = type(args).from_buffer_copy(args)
    out[_SLOT_VALS] = copy.data_ptr()
    out[_SLOT_SP], out[_SLOT_SA], out[_SLOT_SB] = r * c, 1, r
    return out, copy


#: Or-ed into the bfloat16 code of a product array's values dtype (slot 23, ``SS_VALS_F32``):
#: the values and bias are float32, rounded to bfloat16 in the call (the values as the kernel
#: reads them, the bias once)
_VALS_F32 = 0x200
#: The largest batch :func:`rounding_values` arrays take (``BF_SMALL_N`` in csrc/kern_bf16.h:
#: the small-batch tile, which reads a block's rows in place)
ROUNDING_VALUES_MAX_N = 32


def rounding_values(args: PackedArgs, values: T, bias: T | None
                    ) -> tuple[PackedArgs, tuple[T, ...]] | None:
    """A copy of the bfloat16 batch-major :func:`pack_product` array ``args`` (made over a
    bfloat16 copy of the float32 ``values`` and ``bias``) that reads ``values`` and ``bias``
    themselves, rounded to bfloat16 in the call (the values by the kernel as it reads them,
    the bias once, by torch's rounding): the bits of the product
    over the copy (the same rounding, csrc/kern_bf16.h's ``bf_round_pairs``, but for float32
    subnormals that torch rounds up to the smallest normal bfloat16: zero here), for batches of
    at most :data:`ROUNDING_VALUES_MAX_N` rows (the library refuses larger ones), and the
    tensors it points to; None where it does not apply (no bfloat16 kernels, not 16 x 16
    blocks stored by rows, values or bias not contiguous float32). What a float32 layer under
    bfloat16 autocast reads at small batches, where checking that the copy is current
    (:func:`fingerprint`) costs more than rounding the values again."""
    if (values.dtype != torch.float32 or args[23] != _DTYPES.get(torch.bfloat16)
            or args[12] != args[23] or args[13] != 1 or args[19] != 1
            or not _bf16_library() or values.dim() != 3 or tuple(values.shape[1:]) != (16, 16)
            or (args[1], args[2], args[_SLOT_SA], args[_SLOT_SB]) != (16, 16, 16, 1)
            or not values.is_contiguous() or values.shape[0] < args[3]
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                      or bias.numel() != args[0] * 16))):
        return None
    out = type(args).from_buffer_copy(args)
    out[_SLOT_VALS] = values.data_ptr()
    out[_SLOT_SP] = 256
    out[21] = 0 if bias is None else bias.data_ptr()
    out[23] = args[23] | _VALS_F32
    return out, (values,) if bias is None else (values, bias)


def fingerprint(t: T) -> int:
    """A 64-bit fingerprint of the contiguous CPU tensor ``t``'s memory (``ss_fingerprint``,
    csrc/fingerprint.h; one pass at the caches' read rate): what the eager plans of
    ``safesparse.nn`` compare, at each call that reads their copy of a layer's values, with the
    one taken when they made it, to see a write that moved no version counter (through
    ``.data``, NumPy, another process). Needs the library (:func:`status`)."""
    if _lib is None and not status().native:
        raise RuntimeError("safesparse: no native library, so no fingerprint: "
                           f"{status().describe()}")
    return int(_lib.ss_fingerprint(t.data_ptr(), t.numel() * t.element_size()))


def packed_entry() -> Any:
    """``ss_product_packed`` (one argument: the address of a :func:`pack_product` array,
    ``ctypes.addressof``; 0 on success), or None where the native path does not run."""
    return _lib.ss_product_packed if available() else None


def packed_entry_rounded() -> Any:
    """``ss_product_packed_rounded``: :func:`packed_entry` for a bfloat16 array
    (:func:`pack_product` with ``x_dtype`` bfloat16) whose operand is float32, rounded to
    bfloat16 in the call (as ``.to(torch.bfloat16)``: for small operands, where a separate
    conversion costs more than the product); None where the native path does not run."""
    return _lib.ss_product_packed_rounded if available() else None


# ---------------------------------------------------------------------------------------------
# A layer's backward, packed once (the eager fast path's gradients: nn/eager.py)

#: The slots of :func:`pack_linear_backward`'s array written per call: the gradient ``G``
#: (twice: the operand of ``G @ W`` and the values gradient's left factor), the batch (twice),
#: the input ``X``, and the three outputs (address 0: not computed) with the input gradient's
#: dtype code (:func:`grad_input_code`)
BWD_G, BWD_N, BWD_GX, BWD_GX_DT, BWD_THREADS = SLOT_X, SLOT_N, SLOT_Y, 18, SLOT_THREADS
BWD_L, BWD_X, BWD_VN, BWD_GV, BWD_VTHREADS, BWD_GB = 31, 34, 37, 39, 41, 42
#: (1: ``X`` is float32, rounded to bfloat16 in the call: a layer under autocast whose forward
#: rounded its small input in the call, ``ss_product_packed_rounded``)
BWD_X_ROUND = 44
#: The values gradient's slots (after :func:`pack_product`'s 24)
_BWD_V = 24


def pack_linear_backward(a: Matrix, dtype: torch.dtype, rounded: bool,
                         cache: dict[Hashable, Any] | None = None
                         ) -> tuple[PackedArgs, tuple[T, ...]] | None:
    """The arguments of a layer's backward (``Y = X @ A.T``, ``A`` the ``n_rows x n_cols``
    weight, ``X`` and ``G`` batch-major and contiguous, in ``dtype``), packed for
    ``ss_linear_backward_packed`` (one call: ``GX = G @ A`` as :func:`product` computes it
    transposed, the values gradient as :func:`values_grad` does for ``G.T`` and ``X.T``, and,
    bfloat16 only, ``G.sum(0)`` as :func:`colsum_bf16`), and the tensors the array points to;
    None where the native path does not run or the values are not ``dtype`` (float32 /
    float64, or bfloat16 where :func:`reads_bf16`). ``rounded`` (bfloat16): the values
    gradient and the bias gradient written as float32 holding their bfloat16 rounding (the
    bits of their cast). The caller writes the :data:`BWD_G` ... :data:`BWD_GB` slots per call
    (the input gradient's dtype: :func:`grad_input_code`), and :data:`BWD_X_ROUND` where a
    bfloat16 backward's ``X`` is float32 (rounded in the call)."""
    layout, values, n_rows, n_cols = a.layout, a.values, a.n_rows, a.n_cols
    bf16 = dtype == torch.bfloat16
    if (not available() or values.dtype != dtype or values.dim() != 3
            or dtype not in (torch.float32, torch.float64, torch.bfloat16)
            or (bf16 and not reads_bf16(dtype, layout)) or (rounded and not bf16)):
        return None
    rows = _rowwise(a, True, cache)  # (A.T by block rows: the product G @ A)
    n_br = n_cols // rows.r
    if rows.crow.numel() != n_br + 1:
        return None
    outer_rows, outer_cols = _outer(a, cache)
    nnzb = int(values.shape[0])
    if outer_rows.numel() != nnzb or outer_cols.numel() != nnzb:
        return None
    code, threads = _DTYPES[dtype], _threads()
    wide = _DTYPES[torch.float32] | _OUT_ROUNDED
    args = (ctypes.c_int64 * 45)(
        # G @ A: pack_product's slots, transposed (A's blocks read transposed, in place)
        n_br, rows.r, rows.c, min(rows.col.numel(), nnzb), rows.crow.data_ptr(),
        rows.col.data_ptr(), _ptr_of(rows.order) or 0, values.data_ptr(), rows.sp, rows.sa,
        rows.sb, 0, code, 1, n_rows, n_rows, 0, 0, code, 1, n_cols, 0, threads, code,
        # the values gradient: L = G.T (n_rows, N), R = X.T (n_cols, N)
        nnzb, a.r, a.c, outer_rows.data_ptr(), outer_cols.data_ptr(), n_rows, n_cols,
        0, 1, n_rows, 0, 1, n_cols, 0, code, 0, wide if rounded else code, threads,
        # the bias gradient (bfloat16); X read as it is
        0, wide if rounded else code, 0)
    return args, (rows.crow, rows.col, *(() if rows.order is None else (rows.order,)),
                  values, outer_rows, outer_cols)


def grad_input_code(dtype: torch.dtype, rounded: bool) -> int:
    """The :data:`BWD_GX_DT` slot of :func:`pack_linear_backward`'s array for an input
    gradient in ``dtype`` (the operands' dtype; ``rounded``: float32 holding the bfloat16
    rounding of a bfloat16 product)."""
    return _DTYPES[torch.float32] | _OUT_ROUNDED if rounded else _DTYPES[dtype]


def backward_entry() -> Any:
    """``ss_linear_backward_packed`` (one argument: the address of a
    :func:`pack_linear_backward` array; 0 on success), or None where the native path does not
    run."""
    return _lib.ss_linear_backward_packed if available() else None


# ---------------------------------------------------------------------------------------------
# bfloat16 computed in bfloat16 (csrc/kern_bf16.h: AVX512_BF16, float32 sums, no float32 copy
# of the values, the input or the gradient). Elsewhere (no AVX512_BF16, CSR / CSC, operands
# neither batch- nor feature-major) bfloat16 is computed in float32 from float32 copies, as
# before (measured: the copies' memory is twice the step's floor).

_bf16_bound: bool | None = None
#: The output dtypes of the bfloat16 kernels (float32: their sums, unrounded)
_BF16_OUT = (torch.bfloat16, torch.float32)
#: Or-ed into the float32 output code of the bfloat16 kernels (``SS_OUT_ROUNDED``): float32
#: holding the bfloat16 rounding of the sums (the bits of a bfloat16 result cast to float32)
_OUT_ROUNDED = 0x100


def _bf16_library() -> bool:
    """Whether the loaded library has the bfloat16 kernels and this CPU runs them
    (``SAFESPARSE_NATIVE_ISA=avx2`` or ``avx512f`` turns them off, for measurements)."""
    global _bf16_bound
    if _bf16_bound is None:
        want = os.environ.get("SAFESPARSE_NATIVE_ISA", "").strip().lower()
        # (bound with the others in _bind; the kernels exist in every build, where the CPU
        # lacks AVX512_BF16 ss_bf16_supported says 0)
        _bf16_bound = want not in ("avx2", "avx512f") and bool(_lib.ss_bf16_supported())
    return _bf16_bound


def reads_bf16(dtype: torch.dtype, layout: torch.layout) -> bool:
    """Whether the native products of a ``layout`` matrix read ``dtype`` operands as they are
    (bfloat16 computed in bfloat16): the callers then hand them in without a float32 copy."""
    return (dtype == torch.bfloat16 and layout in BLOCK_LAYOUTS and available()
            and _bf16_library())


def bf16_describe() -> str:
    """How bfloat16 products run on CPU (for ``python -m safesparse info``)."""
    if not available():
        return "in float32 (torch ops)"
    if _bf16_library():
        return ("in bfloat16 (AVX512_BF16 vdpbf16ps, float32 sums) for BSR / BSC; CSR / CSC "
                "in float32")
    return "in float32 (no AVX512_BF16 kernels on this CPU or instruction set)"


def _widened(t: T) -> T:
    """``t`` in float32 with the same strides (the float32 route's operand)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=torch.float32)
    return out.copy_(t)


def _index_error() -> IndexDataError:
    return IndexDataError(
        "safesparse: the native bfloat16 kernel read a block index out of range (index "
        "members written while the product ran?); nothing out of bounds was read\n  Do not "
        "write a matrix's index members while a product runs on them.")


def _product_bf16(rows: _Rows, values: T, n_in: int, x: T, xk: int, xn: int, n: int, y: T,
                  yi: int, yn: int, bias: T | None, rounded: bool = False) -> bool:
    """:func:`product` in bfloat16, batch-major (``xk == yi == 1``) or feature-major
    (``xn == yn == 1``); False where the bfloat16 kernels do not run it. A float32 ``y``: the
    float32 sums, or (``rounded``) their bfloat16 rounding widened."""
    if (not _bf16_library() or not ((xk == 1 and yi == 1) or (xn == 1 and yn == 1))
            or values.dtype != torch.bfloat16
            or y.dtype not in _BF16_OUT or (bias is not None and bias.dtype != torch.bfloat16)):
        return False
    b = None if bias is None else bias.contiguous()
    nnzb = rows.col.numel()
    head = (rows.crow.numel() - 1, rows.r, rows.c, rows.crow.data_ptr(), rows.col.data_ptr(),
            _ptr_of(rows.order), nnzb, n_in // rows.c, values.data_ptr(),
            int(values.shape[0]), rows.sp, rows.sa, rows.sb, x.data_ptr(), xk, xn, n,
            y.data_ptr())
    if y.dtype == torch.bfloat16:
        rc = _lib.ss_product_bf16(*head, yi, yn, _ptr_of(b), _threads())
    else:  # float32: the sums unrounded, or (rounded) their bfloat16 rounding widened
        code = _DTYPES[y.dtype] | (_OUT_ROUNDED if rounded else 0)
        rc = _lib.ss_product_bf16_to(*head, code, yi, yn, _ptr_of(b), _threads())
    if rc == -3:
        raise _index_error()
    return bool(rc == 0)


def _values_grad_bf16(rows: T, cols: T, r: int, c: int, l_: T, li: int, ln: int, r_: T,
                      ri: int, rn: int, n: int, values_shape: torch.Size,
                      dtype: torch.dtype = torch.bfloat16, rounded: bool = False
                      ) -> T | None:
    """:func:`values_grad` in bfloat16 for batch-major operands (``li == ri == 1``) or
    operands contiguous along the batch (``ln == rn == 1``), or None; written in float32 (the
    sums unrounded, or with ``rounded`` their bfloat16 rounding widened) where ``dtype`` is
    float32, else in bfloat16."""
    if (not _bf16_library() or not ((li == 1 and ri == 1) or (ln == 1 and rn == 1))
            or r_.dtype != torch.bfloat16
            or len(values_shape) != 3):
        return None
    nnzb = rows.numel()
    out = dtype if dtype == torch.float32 else torch.bfloat16
    g = torch.empty((nnzb, r, c), dtype=out)
    head = (nnzb, r, c, rows.data_ptr(), cols.data_ptr(), l_.shape[0] // r, r_.shape[0] // c,
            l_.data_ptr(), li, ln, r_.data_ptr(), ri, rn, n, g.data_ptr())
    if out == torch.bfloat16:
        rc = _lib.ss_values_grad_bf16(*head, _threads())
    else:  # float32: the sums unrounded, or (rounded) their bfloat16 rounding widened
        code = _DTYPES[out] | (_OUT_ROUNDED if rounded else 0)
        rc = _lib.ss_values_grad_bf16_to(*head, code, _threads())
    if rc == -3:
        raise _index_error()
    return g.view(values_shape) if rc == 0 else None


def colsum_bf16(g: T, dtype: torch.dtype, rounded: bool = False) -> T | None:
    """``g.sum(0)`` of a bfloat16 ``g`` (N, C) whose rows are contiguous, in float32 sums
    (rows in order), as ``dtype`` (bfloat16: rounded once; float32: unrounded, or with
    ``rounded`` the bfloat16 result widened); None where the bfloat16 kernels do not run it
    (the caller sums with torch)."""
    if (not _bf16_library() or g.dtype != torch.bfloat16 or g.dim() != 2 or g.device.type != "cpu"
            or dtype not in _BF16_OUT or (g.shape[1] > 1 and g.stride(1) != 1)):
        return None
    n, c = g.shape
    out = torch.empty(c, dtype=dtype)
    ld = g.stride(0) if n > 1 else c
    code = _DTYPES[dtype] | (_OUT_ROUNDED if rounded and dtype == torch.float32 else 0)
    rc = _lib.ss_colsum_bf16(g.data_ptr(), n, c, ld, out.data_ptr(), code, _threads())
    return out if rc == 0 else None
