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

Nothing here validates: the callers hand in members that safesparse proved.
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

T = torch.Tensor
_HERE = Path(__file__).resolve().parent
#: The library's file name (setup.py's ``NATIVE_FILE``).
LIB_FILE = "_blockprod.native.so"
_ABI = 1
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_ISA_NAMES = {0: "none", 1: "avx2+fma", 2: "avx512f"}
_ROW_LAYOUTS = ROW_LAYOUTS
_BLOCK_LAYOUTS = BLOCK_LAYOUTS
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
    lib.ss_abi_version.restype = _int
    lib.ss_cpu_isa.restype = _int
    lib.ss_select_isa.restype = _int
    lib.ss_select_isa.argtypes = [_int]
    lib.ss_set_runtime.restype = _int
    lib.ss_set_runtime.argtypes = [_ptr, _ptr]
    lib.ss_product.restype = _int
    lib.ss_product.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                               _ptr, _int, _i64, _i64, _i64, _i64,
                               _ptr, _int, _i64, _i64, _ptr, _int]
    lib.ss_values_grad.restype = _int
    lib.ss_values_grad.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64,
                                   _i64, _i64, _int, _ptr, _int]


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
        _bind(lib)
        if lib.ss_abi_version() != _ABI:
            return Status(False, f"{path.name} is from another safesparse version (rebuild: "
                                 "`pip install .`)", "none", str(path), None)
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


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block, the torch-op kernels run (for tests and measurements)."""
    global _forced_off
    saved = _forced_off
    _forced_off = True
    try:
        yield
    finally:
        _forced_off = saved


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


def _block_rows(crow: T, nnzb: int) -> T:
    return torch.repeat_interleave(crow.diff(), output_size=nnzb)


def _long(t: T) -> T:
    return t.to(torch.int64).contiguous()


def _by_rows(compressed: T, plain: T, n_plain: int) -> tuple[T, T, T]:
    """The pattern grouped by the plain dimension: (pointers, compressed index of each block
    in that order, stored position of each)."""
    plain = _long(plain)
    order = torch.argsort(plain, stable=True)
    rows = _block_rows(_long(compressed), plain.numel())
    ptr = torch.zeros(n_plain + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(plain, minlength=n_plain), 0, out=ptr[1:])
    return ptr, rows[order].contiguous(), order


def _block_shape(layout: torch.layout, values: T) -> tuple[int, int]:
    if layout in _BLOCK_LAYOUTS:
        return int(values.shape[1]), int(values.shape[2])
    return 1, 1


def _value_strides(layout: torch.layout, values: T) -> tuple[int, int, int]:
    if layout in _BLOCK_LAYOUTS:
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


def _rowwise(layout: torch.layout, compressed: T, plain: T, values: T, n_rows: int,
             n_cols: int, transposed: bool, cache: dict[Hashable, Any] | None) -> _Rows:
    """``M = A`` (or ``A.T``) read by block rows, over ``values`` (any strides)."""
    rs, cs = _block_shape(layout, values)
    sp, s1, s2 = _value_strides(layout, values)
    row_major = layout in _ROW_LAYOUTS
    if row_major != transposed:
        crow, col = _cached(cache, ("native", "long"),
                            lambda: (_long(compressed), _long(plain)))
        order = None
    else:
        n_plain = n_cols // cs if row_major else n_rows // rs
        crow, col, order = _cached(cache, ("native", "by_plain", n_plain),
                                   lambda: _by_rows(compressed, plain, n_plain))
    if not transposed:
        return _Rows(crow, col, order, rs, cs, sp, s1, s2)  # M's blocks are A's
    return _Rows(crow, col, order, cs, rs, sp, s2, s1)      # A's blocks, transposed


def _outer(layout: torch.layout, compressed: T, plain: T,
           cache: dict[Hashable, Any] | None) -> tuple[T, T]:
    """Block row and block column of each stored block, in stored order."""
    def make() -> tuple[T, T]:
        inner = _long(plain)
        outer = _block_rows(_long(compressed), inner.numel()).contiguous()
        return (outer, inner) if layout in _ROW_LAYOUTS else (inner, outer)
    # (keyed by the orientation: the same members may be proven for a CSR and a CSC matrix)
    pair: tuple[T, T] = _cached(cache, ("native", "outer", layout in _ROW_LAYOUTS), make)
    return pair


def _ptr_of(t: T | None) -> int | None:
    return None if t is None else t.data_ptr()


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Products


def product(layout: torch.layout, compressed: T, plain: T, values: T, n_rows: int,
            n_cols: int, transposed: bool, x: T, xk: int, xn: int, n: int, y: T, yi: int,
            yn: int, bias: T | None = None,
            cache: dict[Hashable, Any] | None = None) -> bool:
    """``Y = M @ X (+ bias)`` for ``M = A`` (or ``A.T``), ``X[k, n] = x[k * xk + n * xn]``,
    ``Y[row, n] = y[row * yi + n * yn]`` (``y`` fresh, written whole); False when the library
    refused (the caller computes with torch ops)."""
    rows = _rowwise(layout, compressed, plain, values, n_rows, n_cols, transposed, cache)
    if x.dtype == torch.bfloat16 and layout in _BLOCK_LAYOUTS:
        if _product_bf16(rows, values, n_rows if transposed else n_cols, x, xk, xn, n, y, yi,
                         yn, bias):
            return True
        if yi == 1:
            x = _widened(x)  # no bfloat16 kernels here: the float32 route
    work = _compute(x.dtype)
    vals = values if values.dtype == work else values.to(work)
    if vals is not values:
        rows.sp, rows.sa, rows.sb = _value_strides(layout, vals)
        if transposed:
            rows.sa, rows.sb = rows.sb, rows.sa
    b = None if bias is None else bias.to(work).contiguous()
    n_in = n_rows if transposed else n_cols
    rc = _lib.ss_product(rows.crow.numel() - 1, rows.r, rows.c, rows.crow.data_ptr(),
                         rows.col.data_ptr(), _ptr_of(rows.order), vals.data_ptr(), rows.sp,
                         rows.sa, rows.sb, x.data_ptr(), _DTYPES[x.dtype], xk, xn, n_in, n,
                         y.data_ptr(), _DTYPES[y.dtype], yi, yn, _ptr_of(b), _threads())
    return bool(rc == 0)


def values_grad(layout: torch.layout, compressed: T, plain: T, values_shape: torch.Size,
                l_: T, li: int, ln: int, r_: T, ri: int, rn: int, n: int,
                dtype: torch.dtype, cache: dict[Hashable, Any] | None = None) -> T | None:
    """Per stored block p at (i, j): ``G_p[a, b] = sum_n L[i r + a, n] R[j c + b, n]`` in the
    values' shape and ``dtype``; ``L[row, n] = l_[row * li + n * ln]``, likewise ``R``;
    operands in float32 / float64 (their common dtype). None when the library refused this
    operand layout."""
    if layout in _BLOCK_LAYOUTS:
        r, c = int(values_shape[1]), int(values_shape[2])
    else:
        r, c = 1, 1
    rows, cols = _outer(layout, compressed, plain, cache)
    nnzb = rows.numel()
    if l_.dtype == torch.bfloat16:
        got = _values_grad_bf16(rows, cols, r, c, l_, li, ln, r_, ri, rn, n, values_shape)
        if got is not None:
            return got.to(dtype)
        l_, r_ = _widened(l_), _widened(r_)  # the float32 route
    g = torch.empty((nnzb, r, c), dtype=l_.dtype)
    rc = _lib.ss_values_grad(nnzb, r, c, rows.data_ptr(), cols.data_ptr(), l_.data_ptr(), li,
                             ln, r_.data_ptr(), ri, rn, n, _DTYPES[l_.dtype], g.data_ptr(),
                             _threads())
    if rc != 0:
        return None
    return g.view(values_shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# bfloat16 computed in bfloat16 (csrc/kern_bf16.h: AVX512_BF16, float32 sums, no float32 copy
# of the values, the input or the gradient). Elsewhere (no AVX512_BF16, CSR / CSC, operands
# neither batch- nor feature-major) bfloat16 is computed in float32 from float32 copies, as
# before (measured: the copies' memory is twice the step's floor).

_bf16_bound: bool | None = None


def _bf16_library() -> bool:
    """Whether the loaded library has the bfloat16 kernels and this CPU runs them
    (``SAFESPARSE_NATIVE_ISA=avx2`` or ``avx512f`` turns them off, for measurements)."""
    global _bf16_bound
    if _bf16_bound is None:
        want = os.environ.get("SAFESPARSE_NATIVE_ISA", "").strip().lower()
        try:
            lib = _lib
            lib.ss_bf16_supported.restype = _int
            lib.ss_product_bf16.restype = _int
            lib.ss_product_bf16.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr,
                                            _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
                                            _ptr, _i64, _i64, _ptr, _int]
            lib.ss_values_grad_bf16.restype = _int
            lib.ss_values_grad_bf16.argtypes = [_i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr,
                                                _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _int]
            _bf16_bound = want not in ("avx2", "avx512f") and bool(lib.ss_bf16_supported())
        except AttributeError:
            _bf16_bound = False
    return _bf16_bound


def reads_bf16(dtype: torch.dtype, layout: torch.layout) -> bool:
    """Whether the native products of a ``layout`` matrix read ``dtype`` operands as they are
    (bfloat16 computed in bfloat16): the callers then hand them in without a float32 copy."""
    return (dtype == torch.bfloat16 and layout in _BLOCK_LAYOUTS and available()
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


def _index_error() -> RuntimeError:
    return RuntimeError(
        "safesparse: the native bfloat16 kernel read a block index out of range (index "
        "members written while the product ran?); nothing out of bounds was read\n  Do not "
        "write a matrix's index members while a product runs on them.")


def _product_bf16(rows: _Rows, values: T, n_in: int, x: T, xk: int, xn: int, n: int, y: T,
                  yi: int, yn: int, bias: T | None) -> bool:
    """:func:`product` in bfloat16, batch-major (``xk == yi == 1``) or feature-major
    (``xn == yn == 1``); False where the bfloat16 kernels do not run it."""
    if (not _bf16_library() or not ((xk == 1 and yi == 1) or (xn == 1 and yn == 1))
            or values.dtype != torch.bfloat16
            or y.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16)):
        return False
    b = None if bias is None else bias.contiguous()
    nnzb = rows.col.numel()
    rc = _lib.ss_product_bf16(rows.crow.numel() - 1, rows.r, rows.c, rows.crow.data_ptr(),
                              rows.col.data_ptr(), _ptr_of(rows.order), nnzb, n_in // rows.c,
                              values.data_ptr(), int(values.shape[0]), rows.sp, rows.sa,
                              rows.sb, x.data_ptr(), xk, xn, n, y.data_ptr(), yi, yn,
                              _ptr_of(b), _threads())
    if rc == -3:
        raise _index_error()
    return bool(rc == 0)


def _values_grad_bf16(rows: T, cols: T, r: int, c: int, l_: T, li: int, ln: int, r_: T,
                      ri: int, rn: int, n: int, values_shape: torch.Size) -> T | None:
    """:func:`values_grad` in bfloat16 for batch-major operands (``li == ri == 1``) or
    operands contiguous along the batch (``ln == rn == 1``), or None."""
    if (not _bf16_library() or not ((li == 1 and ri == 1) or (ln == 1 and rn == 1))
            or r_.dtype != torch.bfloat16
            or len(values_shape) != 3):
        return None
    nnzb = rows.numel()
    g = torch.empty((nnzb, r, c), dtype=torch.bfloat16)
    rc = _lib.ss_values_grad_bf16(nnzb, r, c, rows.data_ptr(), cols.data_ptr(),
                                  l_.shape[0] // r, r_.shape[0] // c, l_.data_ptr(), li, ln,
                                  r_.data_ptr(), ri, rn, n, g.data_ptr(), _threads())
    if rc == -3:
        raise _index_error()
    return g.view(values_shape) if rc == 0 else None
