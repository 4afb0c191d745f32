# SPDX-License-Identifier: Apache-2.0
"""CPU checks of the e2e smoke's machinery: inputs, server command, lifecycle, checks.

The GPU run (``test_minicpmo_4_5_encoder_cuda_graph.py``) only happens on a GPU agent with a
checkpoint; these tests make sure that, when it does, it sends what it claims,
starts and stops the server robustly and judges the answers correctly.
"""

from __future__ import annotations

import base64
import io
import json
import re
import sys
import textwrap
import wave
from pathlib import Path

import pytest
from helpers import serve_smoke as smoke

pytestmark = [pytest.mark.core_model]

REPO = Path(__file__).resolve().parents[3]
ADAPTER = REPO / "vllm_omni/model_executor/models/minicpmo_4_5/encoder_cuda_graph/adapter.py"


def _decode(url: str, mime: str) -> bytes:
    prefix = f"data:{mime};base64,"
    assert url.startswith(prefix), url[:40]
    return base64.b64decode(url[len(prefix) :], validate=True)


def _parts(prompt, kind):
    return [c for c in prompt.messages()[0]["content"] if c["type"] == kind]


# -- inputs ----------------------------------------------------------------------


@pytest.mark.cpu
def test_prompt_groups_share_one_shape_with_distinct_content() -> None:
    from PIL import Image

    groups: dict[str, list] = {}
    for p in smoke.PROMPTS:
        groups.setdefault(p.name.split("/")[0], []).append(p)
    assert len(groups) == 4
    kinds = set()
    for name, prompts in groups.items():
        assert len(prompts) == 4, name  # warmup, capture, replay, first again
        assert prompts[-1].name == prompts[0].name + "#again"
        assert prompts[-1].messages() == prompts[0].messages()
        images = [
            [_decode(c["image_url"]["url"], "image/png") for c in _parts(p, "image_url")] for p in prompts[:3]
        ]
        audios = [
            [_decode(c["audio_url"]["url"], "audio/wav") for c in _parts(p, "audio_url")] for p in prompts[:3]
        ]
        kinds.add((bool(images[0]), bool(audios[0])))
        for slot in range(len(images[0])):
            blobs = [imgs[slot] for imgs in images]
            assert len(set(blobs)) == 3, f"{name}: image variants must differ in content"
            sizes = {Image.open(io.BytesIO(b)).size for b in blobs}
            assert len(sizes) == 1, f"{name}: image variants must keep one size, got {sizes}"
        for slot in range(len(audios[0])):
            blobs = [auds[slot] for auds in audios]
            assert len(set(blobs)) == 3, f"{name}: audio windows must differ in content"
            params = set()
            for b in blobs:
                with wave.open(io.BytesIO(b)) as w:
                    params.add((w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()))
            assert len(params) == 1, f"{name}: audio windows must have one length/format, got {params}"
    assert kinds == {(True, False), (False, True), (True, True)}  # image, audio, image+audio


@pytest.mark.cpu
def test_audio_window_is_the_exact_slice_of_the_bundled_voice() -> None:
    with wave.open(str(smoke.vllm_omni_voice("default_female"))) as src:
        rate = src.getframerate()
        src.setpos(int(2.5 * rate))
        expected = src.readframes(int(4.0 * rate))
    with wave.open(io.BytesIO(smoke.audio_wav("default_female", 2.5, 4.0))) as got:
        assert got.getframerate() == rate
        assert got.readframes(got.getnframes()) == expected
    with pytest.raises(ValueError, match="does not fit"):
        smoke.audio_wav("default_female", 8.0, 4.0)


@pytest.mark.cpu
def test_images_come_from_scikit_image_bundled_photos() -> None:
    from PIL import Image

    raw = Image.open(smoke.skimage_photo("astronaut")).convert("RGB")
    sent = Image.open(io.BytesIO(smoke.image_png("astronaut", "mirror")))
    assert sent.size == raw.size == (512, 512)
    assert sent.transpose(Image.Transpose.FLIP_LEFT_RIGHT).tobytes() == raw.tobytes()
    with pytest.raises(ValueError):
        smoke.image_png("astronaut", "rotate")


# -- server command and deploy config ----------------------------------------------


@pytest.mark.cpu
@pytest.mark.parametrize("mode", ["graphed", "eager", "enforce-eager"])
def test_server_command_per_mode(mode: str, tmp_path: Path) -> None:
    cmd = smoke.server_command("/ckpt", mode, 8123, tmp_path / "d.yaml", vllm="/venv/bin/vllm")
    assert cmd[:4] == ["/venv/bin/vllm", "serve", "/ckpt", "--omni"]
    assert "--trust-remote-code" in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--deploy-config") + 1] == str(tmp_path / "d.yaml")
    overrides = json.loads(cmd[cmd.index("--hf-overrides") + 1]) if "--hf-overrides" in cmd else None
    assert overrides == ({"encoder_cuda_graph": False} if mode == "eager" else None)
    assert ("--enforce-eager" in cmd) == (mode == "enforce-eager")
    with pytest.raises(ValueError):
        smoke.server_command("/ckpt", "cuda-graph", 1, tmp_path)


@pytest.mark.cpu
@pytest.mark.parametrize("mode", ["graphed", "eager", "enforce-eager"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_server_command_merges_the_vision_attention_into_the_overrides(
    mode: str, attn: str, tmp_path: Path
) -> None:
    cmd = smoke.server_command("/ckpt", mode, 8123, tmp_path / "d.yaml", vision_attn=attn)
    assert cmd.count("--hf-overrides") == 1
    overrides = json.loads(cmd[cmd.index("--hf-overrides") + 1])
    expected = {"vision_attn_implementation": attn}
    assert overrides == ({"encoder_cuda_graph": False, **expected} if mode == "eager" else expected)
    assert ("--enforce-eager" in cmd) == (mode == "enforce-eager")
    assert smoke.VISION_ATTNS[0] == smoke.DEFAULT_VISION_ATTN == "sdpa"
    with pytest.raises(ValueError, match="vision attention"):
        smoke.server_command("/ckpt", mode, 1, tmp_path, vision_attn="flash_attention_2")


@pytest.mark.cpu
def test_vision_attentions_are_choices_of_the_registered_key() -> None:
    from vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph import HF_OVERRIDE_KEYS

    spec = HF_OVERRIDE_KEYS["vision_attn_implementation"]
    assert spec.default == smoke.DEFAULT_VISION_ATTN and set(smoke.VISION_ATTNS) <= set(spec.choices)


@pytest.mark.cpu
def test_turn_deploy_overlay_loads_with_vllm_omni(tmp_path: Path) -> None:
    from vllm_omni.config.stage_config import load_deploy_config

    deploy = load_deploy_config(smoke.turn_deploy_config(tmp_path))
    assert deploy.session_mode == "turn"  # ordinary /v1/chat/completions turns, not duplex sessions
    assert deploy.pipeline == "minicpmo_4_5"
    assert [s.stage_id for s in deploy.stages] == [0, 1, 2]


@pytest.mark.cpu
def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smoke, "_hub_snapshot_cached", lambda repo: False)
    model, why = smoke.resolve_model({})
    assert model is None
    assert "MINICPMO_CG_E2E_MODEL" in why and "MINICPMO_CG_E2E_HUB=1" in why
    assert smoke.resolve_model({"MINICPMO_CG_E2E_HUB": "1"})[0] == "openbmb/MiniCPM-o-4_5"
    assert smoke.resolve_model({"MINICPMO_CG_E2E_MODEL": "org/other"})[0] is None  # hub id without HUB=1
    with pytest.raises(ValueError, match="config.json"):
        smoke.resolve_model({"MINICPMO_CG_E2E_MODEL": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    assert smoke.resolve_model({"MINICPMO_CG_E2E_MODEL": str(tmp_path)})[0] == str(tmp_path)
    monkeypatch.setattr(smoke, "_hub_snapshot_cached", lambda repo: repo == "openbmb/MiniCPM-o-4_5")
    assert smoke.resolve_model({})[0] == "openbmb/MiniCPM-o-4_5"


# -- server lifecycle against a stand-in HTTP server ---------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import json, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, behaviour = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"child {child.pid}", flush=True)
    if behaviour == "exit":
        sys.exit(3)
    if behaviour == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour == "never-ready":
        time.sleep(600)
    time.sleep(0.5)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = json.dumps({"choices": [{"message": {"content": json.dumps(body)}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    print("Captured vision encoder CUDA graph 1/4 for inputs [] in 1.0 ms", flush=True)
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _fake(tmp_path: Path, behaviour: str):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = smoke.free_port()
    return smoke.ServeProcess(
        [sys.executable, str(script), str(port), behaviour], tmp_path / "serve.log", port
    )


def _child_pid(server) -> int:
    """The stand-in's child, from its log: printed (flushed) before it serves, so once it is ready."""
    m = re.search(r"child (\d+)", server.log_path.read_text() if server.log_path.exists() else "")
    assert m, "the ready stand-in server did not report its child"
    return int(m.group(1))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.cpu
def test_ready_chat_and_stop_reaps_the_whole_process_group(tmp_path: Path) -> None:
    server = _fake(tmp_path, "serve")
    with server:
        pgid = server.proc.pid
        server.wait_ready(timeout=30, poll=0.1)
        child = _child_pid(server)
        assert _alive(child)
        messages = smoke.PROMPTS[0].messages()
        sent = json.loads(smoke.chat(server.base_url, messages, timeout=30))
    assert sent["temperature"] == 0.0 and sent["modalities"] == ["text"]
    assert sent["model"] == smoke.SERVED_MODEL_NAME and sent["messages"] == messages
    assert server.proc is None
    assert smoke.group_members(pgid) == []
    assert not _alive(child), "the server's child process survived stop()"
    assert smoke.parse_captures(server.log_path.read_text()) == [{"encoder": "vision", "index": 1, "cap": 4}]


@pytest.mark.cpu
def test_server_that_exits_fails_fast_with_its_log(tmp_path: Path) -> None:
    """ServerError, not TimeoutError: the exit was seen before the 60 s deadline ran out."""
    server = _fake(tmp_path, "exit")
    with server, pytest.raises(smoke.ServerError, match=r"exited with code 3(.|\n)*child \d+"):
        server.wait_ready(timeout=60, poll=0.1)


@pytest.mark.cpu
def test_server_that_never_gets_ready_times_out_at_the_deadline(tmp_path: Path) -> None:
    """On a scripted clock that only the pauses advance: 2 s at 0.25 s a poll is 8 pauses, then the error."""
    server = _fake(tmp_path, "never-ready")
    now, pauses = [100.0], []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    with server, pytest.raises(TimeoutError, match="not ready after 2 s"):
        server.wait_ready(timeout=2, poll=0.25, clock=lambda: now[0], sleep=pause)
    assert pauses == [0.25] * 8
    assert server.proc is None


@pytest.mark.cpu
def test_stop_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    server = _fake(tmp_path, "ignore-term").start()
    try:
        server.wait_ready(timeout=30, poll=0.1)
        pgid, child = server.proc.pid, _child_pid(server)
    finally:
        server.stop(grace=1.0, reap_timeout=20)  # raises ServerError if the group outlives the SIGKILL
    assert smoke.group_members(pgid) == [] and not _alive(child)


@pytest.mark.cpu
def test_free_port_is_bindable_on_loopback() -> None:
    import socket

    port = smoke.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# -- judging recordings ---------------------------------------------------------------


def _model_wiring() -> str:
    """The vllm-omni patches and the owned modules beside the model file their hooks call."""
    files = sorted((REPO / "patches/vllm-omni").glob("*.patch"))
    files += sorted((REPO / "vllm_omni/model_executor/models/minicpmo_4_5").glob("*.py"))
    return "".join(p.read_text() for p in files)


@pytest.mark.cpu
def test_expected_encoder_names_are_the_ones_the_model_wiring_uses() -> None:
    wiring = _model_wiring()
    names = set(re.findall(r'make_encoder_cuda_graph\((?:.|\n)*?name="([^"]+)"', wiring))
    # the smoke's chat prompts reach the stateless encoders; "streaming audio" serves duplex sessions only
    assert names == set(smoke.CAPTURED_ENCODERS) | {"streaming audio"}, names


@pytest.mark.cpu
def test_siglip_attention_regex_matches_the_model_log_line() -> None:
    wiring = _model_wiring()
    fmt = re.search(r'"(MiniCPM-o 4\.5 SigLIP attention: %s[^"]*)"', wiring)
    assert fmt, "the SigLIP attention log line is not in patches/vllm-omni; update serve_smoke.SIGLIP_ATTN_RE"
    assert smoke.siglip_attention("INFO x " + fmt.group(1).replace("%s", "eager", 1) + "\nINFO y") == "eager"
    assert smoke.siglip_attention("no such line") is None


@pytest.mark.cpu
def test_capture_regex_matches_the_adapter_log_format() -> None:
    source = ADAPTER.read_text()
    fmt = re.search(r'"(Captured %s encoder CUDA graph %d/%d[^"]*)"', source)
    assert fmt, f"capture log line not found in {ADAPTER}; update serve_smoke.CAPTURE_RE with it"
    line = fmt.group(1) % ("audio", 2, 4, "[((1, 80, 300), 'bfloat16')]", 12.5)
    assert smoke.parse_captures("INFO x " + line) == [{"encoder": "audio", "index": 2, "cap": 4}]


def _record(mode: str, answers: dict[str, str], captures=("vision", "audio"), gpu="H100", **attn) -> dict:
    return {
        "mode": mode,
        "log": "serve.log",
        "answers": [{"name": k, "text": v} for k, v in answers.items()],
        "captures": [{"encoder": c, "index": 1, "cap": 4} for c in captures],
        "env": {"gpu": gpu},
        **attn,
    }


ANSWERS = {"img/0": "A cat.", "img/1": "A dog.", "img/0#again": "A cat."}


@pytest.mark.cpu
def test_check_run() -> None:
    assert smoke.check_run(_record("graphed", ANSWERS)) == []
    assert smoke.check_run(_record("eager", ANSWERS, captures=())) == []
    assert any("captured" in p for p in smoke.check_run(_record("eager", ANSWERS, captures=("vision",))))
    no_audio = smoke.check_run(_record("graphed", ANSWERS, captures=("vision", "vision")))
    assert len(no_audio) == 1 and "no capture of the audio encoder" in no_audio[0]
    assert "vision and audio" in smoke.check_run(_record("graphed", ANSWERS, captures=()))[0]
    drift = smoke.check_run(_record("graphed", {**ANSWERS, "img/0#again": "A lion."}))
    assert len(drift) == 1 and "img/0#again differs from img/0" in drift[0]
    assert any(
        "empty answer" in p for p in smoke.check_run(_record("eager", {**ANSWERS, "img/1": " "}, captures=()))
    )


@pytest.mark.cpu
def test_check_run_requires_the_asked_siglip_attention_in_the_log() -> None:
    asked = {"vision_attn": "eager"}
    assert smoke.check_run(_record("graphed", ANSWERS, siglip_attention="eager", **asked)) == []
    wrong = smoke.check_run(_record("graphed", ANSWERS, siglip_attention="sdpa", **asked))
    assert len(wrong) == 1 and "graphed/eager: the server log names SigLIP attention 'sdpa'" in wrong[0]
    missing = smoke.check_run(_record("eager", ANSWERS, captures=(), siglip_attention=None, **asked))
    assert len(missing) == 1 and "None, expected 'eager'" in missing[0]


@pytest.mark.cpu
def test_compare_only_recordings_of_one_attention() -> None:
    sdpa = _record("eager", ANSWERS, captures=(), vision_attn="sdpa")
    assert smoke.compare(sdpa, _record("graphed", ANSWERS, vision_attn="sdpa")) == []
    (problem,) = smoke.compare(sdpa, _record("graphed", ANSWERS, vision_attn="eager"))
    assert "different SigLIP attention (eager/sdpa vs graphed/eager)" in problem


@pytest.mark.cpu
def test_compare() -> None:
    eager = _record("eager", ANSWERS, captures=())
    assert smoke.compare(eager, _record("graphed", ANSWERS)) == []
    diff = smoke.compare(eager, _record("graphed", {**ANSWERS, "img/1": "A wolf."}))
    assert len(diff) == 1 and "img/1" in diff[0] and "A wolf." in diff[0]
    other_gpu = smoke.compare(eager, _record("graphed", {**ANSWERS, "img/1": "A wolf."}, gpu="L4"))
    assert any("different GPUs" in p for p in other_gpu)
    assert any(
        "prompt sets differ" in p for p in smoke.compare(eager, _record("graphed", {"img/0": "A cat."}))
    )


@pytest.mark.cpu
def test_compare_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_record("eager", ANSWERS, captures=())))
    b.write_text(json.dumps(_record("graphed", ANSWERS)))
    assert smoke.main(["compare", str(a), str(b)]) == 0
    b.write_text(json.dumps(_record("graphed", {**ANSWERS, "img/1": "A wolf."})))
    assert smoke.main(["compare", str(a), str(b)]) == 1
    assert smoke.main(["compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert "missing recording" in capsys.readouterr().err
