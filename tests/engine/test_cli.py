"""`hybrid-serve generate` and `make-tiny-model` through the real console entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_generate_cli_on_the_embedded_model(tiny_model_dir):
    exe = os.path.join(os.path.dirname(sys.executable), "hybrid-serve")
    res = subprocess.run(
        [
            exe,
            "generate",
            "--model-path",
            tiny_model_dir,
            "--prompt",
            "Hello",
            "--prompt",
            "Hi there",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 2 and all(len(l["token_ids"]) == 6 and l["finish_reason"] == "length" for l in lines)
    assert "kernel backend: native" in res.stderr  # the CPU default
