#!/usr/bin/env bash
# One `run` call for a GPU lent to a session (about 8 minutes; the device tool's time is 15 minutes a session, start
# included): what the open issues still need from CUDA, most needed first, each step with its own time limit so that
# a step that hangs can't take the others' time. Carry `.whl` (benchmarks/README.md says how to fill it).
#
#   run: bash benchmarks/gpu_session.sh        carry: [".whl"]   timeout_s: 560
#
# Writes under $OUT (at most 8 files come back): misses/misses.json, conv/cudnn_conv.json, reductions/reductions.json,
# probes/probes.json (+ its snapshot pickles), pytest-cuda.log, session.log.
set -uo pipefail
OUT=${OUT:?run it through the device tool, which sets OUT}

steps() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || echo "wheels not installed: the magics' tests will say not run"
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  # 1. issue 24: the allocator's history where estimates still miss, and cuDNN's RNN/convolution sizes
  timeout 170 python3 benchmarks/gpu_probes_misses.py --out "$OUT/misses" --budget 140
  # 1b. issue 24: whole CNNs measured beside their estimates (cuDNN's convolution workspaces, fitted on one layer)
  timeout 90 python3 benchmarks/bench_cudnn_conv.py --out "$OUT/conv"
  # 1c. issue 24: split reductions' staging buffers beyond 1,024 rows, other widths, dtypes and families
  timeout 45 python3 benchmarks/gpu_probe_reductions.py --out "$OUT/reductions" --budget 30
  # 2. issues 23, 26, 27: nbmem's CUDA tests (measured mode, magics, snapshots, compiled steps); the whole log kept.
  # Only the files that hold them, as gpu_campaign.py runs them: collecting every test file would import libraries
  # the device lacks (playwright, lightning...), and pytest runs nothing after a collection error
  timeout 130 python3 -m pytest -q -m cuda -rfEs -p no:cacheprovider tests/test_cuda.py tests/test_reclaim.py \
    > "$OUT/pytest-cuda.log" 2>&1
  tail -n 5 "$OUT/pytest-cuda.log"
  # 3. issues 26, 27: a live snapshot against torch's counters, the accelerator API
  timeout 110 python3 benchmarks/gpu_probes.py --out "$OUT/probes" --budget 90 --sections accel,nbmem-snapshot
  echo "session done"
}

steps 2>&1 | tee "$OUT/session.log"
