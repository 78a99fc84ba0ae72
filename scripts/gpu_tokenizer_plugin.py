"""A pytest plugin for scripts/gpu_check.sh on a machine without the SmolLM2 package: ``resolve_model("smollm2")``
returns the directory ``$SMOL_TOK_DIR`` (config.json and the tokenizer files of the converted model). The gpu tests
load only its tokenizer and build tiny random models over its vocabulary, so no weights need to travel."""
import os
from pathlib import Path

import decoding.loader as loader

_orig = loader.resolve_model


def _resolve(spec):
    if spec == "smollm2":
        return Path(os.environ["SMOL_TOK_DIR"]), "smollm2", None
    return _orig(spec)


loader.resolve_model = _resolve
