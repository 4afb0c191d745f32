# SPDX-License-Identifier: Apache-2.0
"""Constants shared by the export tests and their conftest."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AUTHOR = "Export Test <export-test@example.com>"
