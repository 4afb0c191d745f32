# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the engine driver: its prompts, the concurrency variants and the bench loop."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minicpmo_cg import thinker_engine as te

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.fixture(scope="module")
def prompts():
    return te.prompts()


def test_prompts_hold_one_placeholder_per_media_item(prompts):
    assert sorted(prompts) == sorted(["image_1_slice", "image_10_slices", "audio_1s", "audio_30s", "image_and_audio"])
    for name, p in prompts.items():
        data = p["multi_modal_data"]
        assert p["prompt"].count(te.IMAGE) == ("image" in data) and p["prompt"].count(te.AUDIO) == ("audio" in data)
    assert prompts["image_10_slices"]["multi_modal_data"]["image"].size == (1344, 1344)
    assert [len(prompts[k]["multi_modal_data"]["audio"][0]) for k in ("audio_1s", "audio_30s")] == [16000, 480000]


def test_variants_keep_shapes_and_change_the_media(prompts):
    p = prompts["image_and_audio"]
    a, b = te._variant(p, 1), te._variant(p, 2)
    (ia, (wa, ra)), (ib, (wb, rb)) = ((v["multi_modal_data"]["image"], v["multi_modal_data"]["audio"]) for v in (a, b))
    assert ia.size == ib.size and wa.shape == wb.shape and ra == rb == 16000
    assert ia.tobytes() != ib.tobytes() and not np.array_equal(wa, wb)
    assert p["multi_modal_data"]["audio"][0][0] not in (wa[0], wb[0])  # the original is untouched


class FakeEngine:
    """Finishes every request in the step after it was added; prompts expand to 50 tokens."""

    def __init__(self):
        self.pending, self.seen = [], []

    def add_request(self, request_id, prompt, params):
        self.pending.append(request_id)
        self.seen.append(prompt)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7])], prompt_token_ids=[0] * 50)
        return [SimpleNamespace(request_id=r, **vars(out)) for r in done]


def test_bench_times_each_concurrency_beside_a_text_prompt_of_the_same_length(prompts):
    engine = FakeEngine()
    rows = te.bench(engine, {"audio_1s": prompts["audio_1s"]}, [1, 8])
    assert [(r["concurrency"], r["prompt_tokens"]) for r in rows] == [(1, 50), (8, 50)]
    texts = [p for p in engine.seen if isinstance(p, dict) and "prompt_token_ids" in p]
    assert len(texts) == 1 + 8 and all(len(p["prompt_token_ids"]) == 50 for p in texts)
    media = [p for p in engine.seen if "multi_modal_data" in p]
    assert len(media) == 2 + 1 + 8  # two warm-up rounds, then each concurrency
