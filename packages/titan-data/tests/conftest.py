import gzip
import json
import os

import pytest

# Everything here is local; never let `datasets` reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def make_documents(n: int) -> list[str]:
    """n distinct documents of varied length and script, each tagged `doc-XXXX` so a test can
    tell from decoded bytes which documents a batch holds."""
    words = ["packing", "résumé", "数据", "🙂", "loader", "tokens", "shard", "epoch", "Ωmega"]
    return [
        f"doc-{i:04d} " + " ".join(words[(i + j) % len(words)] for j in range(3 + (i * 7) % 40))
        for i in range(n)
    ]


def write_jsonl(path, documents, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(documents):
            f.write(json.dumps({"id": i, field: doc}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def documents():
    return make_documents(50)


@pytest.fixture(scope="session")
def jsonl_file(tmp_path_factory, documents):
    return write_jsonl(tmp_path_factory.mktemp("jsonl") / "docs.jsonl", documents)


@pytest.fixture(scope="session")
def two_jsonl_files(tmp_path_factory, documents):
    """A folder with two jsonl files: documents 0-24 and 25-49."""
    folder = tmp_path_factory.mktemp("two")
    write_jsonl(folder / "part-0.jsonl", documents[:25])
    write_jsonl(folder / "part-1.jsonl", documents[25:])
    return str(folder)


@pytest.fixture(scope="session")
def c4_clone(tmp_path_factory, documents):
    """A local copy laid out like the allenai/c4 hub repository: a README declaring config
    `en`, and en/c4-{train,validation}.*.json.gz files."""
    root = tmp_path_factory.mktemp("c4")
    (root / "en").mkdir()
    for split, docs in (("train", documents[:40]), ("validation", documents[40:])):
        for shard in range(2):
            name = root / "en" / f"c4-{split}.{shard:05d}-of-00002.json.gz"
            with gzip.open(name, "wt", encoding="utf-8") as f:
                for doc in docs[shard::2]:
                    f.write(json.dumps({"text": doc, "url": "https://example.com"}) + "\n")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
        '    path: "en/c4-train.*.json.gz"\n  - split: validation\n'
        '    path: "en/c4-validation.*.json.gz"\n---\n# a c4 sample\n'
    )
    return str(root)


@pytest.fixture(scope="session")
def llama3():
    from titan_data import load_tokenizer

    return load_tokenizer("llama3")
