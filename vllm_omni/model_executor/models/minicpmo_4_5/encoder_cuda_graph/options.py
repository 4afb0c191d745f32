# SPDX-License-Identifier: Apache-2.0
"""MiniCPM-o 4.5's encoder ``--hf-overrides`` keys (:data:`HF_OVERRIDE_KEYS`), validated at once."""

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
    """One ``--hf-overrides`` key: ``kind`` ``"bool"``, ``"int"`` (booleans and floats rejected),
    ``"number"`` (finite) or ``"choice"`` (one of ``choices``); numeric keys need a ``maximum``.

    Raises:
        ValueError: a numeric entry without ``maximum >= minimum``, or a default it does not allow.
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
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    for unit, shift in (("TiB", 40), ("GiB", 30)):
        if isinstance(value, int) and value >= 1 << shift and value % (1 << shift) == 0:
            return f"{text} ({value >> shift} {unit})"
    return text


def _registry(*keys: HfOverrideKey) -> dict[str, HfOverrideKey]:
    return {key.name: key for key in keys}


#: Every encoder ``--hf-overrides`` key the model reads. A numeric key's maximum is where the
#: setting stops making sense (a larger value is a mistake to report).
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
    config, another ``--hf-overrides`` key) is never taken for a misspelling of one of ours.
    """
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

    Args:
        hf_config: any object (a ``transformers.PretrainedConfig`` when served).

    Returns:
        ``{key: value}`` for every key of :data:`HF_OVERRIDE_KEYS`, the default
        where ``hf_config`` lacks the key.

    Raises:
        HfOverridesError: (a ``ValueError``) every bad value and every unknown key that starts
            with ``encoder_cuda_graph`` or is a near-miss of a registered key, at once.
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
    return dataclasses.field(default=HF_OVERRIDE_KEYS[key].default, metadata={"hf_key": key})


@dataclass(frozen=True)
class EncoderCudaGraphOptions:
    """The adapter's settings: each field is the ``--hf-overrides`` key in its metadata, whose
    default, range and doc are in :data:`HF_OVERRIDE_KEYS`. One instance configures both encoders.

    Raises:
        HfOverridesError: a value of the wrong type or below its minimum. Only :meth:`from_hf_config`
            applies the maximum, so the wiring may derive larger values (the streaming audio cap).
    """

    enabled: bool = _hf_field("encoder_cuda_graph")
    max_graphs: int = _hf_field("encoder_cuda_graph_max_graphs")
    min_capture_calls: int = _hf_field("encoder_cuda_graph_min_capture_calls")
    min_free_bytes: int = _hf_field("encoder_cuda_graph_min_free_bytes")
    share_pools: bool = _hf_field("encoder_cuda_graph_share_pools")
    admission: str = _hf_field("encoder_cuda_graph_admission")
    max_bytes: int = _hf_field("encoder_cuda_graph_max_bytes")
    log_interval_s: float = _hf_field("encoder_cuda_graph_log_interval_s")
    streaming_audio: bool = _hf_field("encoder_cuda_graph_streaming_audio")
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
