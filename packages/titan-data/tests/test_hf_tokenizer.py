"""Hugging Face tokenizer.json through `load_tokenizer`: the ids are those of the `tokenizers`
library, the special tokens those `transformers` reads from the same folder, `titan-data
tokenize` and the loader use it, and a missing or garbled file is an error naming it and the
fix. The tokenizer is a real byte-level BPE trained once on the embedded corpus (conftest)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from conftest import SPECIAL_TOKENS, TEXTS, write_jsonl
from tokenizers import Tokenizer

from titan_core import plugins, resolve
from titan_data import DataError, HFTokenizer, TokenShards, build_dataloader, load_tokenizer
from titan_data.cli import main

SPECIAL_TEXTS = [
    "<|endoftext|>",
    "before<|im_start|>user\nhi<|im_end|>after <|begin_of_text|> <|end_of_text|>",
    "<|endoftext|><|endoftext|>   <|im_end|>\n",
]


def reference(folder: str) -> Tokenizer:
    """`tokenizers`' own Tokenizer of the folder, set as Titan's: special-token text is text."""
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    return tokenizer


def test_ids_are_the_tokenizers_librarys_on_tricky_texts_and_decode_back(bpe_folders):
    folder = bpe_folders["llama"]
    tokenizer = resolve(plugins.DATA, "titan").build_tokenizer(folder)  # the trainer's path
    assert isinstance(tokenizer, HFTokenizer)
    ref = reference(folder)
    specials = set(tokenizer.special_tokens.values())
    assert len(specials) == len(SPECIAL_TOKENS)
    for text in TEXTS + SPECIAL_TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, bos=False, eos=False) == ids, text[:40]
        both = tokenizer.encode(text, bos=True, eos=True)
        assert both == [tokenizer.bos_id, *ids, tokenizer.eos_id], text[:40]
        assert tokenizer.encode(text, bos=True, eos=False) == [tokenizer.bos_id, *ids]
        assert not specials & set(ids), text[:40]  # documents cannot inject control tokens
        assert tokenizer.decode(ids) == text, text[:40]
    # Special-token text stays text, yet splits into fewer pieces than bytes (BPE merges).
    assert 1 < len(tokenizer.encode("<|endoftext|>", bos=False, eos=False)) < len("<|endoftext|>")
    # A copy for a spawned worker process encodes alike.
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert [copy.encode(t, bos=True, eos=True) for t in SPECIAL_TEXTS] == [
        tokenizer.encode(t, bos=True, eos=True) for t in SPECIAL_TEXTS
    ]
    # Special ids decode to their text, as transformers' decode does by default.
    ids = tokenizer.encode("def f", bos=True, eos=True)
    assert tokenizer.decode(ids) == "<|begin_of_text|>def f<|end_of_text|>"


def test_special_tokens_and_vocabulary_are_those_transformers_reads(bpe_folders):
    transformers = pytest.importorskip("transformers", reason="the reference for the folders")
    expected_sources = {
        "llama": "BOS <|begin_of_text|> = {bos} (tokenizer_config.json)",
        "qwen": "no BOS (it has none): documents are text + EOS",
        "torchtitan": "BOS <|bos|> = {bos} (tokenizer_config.json) (added: not in tokenizer.json)",
    }
    for kind, line in expected_sources.items():
        ours = load_tokenizer(bpe_folders[kind])
        theirs = transformers.AutoTokenizer.from_pretrained(bpe_folders[kind])
        assert ours.vocab_size == len(theirs), kind
        assert ours.eos_id == theirs.eos_token_id, kind
        assert ours.pad_id == theirs.pad_token_id, kind
        if theirs.bos_token_id is None:
            assert not ours.adds_bos and ours.bos_id == ours.eos_id, kind
        else:
            assert ours.adds_bos and ours.bos_id == theirs.bos_token_id, kind
        assert line.format(bos=ours.bos_id) in ours.description, (kind, ours.description)
    # The qwen folder: documents are text + EOS; its EOS starts the next document.
    qwen = load_tokenizer(bpe_folders["qwen"])
    ids = qwen.encode("a b", bos=True, eos=True)
    assert ids == [*qwen.encode("a b", bos=False, eos=False), qwen.eos_id]
    assert qwen.eos_id == reference(bpe_folders["qwen"]).token_to_id("<|endoftext|>")


def test_a_tokenizer_json_alone_takes_its_special_tokens_by_name(bpe_folders):
    bare = load_tokenizer(os.path.join(bpe_folders["bare"], "tokenizer.json"))
    ref = reference(bpe_folders["bare"])
    assert (bare.bos_id, bare.eos_id) == (
        ref.token_to_id("<|begin_of_text|>"),
        ref.token_to_id("<|end_of_text|>"),
    )
    assert bare.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert "BOS <|begin_of_text|>" in bare.description and "(by its name)" in bare.description


def test_a_missing_or_unreadable_tokenizer_is_an_error_naming_the_path_and_the_fix(
    bpe_folders, tmp_path
):
    missing = str(tmp_path / "nowhere" / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=f"tokenizer path {missing} does not exist"):
        load_tokenizer(missing)
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", ')
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(garbled))
    message = str(err.value)
    assert message.startswith(
        f"{garbled / 'tokenizer.json'} is not a tokenizer.json the tokenizers"
    )
    assert "download it again" in message and "\n" not in message
    bad_config = tmp_path / "bad_config"
    shutil.copytree(bpe_folders["llama"], bad_config)
    (bad_config / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>",')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON .*download"):
        load_tokenizer(str(bad_config))
    no_eos = tmp_path / "no_eos"
    shutil.copytree(bpe_folders["llama"], no_eos)
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    with pytest.raises(ValueError, match=r"no end-of-document token.*add `\"eos_token\""):
        load_tokenizer(str(no_eos))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer .*tokenizer\.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_tokenize_writes_the_tokenizer_json_ids_and_training_reads_them(
    bpe_folders, tmp_path, documents, capsys
):
    folder = bpe_folders["llama"]
    tokenizer = load_tokenizer(folder)
    data = write_jsonl(tmp_path / "docs.jsonl", documents)
    out = str(tmp_path / "tokens")
    args = ["tokenize", "--dataset", data, "--tokenizer", folder, "--out", out]
    assert main([*args, "--workers", "2", "--quiet"]) == 0, capsys.readouterr().err
    shards = TokenShards(out)
    expected = np.concatenate([tokenizer.encode(d, bos=True, eos=True) for d in documents])
    assert np.array_equal(shards.read(0, len(expected)), expected)
    assert shards.manifest["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    assert shards.manifest["tokenizer"]["fingerprint"].startswith("sha256:")
    loader = build_dataloader(
        dataset=out, dataset_path=None, tokenizer=tokenizer, seq_len=32, batch_size=2
    )
    inputs, labels = next(iter(loader))
    assert inputs.shape == (2, 32) and int(inputs.max()) < tokenizer.vocab_size
    # The same tokenizer.json with other special tokens made other ids: refused.
    with pytest.raises(DataError, match=r"differs from this run's tokenizer: bos_id"):
        build_dataloader(
            dataset=out,
            dataset_path=None,
            tokenizer=load_tokenizer(bpe_folders["qwen"]),
            seq_len=32,
            batch_size=2,
        )


def test_without_a_bos_the_eos_ending_a_document_starts_the_next(bpe_folders, tmp_path):
    """Block-causal attention counts `bos_id` tokens to find documents: for Qwen's kind that is
    the EOS, and packing adds no other token, so each document's tokens (after the EOS that
    ends the one before) get one id of their own."""
    qwen = load_tokenizer(bpe_folders["qwen"])
    docs = ["The list type", "Dictionaries map keys", "A tuple"]
    stream = [i for d in docs for i in qwen.encode(d, bos=True, eos=True)]
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    loader = build_dataloader(
        dataset=data, dataset_path=None, tokenizer=qwen, seq_len=len(stream) - 1, batch_size=1
    )
    inputs, labels = next(iter(loader))
    assert inputs[0].tolist() + labels[0, -1:].tolist() == stream  # text + EOS, nothing else
    document_ids = (inputs[0] == qwen.bos_id).cumsum(0).tolist()
    lengths = [len(qwen.encode(d, bos=False, eos=False)) for d in docs]
    expected = [0] * lengths[0] + [1] * (1 + lengths[1]) + [2] * (1 + lengths[2])
    assert document_ids == expected
