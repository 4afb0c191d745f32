# SPDX-License-Identifier: Apache-2.0
"""Graph keys and :class:`ExactShapeEncoder`: one key's call as a ``SupportsEncoderCudaGraph`` model."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import torch
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph
from vllm.v1.worker.encoder_cudagraph_defs import (
    EncoderCudaGraphCaptureInputs,
    EncoderCudaGraphConfig,
    EncoderCudaGraphReplayBuffers,
    EncoderItemSpec,
)

__all__ = ["ExactShapeEncoder", "GraphKey"]

GraphKey = tuple[Hashable, ...]
"""``(replay stream id, device, per input: (shape, dtype) or None)``."""


def _is_static(x: Any) -> bool:
    """A positional input that is neither a tensor nor None: a call with one is ineligible."""
    return x is not None and not isinstance(x, torch.Tensor)


#: Replay padding logic, ``padding_logic(dst, src)``: copy in place (shapes are equal by
#: construction of the key). The unbound tensor method itself, so a replay runs no Python frame of
#: ours per input.
_copy_exact = torch.Tensor.copy_


class ExactShapeEncoder(SupportsEncoderCudaGraph):
    """One captured shape as a ``SupportsEncoderCudaGraph`` model.

    Attributes:
        templates: per positional input ``(shape, dtype, device)`` of a tensor, or None.
        keys: buffer keys of the tensor inputs.
        output_shape: the eager output's shape, recorded at the key's first sighting.
        output_dtype: the eager output's dtype (default: ``dtype``).
        tokens: ``prod(output_shape[:-1])`` (at least 1), the manager's token budget.
        dtype: dtype of the first tensor input (the manager's dtype).
    """

    supports_encoder_cudagraph: ClassVar[Literal[True]] = True

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        inputs: Sequence[Any],
        output_shape: torch.Size,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        self._forward = forward
        self.arity = len(inputs)
        tensors = [isinstance(x, torch.Tensor) for x in inputs]
        self.templates = [(x.shape, x.dtype, x.device) if t else None for x, t in zip(inputs, tensors)]
        self.keys = [str(i) for i, t in enumerate(tensors) if t]
        self.output_shape = torch.Size(output_shape)
        self.tokens = max(1, math.prod(self.output_shape[:-1]))
        self.dtype = next(x.dtype for x, t in zip(inputs, tensors) if t)
        self.output_dtype = self.dtype if output_dtype is None else output_dtype
        # built once: the manager asks for the item specs twice per replay and only reads them
        self._item_specs = [EncoderItemSpec(input_size=self.tokens, output_tokens=self.tokens)]

    @property
    def static_bytes(self) -> int:
        """Bytes of the graph's static input buffers plus its output buffer (allocated outside the pool)."""
        inputs = sum(math.prod(t[0]) * t[1].itemsize for t in self.templates if t is not None)
        return inputs + math.prod(self.output_shape) * self.output_dtype.itemsize

    def _call(self, values: dict[str, Any]) -> torch.Tensor:
        return self._forward(*(values.get(str(i)) for i in range(self.arity)))

    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            modalities=["image", "audio"],
            buffer_keys=list(self.keys),
            out_hidden_size=int(self.output_shape[-1]),
            padding_logics=dict.fromkeys(self.keys, _copy_exact),
        )

    def get_input_modality(self, mm_kwargs: dict[str, Any]) -> str:
        return "image"

    def get_max_frames_per_video(self) -> int:
        return 1

    def get_encoder_cudagraph_budget_range(self, vllm_config: Any) -> tuple[int, int]:
        return self.tokens, self.tokens

    def get_encoder_cudagraph_item_specs(self, mm_kwargs: dict[str, Any]) -> list[EncoderItemSpec]:
        return self._item_specs

    def select_encoder_cudagraph_items(self, mm_kwargs: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """The one item is the whole call: ``mm_kwargs`` itself (the adapter builds it per call)."""
        if indices != [0] and list(indices) != [0]:
            raise AssertionError(f"exact-shape encoder graphs hold one item, got indices {indices}")
        return mm_kwargs

    def prepare_encoder_cudagraph_capture_inputs(
        self,
        token_budget: int,
        max_batch_size: int,
        max_frames_per_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        path: str = "default",
        axis_keys: tuple[Hashable, ...] | None = None,
    ) -> EncoderCudaGraphCaptureInputs:
        """Static input buffers: zeros per template, allocated outside the graph."""
        with torch.inference_mode(False):
            values = {
                str(i): torch.zeros(shape, dtype=t_dtype, device=t_device)
                for i, tmpl in enumerate(self.templates)
                if tmpl is not None
                for shape, t_dtype, t_device in (tmpl,)
            }
        return EncoderCudaGraphCaptureInputs(values=values)

    def prepare_encoder_cudagraph_replay_buffers(
        self, mm_kwargs: dict[str, Any], max_batch_size: int, max_frames_per_batch: int, path: str = "default"
    ) -> EncoderCudaGraphReplayBuffers:
        return EncoderCudaGraphReplayBuffers(values=mm_kwargs)  # read only (copied into the buffers)

    def encoder_cudagraph_forward(
        self, inputs: dict[str, torch.Tensor], path: str = "default"
    ) -> torch.Tensor:
        return self._call(inputs)

    def encoder_eager_forward(self, mm_kwargs: dict[str, Any], path: str = "default") -> torch.Tensor:
        return self._call(mm_kwargs)

    def postprocess_encoder_output(
        self,
        outputs: dict[str, torch.Tensor],
        indices: list[int],
        per_item_out_tokens: list[int],
        dest: dict[int, torch.Tensor],
        clone: bool = False,
        batch_mm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # cloned in the caller's mode: an inference tensor exactly when the eager forward returns one
        out = outputs["default"]
        dest[indices[0]] = out.clone() if clone else out


def _describe(key: GraphKey) -> list[Any]:
    """Readable inputs of a key for logs: ``[(shape, dtype) | None, ...]``."""
    return [t if t is None else (tuple(t[0]), str(t[1]).replace("torch.", "")) for t in key[2]]


def _tensor_entries(key: GraphKey) -> Iterator[tuple[torch.Size, torch.dtype]]:
    """The ``(shape, dtype)`` entries of a key's tensor inputs (not None)."""
    return (t for t in key[2] if t is not None)
