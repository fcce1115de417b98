"""The corpus: the held-out split is the committed file and never overlaps training."""

from __future__ import annotations

import hashlib

import pytest
from corpus import HELDOUT_PATH, load_corpus, split_documents


def test_heldout_reads_the_committed_file():
    text = load_corpus("heldout")
    assert text == HELDOUT_PATH.read_text(encoding="utf-8")
    assert 50_000 < len(text) < 400_000


def test_splits_are_disjoint_whole_documents():
    train, heldout = split_documents()
    train_names = {name for name, _ in train}
    heldout_names = {name for name, _ in heldout}
    assert heldout_names and not train_names & heldout_names
    # no held-out document's text appears in the training text
    train_text = load_corpus("train")
    for _, doc in heldout:
        assert doc[:400] not in train_text


def test_training_record_hashes_match_the_committed_heldout(training_record):
    record = training_record
    digest = hashlib.sha256(load_corpus("heldout").encode("utf-8")).hexdigest()
    assert record["corpus"]["heldout_sha256"] == digest


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="split must be"):
        load_corpus("validation")
