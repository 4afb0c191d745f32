"""vllm-omni's contribution conventions that the exported pull request follows.

Each value names where upstream keeps it (``vllm-project/vllm-omni`` paths, commit where known).
What could be checked against the released 0.30.0 wheel is said next to the value; the wheel
carries only ``vllm_omni/`` (no ``pyproject.toml``, ``tests/``, ``docs/``, ``.buildkite/`` or
``tools/``), so the rest follows vllm-omni's repository as of July 2026.
"""

from __future__ import annotations

#: The two-line header of every new ``.py`` / ``.sh`` file (``tools/pre_commit/check_spdx_header.py``);
#: the 0.30.0 wheel's MiniCPM-o files carry exactly these lines.
SPDX_LINES = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project",
)
#: vLLM's own second line, for the vLLM series.
VLLM_SPDX_LINES = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)

#: ``[tool.ruff]`` of vllm-omni's ``pyproject.toml`` (@ 00be5b56 plus TID251 of July 2026). The
#: 0.30.0 wheel's ``vllm_omni/`` is ``ruff format``-clean at this line length.
RUFF_LINE_LENGTH = 120
RUFF_SELECT = ("E", "W", "F", "I", "N", "UP", "TID251")
RUFF_IGNORE = ("E203", "N801", "N802", "N806", "N812")
RUFF_PER_FILE_IGNORES = {
    "tests/**": ("E501",),
    "examples/**": ("E501",),
    "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_llm.py": (
        "E402",
        "E501",
        "F403",
        "F405",
        "N803",
    ),
}
RUFF_BANNED_API = {
    "librosa": "use the audio helpers of vllm-omni instead of librosa",
    **{
        f"torch.cuda.{name}": f"use torch.accelerator.{replacement} (device-agnostic)"
        for name, replacement in (
            ("max_memory_allocated", "max_memory_allocated"),
            ("reset_peak_memory_stats", "reset_peak_memory_stats"),
            ("device_count", "device_count"),
            ("current_device", "current_device_index"),
            ("empty_cache", "empty_cache"),
            ("synchronize", "synchronize"),
        )
    },
}
#: ruff of vllm-omni's ``.pre-commit-config.yaml`` (@ 030fa1e6).
RUFF_VERSION = "0.14.10"

#: ``check-torch-cuda-call`` (``tools/pre_commit/check_torch_cuda.py`` @ 47a64181): calls banned
#: outside ``vllm_omni/platforms/`` (device memory goes through ``current_omni_platform``).
TORCH_CUDA_BANNED = (
    "empty_cache",
    "synchronize",
    "device_count",
    "current_device",
    "memory_reserved",
    "memory_allocated",
    "max_memory_\\w+",
    "reset_peak_memory_stats",
    "memory_stats",
    "mem_get_info",
    "set_device",
    "device",
    "manual_seed",
    "manual_seed_all",
)
TORCH_CUDA_ALLOWED_DIR = "vllm_omni/platforms/"

#: ``check-forbidden-imports`` (@ 14eb2c05) under ``vllm_omni/``: module -> what to use instead.
FORBIDDEN_IMPORTS = {
    "re": "import regex as re",
    "base64": "pybase64",
    "pickle": "no pickle under vllm_omni/",
    "cloudpickle": "no pickle under vllm_omni/",
    "triton": "vllm.triton_utils",
    "tilelang": "vllm.tilelang_utils",
    "huggingface_hub": "vllm.transformers_utils.repo_utils",
}

#: Markers registered in vllm-omni's ``[tool.pytest.ini_options].markers`` (``--strict-markers``).
UPSTREAM_MARKERS = (
    "core_model",
    "advanced_model",
    "full_model",
    "local_model",
    "slow",
    "omni",
    "tts",
    "diffusion",
    "cache",
    "parallel",
    "cpu",
    "gpu",
    "cuda",
    "rocm",
    "xpu",
    "npu",
    "musa",
)
LEVEL_MARKERS = ("core_model", "advanced_model", "full_model")
#: This project's markers that vllm-omni does not register: dropped from the exported tests
#: (the tests keep their own device-count ``skipif``). Any other unknown marker is an error.
DROPPED_MARKERS = ("multi_gpu",)
#: Level given to an exported end-to-end module without one: L3 (``merge-test`` label), as the
#: serving e2e needs the checkpoint and an 80 GB GPU.
E2E_DEFAULT_LEVEL = "advanced_model"

#: PR title prefixes (``docs/contributing/README.md``; ``[Perf]`` is common on merged PRs).
TITLE_PREFIX_MODEL = "[Model]"
TITLE_PREFIX_CORE = "[Core]"
TITLE_PREFIX_TEST = "[Test]"
TITLE_PREFIX_DOC = "[Doc]"
TITLE_PREFIX_CI = "[CI/Build]"
TITLE_PREFIX_PERF = "[Perf]"
MODEL_TITLE = "MiniCPM-o 4.5"
#: The model's folder in vllm-omni: a commit changing files there only is the model's (``[Model]``),
#: one changing a file elsewhere in ``vllm_omni/`` (the worker's model runner) vllm-omni's core (``[Core]``).
MODEL_DIR = "vllm_omni/model_executor/models/minicpmo_4_5/"

#: ``.github/PULL_REQUEST_TEMPLATE.md`` @ 3529b828: first line and headings, in order.
PR_TEMPLATE_FIRST_LINE = "<!-- markdownlint-disable -->"
PR_TEMPLATE_HEADINGS = ("## Purpose", "## Test Plan", "## Test Result")
PR_FIELD_VLLM = "**vLLM Version:**"
PR_FIELD_OMNI = "**vLLM-Omni Commit:**"

#: vllm-omni's tracker of the encoder CUDA graph work, cited by its full reference and title. Its
#: plan says, following its Gating section, that PRs that enable encoder graphs merge after the next
#: vLLM pin bump, and that changes that do not enable encoder graphs can merge on the current pin;
#: the texts cite nothing else from it.
TRACKER_ISSUE = "vllm-project/vllm-omni#7452"
TRACKER_TITLE = "[Perf] Onboard omni encoder stages to the upstream multimodal encoder CUDA Graph framework"
#: The tracker's ordering rule, as the PR texts state it.
TRACKER_RULE = (
    f'{TRACKER_ISSUE} ("{TRACKER_TITLE}") says that PRs that enable encoder graphs merge after the next '
    "vLLM pin bump"
)

#: Where things live upstream.
DESIGN_DOCS_DIR = "docs/design"
NAV_FILE = "docs/.nav.yml"
DESIGN_INDEX_FILE = "docs/design/index.md"
BUILDKITE_READY = ".buildkite/cuda/test-ready.yml"
BUILDKITE_E2E_GROUP = "E2E Test"
#: The MiniCPM-o step the eager/graphed steps are modelled on, and the sibling page the design
#: page is listed next to in the docs navigation.
BUILDKITE_SIBLING_STEP = "MiniCPM-o 4.5 Online Test"
NAV_SIBLING_PAGE = "minicpm_o45_mrv2_performance.md"

#: What names this project, its tooling or its layout, as case-insensitive regular expressions: the
#: single word list of the export's check. None may remain in an exported file, commit message or
#: pull request text (the export fails, naming each place); the exported text must read as a
#: self-contained vllm-omni (or vLLM) change.
PROJECT_WORDS = (
    r"minicpmo[_-]cg",  # the package, its console scripts, its environment variables
    r"\bpatch(?:es)?[ -]set\b",
    r"\blanes?\b",
    r"\bpatches/",  # patches/vllm/NNNN-*.patch, patches/vllm-omni/...
    r"\bpatch[ -]?tool\b",
    r"\bpatch(?:es)? \d{4}\b",  # patch 0004, patches 0001 and 0006
    r"\btools/(?:test|setup_lane)\.sh\b",
    r"\b(?:un)?patched\b",  # in vllm-omni the model file is the code, not a patched copy
    r"\bowned (?:module|file)s?\b",
    r"\bthis project\b",
)
#: What vllm-omni does not have, as case-insensitive regular expressions: this project's demo,
#: benchmark and results page. An exported file, commit message or PR text citing one refers to
#: something the PR does not contain (the export fails, naming each place); cite the measurement
#: plainly instead ("measured on an H200: ...").
NOT_UPSTREAM_WORDS = (
    r"\bdemo(?:'s|s)?\b",
    r"\bthe benchmark\b",
    r"\bbenchmark's\b",
    r"\bresults page\b",
    r"\bdocs/results\b",
    r"\bdry[ -]runs?\b",
)
#: Positional references, which a PR text assembled from several pages cannot keep ("the table
#: above" points at whatever ended up before it); a comparison with a number ("below 3×") is none.
POSITIONAL_WORDS = (r"\b(?:above|below)\b(?!\s*[-−+~≈]?\d)",)

#: The "Not run" item of a PR whose own paths have no results section (the stack table's ``results``).
PR_NO_MEASUREMENTS = "Measurements of the paths this PR adds"

#: The results page's section on how its figures were measured: each PR text with GPU figures shows it.
RESULTS_METHOD_HEADING = "Method"

#: The variables of the exported e2e test (``tests/helpers/serve_smoke.py``'s ``ENV_HUB`` and
#: ``ENV_MODEL`` as vllm-omni's copy names them, :data:`UPSTREAM_RENAMES`): the first lets it download
#: the checkpoint, the second names a local copy; without either the test skips.
E2E_HUB_ENV = "MINICPMO45_E2E_HUB"
E2E_MODEL_ENV = "MINICPMO45_E2E_MODEL"

#: Names with this project's prefix that the exported files carry under a vllm-omni name:
#: old -> new, replaced as whole words (the test environment variables, the served model name).
UPSTREAM_RENAMES = {
    "MINICPMO_CG_E2E_": "MINICPMO45_E2E_",
    "minicpmo-cg-e2e": "minicpmo45-e2e",
}
#: Markers around lines that exist for this project only (its tooling, its lanes): the export
#: drops them with everything between. Python: whole-line comments; Markdown: HTML comments.
PROJECT_ONLY_MARKERS = {
    ".py": ("# project-only", "# /project-only"),
    ".md": ("<!-- project-only -->", "<!-- /project-only -->"),
}
