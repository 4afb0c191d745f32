# SPDX-License-Identifier: Apache-2.0
"""The CUDA backend reads device memory through vllm-omni's platform and ``torch.accelerator``.

vllm-omni bans ``torch.cuda`` memory calls outside ``vllm_omni/platforms/`` (its
``check-torch-cuda-call`` hook and ruff's TID251); free memory comes from
``current_omni_platform.get_free_memory``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.core_model]


class _Platform:
    def __init__(self, free):
        self.free = free
        self.asked = []

    def get_free_memory(self, device=None):
        self.asked.append(device)
        return self.free


@pytest.mark.cpu
def test_free_bytes_come_from_the_omni_platform_for_the_inputs_device(ecg, monkeypatch):
    platform = _Platform(free=123 << 20)
    monkeypatch.setattr(ecg.backend.omni_platforms, "current_omni_platform", platform, raising=False)
    device = torch.device("cuda", 1)
    assert ecg.CudaGraphBackend().free_bytes(device) == 123 << 20
    assert platform.asked == [device]
