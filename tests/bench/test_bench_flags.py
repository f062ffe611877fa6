"""Benchmark flags refuse counts and sizes that would run over nothing, and NaN / inf."""

from __future__ import annotations

import pytest

from bench.cache_ops.bench import main as cache_ops_main
from bench.multiturn.bench import parse_args as multiturn_args
from bench.optimistic.bench import parse_args as optimistic_args
from bench.trace.bench import main as trace_main

REFUSED = [
    (multiturn_args, ["--num-clients", "0"], "--num-clients"),
    (multiturn_args, ["--num-rounds", "-1"], "--num-rounds"),
    (multiturn_args, ["--hicache-ratio", "nan"], "--hicache-ratio"),
    (multiturn_args, ["--load", "inf"], "--load"),
    (multiturn_args, ["--page-size", "1.5"], "--page-size"),
    (optimistic_args, ["--num-requests", "0"], "--num-requests"),
    (optimistic_args, ["--cached-fraction", "nan"], "--cached-fraction"),
    (optimistic_args, ["--cached-fraction", "1.5"], "--cached-fraction"),
]


@pytest.mark.parametrize("parse,argv,flag", REFUSED)
def test_bad_flag_exits_naming_it(parse, argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv, True)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "main,argv,flag",
    [
        (cache_ops_main, ["--sizes", "0"], "--sizes"),
        (trace_main, ["--l3-gbps", "nan"], "--l3-gbps"),
    ],
)
def test_bad_flag_of_main_exits_naming_it(main, argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_good_flags_parse() -> None:
    opts = multiturn_args(["--num-clients", "3", "--hicache-ratio", "2.5"], True)
    assert opts.num_clients == 3 and opts.hicache_ratio == 2.5
    assert optimistic_args(["--cached-fraction", "0"], True).cached_fraction == 0.0
