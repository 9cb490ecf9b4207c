"""SampleFolder: each rank opens only the files of its share, and the share follows the global position."""

from __future__ import annotations

import pytest
import torch

from perdure import PerdureError
from perdure.data.loader import ResumableLoader
from perdure.data.sample_folder import SampleFolder, write_sample_folder


def test_each_rank_opens_only_its_share_and_a_resume_on_other_ranks_covers_the_rest(tmp_path):
    folder = write_sample_folder(tmp_path / "samples", [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(24)])
    opened: dict[int, list[str]] = {}

    def dataset_for(rank):
        def load(path):
            opened.setdefault(rank, []).append(path.name)
            return torch.load(path, weights_only=True)

        return SampleFolder(folder, load=load)

    # Two ranks consume two global batches (2 ranks x batch 3 x 2) of epoch 0, then the run resumes on three ranks.
    seen = []
    for rank in range(2):
        loader = ResumableLoader(dataset_for(rank), batch_size=3, shuffle=True, seed=7, rank=rank, world_size=2)
        batches = iter(loader.iter_epoch(0))
        for _ in range(2):
            seen.extend(next(batches)[1].tolist())
    assert set(opened[0]).isdisjoint(opened[1]) and len(opened[0]) == len(opened[1]) == 6
    opened.clear()
    for rank in range(3):
        loader = ResumableLoader(dataset_for(rank), batch_size=3, shuffle=True, seed=7, rank=rank, world_size=3)
        for _, targets in loader.iter_epoch(0, samples_done=12):
            seen.extend(targets.tolist())
    assert all(len(set(opened[a]) & set(opened[b])) == 0 for a in range(3) for b in range(a))
    assert sorted(seen) == list(range(24))


def test_a_missing_or_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(PerdureError, match="does not exist"):
        SampleFolder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PerdureError, match="no file matching"):
        SampleFolder(tmp_path / "empty")
