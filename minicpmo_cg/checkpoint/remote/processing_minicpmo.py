"""MiniCPM-o 4.5's HF processor for ``AutoProcessor`` (``auto_map``): images through vllm-omni's
``MiniCPMVImageProcessor``, audio through transformers' ``WhisperFeatureExtractor``, text through the
folder's tokenizer. ``(<image>./</image>)`` becomes the image's markers with ``query_num`` ``<unk>`` per
slice, ``(<audio>./</audio>)`` one ``<unk>`` per audio token within ``<|audio_start|>``/``<|audio_end|>``.
"""

import json
import math
import re

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, WhisperFeatureExtractor
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import cached_file
from vllm_omni.model_executor.models.minicpmo_4_5.minicpmo_4_5_omni_llm import MiniCPMVImageProcessor

IMAGE_PATTERN = "(<image>./</image>)"
AUDIO_PATTERN = "(<audio>./</audio>)"


def _per_prompt(items, leaf_types):
    """``items`` as one list per prompt: one item, a list of items (one prompt) or a list of lists."""
    if isinstance(items, leaf_types):
        return [[items]]
    items = list(items)
    return [items] if items and isinstance(items[0], leaf_types) else [list(group) for group in items]


class MiniCPMO45Processor(ProcessorMixin):
    """Image processor, Whisper feature extractor and tokenizer of a MiniCPM-o 4.5 checkpoint."""

    def __init__(
        self,
        image_processor,
        feature_extractor,
        tokenizer,
        chat_template=None,
        pool_step=5,
        audio_chunk_length=1.0,
        audio_start="<|audio_start|>",
        audio_end="<|audio_end|>",
    ):
        super().__init__(image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        self.pool_step, self.audio_chunk_length = pool_step, audio_chunk_length
        self.audio_start, self.audio_end = audio_start, audio_end

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, tokenizer=None, **kwargs):
        """Build from the folder's ``preprocessor_config.json``; the tokenizer is loaded unless given.
        Other keyword arguments (vLLM passes ``mm_processor_kwargs``) apply per call, not here."""
        hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        with open(cached_file(pretrained_model_name_or_path, "preprocessor_config.json", **hub)) as f:
            config = json.load(f)
        if tokenizer is None:
            # config.json names code: without the caller's trust_remote_code, transformers would prompt
            hub["trust_remote_code"] = kwargs.get("trust_remote_code", False)
            tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **hub)
        return cls(
            MiniCPMVImageProcessor(**config["image_processor"]),
            WhisperFeatureExtractor(**config["feature_extractor"]),
            tokenizer,
            **config["processor"],
        )

    def audio_tokens(self, num_frames):
        """LLM tokens of ``num_frames`` mel frames: Whisper's stride-2 conv, then ``pool_step`` pooling."""
        return ((num_frames + 1) // 2) // self.pool_step

    def get_audio_placeholder(self, audio_lens, chunk_input=True, chunk_length=1):
        """The placeholder text of a clip of ``audio_lens`` samples: one ``<unk>`` per audio token,
        in one ``audio_start``/``audio_end`` group, or (``chunk_input``) one per ``chunk_length`` s."""
        extractor = self.feature_extractor
        total = self.audio_tokens(math.ceil(audio_lens / extractor.hop_length))
        step = total
        if chunk_input:
            chunk_frames = int(chunk_length * extractor.sampling_rate / extractor.hop_length)
            step = max(self.audio_tokens(chunk_frames), 1)
        groups = [min(step, total - start) for start in range(0, total, step)] or [0]
        return "".join(self.audio_start + "<unk>" * n + self.audio_end for n in groups)

    def _audio_inputs(self, audios, sampling_rate):
        """Mel features of each clip's 30 s segments: ``audio_features`` ``(segments, mel, frames)``,
        zero-padded; ``audio_feature_lens``, per prompt, the segments' frame counts."""
        window = self.feature_extractor.n_samples
        pieces, counts = [], []
        for clips in audios:
            clips = [np.asarray(c, dtype=np.float32).reshape(-1) for c in clips]
            prompt_pieces = [c[s : s + window] for c in clips for s in range(0, max(len(c), 1), window)]
            pieces += prompt_pieces
            counts.append(len(prompt_pieces))
        if not pieces:
            no_lens = [torch.zeros(0, dtype=torch.long)] * len(counts)
            return {"audio_features": [], "audio_feature_lens": no_lens}
        out = self.feature_extractor(
            pieces, sampling_rate=sampling_rate, padding="max_length", return_attention_mask=True,
            return_tensors="pt",
        )
        lens = out["attention_mask"].sum(dim=1).long()
        features = out["input_features"][:, :, : int(lens.max())]
        return {"audio_features": features, "audio_feature_lens": list(torch.split(lens, counts))}

    def _expand(self, text, sizes, clips, max_slice_nums, use_image_id, chunk_input):
        """``text`` with each image / audio pattern replaced by its item's placeholder.

        Raises:
            ValueError: the patterns and the items differ in number.
        """
        parts = re.split(f"({re.escape(IMAGE_PATTERN)}|{re.escape(AUDIO_PATTERN)})", text)
        if parts.count(IMAGE_PATTERN) != len(sizes) or parts.count(AUDIO_PATTERN) != len(clips):
            raise ValueError(
                f"a prompt has {parts.count(IMAGE_PATTERN)} image and {parts.count(AUDIO_PATTERN)} audio "
                f"patterns for {len(sizes)} images and {len(clips)} audio clips"
            )
        sizes, clips = iter(enumerate(sizes)), iter(clips)
        for i, part in enumerate(parts):
            if part == IMAGE_PATTERN:
                index, size = next(sizes)
                parts[i] = self.image_processor.get_slice_image_placeholder(
                    size, image_idx=index, max_slice_nums=max_slice_nums, use_image_id=use_image_id
                )
            elif part == AUDIO_PATTERN:
                parts[i] = self.get_audio_placeholder(len(next(clips)), chunk_input, self.audio_chunk_length)
        return "".join(parts)

    def __call__(
        self,
        text=None,
        images=None,
        audios=None,
        max_slice_nums=None,
        use_image_id=None,
        chunk_input=False,
        sampling_rate=16000,
        return_tensors="pt",
        **kwargs,
    ):
        """Process prompts with their images and audio clips (vLLM passes one prompt per item).

        Raises:
            ValueError: prompts and media do not match.
        """
        data, image_lists, audio_lists = {}, [], []
        if images is not None:
            image_lists = [
                [self.image_processor.to_pil_image(img).convert("RGB") for img in group]
                for group in _per_prompt(images, (Image.Image, np.ndarray, torch.Tensor))
            ]
            out = self.image_processor.preprocess(
                image_lists, max_slice_nums=max_slice_nums, return_tensors=return_tensors
            )
            data.update({k: out[k] for k in ("pixel_values", "image_sizes", "tgt_sizes")})
        if audios is not None:
            audio_lists = _per_prompt(audios, (np.ndarray, torch.Tensor))
            data.update(self._audio_inputs(audio_lists, sampling_rate))
        if text is not None:
            prompts = [text] if isinstance(text, str) else list(text)
            image_lists = image_lists or [[] for _ in prompts]
            audio_lists = audio_lists or [[] for _ in prompts]
            if not len(prompts) == len(image_lists) == len(audio_lists):
                lists = f"{len(image_lists)} image and {len(audio_lists)} audio lists"
                raise ValueError(f"prompts and media do not match: {len(prompts)} prompts, {lists}")
            expanded = [
                self._expand(p, [img.size for img in imgs], clips, max_slice_nums, use_image_id, chunk_input)
                for p, imgs, clips in zip(prompts, image_lists, audio_lists)
            ]
            data.update(self.tokenizer(expanded, padding=True, return_tensors="pt"))
        return BatchFeature(data)
