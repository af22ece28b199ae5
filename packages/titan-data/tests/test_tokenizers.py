import os
import shutil
import sys

import pytest
from conftest import TEXTS

from titan_data import ByteTokenizer, Llama3Tokenizer, load_tokenizer
from titan_data.tokenizer import find_tokenizer_model, llama3_package_asset

try:
    from llama_models.llama3.tokenizer import Tokenizer as ReferenceTokenizer
except ImportError:  # pragma: no cover - the test extra installs it
    ReferenceTokenizer = None

needs_reference = pytest.mark.skipif(
    ReferenceTokenizer is None,
    reason="llama-models is not installed (pip install titan-llm-data[test]); it holds the "
    "reference tokenizer and its tokenizer.model",
)


@needs_reference
def test_llama3_ids_match_reference_tokenizer(llama3):
    reference = ReferenceTokenizer.get_instance()
    for text in TEXTS:
        for bos, eos in ((False, False), (True, True), (True, False)):
            assert llama3.encode(text, bos=bos, eos=eos) == reference.encode(
                text, bos=bos, eos=eos
            ), text[:40]
        ids = llama3.encode(text, bos=False, eos=False)
        assert llama3.decode(ids) == reference.decode(ids) == text


@needs_reference
def test_llama3_vocabulary_and_special_tokens_match_reference(llama3):
    reference = ReferenceTokenizer.get_instance()
    assert llama3.vocab_size == reference.n_words == 128_256
    assert llama3.special_tokens == reference.special_tokens
    assert (llama3.bos_id, llama3.eos_id, llama3.eot_id) == (128_000, 128_001, 128_009)
    assert llama3.special_tokens["<|start_header_id|>"] == 128_006
    assert llama3.special_tokens["<|end_header_id|>"] == 128_007
    assert llama3.pad_id == reference.pad_id


def test_llama3_special_token_text_is_not_injected(llama3):
    ids = llama3.encode("<|eot_id|> and <|begin_of_text|>", bos=True, eos=True)
    specials = set(llama3.special_tokens.values())
    assert ids[0] == llama3.bos_id and ids[-1] == llama3.eos_id
    assert not specials & set(ids[1:-1])


def test_tokenizer_paths_accept_file_and_hf_folder_layouts(tmp_path, llama3):
    asset = llama3_package_asset()
    assert llama3.model_path == asset
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(asset, flat / "tokenizer.model")
    hf = tmp_path / "hf" / "original"
    hf.mkdir(parents=True)
    shutil.copy(asset, hf / "tokenizer.model")
    assert find_tokenizer_model(asset) == asset
    assert find_tokenizer_model(str(flat)) == str(flat / "tokenizer.model")
    assert find_tokenizer_model(str(hf.parent)) == str(hf / "tokenizer.model")
    # One real load through the HF layout (loading costs ~1 s, so only once).
    tokenizer = load_tokenizer(str(hf.parent))
    assert isinstance(tokenizer, Llama3Tokenizer)
    assert tokenizer.encode("Titan", bos=False, eos=False) == llama3.encode(
        "Titan", bos=False, eos=False
    )


def test_load_tokenizer_errors_say_what_was_tried_and_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"unknown tokenizer 'gpt9'.*`byte`.*`llama3`"):
        load_tokenizer("gpt9")
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(str(tmp_path))
    assert os.path.join(str(tmp_path), "tokenizer.model") in str(err.value)
    assert os.path.join(str(tmp_path), "original", "tokenizer.model") in str(err.value)


def test_llama3_name_without_llama_models_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_models", None)  # as if it were not installed
    with pytest.raises(FileNotFoundError, match=r"pip install titan-llm-data\[llama\]"):
        load_tokenizer("llama3")


def test_byte_tokenizer_round_trips_and_adds_only_requested_specials():
    tokenizer = load_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.vocab_size == 259
    for text in TEXTS[:10]:
        ids = tokenizer.encode(text, bos=True, eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert all(0 <= i < 256 for i in ids[1:-1])
        assert ids[1:-1] == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("", bos=False, eos=False) == []
