"""core/lengths.py: where a command's lengths come from (a profile or a file), checked as a whole.

    python -m pytest tests/core/test_lengths.py -q
"""

import typing

import pytest

from megatron_chunkflow.core.lengths import LengthsConfig, ProfileName
from megatron_chunkflow.core.profiles import PROFILES, ensure_long, sample_lengths


def test_profile_names_are_the_profiles():
    assert set(typing.get_args(ProfileName)) == set(PROFILES)


def test_a_profile_draws_the_default_batch_of_the_command():
    lengths, source = LengthsConfig(seed=3, step=2, scale=0.5).lengths(default_batch=40)
    assert lengths == sample_lengths("B", 40, 3, 2, 0.5)
    assert source == "profile B, seed 3, step 2, scale 0.5"
    assert len(LengthsConfig(global_batch_size=7).lengths(default_batch=40)[0]) == 7


def test_min_long_redraws_from_the_tail_per_step():
    cfg = LengthsConfig(global_batch_size=16, scale=1 / 32, min_long=2)
    for offset in (0, 1):
        lengths, _ = cfg.lengths(16, long_above=256, step_offset=offset)
        plain = sample_lengths("B", 16, 0, offset, 1 / 32)
        assert lengths == ensure_long(plain, "B", 256, 2, offset, 1 / 32)
        assert sum(n > 256 for n in lengths) >= 2
    assert cfg.lengths(16)[0] == sample_lengths("B", 16, 0, 0, 1 / 32)  # no threshold: as drawn


def test_a_file_is_the_whole_batch(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("5\n# a comment\n7  # and another\n")
    assert LengthsConfig(lengths_file=str(f)).lengths(default_batch=99) == ([5, 7], str(f))
    for given in ({"global_batch_size": 3}, {"profile": "A"}):
        with pytest.raises(ValueError, match="with --lengths-file the file is the global batch"):
            LengthsConfig(lengths_file=str(f), **given)


@pytest.mark.parametrize("kw,message", [
    ({"global_batch_size": 0}, "--global-batch-size must be >= 1, got 0"),
    ({"scale": float("nan")}, "--scale must be a finite number > 0"),
    ({"step": -1}, "--step must be >= 0, got -1"),
    ({"min_long": -1}, "--min-long must be >= 0, got -1"),
    ({"profile": "Z"}, "--profile 'Z': choose from A, B, C, dcp"),
])
def test_bad_values_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LengthsConfig(**kw)
