"""The main job (``hatch run demo``, README's table) measures each package's default tier."""

from __future__ import annotations

import main_job
from flashcodec.tiers import DEFAULT_TIER as FLASHCODEC_DEFAULT
from palu_mlx.tiers import DEFAULT_TIER as PALU_DEFAULT


def test_the_main_job_runs_each_package_s_default_tier_first():
    assert main_job.DEMO["palu-mlx"][0].split(",")[0] == PALU_DEFAULT
    assert main_job.DEMO["flashcodec"][0].split(",")[0] == FLASHCODEC_DEFAULT
