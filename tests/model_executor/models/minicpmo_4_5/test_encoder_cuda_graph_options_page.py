# SPDX-License-Identifier: Apache-2.0
"""The design overview's options table against the ``--hf-overrides`` registry: a row per key the
adapter registers, with its default and, for numbers, its range.

A change that registers a key adds its row to the page, so the two agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

DESIGN_DOC = Path(__file__).resolve().parents[4] / "docs/design/minicpmo_encoder_cuda_graph.md"


def test_design_doc_options_table_lists_every_key_with_its_default(ecg):
    table = DESIGN_DOC.read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    for key, spec in ecg.HF_OVERRIDE_KEYS.items():
        row = re.search(rf"^\| `{key}` \|(.*)$", table, re.MULTILINE)
        assert row, f"{key} missing from the design doc's options table"
        assert f"`{json.dumps(spec.default)}`" in row.group(1), row.group(0)
        if spec.kind in ("int", "number"):
            assert f"{spec.minimum} to {spec.maximum}" in row.group(1), row.group(0)  # the range
