import sys, time, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
torch.set_num_threads(1)
import safesparse as ss, safetensors.torch as st
from safesparse.safetensors import save_file, load_file
from inputs import make_compressed
inp = make_compressed(10**7, torch.sparse_csr, torch.Generator().manual_seed(0))
w = ss.sparse_csr_tensor(inp.compressed, inp.plain, inp.values, inp.size)
save_file({"w": w, "b": torch.ones(3)}, "/tmp/p.safetensors")
def plain():
    f = st.load_file("/tmp/p.safetensors")
    return torch.sparse_csr_tensor(f["w.__ss_crow_indices"], f["w.__ss_col_indices"], f["w.__ss_values"], inp.size, check_invariants=True)
def ours(): return load_file("/tmp/p.safetensors")
def touchvals():
    f = st.load_file("/tmp/p.safetensors"); return f["w.__ss_values"].sum()
res = {k: [] for k in ("plain", "ours", "touchvals")}
for _ in range(10):
    for k, fn in (("plain", plain), ("ours", ours), ("touchvals", touchvals)):
        s = time.process_time(); fn(); res[k].append(time.process_time() - s)
for k, v in res.items(): print(k, f"cpu min {min(v)*1e3:.1f} ms  median {sorted(v)[5]*1e3:.1f}")
