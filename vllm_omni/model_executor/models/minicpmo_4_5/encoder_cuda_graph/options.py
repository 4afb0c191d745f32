# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's encoder ``--hf-overrides`` keys and the adapter's options, validated.

:data:`HF_OVERRIDE_KEYS` holds one :class:`HfOverrideKey` entry per key (kind,
default, range, doc); :func:`read_hf_overrides` validates them all (and rejects
unknown look-alikes) in one :class:`HfOverridesError`;
:class:`EncoderCudaGraphOptions` is the adapter's view of them. The key
``vision_attn_implementation`` belongs to SigLIP's attention: its definition
(choices, default, doc) comes from ``siglip_attention.py`` beside the model
file, which validates it on its own too; it is registered here so that one
error reports it with the adapter's keys and its look-alikes are caught.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from .. import siglip_attention

__all__ = [
    "HF_OVERRIDE_KEYS",
    "EncoderCudaGraphOptions",
    "HfOverrideKey",
    "HfOverridesError",
    "OptionKind",
    "read_hf_overrides",
]

OptionKind = Literal["bool", "int", "number", "choice"]

_JSON_TYPE_NAMES = {
    bool: "a boolean",
    str: "a string",
    int: "an integer",
    float: "a float",
    type(None): "null",
}


def _as_json(value: Any) -> str:
    """``value`` as the user wrote it in the ``--hf-overrides`` JSON (repr when not JSON)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _type_name(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return _JSON_TYPE_NAMES.get(type(value), f"a {type(value).__name__}")


@dataclass(frozen=True)
class HfOverrideKey:
    """One ``--hf-overrides`` key of the encoder options.

    Attributes:
        name: the JSON key, e.g. ``"encoder_cuda_graph_max_graphs"``.
        kind: ``"bool"`` (a JSON boolean), ``"int"`` (an integer from ``minimum``
            to ``maximum``; ``true``/``false`` and floats are rejected), ``"number"``
            (a finite integer or float from ``minimum`` to ``maximum``) or
            ``"choice"`` (one of ``choices``).
        default: the value in force when the key is absent.
        doc: one line for the option tables.
        minimum: lower bound of ``"int"`` and ``"number"`` keys (inclusive).
        maximum: upper bound of ``"int"`` and ``"number"`` keys (inclusive), required
            for them: a value past any sensible setting (e.g. a capture threshold no
            shape ever reaches) is a mistake to report, not a setting to honour.
            It bounds what a user writes (:func:`read_hf_overrides`); code that derives
            a value from the options may pass it (``check(value, bounded=False)``): the
            streaming audio adapter's cap is its number of batch buckets.
        choices: allowed strings of a ``"choice"`` key.

    Raises:
        ValueError: an ``"int"`` or ``"number"`` entry without a ``maximum`` (or with
            ``maximum < minimum``), or a default the entry does not allow.
    """

    name: str
    kind: OptionKind
    default: Any
    doc: str
    minimum: float = 0
    maximum: float | None = None
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind in ("int", "number") and (self.maximum is None or self.maximum < self.minimum):
            kind = "an int" if self.kind == "int" else "a number"
            raise ValueError(
                f"registry entry {self.name}: {kind} key needs a maximum >= its minimum "
                f"{_bound(self.minimum)}, got {self.maximum!r}"
            )
        if self.check(self.default) is not None:
            raise ValueError(f"registry entry {self.name}: default {self.default!r} is not {self.allowed}")

    @property
    def allowed(self) -> str:
        """What the key accepts from a user, in words (used in error messages and docs)."""
        return self._allowed(bounded=True)

    def _allowed(self, bounded: bool) -> str:
        if self.kind == "bool":
            return "a JSON boolean (true or false)"
        if self.kind in ("int", "number"):
            what = "an integer" if self.kind == "int" else "a number"
            upper = f" and <= {_bound(self.maximum)}" if bounded and self.maximum is not None else ""
            return f"{what} >= {_bound(self.minimum)}{upper}"
        return "one of " + ", ".join(json.dumps(c) for c in self.choices)

    def _accepts(self, value: Any, bounded: bool) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        # compared as given: an int of any size (JSON has no limit) never goes through float
        return self.minimum <= value and (not bounded or self.maximum is None or value <= self.maximum)

    def check(self, value: Any, *, bounded: bool = True) -> str | None:
        """None when ``value`` is allowed, else ``key=<JSON>: got <type>, expected <allowed>``.

        Args:
            bounded: also apply ``maximum`` (a user's value); False checks the type and the
                minimum only (a value the code derived from validated options).
        """
        if self._accepts(value, bounded):
            return None
        return f"{self.name}={_as_json(value)}: got {_type_name(value)}, expected {self._allowed(bounded)}"


def _bound(value: float | None) -> str:
    """A range bound as a user writes it, with its size for whole GiB or TiB (``1099511627776 (1 TiB)``)."""
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    for unit, shift in (("TiB", 40), ("GiB", 30)):
        if isinstance(value, int) and value >= 1 << shift and value % (1 << shift) == 0:
            return f"{text} ({value >> shift} {unit})"
    return text


def _registry(*keys: HfOverrideKey) -> dict[str, HfOverrideKey]:
    return {key.name: key for key in keys}


#: Every encoder ``--hf-overrides`` key the model reads, by name. Adding a key is one
#: entry here (register only keys whose behaviour exists); its consumer reads the
#: validated value from :func:`read_hf_overrides`. The maximum of each numeric key is
#: where the setting stops making sense: 1024 graphs per encoder (never evicted, each
#: holding pool segments and buffers), a capture threshold of 10000 calls (the cost rule
#: is the way to be more selective), 1 TiB for byte amounts (more than any device holds)
#: and one day between stats lines.
#: The streaming audio adapter keeps up to 30 times ``max_graphs`` graphs.
HF_OVERRIDE_KEYS: dict[str, HfOverrideKey] = _registry(
    HfOverrideKey(
        name="encoder_cuda_graph",
        kind="bool",
        default=True,
        doc="build the encoder graph adapters at all (--enforce-eager always disables them)",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_max_graphs",
        kind="int",
        minimum=0,
        maximum=1024,
        default=4,
        doc="graphs kept per encoder, never evicted; 0 disables capture",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_min_capture_calls",
        kind="int",
        minimum=2,
        maximum=10_000,
        default=2,
        doc="calls with the same input shapes, dtype, device and stream before a capture may happen",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_min_free_bytes",
        kind="int",
        minimum=0,
        maximum=1 << 40,
        default=1 << 30,
        doc="defer a capture while the device has less free memory (bytes); 0 disables",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_share_pools",
        kind="bool",
        default=True,
        doc="one graph pool + capture stream per (encoder, device, replay stream); false = one per graph",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_admission",
        kind="choice",
        choices=("cost", "count"),
        default="cost",
        doc='vision and stateless audio encoders: "cost" captures a shape only when its measured saving '
        'pays for capture and memory, "count" every shape seen min_capture_calls times'
        ' (streaming audio chunks always use "count")',
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_max_bytes",
        kind="int",
        minimum=0,
        maximum=1 << 40,
        default=0,
        doc="device memory the graphs of one encoder may hold (bytes); a capture that would pass it "
        "is deferred; 0 = no limit",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_log_interval_s",
        kind="number",
        minimum=0,
        maximum=86_400,
        default=60.0,
        doc="seconds between INFO lines with each encoder's hit rate, graphs and bytes; 0 = off",
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_streaming_audio",
        kind="bool",
        default=True,
        doc="also replay the streaming (duplex) audio forward from CUDA graphs, one per batch bucket "
        '(1, 2, 4, ... up to duplex_max_sessions, at most 32), bitwise equal to its eager run; admission "count"',
    ),
    HfOverrideKey(
        name="encoder_cuda_graph_startup_capture",
        kind="bool",
        default=True,
        doc="duplex deployments: allocate the streaming audio K/V pages and capture the streaming audio graph "
        "of every batch bucket and the camera frame's graph while the worker warms up, before the KV cache "
        "is sized; false = capture them lazily, as sessions reach them",
    ),
    HfOverrideKey(
        name=siglip_attention.VISION_ATTN_KEY,
        kind="choice",
        choices=siglip_attention.VISION_ATTN_CHOICES,
        default=siglip_attention.VISION_ATTN_DEFAULT,
        doc=siglip_attention.VISION_ATTN_DOC,
    ),
    HfOverrideKey(
        name="encoder_fused_layers",
        kind="choice",
        choices=("all", "vision", "audio", "none"),
        default="all",
        doc="encoders whose layers run fused (packed q/k/v, GEMM epilogues, residual add + LayerNorm "
        'in one kernel), eager and graphed alike; read by the model file (fused_layers.py): "all", '
        '"vision", "audio" or "none" (the unfused layers); SigLIP only with its "sdpa" attention',
    ),
)

#: Unregistered keys starting with one of these are always reported as unknown.
_KEY_PREFIXES = ("encoder_cuda_graph",)
_NEAR_MISS_CUTOFF = 0.8
_MIN_TRUNCATED_KEY = 10


class HfOverridesError(ValueError):
    """One or more bad encoder ``--hf-overrides`` keys; ``problems`` lists each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(
            f"invalid --hf-overrides for MiniCPM-o 4.5 ({count}):\n  " + "\n  ".join(self.problems)
        )


def _closest_key(name: str) -> str | None:
    """The registered key ``name`` looks like a misspelling or truncation of, if any."""
    name = name.lower()
    match = difflib.get_close_matches(name, list(HF_OVERRIDE_KEYS), n=1, cutoff=_NEAR_MISS_CUTOFF)
    if match:
        return match[0]
    if len(name) >= _MIN_TRUNCATED_KEY:
        return next((key for key in HF_OVERRIDE_KEYS if key.startswith(name)), None)
    return None


def _model_config_names(hf_config: Any) -> set[str]:
    """Names the model's configuration itself uses: the attributes of its sub-configurations
    (``audio_config.encoder_layers``, ...), so that the same name at the top level (a checkpoint's
    config, another ``--hf-overrides`` key) is never taken for a misspelling of one of ours."""
    names: set[str] = set()
    for value in getattr(hf_config, "__dict__", {}).values():
        if callable(getattr(value, "to_dict", None)):
            names.update(getattr(value, "__dict__", {}))
    return names


def _is_own_name(name: str) -> bool:
    """Whether ``name`` is the unprefixed tail of a registered key: ``attn_implementation`` is
    transformers' own key, not a misspelling of ``vision_attn_implementation``."""
    return any(key.endswith("_" + name.lower()) for key in HF_OVERRIDE_KEYS)


def _unknown_key_problems(hf_config: Any) -> list[str]:
    """Unregistered attributes of ``hf_config`` that carry a key prefix or look like a key
    (not a name the model's sub-configurations use, nor the unprefixed tail of a key)."""
    problems = []
    model_names = _model_config_names(hf_config)
    for name, value in getattr(hf_config, "__dict__", {}).items():
        if name in HF_OVERRIDE_KEYS or hasattr(type(hf_config), name):
            continue
        if not name.lower().startswith(_KEY_PREFIXES) and (name in model_names or _is_own_name(name)):
            continue
        closest = _closest_key(name)
        if closest is None and not name.lower().startswith(_KEY_PREFIXES):
            continue
        hint = f"did you mean {closest}?" if closest else "valid keys: " + ", ".join(HF_OVERRIDE_KEYS)
        problems.append(f"{name}={_as_json(value)}: unknown key, {hint}")
    return problems


def read_hf_overrides(hf_config: Any) -> dict[str, Any]:
    """Validate the encoder ``--hf-overrides`` keys on a model's HF config.

    ``--hf-overrides`` JSON keys land as attributes of
    ``model_config.hf_config``; the checkpoint's own keys live there too.

    Args:
        hf_config: any object (a ``transformers.PretrainedConfig`` when served).

    Returns:
        ``{key: value}`` for every key of :data:`HF_OVERRIDE_KEYS`, the default
        where ``hf_config`` lacks the key.

    Raises:
        HfOverridesError: (a ``ValueError``) listing every problem at once: a
            value of the wrong type or out of range (key, value as JSON, type
            received, what is allowed), and every unknown key that starts with
            ``encoder_cuda_graph`` or is a near-miss of a registered key, with
            the closest valid key.
    """
    problems = []
    values = {}
    for name, spec in HF_OVERRIDE_KEYS.items():
        value = getattr(hf_config, name, spec.default)
        problem = spec.check(value)
        if problem is not None:
            problems.append(problem)
        values[name] = value
    problems += _unknown_key_problems(hf_config)
    if problems:
        raise HfOverridesError(problems)
    return values


def _hf_field(key: str) -> Any:
    """A dataclass field whose default, type rule and doc come from ``HF_OVERRIDE_KEYS[key]``."""
    return dataclasses.field(default=HF_OVERRIDE_KEYS[key].default, metadata={"hf_key": key})


@dataclass(frozen=True)
class EncoderCudaGraphOptions:
    """The adapter's settings, read from ``--hf-overrides``.

    One instance configures both encoders; each encoder gets its own adapter,
    so caps and counters are per encoder. Each field names its key in
    :data:`HF_OVERRIDE_KEYS`, which holds the default, the rule and the doc.
    The fields that only the model wiring reads are documented where they
    are defined.

    Attributes:
        enabled: ``encoder_cuda_graph`` (bool, default True). False builds no
            adapters and every call runs eagerly.
        max_graphs: ``encoder_cuda_graph_max_graphs`` (int 0 to 1024, default 4).
            Graphs retained per encoder; 0 disables capture. Never evicted.
        min_capture_calls: ``encoder_cuda_graph_min_capture_calls`` (int 2 to
            10000, default 2). Calls with the same key, the capturing call included,
            before a shape is captured.
        min_free_bytes: ``encoder_cuda_graph_min_free_bytes`` (int 0 to 1 TiB,
            bytes, default 1 GiB). A capture is deferred while the device's free
            memory is below it; 0 disables the check.
        share_pools: ``encoder_cuda_graph_share_pools`` (bool, default True).
            One graph pool and capture stream per (encoder, device, replay
            stream); False gives each graph its own (for A/B comparison).
        admission: ``encoder_cuda_graph_admission`` (``"cost"`` or
            ``"count"``, default ``"cost"``). ``"count"`` captures a shape at its
            ``min_capture_calls``-th call; ``"cost"`` also requires the measured
            saving to pay for the capture and the memory (:class:`CaptureCostModel`).
            The model wiring applies it to the vision and stateless audio
            adapters.
            The streaming audio adapter always counts (see ``streaming_audio``).
        max_bytes: ``encoder_cuda_graph_max_bytes`` (int 0 to 1 TiB, bytes, default 0).
            Device memory the encoder's graphs may hold (pool growth + static
            input and output buffers); a capture whose estimate would pass it is
            deferred. 0 = no limit.
        log_interval_s: ``encoder_cuda_graph_log_interval_s`` (number 0 to 86400,
            seconds, default 60). Period of the INFO line with the hit rate,
            graphs and bytes, logged from the call path; 0 = off.

    Raises:
        HfOverridesError: (a ``ValueError``) every value of the wrong type or
            out of range, each naming the ``--hf-overrides`` key, the value as
            JSON, the type received and what is allowed. ``true`` is not
            accepted as an int and the string ``"false"`` not as a bool. The
            ranges above bound the ``--hf-overrides`` values
            (:meth:`from_hf_config`).
            Built directly (``EncoderCudaGraphOptions(...)``,
            ``dataclasses.replace``, the adapter's constructor), a numeric field
            is checked against its minimum only, so the wiring may derive larger
            values (the streaming audio adapter's ``max_graphs``).
    """

    enabled: bool = _hf_field("encoder_cuda_graph")
    max_graphs: int = _hf_field("encoder_cuda_graph_max_graphs")
    min_capture_calls: int = _hf_field("encoder_cuda_graph_min_capture_calls")
    min_free_bytes: int = _hf_field("encoder_cuda_graph_min_free_bytes")
    share_pools: bool = _hf_field("encoder_cuda_graph_share_pools")
    admission: str = _hf_field("encoder_cuda_graph_admission")
    max_bytes: int = _hf_field("encoder_cuda_graph_max_bytes")
    log_interval_s: float = _hf_field("encoder_cuda_graph_log_interval_s")
    #: ``encoder_cuda_graph_streaming_audio`` (bool, default True). Read by the model wiring, not by the
    #: adapter: replay the streaming (duplex) audio forward (``streaming_audio.encode_rows``, every chunk of
    #: every session) from one graph per batch bucket, bitwise equal to its eager run. Needs ``enabled``. That
    #: adapter captures by ``"count"`` whatever ``admission`` says: its keys are the few buckets, each of which
    #: every step of that many sessions meets; the other options apply to it as to each encoder.
    streaming_audio: bool = _hf_field("encoder_cuda_graph_streaming_audio")
    #: ``encoder_cuda_graph_startup_capture`` (bool, default True). Read by the model wiring: on a duplex
    #: deployment, allocate the streaming audio K/V pages and capture the graphs every duplex session needs
    #: (every batch bucket of the streaming audio forward, a camera frame's single slice) while the worker
    #: warms up, before vLLM sizes the KV cache; False leaves them to the lazy path.
    startup_capture: bool = _hf_field("encoder_cuda_graph_startup_capture")

    def __post_init__(self) -> None:
        # the type and the minimum: values read from --hf-overrides were range-checked by
        # read_hf_overrides; the code derives larger ones (the streaming audio adapter's cap)
        checks = (
            HF_OVERRIDE_KEYS[f.metadata["hf_key"]].check(getattr(self, f.name), bounded=False)
            for f in fields(self)
        )
        problems = [p for p in checks if p is not None]
        if problems:
            raise HfOverridesError(problems)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EncoderCudaGraphOptions:
        """Read the options from a model's HF config, validating every registered key.

        Raises:
            HfOverridesError: see :func:`read_hf_overrides`.
        """
        values = read_hf_overrides(hf_config)
        return cls(**{f.name: values[f.metadata["hf_key"]] for f in fields(cls)})

    def describe(self) -> str:
        """``key=<JSON> ...`` for every option, as a user would write them."""
        return " ".join(f"{f.metadata['hf_key']}={_as_json(getattr(self, f.name))}" for f in fields(self))
