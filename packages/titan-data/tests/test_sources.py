import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl

from titan_data import build_dataloader, load_source, load_tokenizer, pydocs_documents


def texts(source):
    """Every document of `source`, read once by one stream."""
    reader, out = source.open(0, 1), []
    while (row := reader.next()) is not None:
        out.append(row.text)
    return out


def test_pydocs_is_real_english_deterministic_and_deduplicated():
    documents = pydocs_documents()
    assert len(documents) > 200
    assert sum(map(len, documents)) > 1_000_000
    assert len(set(documents)) == len(documents)
    joined = "\n".join(documents)
    for phrase in ("The ", " is ", " the ", "Return "):
        assert joined.count(phrase) > 500
    assert texts(load_source("pydocs")) == list(pydocs_documents("train"))


def test_pydocs_validation_split_is_held_out_from_training():
    train, validation = pydocs_documents("train"), pydocs_documents("validation")
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(pydocs_documents())
    # About a tenth of the text: enough for a few validation batches of 8 x 2048 bytes.
    share = sum(map(len, validation)) / sum(map(len, pydocs_documents()))
    assert 0.05 < share < 0.2, share
    assert texts(load_source("pydocs_validation")) == list(validation)
    with pytest.raises(ValueError, match="unknown pydocs split 'test'"):
        pydocs_documents("test")


def test_jsonl_file_folder_glob_and_format_name_read_the_same_documents(
    jsonl_file, two_jsonl_files, documents
):
    assert texts(load_source(jsonl_file)) == documents
    assert texts(load_source(two_jsonl_files)) == documents  # sorted: part-0 then part-1
    assert texts(load_source(os.path.join(two_jsonl_files, "*.jsonl"))) == documents
    assert texts(load_source("jsonl", two_jsonl_files)) == documents


def test_jsonl_with_a_custom_text_field(tmp_path, documents):
    path = write_jsonl(tmp_path / "body.jsonl", documents[:5], field="body")
    assert texts(load_source(path, text_field="body")) == documents[:5]


def test_parquet_files(tmp_path, documents):
    pq.write_table(pa.table({"text": documents[:30]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": documents[30:]}), tmp_path / "b.parquet")
    assert texts(load_source(str(tmp_path))) == documents
    assert texts(load_source(str(tmp_path / "a.parquet"))) == documents[:30]


def test_plain_text_files_are_one_document_each(tmp_path, documents):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("\n".join(documents[i * 5 : i * 5 + 5]) + "\n")
    got = texts(load_source(str(tmp_path)))
    assert len(got) == 3
    assert got[1].strip() == "\n".join(documents[5:10])


def test_c4_reads_a_local_clone_through_the_hub_code_path(c4_clone, documents):
    source = load_source("c4", c4_clone)
    assert "allenai/c4 (en) split train" in source.description
    # Config `en`, split `train` only: the validation files are not read.
    assert sorted(texts(source)) == sorted(documents[:40])


def test_c4_reads_a_folder_of_bare_json_gz_files(c4_clone, documents):
    assert sorted(texts(load_source("c4", os.path.join(c4_clone, "en")))) == sorted(documents[:40])


def test_any_hub_name_reads_its_local_copy_and_names_the_hub_otherwise(c4_clone, documents):
    plain = os.path.join(c4_clone, "en")
    assert sorted(texts(load_source("someone/corpus", plain))) == sorted(documents[:40])
    hub = load_source("someone/corpus")  # nothing is read until a reader reads
    assert "someone/corpus split train from Hugging Face hub" in hub.description
    assert "allenai/c4 (en)" in load_source("c4").description


def test_unknown_dataset_lists_the_known_names():
    with pytest.raises(ValueError) as err:
        load_source("nonsense")
    message = str(err.value)
    assert "unknown dataset 'nonsense'" in message
    assert (
        "pydocs, pydocs_validation, c4" in message
        and "owner/name" in message
        and "parquet" in message
    )


def test_missing_paths_and_empty_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset path .*missing.jsonl does not exist"):
        load_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        load_source(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no data files; accepted extensions: .jsonl"):
        load_source(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="local copy of c4"):
        load_source("c4", str(tmp_path / "nowhere"))


def test_wrong_combinations_are_refused(jsonl_file):
    with pytest.raises(ValueError, match="embedded and takes no dataset_path"):
        load_source("pydocs", jsonl_file)
    with pytest.raises(ValueError, match="names a file format; set dataset_path"):
        load_source("parquet")


def test_empty_dataset_fails_when_the_loader_is_built(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"dataset .*empty.jsonl \(1 jsonl file .*\) is empty"):
        build_dataloader(
            dataset=str(tmp_path / "empty.jsonl"),
            dataset_path=None,
            tokenizer=load_tokenizer("byte"),
            seq_len=8,
            batch_size=1,
        )


def test_missing_text_field_names_the_field_and_the_fields_found(tmp_path, documents):
    path = write_jsonl(tmp_path / "body.jsonl", documents[:3], field="body")
    with pytest.raises(ValueError) as err:
        build_dataloader(
            dataset=path,
            dataset_path=None,
            tokenizer=load_tokenizer("byte"),
            seq_len=8,
            batch_size=1,
        )
    assert "has no field 'text'; fields found: 'id', 'body'" in str(err.value)
    assert str(err.value).endswith("\nset text_field to the field that holds the text")
    flag = err.value.for_option("--text-field")  # a caller names its own setting
    assert str(flag).endswith("\nset --text-field to the field that holds the text")


def test_mixed_formats_in_one_folder_are_refused(tmp_path, jsonl_file):
    shutil.copy(jsonl_file, tmp_path / "a.jsonl")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="mixes json and parquet files"):
        load_source(str(tmp_path))


def _all_rows(reader):
    rows = []
    while (row := reader.next()) is not None:
        rows.append(row)
    return rows


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json list", "text files"])
def test_a_stream_reads_every_nth_document_and_resumes_from_any_position(tmp_path, documents, kind):
    folder = tmp_path / "data"
    folder.mkdir()
    for part in range(3):  # three files, documents in order across them
        docs = documents[part * 10 : part * 10 + 10]
        if kind == "jsonl":
            write_jsonl(folder / f"{part}.jsonl", docs)
        elif kind == "jsonl.gz":
            with gzip.open(folder / f"{part}.jsonl.gz", "wt", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": d}) + "\n\n" for d in docs)  # blank lines too
        elif kind == "json list":
            (folder / f"{part}.json").write_text(json.dumps([{"text": d} for d in docs]))
        else:
            for i, d in enumerate(docs):
                (folder / f"{part}-{i:02d}.txt").write_text(d)
    source = load_source(str(folder))
    every = [row.text for row in _all_rows(source.open(0, 1))]
    assert every == documents[:30]
    for slot in range(3):
        reader = source.open(slot, 3)
        states, texts = [reader.state_dict()], []
        while (row := reader.next()) is not None:
            texts.append(row.text)
            states.append(reader.state_dict())
        assert texts == documents[slot:30:3]
        for i, state in enumerate(states):
            resumed = source.open(slot, 3)
            resumed.load_state_dict(json.loads(json.dumps(state)))
            assert [r.text for r in _all_rows(resumed)] == texts[i:], (slot, i)
