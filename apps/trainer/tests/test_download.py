"""`titan-download` without a network: the README's commands against a Hugging Face cache
built here (the layout huggingface_hub reads: refs/main -> snapshots/<commit>/...) with
HF_HUB_OFFLINE=1, and the messages for an unreachable Hub and for a gated repo without a
token, from a real connection refused and a real HTTP answer."""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan_data import find_tokenizer_model, load_tokenizer

TRAINER = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REPO = "meta-llama/Llama-3.1-8B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path) -> Path:
    """A cache holding the repo's tokenizer files and weights at COMMIT, `main` pointing there."""
    repo = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B"
    snapshot = repo / "snapshots" / COMMIT
    (snapshot / "original").mkdir(parents=True)
    shutil.copyfile(find_tokenizer_model("llama3"), snapshot / "original" / "tokenizer.model")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snapshot / "tokenizer.json").write_text("{}")
    save_file({"lm_head.weight": torch.ones(2, 2)}, str(snapshot / "model.safetensors"))
    (snapshot / "README.md").write_text("not an asset")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def run(line: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(PATH=f"{BIN}:{os.environ['PATH']}", **env)
    return subprocess.run(
        shlex.split(line), cwd=cwd, capture_output=True, text=True, timeout=300, env=environment
    )


def readme_lines() -> list[str]:
    lines = (TRAINER / "README.md").read_text().splitlines()
    return [line for line in lines if line.startswith("titan-download ")]


def test_the_readme_commands_place_the_assets_where_the_configs_look(hub_cache, tmp_path):
    tokenizer_only, with_weights = readme_lines()
    cwd = tmp_path / "work"
    cwd.mkdir()
    done = run(tokenizer_only, cwd, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    assert done.returncode == 0, done.stderr
    folder = cwd / "assets/hf/Llama-3.1-8B"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "config.json",
        "original/tokenizer.model",
        "tokenizer.json",
    ]
    assert "use it with: --model.hf_assets_path assets/hf/Llama-3.1-8B" in done.stdout
    assert "place in assets/hf/Llama-3.1-8B: 100%" in done.stderr  # progress, on stderr
    # The trainer's tokenizer loader (model.hf_assets_path) finds it there.
    assert load_tokenizer(str(folder)).vocab_size == 128256
    done = run(with_weights, cwd, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    assert done.returncode == 0, done.stderr
    assert (folder / "model.safetensors").read_bytes() == (
        hub_cache / "models--meta-llama--Llama-3.1-8B/snapshots" / COMMIT / "model.safetensors"
    ).read_bytes()
    assert not (folder / "README.md").exists()


def test_offline_without_the_repo_in_the_cache_says_so(tmp_path):
    done = run(f"titan-download {REPO}", tmp_path, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.splitlines()[-2:] == [
        f"titan-download: error: HF_HUB_OFFLINE is set, so only the cache is read, and the cache "
        f"({tmp_path}) holds no copy of {REPO}",
        "       unset HF_HUB_OFFLINE and run this where the Hub can be reached, or point "
        "HF_HUB_CACHE at a cache that holds the repo",
    ]


def test_an_unreachable_hub_is_named_as_the_network(tmp_path):
    # Port 9 (discard) has no server here: the connection is refused, as without a network.
    done = run(
        f"titan-download {REPO}", tmp_path, HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_CACHE=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    # The hub this environment names is the one named (HF_ENDPOINT); HF_HUB_OFFLINE is not set,
    # so there is nothing to unset.
    error, fix = done.stderr.splitlines()[-2:]
    assert error.startswith(
        "titan-download: error: the Hub at http://127.0.0.1:9 (HF_ENDPOINT) cannot be reached (no"
        f" network, or a proxy or firewall in the way), and the cache ({tmp_path}) holds no copy"
        f" of {REPO} ("  # the client's error class
    ), error
    assert fix == (
        "       run this where the Hub at http://127.0.0.1:9 (HF_ENDPOINT) can be reached, or"
        " point HF_HUB_CACHE at a cache that holds the repo"
    ), fix


class _Gated(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers for a gated repo without an accepted license."""

    def do_GET(self):  # noqa: N802 (the http.server API)
        body = b'{"error": "Access to model meta-llama/Llama-3.1-8B is restricted."}'
        self.send_response(403)
        self.send_header("X-Error-Code", "GatedRepo")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_a_gated_repo_without_a_token_says_how_to_get_one(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = run(
            f"titan-download {REPO}", tmp_path,
            HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", HF_HUB_CACHE=str(tmp_path),
        )  # fmt: skip
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        f"titan-download: error: {REPO} is gated: accept its license on "
        f"https://huggingface.co/{REPO}, then give a token that may read it",
        "       pass --token hf_..., set HF_TOKEN, or run `hf auth login` "
        "(tokens: https://huggingface.co/settings/tokens)",
    ]
