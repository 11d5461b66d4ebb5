"""Child process of tests/enforcement/test_protect.py: PyG conversions of corrupted edge_index,
enforced.

Prints one line per case: ``<case> refused <InvariantError id>``, ``<case> ok`` or
``<case> error <type>``. A crash kills the process (the parent sees a negative status).
"""

from __future__ import annotations

import sys
import warnings

import torch

import safesparse as ss

warnings.filterwarnings("ignore")
from torch_geometric import EdgeIndex  # noqa: E402
from torch_geometric.data import Data  # noqa: E402
from torch_geometric.nn import GCNConv  # noqa: E402
from torch_geometric.transforms import ToSparseTensor  # noqa: E402
from torch_geometric.utils import (  # noqa: E402
    to_torch_coo_tensor,
    to_torch_csc_tensor,
    to_torch_csr_tensor,
)

N = 4
BAD = {"too_large": N, "far": 10**7, "negative": -1}


def edge_index(row: bool, bad: int) -> torch.Tensor:
    ei = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 3, 2]])
    ei[0 if row else 1, 2] = bad
    return ei


def gcn(ei: torch.Tensor) -> torch.Tensor:
    data = ToSparseTensor(layout=torch.sparse_csr)(Data(x=torch.randn(N, 3), edge_index=ei,
                                                       num_nodes=N))
    return GCNConv(3, 2, normalize=False)(data.x, data.adj_t)


CASES = {
    "to_torch_csr_tensor": lambda ei: to_torch_csr_tensor(ei, size=(N, N)),
    "to_torch_coo_tensor": lambda ei: to_torch_coo_tensor(ei, size=(N, N)),
    "to_torch_csc_tensor": lambda ei: to_torch_csc_tensor(ei, size=(N, N)),
    "ToSparseTensor+GCNConv": gcn,
    "EdgeIndex.to_sparse_csr": lambda ei: EdgeIndex(ei, sparse_size=(N, N)).sort_by("row")[0]
    .to_sparse_csr(),
}

ss.set_enforce(True)
for name, run in CASES.items():
    for bad_name, bad in BAD.items():
        for row in (True, False):
            case = f"{name}/{bad_name}/{'row' if row else 'col'}"
            try:
                out = run(edge_index(row, bad))
            except ss.InvariantError as err:
                print(case, "refused", err.invariant)
                continue
            except Exception as err:  # a clear Python error is no crash either
                print(case, "error", type(err).__name__)
                continue
            sparse = out if out.layout != torch.strided else None
            print(case, "ok" if sparse is None or ss.is_checked(sparse) else "UNCHECKED")
# in range but not coalesced (column order within row 1 broken): refused with 5.6
uncoalesced = torch.tensor([[0, 1, 1, 2, 3], [1, 2, 0, 3, 2]])
try:
    EdgeIndex(uncoalesced, sparse_size=(N, N), sort_order="row").to_sparse_csr()
    print("EdgeIndex.to_sparse_csr/uncoalesced ok")
except ss.InvariantError as err:
    print("EdgeIndex.to_sparse_csr/uncoalesced refused", err.invariant)
sys.stdout.flush()
