"""Fixtures for the tests of the vLLM-side changes of PR #42785.

The same tests run on both lanes: on the legacy lane (vllm 0.28.0) against the
patches of ``patches/vllm/`` applied to the installed vLLM, on the current lane
(vllm 0.30.0) against upstream's own implementation.
"""

from __future__ import annotations

import pytest
import torch


def vllm_lane() -> str:
    """The lane (``lanes/*.txt``, via :mod:`minicpmo_cg.lanes`) of the installed vLLM/vllm-omni pair.

    ``"legacy"`` is the lane whose vLLM needs the patches of ``patches/vllm/``.
    """
    import importlib.metadata

    import vllm

    from minicpmo_cg import lanes

    omni = importlib.metadata.version("vllm-omni")
    lane = lanes.lane_for_versions(vllm.__version__, omni)
    if lane is None:
        known = ", ".join(f"{ln.name} = {ln.vllm} + {ln.vllm_omni}" for ln in lanes.all_lanes())
        pytest.fail(f"vllm {vllm.__version__} + vllm-omni {omni} is not a lane ({known})", pytrace=False)
    return lane.name


@pytest.fixture(scope="session")
def lane() -> str:
    return vllm_lane()


@pytest.fixture(scope="session", autouse=True)
def _patched_or_upstream():
    """Fail every test, with the fix, when the legacy lane's vLLM lacks the patches."""
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig

    if "capture_axes" not in EncoderCudaGraphConfig.__dataclass_fields__:
        pytest.fail(
            "the installed vLLM has no EncoderCudaGraphConfig.capture_axes: the legacy lane's "
            "vLLM patches are not applied (run `minicpmo-cg-patch apply`)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tp_group(tmp_path_factory):
    """A single-process tensor-parallel group, needed to build vLLM's parallel linear layers."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        init_file = tmp_path_factory.mktemp("minicpmo-cg-dist") / "init"
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{init_file}",
                backend="gloo",
            )
            parallel_state.initialize_model_parallel(1, 1)
    yield
