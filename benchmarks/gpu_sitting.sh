#!/bin/bash
# A device sitting of the learner's CUDA path, prepared here and run on a lent GPU machine (which has
# torch, transformers and nvcc but no package registry, no DeepSpeed and no redis-server).
#
#   bash benchmarks/gpu_sitting.sh prepare   # here: wheels into .whl/, redis-server + libs into .gpu/
#   bash benchmarks/gpu_sitting.sh run       # there, carrying [".whl", ".gpu"]; results under $OUT
#
# `run`: the gpu-marked unit tests that fit one GPU, `asyncrl.bench.gpu_learner` at the 0.5B shape
# (every section) and the 1.5B shape's reference and ZeRO-3 sections, then a short summary (the tool
# returns only the output's tail). ~5-6 minutes on an H200 plus the machine's start.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
case "${1:-}" in
prepare)
    for d in /.whl/ /.gpu/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude; done
    mkdir -p .whl .gpu/lib
    P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
    P="$P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
    V() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
    for p in hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions omegaconf redis; do
        python3 -m pip download -q $P -d .whl "$p==$(V $p)" || exit 1
    done
    # DeepSpeed ships an sdist only: a pure-Python wheel (its ops are JIT-built where needed).
    .venv/bin/pip wheel -q --no-deps --no-build-isolation "deepspeed==$(V deepspeed)" -w .whl || exit 1
    cp -L "$(command -v redis-server)" .gpu/redis-server
    ldd .gpu/redis-server | awk '/(lzf|jemalloc)/ {print $3}' | xargs -r -I{} cp -L {} .gpu/lib/
    du -sh .whl .gpu
    ;;
run)
    export PYTHONUNBUFFERED=1
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$ROOT PATH=$ROOT/.gpu:$PATH LD_LIBRARY_PATH=$ROOT/.gpu/lib
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
    python3 -c "import torch, deepspeed, transformers; print(torch.__version__, deepspeed.__version__, transformers.__version__)" || exit 4
    D=$(date -u +%Y-%m-%d-%H%M)
    echo "== gpu tests $(($(date +%s) - t0)) s"
    timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="-ra --timeout=150" \
        tests/unit/test_checkpoint_rank_flag.py tests/unit/test_weight_broadcast.py >"$OUT/gpu-tests-$D.log" 2>&1
    echo "pytest rc=$?"; tail -8 "$OUT/gpu-tests-$D.log"
    echo "== 0.5B $(($(date +%s) - t0)) s"
    timeout "${T05:-330}" python3 -m asyncrl.bench.gpu_learner --shape qwen2.5-0.5b --steps "${STEPS:-6}" \
        --out "$OUT/gpu-learner-$D-h200-qwen2.5-0.5b.json" >"$OUT/gpu-learner-0.5b.log" 2>&1
    echo "0.5B rc=$?"; tail -4 "$OUT/gpu-learner-0.5b.log"
    echo "== 1.5B $(($(date +%s) - t0)) s"
    timeout "${T15:-150}" python3 -m asyncrl.bench.gpu_learner --shape qwen2.5-1.5b \
        --skip gradient,guard,throughput,zero1,zero2,floors \
        --out "$OUT/gpu-learner-$D-h200-qwen2.5-1.5b-reference-zero3.json" >"$OUT/gpu-learner-1.5b.log" 2>&1
    echo "1.5B rc=$?"; tail -4 "$OUT/gpu-learner-1.5b.log"
    echo "== done $(($(date +%s) - t0)) s"
    python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/gpu-learner-*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], {k: round(v) for k, v in d["marks_s"].items()})
    print("  failed checks", [k for k, v in d.get("checks", {}).items() if not v], "errors", list(d["errors"]))
    print("  reference", d.get("reference"))
    tp = d.get("throughput") or {}
    print("  throughput", {k: round(v, 4) for k, v in tp.items() if isinstance(v, float)})
    for st, z in (d.get("zero") or {}).items():
        if z:
            print("  zero", st, {k: round(v, 4) if isinstance(v, float) else v for k, v in z.items()})
PY
    ;;
*) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
