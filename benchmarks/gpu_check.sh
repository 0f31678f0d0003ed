#!/usr/bin/env bash
# The device check of the opt-in Pallas Triton kernels (issue 37): the row kernels
# (kldiv_jax/_gpu_rows.py; with the gradient pass's, kldiv_jax/_gpu_grad.py, in every
# value_and_grad the row steps time, and in test_gpu_rows.py's gradients) and the fused LM-head kernels (kldiv_jax/_gpu_fused_head.py,
# kldiv_jax/_gpu_fused_distill.py, kldiv_jax/_gpu_fused_topk.py), one
# command on a machine with an NVIDIA GPU (python3 with jax[cuda], pytest, numpy):
#
#   bash benchmarks/gpu_check.sh          # at most 1200 s (the steps' limits), compiles included
#   GPU_CHECK_STEPS=env,quick,full,tests,whole bash benchmarks/gpu_check.sh   # in two calls
#   GPU_CHECK_STEPS=sweep,head-quick,head,head-tests bash benchmarks/gpu_check.sh  # of <= 600 s
#   GPU_CHECK_STEPS=distill-quick,distill,distill-tests bash benchmarks/gpu_check.sh  # <= 240 s
#   GPU_CHECK_STEPS=topk-quick,topk,topk-tests bash benchmarks/gpu_check.sh  # <= 220 s
#
# 1. a smoke test: three row cases at a small shape, the kernels off and on side by side;
# 2. the issue's shapes, (4096, 8192) float32 and (2048, 131072) bfloat16, value_and_grad,
#    XLA's path and the kernels' in one round-robin (medians, the floor's TB/s, values);
# 3. tests/test_gpu_rows.py with the kernels compiled by Triton for real (not interpreted),
#    against XLA's path on the same GPU (tests/test_gpu_grad_pass.py, the gradient pass's
#    own tests: step grad-tests, in a later session's list);
# 4. the whole-row kernel (JSD, skew KL, skew reverse KL, TVD at (4096, 8192) float32: a
#    program holds a row pair, one read of the logits) against XLA's path, the split kernels
#    at their old layout (4x1024w4s3: two reads) and whole rows at 8 and 32 warps (1x0w8s1,
#    1x0w32s1; the default is 16);
# 5. a sweep of the kernels' layout (rows per program x tile, warps, stages) for forward KL
#    (one-pass kernel) and JSD (statistics + class sums kernels) at the same shapes;
# 6. the fused token log-probs (16384 x 2048 x 131072 bf16, value_and_grad wrt hidden and
#    weight): the materialised loss, XLA's chunk loop and the fused-head kernels (both
#    backwards, and two more layouts: blocks of 128 x 128 x 64, 8 warps) in one round-robin
#    (--quick first), and tests/test_gpu_fused_head.py compiled by Triton;
# 7. the fused distillation loss (16384 x 2048 x 131072 bf16, forward KL with labels): the
#    materialised loss, XLA's chunk loop and the distillation kernels (both backwards, and the
#    token kernels' layout 64 x 128 x 64, 4 warps, beside their own 64 x 64 x 64, 8 warps) in
#    one round-robin (--quick first), and tests/test_gpu_fused_distill.py compiled by Triton;
# 8. the fused top-k distillation loss (16384 x 2048 x 131072 bf16, k = 64, forward KL): the
#    materialised loss, XLA's chunk loop and the top-k kernels (both backwards, and blocks of
#    128 x 128 x 64, 8 warps) in one round-robin (--quick first), and
#    tests/test_gpu_fused_topk.py compiled by Triton.
# Results: $OUT/gpu-check/ (or benchmarks/results/gpu-check/): device-*.json and the logs.
# Each step has its own time limit; a step that fails or times out does not stop the next.
# GPU_CHECK_STEPS=head-quick,head,head-tests runs only those steps (the fused head's).
# The steps' limits add up to 1200 s, more than one session's 15 device minutes (which also
# pay for the machine's start). In order of what each decides, with a session's time:
#   1. GPU_CHECK_STEPS=env,quick,full,tests,whole (<= 445 s): the row kernels' speed and
#      correctness compiled by Triton; a default may change only on these figures;
#   2. GPU_CHECK_STEPS=head-quick,head,distill-quick,topk-quick (<= 270 s): the fused-head
#      kernels against the issue's targets (token log-probs, policy), the others' smoke runs;
#   3. (a later session) grad-tests,distill,topk,head-tests,distill-tests,topk-tests,sweep.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/benchmarks:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
RES="${OUT:-benchmarks/results}/gpu-check"
mkdir -p "$RES"
CASES="${GPU_CHECK_CASES:-forward_kl,reverse_kl,symmetric_kl,jsd,skew_kl,skew_reverse_kl,tvd,alpha_beta}"
step() {  # step NAME SECONDS CMD... (only the steps named in $GPU_CHECK_STEPS, if set)
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then return; fi
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$RES/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
}
step env 20 "$PY" -c 'import jax; print(jax.__version__, jax.devices())'
step quick 35 "$PY" benchmarks/bench_device.py --quick --cases forward_kl,jsd,tvd \
  --gpu-kernels both --repeats 5 --out "$RES/quick"
step full 150 "$PY" benchmarks/bench_device.py --cases "$CASES" --gpu-kernels both \
  --repeats 7 --out "$RES/full"
step tests 150 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider tests/test_gpu_rows.py
step grad-tests 90 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider \
  tests/test_gpu_grad_pass.py
step whole 90 "$PY" benchmarks/bench_device.py --cases jsd,skew_kl,skew_reverse_kl,tvd \
  --shapes 4096x8192:float32 --gpu-kernels both \
  --gpu-configs "${GPU_CHECK_WHOLE_CONFIGS:-4x1024w4s3,1x0w8s1,1x0w32s1}" --repeats 7 \
  --out "$RES/whole"
step sweep 45 "$PY" benchmarks/bench_device.py --cases forward_kl,jsd --gpu-kernels both \
  --gpu-configs "${GPU_CHECK_CONFIGS:-2x2048w8s3,8x512w8s3}" --repeats 5 --out "$RES/sweep"
fused_steps() {  # fused_steps NAME CASE SECONDS CONFIGS TESTS: --quick, the full run, the tests
  local name=$1 case=$2 limit=$3 configs=$4 tests=$5
  step "$name-quick" 40 "$PY" benchmarks/bench_device.py --quick --cases "$case" \
    --gpu-kernels both --repeats 3 --out "$RES/$name-quick"
  step "$name" "$limit" "$PY" benchmarks/bench_device.py --cases "$case" --gpu-kernels both \
    --head-configs "$configs" --repeats 5 --out "$RES/$name"
  step "$name-tests" 60 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider "$tests"
}
fused_steps head fused_token_log_probs 150 \
  "${GPU_CHECK_HEAD_CONFIGS:-owned:128x128x64w8s3,atomic:128x128x64w8s3}" \
  tests/test_gpu_fused_head.py
fused_steps distill fused_distillation 140 "${GPU_CHECK_DISTILL_CONFIGS:-owned:64x128x64w4s3}" \
  tests/test_gpu_fused_distill.py
fused_steps topk fused_topk 120 "${GPU_CHECK_TOPK_CONFIGS:-owned:128x128x64w8s3}" \
  tests/test_gpu_fused_topk.py
echo "=== summary (gpu: the kernels' time / XLA's, and the floor's TB/s)"
grep -h -A6 "kldiv_jax " "$RES"/full.log "$RES"/whole.log "$RES"/sweep.log | grep -v "^--" || true
grep -h -A4 "^fused_token_log_probs" "$RES"/head.log || true
grep -h -A4 "^fused_distillation" "$RES"/distill.log || true
grep -h -A4 "^fused_topk" "$RES"/topk.log || true
tail -n 3 "$RES/tests.log" "$RES/head-tests.log" "$RES/distill-tests.log" "$RES/topk-tests.log" ||
  true
