"""`lab.engines.aot`: argument checks that run without nvcc (the compilation itself needs the toolkit wheels)."""

from __future__ import annotations

import argparse

import pytest

from lab.engines import aot


def test_captured_shapes_are_parsed_and_bad_ones_named():
    assert aot._parse_shapes("8x2,64x8") == [(8, 2), (64, 8)]
    with pytest.raises(argparse.ArgumentTypeError, match="HEADSxGROUPS.*'8by2'"):
        aot._parse_shapes("8by2")


def test_a_folder_that_is_not_a_bundle_is_refused_before_any_download(tmp_path):
    with pytest.raises(aot.AotError, match="not a bundle.*python -m lab.engines.bundle"):
        aot.build(tmp_path, cuda_home=tmp_path)


def test_cli_reports_the_error_in_one_line(tmp_path, capsys):
    assert aot.main([str(tmp_path), "--cuda-home", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "not a bundle" in err[0]
