#!/usr/bin/env bash
# The torch engine's `gpu` tests on a machine with CUDA (tests/test_gpu.py, a few minutes): greedy speculative
# token-identical to decode on the device (forced, schema, lookup, draft model), static/dynamic KV cache crop ==
# from scratch, masks uploaded through the pinned buffer, the sampled distribution on the device, and the
# bf16/fp16 greedy-identity record. Tiny random models only; the SmolLM2 tokenizer must be installed (make setup).
#
#   scripts/gpu_check.sh                      # with .venv/bin/python (needs a CUDA build of torch)
#   PYTHON=/path/to/python scripts/gpu_check.sh
#   SMOL_TOK_DIR=dir scripts/gpu_check.sh     # no SmolLM2 package there: its tokenizer files from dir
#                                             # (config.json, tokenizer*.json from ~/.cache/specagent/models/<sha>)
#
# Exits 2 when CUDA is not available (the tests would only be skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF'
import sys, torch, transformers
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}")
if not torch.cuda.is_available():
    print("CUDA is not available: nothing to check here", file=sys.stderr)
    sys.exit(2)
print(f"device: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
PYEOF
PLUGIN=()
if [ -n "${SMOL_TOK_DIR:-}" ]; then
  export PYTHONPATH="$PWD/scripts:$PYTHONPATH"
  PLUGIN=(-p gpu_tokenizer_plugin)
fi
exec "$PY" -m pytest -q -m gpu -p no:cacheprovider "${PLUGIN[@]}" tests/test_gpu.py "$@"
