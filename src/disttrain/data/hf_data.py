"""Hugging Face `datasets` folders (written by `save_to_disk`) as map-style datasets.

`load_from_disk` memory-maps the Arrow files, so a row is read on demand and row i is
the same on every rank and run: the ElasticSampler resumes it exactly at any world
size. A sample is made of the configured columns:

    one column (token ids, block_size + 1 per row)  -> (x, y) = (row[:-1], row[1:])
    several columns                                  -> {column: tensor}, for model(**batch)

`datasets` is an optional dependency (`pip install disttrain[data]`), imported only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.errors import UserError

DEFAULT_HELDOUT = "validation"
"""data.hf_heldout_split's default: used when the folder has it, else no held-out set.
Any other split that the folder lacks is a `UserError`."""


def _load(folder: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(
            "data.hf_dataset needs the `datasets` package: pip install 'disttrain[data]' (or pip install datasets)."
        ) from None
    if not folder.is_dir():
        raise UserError(
            f"data.hf_dataset: {folder} is not a folder; point it at a folder written by Dataset.save_to_disk."
        )
    try:
        return datasets.load_from_disk(str(folder))
    except Exception as e:  # not a save_to_disk folder: the user's to fix
        raise UserError(
            f"data.hf_dataset: {folder} is not a Hugging Face datasets folder "
            f"({type(e).__name__}: {str(e)[:200]}); write it with Dataset.save_to_disk."
        ) from None


class HFRows(Dataset):
    """Rows of a `datasets.Dataset`, restricted to `columns` and returned as tensors."""

    def __init__(self, table: Any, columns: list[str], where: str):
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise UserError(
                f"data.hf_columns names {', '.join(map(repr, missing))}, but {where} has the "
                f"columns {', '.join(table.column_names)}; name some of those."
            )
        self.table = table.with_format("numpy", columns=list(columns))
        self.columns = list(columns)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int):
        row = self.table[int(i)]
        tensors = {c: torch.as_tensor(np.asarray(row[c])) for c in self.columns}
        if len(self.columns) == 1:
            ids = tensors[self.columns[0]].long()
            return ids[:-1], ids[1:]
        return tensors


def _check_rows(rows: HFRows, block_size: int | None, where: str) -> None:
    if len(rows) == 0 or len(rows.columns) != 1:
        return
    n = len(rows[0][0]) + 1
    if n < 2 or (block_size is not None and n > block_size + 1):
        raise UserError(
            f"data.hf_dataset: the first row of {where} has {n} tokens in column "
            f"{rows.columns[0]!r}; one column gives (x, y) next-token pairs and needs 2 to "
            f"block_size + 1 = {(block_size or 0) + 1} tokens per row (cut the text into "
            f"windows with Dataset.map, or raise model.block_size)."
        )


def hf_datasets(
    folder: str | os.PathLike,
    columns: list[str],
    *,
    split: str = "train",
    heldout_split: str = "validation",
    block_size: int | None = None,
    base: str | os.PathLike | None = None,
) -> tuple[HFRows, HFRows | None, dict]:
    """(train rows, held-out rows or None, summary fields) of a `save_to_disk` folder
    (relative to `base`). A DatasetDict gives `split` and `heldout_split` (None when
    that split is the default "validation" and absent, or ''); a single Dataset has no
    held-out part. `block_size`, when given, bounds the length of one-column rows. Raises `UserError` for a missing
    package, folder, split (a held-out split named but absent included) or column, or a
    row that cannot be a next-token window."""
    path = Path(folder).expanduser()
    path = path if path.is_absolute() else Path(base or Path.cwd()) / path
    loaded = _load(path)
    if hasattr(loaded, "column_names") and not isinstance(loaded.column_names, dict):
        train_table, held_table = loaded, None
    else:
        splits = list(loaded.keys())
        if split not in splits:
            raise UserError(
                f"data.hf_split is {split!r}, but {path} has the splits {', '.join(splits)}; "
                f"set data.hf_split to one of them."
            )
        train_table = loaded[split]
        if heldout_split and heldout_split not in splits and heldout_split != DEFAULT_HELDOUT:
            raise UserError(
                f"data.hf_heldout_split is {heldout_split!r}, but {path} has the splits "
                f'{", ".join(splits)}; set it to one of them, or to "" for no held-out set.'
            )
        held_table = loaded[heldout_split] if heldout_split and heldout_split in splits else None
    train = HFRows(train_table, columns, f"{path} [{split}]")
    held = HFRows(held_table, columns, f"{path} [{heldout_split}]") if held_table is not None else None
    if len(train) == 0:
        raise UserError(f"data.hf_dataset: {path} [{split}] has no rows.")
    for rows, name in ((train, split), (held, heldout_split)):
        if rows is not None:
            _check_rows(rows, block_size, f"{path} [{name}]")
    return train, held, {"hf_rows": len(train), "hf_heldout_rows": len(held) if held is not None else 0}
