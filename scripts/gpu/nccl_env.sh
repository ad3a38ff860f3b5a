# Source this before a data-parallel run on a GPU machine whose NCCL comes with PyTorch
# (pip's nvidia-nccl-cu12 ships libnccl.so.2 only; cudarc loads libnccl.so): links it as
# libnccl.so in a private folder on LD_LIBRARY_PATH and turns NVLink multicast off, as the
# lent machines require.   . scripts/gpu/nccl_env.sh
export NCCL_NVLS_ENABLE=0
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_lib=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia.nccl, os.path as p
    roots = [p.join(d, "lib") for d in nvidia.nccl.__path__]
except Exception:
    roots = []
for r in roots:
    for f in sorted(glob.glob(os.path.join(r, "libnccl.so*"))):
        print(f); raise SystemExit
PY
)
  if [ -n "${nccl_lib:-}" ]; then
    mkdir -p "${TMPDIR:-/tmp}/tandem-nccl"
    ln -sf "$nccl_lib" "${TMPDIR:-/tmp}/tandem-nccl/libnccl.so"
    export LD_LIBRARY_PATH="${TMPDIR:-/tmp}/tandem-nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "nccl: $nccl_lib" >&2
  else
    echo "nccl: no libnccl found (install nvidia-nccl-cu12 or NCCL)" >&2
  fi
fi
