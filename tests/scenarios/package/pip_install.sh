#!/usr/bin/env bash
# The Python package installs as the README says: pip, offline, into a venv over Debian's torch;
# then `import hyper_parallel` works from any directory, from the venv's copy (with its _C and
# the C++ library beside it), and a 2-rank MC2 layer runs.
#   pip_install.sh BUILD_PYTHON_DIR HP_RUN
set -euo pipefail
package=$1 hp_run=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --no-build-isolation --no-index "$package" >"$work/pip.log" 2>&1 \
  || { cat "$work/pip.log"; echo "FAIL: pip install"; exit 1; }
cd /
where=$(env -u PYTHONPATH "$work/venv/bin/python" -c 'import hyper_parallel, hyper_parallel._C as C; print(hyper_parallel.__file__); print(C.__file__)')
grep -q "^$work/venv/" <<<"$where" || { echo "$where"; echo "FAIL: expected the venv's hyper_parallel"; exit 1; }
cat >"$work/mc2.py" <<'PY'
import torch, torch.distributed as dist
from torch import nn
from hyper_parallel import init_device_mesh, parallelize_module, MC2ColwiseParallel, MC2RowwiseParallel
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
mlp = nn.Sequential(nn.Linear(512, 1024), nn.SiLU(), nn.Linear(1024, 512)).bfloat16()
parallelize_module(mlp, mesh, {"0": MC2ColwiseParallel(), "2": MC2RowwiseParallel()})
y = mlp(torch.randn(2, 4, 512).bfloat16())
y.float().sum().backward()
print("mc2 ok", tuple(y.shape))
dist.destroy_process_group()
PY
out=$(env -u PYTHONPATH OMP_NUM_THREADS=1 "$hp_run" --nproc-per-node 2 --timeout 120 -- "$work/venv/bin/python" "$work/mc2.py" 2>&1) \
  || { echo "$out"; echo "FAIL: the installed package's MC2 layers"; exit 1; }
grep -q "mc2 ok (2, 4, 512)" <<<"$out" || { echo "$out"; echo "FAIL: no output"; exit 1; }
echo "pip_install.sh: installed into a venv; imported from / as $(head -n 1 <<<"$where"); 2-rank MC2 ran"
