# SPDX-License-Identifier: Apache-2.0
"""Eager-vs-graphed serving smoke for MiniCPM-o 4.5's input encoder CUDA graphs.

Starts ``vllm serve <model> --omni`` in one mode, sends fixed image, audio and
image+audio chat prompts (greedy, text output only) through the OpenAI-compatible
API and records the answers; a second call compares two recordings.

Modes (what the user types; the adapter is the only thing that differs between
``eager`` and ``graphed``, so their answers must be identical):

- ``graphed``: default options (encoder CUDA graphs on).
- ``eager``: ``--hf-overrides '{"encoder_cuda_graph": false}'``.
- ``enforce-eager``: ``--enforce-eager`` (no adapter; the Thinker's decode graphs are
  off as well, so its answers are *not* required to match ``graphed``).

Each mode runs with SigLIP's attention chosen by ``--vision-attn`` (the ``--hf-overrides`` key
``vision_attn_implementation``, merged into the mode's overrides; default: the server's, ``"sdpa"``).
The attention changes the numerics, so only recordings of one attention are compared; each
server's log must name the attention it runs (the model's ``SigLIP attention`` INFO line).

Inputs are built locally, nothing is downloaded: images from scikit-image's bundled
photos, audio from vllm-omni's bundled voice ``.wav`` files, sent as base64 data URLs.
Each prompt group holds several inputs of one exact shape (mirrored/flipped photos,
equal-length audio windows), so the graphed server sees each shape recur: its admission
may capture it after the first calls (by default only where the measured saving pays) and
replay it later; the group ends with the first input again, whose answer must equal its
first answer within the same server.

CLI (run it with the vllm-omni under test installed)::

    python tests/helpers/serve_smoke.py run --mode graphed --out out/e2e/current-graphed.json
    python tests/helpers/serve_smoke.py run --mode graphed --vision-attn eager --out out/e2e/g-eager-attn.json
    python tests/helpers/serve_smoke.py compare out/e2e/current-eager.json out/e2e/current-graphed.json

Module-level imports are stdlib only, so ``compare`` runs on any Python 3.10+.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_ID = "openbmb/MiniCPM-o-4_5"
SERVED_MODEL_NAME = "minicpmo-cg-e2e"
HOST = "127.0.0.1"

MODE_ARGS: dict[str, list[str]] = {
    "graphed": [],
    "eager": ["--hf-overrides", json.dumps({"encoder_cuda_graph": False})],
    "enforce-eager": ["--enforce-eager"],
}
#: modes whose answers must equal ``graphed``'s (only the encoder adapter differs)
EQUIVALENT_TO_GRAPHED = ("eager",)
#: values of ``--hf-overrides vision_attn_implementation`` the e2e serves with; the first is the default
VISION_ATTNS = ("sdpa", "eager")
DEFAULT_VISION_ATTN = VISION_ATTNS[0]

#: environment knobs
ENV_MODEL = "MINICPMO_CG_E2E_MODEL"  # local checkpoint dir, or a hub id (with ENV_HUB=1)
ENV_HUB = "MINICPMO_CG_E2E_HUB"  # "1": the hub may be used (network access to huggingface.co)
ENV_STARTUP_TIMEOUT = "MINICPMO_CG_E2E_STARTUP_TIMEOUT"  # seconds, default 1200

DEFAULT_STARTUP_TIMEOUT_S = 1200.0
REQUEST_TIMEOUT_S = 300.0
MAX_TOKENS = 64

#: adapter names given by the model file's wiring (_init_encoder_cuda_graphs); each prompt
#: group repeats one shape three times, so the graphed server must capture every one
CAPTURED_ENCODERS = ("vision", "audio")
#: the adapter's INFO line per capture (encoder_cuda_graph/adapter.py, ``EncoderCudaGraph._log_capture``)
CAPTURE_RE = re.compile(r"Captured (?P<name>.+?) encoder CUDA graph (?P<n>\d+)/(?P<cap>\d+)")
#: the model's INFO line naming SigLIP's attention (vision_attn_implementation)
SIGLIP_ATTN_RE = re.compile(r"MiniCPM-o 4\.5 SigLIP attention: (?P<attn>\w+)")


class ServerError(RuntimeError):
    """The server exited, never became ready, or answered with an error."""


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it (vllm_omni imports take ~12 s)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed in {sys.executable}")
    return Path(next(iter(spec.submodule_search_locations)))


def skimage_photo(name: str) -> Path:
    """A photo bundled with scikit-image (``skimage/data/<name>.png``; no pooch download)."""
    path = _package_dir("skimage") / "data" / f"{name}.png"
    if not path.is_file():
        raise FileNotFoundError(f"scikit-image does not bundle {path.name} ({path})")
    return path


def vllm_omni_voice(name: str) -> Path:
    """A voice prompt bundled with vllm-omni (Step-Audio 2 assets; present in 0.28.0 and 0.30.0)."""
    path = _package_dir("vllm_omni") / "model_executor" / "models" / "step_audio2" / "assets" / f"{name}.wav"
    if not path.is_file():
        raise FileNotFoundError(f"vllm-omni does not bundle {path.name} ({path})")
    return path


def image_png(photo: str, transform: str = "none") -> bytes:
    """PNG bytes of a bundled photo, optionally mirrored or flipped (same size, different pixels)."""
    from PIL import Image

    with Image.open(skimage_photo(photo)) as im:
        im = im.convert("RGB")
        if transform == "mirror":
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        elif transform == "flip":
            im = im.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        elif transform != "none":
            raise ValueError(f"unknown transform {transform!r}")
        buf = io.BytesIO()
        im.save(buf, format="PNG")
    return buf.getvalue()


def audio_wav(voice: str, start_s: float, seconds: float) -> bytes:
    """A ``seconds``-long window of a bundled voice, as WAV bytes in the source's format."""
    with wave.open(str(vllm_omni_voice(voice)), "rb") as src:
        params = src.getparams()
        first = round(start_s * params.framerate)
        count = round(seconds * params.framerate)
        if first + count > params.nframes:
            raise ValueError(
                f"{voice}.wav has {params.nframes / params.framerate:.2f} s; "
                f"window {start_s}+{seconds} s does not fit"
            )
        src.setpos(first)
        frames = src.readframes(count)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as dst:
        dst.setnchannels(params.nchannels)
        dst.setsampwidth(params.sampwidth)
        dst.setframerate(params.framerate)
        dst.writeframes(frames)
    return buf.getvalue()


def data_url(payload: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode('ascii')}"


@dataclass(frozen=True)
class Prompt:
    """One chat turn: images and audio clips (built lazily) and a question."""

    name: str
    text: str
    images: tuple[tuple[str, str], ...] = ()  # (photo, transform)
    audios: tuple[tuple[str, float, float], ...] = ()  # (voice, start_s, seconds)

    def messages(self) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = []
        for photo, transform in self.images:
            content.append(
                {
                    "type": "image_url",
                    "image_url": {"url": data_url(image_png(photo, transform), "image/png")},
                }
            )
        for voice, start, seconds in self.audios:
            content.append(
                {
                    "type": "audio_url",
                    "audio_url": {"url": data_url(audio_wav(voice, start, seconds), "audio/wav")},
                }
            )
        content.append({"type": "text", "text": self.text})
        return [{"role": "user", "content": content}]


_DESCRIBE = "Describe this image in two sentences."
_TRANSCRIBE = "Transcribe the speech in this audio exactly."
_BOTH = "First describe the image in one sentence, then transcribe the speech in the audio."


def _group(name: str, text: str, variants: list[dict[str, Any]]) -> list[Prompt]:
    """Same-shape variants in order (warmup, capture, replay), then the first one again."""
    prompts = [Prompt(f"{name}/{i}", text, **v) for i, v in enumerate(variants)]
    return prompts + [Prompt(f"{name}/0#again", text, **variants[0])]


#: the fixed prompt set, in send order
PROMPTS: tuple[Prompt, ...] = tuple(
    _group(
        "image-astronaut-512x512",
        _DESCRIBE,
        [{"images": (("astronaut", t),)} for t in ("none", "mirror", "flip")],
    )
    + _group(
        "image-coffee-600x400",
        _DESCRIBE,
        [{"images": (("coffee", t),)} for t in ("none", "mirror", "flip")],
    )
    + _group(
        "audio-female-4s",
        _TRANSCRIBE,
        [{"audios": (("default_female", start, 4.0),)} for start in (0.0, 2.5, 5.0)],
    )
    + _group(
        "image+audio-chelsea-male-3s",
        _BOTH,
        [
            {"images": (("chelsea", t),), "audios": (("default_male", start, 3.0),)}
            for t, start in (("none", 0.0), ("mirror", 2.0), ("flip", 4.0))
        ],
    )
)


def repeat_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(first, again) name pairs whose answers must be equal within one server."""
    return [(n[: -len("#again")], n) for n in names if n.endswith("#again")]


# ---------------------------------------------------------------------------
# Model selection
# ---------------------------------------------------------------------------


def _hub_snapshot_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_model(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """The checkpoint to serve, or None with the reason to skip.

    - ``MINICPMO_CG_E2E_MODEL`` = an existing directory: that local checkpoint
      (it must hold ``config.json``; anything else is a configuration error);
    - otherwise the hub id (``MINICPMO_CG_E2E_MODEL`` or ``openbmb/MiniCPM-o-4_5``),
      when ``MINICPMO_CG_E2E_HUB=1`` allows downloads or its snapshot is already in
      the Hugging Face cache.

    Raises:
        ValueError: ``MINICPMO_CG_E2E_MODEL`` names a directory without ``config.json``.
    """
    env = dict(os.environ if env is None else env)
    value = env.get(ENV_MODEL, "").strip()
    if value and Path(value).expanduser().is_dir():
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"{ENV_MODEL}={value} is a directory without config.json (not a checkpoint)")
        return str(path), f"local checkpoint {path}"
    repo_id = value or MODEL_ID
    if env.get(ENV_HUB, "") == "1":
        return repo_id, f"hub id {repo_id} ({ENV_HUB}=1)"
    if _hub_snapshot_cached(repo_id):
        return repo_id, f"hub id {repo_id} (snapshot in the Hugging Face cache)"
    return None, (
        f"no MiniCPM-o 4.5 checkpoint: set {ENV_MODEL} to a local checkpoint directory, or set "
        f"{ENV_HUB}=1 to let vLLM download {repo_id} from the Hugging Face hub (network access; HF_TOKEN "
        "if your account needs one), or pre-download it into the Hugging Face cache"
    )


# ---------------------------------------------------------------------------
# Server lifecycle
# ---------------------------------------------------------------------------


def free_port(host: str = HOST) -> int:
    """A port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def turn_deploy_config(directory: Path) -> Path:
    """A deploy YAML selecting the turn-based engine on top of vllm-omni's ``minicpmo_4_5.yaml``.

    vllm-omni's default MiniCPM-o deploy is a duplex session engine; ordinary
    ``/v1/chat/completions`` turns need ``session_mode: turn`` (0.30.0 ships this as
    ``minicpmo_4_5_turn.yaml``, 0.28.0 does not, so we write the same overlay).
    """
    base = _package_dir("vllm_omni") / "deploy" / "minicpmo_4_5.yaml"
    if not base.is_file():
        raise FileNotFoundError(f"vllm-omni has no MiniCPM-o 4.5 deploy config at {base}")
    path = directory / "minicpmo_4_5_e2e_turn.yaml"
    path.write_text(
        "# Written by tests/helpers/serve_smoke.py: vllm-omni's MiniCPM-o 4.5 deploy, turn-based engine.\n"
        f"base_config: {json.dumps(str(base))}\n"
        "session_mode: turn\n",
        encoding="utf-8",
    )
    return path


def thinker_only_deploy_config(directory: Path) -> Path:
    """A deploy YAML serving the thinker stage alone (``minicpmo_4_5_thinker_only``, registered by
    this project's vLLM plugin): text answers from a checkpoint without the talker's assets."""
    path = directory / "minicpmo_4_5_e2e_thinker_only.yaml"
    path.write_text(
        "# Written by tests/helpers/serve_smoke.py: MiniCPM-o 4.5's thinker stage alone.\n"
        "pipeline: minicpmo_4_5_thinker_only\n"
        "trust_remote_code: true\n"
        "enable_prefix_caching: false\n"
        "stages:\n"
        "  - stage_id: 0\n"
        "    max_num_seqs: 8\n"
        f"    gpu_memory_utilization: {os.environ.get('MINICPMO_CG_E2E_GPU_UTIL', '0.5')}\n"
        "    max_model_len: 8192\n"
        "    devices: \"0\"\n",
        encoding="utf-8",
    )
    return path


def vllm_executable() -> list[str]:
    """The ``vllm`` console script of the running interpreter's environment (the venv under test);
    ``python -m vllm.entrypoints.cli.main`` where the environment has no console scripts."""
    candidate = Path(sys.executable).parent / "vllm"
    if candidate.is_file():
        return [str(candidate)]
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def mode_args(mode: str, vision_attn: str | None = None) -> list[str]:
    """The flags of ``mode``, with ``vision_attn_implementation`` merged into its ``--hf-overrides``."""
    if mode not in MODE_ARGS:
        raise ValueError(f"unknown mode {mode!r} (have {sorted(MODE_ARGS)})")
    if vision_attn is not None and vision_attn not in VISION_ATTNS:
        raise ValueError(f"unknown vision attention {vision_attn!r} (have {list(VISION_ATTNS)})")
    args = list(MODE_ARGS[mode])
    overrides: dict[str, Any] = {}
    if "--hf-overrides" in args:
        at = args.index("--hf-overrides")
        overrides = json.loads(args[at + 1])
        del args[at : at + 2]
    if vision_attn is not None:
        overrides["vision_attn_implementation"] = vision_attn
    return args + (["--hf-overrides", json.dumps(overrides)] if overrides else [])


def server_command(
    model: str,
    mode: str,
    port: int,
    deploy_config: Path,
    vllm: str | list[str] = "vllm",
    vision_attn: str | None = None,
) -> list[str]:
    flags = mode_args(mode, vision_attn)
    return [
        *([vllm] if isinstance(vllm, str) else vllm),
        "serve",
        model,
        "--omni",
        "--trust-remote-code",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--deploy-config",
        str(deploy_config),
        *flags,
    ]


def _http_get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@dataclass
class ServeProcess:
    """``vllm serve`` (or any HTTP server command) in its own process group, logging to a file.

    Use as a context manager: ``__exit__`` stops the whole process group (engine
    core and stage workers included) and waits until it is gone, so a following
    server finds the GPU memory free.
    """

    command: list[str]
    log_path: Path
    port: int
    host: str = HOST
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)
    _saved_handlers: dict[int, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # own process group: stop() reaches every worker
                # only a prctl() between fork and exec; started from the main thread in practice
                preexec_fn=_term_on_parent_death,  # noqa: PLW1509
            )
        # A CI timeout/cancel SIGTERMs our process group, which no longer contains the
        # server: turn SIGTERM/SIGHUP into SystemExit so the context manager stops it.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._saved_handlers[sig] = signal.signal(sig, _raise_system_exit)
        atexit.register(self.stop)
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self,
        timeout: float,
        poll: float = 2.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Poll ``/health`` until 200; fail fast if the process exits.

        Args:
            clock, sleep: the time source of the deadline and the pause between polls (seconds);
                tests script them.

        Raises:
            ServerError: the process exited before becoming ready.
            TimeoutError: not ready within ``timeout`` seconds.
        """
        assert self.proc is not None, "start() first"
        deadline = clock() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"server exited with code {code} before becoming ready: {' '.join(self.command)}\n"
                    f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            try:
                if _http_get(self.base_url + "/health", timeout=5.0) == 200:
                    return
            except OSError:
                pass  # not listening yet
            if clock() >= deadline:
                raise TimeoutError(
                    f"server not ready after {timeout:.0f} s ({self.base_url}/health)\n"
                    f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            sleep(poll)

    def stop(self, grace: float = 30.0, reap_timeout: float = 60.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` s, then wait until no member is alive."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)  # workers still shutting down after the leader exited
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # stragglers
        self.proc.wait()
        deadline = time.monotonic() + reap_timeout
        while group_members(pgid):
            if time.monotonic() >= deadline:
                raise ServerError(f"process group {pgid} still alive {reap_timeout:.0f} s after SIGKILL")
            time.sleep(0.2)
        self.proc = None
        atexit.unregister(self.stop)
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()

    def __enter__(self) -> ServeProcess:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``.

    Zombies are ignored: they hold no memory, and in a container whose PID 1 does
    not reap orphans they would otherwise keep the group "alive" forever.
    """
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: fall back to signal 0 (zombies count there)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses
        fields_after_comm = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields_after_comm[0], int(fields_after_comm[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _term_on_parent_death() -> None:
    """In the child before exec: SIGTERM the server if this (test) process dies (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def chat(base_url: str, messages: list[dict[str, Any]], timeout: float = REQUEST_TIMEOUT_S) -> str:
    """One greedy, text-only chat completion; returns the answer text."""
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": messages,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "max_tokens": MAX_TOKENS,
        "modalities": ["text"],  # vllm-omni: skip the Talker/Code2Wav stages' audio output
    }
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            payload = json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        raise ServerError(f"HTTP {exc.code} from /v1/chat/completions: {exc.read()[:2000]!r}") from exc
    texts = [c.get("message", {}).get("content") for c in payload.get("choices", [])]
    texts = [t for t in texts if isinstance(t, str)]
    if not texts:
        raise ServerError(f"no text choice in the response: {json.dumps(payload)[:2000]}")
    return texts[0]


# ---------------------------------------------------------------------------
# Runs and checks
# ---------------------------------------------------------------------------


def parse_captures(log_text: str) -> list[dict[str, Any]]:
    """The adapter's capture log lines: ``[{"encoder": name, "index": n, "cap": max_graphs}, ...]``."""
    return [
        {"encoder": m["name"], "index": int(m["n"]), "cap": int(m["cap"])}
        for m in CAPTURE_RE.finditer(log_text)
    ]


def siglip_attention(log_text: str) -> str | None:
    """The SigLIP attention the model's log line names (the last one), or None without the line."""
    found = SIGLIP_ATTN_RE.findall(log_text)
    return found[-1] if found else None


def label(record: dict[str, Any]) -> str:
    """``mode`` or ``mode/attention`` of a recording (``mode`` for one without an attention field)."""
    attn = record.get("vision_attn")
    return record["mode"] if attn is None else f"{record['mode']}/{attn}"


def environment() -> dict[str, str]:
    info: dict[str, str] = {"python": sys.version.split()[0]}
    dists: tuple[str, ...] = ("vllm", "vllm-omni", "torch")
    dists += ("minicpmo-encoder-cuda-graphs",)
    for dist in dists:
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = "not installed"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        info["gpu"] = out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = "unknown (no nvidia-smi)"
    return info


def run_mode(
    model: str,
    mode: str,
    workdir: Path,
    *,
    prompts: tuple[Prompt, ...] = PROMPTS,
    startup_timeout: float | None = None,
    vision_attn: str | None = None,
    thinker_only: bool = False,
) -> dict[str, Any]:
    """Serve ``model`` in ``mode`` (SigLIP attention ``vision_attn``, None: the server's default), send
    ``prompts`` one at a time, stop the server; return the record. ``thinker_only`` serves the thinker
    stage alone (:func:`thinker_only_deploy_config`) instead of the turn-based three-stage deploy."""
    if startup_timeout is None:
        startup_timeout = float(os.environ.get(ENV_STARTUP_TIMEOUT, DEFAULT_STARTUP_TIMEOUT_S))
    workdir.mkdir(parents=True, exist_ok=True)
    deploy = thinker_only_deploy_config(workdir) if thinker_only else turn_deploy_config(workdir)
    port = free_port()
    attn = vision_attn or DEFAULT_VISION_ATTN
    log_path = workdir / f"serve-{mode}-{attn}.log"
    command = server_command(model, mode, port, deploy, vllm=vllm_executable(), vision_attn=vision_attn)
    answers: list[dict[str, str]] = []
    started = time.monotonic()
    with ServeProcess(command, log_path, port) as server:
        server.wait_ready(startup_timeout)
        ready_s = time.monotonic() - started
        for prompt in prompts:
            try:
                text = chat(server.base_url, prompt.messages())
            except (ServerError, OSError) as exc:
                raise ServerError(f"{mode}: prompt {prompt.name} failed: {exc}\n{server.log_tail()}") from exc
            answers.append({"name": prompt.name, "text": text})
    log_text = log_path.read_text(encoding="utf-8", errors="replace")
    return {
        "mode": mode,
        "vision_attn": attn,
        "model": model,
        "command": command,
        "log": str(log_path),
        "startup_s": round(ready_s, 1),
        "answers": answers,
        "captures": parse_captures(log_text),
        "siglip_attention": siglip_attention(log_text),
        "env": environment(),
    }


def check_run(record: dict[str, Any]) -> list[str]:
    """Problems within one recording (empty list: fine)."""
    problems: list[str] = []
    who = label(record)
    answers = {a["name"]: a["text"] for a in record["answers"]}
    expected = record.get("vision_attn")
    if expected is not None and record.get("siglip_attention") != expected:
        problems.append(
            f"{who}: the server log names SigLIP attention {record.get('siglip_attention')!r}, expected "
            f"{expected!r} (does the served model file read vision_attn_implementation? see {record['log']})"
        )
    for name, text in answers.items():
        if not text.strip():
            problems.append(f"{who}: empty answer for {name}")
    for first, again in repeat_pairs(list(answers)):
        if first in answers and answers[first] != answers[again]:
            problems.append(
                f"{who}: {again} differs from {first} within one server "
                f"(first, eager warmup: {answers[first]!r}; again: {answers[again]!r})"
            )
    encoders = sorted({c["encoder"] for c in record["captures"]})
    if record["mode"] == "graphed":
        missing = [name for name in CAPTURED_ENCODERS if name not in encoders]
        if missing:
            problems.append(
                f"graphed: no capture of the {' and '.join(missing)} encoder; the log shows captures of "
                f"{encoders or 'none'} (does the served model file carry the encoder CUDA graph wiring? "
                f"see {record['log']})"
            )
    elif record["captures"]:
        problems.append(f"{who}: encoder CUDA graphs were captured ({encoders}) although disabled")
    return problems


def compare(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """Answer differences between two recordings of the same prompt set (empty list: equal)."""
    if reference.get("vision_attn") != candidate.get("vision_attn"):
        why = "the attention changes the numerics, so only recordings of one attention are compared"
        return [f"recorded with different SigLIP attention ({label(reference)} vs {label(candidate)}): {why}"]
    ref = {a["name"]: a["text"] for a in reference["answers"]}
    cand = {a["name"]: a["text"] for a in candidate["answers"]}
    problems: list[str] = []
    if list(ref) != list(cand):
        problems.append(f"prompt sets differ: {list(ref)} vs {list(cand)}")
    for name, text in ref.items():
        if name in cand and text != cand[name]:
            problems.append(
                f"{name}: {label(reference)} answered {text!r}, {label(candidate)} answered {cand[name]!r}"
            )
    if problems and reference.get("env", {}).get("gpu") != candidate.get("env", {}).get("gpu"):
        problems.append(
            f"note: recorded on different GPUs "
            f"({reference['env'].get('gpu')} vs {candidate['env'].get('gpu')}); "
            "rerun both modes on one GPU (tests/e2e/online_serving/test_minicpmo_4_5_encoder_cuda_graph.py) "
            "to rule that out"
        )
    return problems


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    if args.model:
        model, why = args.model, "--model"
    else:
        model, why = resolve_model()
    if model is None:
        print(f"serve_smoke: {why}", file=sys.stderr)
        return 2
    attn = args.vision_attn or f"{DEFAULT_VISION_ATTN} (the default)"
    print(
        f"serve_smoke: serving {model} ({why}) in mode {args.mode}, SigLIP attention {attn}", file=sys.stderr
    )
    out = Path(args.out)
    workdir = (
        Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"serve-smoke-{args.mode}-"))
    )
    record = run_mode(model, args.mode, workdir, vision_attn=args.vision_attn, thinker_only=args.thinker_only)
    record["problems"] = check_run(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for a in record["answers"]:
        print(f"[{args.mode}] {a['name']}: {a['text']!r}")
    print(f"[{args.mode}] captures: {record['captures']}")
    for p in record["problems"]:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if record["problems"] else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    records = []
    for path in (args.reference, args.candidate):
        if not Path(path).is_file():
            print(f"serve_smoke: missing recording {path} (did that mode's job fail?)", file=sys.stderr)
            return 2
        records.append(json.loads(Path(path).read_text(encoding="utf-8")))
    reference, candidate = records
    problems = compare(reference, candidate)
    for p in problems:
        print(f"DIFF: {p}", file=sys.stderr)
    if not problems:
        print(
            f"serve_smoke: {len(reference['answers'])} answers equal "
            f"({label(reference)} vs {label(candidate)})"
        )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="serve in one mode and record the answers")
    run.add_argument("--mode", choices=sorted(MODE_ARGS), required=True)
    run.add_argument(
        "--vision-attn",
        choices=VISION_ATTNS,
        help="SigLIP attention (--hf-overrides vision_attn_implementation; default: the server's, sdpa)",
    )
    run.add_argument("--out", required=True, help="JSON recording to write")
    run.add_argument("--model", help=f"checkpoint (default: ${ENV_MODEL}, else {MODEL_ID} when allowed)")
    run.add_argument("--workdir", help="server logs and deploy overlay (default: a new temp dir)")
    run.add_argument("--thinker-only", action="store_true", help="serve the thinker stage alone (text out)")
    run.set_defaults(func=_cmd_run)
    cmp_ = sub.add_parser("compare", help="compare two recordings' answers")
    cmp_.add_argument("reference")
    cmp_.add_argument("candidate")
    cmp_.set_defaults(func=_cmd_compare)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
