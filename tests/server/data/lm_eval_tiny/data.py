"""Loads this task's items from the JSONL files beside this module, so the task runs from any working
directory and never asks a hub (lm-eval's `custom_dataset` hook; `dataset_path: json` would resolve
its `data_files` against the caller's working directory)."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str) -> datasets.DatasetDict:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**_kwargs) -> datasets.DatasetDict:
    return _load("mc.jsonl")


def load_gen(**_kwargs) -> datasets.DatasetDict:
    return _load("gen.jsonl")
