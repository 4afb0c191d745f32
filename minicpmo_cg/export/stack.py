"""The stack of pull requests the export writes: one declarative table, and its resolution.

vllm-project/vllm-omni#7452 ("[Perf] Onboard omni encoder stages to the upstream multimodal encoder
CUDA Graph framework") says that PRs that enable encoder graphs merge after the next vLLM pin bump,
and that changes that do not enable encoder graphs can merge on the current pin; some of these
changes are plain bug or layout fixes that enable no graph. So the change
set goes upstream as a **stack**: independent vllm-omni PRs, each applying on the one before it
(against the pinned release wheel), each with its own tests, design-page parts and results, plus
the vLLM change as a PR of its own for vllm-project/vllm.

:data:`STACK` and :data:`VLLM_PRS` are the only place that says what goes where. Everything else
is derived and checked by :func:`resolve` against the checkout:

- ``patches``: vllm-omni patches, by topic (the file name without ``NNNN-`` and ``.patch``) or by
  file name; the PRs take them in ``series`` order, each active patch in exactly one PR;
- ``owned``: globs (``fnmatch``, ``*`` crosses ``/``) of the owned files (site-relative paths under
  ``vllm_omni/``); a glob ending in ``*`` covers a module and the package it may become;
- ``tests``: globs of repo-relative test files; every exported test file in exactly one PR; the
  modules the tests import from this project are vendored beside them in the first PR that needs
  them;
- ``docs``: a design page (``docs/design/x.md``: the PR that adds the page) or one of its
  sections (``docs/design/x.md#Heading``: that section, with its subsections, belongs to the PR);
  finer parts are tagged in the page itself (:mod:`.docsplit`); a page version never shows what a
  later PR adds;
- ``results``: headings of ``docs/results/stack.md`` whose sections go into the PR's Test Result
  (rows and paragraphs tagged for another PR left out, see :mod:`.docsplit`);
- ``measured_on``: the tree those figures were measured on, which the PR text states: ``"own"``
  (this PR's own tree: the release with this PR and the earlier ones applied, the default; the
  stack's results page measures every PR so), ``"stack"`` (the whole stack applied) or the key of
  the last PR of the stack the measured tree had;
- ``vllm``: keys of :data:`VLLM_PRS` the PR cannot work without;
- ``not_run``: sentences for the PR text's "Not run": paths of this PR that no run measured or tested;
- ``remarks``: paragraphs of the PR text's Purpose, after its new modules, for what the stack itself
  explains (an option's default and what it gives): fixed text, or a function of the checkout's
  ``--hf-overrides`` registry (key -> :class:`HfKey`), so that a default the text states is the one
  the code has.

A PR key names its folder (``NN-key``, numbered in stack order) and its tags in the pages; keep
keys when the series is renumbered. Editing the stack is editing these two tables; the export
tests check their invariants on the checkout (every patch, owned file and test file in exactly one
PR, each PR applying on the previous, a PR's tests importing only what it or an earlier PR holds),
and ``--verify`` that each PR's tree names nothing a later PR adds, that each module a PR adds has a
user in its tree and that what a PR adds is tested with it (:mod:`.forward`).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minicpmo_cg.export import conventions as conv
from minicpmo_cg.export.changeset import ChangeSet
from minicpmo_cg.export.transform import ExportError
from minicpmo_cg.patchtool.series import Patch, load_series

__all__ = [
    "OPTIONS_MODULE",
    "STACK",
    "VLLM_PRS",
    "OmniPr",
    "ResolvedPr",
    "ResolvedVllmPr",
    "Stack",
    "HfKey",
    "Remark",
    "StackError",
    "VllmPr",
    "hf_override_keys",
    "patch_commit_title",
    "patch_prefix",
    "patch_topic",
    "resolve",
]


@dataclass(frozen=True)
class HfKey:
    """One ``--hf-overrides`` key of the checkout's registry: its default (as Python: ``False``,
    ``"all"``) and its doc line."""

    default: object
    doc: str


#: A paragraph of a PR's Purpose: fixed text, or made from the registry (key -> :class:`HfKey`).
Remark = str | Callable[[Mapping[str, HfKey]], str]

#: The owned module holding the ``--hf-overrides`` registry (``HfOverrideKey(name=..., ...)`` entries).
OPTIONS_MODULE = "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/options.py"


def hf_override_keys(source: str) -> dict[str, HfKey]:
    """The ``HfOverrideKey(...)`` entries of ``source`` whose name, default and doc are literals
    (an entry taking them from another module is left out), read from its syntax tree."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "HfOverrideKey":
            kw = {k.arg: k.value for k in node.keywords}
            try:
                name, default, doc = (ast.literal_eval(kw[k]) for k in ("name", "default", "doc"))
            except (KeyError, ValueError):
                continue
            out[name] = HfKey(default, doc)
    return out


def _js(value: object) -> str:
    return f"`{json.dumps(value)}`"


def _fused_layers_default(keys: Mapping[str, HfKey]) -> str:
    default = keys["encoder_fused_layers"].default
    if default == "none":
        state = (
            'off by default: `--hf-overrides encoder_fused_layers` defaults to `"none"`, the unfused layers'
        )
    else:
        which = "both encoders" if default == "all" else f"the {default} encoder"
        state = (
            f"on by default: `--hf-overrides encoder_fused_layers` defaults to {_js(default)} ({which}); "
            '`"none"` keeps the unfused layers'
        )
    return (
        f"The fused layers are {state}. They are not bitwise equal to the unfused layers: the CUDA tests "
        "hold the fused model's output (the image call, an audio call, a duplex session's chunks) within "
        "1e-2 of the original layers' largest magnitude (`max |fused - original| <= 1e-2 * max |original|`, "
        "the original being the layers as vllm-omni 0.30.0 runs them with eager attention), and SigLIP's own "
        "output within a small multiple of the divergence vllm-omni's SDPA layers already have from the eager "
        "ones; a graph replay stays bitwise equal to the fused eager call. Those bounds were checked with "
        "random weights at the checkpoint's dimensions only: no run put the checkpoint's own weights through "
        "the fused layers, so a maintainer who wants that evidence first can merge this PR with the default "
        'set to `"none"`: its `encoder_fused_layers` entry in `encoder_cuda_graph/options.py` and that key\'s '
        "row of the options table in `docs/design/minicpmo_encoder_cuda_graph.md`, both (the options-page "
        "test checks that the row names the key's default, not which value it states as the default)."
    )


def _duplex_batch_default(keys: Mapping[str, HfKey]) -> str:
    key = keys["encoder_cuda_graph_duplex_batch"]
    fused = keys["encoder_fused_layers"].default
    per_session = "each session's chunk is encoded on its own, bitwise equal to eager"
    off_path = (
        "not bitwise: the option's description bounds them within four bf16 steps of each session's own "
        "encode (`4 · 2⁻⁸` of the output's largest magnitude)"
    )
    if fused in ("all", "audio"):
        rows = (
            "each row is bitwise equal to its session's own encode where it runs the fused Whisper layers "
            f"(`encoder_fused_layers` defaults to {_js(fused)}) with the SDPA reference attention over the "
            f"gathered pages (the Test Result's table, and the CUDA test asserts it); with the unfused layers "
            f"the rows are {off_path}, which no test checks (the CUDA tests build the default fused layers, and the "
            f"CPU tests' tiny float32 models run unfused rows within 1e-4); with vLLM's "
            "FlashAttention (chosen where its compiled op is registered) the tests assert that four-step bound, which no run has "
            "measured"
        )
    else:
        rows = f"the rows run the unfused Whisper layers (`encoder_fused_layers` defaults to {_js(fused)}), {off_path}"
    batched = (
        "the chunks of every duplex session scheduled in one engine step are encoded in one batched call: "
        f"{rows}"
    )
    if key.default:
        state = (
            f"on by default (`--hf-overrides encoder_cuda_graph_duplex_batch`, default `true`): {batched}; "
            f"with `false`, {per_session}"
        )
    else:
        state = (
            f"opt-in (`--hf-overrides encoder_cuda_graph_duplex_batch`, default `false`: {per_session}); "
            f"with `true`, {batched}"
        )
    return f'Batched duplex steps are {state}. The option\'s own description: "{key.doc}".'


@dataclass(frozen=True)
class OmniPr:
    """One vllm-omni pull request of the stack (see the module docstring for each field)."""

    key: str
    title: str
    prefixes: tuple[str, ...]
    patches: tuple[str, ...]
    owned: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    docs: tuple[str, ...] = ()
    results: tuple[str, ...] = ()
    measured_on: str = "own"
    vllm: tuple[str, ...] = ()
    remarks: tuple[Remark, ...] = ()
    not_run: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmPr:
    """One vllm-project/vllm pull request: vLLM patches and tests in vLLM's layout.

    ``tests`` are globs of repo-relative files under :data:`VLLM_TESTS_ROOT`, exported to the path
    below it (``tests/vllm_patches/upstream/tests/v1/x.py`` -> ``tests/v1/x.py``).
    """

    key: str
    title: str
    prefixes: tuple[str, ...]
    patches: tuple[str, ...]
    tests: tuple[str, ...] = ()


#: Where this repository keeps the tests of its vLLM changes in vLLM's own layout.
VLLM_TESTS_ROOT = "tests/vllm_patches/upstream/"

_MC45 = "tests/model_executor/models/minicpmo_4_5/"
_MODEL = "vllm_omni/model_executor/models/minicpmo_4_5/"
_DESIGN = "docs/design/minicpmo_encoder_cuda_graph"
#: The heading of each PR's section on the stack's results page (docs/results/stack.md): that PR's
#: call sites measured on its own tree against the tree before it, in one run.
_BEFORE_AFTER = "Before and after this PR"

# The stack in merge order (the vllm-omni series 0001-0011). A test file sits in the first PR whose
# tree its tests pass in: each --hf-overrides key arrives with the PR whose code reads it (its lines
# of options.py and of the tests are tagged `# pr: KEY`), and the test of the design overview's
# options table against the registry (test_encoder_cuda_graph_options_page.py) arrives with the table,
# in the encoder-graphs PR: each later PR adds its keys and their rows together, so the test holds on
# every tree. The model wiring every encoder shares (_init_encoder_cuda_graphs, its
# fallbacks and start-up line) is tested with the encoder-graphs PR that adds it
# (test_encoder_cuda_graph_wiring.py, and test_encoder_cuda_graph_models.py on CUDA), the vision graph over
# the whole image call with the image-call PR (test_model_wiring.py, test_vision_graph_cuda.py).
# The fused-layers PR comes before duplex-batch: the batched duplex steps' exact rows run its fused
# Whisper layers (duplex_rows.encode_rows through fused_layers.whisper_encode_layers). The batched steps
# are a PR of their own after duplex-scale: they are opt-in, and their start-up capture of the batch
# buckets extends duplex-scale's start-up capture (its lines of startup_capture.py are tagged for them).
STACK: tuple[OmniPr, ...] = (
    OmniPr(
        key="siglip-attention",
        title="MiniCPM-o 4.5: SigLIP's SDPA attention reachable from serving; contiguous encoder hidden states",
        prefixes=("[Bugfix]", "[Model]"),
        patches=("minicpmo45-siglip-sdpa-attention", "minicpmo45-contiguous-hidden-states"),
        owned=(_MODEL + "siglip_attention.py",),
        tests=(_MC45 + "test_vision_attention.py", _MC45 + "test_audio_layout.py"),
        results=(_BEFORE_AFTER,),
        remarks=(
            "The SDPA default changes SigLIP's numerics for every served image: SDPA keeps the logits in "
            "higher precision through the softmax, and on one attention layer its largest and mean errors "
            "against float32 are no larger than the eager attention's (a CPU test checks both). The Test "
            "Result's image rows give the image call's output difference after the resampler, with random "
            "weights at the checkpoint's dimensions; SigLIP's own output, before the resampler, was not compared. No "
            'run compared the checkpoint\'s answers. `--hf-overrides \'{"vision_attn_implementation": "eager"}\'` '
            "keeps the former numerics bitwise; the contiguous hidden states change no bit.",
        ),
    ),
    OmniPr(
        key="encoder-graphs",
        title="MiniCPM-o 4.5: exact-shape CUDA graphs for the vision and audio encoders",
        prefixes=("[Model]", "[Perf]"),
        patches=("minicpmo45-route-encoders-through-cuda-graphs",),
        # the adapter package but immediate.py (capture_now), whose only caller is the duplex-scale PR's
        # start-up capture
        owned=(
            *(
                f"{_MODEL}encoder_cuda_graph/{name}.py"
                for name in ("__init__", "adapter", "admission", "backend", "factory", "options", "shapes")
            ),
            _MODEL + "encoder_graphs.py",
        ),
        tests=(
            _MC45 + "conftest.py",
            *(
                f"{_MC45}test_encoder_cuda_graph_{name}.py"
                for name in (
                    "admission",
                    "cuda",
                    "failed_capture",
                    "models",
                    "multi_gpu",
                    "options",
                    "options_page",
                    "platform",
                    "policy",
                    "threads",
                    "wiring",
                )
            ),
            _MC45 + "test_vision_attention_overrides.py",
        ),
        docs=(_DESIGN + ".md", _DESIGN + "/cost_admission.md", _DESIGN + "/live_worker.md"),
        results=(_BEFORE_AFTER,),
        vllm=("capture-error-mode",),
    ),
    OmniPr(
        key="image-call",
        title="MiniCPM-o 4.5: one vision CUDA graph per image call, without host reads",
        prefixes=("[Model]", "[Perf]"),
        patches=("minicpmo45-vision-one-graph-per-image-call",),
        owned=(_MODEL + "vision_path.py",),
        tests=(
            _MC45 + "test_vision_path.py",
            _MC45 + "test_vision_graph_cuda.py",
            _MC45 + "test_model_wiring.py",
            "tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py",
        ),
        docs=(_DESIGN + "/image_path.md",),
        results=(_BEFORE_AFTER,),
        remarks=(
            "`test_vision_graph_cuda.py` encodes real photos from scikit-image's bundled sample data "
            "(`skimage.data`, no download) through the model's own image processor; scikit-image is not a "
            "vllm-omni dependency, so without it those CUDA tests skip (with that reason), all but "
            "`test_cost_admission_captures_a_duplex_frame_and_no_grad_replays_it`, which loads its photo outside "
            "that fixture and fails: the agents that run `core_model and cuda` need scikit-image.",
            "The serving e2e test (`tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py`) needs the "
            "checkpoint and skips without it; its `--enforce-eager` server runs only with "
            "`MINICPMO45_E2E_ENFORCE_EAGER=1` (one more model load) and skips otherwise.",
        ),
    ),
    OmniPr(
        key="streaming-audio",
        title="MiniCPM-o 4.5: CUDA graphs for the full-duplex streaming audio chunks",
        prefixes=("[Model]", "[Perf]"),
        patches=("minicpmo45-graph-streaming-audio",),
        # the batched duplex steps (duplex_batch.py, duplex_rows.py) are the duplex-batch PR's: the lines of
        # streaming_audio.py that call them are tagged for it
        owned=(_MODEL + "streaming_audio.py",),
        tests=(
            _MC45 + "test_encoder_cuda_graph_static_args.py",
            _MC45 + "test_encoder_cuda_graph_streaming_audio.py",
        ),
        docs=(_DESIGN + "/streaming_audio.md",),
        results=(_BEFORE_AFTER,),
    ),
    OmniPr(
        key="fused-layers",
        title="MiniCPM-o 4.5: fused SigLIP and Whisper layers inside the encoder graphs",
        prefixes=("[Model]", "[Perf]"),
        patches=("minicpmo45-fused-encoder-layers",),
        # the calls of encoder_graphs.py, vision_path.py and streaming_audio.py into fused_layers.py are
        # tagged for this PR, so the module and its kernel arrive here with every caller
        owned=(_MODEL + "fused_layers.py", _MODEL + "ops/*"),
        tests=(_MC45 + "test_fused_layers.py", _MC45 + "test_fused_layers_cuda.py"),
        docs=(_DESIGN + "/fused_layers.md",),
        results=(_BEFORE_AFTER,),
        remarks=(
            _fused_layers_default,
            "`test_fused_layers_cuda.py` holds the image call's output to the numerics bound both with SigLIP's "
            'fused layers (`encoder_fused_layers` `"all"`) and without them (`"audio"`, Whisper\'s alone). It prints '
            "the single-slice image graph's memory "
            "(graph pool and static buffers) and where the pool's bytes go, without asserting a bound on them.",
            "With the fused layers, the first chunks of a server's first duplex session also compile their Triton "
            'kernels: in the Test Result\'s duplex row, that session ("first session") is many times slower '
            "than the first session before this PR, while later sessions replay faster than before. PR 6 of this "
            "stack runs that compilation, and the captures every session needs, at start-up instead; merged "
            "without it, each server's first duplex session pays it once.",
            "With the encoder graphs off (`encoder_cuda_graph` false, or a shape the admission leaves eager), the "
            "one-slice image call measured slower with the fused layers than without them on the GPU host (the "
            "Test Result's eager columns) and the multi-slice image calls much faster; the cause of the one-slice "
            "slowdown was not measured. The default calls, graphs on, are faster in every row apart "
            "from the first duplex session.",
        ),
    ),
    OmniPr(
        key="duplex-scale",
        title="MiniCPM-o 4.5: duplex audio without host reads, its graphs captured at start-up",
        # [Core]: its worker patch changes vllm-omni's model runner (a hook any model can answer); it stays
        # here, as it applies between this PR's model patches and is tested with them
        prefixes=("[Model]", "[Core]", "[Perf]"),
        patches=(
            "minicpmo45-audio-lengths-on-the-host",
            "worker-model-graphs-at-startup",
            "minicpmo45-startup-capture",
        ),
        owned=(
            _MODEL + "audio_lengths.py",
            _MODEL + "encoder_cuda_graph/immediate.py",
            _MODEL + "startup_capture.py",
        ),
        tests=(_MC45 + "test_audio_host_reads.py", _MC45 + "test_startup_capture.py"),
        docs=tuple(
            f"{_DESIGN}/streaming_audio.md#{heading}" for heading in ("Start-up capture", "No host reads")
        ),
        results=(_BEFORE_AFTER,),
    ),
    OmniPr(
        key="duplex-batch",
        title="MiniCPM-o 4.5: opt-in batching of the duplex audio chunks of an engine step",
        # [Core]: its worker patch changes vllm-omni's model runner (a batched preprocess hook any model can
        # answer); it applies between this PR's model patches and is tested with them
        prefixes=("[Model]", "[Core]", "[Perf]"),
        patches=("worker-batch-append-preprocess", "minicpmo45-duplex-append-batch"),
        owned=(_MODEL + "duplex_batch.py", _MODEL + "duplex_rows.py"),
        tests=(_MC45 + "test_duplex_batch.py",),
        docs=(f"{_DESIGN}/streaming_audio.md#Batched steps",),
        results=("Batched duplex steps with exact rows",),
        not_run=(
            "The batched duplex steps with vLLM's paged FlashAttention (`flash_attn_varlen_func` with a block "
            "table), the attention they choose where vLLM's compiled FA2 op is registered: the GPU host had no "
            "compiled vLLM ops, so every batched step measured and tested ran the SDPA reference over the "
            "gathered pages; the tolerance the tests assert for FlashAttention rows is unmeasured.",
        ),
        remarks=(
            _duplex_batch_default,
            "How a step's appends are batched: the model runner hands the model every duplex append of the step "
            "it accepts. Each one's own preprocess runs in a worker thread of the model (`duplex-append`), one "
            "at a time and in request order, under the runner thread's autograd mode, CUDA device and stream and "
            "context variables; where its audio chunk reaches the encoder it parks. Once every request has "
            "parked or finished, the runner's thread encodes the parked chunks in one batched call and resumes "
            "the requests in order (an append with two chunks parks twice). A step that fails ends every parked "
            "call with the error, each session's own cache restored.",
        ),
    ),
)

VLLM_PRS: tuple[VllmPr, ...] = (
    VllmPr(
        key="capture-error-mode",
        title="EncoderCudaGraphManager: let the caller choose the capture error mode",
        prefixes=("[Core]",),
        patches=("encoder-cudagraph-capture-error-mode",),
        tests=(VLLM_TESTS_ROOT + "tests/v1/cudagraph/test_encoder_cudagraph_capture_error_mode.py",),
    ),
)


class StackError(ExportError):
    """The stack table does not fit the checkout (the message lists every mismatch)."""


def patch_topic(name: str) -> str:
    """``vllm-omni/0005-minicpmo45-siglip-sdpa-attention.patch`` -> ``minicpmo45-siglip-sdpa-attention``."""
    return re.sub(r"^\d{4}-", "", PurePosixPath(name).name.removesuffix(".patch"))


def patch_prefix(patch: Patch) -> str:
    """The commit prefix of a vllm-omni patch, read off the files it changes: ``[Model]`` when every
    one lies in the model's folder (:data:`.conventions.MODEL_DIR`), ``[Core]`` when one lies outside
    it (vllm-omni's own code, e.g. ``vllm_omni/worker/gpu_model_runner.py``)."""
    if all(path.startswith(conv.MODEL_DIR) for path in patch.file_paths):
        return conv.TITLE_PREFIX_MODEL
    return conv.TITLE_PREFIX_CORE


def patch_commit_title(patch: Patch) -> str:
    """The commit title of a vllm-omni patch: ``[Model] MiniCPM-o 4.5: <subject>`` for a change of the
    model, ``[Core] <subject>`` for one of vllm-omni's core (:func:`patch_prefix`); a ``minicpmo_4_5: ``
    at the start of the subject gives way to the model's name."""
    prefix = patch_prefix(patch)
    if prefix == conv.TITLE_PREFIX_CORE:
        return f"{prefix} {patch.subject}"
    return f"{prefix} {conv.MODEL_TITLE}: {patch.subject.removeprefix('minicpmo_4_5: ')}"


@dataclass
class ResolvedPr:
    """A vllm-omni PR of the stack as found in the checkout."""

    spec: OmniPr
    number: int
    patches: list[Patch]
    owned: dict[str, Path]
    tests: dict[str, Path]
    #: design pages this PR adds (repo-relative)
    pages: list[str]
    #: (page, heading) of the page sections this PR adds to a page an earlier or this PR adds
    sections: list[tuple[str, str]]
    results: tuple[str, ...]
    vllm: list[str]
    #: how many PRs of the stack, from the first, the tree its figures were measured on had applied
    #: (``spec.measured_on`` resolved; the whole stack's length for ``"stack"``)
    measured_upto: int = 0
    #: the spec's remarks as text (those made from the registry, made from the checkout's)
    remarks: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def folder(self) -> str:
        return f"{self.number:02d}-{self.spec.key}"

    @property
    def title(self) -> str:
        return "".join(self.spec.prefixes) + " " + self.spec.title


@dataclass
class ResolvedVllmPr:
    """A vLLM PR as found in the checkout: its active patches and its tests (source -> vLLM path)."""

    spec: VllmPr
    patches: list[Patch]
    tests: dict[str, tuple[str, Path]]

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def folder(self) -> str:
        return f"vllm-{self.spec.key}"

    @property
    def title(self) -> str:
        return "".join(self.spec.prefixes) + " " + self.spec.title


@dataclass
class Stack:
    omni: list[ResolvedPr]
    vllm: list[ResolvedVllmPr]
    #: page -> heading -> key of the PR the section belongs to
    page_sections: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [pr.key for pr in self.omni]

    def upto(self, key: str) -> list[str]:
        """The keys of the PRs up to and including ``key``, in stack order."""
        keys = self.keys
        return keys[: keys.index(key) + 1]

    def vllm_pr(self, key: str) -> ResolvedVllmPr | None:
        return next((pr for pr in self.vllm if pr.key == key), None)


def _match_patches(
    names: tuple[str, ...], series: list[Patch], where: str, problems: list[str]
) -> list[Patch]:
    found = []
    for name in names:
        hits = [p for p in series if name in (PurePosixPath(p.name).name, patch_topic(p.name))]
        if len(hits) != 1:
            listed = ", ".join(PurePosixPath(p.name).name for p in series)
            problems.append(f"{where}: patch {name!r} matches {len(hits)} patches of the series ({listed})")
        found += hits[:1]
    return found


def _glob(patterns: tuple[str, ...], files: set[str], where: str, problems: list[str]) -> set[str]:
    out: set[str] = set()
    for pattern in patterns:
        hits = {f for f in files if fnmatch.fnmatchcase(f, pattern)}
        if not hits:
            problems.append(f"{where}: {pattern!r} matches no file")
        out |= hits
    return out


def _tracked_tests(repo: Path, patterns: list[str]) -> set[str]:
    out = set()
    for pattern in patterns:
        head = pattern.split("*", 1)[0]
        root = repo / PurePosixPath(head).parent
        for path in root.rglob("*.py") if root.is_dir() else []:
            rel = path.relative_to(repo).as_posix()
            if "__pycache__" not in rel and fnmatch.fnmatchcase(rel, pattern):
                out.add(rel)
    return out


def _headings(text: str) -> set[str]:
    from minicpmo_cg.export.prtext import markdown_sections

    return {heading for _, heading, _ in markdown_sections(text)}


def _once(owner: dict[str, list[str]], what: str, problems: list[str]) -> None:
    for item, keys in sorted(owner.items()):
        if len(keys) != 1:
            where = ", ".join(keys) if keys else "no PR"
            problems.append(f"{what} {item} is in {where}: it must be in exactly one PR of the stack")


def _resolve_omni(cs: ChangeSet, table: tuple[OmniPr, ...], problems: list[str]) -> list[ResolvedPr]:
    series = list(load_series(cs.repo / "patches" / "vllm-omni"))
    active = {p.name for p in cs.omni_patches}
    tests_all = set(cs.tests) | _tracked_tests(cs.repo, [g for pr in table for g in pr.tests])
    owner_patch = {name: [] for name in active}
    owner_owned: dict[str, list[str]] = {rel: [] for rel in cs.owned}
    owner_test: dict[str, list[str]] = {rel: [] for rel in tests_all}
    resolved = []
    options = cs.owned.get(OPTIONS_MODULE)
    keys = hf_override_keys(options.read_text(encoding="utf-8")) if options else {}
    order = [p.name for p in series]
    last = -1
    for spec in table:
        where = f"PR {spec.key}"
        patches = [p for p in _match_patches(spec.patches, series, where, problems) if p.name in active]
        for patch in patches:
            owner_patch[patch.name].append(spec.key)
            prefix = patch_prefix(patch)
            if prefix not in spec.prefixes:
                problems.append(
                    f"{where}: {patch.name} changes {', '.join(patch.file_paths)}, so its commit is {prefix}, "
                    f"which the PR's title prefixes ({''.join(spec.prefixes)}) lack"
                )
            at = order.index(patch.name)
            if at < last:
                problems.append(
                    f"{where}: {patch.name} comes before a patch of an earlier PR in the series, so the stack "
                    "would not apply PR by PR; order the PRs (or the series) alike"
                )
            last = max(last, at)
        owned = _glob(spec.owned, set(cs.owned), where, problems)
        tests = _glob(spec.tests, tests_all, where, problems)
        for rel in owned:
            owner_owned[rel].append(spec.key)
        for rel in tests:
            owner_test[rel].append(spec.key)
        pages, sections = [], []
        for doc in spec.docs:
            page, _, heading = doc.partition("#")
            if page not in cs.design_pages:
                problems.append(f"{where}: {page} is not a design page of the checkout")
            elif not heading:
                pages.append(page)
            elif heading not in _headings(cs.design_pages[page].read_text(encoding="utf-8")):
                problems.append(f"{where}: {page} has no heading {heading!r}")
            else:
                sections.append((page, heading))
        resolved.append(
            ResolvedPr(
                spec=spec,
                number=len(resolved) + 1,
                patches=patches,
                owned={rel: cs.owned[rel] for rel in sorted(owned)},
                tests={rel: cs.repo / rel for rel in sorted(tests)},
                pages=pages,
                sections=sections,
                results=spec.results,
                vllm=list(spec.vllm),
                remarks=_remarks(spec, keys, where, problems),
            )
        )
        if not (patches or owned):
            problems.append(f"{where}: no active vllm-omni patch and no owned file on lane {cs.lane.name}")
    stack_keys = [pr.key for pr in resolved]
    for pr in resolved:
        on = pr.spec.measured_on
        upto = measured_upto(stack_keys, pr.key, on)
        if upto is not None:
            pr.measured_upto = upto
            if upto < pr.number:
                problems.append(
                    f"PR {pr.key}: measured_on {on!r} is a tree without this PR, which has no figures of it"
                )
        else:
            problems.append(
                f"PR {pr.key}: measured_on {on!r} is none of 'stack', 'own' and the stack's keys "
                f"({', '.join(stack_keys)})"
            )
    _once(owner_patch, "vllm-omni patch", problems)
    _once(owner_owned, "owned file", problems)
    _once(owner_test, "test file", problems)
    intro = {page: [pr.key for pr in resolved if page in pr.pages] for page in cs.design_pages}
    _once(intro, "design page", problems)
    return resolved


def _remarks(spec: OmniPr, keys: Mapping[str, HfKey], where: str, problems: list[str]) -> list[str]:
    out = []
    for remark in spec.remarks:
        if isinstance(remark, str):
            out.append(remark)
            continue
        try:
            out.append(remark(keys))
        except KeyError as e:
            problems.append(
                f"{where}: a remark needs the --hf-overrides key {e} the registry ({OPTIONS_MODULE}) lacks"
            )
    return out


def _resolve_vllm(cs: ChangeSet, table: tuple[VllmPr, ...], problems: list[str]) -> list[ResolvedVllmPr]:
    series = list(load_series(cs.repo / "patches" / "vllm"))
    active = {p.name for p in cs.vllm_patches}
    owner = {name: [] for name in active}
    out = []
    for spec in table:
        where = f"vLLM PR {spec.key}"
        patches = [p for p in _match_patches(spec.patches, series, where, problems) if p.name in active]
        for patch in patches:
            owner[patch.name].append(spec.key)
        files = _tracked_tests(cs.repo, list(spec.tests))
        tests = {}
        for rel in sorted(_glob(spec.tests, files, where, problems)):
            if not rel.startswith(VLLM_TESTS_ROOT):
                problems.append(f"{where}: {rel} is not under {VLLM_TESTS_ROOT}")
                continue
            tests[rel] = (rel.removeprefix(VLLM_TESTS_ROOT), cs.repo / rel)
        if patches:  # a change vLLM already ships on this lane needs no PR
            out.append(ResolvedVllmPr(spec=spec, patches=patches, tests=tests))
    _once(owner, "vLLM patch", problems)
    return out


def measured_upto(keys: Sequence[str], key: str, on: str) -> int | None:
    """How many PRs of the stack ``keys`` (merge order), from the first, the tree that PR ``key``'s
    figures were measured on had applied, for its ``measured_on`` value ``on``: all of them for
    ``"stack"``, up to ``key`` for ``"own"``, up to ``on`` for a key; None for anything else."""
    if on == "stack":
        return len(keys)
    if on == "own":
        return keys.index(key) + 1
    return keys.index(on) + 1 if on in keys else None


def resolve(
    cs: ChangeSet, table: tuple[OmniPr, ...] = STACK, vllm_table: tuple[VllmPr, ...] = VLLM_PRS
) -> Stack:
    """The stack of ``table`` / ``vllm_table`` as the checkout of ``cs`` fills it.

    Raises:
        StackError: every way the tables and the checkout disagree (a patch, owned file, test file
            or design page in no PR or in two, an entry that matches nothing, PRs out of series
            order, an unknown vLLM PR, a duplicate key), one per line.
    """
    problems: list[str] = []
    keys = [pr.key for pr in table] + [pr.key for pr in vllm_table]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        problems.append(f"key {key!r} is used by two PRs")
    for key in keys:
        if not re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+)*", key):
            problems.append(f"key {key!r} is not lower-case words joined by '-' (it names a folder)")
    omni = _resolve_omni(cs, table, problems)
    vllm = _resolve_vllm(cs, vllm_table, problems)
    known_vllm = {pr.key for pr in vllm_table}
    present = {pr.key for pr in vllm}
    for pr in omni:
        for key in pr.vllm:
            if key not in known_vllm:
                problems.append(
                    f"PR {pr.key}: depends on vLLM PR {key!r}, which the vLLM table does not have"
                )
        pr.vllm = [k for k in pr.vllm if k in present]
    if problems:
        raise StackError("the stack table does not fit the checkout:\n  " + "\n  ".join(problems))
    stack = Stack(omni=omni, vllm=vllm)
    for pr in omni:
        for page, heading in pr.sections:
            stack.page_sections.setdefault(page, {})[heading] = pr.key
    return stack
