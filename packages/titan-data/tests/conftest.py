import gzip
import json
import os

import pytest

# Everything here is local; never let `datasets` reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# Texts that tokenizers get wrong: scripts, emoji and joiners, whitespace runs, special-token
# text, the empty string, very long runs (tiktoken needs them cut) and a 430k-character text.
TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3:14pm; we'll see.",
    "Ünïcödé façade — naïve café, Ελληνικά, русский, עברית, العربية",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 🇫🇷 ✔️",
    "digits 1234567890 3.14159 1e-10 0xFF 1,000,000",
    "tabs\tand\nnew\r\nlines\n\n\n  indented\u00a0nbsp\u3000ideographic space",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>hi<|eot_id|><|end_of_text|>",
    "def f(x):\n    return x ** 2  # code\n",
    " " * 30_000 + "after a long run of spaces",
    "x" * 60_000,
    "word " * 2_000 + "\n" * 26_000 + "y" * 25_001,
    "z" * 399_990 + " " * 30_000 + "tail",  # a long run across the 400k-character cut
]


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


# The special tokens of the test tokenizer, added after its BPE vocabulary as the families do.
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
)


def train_bpe_tokenizer_json(path, documents, vocab_size: int = 1000) -> None:
    """A byte-level BPE tokenizer (GPT-2, Llama 3 and Qwen use this kind) trained with
    `tokenizers` on `documents`, saved as a Hugging Face tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path))


def tokenizer_folder(root, name: str, tokenizer_json, **files) -> str:
    """A model's tokenizer folder: the tokenizer.json and the given JSON files beside it
    (`tokenizer_config={...}` writes tokenizer_config.json)."""
    import shutil

    folder = root / name
    folder.mkdir()
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    for stem, content in files.items():
        (folder / f"{stem}.json").write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return str(folder)


@pytest.fixture(scope="session")
def bpe_folders(tmp_path_factory) -> dict[str, str]:
    """One BPE tokenizer.json, trained once on the embedded corpus, in folders laid out as the
    families ship theirs: `llama` (tokenizer_config.json names BOS, EOS and PAD, as Llama 3's
    and DeepSeek-V3's do), `qwen` (no BOS, `add_bos_token: false`, config.json ids, as Qwen3's),
    `bare` (tokenizer.json alone), `torchtitan` (tokenizer_config.json names tokens that
    tokenizer.json lacks, as torchtitan's test tokenizer does)."""
    from tokenizers import Tokenizer

    from titan_data import pydocs_documents

    root = tmp_path_factory.mktemp("bpe")
    trained = root / "tokenizer.json"
    train_bpe_tokenizer_json(trained, pydocs_documents("train"))
    endoftext = Tokenizer.from_file(str(trained)).token_to_id("<|endoftext|>")
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {
        "llama": tokenizer_folder(
            root,
            "llama",
            trained,
            tokenizer_config={
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "pad_token": {"content": "<|endoftext|>", **entry, "__type": "AddedToken"},
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            special_tokens_map={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        ),
        "qwen": tokenizer_folder(
            root,
            "qwen",
            trained,
            tokenizer_config={
                "add_bos_token": False,
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            config={"bos_token_id": endoftext, "eos_token_id": endoftext},
        ),
        "bare": tokenizer_folder(root, "bare", trained),
        "torchtitan": tokenizer_folder(
            root,
            "torchtitan",
            trained,
            tokenizer_config={
                "added_tokens_decoder": {
                    "128000": {"content": "<|bos|>", **entry, "special": True},
                    "128001": {"content": "<|eos|>", **entry, "special": True},
                },
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
        ),
    }
