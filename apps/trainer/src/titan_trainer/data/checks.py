"""The data's pre-start checks, with no process group: the tokenizer loads (and the Hugging Face
weights a run starts from have a row for each of its ids), each dataset is found and, once per
job, its first document read."""

from __future__ import annotations

from titan_core import ModelSpec, NamesItsOption, PluginError, first_line, plugins, resolve
from titan_trainer.model import hf_import_vocab


def tokenizer_problems(
    config, spec: ModelSpec | None, *, dry_run: bool
) -> tuple[int | None, list[str], list[str]]:
    """(the vocabulary size, problems, notes) of the run's tokenizer, for the model family
    `spec` (None: not found). A dry run takes a tokenizer that does not load as a note (the
    cluster may hold the file) and the flavor's vocabulary size instead. (None, [], []) when
    the model, its flavor or the data plugin is not found (the config checks say so)."""
    if spec is None:
        return None, [], []
    try:
        data = resolve(plugins.DATA, config.training.data_plugin)
    except PluginError:
        return None, [], []
    vocab_size = spec.flavors[config.model.flavor].vocab_size
    problems: list[str] = []
    notes: list[str] = []
    tokenizer_path, note = config.model.tokenizer_source()
    if note:
        notes.append(note)
    try:
        vocab_size = data.build_tokenizer(tokenizer_path).vocab_size
    except Exception as e:  # any failure to load is the user's to see, with its reason
        key = (
            "tokenizer_path" if tokenizer_path == config.model.tokenizer_path else "hf_assets_path"
        )
        message = f"[model] {key} = {tokenizer_path!r} cannot be loaded: {first_line(e)}"
        if dry_run:
            notes.append(f"{message}; memory uses the flavor's vocabulary ({vocab_size:,})")
        else:
            problems.append(
                message + f"\npoint {key} at a tokenizer.json or tokenizer.model (or a"
                " folder holding one), or use byte"
            )
    else:
        problems += _hf_vocab_problems(config, tokenizer_path, vocab_size, notes)
    return vocab_size, problems, notes


def dataset_problems(config, notes: list[str], *, open_datasets: bool) -> list[str]:
    """Each dataset of the run ([training], and [validation] when on) found by the data plugin;
    with `open_datasets` its first document read too."""
    data = resolve(plugins.DATA, config.training.data_plugin)
    datasets = [("training", config.training.dataset, config.training.dataset_path)]
    if config.validation.enable:
        datasets.append(("validation", config.validation.dataset, config.validation.dataset_path))
    problems: list[str] = []
    for section, dataset, path in datasets:
        found = _described(data, section, dataset, path, notes)
        if not found and open_datasets:
            found = _opened(data, section, dataset, path)
        problems += found
    return problems


def _hf_vocab_problems(config, tokenizer_path: str, vocab_size: int, notes: list[str]) -> list[str]:
    """Hugging Face weights to start from must have a row for every id of the tokenizer."""
    imported = hf_import_vocab(config)
    if imported is None:
        return []
    path = config.checkpoint.initial_load_path
    if imported < vocab_size:
        return [
            f"[checkpoint] initial_load_path = {path!r} holds weights for {imported:,} token ids"
            f" (its config.json), fewer than the {vocab_size:,} of the tokenizer"
            f" {tokenizer_path!r}\nuse the tokenizer those weights were trained"
            f" with (a Hugging Face folder holds it: --model.tokenizer_path {path})"
        ]
    notes.append(
        f"model: vocabulary {imported:,} from the Hugging Face weights in {path}"
        f" (the tokenizer has {vocab_size:,} ids)"
    )
    return []


def _described(data, section: str, dataset: str, path: str | None, notes: list[str]) -> list[str]:
    describe = data.describe_dataset
    if describe is None:
        notes.append(
            f"data plugin {data.name!r} cannot check [{section}] dataset before loading it"
        )
        return []
    try:
        notes.append(f"[{section}] dataset: {describe(dataset, path)}")
    except (ValueError, FileNotFoundError, OSError) as e:
        return [_named(section, dataset, e)]
    return []


def _named(section: str, dataset: str, error: BaseException) -> str:
    """The plugin's message about `dataset`, every line of it (the fixes follow the first),
    under the key that names it."""
    text = str(error).strip() or type(error).__name__
    if text.startswith(f"dataset {dataset} "):  # titan-data's messages name it
        return f"[{section}] {text}"
    return f"[{section}] dataset = {dataset!r}: {text}"


def _opened(data, section: str, dataset: str, path: str | None) -> list[str]:
    """The data plugin reads the dataset's first document (see `DataSpec.check_dataset`)."""
    check = data.check_dataset
    if check is None:
        return []
    try:
        check(dataset, path)
    except Exception as e:  # noqa: BLE001 - whatever a plugin raises, its message is the answer
        if isinstance(e, NamesItsOption):
            # A first row without the default text field: reachable, and the loader checks the
            # field with the run's dataset_text_field, naming that key (data/loader.py).
            return []
        return [_named(section, dataset, e)]
    return []
