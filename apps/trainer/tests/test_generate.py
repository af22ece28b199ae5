"""`titan-generate` through the README's commands: a short run of the debug model, generation
from its DCP checkpoint on one process and with tensor parallel on two, and from its Hugging
Face export, all greedy and all equal to `transformers`' greedy generation from the exported
folder; then sampling from the same checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import string
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from titan_trainer.generate import main

TRAINER = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMPT = "The list"


def readme_block() -> list[str]:
    """The README's generation commands, in order (from the training run to the last)."""
    lines = (TRAINER / "README.md").read_text().splitlines()
    start = lines.index("<!-- generation commands: run by tests/test_generate.py -->")
    block = lines[start + 2 : lines.index("```", start + 2)]
    return [line for line in block if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """The README's block, each command as shown: the training run first; then the conversion
    followed by generation from its folder, beside generation from the checkpoint on one
    process and under torchrun (they read only what training wrote, and a one-thread CPU job
    leaves the other core of a CI machine idle). Results in the README's order."""
    cwd = tmp_path_factory.mktemp("generate")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}

    def run(lines: list[str]) -> list[tuple[str, subprocess.CompletedProcess]]:
        results = []
        for line in lines:
            done = subprocess.run(
                shlex.split(line), cwd=cwd, capture_output=True, text=True, timeout=600, env=env
            )
            assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-3000:])
            results.append((line, done))
        return results

    train, *rest = readme_block()
    assert train.startswith("titan-train ") and "--checkpoint.enable" in train
    hf = [line for line in rest if "gen_hf" in line]  # the conversion, then what reads it
    assert hf[0].startswith("titan-ckpt convert") and len(hf) == 2
    chains = [hf, *([line] for line in rest if line not in hf)]
    results = run([train])
    with ThreadPoolExecutor(len(chains)) as pool:
        for done in pool.map(run, chains):
            results += done
    return cwd, sorted(results, key=lambda r: [train, *rest].index(r[0]))


def test_greedy_text_is_the_same_from_dcp_tp_and_hf_and_equals_transformers(readme_runs):
    transformers = pytest.importorskip("transformers", reason="the dev group installs it")
    from titan_data import load_tokenizer

    cwd, results = readme_runs
    texts = [
        d.stdout
        for line, d in results
        if "titan_trainer.generate" in line or line.startswith("titan-generate")
    ]
    assert len(texts) == 3  # DCP on one process, DCP under TP 2 (rank 0 prints), HF folder
    assert all(t.startswith(PROMPT) for t in texts), texts
    # fp32 on CPU; TP sums the row-parallel halves in another order (~1e-6), far below the
    # gaps between the most likely and the next token in these 50 steps: the same tokens.
    assert texts[0] == texts[1] == texts[2], texts
    # The exported folder in transformers: its greedy tokens, decoded, are the same text.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        cwd / "outputs/gen_hf", torch_dtype=torch.float32
    ).eval()
    tokenizer = load_tokenizer("byte")
    prompt = torch.tensor([tokenizer.encode(PROMPT, bos=True, eos=False)])
    with torch.no_grad():
        ids = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=50,
            min_new_tokens=50, eos_token_id=None, pad_token_id=0,
        )[0, prompt.shape[1]:].tolist()  # fmt: skip
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    assert texts[0] == PROMPT + tokenizer.decode(ids) + "\n"
    # The conversion showed its progress (tqdm, on stderr).
    (convert,) = [d for line, d in results if line.startswith("titan-ckpt convert")]
    assert "read step-10" in convert.stderr and "write HF weights" in convert.stderr
    # Its config.json names the tokenizer's BOS and EOS, and the model's own context length
    # (the debug flavor's 2048), not the run's 64-token samples.
    config = json.loads((cwd / "outputs/gen_hf/config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    assert config["max_position_embeddings"] == 2048


def test_sampled_text_has_the_letters_of_the_corpus(readme_runs, capsys):
    cwd, _ = readme_runs
    args = [str(cwd / "outputs/gen"), "--prompt", PROMPT, "--max-new-tokens", "50"]
    sample = [*args, "--temperature", "1", "--top-k", "40", "--top-p", "0.95", "--samples", "4"]
    assert main([*sample, "--seed", "0"]) == 0
    first = capsys.readouterr().out
    assert main([*sample, "--seed", "0"]) == 0
    assert capsys.readouterr().out == first  # the seed decides
    assert main([*sample, "--seed", "1"]) == 0
    assert capsys.readouterr().out != first
    texts = [t.removeprefix(PROMPT) for t in first.split("-" * 40 + "\n") if t.strip()]
    assert len(texts) == 4 and len(set(texts)) == 4
    # Ten steps bring the loss from ln(vocab) (about 6.3 nats: random bytes, of which about
    # one in six is a letter or a space) to the corpus's letter statistics (about 2.9 nats):
    # sampled text is then mostly letters and spaces, as the Python docs are.
    chars = "".join(texts)
    share = sum(c in string.ascii_letters + " " for c in chars) / len(chars)
    assert share > 0.7, (share, texts)


def test_bad_requests_are_refused_with_what_to_do(readme_runs, tmp_path, capsys):
    cwd, _ = readme_runs
    assert main([str(cwd / "outputs/gen"), "--prompt", "x", "--max-new-tokens", "100"]) == 2
    assert capsys.readouterr().err == (
        "titan-generate: error: the prompt (2 tokens) and --max-new-tokens 100 need 102 "
        "positions, but the model has 64\n"
        "       use --max-new-tokens 62 or less\n"
    )
    assert main([str(tmp_path)]) == 2
    assert "is neither a DCP checkpoint" in capsys.readouterr().err
    assert main([str(cwd / "outputs/gen"), "--top-p", "0"]) == 2
    assert "top_p = 0.0: use a value in (0, 1]" in capsys.readouterr().err
