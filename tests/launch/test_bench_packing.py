"""``mgrpo bench packing``: the metrics on hand-checkable cases, and our packer vs padded batches."""
import json

import pytest

from launch.bench import packing as bp
from launch.bench.layers import DEFAULT_LENGTHS


def test_imbalance_by_hand():
    assert bp.imbalance([10, 20, 30]) == pytest.approx(1.5)
    assert bp.imbalance([7, 7]) == 1.0
    assert bp.imbalance([0, 0]) == 1.0


def test_padded_batches_by_hand():
    # dp=2: rank 0 gets samples 0, 2, 4 -> batches [0, 2] (max 5) and [4]; rank 1 gets 1, 3 -> [1, 3]
    lengths = [1, 3, 5, 2, 4]
    ranks = bp.plan_padded(lengths, dp=2, batch_size=2)
    assert [[mb["samples"] for mb in r] for r in ranks] == [[[0, 2], [4]], [[1, 3], []]]
    r = bp.evaluate([ranks])
    # processed: rank 0 = 2*5 + 4 = 14, rank 1 = 2*3 = 6 (+ an empty batch); real 15 of 20
    assert r["steps"][0]["rank_tokens"] == [14, 6]
    assert r["padding_fraction"] == pytest.approx(1 - 15 / 20)
    assert r["imbalance_tokens"]["mean"] == pytest.approx(14 / 10)
    # attention: rank 0 = 2*25 + 16 = 66, rank 1 = 2*9 = 18 -> 66 / 42
    assert r["steps"][0]["rank_attn"] == [66, 18]
    assert r["imbalance_attn"]["worst"] == pytest.approx(66 / 42)
    assert r["microbatches_per_rank"] == {"mean": 2, "max": 2}


def test_ours_by_hand():
    # LPT: 6 -> r0, 5 -> r1, 4 -> r1 (5 < 6), 3 -> r0 (6 < 9): 9 tokens each, one micro-batch of
    # 9 + 1 padding token each (budget 10, pad multiple 2)
    lengths = [6, 5, 4, 3]
    ranks = bp.plan_ours(lengths, dp=2, budget=10, pad_multiple=2)
    assert sorted(sorted(mb["samples"]) for r in ranks for mb in r) == [[0, 3], [1, 2]]
    r = bp.evaluate([ranks])
    assert r["steps"][0]["rank_tokens"] == [10, 10]
    assert r["padding_fraction"] == pytest.approx(2 / 20)
    assert r["imbalance_tokens"]["worst"] == 1.0
    # attention per segment: rank 0: 36 + 9 + 1 (its padding segment), rank 1: 25 + 16 + 1
    assert r["steps"][0]["rank_attn"] == [46, 42]
    assert r["imbalance_attn"]["mean"] == pytest.approx(46 / 44)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_every_sample_once_and_equal_counts(dp):
    (lengths,) = bp.sample_steps(1, 100, seed=3)
    assert set(lengths) <= set(DEFAULT_LENGTHS)
    for ranks in (bp.plan_ours(lengths, dp, 4096, 2), bp.plan_padded(lengths, dp, 4)):
        ids = sorted(i for r in ranks for mb in r for i in mb["samples"])
        assert ids == list(range(100))
        assert len({len(r) for r in ranks}) == 1
        for r in ranks:  # real tokens add up
            for mb in r:
                assert mb["real"] == sum(lengths[i] for i in mb["samples"])


def test_ours_pads_less_and_balances_better_than_padded_batches(tmp_path):
    res = bp.run_bench(tmp_path, samples=64, steps=4, dp_sizes=[1, 4], budget=8192, batch_sizes=[4, 8],
                       pad_multiple=2, seed=1, plot=False, quiet=True)
    m = res["methods"]
    for dp in ("1", "4"):
        assert m["ours"][dp]["padding_fraction"] < 0.01
        assert m["ours"][dp]["padding_fraction"] < m["padded_bs4"][dp]["padding_fraction"] / 10
        assert m["padded_bs8"][dp]["padding_fraction"] > m["padded_bs4"][dp]["padding_fraction"]
        assert m["ours"][dp]["real_tokens"] == m["padded_bs4"][dp]["real_tokens"]  # same samples
    assert m["ours"]["4"]["imbalance_tokens"]["worst"] < m["padded_bs4"]["4"]["imbalance_tokens"]["mean"]
    assert m["ours"]["1"]["imbalance_tokens"]["worst"] == 1.0
    # ours fits each rank into close to the fewest micro-batches its tokens allow
    for step, lengths in zip(m["ours"]["1"]["steps"], bp.sample_steps(4, 64, seed=1)):
        assert step["microbatches"] <= -(-sum(lengths) // 8192) + 1
    saved = json.loads((tmp_path / "bench_packing.json").read_text())
    assert saved["config"]["length_source"] == "launch.bench.layers.DEFAULT_LENGTHS"
    hb = saved["host_build"]  # the packer's host time on the first steps' lengths
    assert hb["steps"] == 4 and hb["ms_per_step"] > hb["ms_to_first"] > 0 and hb["microbatches"] >= 2
    assert hb["tokens_per_step"] == pytest.approx(sum(sum(s) for s in bp.sample_steps(4, 64, seed=1)) / 4)
    assert hb["tokens_per_s"] == pytest.approx(hb["tokens_per_step"] / (hb["ms_per_step"] / 1e3))


def test_cli_names_the_result_files(tmp_path, capsys):
    """Every ``mgrpo bench KIND`` ends by naming what it wrote under ``--out`` (here through
    ``python -m launch.bench.packing``; ``mgrpo bench`` wraps the kinds the same way)."""
    assert bp.main(["--steps", "1", "--samples", "8", "--dp", "1", "--out", str(tmp_path / "o")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"[bench packing] results in {tmp_path / 'o'}/: bench_packing.json, bench_packing.png" or \
        last == f"[bench packing] results in {tmp_path / 'o'}/: bench_packing.json", last  # without matplotlib


@pytest.mark.parametrize("argv, message", [
    (["--dp", "abc"], "argument --dp: expected comma-separated positive integers, got 'abc'"),
    (["--dp", "0"], "argument --dp: expected comma-separated positive integers, got '0'"),
    (["--dp", ","], "argument --dp: expected comma-separated positive integers, got ','"),
    (["--batch-sizes", "4,x"], "argument --batch-sizes: expected comma-separated positive integers, got '4,x'"),
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["--samples", "-3"], "argument --samples: expected a positive integer, got '-3'"),
    (["--budget", "0"], "argument --budget: expected a positive integer, got '0'"),
    (["--pad-multiple", "0"], "argument --pad-multiple: expected a positive integer, got '0'"),
])
def test_cli_rejects_bad_sizes_naming_the_flag(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bp.main(["--out", str(tmp_path / "o"), *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"mgrpo bench packing: error: {message}"
    assert not (tmp_path / "o").exists()
