"""REST's datastore (He et al., 2024, section 3.1), built once and published as an artifact like a trained component.

REST builds its chat datastore from ShareGPT conversations, every turn (and UltraChat for the large one); here the
documents are the assistant turns of `conversations` (the responses a chat model writes: `roles`) and the human-written
responses (`reference_response`) of the `responses` sets, each tokenized with the target's tokenizer as plain text (no
chat template, no special tokens: what the target writes inside its turn). decoding/rest.py's `Datastore` keeps them as
one token array with its suffix array. What the build took (reading and tokenizing the corpus, the leaderboard check,
the suffix sort) is the artifact's `compute_minutes`, and its size `datastore_mb`: the leaderboard's cost columns read
them as a training cost.

Never the leaderboard's own questions: a corpus that is the `leaderboard` set itself is refused, and so is a corpus
with any document sharing a passage with one of its questions (data/overlap.py: a stretch of 90 characters or more,
case- and whitespace-folded), naming it, so that no datastore holds text of what it is measured on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from specrepro import suspension
from specrepro.data import load_records
from specrepro.data.config import DatasetConfig
from specrepro.data.overlap import every_passage, quotes
from specrepro.data.records import reference_response
from specrepro.decoding.rest import Datastore
from specrepro.errors import SpecReproError
from specrepro.registry import register_component
from specrepro.training.eagle_data import MESSAGE_CHARS


@dataclass
class RestDatastoreConfig:
    component: str = "rest_datastore"
    conversations: Optional[DatasetConfig] = None  # whole conversations (task sharegpt)
    roles: List[str] = field(default_factory=lambda: ["assistant"])  # whose messages are documents
    responses: Dict[str, DatasetConfig] = field(default_factory=dict)  # sets whose human-written answers join
    leaderboard: DatasetConfig = field(default_factory=DatasetConfig)  # questions no document may share a passage with
    tokenize_batch: int = 512  # documents a tokenizer call


def corpus_documents(spec) -> list[tuple[str, str]]:
    """(where from, text) of every document: `roles` messages of the conversations, then the responses sets'
    answers; each message cut at MESSAGE_CHARS characters, as EAGLE's data is."""
    documents = []
    if spec.conversations is not None:
        for record in load_records(spec.conversations):
            messages = record.fields.get("messages")
            if messages is None:
                raise SpecReproError(
                    f"dataset '{spec.conversations.name}' has no whole conversations (task sharegpt has them)"
                )
            documents += [
                (f"{spec.conversations.name} {record.id}", m["content"][:MESSAGE_CHARS])
                for m in messages
                if m["role"] in spec.roles and m["content"].strip()
            ]
    for name, dataset in spec.responses.items():
        for record in load_records(dataset):
            answer = reference_response(record)
            if answer and answer.strip():
                documents.append((f"{name} {record.id}", answer[:MESSAGE_CHARS]))
    return documents


def refuse_leaderboard_text(spec, documents: list[tuple[str, str]]) -> None:
    """One line naming the first document that shares a passage with a leaderboard question, or the corpus set that
    is the leaderboard's own file."""
    sets = ([spec.conversations] if spec.conversations is not None else []) + list(spec.responses.values())
    for dataset in sets:
        if dataset.path == spec.leaderboard.path:
            raise SpecReproError(
                f"the REST datastore's corpus '{dataset.name}' is the leaderboard's own questions "
                f"({dataset.path}): build it from other text"
            )
    known = every_passage(load_records(spec.leaderboard))
    for origin, text in documents:
        if quotes(text, known):
            raise SpecReproError(
                f"the REST datastore's corpus shares a passage with a {spec.leaderboard.name} "
                f"question ({origin}): leave that record out (its dataset's ids_path) and build it "
                "again"
            )


@register_component("rest_datastore", schema=RestDatastoreConfig)
def build_rest_datastore(cfg, target, work_dir, log_metrics, device):
    """Build the datastore of the recipe's corpus for the target's tokenizer; returns (datastore, metrics, [])."""
    spec, tokenizer = cfg.training, target.tokenizer
    if tokenizer is None:
        raise SpecReproError("the REST datastore is tokenized with the target's tokenizer; this model has none")
    started = suspension.clock()
    documents = corpus_documents(spec)
    refuse_leaderboard_text(spec, documents)
    checked = suspension.clock()
    token_lists = []
    for start in range(0, len(documents), spec.tokenize_batch):
        texts = [text for _, text in documents[start : start + spec.tokenize_batch]]
        token_lists += tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokenized = suspension.clock()
    vocab = target.model.get_output_embeddings().weight.shape[0]
    datastore = Datastore.build(token_lists, {"vocab_size": vocab})
    built = suspension.clock()
    metrics = {
        "documents": datastore.settings["documents"],
        "datastore_tokens": datastore.settings["tokens"],
        "datastore_mb": datastore.nbytes / 2**20,
        "read_and_check_minutes": (checked - started) / 60,
        "tokenize_minutes": (tokenized - checked) / 60,
        "suffix_array_minutes": (built - tokenized) / 60,
        "compute_minutes": (built - started) / 60,
    }
    return datastore, metrics, []
