import json
import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.startswith("'")  # it printed the decoded text of a batch
    assert "'pydocs': " in out and "'pydocs_validation': " in out  # then the tokens per source


def test_readme_tokenizer_json_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2, "README.md's python examples: the loader's, then the tokenizer's"
    monkeypatch.chdir(tmp_path)  # it writes my_tokenizer/ where it runs
    exec(compile(blocks[1], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "my_tokenizer/tokenizer.json: 2,002 ids; BOS <|begin_of_text|> = 2000" in out, out
    assert (tmp_path / "my_tokenizer" / "tokenizer.json").is_file()


def test_readme_shell_commands_run_as_shown(tmp_path):
    """Every command of the README's shell blocks, exactly as written, from a scratch folder
    with the package's console script on PATH; then training reads what they wrote."""
    commands = [
        line.strip()
        for block in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
        for line in block.splitlines()
        if line.strip()
    ]
    assert commands == [
        "titan-data tokenize --dataset pydocs --tokenizer byte --out tokens/pydocs --shard-tokens 200000",
        "titan-data info tokens/pydocs",
    ]
    env = {
        **os.environ,
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    outputs = []
    for command in commands:
        done = subprocess.run(
            command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert "titan-data: wrote " in outputs[0] and " documents, " in outputs[0]
    assert " tokens in " in outputs[1] and '"name": "byte"' in outputs[1]
    index = json.loads((tmp_path / "tokens/pydocs/titan-tokens.json").read_text())
    assert index["complete"] and len(index["shards"]) > 3

    from titan_data import build_dataloader, load_tokenizer

    loader = build_dataloader(
        dataset=str(tmp_path / "tokens/pydocs"),
        dataset_path=None,
        tokenizer=load_tokenizer("byte"),
        seq_len=64,
        batch_size=2,
    )
    inputs, labels = next(iter(loader))
    assert inputs.shape == (2, 64) and (inputs[:, 1:] == labels[:, :-1]).all()
