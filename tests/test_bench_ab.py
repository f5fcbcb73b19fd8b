"""bench/triton/ab_prepare.sh and ab_trees.sh: a commit's tree as bench_full.py needs it, and the
trees timed in turn, here with a stand-in bench_full.py whose numbers are set by hand."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "bench" / "triton"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and the repository's history")

# a stand-in for bench_full.py: its tree's GPU ms (the file MS beside it) at each --ctx
FAKE_BENCH = """import argparse, json, os
ap = argparse.ArgumentParser()
for a in ("--out", "--ctx", "--prefill", "--prefill-table", "--layers", "--set"):
    ap.add_argument(a)
a = ap.parse_args()
ms = float(open(os.path.join(os.path.dirname(__file__), "MS")).read())
if a.set == "fail":
    raise SystemExit(1)
os.makedirs(a.out, exist_ok=True)
rows = [dict(ctx=int(c), gpu_ms_per_step=ms + int(c) / 1e6, greedy_tokens_per_s=1000 / ms) for c in a.ctx.split(",")]
json.dump(dict(decode=rows, layers=a.layers), open(os.path.join(a.out, "results.json"), "w"))
"""


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def _env(**kw: str) -> dict:
    return {**os.environ, **kw}


def test_prepare_copies_the_commits_tree(tmp_path):
    sha = _git("rev-parse", "--short", "HEAD").decode().strip()
    out = subprocess.run(["bash", str(SCRIPTS / "ab_prepare.sh"), "HEAD"], env=_env(AB_DIR=str(tmp_path)),
                         capture_output=True, text=True, check=True).stdout
    tree = tmp_path / sha
    assert out.startswith(f"{tmp_path}/{sha} (")
    for path in ("ds4/__init__.py", "bench/triton/bench_full.py", "pyproject.toml"):
        assert (tree / path).read_bytes() == _git("show", f"HEAD:{path}")
    assert not (tree / "tests").exists() and not (tree / "bench/triton/results_h200").exists()
    assert [p.name for p in tmp_path.iterdir()] == [sha]  # (no temporary folder left)


def test_prepare_refuses_an_unknown_commit(tmp_path):
    r = subprocess.run(["bash", str(SCRIPTS / "ab_prepare.sh"), "no-such-rev"], env=_env(AB_DIR=str(tmp_path)),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no commit no-such-rev" in r.stderr
    assert not any(tmp_path.iterdir())


def _tree(root: Path, ms: float) -> None:
    (root / "bench" / "triton").mkdir(parents=True)
    (root / "bench" / "triton" / "bench_full.py").write_text(FAKE_BENCH)
    (root / "bench" / "triton" / "MS").write_text(str(ms))


def test_trees_alternate_and_land_in_one_csv(tmp_path):
    work = tmp_path / "work"
    _tree(work, 4.9)
    _tree(work / "ab" / "abc1234", 5.0)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPTS / "ab_trees.sh")], cwd=work, capture_output=True, text=True, check=True,
                       env=_env(OUT=str(out), CTX="4096,131072", ROUNDS="2", LAYERS="30"))
    rows = list(csv.DictReader(open(out / "ab.csv")))
    assert r.stdout.splitlines()[0] == "device,round,tree,ctx,gpu_ms,greedy_tokens_per_s"
    assert [(x["round"], x["tree"], x["ctx"], x["gpu_ms"]) for x in rows] == [
        ("1", ".", "4096", "4.904"), ("1", ".", "131072", "5.031"),
        ("1", "ab/abc1234", "4096", "5.004"), ("1", "ab/abc1234", "131072", "5.131"),
        ("2", ".", "4096", "4.904"), ("2", ".", "131072", "5.031"),
        ("2", "ab/abc1234", "4096", "5.004"), ("2", "ab/abc1234", "131072", "5.131")]
    assert {x["greedy_tokens_per_s"] for x in rows if x["tree"] == "."} == {"204.1"}
    assert sorted(p.name for p in out.iterdir()) == ["ab.csv", "device.txt", "runs.tgz"]


def test_a_failed_tree_gives_no_rows(tmp_path):
    work = tmp_path / "work"
    _tree(work, 4.9)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPTS / "ab_trees.sh")], cwd=work, capture_output=True, text=True,
                       env=_env(OUT=str(out), ROUNDS="1", ARGS="--set fail"))
    assert r.returncode == 0 and ".: bench_full.py failed (round 1)" in r.stderr
    assert open(out / "ab.csv").read().splitlines() == ["device,round,tree,ctx,gpu_ms,greedy_tokens_per_s"]
