"""Real inputs through MiniCPM-o's own preprocessing, for tests and measurements outside an engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Whisper front end: 16 kHz input, 80 mel bins, hop 160 samples -> 100 mel frames per second.
SAMPLING_RATE = 16000
NUM_MEL_BINS = 80
#: MiniCPM-o cuts audio into parts of at most 30 s (Whisper's window, 3000 mel frames).
MAX_CLIP_SECONDS = 30.0

#: Slicing of MiniCPM-o 4.5 (checkpoint slice_config / MiniCPMVImageProcessor defaults).
MAX_SLICE_NUMS = 9
SCALE_RESOLUTION = 448
PATCH_SIZE = 14


@dataclass
class VisionInput:
    """One ``get_vision_hidden_states`` call: the slices of one or more photos."""

    name: str
    source: str
    pixel_values: list[torch.Tensor]
    tgt_sizes: torch.Tensor
    num_images: int = 1

    modality = "image"

    @property
    def num_slices(self) -> int:
        return len(self.pixel_values)

    @property
    def patches(self) -> list[int]:
        """Patches per slice (``h_i * w_i``)."""
        return [int(h) * int(w) for h, w in self.tgt_sizes.tolist()]

    def describe(self) -> str:
        """Input shape for the table: ``slices x max patches`` (``*`` marks a padded mask)."""
        patches = self.patches
        padded = "*" if min(patches) != max(patches) else ""
        return f"{self.num_slices} sl x {max(patches)} p{padded}"

    def data(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
        """The ``get_vision_hidden_states`` argument, on ``device``; pixels in ``dtype``."""
        return {
            "pixel_values": [p.to(device=device, dtype=dtype) for p in self.pixel_values],
            "tgt_sizes": self.tgt_sizes.to(device=device),
        }


@dataclass
class AudioInput:
    """One ``get_audio_hidden_states`` call: log-mel features of one or more clips."""

    name: str
    source: str
    features: list[torch.Tensor]
    as_list: bool = False

    modality = "audio"

    @property
    def frames(self) -> list[int]:
        """Mel frames per clip."""
        return [int(f.shape[-1]) for f in self.features]

    def describe(self) -> str:
        """Input shape for the table: ``clips x max mel frames`` (``*`` marks padding)."""
        frames = self.frames
        padded = "*" if min(frames) != max(frames) else ""
        return f"{len(frames)} x {max(frames)} mel{padded}"

    def data(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
        """The ``get_audio_hidden_states`` argument, on ``device``; features in ``dtype``."""
        feats = [f.to(device=device, dtype=dtype) for f in self.features]
        lens = [torch.tensor([n], dtype=torch.int64) for n in self.frames]
        if self.as_list:
            audio_features: Any = feats
        else:
            if len(set(self.frames)) != 1:
                raise ValueError(f"{self.name}: clips of different lengths need as_list=True")
            audio_features = torch.stack(feats)
        return {"audio_features": audio_features, "audio_feature_lens": lens}


def load_photo(name: str) -> Any:
    """Return ``skimage.data.<name>()`` as an RGB ``PIL.Image``.

    Raises:
        RuntimeError: scikit-image is missing or does not ship the photo offline.
    """
    from PIL import Image

    try:
        import skimage.data
    except ImportError as exc:
        raise RuntimeError(
            "the sample photos need scikit-image (pip install 'scikit-image==0.26.0')"
        ) from exc
    loader = getattr(skimage.data, name, None)
    if loader is None:
        raise RuntimeError(f"skimage.data has no photo {name!r} (scikit-image {skimage.__version__})")
    try:
        array = loader()
    except Exception as exc:  # e.g. pooch-only datasets raise when offline
        raise RuntimeError(f"skimage.data.{name}() is not available offline: {exc}") from exc
    return Image.fromarray(np.asarray(array)).convert("RGB")


def duplex_frame(size: int = SCALE_RESOLUTION) -> Any:
    """A ``size x size`` centre crop of ``skimage.data.coffee()``: a video-call frame in duplex mode."""
    image = load_photo("coffee")
    width, height = image.size
    side = min(width, height, size)
    left, top = (width - side) // 2, (height - side) // 2
    crop = image.crop((left, top, left + side, top + side))
    return crop if side == size else crop.resize((size, size))


def make_image_processor(scale_resolution: int = SCALE_RESOLUTION) -> Any:
    """vllm-omni's ``MiniCPMVImageProcessor`` configured as the thinker's ``__init__`` does."""
    from minicpmo_cg.thinker_config import model_module

    return model_module().MiniCPMVImageProcessor(
        max_slice_nums=MAX_SLICE_NUMS,
        scale_resolution=scale_resolution,
        patch_size=PATCH_SIZE,
        use_image_id=True,
        image_feature_size=64,
    )


def process_images(processor: Any, images: list[Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Slice and patchify photos with MiniCPM-o's processor."""
    out = processor.preprocess(images, max_slice_nums=MAX_SLICE_NUMS, return_tensors=None)
    pixel_values = [torch.from_numpy(np.ascontiguousarray(p)).float() for p in out["pixel_values"][0]]
    tgt_sizes = torch.from_numpy(np.asarray(out["tgt_sizes"][0])).to(torch.int32).reshape(-1, 2)
    if len(pixel_values) != tgt_sizes.shape[0]:
        raise RuntimeError(
            f"MiniCPMVImageProcessor returned {len(pixel_values)} slices but {tgt_sizes.shape[0]} tgt_sizes"
        )
    return pixel_values, tgt_sizes


def vision_input(processor: Any, name: str, photos: list[str], *, frame: bool = False) -> VisionInput:
    """Build a :class:`VisionInput` from ``skimage.data`` photo names."""
    images = [duplex_frame(processor.scale_resolution)] if frame else [load_photo(p) for p in photos]
    labels = ["coffee crop" if frame else p for p in photos]
    pixel_values, tgt_sizes = process_images(processor, images)
    source = ", ".join(f"{label} {img.size[0]}x{img.size[1]}" for label, img in zip(labels, images))
    return VisionInput(name, source, pixel_values, tgt_sizes, num_images=len(images))


def voice_files() -> list[Path]:
    """The voice ``.wav`` files shipped inside the installed vllm-omni package, sorted by path.

    Raises:
        RuntimeError: none found (a stripped install).
    """
    import vllm_omni

    root = Path(vllm_omni.__file__).resolve().parent
    files = sorted(root.rglob("*.wav"))
    if not files:
        raise RuntimeError(f"no .wav voice files found under {root} (real speech is needed here)")
    return files


def voice_file(stem: str) -> Path:
    """The shipped voice file named ``<stem>.wav`` (e.g. ``default_female``)."""
    for path in voice_files():
        if path.stem == stem:
            return path
    raise RuntimeError(f"vllm-omni ships no {stem}.wav; found {[p.name for p in voice_files()]}")


def load_wav_16k(path: str | Path) -> np.ndarray:
    """Read a ``.wav`` file as mono float32 in [-1, 1] at 16 kHz."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    rate, data = wavfile.read(str(path))
    if np.issubdtype(data.dtype, np.integer):
        info = np.iinfo(data.dtype)
        scale = float(max(abs(info.min), info.max))
        offset = 0.0 if info.min < 0 else (info.max + 1) / 2.0  # unsigned 8-bit PCM is offset
        wav = (data.astype(np.float64) - offset) / scale
    else:
        wav = data.astype(np.float64)
    if wav.ndim == 2:
        wav = wav.mean(axis=1)
    if rate != SAMPLING_RATE:
        g = math.gcd(int(rate), SAMPLING_RATE)
        wav = resample_poly(wav, SAMPLING_RATE // g, int(rate) // g)
    return wav.astype(np.float32)


def make_feature_extractor() -> Any:
    """transformers' ``WhisperFeatureExtractor`` for 80 mel bins at 16 kHz (built locally)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE)


def mel_features(extractor: Any, wav: np.ndarray) -> torch.Tensor:
    """Log-mel features of one clip of at most 30 s, as MiniCPM-o's processor computes them.

    Raises:
        ValueError: the clip is longer than 30 s (MiniCPM-o would split it into parts).
    """
    seconds = len(wav) / SAMPLING_RATE
    if seconds > MAX_CLIP_SECONDS:
        raise ValueError(f"clip of {seconds:.1f} s exceeds {MAX_CLIP_SECONDS:.0f} s; split it first")
    out = extractor(
        wav,
        sampling_rate=SAMPLING_RATE,
        return_attention_mask=True,
        padding="max_length",
        return_tensors="np",
    )
    frames = int(out["attention_mask"][0].sum())
    return torch.from_numpy(np.ascontiguousarray(out["input_features"][0, :, :frames])).float()


def audio_input(
    extractor: Any, name: str, clips: list[tuple[str, float | None]], *, as_list: bool | None = None
) -> AudioInput:
    """Build an :class:`AudioInput` from shipped voices."""
    features, parts = [], []
    for stem, seconds in clips:
        wav = load_wav_16k(voice_file(stem))
        if seconds is not None:
            wav = wav[: round(seconds * SAMPLING_RATE)]
        features.append(mel_features(extractor, wav))
        parts.append(f"{stem}.wav[{len(wav) / SAMPLING_RATE:.2f} s]")
    if as_list is None:
        as_list = len(clips) > 1
    return AudioInput(name, ", ".join(parts), features, as_list=as_list)


#: ``scale_resolution`` of the reduced size (``--quick``): slices of about 16 x 16 = 256 patches
#: instead of 1024.
QUICK_SCALE_RESOLUTION = 224


def build_inputs(*, quick: bool = False) -> list[VisionInput | AudioInput]:
    """The demo's inputs, vision first."""
    extractor = make_feature_extractor()
    if quick:
        processor = make_image_processor(QUICK_SCALE_RESOLUTION)
        items: list[VisionInput | AudioInput] = [
            vision_input(processor, "chelsea@224", ["chelsea"]),
            vision_input(processor, "frame@224", ["coffee"], frame=True),
        ]
    else:
        processor = make_image_processor()
        items = [
            vision_input(processor, "chelsea", ["chelsea"]),
            vision_input(processor, "astronaut", ["astronaut"]),
            vision_input(processor, "rocket", ["rocket"]),
            vision_input(processor, "hubble", ["hubble_deep_field"]),
            vision_input(processor, "retina", ["retina"]),
            vision_input(processor, "duplex_frame", ["coffee"], frame=True),
            vision_input(processor, "photos_x3", ["retina", "hubble_deep_field", "astronaut"]),
        ]
    items += [
        audio_input(extractor, "speech_1s", [("default_female", 1.0)]),
        audio_input(extractor, "speech_5s", [("default_female", 5.0)]),
    ]
    if not quick:
        items += [
            audio_input(extractor, "speech_full", [("default_female", None)]),
            audio_input(extractor, "speech_pair", [("default_male", None), ("default_female", None)]),
        ]
    return items
