"""The native library's declared interface (csrc/blockprod.h) and its ctypes bindings agree.

Claims: every function ``native._bind`` binds is declared in ``blockprod.h`` with the same
argument and result types (``int64_t`` -> ``c_int64``, ``uint64_t`` -> ``c_uint64``, ``int``
-> ``c_int``, pointers -> ``c_void_p``, ``const char *`` -> ``c_char_p``, ``void`` -> None),
and every declared function
is bound; the bindings' ABI number is the header's ``SS_ABI_VERSION`` (and the built library's);
the dtype codes come from the library, in the header's order; the SIMD mappings live in their
own headers, and setup.py lists every header as a dependency of the extension.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from safesparse.kernels import native

CSRC = Path(native.__file__).resolve().parent / "csrc"
HEADER = (CSRC / "blockprod.h").read_text()
ROOT = Path(__file__).resolve().parents[2]


def _ctype(decl: str) -> Any:
    decl = decl.strip()
    if decl == "void":
        return None
    if "char" in decl and "*" in decl:
        return ctypes.c_char_p
    if "*" in decl:
        return ctypes.c_void_p
    base = decl.replace("const", "").split()[0]
    return {"int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "int": ctypes.c_int}[base]


def declarations() -> dict[str, tuple[Any, list[Any]]]:
    """name -> (result type, argument types) of every function the header declares."""
    text = re.sub(r"/\*.*?\*/", "", HEADER, flags=re.S)
    out = {}
    for ret, name, args in re.findall(r"^([\w ]+?\**)\s*(ss_\w+)\(([^)]*)\);", text, re.M | re.S):
        params = [] if args.strip() in ("", "void") else [
            _ctype(re.sub(r"\w+$", "", a.strip())) for a in args.split(",")]
        out[name] = (_ctype(ret), params)
    return out


class _Recorder:
    """Stands in for the library: records what ``_bind`` sets on each function."""

    def __init__(self) -> None:
        self.functions: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        fn = self.functions.get(name)
        if fn is None:
            fn = self.functions[name] = type("Fn", (), {"restype": ctypes.c_int,
                                                        "argtypes": None})()
        return fn


def test_bindings_match_the_header() -> None:
    declared = declarations()
    assert {"ss_product", "ss_values_grad", "ss_last_error", "ss_abi_version"} <= set(declared)
    lib = _Recorder()
    native._bind(lib)
    bound = lib.functions
    assert set(bound) == set(declared), (set(bound) ^ set(declared))
    for name, (ret, args) in declared.items():
        assert bound[name].restype == ret, name
        assert list(bound[name].argtypes) == args, name


def test_abi_and_dtype_codes_have_one_source() -> None:
    found = re.search(r"#define SS_ABI_VERSION (\d+)", HEADER)
    assert found is not None and int(found.group(1)) == native._ABI
    names = re.search(r'#define SS_DTYPE_NAMES "([^"]+)"', HEADER)
    codes = dict(re.findall(r"SS_DT_(\w+) = (\d+)", HEADER))
    assert names is not None
    assert [int(codes[k]) for k in ("F32", "F64", "F16", "BF16")] == [0, 1, 2, 3]
    expected = {getattr(torch, n): i for i, n in enumerate(names.group(1).split())}
    assert set(expected) == {torch.float32, torch.float64, torch.float16, torch.bfloat16}
    if not native.status().native:
        pytest.skip(f"native kernels: {native.status().reason}")
    assert int(native._lib.ss_abi_version()) == native._ABI
    assert expected == native._DTYPES


def test_simd_mappings_in_their_own_headers_and_setup_lists_them() -> None:
    source = (CSRC / "blockprod.c").read_text()
    assert "_mm512_" not in source and "_mm256_" not in source
    for name in ("simd_avx512.h", "simd_avx2.h"):
        assert f'#include "{name}"' in source
        assert "#define LOADU" in (CSRC / name).read_text()
    setup = (ROOT / "setup.py").read_text()
    for header in sorted(CSRC.glob("*.h")):
        assert f"safesparse/kernels/csrc/{header.name}" in setup, header.name
