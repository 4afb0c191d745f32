"""MiniCPM-o 4.5 input encoder CUDA graphs: a fork-style patch set on vllm-omni.

Installs the ``minicpmo_cg`` package (patch tool, demo, benchmark, offline GPU runner) and
ships, as package data, the files this project owns in vllm-omni's tree (``vllm_omni/``: the adapter
package ``vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/`` and any module
beside it, every file of the tree), the patch series (``patches/``) that the tool installs into
vllm-omni / vLLM, and the lane files (``lanes/``).

Lanes are extras because the patch set supports pinned vLLM/vllm-omni pairs; the extras are
read from ``lanes/<lane>.txt`` by ``minicpmo_cg.lanes`` (the one home of the pairs):
    pip install -e ".[current,test]"     # vllm 0.30.0 + vllm-omni 0.30.0
    pip install -e ".[legacy,test]"      # vllm 0.28.0 + vllm-omni 0.28.0 (+ vLLM patches)
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from minicpmo_cg import lanes  # noqa: E402  (stdlib only: reads lanes/*.txt of this checkout)

PAYLOAD_DIRS = ("patches", "lanes", "vllm_omni")


class BuildPyWithPayload(build_py):
    """Copy the owned ``vllm_omni/`` tree (packages included, bytecode left out), the patch series and
    the lanes into ``minicpmo_cg/_payload``.

    An editable install reads them from the source tree instead (see ``minicpmo_cg/resources.py``).
    """

    def run(self):
        super().run()
        payload = os.path.join(self.build_lib, "minicpmo_cg", "_payload")
        shutil.rmtree(payload, ignore_errors=True)
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
        for name in PAYLOAD_DIRS:
            shutil.copytree(os.path.join(HERE, name), os.path.join(payload, name), ignore=skip)


LANE_EXTRAS = {
    lane.name: [lane.requirement("vllm"), lane.requirement("vllm-omni")]
    for lane in lanes.all_lanes(os.path.join(HERE, "lanes"))
}


setup(
    name="minicpmo-encoder-cuda-graphs",
    version="0.1.0",
    description="Exact-shape CUDA graphs for MiniCPM-o 4.5's vision and audio encoders on vllm-omni",
    long_description=Path(HERE, "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.14",
    packages=find_packages(include=["minicpmo_cg", "minicpmo_cg.*"]),
    package_data={
        "minicpmo_cg.offline_gpu": ["deps.txt", "stubs/vllm/*.py", "stubs/vllm/vllm_flash_attn/*.py"]
    },
    cmdclass={"build_py": BuildPyWithPayload},
    install_requires=[],  # torch/vLLM/vllm-omni come from a lane extra
    extras_require={
        **LANE_EXTRAS,
        "test": ["pytest>=9", "pytest-xdist>=3.8", "pyyaml"],
        "demo": ["scikit-image>=0.24"],
    },
    entry_points={
        "console_scripts": [
            "minicpmo-cg-patch = minicpmo_cg.patchtool:main",
            "minicpmo-cg-demo = minicpmo_cg.demo:main",
            "minicpmo-cg-bench = minicpmo_cg.bench.cli:main",
            "minicpmo-cg-offline-gpu = minicpmo_cg.offline_gpu.cli:main",
            "minicpmo-cg-checkpoint = minicpmo_cg.checkpoint.cli:main",
            "minicpmo-cg-export = minicpmo_cg.export.cli:main",
        ],
        # vLLM calls these in every process: warns in the log when the patch set is not applied
        # and registers MiniCPM-o 4.5's thinker-only vllm-omni pipeline (before vllm-omni resolves one)
        "vllm.general_plugins": [
            "minicpmo_cg_patch_check = minicpmo_cg.vllm_plugin:check_patch_set",
            "minicpmo_cg_thinker_only = minicpmo_cg.omni_plugin:register_thinker_only",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ],
)
