#!/usr/bin/env bash
# scripts/cuda_check.sh -- the GPU checks, run by hand on a machine with a CUDA device and
# a CUDA build of torch (not in CI, which has no GPU).
#
# Builds the extensions in place with the python3 found there (its torch, cython and
# numpy), then, logs under $OUT (default /tmp/mxfp4x-cuda):
#   1. the machine: GPU, driver, torch, CPU;
#   2. tests/cuda (the Triton kernel, the modules, autograd, torch.compile and
#      `bench --device cuda` on CUDA tensors);
#   3. the main job on CUDA tensors, float32 and bfloat16 latents, against the GPU's roofs
#      (the Triton kernel and the torch backend);
#   4. the Triton kernels' block sizes (token kernel rows, warps, stages at T <= 16; tile rows and
#      the tensor cores' tile height above), each timed as CUDA-graph replays against the
#      read floor, with whether every size gave the same bits;
#   5. whether a token's row on the GPU has the same bits alone as in a batch of 8, 64 and
#      512, float32 and bf16, through the default path and the torch backend (cuBLAS's,
#      which is not held to it);
#   6. gpt-oss (4 of gpt-oss-20b's layers at full width, random weights) decoding with its
#      experts in CPU memory and the rest on the GPU (split_devices), beside the same model
#      whole on the CPU: tokens/s and the same greedy tokens;
#   7. the CPU kernels on that machine's cores (bench, 1 and all threads) and the kernel
#      tests there (every ISA its CPU runs); MXFP4X_CUDA_CHECK_CPU=0 leaves this out.
# Steps 2-7 are "tests bench sweep bits hybrid cpu" in MXFP4X_CUDA_CHECK_STEPS (below).
# Each step has a time limit; one failing step does not stop the next.
set -u
# MXFP4X_CUDA_CHECK_STEPS: the steps to run, of "tests bench sweep bits hybrid cpu" (all by
# default; the build and the machine's facts always), so that the check fits calls of a
# limited length: e.g. "tests bench sweep" in one, "bits hybrid" in the next
STEPS=" ${MXFP4X_CUDA_CHECK_STEPS:-tests bench sweep bits hybrid cpu} "
[ "${MXFP4X_CUDA_CHECK_CPU:-1}" = 0 ] && STEPS=${STEPS/ cpu / }
want() { case "$STEPS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-/tmp/mxfp4x-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cores=$(nproc)

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
lscpu | grep -E "^Model name|^CPU\(s\)|^Flags" | cut -c1-1200
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== build"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace -j "$cores" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
python3 -c "import mxfp4x; print(mxfp4x.backend_info())"

if want tests; then
echo "== tests/cuda"
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs tests/cuda 2>&1 \
    | tee "$OUT/cuda_tests.log" | tail -25
fi

if want bench; then
echo "== python -m mxfp4x --device cuda"
for dtype in float32 bfloat16; do
    timeout 150 python3 -m mxfp4x --device cuda --dtype $dtype --tokens 1 4 16 128 512 \
        --json "$OUT/bench_cuda_$dtype.json"
done
fi

if want sweep; then
echo "== the kernels' block sizes: CUDA-graph replays of 20 calls, gate/up, and their bits"
timeout 240 python3 - <<'EOF'
import itertools
import torch
import mxfp4x
from mxfp4x._core import triton_impl as ti
from mxfp4x._measure import gpu
from mxfp4x.testing import bench

dev = torch.device("cuda")
read = gpu.read_bandwidth(dev)
packed, scales = (t.cuda() for t in bench.make_experts(32, 5760, 2880))
defaults = {k: getattr(ti, k) for k in ("TOKEN_BLOCK_O", "TOKEN_WARPS", "TOKEN_STAGES",
                                         "BLOCK_O", "MMA_TILE")}


def replay_ms(fn):
    return gpu.graph_time(lambda: [fn() for _ in range(20)], dev, 5) * 1e3 / 20


for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 4, 16, 128, 512):
        x, sel, mix, shared = (t.cuda() for t in bench.make_tokens(n, 4, 32, 2880, 5760, dtype))
        floor = bench.streamed_bytes(packed, scales, sel) / read * 1e3
        if n <= 16:
            grid = itertools.product((32, 64, 128), (1, 4), (1, 3), (defaults["BLOCK_O"],),
                                     (defaults["MMA_TILE"],))
        else:
            grid = itertools.product((defaults["TOKEN_BLOCK_O"],), (defaults["TOKEN_WARPS"],),
                                     (defaults["TOKEN_STAGES"],), (64, 128, 256),
                                     (16, 32) if dtype != torch.float32
                                     else (defaults["MMA_TILE"],))
        results, first = [], None
        for bo, warps, stages, tile_bo, mma_tile in grid:
            (ti.TOKEN_BLOCK_O, ti.TOKEN_WARPS, ti.TOKEN_STAGES, ti.BLOCK_O,
             ti.MMA_TILE) = bo, warps, stages, tile_bo, mma_tile
            try:
                y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)
                ms = replay_ms(lambda: mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared))
            except Exception as e:  # a block size the GPU cannot hold
                print(f"  {dtype} T={n} {bo}/{warps}/{stages}/{tile_bo}/{mma_tile}: "
                      f"{type(e).__name__}: {str(e)[:200]}")
                continue
            first = y if first is None else first
            results.append((ms, f"{bo}/{warps}/{stages}/{tile_bo}/{mma_tile}",
                            torch.equal(y, first)))
        for k, v in defaults.items():
            setattr(ti, k, v)
        results.sort()
        print(f"{dtype} T={n}: read floor {floor:.4f} ms; token rows/warps/stages, tile "
              f"rows, MMA tile height: ms, x floor, the same bits as the first size's")
        for ms, config, same in results[:4] + results[-1:]:
            print(f"  {ms:.4f} x{ms / floor:5.1f}  {config}  {same}")
EOF
fi

if want bits; then
echo "== one token alone against the same token in a batch, on the GPU"
timeout 90 python3 - <<'EOF'
import torch
import mxfp4x
from mxfp4x.testing import bench

packed, scales = (t.cuda() for t in bench.make_experts(32, 2880, 2880))
for dtype in (torch.float32, torch.bfloat16):
    for n in (8, 64, 512):
        x, sel, mix, shared = (t.cuda() for t in bench.make_tokens(n, 4, 32, 2880, 2880, dtype))
        for backend in ("auto", "torch"):
            full = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, backend=backend)
            same = sum(torch.equal(mxfp4x.mxfp4_experts(
                x[t:t + 1], packed, scales, sel[t:t + 1], mix[t:t + 1], shared[t:t + 1],
                backend=backend)[0], full[t]) for t in range(0, n, max(1, n // 16)))
            print(f"{backend}: {dtype} T={n}: {same} of {len(range(0, n, max(1, n // 16)))} "
                  "rows bit-identical alone and in the batch")
EOF
fi

if want hybrid; then
echo "== gpt-oss decoding, experts in CPU memory and the rest on the GPU, against all on the CPU"
timeout 400 python3 - <<'EOF'
import os, time
import torch
import mxfp4x.integrations.transformers as mxt
from mxfp4x.testing.gpt_oss import write_gpt_oss_model

folder = "/tmp/mxfp4x-gpt-oss-4-layers"
if not os.path.exists(os.path.join(folder, "config.json")):
    write_gpt_oss_model(folder, num_hidden_layers=4)
ids = torch.randint(0, 200000, (1, 128), generator=torch.Generator().manual_seed(0))
runs = {}
for side in ("cpu", "split"):
    model = mxt.from_pretrained(folder, dtype=torch.bfloat16).eval()
    dev = "cpu" if side == "cpu" else "cuda"
    if side == "split":
        mxt.split_devices(model, "cuda")
    kw = dict(do_sample=False, max_new_tokens=32, min_new_tokens=32)
    model.generate(ids.to(dev), do_sample=False, max_new_tokens=2)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids.to(dev), **kw).cpu()
    spent = time.perf_counter() - t0
    runs[side] = out
    print(f"{side}: {32 / spent:.2f} tok/s (prompt 128 + 32 greedy tokens, {spent:.2f} s)")
    del model
print("same greedy tokens:", torch.equal(runs["cpu"], runs["split"]))
EOF
fi

if ! want cpu; then exit 0; fi
echo "== the CPU kernels on this machine ($cores cores)"
timeout 150 python3 -m mxfp4x --threads 1 "$cores" --tokens 1 4 128 --no-torch
timeout 120 python3 -m pytest -p no:cacheprovider -q -x -n "$cores" tests/kernels 2>&1 \
    | tail -8
